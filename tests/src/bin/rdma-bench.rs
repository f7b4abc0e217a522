//! rdma-bench: the RDMA lane's transport (`RdmaTransport`) against perftest
//! and plain TCP, in the same run on the same Soft-RoCE pair (the two QEMU
//! guests of deploy/local/rdma-rig).
//!
//!   cargo build --release --workspace
//!   target/release/rdma-bench [--rounds N]        (root; boots the rig, ~3-5 min)
//!
//! Prints, per round and as medians: `ib_write_bw` (64 KiB, node1 → node2),
//! the lane's stream throughput with 64 KiB and 1 MiB sends (one stream,
//! `rdma-lane-bench bench`), the zero-copy path (`bench --direct`: placements
//! from a registered 1 MiB ring into the peer's, 64 and 256 KiB), TCP
//! between the two guests (64 KiB writes),
//! `ib_send_lat` and the lane's ping-pong (2 bytes), with the ratios. Under
//! emulation absolute figures are low (the guests' CPUs are emulated by
//! TCG and rxe does all transport work in software): compare ratios only.

use anyhow::{bail, Context, Result};
use flowlane_cluster::rdma_rig::{perftest, underlay_addr, RdmaRig, RigConfig};
use serde_json::Value;
use std::time::Duration;

const PORT: u16 = 7490;
const TCP_PORT: u16 = 7491;
const TOTAL: u64 = 24 << 20;

fn tagged(out: &str, tag: &str) -> Result<Value> {
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix(&format!("@@{tag} ")))
        .with_context(|| format!("no @@{tag} in: {out}"))?;
    Ok(serde_json::from_str(line)?)
}

fn run(rig: &RdmaRig, node: u8, script: &str, secs: u64) -> Result<String> {
    let out = rig.run(node, script, Duration::from_secs(secs))?;
    if !out.success() {
        bail!(
            "node{node}: `{script}` exit {}:\n{}\n{}",
            out.status,
            out.stdout,
            out.stderr
        );
    }
    Ok(out.stdout)
}

fn lane(rig: &RdmaRig, args: &str, tag: &str, secs: u64) -> Result<Value> {
    let out = run(
        rig,
        1,
        &format!("$FLOWLANE_BIN_DIR/rdma-lane-bench {args} --device rxe0 --gid-index 1"),
        secs,
    )?;
    tagged(&out, tag)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn mb(bps: f64) -> String {
    format!("{:.2} MB/s", bps / 1e6)
}

fn main() -> Result<()> {
    let rounds: usize = std::env::args()
        .skip_while(|a| a != "--rounds")
        .nth(1)
        .map(|v| v.parse().expect("--rounds N"))
        .unwrap_or(3);
    let rig = RdmaRig::boot(&RigConfig::default())?;
    eprintln!("rig booted in {:.1?}", rig.boot_time());
    let peer = underlay_addr(2);
    run(
        &rig,
        2,
        &format!(
            "B=$FLOWLANE_BIN_DIR/rdma-lane-bench
setsid $B serve --device rxe0 --gid-index 1 --listen {peer}:{PORT} > /tmp/lane-serve.log 2>&1 < /dev/null &
setsid $B tcp-serve --listen {peer}:{TCP_PORT} > /tmp/tcp-serve.log 2>&1 < /dev/null &
for i in $(seq 100); do grep -q @@READY /tmp/lane-serve.log && grep -q @@READY /tmp/tcp-serve.log && exit 0; sleep 0.1; done
cat /tmp/lane-serve.log /tmp/tcp-serve.log; exit 1"
        ),
        60,
    )?;
    let (mut wbw, mut l64, mut l1m, mut tcp, mut slat, mut llat) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    let (mut d64, mut d256) = (vec![], vec![]);
    for round in 1..=rounds {
        // Alternate the order so slow drifts of the host's load hit all.
        let w = perftest::ib_write_bw(&rig, 65536, 4)?.avg_bytes_per_sec();
        let a = lane(
            &rig,
            &format!("bench --peer {peer}:{PORT} --size 65536 --total {TOTAL}"),
            "BENCH",
            300,
        )?;
        let b = lane(
            &rig,
            &format!("bench --peer {peer}:{PORT} --size 1048576 --total {TOTAL}"),
            "BENCH",
            300,
        )?;
        // Zero copy: placements from a registered 1 MiB ring into the
        // peer's registered 1 MiB ring (the relay's pod-ring data path).
        let c = lane(
            &rig,
            &format!("bench --direct --peer {peer}:{PORT} --size 65536 --total {TOTAL}"),
            "BENCH",
            300,
        )?;
        let e = lane(
            &rig,
            &format!("bench --direct --peer {peer}:{PORT} --size 262144 --total {TOTAL}"),
            "BENCH",
            300,
        )?;
        let t = tagged(
            &run(
                &rig,
                1,
                &format!("$FLOWLANE_BIN_DIR/rdma-lane-bench tcp-bench --peer {peer}:{TCP_PORT} --size 65536 --total {TOTAL}"),
                300,
            )?,
            "BENCH",
        )?;
        let s = perftest::ib_send_lat(&rig, 2, 1000)?;
        let l = lane(
            &rig,
            &format!("lat --peer {peer}:{PORT} --size 2 --iters 1000"),
            "LAT",
            300,
        )?;
        let f = |v: &Value| v["bytes_per_sec"].as_f64().unwrap_or(0.0);
        println!(
            "round {round}: ib_write_bw {} | lane 64K {} | lane 1M {} | zero-copy 64K {} | zero-copy 256K {} | tcp {} | ib_send_lat typ {:.1} us | lane rtt p50 {:.1} us",
            mb(w), mb(f(&a)), mb(f(&b)), mb(f(&c)), mb(f(&e)), mb(f(&t)), s.typical_us, l["p50_us"].as_f64().unwrap_or(0.0)
        );
        d64.push(f(&c));
        d256.push(f(&e));
        wbw.push(w);
        l64.push(f(&a));
        l1m.push(f(&b));
        tcp.push(f(&t));
        slat.push(s.typical_us);
        llat.push(l["p50_us"].as_f64().unwrap_or(0.0));
    }
    // Ratios per round first (both figures of a ratio come from the same
    // minute of host load), then their medians.
    let ratio = |x: &[f64], y: &[f64]| median(x.iter().zip(y).map(|(a, b)| a / b).collect());
    let (r64, r1m, rtcp) = (ratio(&l64, &wbw), ratio(&l1m, &wbw), ratio(&l64, &tcp));
    let (rd64, rd256) = (ratio(&d64, &wbw), ratio(&d256, &wbw));
    let (dm64, dm256) = (median(d64), median(d256));
    let rlat = ratio(&llat, &slat.iter().map(|s| 2.0 * s).collect::<Vec<_>>());
    let (w, a, b, t) = (median(wbw), median(l64), median(l1m), median(tcp));
    let (s, l) = (median(slat), median(llat));
    println!("\nRDMA lane transport vs perftest vs TCP, Soft-RoCE, {rounds} rounds");
    println!("(figures: medians; ratios: medians of the per-round ratios)");
    println!("| figure | value | ratio |");
    println!("|---|---|---|");
    println!("| ib_write_bw, 64 KiB | {} | 1.00 |", mb(w));
    println!(
        "| lane stream, 64 KiB sends | {} | {r64:.2} of ib_write_bw |",
        mb(a)
    );
    println!(
        "| lane stream, 1 MiB sends | {} | {r1m:.2} of ib_write_bw |",
        mb(b)
    );
    println!(
        "| lane zero copy, ring to ring, 64 KiB placements | {} | {rd64:.2} of ib_write_bw |",
        mb(dm64)
    );
    println!(
        "| lane zero copy, ring to ring, 256 KiB placements | {} | {rd256:.2} of ib_write_bw |",
        mb(dm256)
    );
    println!(
        "| TCP guest to guest, 64 KiB writes | {} | lane 64K = {rtcp:.2}x TCP |",
        mb(t)
    );
    println!("| ib_send_lat 2 B, typical (one-way) | {s:.1} us | |");
    println!("| lane ping-pong 2 B, p50 round trip | {l:.1} us | {rlat:.2}x of 2 x ib_send_lat |");
    let _ = run(&rig, 2, "cat /tmp/lane-serve.log", 30);
    Ok(())
}
