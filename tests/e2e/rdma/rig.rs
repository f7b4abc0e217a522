//! The Soft-RoCE rig on real verbs: two QEMU guests booting Debian's kernel,
//! each a flowlane node with `rdma_rxe` on its NIC (see `docs/rdma.md`, "Test
//! rig"). The rig boots once for this binary; the tests take turns on it.
//!
//! Figures (perftest, iperf3) are printed, never asserted:
//! `cargo test --release -p flowlane-e2e --test e2e -- rdma::rig:: --nocapture`.

use flowlane_cluster::rdma_rig::{self, perftest, pod_cidr, underlay_addr, RdmaRig, NODES};
use serde_json::Value;
use std::sync::OnceLock;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

/// Both nodes made flowlane nodes once per binary (flowlaned + CNI config).
/// Each daemon reads the rig's node table and serves its metrics on its own
/// underlay address (`$RIG_ADDR` expands per guest).
fn nodes_up(rig: &RdmaRig) {
    static UP: OnceLock<Result<(), String>> = OnceLock::new();
    UP.get_or_init(|| {
        rig.nodes_up(&[
            "--nodes-file",
            "/etc/flowlane/nodes.json",
            "--metrics-addr",
            "$RIG_ADDR:9464",
        ])
        .map_err(|e| format!("{e:#}"))
    })
    .as_ref()
    .expect("node-up.sh on both guests");
}

fn json(s: &str, what: &str) -> Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {s}"))
}

/// A counter of a link in the guest's root netns (`statistics/<name>` in sysfs).
fn link_counter(rig: &RdmaRig, node: u8, dev: &str, name: &str) -> u64 {
    rig.run_ok(
        node,
        &format!("cat /sys/class/net/{dev}/statistics/{name}"),
        T,
    )
    .stdout
    .trim()
    .parse()
    .expect("counter")
}

#[test]
fn rxe_port_is_active_with_an_ipv4_roce_v2_gid_and_diag_reports_it() {
    let _turn = crate::turn::take(module_path!());
    let Some(rig) = rdma_rig::shared() else {
        return;
    };
    let rig = rig.lock();
    eprintln!("rig booted in {:.1?}", rig.boot_time());
    nodes_up(&rig);
    for node in NODES {
        let addr = underlay_addr(node);
        let link = rig.run_ok(node, "rdma -j link show", T).stdout;
        let link = json(&link, "rdma -j link show");
        let rxe = link
            .as_array()
            .and_then(|l| l.iter().find(|l| l["ifname"] == "rxe0"))
            .unwrap_or_else(|| panic!("node{node}: no rxe0 in {link}"));
        assert_eq!(rxe["state"], "ACTIVE", "node{node}: {rxe}");
        assert_eq!(rxe["netdev"], "eth0", "node{node}: {rxe}");

        // The GID table as the kernel shows it: the underlay address as an
        // IPv4-mapped RoCE v2 GID.
        let gids = rig
            .run_ok(
                node,
                // The table has 1024 slots: one grep finds the populated ones
                // (a fork per slot costs a minute under TCG).
                "p=/sys/class/infiniband/rxe0/ports/1
                 grep -v '^0000:0000:0000:0000:0000:0000:0000:0000$' $p/gids/* | while IFS=: read -r f gid; do
                   i=${f##*/}; echo \"$i $gid $(cat $p/gid_attrs/types/$i)\"; done",
                T,
            )
            .stdout;
        let octets = addr.octets();
        let mapped = format!(
            "0000:0000:0000:0000:0000:ffff:{:02x}{:02x}:{:02x}{:02x}",
            octets[0], octets[1], octets[2], octets[3]
        );
        assert!(
            gids.lines()
                .any(|l| l.contains(&mapped) && l.ends_with("RoCE v2")),
            "node{node}: no RoCE v2 GID {mapped} in\n{gids}"
        );

        // flowlane diag discovers the same from /sys/class/infiniband and
        // selects that GID for the node's underlay address.
        let diag = rig.run(
            node,
            &format!(
                "$FLOWLANE_BIN_DIR/flowlane diag --json --node-ip {addr} --nodes /etc/flowlane/nodes.json"
            ),
            T,
        );
        let diag = diag.expect("flowlane diag ran");
        let report = json(&diag.stdout, "flowlane diag --json");
        let rdma = report["sections"]
            .as_array()
            .and_then(|s| s.iter().find(|s| s["name"] == "rdma"))
            .unwrap_or_else(|| panic!("node{node}: no rdma section: {report}"));
        let selected = &rdma["data"]["selection"]["selected"];
        assert_eq!(selected["device"], "rxe0", "node{node}: {rdma}");
        assert_eq!(selected["port"], 1, "node{node}: {rdma}");
        assert_eq!(selected["type"], "RoCE v2", "node{node}: {rdma}");
        assert_eq!(
            selected["gid"],
            format!("::ffff:{addr}"),
            "node{node}: {rdma}"
        );
        assert_eq!(selected["link_layer"], "Ethernet", "node{node}: {rdma}");
        let port = &rdma["data"]["inventory"]["devices"][0]["ports"][0];
        assert_eq!(port["state"]["name"], "ACTIVE", "node{node}: {port}");
        let rdma_errors: Vec<&Value> = rdma["findings"]
            .as_array()
            .map(|f| f.iter().filter(|f| f["severity"] == "error").collect())
            .unwrap_or_default();
        assert!(rdma_errors.is_empty(), "node{node}: {rdma_errors:?}");
        let stats = rig.daemon_stats(node).expect("flowlaned answers");
        assert_eq!(stats.daemon.socket, "/run/flowlane/flowlaned.sock");
        assert_eq!(stats.daemon.state_dir, "/var/lib/flowlane");
        // The daemon's own discovery (its cross-node view, refreshed from
        // sysfs) found the same lane on this node.
        let view = rig
            .run_ok(
                node,
                "for _ in $(seq 1 100); do [ -s /var/lib/flowlane/daemon/nodes.json ] && break; sleep 0.2; done
                 cat /var/lib/flowlane/daemon/nodes.json",
                T,
            )
            .stdout;
        let view = json(&view, "flowlaned's node view");
        assert_eq!(view["node"], format!("node{node}"), "{view}");
        assert_eq!(view["rdma"]["lane"]["device"], "rxe0", "{view}");
        assert_eq!(
            view["rdma"]["lane"]["gid"],
            format!("::ffff:{addr}"),
            "{view}"
        );
        // The node's daemon runs with the arguments nodes_up gave it, and the
        // other node reaches it over the underlay.
        let metrics = rig
            .run_ok(
                rdma_rig::peer(node),
                &format!("curl -sS --max-time 20 http://{addr}:9464/metrics"),
                T,
            )
            .stdout;
        assert!(
            metrics.contains("flowlane_"),
            "node{node}'s flowlaned metrics from the other node: {metrics}"
        );
        eprintln!(
            "node{node}: rxe0/1 ACTIVE on eth0, gid[{}] {} ({}), no RDMA problem in diag, daemon metrics reachable over the underlay",
            selected["gid_index"], selected["gid"], selected["type"]
        );
    }
}

#[test]
fn pod_on_node1_reaches_pod_on_node2_over_tcp_across_the_underlay() {
    let _turn = crate::turn::take(module_path!());
    let Some(rig) = rdma_rig::shared() else {
        return;
    };
    let rig = rig.lock();
    nodes_up(&rig);
    let client_ip = rig.add_pod(1, "tcp-cli").expect("pod on node1");
    let server_ip = rig.add_pod(2, "tcp-srv").expect("pod on node2");
    assert!(
        client_ip.to_string().starts_with("10.47.1."),
        "{client_ip} not in {}",
        pod_cidr(1)
    );
    assert!(
        server_ip.to_string().starts_with("10.47.2."),
        "{server_ip} not in {}",
        pod_cidr(2)
    );

    // Each daemon learnt its pod from the registry the plugin wrote.
    for node in NODES {
        let pods = rig
            .daemon_stats(node)
            .expect("flowlaned answers")
            .daemon
            .pods;
        assert!(pods >= 1, "node{node}'s flowlaned knows {pods} pods");
    }
    rig.run_ok(
        2,
        "pod-exec.sh tcp-srv iperf3 -s -1 -D --logfile /tmp/iperf3-srv.log
         for _ in $(seq 1 300); do ip netns exec tcp-srv ss -ltn | grep -q ':5201 ' && exit 0; sleep 0.1; done
         exit 1",
        T,
    );
    let tx_before = link_counter(&rig, 1, "eth0", "tx_bytes");
    let out = rig.run_ok(
        1,
        &format!("pod-exec.sh tcp-cli iperf3 -c {server_ip} -t 3 -J"),
        Duration::from_secs(90),
    );
    let tx_after = link_counter(&rig, 1, "eth0", "tx_bytes");
    let report = json(&out.stdout, "iperf3 -J");
    let conn = &report["start"]["connected"][0];
    // No NAT between pods: each end sees the other's pod address.
    assert_eq!(conn["local_host"], client_ip.to_string(), "{conn}");
    assert_eq!(conn["remote_host"], server_ip.to_string(), "{conn}");
    let sent = report["end"]["sum_sent"]["bytes"]
        .as_u64()
        .expect("bytes sent");
    let received = report["end"]["sum_received"]["bytes"]
        .as_u64()
        .expect("bytes received");
    assert!(received > 0, "nothing received: {}", out.stdout);
    // The stream crossed node1's underlay NIC (host-gw route), not some other path.
    assert!(
        tx_after - tx_before >= received,
        "node1 eth0 sent {} bytes during a {received}-byte stream",
        tx_after - tx_before
    );
    let bps = report["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap_or(0.0);
    println!(
        "pod-to-pod TCP across nodes (iperf3 -t 3, {client_ip} -> {server_ip}): {:.1} Mbit/s, {sent} bytes sent, {} retransmits",
        bps / 1e6,
        report["end"]["sum_sent"]["retransmits"]
    );
    rig.del_pod(1, "tcp-cli").expect("DEL pod on node1");
    rig.del_pod(2, "tcp-srv").expect("DEL pod on node2");
    // DEL released the leases and the registry entries.
    for node in NODES {
        let left = rig
            .run_ok(
                node,
                "ls /var/lib/flowlane/ipam/flowlane-rig 2>/dev/null | grep -c '^10\\.' || true",
                T,
            )
            .stdout;
        assert_eq!(left.trim(), "0", "node{node}: leases left after DEL");
    }
}

#[test]
fn perftest_baseline_between_the_guests() {
    let _turn = crate::turn::take(module_path!());
    let Some(rig) = rdma_rig::shared() else {
        return;
    };
    let rig = rig.lock();
    let sent = |n| link_counter(&rig, n, "eth0", "tx_bytes");
    let before = sent(1);
    let bw = perftest::ib_write_bw(&rig, 65536, 3).expect("ib_write_bw node1 -> node2");
    let moved = sent(1) - before;
    assert!(bw.iterations > 0, "{bw:?}");
    assert!(bw.avg_gbit_s > 0.0, "{bw:?}");
    // The RDMA WRITEs really went over the wire as RoCE v2 (UDP 4791) frames.
    assert!(
        moved >= bw.iterations * bw.msg_bytes,
        "node1 eth0 sent {moved} bytes for {} x {} bytes of RDMA WRITE",
        bw.iterations,
        bw.msg_bytes
    );
    let lat = perftest::ib_send_lat(&rig, 2, 1000).expect("ib_send_lat node1 <-> node2");
    assert_eq!(lat.iterations, 1000, "{lat:?}");
    assert!(lat.min_us > 0.0 && lat.min_us <= lat.avg_us, "{lat:?}");
    println!(
        "perftest baseline (rxe0 <-> rxe0, RoCE v2, QEMU TCG guests): ib_write_bw 64 KiB x {} in 3 s: \
         avg {:.3} Gbit/s ({:.1} MB/s), peak {:.3} Gbit/s; ib_send_lat 2 B x {}: typical {:.1} us, \
         avg {:.1} us, p99 {:.1} us",
        bw.iterations,
        bw.avg_gbit_s,
        bw.avg_bytes_per_sec() / 1e6,
        bw.peak_gbit_s,
        lat.iterations,
        lat.typical_us,
        lat.avg_us,
        lat.p99_us
    );
}
