//! Unmodified third-party programs over the shared-memory lane: each run
//! checks the program's own success and the daemon's counters (the lane was
//! really used). Figures are printed, never asserted.

use flowlane_e2e::shm::{heavy, run_ok, wait_listening, Bg, Node};
use std::time::Duration;

const T: Duration = Duration::from_secs(180);

fn iperf3_json_gbps(out: &str) -> f64 {
    let v: serde_json::Value = serde_json::from_str(out).expect("iperf3 --json output");
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap_or(0.0)
        / 1e9
}

/// iperf3 both directions (-R) and with four parallel streams (-P 4).
#[test]
fn iperf3_over_shared_memory() {
    let _g = heavy();
    let node = Node::new("ipf", 2);
    let (client, server) = (&node.pods[0], &node.pods[1]);
    let _srv = Bg::spawn(node.cmd(server, true, &["iperf3", "-s", "-p", "5201"]));
    wait_listening(server, 5201);
    let ip = server.ip.to_string();
    let mut opened = node.shm_opened();
    for extra in [&[][..], &["-R"][..], &["-P", "4"][..]] {
        let mut argv = vec!["iperf3", "-c", &ip, "-p", "5201", "-t", "3", "--json"];
        argv.extend_from_slice(extra);
        let out = run_ok(node.cmd(client, true, &argv), T, "iperf3 client");
        let gbps = iperf3_json_gbps(&out);
        eprintln!("iperf3 {extra:?} over shm: {gbps:.1} Gbit/s");
        assert!(gbps > 0.0, "iperf3 moved nothing: {out}");
        let now = node.shm_opened();
        // Control connection + data streams all go over the lane.
        let streams = if extra.first() == Some(&"-P") { 4 } else { 1 };
        assert!(
            now - opened > streams,
            "iperf3 {extra:?}: only {} shm connections",
            now - opened
        );
        opened = now;
    }
}
