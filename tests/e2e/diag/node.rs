//! `flowlane diag` on a real node: a bridge and pods wired by the real
//! `flowlane` plugin (invoked as a runtime invokes it), the real
//! `flowlaned`, an installed conflist and bin dir in temporary directories.
//! Each test breaks one thing the way it breaks on real nodes and checks
//! that diag names it (problem id in `--json`) and exits non-zero; the
//! untouched node must come out healthy with exit 0.
//!
//! Names: bridges and netns `fldg<k><pid>`, subnets 10.204.<n>.0/24 with `n`
//! from the test's `k` and the process id, so that a concurrent run of this
//! suite (another checkout on the same machine) uses other names and subnets.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use flowlane_e2e::binaries;
use flowlane_e2e::cni::Invocation;
use flowlane_e2e::fsutil::TempDir;
use flowlane_e2e::host::LinkGuard;
use flowlane_e2e::netns::Netns;
use flowlane_e2e::process::{self, ChildGuard};
use flowlane_e2e::wait;
use serde_json::{json, Value};

/// Third octet of test `k`'s pod subnet 10.204.<octet>.0/24: eight slots
/// per process, placed by the process id.
fn octet_of(k: u8) -> u8 {
    ((std::process::id() % 31) * 8) as u8 + (k - 1)
}

/// One node: config dir, bin dir, state and IPAM dirs, bridge, daemon, pods.
struct Node {
    dir: TempDir,
    /// Third octet of the node's pod subnet 10.204.<octet>.0/24.
    octet: u8,
    /// Also an IPv6 range.
    dual: bool,
    network: String,
    daemon: Option<ChildGuard>,
    pods: Vec<(Netns, String)>,
    // Dropped last: the pods' veths hang off it.
    _bridge: LinkGuard,
}

impl Node {
    /// A node with the flowlane conflist installed, the plugin in its bin
    /// dir, flowlaned running, and `pods` pods wired by the plugin.
    fn new(k: u8, pods: usize) -> Node {
        Node::build(k, pods, false)
    }

    /// Like [`Node::new`], with an IPv6 range fd00:204:<octet>::/64 too.
    fn dual_stack(k: u8, pods: usize) -> Node {
        Node::build(k, pods, true)
    }

    fn build(k: u8, pods: usize, dual: bool) -> Node {
        assert!(
            (1..=7).contains(&k),
            "k picks one of seven subnets per process (8 is a peer's)"
        );
        let pid = std::process::id();
        let network = format!("fldg{k}{pid:x}");
        let octet = octet_of(k);
        let dir = TempDir::new(&format!("dg{k}"));
        for sub in ["net.d", "bin", "state", "ipam"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        std::os::unix::fs::symlink(binaries::flowlane(), dir.join("bin/flowlane")).unwrap();
        let mut node = Node {
            _bridge: LinkGuard::new(&network),
            dir,
            octet,
            dual,
            network,
            daemon: None,
            pods: Vec::new(),
        };
        node.write_conflist();
        node.start_daemon();
        for i in 0..pods {
            node.add_pod(i);
        }
        node
    }

    fn conf_dir(&self) -> PathBuf {
        self.dir.join("net.d")
    }
    fn state_dir(&self) -> PathBuf {
        self.dir.join("state")
    }
    fn socket(&self) -> PathBuf {
        self.dir.join("flowlaned.sock")
    }
    fn lease_dir(&self) -> PathBuf {
        self.dir.join("ipam").join(&self.network)
    }
    /// Host `n` of the node's pod subnet.
    fn ip(&self, n: u8) -> String {
        format!("10.204.{}.{n}", self.octet)
    }

    fn conflist_path(&self) -> PathBuf {
        self.conf_dir().join("10-flowlane.conflist")
    }

    /// fd00:204:<octet>::/64, written canonically (as diag prints it).
    fn v6_subnet(&self) -> String {
        let net: std::net::Ipv6Addr = format!("fd00:204:{:x}::", self.octet).parse().unwrap();
        format!("{net}/64")
    }

    fn ranges(&self) -> Value {
        let mut r = vec![json!([{ "subnet": format!("10.204.{}.0/24", self.octet) }])];
        if self.dual {
            r.push(json!([{ "subnet": self.v6_subnet() }]));
        }
        Value::Array(r)
    }

    /// The flowlane plugin's entry of the conflist.
    fn plugin_conf(&self) -> Value {
        json!({
            "type": "flowlane",
            "bridge": self.network,
            "isGateway": true,
            "ipMasq": false,
            "stateDir": self.state_dir(),
            "daemonSocket": self.socket(),
            "ipam": {
                "type": "flowlane",
                "ranges": self.ranges(),
                "dataDir": self.dir.join("ipam"),
            },
        })
    }

    fn write_conflist(&self) {
        let list = json!({
            "cniVersion": "1.1.0",
            "name": self.network,
            "plugins": [self.plugin_conf()],
        });
        std::fs::write(
            self.conflist_path(),
            serde_json::to_vec_pretty(&list).unwrap(),
        )
        .unwrap();
    }

    fn start_daemon(&mut self) {
        let mut cmd = Command::new(binaries::workspace_artifact("flowlaned"));
        cmd.arg("--state-dir")
            .arg(self.state_dir())
            .arg("--socket")
            .arg(self.socket())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let guard = ChildGuard::new(cmd.spawn().expect("start flowlaned"));
        let sock = self.socket();
        let up = wait::until(Duration::from_secs(20), || {
            std::os::unix::net::UnixStream::connect(&sock).is_ok()
        });
        assert!(up, "flowlaned did not listen on {}", sock.display());
        self.daemon = Some(guard);
    }

    fn stop_daemon(&mut self) {
        if let Some(mut d) = self.daemon.take() {
            d.terminate(Duration::from_secs(10));
        }
    }

    /// CNI ADD exactly as a runtime runs a conflist's first plugin: the
    /// plugin's entry plus the list's name and cniVersion on stdin.
    fn add_pod(&mut self, i: usize) {
        let ns = Netns::named(&format!("{}p{i}", self.network));
        let id = format!("{}-container-{i}", self.network);
        let mut conf = self.plugin_conf();
        conf["name"] = json!(self.network);
        conf["cniVersion"] = json!("1.1.0");
        let result = Invocation::new(binaries::flowlane(), "ADD")
            .container_id(&id)
            .netns(ns.path_str())
            .ifname("eth0")
            .args(&format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=diag;K8S_POD_NAME=pod{i}"
            ))
            .cni_path(&self.dir.join("bin").display().to_string())
            .config(&conf)
            .run()
            .expect_json();
        assert!(
            result["ips"][0]["address"].as_str().is_some(),
            "ADD result {result}"
        );
        self.pods.push((ns, id));
    }

    /// Runs `flowlane diag --json` against this node; (exit code, report).
    fn diag(&self) -> (i32, Value) {
        let out = self.run_diag(&["--json"]);
        let report: Value = serde_json::from_str(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "diag --json printed no JSON ({e}):\n{}\n{}",
                out.stdout, out.stderr
            )
        });
        (out.status.code().unwrap_or(-1), report)
    }

    /// Runs `flowlane diag` with this node's directories, then `extra`. RDMA
    /// is read from an empty sysfs (unless `extra` names one) so the result
    /// does not depend on the host.
    fn run_diag(&self, extra: &[&str]) -> process::Output {
        let no_rdma = self.dir.join("sys-without-rdma");
        std::fs::create_dir_all(&no_rdma).unwrap();
        process::run(
            Command::new(binaries::flowlane())
                .arg("diag")
                .arg("--cni-conf-dir")
                .arg(self.conf_dir())
                .arg("--cni-bin-dir")
                .arg(self.dir.join("bin"))
                .arg("--state-dir")
                .arg(self.state_dir())
                .arg("--socket")
                .arg(self.socket())
                .arg("--sysfs")
                .arg(&no_rdma)
                // Last, so a test's own --sysfs wins.
                .args(extra)
                .env_remove("CNI_COMMAND"),
            Duration::from_secs(60),
        )
        .expect("run flowlane diag")
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop_daemon();
        // Netns guards delete the pods' namespaces (and with them the veths).
        self.pods.clear();
    }
}

/// `(id, severity)` of every problem in a report.
fn problems(report: &Value) -> Vec<(String, String)> {
    report["problems"]
        .as_array()
        .expect("problems array")
        .iter()
        .map(|p| {
            (
                p["id"].as_str().unwrap().to_string(),
                p["severity"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn has_error(report: &Value, id: &str) -> bool {
    problems(report)
        .iter()
        .any(|(i, s)| i == id && s == "error")
}

fn finding_ids(report: &Value, section: &str) -> Vec<String> {
    report["sections"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["name"] == section)
        .flat_map(|s| s["findings"].as_array().unwrap().iter())
        .map(|f| f["id"].as_str().unwrap().to_string())
        .collect()
}

fn assert_fix_given(report: &Value) {
    for p in report["problems"].as_array().unwrap() {
        assert!(
            p["fix"].as_str().is_some_and(|f| !f.is_empty()),
            "problem without a fix: {p}"
        );
    }
}

#[test]
fn diag_reports_a_healthy_node_as_healthy() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::dual_stack(1, 2);
    let (code, report) = node.diag();
    assert_eq!(
        problems(&report),
        Vec::<(String, String)>::new(),
        "{report:#}"
    );
    assert_eq!(code, 0);
    assert_eq!(report["healthy"], true);
    for (section, id) in [
        ("cni_config", "cni.config_ok"),
        ("binaries", "bin.version_ok"),
        ("bridge", "bridge.up"),
        ("bridge", "bridge.gateway_ok"),
        ("bridge", "bridge.route_ok"),
        ("ipam", "ipam.usage"),
        ("daemon", "daemon.up"),
        ("pods", "pods.live"),
        ("rdma", "rdma.none"),
        ("host", "host.memlock"),
    ] {
        assert!(
            finding_ids(&report, section).contains(&id.to_string()),
            "{id} missing: {report:#}"
        );
    }
    // The usage line counts the two real leases.
    let usage = report["sections"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "ipam")
        .unwrap()["findings"][0]["summary"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(usage.contains("2 of 253"), "{usage}");
    // Dual stack: both gateways on the bridge, both subnets routed to it.
    let bridge = report["sections"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "bridge")
        .unwrap()["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["summary"].as_str().unwrap().to_string())
        .collect::<Vec<_>>();
    let v6 = node.v6_subnet();
    assert!(
        bridge
            .iter()
            .any(|f| f.contains("gateway") && f.contains(&v6)),
        "{bridge:#?}"
    );
    assert!(
        bridge
            .iter()
            .any(|f| f.starts_with(&format!("{v6} routes to"))),
        "{bridge:#?}"
    );

    // With an RDMA NIC (the Soft-RoCE fixture tree), the lane's GID is
    // chosen; the daemon's 8 MiB memlock is then only a warning, and
    // warnings alone keep the exit code 0.
    let rxe = Path::new(env!("CARGO_MANIFEST_DIR")).join("../rdma/tests/fixtures/rxe");
    let out = node.run_diag(&[
        "--json",
        "--sysfs",
        rxe.to_str().unwrap(),
        "--node-ip",
        "192.0.2.1",
    ]);
    let rdma: Value = serde_json::from_str(&out.stdout).unwrap();
    assert!(
        finding_ids(&rdma, "rdma").contains(&"rdma.gid_selected".to_string()),
        "{rdma:#}"
    );
    assert!(
        problems(&rdma).iter().all(|(_, sev)| sev == "warning"),
        "{rdma:#}"
    );
    assert_eq!(out.status.code(), Some(0), "{rdma:#}");

    // The human form says the same (printed: docs/diag.md shows it).
    let text = node.run_diag(&[]);
    println!("{}", text.stdout);
    assert!(text.success(), "{}", text.stdout);
    assert!(
        text.stdout
            .contains("0 error(s), 0 warning(s): this node is healthy"),
        "{}",
        text.stdout
    );
}

#[test]
fn diag_detects_a_broken_conflist() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new(2, 1);
    let text = std::fs::read_to_string(node.conflist_path()).unwrap();
    // A half-written file, as a non-atomic installer leaves it.
    std::fs::write(node.conflist_path(), &text[..text.len() / 2]).unwrap();
    let (code, report) = node.diag();
    assert!(has_error(&report, "cni.invalid_json"), "{report:#}");
    assert_ne!(code, 0);
    assert_fix_given(&report);

    // A valid non-flowlane config sorting first shadows flowlane's.
    node.write_conflist();
    std::fs::write(
        node.conf_dir().join("05-other.conf"),
        r#"{"cniVersion": "1.0.0", "name": "other", "type": "bridge"}"#,
    )
    .unwrap();
    let (code, report) = node.diag();
    assert!(has_error(&report, "cni.not_flowlane"), "{report:#}");
    assert!(has_error(&report, "cni.flowlane_shadowed"), "{report:#}");
    assert_ne!(code, 0);

    std::fs::remove_file(node.conf_dir().join("05-other.conf")).unwrap();
    let (code, report) = node.diag();
    assert_eq!(code, 0, "repaired: {report:#}");
}

#[test]
fn diag_detects_a_hung_or_stopped_daemon() {
    let _turn = crate::turn::take(module_path!());
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;

    let mut node = Node::new(3, 1);
    // Hung (SIGSTOP): the kernel still accepts on its socket, nothing answers.
    let pid = Pid::from_raw(node.daemon.as_ref().unwrap().pid() as i32);
    kill(pid, Signal::SIGSTOP).unwrap();
    let (code, report) = node.diag();
    kill(pid, Signal::SIGCONT).unwrap();
    assert!(has_error(&report, "daemon.unresponsive"), "{report:#}");
    assert_ne!(code, 0);
    assert_eq!(node.diag().0, 0, "answers again after SIGCONT");

    node.stop_daemon();
    let (code, report) = node.diag();
    assert!(has_error(&report, "daemon.down"), "{report:#}");
    assert_ne!(code, 0);
    assert_fix_given(&report);
    // Nothing else is wrong: the pods still have their network.
    assert_eq!(problems(&report).len(), 1, "{report:#}");
}

#[test]
fn diag_detects_a_leaked_lease() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new(4, 1);
    // An address taken by a container that has no pod registry entry, as a
    // plugin killed between IPAM and the registry write leaves it.
    std::fs::write(
        node.lease_dir().join(node.ip(200)),
        "f00dfeedcafe0001\r\neth0",
    )
    .unwrap();
    let (code, report) = node.diag();
    assert!(has_error(&report, "ipam.leaked_lease"), "{report:#}");
    let leaked: Vec<Value> = report["problems"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["id"] == "ipam.leaked_lease")
        .cloned()
        .collect();
    assert_eq!(
        leaked.len(),
        1,
        "only the stray lease, not the pod's: {leaked:?}"
    );
    assert!(leaked[0]["summary"]
        .as_str()
        .unwrap()
        .contains(&node.ip(200)));
    assert_ne!(code, 0);
    assert_fix_given(&report);

    // The opposite fault: the pod's own lease removed (someone cleaned the
    // data dir): its address could be given to the next pod.
    let own = node.lease_dir().join(node.ip(2));
    assert!(own.exists(), "pod0 got {}", node.ip(2));
    std::fs::remove_file(&own).unwrap();
    let (code, report) = node.diag();
    assert!(has_error(&report, "ipam.lease_missing"), "{report:#}");
    assert_ne!(code, 0);
}

#[test]
fn diag_detects_a_pod_registered_without_its_netns() {
    let _turn = crate::turn::take(module_path!());
    let mut node = Node::new(5, 2);
    // The runtime lost the pod without CNI DEL: its netns is gone, its
    // registry entry and lease stay.
    let (gone, gone_id) = node.pods.remove(1);
    let path = gone.path().to_path_buf();
    drop(gone);
    assert!(!Path::new(&path).exists());
    let (code, report) = node.diag();
    assert!(has_error(&report, "pods.netns_missing"), "{report:#}");
    assert!(
        has_error(&report, "ipam.leaked_lease"),
        "its lease is leaked too: {report:#}"
    );
    let missing = report["problems"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["id"] == "pods.netns_missing")
        .unwrap();
    assert!(
        missing["fix"].as_str().unwrap().contains(&gone_id),
        "{missing}"
    );
    assert!(
        finding_ids(&report, "pods").contains(&"pods.live".to_string()),
        "the other pod is fine"
    );
    assert_ne!(code, 0);
}

/// A pod server that counts what it receives until EOF, then prints the count.
const COUNT_SERVER: &str = r#"
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(1)
c, _ = s.accept(); n = 0
while True:
    b = c.recv(1 << 16)
    if not b:
        break
    n += len(b)
print(n, flush=True)
"#;

/// A pod client that sends N bytes, says so, and keeps the connection open
/// until its stdin closes.
const HOLDING_CLIENT: &str = r#"
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
c.sendall(b'x' * int(sys.argv[3]))
print('sent', flush=True)
sys.stdin.read()
c.close()
"#;

fn daemon_stats(report: &Value) -> Value {
    report["sections"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "daemon")
        .unwrap()["data"]["stats"]
        .clone()
}

#[test]
fn diag_shows_live_shared_memory_connections() {
    let _turn = crate::turn::take(module_path!());
    use std::io::{BufRead, BufReader};

    let node = Node::new(6, 2);
    let preload = binaries::workspace_artifact("libflowlane_preload.so");
    let in_pod = |i: usize, argv: &[&str]| {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", node.pods[i].0.name(), "env"])
            .arg(format!("LD_PRELOAD={}", preload.display()))
            .arg(format!("FLOWLANE_SOCKET={}", node.socket().display()))
            .args(argv)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    };
    let mut server = ChildGuard::new(
        in_pod(1, &["/usr/bin/python3", "-c", COUNT_SERVER, "7100"])
            .spawn()
            .unwrap(),
    );
    let listening = wait::until(Duration::from_secs(20), || {
        let o = node.pods[1].0.exec(&["ss", "-Htln", "sport = :7100"]);
        !o.stdout.trim().is_empty()
    });
    assert!(listening, "the pod server did not listen");
    let sent: u64 = 1 << 20;
    let mut client = ChildGuard::new(
        in_pod(
            0,
            &[
                "/usr/bin/python3",
                "-c",
                HOLDING_CLIENT,
                &node.ip(3),
                "7100",
                &sent.to_string(),
            ],
        )
        .spawn()
        .unwrap(),
    );
    let mut line = String::new();
    BufReader::new(client.child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "sent");

    // The connection is open: diag lists it on the shm lane, pod to pod.
    let (code, report) = node.diag();
    assert_eq!(code, 0, "{report:#}");
    let stats = daemon_stats(&report);
    let conns = stats["connections"].as_array().expect("connections");
    assert_eq!(conns.len(), 1, "{stats:#}");
    assert_eq!(conns[0]["lane"], "shm");
    assert_eq!(conns[0]["client"]["pod"], "diag/pod0", "{stats:#}");
    assert_eq!(conns[0]["server"]["addr"], format!("{}:7100", node.ip(3)));
    assert!(finding_ids(&report, "daemon").contains(&"daemon.connection".to_string()));
    // (Printed for docs/diag.md; run with --nocapture.)
    println!("{}", node.run_diag(&[]).stdout);

    // Closed: the lane's counters hold the bytes the client sent.
    drop(client.child.stdin.take());
    let mut out = String::new();
    std::io::Read::read_to_string(&mut server.child.stdout.take().unwrap(), &mut out).unwrap();
    assert_eq!(out.trim(), sent.to_string(), "server received");
    let closed = wait::until(Duration::from_secs(30), || {
        let (_, r) = node.diag();
        let shm = &daemon_stats(&r)["lanes"]["shm"];
        shm["connections_closed"] == 1 && shm["bytes"].as_u64().unwrap_or(0) >= sent
    });
    assert!(
        closed,
        "lane counters after close: {:#}",
        daemon_stats(&node.diag().1)
    );
}

#[test]
fn diag_checks_routes_to_other_nodes_from_the_node_table() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new(7, 1);
    let peer_cidr = format!("10.204.{}.0/24", octet_of(8));
    let peer_underlay = node.ip(254);
    let table = node.dir.join("nodes.json");
    std::fs::write(
        &table,
        serde_json::to_vec_pretty(&json!({"nodes": [
            {"name": "this", "podCIDRs": [format!("10.204.{}.0/24", node.octet)], "underlay": node.ip(1)},
            {"name": "peer", "podCIDRs": [peer_cidr], "underlay": peer_underlay,
             "rdma": {"device": "mlx5_0", "port": 1, "gidIndex": 3, "gid": "::ffff:10.9.9.9",
                      "linkLayer": "Ethernet"}},
        ]}))
        .unwrap(),
    )
    .unwrap();
    let nodes_arg = table.display().to_string();

    // No route to the peer's pods yet: broken.
    let out = node.run_diag(&["--json", "--nodes", &nodes_arg]);
    let report: Value = serde_json::from_str(&out.stdout).unwrap();
    assert!(has_error(&report, "nodes.route_missing"), "{report:#}");
    let fix = report["problems"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["id"] == "nodes.route_missing")
        .unwrap()["fix"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(fix, format!("ip route add {peer_cidr} via {peer_underlay}"));
    assert_ne!(out.status.code(), Some(0));
    assert!(
        finding_ids(&report, "nodes").contains(&"nodes.self".to_string()),
        "{report:#}"
    );

    // Do what diag says (the route dies with the test's bridge): healthy,
    // and the peer's lane is explained (it has RDMA, this node does not).
    process::sh(&[
        "ip",
        "route",
        "add",
        &peer_cidr,
        "via",
        &peer_underlay,
        "dev",
        &node.network,
    ])
    .expect_ok("ip route add");
    let out = node.run_diag(&["--json", "--nodes", &nodes_arg]);
    let report: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(0), "{report:#}");
    assert!(
        finding_ids(&report, "nodes").contains(&"nodes.route_ok".to_string()),
        "{report:#}"
    );
    let lane = report["sections"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "nodes")
        .unwrap()["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["id"] == "nodes.lane")
        .unwrap()["summary"]
        .clone();
    assert_eq!(lane, "peer: TCP (it has RDMA, this node does not)");

    // A table that cannot be used is an error of its own.
    std::fs::write(
        &table,
        r#"{"nodes": [{"name": "a", "podCIDRs": ["10.204.0.0/24"], "underlay": "x"}]}"#,
    )
    .unwrap();
    let out = node.run_diag(&["--json", "--nodes", &nodes_arg]);
    let report: Value = serde_json::from_str(&out.stdout).unwrap();
    assert!(has_error(&report, "nodes.table_invalid"), "{report:#}");
}
