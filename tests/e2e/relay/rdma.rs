//! The cross-node relay over real verbs: the Soft-RoCE two-guest rig (see
//! `docs/rdma.md`, "Test rig"), each guest a flowlane node whose `flowlaned`
//! runs `--lane-transport rdma` on `rxe0`. Pods are network namespaces wired
//! by the real plugin in each guest; programs run unmodified with the
//! preload library (`pod-exec.sh --lane`).
//!
//! Figures are printed, never asserted:
//! `cargo test --release -p flowlane-e2e --test e2e -- relay::rdma:: --nocapture`.

use std::time::Duration;

use flowlane_cluster::rdma_rig::{self, perftest, shell_quote, RdmaRig};
use flowlane_e2e::shm_scripts::{ECHO_CLIENT, ECHO_SERVER, PEER_KILL};
use serde_json::Value;

const T: Duration = Duration::from_secs(180);

fn relay_nodes_up(rig: &RdmaRig) {
    rig.nodes_up_with_rdma_lane(&["--log-level", "info,flowlaned=debug"])
        .unwrap_or_else(|e| panic!("flowlaned with the RDMA lane on both guests: {e:#}"));
}

/// (opened, closed, bytes) of node `n`'s RDMA relay lane.
fn rdma_lane(rig: &RdmaRig, node: u8) -> (u64, u64, u64) {
    rig.daemon_stats(node)
        .expect("flowlaned answers")
        .lanes
        .get("rdma")
        .map(|l| (l.connections_opened, l.connections_closed, l.bytes))
        .unwrap_or_default()
}

fn logs(rig: &RdmaRig) -> String {
    format!(
        "--- node1 flowlaned.log ---\n{}\n--- node2 flowlaned.log ---\n{}",
        rig.node_log(1, "flowlaned.log"),
        rig.node_log(2, "flowlaned.log")
    )
}

fn wait_listening(rig: &RdmaRig, node: u8, pod: &str, port: u16) {
    rig.run_ok(
        node,
        &format!(
            "for _ in $(seq 1 300); do ip netns exec {pod} ss -Hltn 'sport = :{port}' | grep -q . && exit 0; sleep 0.1; done; exit 1"
        ),
        T,
    );
}

/// One short echo from pod `cli` (node 1) to pod `srv` (node 2), so that
/// the daemons' RDMA link is up before connections are counted.
fn warm_up(rig: &RdmaRig, cli: &str, srv: &str, srv_ip: std::net::Ipv4Addr) {
    let server = rig
        .spawn(
            2,
            &format!(
                "pod-exec.sh --lane {srv} python3 -c {} 7600 1",
                shell_quote(ECHO_SERVER)
            ),
            T,
        )
        .expect("warm-up echo server");
    wait_listening(rig, 2, srv, 7600);
    let out = rig
        .run(
            1,
            &format!(
                "pod-exec.sh --lane {cli} python3 -c {} {srv_ip} 7600 10000 1",
                shell_quote(ECHO_CLIENT)
            ),
            T,
        )
        .expect("warm-up echo client");
    assert!(
        out.stdout.starts_with("ok 10000"),
        "warm-up: {}{}",
        out.stdout,
        out.stderr
    );
    let _ = server.wait();
}

/// Checksummed echo (random sizes, both directions at once, half-close)
/// and iperf3 from a pod on node 1 to a pod on node 2, carried over RDMA
/// between the daemons; both daemons count the connections on lane "rdma".
#[test]
fn relay_over_rdma_carries_a_checksummed_echo_and_iperf3() {
    let _turn = crate::turn::take(module_path!());
    let Some(rig) = rdma_rig::shared() else {
        return;
    };
    let rig = rig.lock();
    relay_nodes_up(&rig);
    rig.add_pod(1, "rrcli").expect("client pod on node1");
    let srv_ip = rig.add_pod(2, "rrsrv").expect("server pod on node2");

    // The first connection to a peer daemon sets the RDMA link up (queue
    // pairs: seconds under TCG), longer than a pod waits for its daemon's
    // answer (500 ms): that connection stays on TCP, correctly. Warm the
    // lane up first, then count.
    warm_up(&rig, "rrcli", "rrsrv", srv_ip);
    let before = rdma_lane(&rig, 1).0;
    let before2 = rdma_lane(&rig, 2).0;

    // Checksummed echo, 3 connections.
    let conns = 3;
    let server = rig
        .spawn(
            2,
            &format!(
                "pod-exec.sh --lane rrsrv python3 -c {} 7601 {conns}",
                shell_quote(ECHO_SERVER)
            ),
            T,
        )
        .expect("echo server");
    wait_listening(&rig, 2, "rrsrv", 7601);
    let bytes = 4_000_000u64;
    for seed in 0..conns {
        let out = rig.run(
            1,
            &format!(
                "pod-exec.sh --lane rrcli python3 -c {} {srv_ip} 7601 {bytes} {}",
                shell_quote(ECHO_CLIENT),
                seed + 3
            ),
            T,
        );
        let out = out.expect("echo client ran");
        assert!(
            out.success() && out.stdout.starts_with(&format!("ok {bytes}")),
            "echo over the RDMA relay: {}{}\n{}",
            out.stdout,
            out.stderr,
            logs(&rig)
        );
    }
    let _ = server.wait();
    let (opened, _, moved) = rdma_lane(&rig, 1);
    assert_eq!(opened - before, conns, "node1 RDMA lane\n{}", logs(&rig));
    assert!(moved >= conns * 2 * bytes, "node1 moved {moved} bytes");
    assert_eq!(rdma_lane(&rig, 2).0 - before2, conns, "node2 RDMA lane");
    // Zero copy: both daemons placed (RDMA WRITE from the pod's sending ring
    // into the remote pod's receiving ring) instead of copying.
    for n in [1u8, 2] {
        let log = rig.node_log(n, "flowlaned.log");
        assert!(
            log.lines()
                .any(|l| l.contains("zero-copy modes") && l.contains("out=Some(")),
            "node{n} did not place bytes without copies\n{}",
            logs(&rig)
        );
    }

    // iperf3: plain TCP between the same pods, then through the relay.
    let mut figures = Vec::new();
    for (label, lane) in [
        ("tcp", ""),
        ("rdma relay", "--lane "),
        ("rdma relay -R", "--lane "),
    ] {
        let srv = rig
            .spawn(
                2,
                &format!("pod-exec.sh {lane}rrsrv iperf3 -s -1 -p 7602"),
                T,
            )
            .expect("iperf3 server");
        wait_listening(&rig, 2, "rrsrv", 7602);
        let rev = if label.ends_with("-R") { " -R" } else { "" };
        let out = rig.run_ok(
            1,
            &format!("pod-exec.sh {lane}rrcli iperf3 -c {srv_ip} -p 7602 -t 3 -J{rev}"),
            T,
        );
        let _ = srv.wait();
        let v: Value = serde_json::from_str(&out.stdout).expect("iperf3 -J");
        let bps = v["end"]["sum_received"]["bits_per_second"]
            .as_f64()
            .expect("bits per second");
        assert!(bps > 0.0, "{}", out.stdout);
        figures.push((label, bps / 1e6));
    }
    for (label, mbps) in &figures {
        eprintln!("iperf3 over the rig, {label}: {mbps:.1} Mbit/s");
    }
    eprintln!(
        "rdma relay / tcp: {:.2}x (Soft-RoCE under TCG: ratios only)",
        figures[1].1 / figures[0].1
    );
    // The raw verbs baseline on the same pair, in the same run.
    match perftest::ib_write_bw(&rig, 65536, 3) {
        Ok(bw) => eprintln!(
            "ib_write_bw 64 KiB: {:.1} Mbit/s; iperf3 through the rdma relay / ib_write_bw: {:.2}x",
            bw.avg_gbit_s * 1e3,
            figures[1].1 / (bw.avg_gbit_s * 1e3)
        ),
        Err(e) => eprintln!("ib_write_bw: {e:#}"),
    }
    // One-way latency: sockperf ping-pong (TCP between the pods, then
    // through the relay) against ib_send_lat.
    let mut lat = Vec::new();
    for (label, lane) in [("tcp", ""), ("rdma relay", "--lane ")] {
        // The server runs in the background of a job that records its pid
        // (pod-exec.sh and ip netns exec exec in place) and waits for it.
        let pidfile = format!("/tmp/rr-sockperf-{}.pid", lat.len());
        let srv = rig
            .spawn(
                2,
                &format!(
                    "pod-exec.sh {lane}rrsrv sockperf server --tcp -i {srv_ip} -p 7603 & echo $! > {pidfile}; wait"
                ),
                T,
            )
            .expect("sockperf server");
        wait_listening(&rig, 2, "rrsrv", 7603);
        let out = rig.run(
            1,
            &format!(
                "pod-exec.sh {lane}rrcli sockperf ping-pong --tcp -i {srv_ip} -p 7603 -t 3 -m 64 --mps 1000"
            ),
            T,
        );
        rig.run_ok(2, &format!("kill $(cat {pidfile})"), T);
        let _ = srv.wait();
        let p50 = out.ok().and_then(|o| {
            o.stdout
                .lines()
                .find(|l| l.contains("percentile 50.000"))
                .and_then(|l| l.split('=').nth(1))
                .and_then(|x| x.trim().parse::<f64>().ok())
        });
        lat.push((label, p50));
    }
    let send_lat = perftest::ib_send_lat(&rig, 64, 500).ok();
    eprintln!(
        "one-way p50 64 B: sockperf tcp {:?} us, sockperf rdma relay {:?} us, ib_send_lat typical {:?} us",
        lat[0].1,
        lat[1].1,
        send_lat.map(|l| l.typical_us)
    );
    assert!(
        rdma_lane(&rig, 1).0 >= before + conns + 4,
        "iperf3 did not use the RDMA relay\n{}",
        logs(&rig)
    );
    // The same pods and iperf3 through the relay's copying data path (the
    // fallback: FLOWLANE_RELAY_ZERO_COPY=0), same run: the zero-copy gain.
    relay_nodes_up_copying(&rig);
    warm_up(&rig, "rrcli", "rrsrv", srv_ip);
    let mut copying = Vec::new();
    for rev in ["", " -R"] {
        let srv = rig
            .spawn(2, "pod-exec.sh --lane rrsrv iperf3 -s -1 -p 7604", T)
            .expect("iperf3 server");
        wait_listening(&rig, 2, "rrsrv", 7604);
        let out = rig.run_ok(
            1,
            &format!("pod-exec.sh --lane rrcli iperf3 -c {srv_ip} -p 7604 -t 3 -J{rev}"),
            T,
        );
        let _ = srv.wait();
        let v: Value = serde_json::from_str(&out.stdout).expect("iperf3 -J");
        copying.push(
            v["end"]["sum_received"]["bits_per_second"]
                .as_f64()
                .unwrap_or(0.0)
                / 1e6,
        );
    }
    eprintln!(
        "iperf3 over the rig, rdma relay copying: {:.1} Mbit/s, -R {:.1} Mbit/s; zero copy / copying: {:.2}x, -R {:.2}x",
        copying[0],
        copying[1],
        figures[1].1 / copying[0],
        figures[2].1 / copying[1]
    );
    let _ = rig.del_pod(1, "rrcli");
    let _ = rig.del_pod(2, "rrsrv");
}

/// Both daemons restarted with the relay's copying data path.
fn relay_nodes_up_copying(rig: &RdmaRig) {
    let args = "--lane-listen $RIG_ADDR:7471 --lane-transport rdma --nodes-file /etc/flowlane/nodes.json --node-name node$RIG_NODE --lane-key-file /etc/flowlane/lane.key --log-level info,flowlaned=debug";
    let jobs: Vec<_> = [1u8, 2]
        .iter()
        .map(|&n| {
            rig.spawn(
                n,
                &format!("FLOWLANE_RELAY_ZERO_COPY=0 FLOWLANED_ARGS='{args}' node-up.sh"),
                T,
            )
            .expect("node-up.sh")
        })
        .collect();
    for j in jobs {
        let out = j.wait().expect("node-up.sh ran");
        assert!(out.success(), "node-up.sh: {}{}", out.stdout, out.stderr);
    }
}

/// The project's ring all-reduce (2 ranks, one pod per node; every sum is
/// checked by the workers) over the RDMA relay.
#[test]
fn ring_allreduce_across_nodes_over_the_rdma_relay() {
    let _turn = crate::turn::take(module_path!());
    let Some(rig) = rdma_rig::shared() else {
        return;
    };
    let rig = rig.lock();
    relay_nodes_up(&rig);
    let ip1 = rig.add_pod(1, "rrar0").expect("rank 0 pod on node1");
    let ip2 = rig.add_pod(2, "rrar1").expect("rank 1 pod on node2");
    warm_up(&rig, "rrar0", "rrar1", ip2);
    let before = rdma_lane(&rig, 1).0;
    let worker = |rank: u32, me: std::net::Ipv4Addr, next: std::net::Ipv4Addr, pod: &str| {
        format!(
            "pod-exec.sh --lane {pod} $FLOWLANE_BIN_DIR/flowlane-train allreduce-worker \
             --listen {me}:7621 --next {next}:7621 --rank {rank} --workers 2 \
             --elements 262144 --steps 5 --warmup 1 --start-delay-ms 2000"
        )
    };
    let r1 = rig
        .spawn(2, &worker(1, ip2, ip1, "rrar1"), T)
        .expect("rank 1");
    let r0 = rig
        .run(1, &worker(0, ip1, ip2, "rrar0"), T)
        .expect("rank 0 ran");
    let r1 = r1.wait().expect("rank 1 ran");
    for r in [&r0, &r1] {
        assert!(
            r.success() && r.stdout.contains("allreduce-worker"),
            "all-reduce rank on node{}: {}{}\n{}",
            r.node,
            r.stdout,
            r.stderr,
            logs(&rig)
        );
    }
    let v: Value = serde_json::from_str(r0.stdout.trim().lines().last().unwrap()).unwrap();
    eprintln!(
        "ring all-reduce over the RDMA relay: {} B tensor, {} steps in {:.2} s",
        v["tensor_bytes"], v["steps"], v["wall_s"]
    );
    assert!(
        rdma_lane(&rig, 1).0 >= before + 2,
        "the ring's connections did not use the RDMA relay\n{}",
        logs(&rig)
    );
    let _ = rig.del_pod(1, "rrar0");
    let _ = rig.del_pod(2, "rrar1");
}

/// The server node's daemon killed mid-stream over the RDMA relay: both
/// pods see their connection reset (`ECONNRESET`, or `EPIPE` on the
/// client's write), neither hangs, neither sees a clean end-of-stream.
#[test]
fn daemon_killed_mid_stream_over_rdma_ends_the_connection_for_both_pods() {
    let _turn = crate::turn::take(module_path!());
    let Some(rig) = rdma_rig::shared() else {
        return;
    };
    let rig = rig.lock();
    relay_nodes_up(&rig);
    rig.add_pod(1, "rrkcli").expect("client pod on node1");
    let srv_ip = rig.add_pod(2, "rrksrv").expect("server pod on node2");
    warm_up(&rig, "rrkcli", "rrksrv", srv_ip);
    let before = rdma_lane(&rig, 1).0;
    let quoted = shell_quote(PEER_KILL);
    let server = rig
        .spawn(
            2,
            &format!("pod-exec.sh --lane rrksrv python3 -c {quoted} server 7631"),
            Duration::from_secs(120),
        )
        .expect("server");
    wait_listening(&rig, 2, "rrksrv", 7631);
    let client = rig
        .spawn(
            1,
            &format!("pod-exec.sh --lane rrkcli python3 -c {quoted} client {srv_ip} 7631"),
            Duration::from_secs(120),
        )
        .expect("client");
    // Bytes flow through the relay before the kill.
    let t0 = std::time::Instant::now();
    while rdma_lane(&rig, 1).0 <= before {
        assert!(t0.elapsed() < Duration::from_secs(60), "{}", logs(&rig));
        std::thread::sleep(Duration::from_millis(500));
    }
    std::thread::sleep(Duration::from_secs(2));
    rig.run_ok(2, "kill -9 $(cat /run/flowlane/flowlaned.pid)", T);
    let killed = std::time::Instant::now();
    let c = client.wait().expect("client job");
    let s = server.wait().expect("server job");
    eprintln!(
        "daemon killed over RDMA: client {:?} / server {:?} after {:.1?}",
        c.stdout.lines().last(),
        s.stdout.lines().last(),
        killed.elapsed()
    );
    assert!(
        c.stdout.contains("ended"),
        "the client hung or failed (exit {}): {}{}\n{}",
        c.status,
        c.stdout,
        c.stderr,
        logs(&rig)
    );
    assert!(
        s.stdout.contains("ended"),
        "the server hung or failed (exit {}): {}{}\n{}",
        s.status,
        s.stdout,
        s.stderr,
        logs(&rig)
    );
    // The client's daemon is alive and resets its pod's socket. The
    // server's own daemon is dead: its pod learns of the failure from the
    // RST the client's node sends (docs/relay.md, "Failures").
    assert!(
        c.stdout.contains("ended ConnectionResetError ")
            || c.stdout.contains("ended BrokenPipeError "),
        "the client saw no reset: {}\n{}",
        c.stdout,
        logs(&rig)
    );
    assert!(
        s.stdout.contains("ended ConnectionResetError "),
        "the server saw no reset: {}\n{}",
        s.stdout,
        logs(&rig)
    );
    // Node 1's daemon counts the broken RDMA link (metrics:
    // flowlane_rdma_errors_total{kind="link_failed"}).
    let t0 = std::time::Instant::now();
    loop {
        let errors = rig.daemon_stats(1).expect("flowlaned answers").lane_errors;
        let failed = errors
            .get("rdma")
            .and_then(|e| e.get("link_failed"))
            .copied()
            .unwrap_or(0);
        if failed >= 1 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "node1 did not count the failed RDMA link: {errors:?}\n{}",
            logs(&rig)
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    // Restart the killed daemon for the other tests.
    relay_nodes_up(&rig);
    let _ = rig.del_pod(1, "rrkcli");
    let _ = rig.del_pod(2, "rrksrv");
}
