//! `RdmaTransport` (flowlane_rdma::transport) on real verbs: Soft-RoCE in
//! the two QEMU guests of the rig (deploy/local/rdma-rig), driven through
//! `rdma-lane-bench` (rdma/src/bin), which the guests run from this test's
//! own target directory.
//!
//! - many concurrent streams, random message sizes, both directions, every
//!   byte compared with the sender's generator and CRC-32 per message;
//! - the peer daemon's process killed mid-stream: the other side sees
//!   ConnectionReset (or EOF) promptly, not a hang, and a restarted peer is
//!   reachable again (the link is re-established).
//!
//! `cargo build --release -p flowlane-rdma --bin rdma-lane-bench` (CI builds
//! the workspace first), then
//! `cargo test --release -p flowlane-e2e --test e2e -- rdma::transport:: --nocapture`

use flowlane_cluster::rdma_rig::{self, underlay_addr, RdmaRig};
use serde_json::Value;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);
const PORT: u16 = 7480;

fn bench() -> &'static str {
    "$FLOWLANE_BIN_DIR/rdma-lane-bench"
}

/// Starts `rdma-lane-bench serve` on `node` (in the background, pid in
/// /tmp/lane-serve.pid) and waits until it listens.
fn start_server(rig: &RdmaRig, node: u8, extra: &str) {
    let bin = rig.bin_dir().join("rdma-lane-bench");
    assert!(
        bin.exists(),
        "{} is missing: build it first (cargo build --release -p flowlane-rdma --bin rdma-lane-bench, \
         or the whole workspace as CI does)",
        bin.display()
    );
    let addr = underlay_addr(node);
    let script = format!(
        "B={b}; [ -f /tmp/lane-serve.pid ] && kill $(cat /tmp/lane-serve.pid) 2>/dev/null; \
         setsid $B serve --device rxe0 --gid-index 1 --listen {addr}:{PORT} {extra} \
           > /tmp/lane-serve.log 2>&1 < /dev/null & echo $! > /tmp/lane-serve.pid; \
         for i in $(seq 100); do grep -q @@READY /tmp/lane-serve.log && exit 0; sleep 0.1; done; \
         cat /tmp/lane-serve.log; exit 1",
        b = bench()
    );
    rig.run_ok(node, &script, T);
}

fn stop_server(rig: &RdmaRig, node: u8) -> String {
    rig.run_ok(
        node,
        "kill $(cat /tmp/lane-serve.pid) 2>/dev/null; rm -f /tmp/lane-serve.pid; cat /tmp/lane-serve.log",
        T,
    )
    .stdout
}

/// Both guests' Soft-RoCE counters (retries, duplicates, send errors) and
/// their NIC queue's drops: what the fabric did when a transfer failed.
fn soft_roce_counters(rig: &RdmaRig) -> String {
    let mut out = String::new();
    for node in [1u8, 2] {
        let r = rig.run(
            node,
            "cd /sys/class/infiniband/rxe0/ports/1/hw_counters && grep -v ':0$' -H * | tr '\\n' ' '; \
             echo; tc -s qdisc show dev eth0 | grep -m1 dropped",
            T,
        );
        let text = r.map(|o| o.stdout).unwrap_or_else(|e| e.to_string());
        out.push_str(&format!("node{node} soft-roce: {text}\n"));
    }
    out
}

/// The JSON after `@@TAG ` in a job's output.
fn tagged(out: &str, tag: &str) -> Value {
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix(&format!("@@{tag} ")))
        .unwrap_or_else(|| panic!("no @@{tag} line in:\n{out}"));
    serde_json::from_str(line).unwrap_or_else(|e| panic!("@@{tag}: {e}: {line}"))
}

#[test]
fn checked_transfer_over_many_streams_in_both_directions() {
    let _turn = crate::turn::take(module_path!());
    let Some(rig) = rdma_rig::shared() else {
        return;
    };
    let rig = rig.lock();
    start_server(&rig, 2, "--checksums");
    let out = rig.run(
        1,
        &format!(
            "{} check --device rxe0 --gid-index 1 --peer {}:{PORT} --streams 16 --checksums",
            bench(),
            underlay_addr(2)
        ),
        Duration::from_secs(400),
    );
    let server_log = stop_server(&rig, 2);
    let out = out.expect("job ran");
    assert!(
        out.success(),
        "check failed (exit {}):\n{}\n{}\nserver: {server_log}\n{}",
        out.status,
        out.stdout,
        out.stderr,
        soft_roce_counters(&rig)
    );
    let r = tagged(&out.stdout, "CHECK");
    eprintln!("checked transfer: {r}\n{}", soft_roce_counters(&rig));
    assert_eq!(r["ok"], true);
    // Every stream's bytes in both directions, as rdma-lane-bench's
    // check_spec defines them (1.5 MB + i*12345 up, 0.7 MB + i*777 down).
    let up: u64 = (0..16).map(|i| 1_500_000 + i * 12_345).sum();
    let down: u64 = (0..16).map(|i| 700_000 + i * 777).sum();
    assert_eq!(r["sent"], up);
    assert_eq!(r["received"], down);
    // RdmaOptions::default().links_per_peer queue pairs carry the 16 streams.
    assert_eq!(r["stats"]["links_up"], 2, "16 streams over two links");
    assert_eq!(r["stats"]["bytes_sent"], up);
    assert_eq!(r["stats"]["bytes_received"], down);
    assert!(
        !server_log.contains("stream "),
        "server-side stream errors: {server_log}"
    );
}

#[test]
fn killing_the_peer_process_resets_its_streams_and_a_restarted_peer_is_reachable() {
    let _turn = crate::turn::take(module_path!());
    let Some(rig) = rdma_rig::shared() else {
        return;
    };
    let rig = rig.lock();
    start_server(&rig, 2, "");
    let peer = underlay_addr(2);
    let waiter = rig
        .spawn(
            1,
            &format!(
                "{} wait-reset --device rxe0 --gid-index 1 --peer {peer}:{PORT}",
                bench()
            ),
            Duration::from_secs(120),
        )
        .expect("spawn wait-reset");
    // Kill the server once the stream is open (rdma-lane-bench logs each
    // accepted stream) and has carried bytes.
    rig.run_ok(
        2,
        "for i in $(seq 600); do grep -q '@@ACCEPTED.* op 3' /tmp/lane-serve.log && break; sleep 0.1; done; \
         grep -q '@@ACCEPTED.* op 3' /tmp/lane-serve.log || { cat /tmp/lane-serve.log; exit 1; }; \
         sleep 0.5; kill -9 $(cat /tmp/lane-serve.pid); rm -f /tmp/lane-serve.pid",
        Duration::from_secs(120),
    );
    let out = waiter.wait().expect("wait-reset job");
    let r = tagged(&out.stdout, "RESET");
    eprintln!("after the peer was killed: {r}");
    assert!(out.success(), "{}\n{}", out.stdout, out.stderr);
    assert_eq!(r["outcome"], "ConnectionReset", "{r}");
    // A new peer process: new opens work again over a new link.
    start_server(&rig, 2, "");
    let out = rig.run(
        1,
        &format!(
            "{} check --device rxe0 --gid-index 1 --peer {peer}:{PORT} --streams 2",
            bench()
        ),
        Duration::from_secs(200),
    );
    let log = stop_server(&rig, 2);
    let out = out.expect("job ran");
    assert!(
        out.success(),
        "{}\n{}\nserver: {log}",
        out.stdout,
        out.stderr
    );
    assert_eq!(tagged(&out.stdout, "CHECK")["ok"], true);
}
