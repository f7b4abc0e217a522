//! The cross-node relay over real verbs: the Soft-RoCE two-guest rig (see
//! `docs/rdma.md`, "Test rig"), each guest a flowlane node whose `flowlaned`
//! runs `--lane-transport rdma` on `rxe0`. Pods are network namespaces wired
//! by the real plugin in each guest; programs run unmodified with the
//! preload library (`pod-exec.sh --lane`).
//!
//! Figures are printed, never asserted:
//! `cargo test --release -p flowlane-e2e --test relay_rdma -- --nocapture`.

use std::time::Duration;

use flowlane_e2e::rdma_vm::{self, shell_quote, RdmaRig};
use flowlane_e2e::shm_scripts::{ECHO_CLIENT, ECHO_SERVER};
use serde_json::Value;

const T: Duration = Duration::from_secs(180);

fn relay_nodes_up(rig: &RdmaRig) {
    rig.nodes_up(&[
        "--lane-listen",
        "$RIG_ADDR:7471",
        "--lane-transport",
        "rdma",
        "--nodes-file",
        "/etc/flowlane/nodes.json",
        "--node-name",
        "node$RIG_NODE",
        "--log-level",
        "info,flowlaned=debug",
    ])
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

/// Checksummed echo (random sizes, both directions at once, half-close)
/// and iperf3 from a pod on node 1 to a pod on node 2, carried over RDMA
/// between the daemons; both daemons count the connections on lane "rdma".
#[test]
fn relay_over_rdma_carries_a_checksummed_echo_and_iperf3() {
    let Some(rig) = rdma_vm::shared() else { return };
    let rig = rig.lock();
    relay_nodes_up(&rig);
    rig.add_pod(1, "rrcli").expect("client pod on node1");
    let srv_ip = rig.add_pod(2, "rrsrv").expect("server pod on node2");

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
    assert_eq!(opened, conns, "node1 RDMA lane\n{}", logs(&rig));
    assert!(moved >= conns * 2 * bytes, "node1 moved {moved} bytes");
    assert_eq!(rdma_lane(&rig, 2).0, conns, "node2 RDMA lane");

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
    assert!(
        rdma_lane(&rig, 1).0 >= conns + 4,
        "iperf3 did not use the RDMA relay\n{}",
        logs(&rig)
    );
    let _ = rig.del_pod(1, "rrcli");
    let _ = rig.del_pod(2, "rrsrv");
}
