//! A node as a network namespace, as the multi-node harnesses build it
//! (`frameworks::RelayPair`, `services::SvcCluster`): pods wired by the real
//! plugin run inside the node's namespace, its daemon started there and
//! waited for, two nodes joined by an underlay veth with host-gw routes.

use crate::shm::{build_dir, fresh_netns, run_cni, sh, sh_ok, Pod};
use flowlane_lane::client::DaemonClient;
use flowlane_lane::proto::Stats;
use std::net::Ipv4Addr;
use std::path::Path;
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

/// Runs the CNI plugin inside `node_netns` as a runtime does, for the pod
/// namespace `pod_ns` (container `id`) with the configuration `conf`.
pub fn cni_in(node_netns: &str, conf: &str, command: &str, pod_ns: &str, id: &str) -> Output {
    let mut plugin = Command::new("ip");
    plugin
        .args(["netns", "exec", node_netns])
        .arg(build_dir().join("flowlane"));
    run_cni(plugin, conf, command, pod_ns, id).expect("run the CNI plugin")
}

/// A fresh pod namespace `pod_ns` wired by the plugin in `node_netns`.
pub fn add_pod_in(node_netns: &str, conf: &str, pod_ns: &str) -> Pod {
    fresh_netns(pod_ns);
    let id = format!("{pod_ns}-{}", std::process::id());
    let out = cni_in(node_netns, conf, "ADD", pod_ns, &id);
    assert!(
        out.status.success(),
        "CNI ADD in {node_netns}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ip = v["ips"][0]["address"]
        .as_str()
        .and_then(|a| a.split('/').next()?.parse().ok())
        .expect("pod IP in the CNI result");
    Pod {
        netns: pod_ns.to_string(),
        ip,
        container_id: id,
    }
}

/// The daemon's counters on `socket`, if it answers.
pub fn daemon_stats(socket: &Path) -> Option<Stats> {
    DaemonClient::connect(socket, Duration::from_secs(2))
        .and_then(|mut c| c.stats())
        .ok()
}

/// Waits until the daemon `child` answers on `socket` (20 s at most);
/// panics with its log if it exits or stays silent.
pub fn wait_daemon(child: &mut Child, socket: &Path, log: impl Fn() -> String) {
    let t0 = Instant::now();
    while daemon_stats(socket).is_none() {
        if let Some(st) = child.try_wait().unwrap() {
            panic!("flowlaned exited ({st}): {}", log());
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "flowlaned did not come up: {}",
            log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Stops a daemon: SIGTERM, up to 5 s to exit, then SIGKILL.
pub fn stop_daemon(mut d: Child) {
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(d.id() as i32, libc::SIGTERM) };
    let t0 = Instant::now();
    while d.try_wait().ok().flatten().is_none() && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = d.kill();
    let _ = d.wait();
}

/// One end of an underlay link: the node's namespace, its underlay
/// address (/24) and its pods' CIDR.
pub struct Underlay<'a> {
    pub netns: &'a str,
    pub addr: Ipv4Addr,
    pub cidr: &'a str,
}

/// Joins two nodes with the veth pair `<link>0`/`<link>1` and routes each
/// node's pod CIDR via the other's underlay address (host-gw).
pub fn join(link: &str, ends: [Underlay<'_>; 2]) {
    let (a, b) = (format!("{link}0"), format!("{link}1"));
    let _ = sh(&["ip", "link", "del", &a]);
    sh_ok(&[
        "ip",
        "link",
        "add",
        &a,
        "netns",
        ends[0].netns,
        "type",
        "veth",
        "peer",
        "name",
        &b,
        "netns",
        ends[1].netns,
    ]);
    for i in 0..2 {
        let (me, other) = (&ends[i], &ends[1 - i]);
        let dev = format!("{link}{i}");
        let addr = format!("{}/24", me.addr);
        sh_ok(&["ip", "-n", me.netns, "addr", "add", &addr, "dev", &dev]);
        sh_ok(&["ip", "-n", me.netns, "link", "set", &dev, "up"]);
        let via = other.addr.to_string();
        sh_ok(&[
            "ip", "-n", me.netns, "route", "add", other.cidr, "via", &via,
        ]);
    }
}

/// One row of the daemons' static node table (`--nodes-file`).
pub struct NodeRow<'a> {
    pub name: &'a str,
    pub pod_cidr: &'a str,
    pub underlay: Ipv4Addr,
    pub lane_port: u16,
}

/// Writes the static node table the relay's daemons share to
/// `dir/nodes.json` and returns its path.
pub fn write_nodes_file<'a>(
    dir: &Path,
    rows: impl IntoIterator<Item = NodeRow<'a>>,
) -> std::path::PathBuf {
    let nodes: Vec<_> = rows
        .into_iter()
        .map(|n| {
            serde_json::json!({
                "name": n.name, "podCIDRs": [n.pod_cidr],
                "underlay": n.underlay.to_string(), "lanePort": n.lane_port,
            })
        })
        .collect();
    let file = dir.join("nodes.json");
    std::fs::write(&file, serde_json::json!({ "nodes": nodes }).to_string()).unwrap();
    file
}
