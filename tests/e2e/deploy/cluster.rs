//! The deployment path end to end, on the one-machine cluster: nodes that
//! are installed and run exactly as the shipped manifests install and run
//! them on a real cluster.
//!
//! - A node is a network namespace on an underlay bridge (its `eth0`,
//!   `10.235.0.(10+i)/24`) plus a private mount namespace in which the
//!   host's well-known directories (`/etc/cni/net.d`, `/opt/cni/bin`,
//!   `/opt/flowlane/lib`, `/var/lib/flowlane`, `/var/lib/cni`,
//!   `/run/flowlane`, `/run/netns`, `/etc/flowlane-lane`) are its own tmpfs:
//!   a machine of its own, as far as flowlane can tell.
//! - Each node runs the DaemonSet's init script (`install.sh` from the
//!   ConfigMap, unmodified) and then `flowlaned` with the DaemonSet's own
//!   arguments (expanded from the ConfigMap as the kubelet does) against a
//!   fake API server serving the Node objects (the one fake: Kubernetes
//!   cannot run here). Pods are wired by the runtime's part, played by the
//!   test: the installed conflist's plugins run in order with prevResult.
//! - The ConfigMap is used as shipped except for two values an operator may
//!   set: the node view refresh (2 s, so a joining node shows in seconds)
//!   and the lane transport (`tcp-test`: no RDMA here).
//!
//! - Nodes 1 and 2 have an RDMA port: a Soft-RoCE-like sysfs tree (the
//!   `rxe` fixture, its RoCE v2 GID rewritten to the node's own address) is
//!   mounted on the node's `/sys`, so each daemon discovers it, selects the
//!   GID and publishes its lane on its Node object exactly as on RDMA
//!   hardware; the bytes then go over the `tcp-test` transport, since this
//!   kernel has no verbs device to open (the second fake: RDMA hardware).
//! - Node 4 runs components/chained: a reference `bridge` + `host-local` +
//!   `portmap` conflist is there first, and the DaemonSet's init script (with
//!   the component's ConfigMap and environment) chains flowlane into it.
//!
//! Shown: pod-to-pod across nodes with no route added by the test; the
//! server sees the client pod's own address (no NAT between pods); the
//! cross-node connection rides the relay between the two RDMA nodes' daemons;
//! the same-node pair on shared memory; a node that joins later is
//! reachable; pods wired by the chained conflist get the shared-memory lane;
//! `flowlane diag` on a node is healthy.
//!
//! `flowlane cluster check --kubernetes` runs against the same set-up
//! (its own addresses, 10.241.0.0/16), through the fake API server, with a
//! kubelet double per node that runs the probe pods it creates
//! (`flowlane_e2e::kubelet`): injection by the webhook's own code at
//! admission, pods wired by the installed conflist, the daemons' counters
//! read through the pod proxy subresource of their DaemonSet pods.
//!
//! Names: netns `dpu*` (underlay), `dpn*` (nodes); underlay 10.235.0.0/24,
//! pods 10.234.(10+i).0/24 (the check's cluster: 10.241.0.0/24 and
//! 10.241.(10+i).0/24). The two tests take turns (one lock): each mounts
//! over the same host directories and names its veths alike.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use flowlane_e2e::binaries;
use flowlane_e2e::fake_api::{node_object, FakeApi};
use flowlane_e2e::fsutil::TempDir;
use flowlane_e2e::kubelet::{kubelet_expand, Kubelet, NodeHost};
use flowlane_e2e::netns::Netns;
use flowlane_e2e::process::{self, ChildGuard};
use flowlane_e2e::wait;
use serde::Deserialize;
use serde_json::{json, Value};

/// A cluster's address plan: the underlay /24 (`.1` the API server, `.(10+i)`
/// node i) and the pods' /16 (node i gets `.(10+i).0/24`).
#[derive(Clone, Copy)]
struct Addrs {
    underlay: &'static str,
    pods: &'static str,
}

const ADDRS: Addrs = Addrs {
    underlay: "10.235.0",
    pods: "10.234",
};
/// The connectivity check's cluster.
const CHECK_ADDRS: Addrs = Addrs {
    underlay: "10.241.0",
    pods: "10.241",
};

/// The two tests mount over the same host directories: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
const NODE_DIRS: &[&str] = &[
    "/etc/cni/net.d",
    "/opt/cni/bin",
    "/opt/flowlane/lib",
    "/var/lib/flowlane",
    "/var/lib/cni",
    "/run/flowlane",
    "/run/netns",
    "/etc/flowlane-lane",
];
const SOCKET: &str = "/run/flowlane/flowlaned.sock";

fn deploy_doc(name: &str) -> serde_yaml::Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/kubernetes")
        .join(name);
    serde_yaml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// The ConfigMap's data, with the operator's two settings of this test;
/// with components/chained's ConfigMap patch applied for a chained node.
fn config_data(kind: NodeKind) -> BTreeMap<String, String> {
    let cm = deploy_doc("configmap.yaml");
    let mut data: BTreeMap<String, String> = serde_yaml::from_value(cm["data"].clone()).unwrap();
    if kind == NodeKind::Chained {
        let patch = deploy_doc("components/chained/configmap-patch.yaml");
        for op in patch.as_sequence().unwrap() {
            let key = op["path"].as_str().unwrap().strip_prefix("/data/").unwrap();
            let value = op["value"].as_str().unwrap().to_string();
            data.insert(key.to_string(), value);
        }
    }
    data.insert("FLOWLANE_NODES_REFRESH".into(), "2".into());
    data.insert("FLOWLANE_LANE_TRANSPORT".into(), "tcp-test".into());
    data
}

/// What a node brings before the DaemonSet runs on it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum NodeKind {
    /// flowlane is the cluster's CNI (the shipped manifests as they are).
    Primary,
    /// The same, on a node with an RDMA port.
    PrimaryRdma,
    /// Another CNI's conflist is there; components/chained joins it.
    Chained,
}

/// The node's `/sys` as the daemon reads it for RDMA discovery: the `rxe`
/// fixture (a Soft-RoCE device on netdev `vA`), moved onto the node's
/// `eth0`, its IPv4 RoCE v2 GID set to the node's underlay address, as the
/// kernel derives it from that address.
fn rdma_sysfs(dst: &Path, node_ip: &str) {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../rdma/tests/fixtures/rxe");
    let cp = Command::new("cp")
        .arg("-a")
        .arg(&fixture)
        .arg(dst)
        .status()
        .unwrap();
    assert!(cp.success(), "copying the rxe fixture");
    let o: Vec<u8> = node_ip.split('.').map(|x| x.parse().unwrap()).collect();
    let gid = format!(
        "0000:0000:0000:0000:0000:ffff:{:02x}{:02x}:{:02x}{:02x}",
        o[0], o[1], o[2], o[3]
    );
    let port = dst.join("devices/virtual/infiniband/rxe0/ports/1");
    std::fs::write(port.join("gids/1"), format!("{gid}\n")).unwrap();
    for f in ["gid_attrs/ndevs/0", "gid_attrs/ndevs/1"] {
        std::fs::write(port.join(f), "eth0\n").unwrap();
    }
    std::fs::write(dst.join("devices/virtual/infiniband/rxe0/parent"), "eth0\n").unwrap();
    std::fs::rename(
        dst.join("devices/virtual/net/vA"),
        dst.join("devices/virtual/net/eth0"),
    )
    .unwrap();
    std::fs::remove_file(dst.join("class/net/vA")).unwrap();
    std::os::unix::fs::symlink("../../devices/virtual/net/eth0", dst.join("class/net/eth0"))
        .unwrap();
}

/// The flowlaned container's command line, expanded for a node.
fn daemon_command(env: &BTreeMap<String, String>) -> Vec<String> {
    let ds = deploy_doc("daemonset.yaml");
    let c = ds["spec"]["template"]["spec"]["containers"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "flowlaned")
        .unwrap()
        .clone();
    let mut cmd: Vec<String> = serde_yaml::from_value(c["command"].clone()).unwrap();
    let args: Vec<String> = serde_yaml::from_value(c["args"].clone()).unwrap();
    cmd.extend(args.iter().map(|a| kubelet_expand(a, env)));
    cmd
}

/// A node: its network namespace, the holder of its mount namespace, its
/// daemon.
struct Node {
    name: String,
    ip: String,
    cidr: String,
    /// Held for its lifetime: dropping it deletes the node.
    _net: Netns,
    holder: ChildGuard,
    host: NodeHost,
    daemon: Option<ChildGuard>,
    log: PathBuf,
}

impl Node {
    /// `nsenter` into the node's mount and network namespaces.
    fn command(&self, program: &str) -> Command {
        self.host.command(program)
    }

    fn sh(&self, script: &str) -> process::Output {
        self.host.sh(script)
    }

    fn status(&self) -> Option<Value> {
        let out = self.sh(&format!(
            "/opt/cni/bin/flowlane status --json --socket {SOCKET}"
        ));
        serde_json::from_str(&out.stdout).ok()
    }
}

struct Cluster {
    addrs: Addrs,
    underlay: Netns,
    api: FakeApi,
    work: TempDir,
    nodes: Vec<Node>,
    created_dirs: Vec<PathBuf>,
}

impl Cluster {
    fn new(addrs: Addrs) -> Cluster {
        let api_ip = format!("{}.1", addrs.underlay);
        // Every directory made on the host for a mount point, parents
        // first (removed in reverse order afterwards).
        let mut created_dirs = Vec::new();
        for d in NODE_DIRS {
            for a in Path::new(d)
                .ancestors()
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
            {
                if !a.exists() {
                    std::fs::create_dir(a).unwrap();
                    created_dirs.push(a.to_path_buf());
                }
            }
        }
        let underlay = Netns::new("dpu");
        underlay
            .ip(&["link", "add", "br0", "type", "bridge"])
            .expect_ok("br0");
        underlay
            .ip(&["addr", "add", &format!("{api_ip}/24"), "dev", "br0"])
            .expect_ok("addr");
        underlay
            .ip(&["link", "set", "br0", "up"])
            .expect_ok("br0 up");
        let listener = underlay.run(move || std::net::TcpListener::bind((api_ip, 0)).unwrap());
        let api = FakeApi::serve(listener, Vec::new());
        Cluster {
            addrs,
            underlay,
            api,
            work: TempDir::new("dpc"),
            nodes: Vec::new(),
            created_dirs,
        }
    }

    /// Provisions node `i` (what a machine has before the DaemonSet: a
    /// link to the underlay, the CNI reference plugins, a registered Node),
    /// then runs the DaemonSet's init script and daemon on it.
    fn join(&mut self, i: u32, kind: NodeKind) -> usize {
        let name = format!("dp-n{i}");
        let ip = format!("{}.{}", self.addrs.underlay, 10 + i);
        let cidr = format!("{}.{}.0/24", self.addrs.pods, 10 + i);
        let net = Netns::new("dpn");
        let veth = format!("dpv{}{i}", std::process::id() % 10_000);
        self.underlay
            .ip(&[
                "link",
                "add",
                &veth,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                net.name(),
            ])
            .expect_ok("veth");
        self.underlay
            .ip(&["link", "set", &veth, "master", "br0", "up"])
            .expect_ok("veth up");
        net.ip(&["addr", "add", &format!("{ip}/24"), "dev", "eth0"])
            .expect_ok("node addr");
        net.ip(&["link", "set", "eth0", "up"]).expect_ok("eth0 up");
        let sysfs = match kind {
            NodeKind::PrimaryRdma => {
                let tree = self.work.join(format!("{name}-sys"));
                rdma_sysfs(&tree, &ip);
                format!("mount --bind {} /sys; ", tree.display())
            }
            NodeKind::Primary | NodeKind::Chained => String::new(),
        };
        let mut holder = Command::new("ip");
        holder
            .args(["netns", "exec", net.name(), "unshare", "--mount"])
            .args(["--propagation", "private", "sh", "-c"])
            .arg(format!(
                "set -e; for d in {}; do mount -t tmpfs tmpfs $d; done; {sysfs}echo ready; exec sleep 100000",
                NODE_DIRS.join(" ")
            ))
            .stdout(Stdio::piped());
        let mut holder = ChildGuard::new(holder.spawn().unwrap());
        let mut line = String::new();
        BufReader::new(holder.child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "node {name}'s mount namespace");
        let log = self.work.join(format!("{name}.log"));
        let host = NodeHost {
            name: name.clone(),
            ip: ip.clone(),
            holder_pid: holder.pid(),
        };
        let mut node = Node {
            name: name.clone(),
            ip: ip.clone(),
            cidr: cidr.clone(),
            _net: net,
            holder,
            host,
            daemon: None,
            log,
        };
        // The machine's own CNI plugins (kubeadm installs them), the
        // cluster's lane key (the Secret, mode 0400).
        node.sh("cp /usr/lib/cni/portmap /opt/cni/bin/ && printf 'deploy_cluster: a lane key of 32 bytes or more' > /etc/flowlane-lane/key && chmod 0400 /etc/flowlane-lane/key")
            .expect_ok("provision");
        if kind == NodeKind::Chained {
            // The cluster's own CNI, there before flowlane: the reference
            // bridge with host-local IPAM on the node's pod CIDR.
            let other = json!({
                "cniVersion": "1.0.0",
                "name": "cluster-net",
                "plugins": [
                    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true,
                     "ipam": {"type": "host-local", "ranges": [[{"subnet": cidr}]],
                              "routes": [{"dst": "0.0.0.0/0"}]}},
                    {"type": "portmap", "capabilities": {"portMappings": true}}
                ]
            });
            node.sh(&format!(
                "cp /usr/lib/cni/bridge /usr/lib/cni/host-local /opt/cni/bin/ && printf '%s' '{other}' > /etc/cni/net.d/10-cluster.conflist"
            ))
            .expect_ok("the cluster's CNI");
        }
        self.api.put_node(node_object(&name, &[&cidr], &ip, None));
        self.install(&mut node, kind);
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    fn install(&self, node: &mut Node, kind: NodeKind) {
        let data = config_data(kind);
        let dir = self.work.join(&node.name);
        std::fs::create_dir_all(dir.join("sa")).unwrap();
        std::fs::write(dir.join("install.sh"), &data["install.sh"]).unwrap();
        std::fs::write(dir.join("tmpl"), &data["10-flowlane.conflist.tmpl"]).unwrap();
        std::fs::write(dir.join("sa/token"), "deploy-cluster-token").unwrap();
        std::fs::write(dir.join("sa/ca.crt"), &self.api.ca_pem).unwrap();
        let mut c = node.command("/bin/sh");
        c.arg(dir.join("install.sh"))
            .env("NODE_NAME", &node.name)
            .env("FLOWLANE_SRC_DIR", self.image_dir())
            .env("CONFLIST_TEMPLATE", dir.join("tmpl"))
            .env("CONFLIST_NAME", &data["CONFLIST_NAME"])
            .env("HOST_CNI_BIN_DIR", "/opt/cni/bin")
            .env("HOST_CNI_NET_DIR", "/etc/cni/net.d")
            .env("HOST_LIB_DIR", "/opt/flowlane/lib")
            .env("SERVICE_ACCOUNT_DIR", dir.join("sa"))
            .env("KUBERNETES_API", format!("https://{}", self.api.addr));
        if kind == NodeKind::Chained {
            // components/chained's DaemonSet patch: FLOWLANE_MODE and
            // CHAINED_CONFLIST; chain.sh and its entry where the ConfigMap
            // volume puts them.
            for key in ["chain.sh", "chained-entry.json"] {
                std::fs::write(dir.join(key), &data[key]).unwrap();
            }
            c.env("FLOWLANE_MODE", "chained")
                .env("CHAINED_CONFLIST", &data["CHAINED_CONFLIST"])
                .env("CHAIN_SCRIPT", dir.join("chain.sh"))
                .env("CHAINED_ENTRY", dir.join("chained-entry.json"))
                .env("CHAINED_WAIT_SECONDS", "5");
        }
        process::run(&mut c, Duration::from_secs(120))
            .unwrap()
            .expect_ok("install.sh");

        let mut env = data.clone();
        env.insert("NODE_NAME".into(), node.name.clone());
        env.insert("HOST_IP".into(), node.ip.clone());
        let argv = daemon_command(&env);
        // The image's path for the binaries is the build directory here.
        let exe = binaries::build_dir().join("flowlaned");
        let kc = self.api.kubeconfig(&dir);
        let log = std::fs::File::create(&node.log).unwrap();
        let mut d = node.command(exe.to_str().unwrap());
        d.args(&argv[1..])
            .envs(
                env.iter()
                    .filter(|(k, _)| k.starts_with("FLOWLANE_") || k == &"NODE_NAME"),
            )
            .env("KUBECONFIG", &kc)
            .env("RUST_LOG", "info")
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        node.daemon = Some(ChildGuard::new(d.spawn().unwrap()));
        assert!(
            wait::until(Duration::from_secs(20), || node.status().is_some()),
            "flowlaned on {} did not serve: {}",
            node.name,
            std::fs::read_to_string(&node.log).unwrap_or_default()
        );
    }

    /// A pod on node `n`, wired as the runtime wires it: every plugin of
    /// the installed conflist in order, each given the previous result.
    fn pod(&self, n: usize, tag: &str) -> String {
        let node = &self.nodes[n];
        let netns = format!("/run/netns/{tag}");
        node.sh(&format!("touch {netns} && unshare --net={netns} true"))
            .expect_ok("pod netns");
        let result = node
            .host
            .cni(
                "ADD",
                &netns,
                &format!("dp{tag}"),
                // As containerd and CRI-O pass them.
                &format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=train;K8S_POD_NAME={tag}"),
                None,
            )
            .unwrap_or_else(|e| panic!("CNI ADD on {}: {e}", node.name));
        result["ips"][0]["address"]
            .as_str()
            .unwrap()
            .split('/')
            .next()
            .unwrap()
            .to_string()
    }

    /// A command that runs `args` in pod `tag` of node `n` with flowlane
    /// injected as the webhook injects it (the installed preload library,
    /// the node's daemon socket).
    fn in_pod(&self, n: usize, tag: &str, args: &[&str]) -> Command {
        let node = &self.nodes[n];
        let mut c = node.command("nsenter");
        c.arg(format!("--net=/run/netns/{tag}"))
            .args([
                "--",
                "env",
                "LD_PRELOAD=/opt/flowlane/lib/libflowlane_preload.so",
            ])
            .arg(format!("FLOWLANE_SOCKET={SOCKET}"))
            .arg(binaries::flowlane())
            .args(args);
        c
    }

    /// Moves 2 MiB from pod (n_client, client) to (n_server, server) at
    /// `server_ip`; returns the client address the server saw, or why not.
    fn transfer(
        &self,
        client: (usize, &str),
        server: (usize, &str, &str),
        port: u16,
    ) -> Result<String, String> {
        let mut s = self.in_pod(
            server.0,
            server.1,
            &["cluster", "probe", "serve", &port.to_string()],
        );
        s.stdout(Stdio::piped()).stderr(Stdio::null());
        let mut srv = ChildGuard::new(s.spawn().unwrap());
        let mut lines = BufReader::new(srv.child.stdout.take().unwrap()).lines();
        if lines.next().and_then(Result::ok).as_deref() != Some("listening") {
            return Err("server did not listen".into());
        }
        let mut c = self.in_pod(
            client.0,
            client.1,
            &[
                "cluster",
                "probe",
                "send",
                &format!("{}:{port}", server.2),
                "2097152",
            ],
        );
        let out = process::run(&mut c, Duration::from_secs(60)).map_err(|e| e.to_string())?;
        if !out.success() {
            return Err(out.stderr);
        }
        let peer = lines
            .next()
            .and_then(Result::ok)
            .ok_or("server printed no peer")?;
        srv.terminate(Duration::from_secs(1));
        Ok(peer
            .strip_prefix("peer ")
            .and_then(|p| p.rsplit_once(':'))
            .map(|(ip, _)| ip.to_string())
            .unwrap_or(peer))
    }

    fn opened(&self, n: usize, lane: &str) -> u64 {
        self.nodes[n]
            .status()
            .and_then(|s| {
                let st = if s.get("lanes").is_some() {
                    s
                } else {
                    s["stats"].clone()
                };
                st["lanes"][lane]["connections_opened"].as_u64()
            })
            .unwrap_or(0)
    }

    fn logs(&self) -> String {
        self.nodes
            .iter()
            .map(|n| {
                format!(
                    "--- {}:\n{}",
                    n.name,
                    std::fs::read_to_string(&n.log).unwrap_or_default()
                )
            })
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(d) = &mut n.daemon {
                d.terminate(Duration::from_secs(2));
            }
            n.holder.terminate(Duration::from_secs(1));
        }
        self.nodes.clear();
        for d in self.created_dirs.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

#[test]
fn a_cluster_installed_by_the_manifests_routes_and_carries_pods() {
    let _turn = crate::turn::take(module_path!());
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = Cluster::new(ADDRS);
    let n1 = c.join(1, NodeKind::PrimaryRdma);
    let n2 = c.join(2, NodeKind::PrimaryRdma);

    // install.sh wrote each node's conflist from its own Node's podCIDRs.
    for n in [n1, n2] {
        let conf = c.nodes[n]
            .sh("cat /etc/cni/net.d/10-flowlane.conflist")
            .stdout;
        let conf: Value = serde_json::from_str(&conf).unwrap();
        assert_eq!(
            conf["plugins"][0]["ipam"]["ranges"],
            json!([[{"subnet": c.nodes[n].cidr}]])
        );
    }

    let a = c.pod(n1, "dpa");
    let _b = c.pod(n1, "dpb");
    let cc = c.pod(n2, "dpc");

    // Across nodes, with no route added by the test: flowlaned routes the
    // other nodes' pod CIDRs. The server sees the client pod's own address.
    let mut last = Err(String::new());
    let reached = wait::until(Duration::from_secs(30), || {
        last = c.transfer((n1, "dpa"), (n2, "dpc", &cc), 18_600);
        last.is_ok()
    });
    assert!(
        reached,
        "pod a (node 1) cannot reach pod c (node 2): {last:?}\n{}",
        c.logs()
    );
    assert_eq!(
        last.as_deref(),
        Ok(a.as_str()),
        "the server saw a NATed client"
    );

    // Both RDMA nodes published their lanes on their Node objects; once
    // each daemon's view has the other's, a cross-node connection rides
    // the relay (the client's daemon counts it), bytes checked end to end,
    // and the server still sees the client pod's own address.
    for n in [n1, n2] {
        c.assert_lane_published(n);
    }
    let mut port = 18_610;
    let rode = wait::until(Duration::from_secs(30), || {
        let before = c.opened(n1, "relay");
        port += 1;
        let seen = c.transfer((n1, "dpa"), (n2, "dpc", &cc), port);
        assert_eq!(seen.as_deref(), Ok(a.as_str()), "over the relay");
        c.opened(n1, "relay") > before
    });
    assert!(rode, "cross-node connection not on the relay\n{}", c.logs());
    assert!(
        c.opened(n2, "relay") > 0,
        "the server's daemon relayed nothing"
    );

    // Same node: shared memory.
    let shm_before = c.opened(n1, "shm");
    let b_ip = c.pod_ip(n1, "dpb");
    c.transfer((n1, "dpa"), (n1, "dpb", &b_ip), 18_601).unwrap();
    assert!(
        c.opened(n1, "shm") > shm_before,
        "same-node pair not on shm\n{}",
        c.logs()
    );

    // A node that joins later (no RDMA) becomes reachable from the others.
    let n3 = c.join(3, NodeKind::Primary);
    let d = c.pod(n3, "dpd");
    let mut last = Err(String::new());
    let reached = wait::until(Duration::from_secs(30), || {
        last = c.transfer((n1, "dpa"), (n3, "dpd", &d), 18_603);
        last.is_ok()
    });
    assert!(
        reached,
        "the joining node's pod is unreachable: {last:?}\n{}",
        c.logs()
    );

    // A node whose pods another CNI wires (reference bridge + host-local),
    // with flowlane chained into that conflist by components/chained: its
    // co-located pods get the shared-memory lane.
    let n4 = c.join(4, NodeKind::Chained);
    // The cluster CNI's routes to the other nodes' pods, as flannel's
    // host-gw backend installs them (the reference bridge routes nothing
    // between nodes; flowlaned does not in chained mode).
    for n in [n1, n2, n3] {
        let (cidr, via) = (c.nodes[n].cidr.clone(), c.nodes[n].ip.clone());
        c.nodes[n4]
            .sh(&format!("ip route add {cidr} via {via}"))
            .expect_ok("the cluster CNI's route");
    }
    let conf: Value = serde_json::from_str(
        &c.nodes[n4]
            .sh("cat /etc/cni/net.d/10-cluster.conflist")
            .expect_ok("chained conflist")
            .stdout,
    )
    .unwrap();
    let types: Vec<&str> = conf["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["type"].as_str())
        .collect();
    assert_eq!(types, ["bridge", "portmap", "flowlane"], "{conf}");
    let _e = c.pod(n4, "dpe");
    let f = c.pod(n4, "dpf");
    let shm_before = c.opened(n4, "shm");
    c.transfer((n4, "dpe"), (n4, "dpf", &f), 18_604).unwrap();
    assert!(
        c.opened(n4, "shm") > shm_before,
        "chained pods not on shm\n{}",
        c.logs()
    );

    // The primary nodes' daemons route to the chained node's pods within a
    // refresh round of its Node appearing (diag on them checks that route).
    let n4_cidr = c.nodes[n4].cidr.clone();
    for n in [n1, n2, n3] {
        let routed = wait::until(Duration::from_secs(30), || {
            c.nodes[n]
                .sh(&format!("ip route show {n4_cidr}"))
                .stdout
                .contains("via")
        });
        assert!(
            routed,
            "{} has no route to {n4_cidr}\n{}",
            c.nodes[n].name,
            c.logs()
        );
    }

    // diag with the DaemonSet's paths, on a primary and a chained node:
    // healthy. (The RDMA nodes' /sys is the fixture tree, without their
    // bridge: diag there would rightly miss it.)
    for n in [n3, n4] {
        let out = c.nodes[n].sh("/opt/cni/bin/flowlane diag --json");
        let report: Value = serde_json::from_str(&out.stdout).unwrap_or(Value::Null);
        assert_eq!(
            report["healthy"], true,
            "{}: {}",
            c.nodes[n].name, out.stdout
        );
        // It knows which node it is on, also where another CNI's config
        // holds the pod subnet.
        let nodes = report["sections"]
            .as_array()
            .and_then(|s| s.iter().find(|s| s["name"] == "nodes"))
            .cloned()
            .unwrap_or(Value::Null);
        let ids: Vec<&str> = nodes["findings"]
            .as_array()
            .map(|f| f.iter().filter_map(|f| f["id"].as_str()).collect())
            .unwrap_or_default();
        assert!(
            ids.contains(&"nodes.self") && !ids.contains(&"nodes.self_unknown"),
            "{}: {nodes}",
            c.nodes[n].name
        );
    }
}

impl Cluster {
    /// Node `n`'s daemon published its RDMA lane on its Node object.
    fn assert_lane_published(&self, n: usize) {
        let published = wait::until(Duration::from_secs(30), || {
            self.api.nodes().iter().any(|o| {
                o["metadata"]["name"] == self.nodes[n].name.as_str()
                    && o["metadata"]["annotations"]["flowlane.io/rdma-lane"].is_string()
            })
        });
        assert!(
            published,
            "{} published no lane\n{}",
            self.nodes[n].name,
            self.logs()
        );
    }

    /// What the image's /usr/local/lib/flowlane holds (the Dockerfile's
    /// COPY): the release binaries and ship.sh's files.
    fn image_dir(&self) -> PathBuf {
        let dir = self.work.join("image");
        if !dir.exists() {
            std::fs::create_dir_all(&dir).unwrap();
            for bin in ["flowlane", "flowlaned", "flowlane-cluster"] {
                std::os::unix::fs::symlink(binaries::build_dir().join(bin), dir.join(bin)).unwrap();
            }
            // The shipped directory (ship.sh): the preload library, the
            // injection's static probe and its no-op object.
            let shipped = binaries::build_dir().join("shipped");
            for file in [
                "libflowlane_preload.so",
                "libflowlane_noop.so",
                "flowlane-probe",
            ] {
                std::os::unix::fs::symlink(shipped.join(file), dir.join(file)).unwrap();
            }
        }
        dir
    }

    fn pod_ip(&self, n: usize, tag: &str) -> String {
        let out = self.nodes[n].sh(&format!(
            "nsenter --net=/run/netns/{tag} ip -4 -o addr show dev eth0"
        ));
        out.stdout
            .split_whitespace()
            .nth(3)
            .and_then(|a| a.split('/').next())
            .unwrap_or_default()
            .to_string()
    }
}

/// The DaemonSet's pod on a node, as the DaemonSet controller creates it and
/// the kubelet reports it (hostNetwork: its IP is the node's). The test runs
/// that pod's flowlaned itself ([`Cluster::install`]).
fn daemon_pod(node: &Node) -> Value {
    let ds: Value = serde_json::to_value(deploy_doc("daemonset.yaml")).unwrap();
    let template = &ds["spec"]["template"];
    let mut spec = template["spec"].clone();
    spec["nodeName"] = json!(node.name);
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("flowlane-node-{}", node.name), "namespace": "flowlane-system",
                     "labels": template["metadata"]["labels"], "uid": format!("uid-ds-{}", node.name)},
        "spec": spec,
        "status": {"phase": "Running", "podIP": node.ip, "podIPs": [{"ip": node.ip}],
                   "hostIP": node.ip,
                   "conditions": [{"type": "Ready", "status": "True"}]}
    })
}

/// `flowlane cluster check --kubernetes ARGS --json` from the underlay (where
/// the API server listens): its exit code and report.
fn check(c: &Cluster, kubeconfig: &Path, args: &[&str]) -> (i32, Value, String) {
    let mut cmd = c.underlay.command(binaries::flowlane().to_str().unwrap());
    cmd.args([
        "cluster",
        "check",
        "--kubernetes",
        "--json",
        "--timeout",
        "60",
    ])
    .arg("--kubeconfig")
    .arg(kubeconfig)
    .args(args);
    let out = process::run(&mut cmd, Duration::from_secs(300)).unwrap();
    let report = serde_json::from_str(&out.stdout).unwrap_or(Value::Null);
    let code = if out.success() { 0 } else { 1 };
    (code, report, format!("{}\n{}", out.stdout, out.stderr))
}

fn pair<'a>(report: &'a Value, kind: &str) -> &'a Value {
    report["pairs"]
        .as_array()
        .and_then(|p| p.iter().find(|p| p["kind"] == kind))
        .unwrap_or(&Value::Null)
}

#[test]
fn the_connectivity_check_through_the_api_server_names_each_pairs_lane() {
    let _turn = crate::turn::take(module_path!());
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = Cluster::new(CHECK_ADDRS);
    let n1 = c.join(1, NodeKind::PrimaryRdma);
    let n2 = c.join(2, NodeKind::PrimaryRdma);
    let n3 = c.join(3, NodeKind::Primary);

    // What `kubectl apply -k deploy/kubernetes` leaves in the API: the
    // namespace, the DaemonSet's pods (their daemons run above), the
    // webhook's MutatingWebhookConfiguration (answered by its own code).
    c.api
        .put_namespace(serde_json::to_value(deploy_doc("namespace.yaml")).unwrap());
    let webhook_docs = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/webhook.yaml"),
    )
    .unwrap();
    for doc in serde_yaml::Deserializer::from_str(&webhook_docs) {
        let v: Value = serde_json::to_value(serde_yaml::Value::deserialize(doc).unwrap()).unwrap();
        if v["kind"] == "MutatingWebhookConfiguration" {
            c.api.set_mutating_webhooks(v);
        }
    }
    for n in [n1, n2, n3] {
        c.api.put_pod(daemon_pod(&c.nodes[n]));
    }
    // The API server reaches pods over the underlay (the proxy subresource).
    let underlay = c.underlay.path().to_path_buf();
    c.api.set_pod_dialer(std::sync::Arc::new(move |addr| {
        let ns = std::fs::File::open(&underlay)?;
        std::thread::spawn(move || {
            flowlane_e2e::netns::enter(&ns).map_err(std::io::Error::other)?;
            std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        })
        .join()
        .map_err(|_| std::io::Error::other("dialer thread panicked"))?
    }));
    let logs = c.work.join("kubelet");
    std::fs::create_dir_all(&logs).unwrap();
    let kubelets: Vec<Kubelet> = [n1, n2, n3]
        .iter()
        .map(|&n| {
            Kubelet::start(
                c.api.state.clone(),
                c.nodes[n].host.clone(),
                c.image_dir(),
                logs.clone(),
            )
        })
        .collect();
    for n in [n1, n2] {
        c.assert_lane_published(n);
    }
    // ... and each RDMA node's daemon has the other's lane in its view.
    for (n, other) in [(n1, n2), (n2, n1)] {
        let other = c.nodes[other].name.clone();
        let seen = wait::until(Duration::from_secs(30), || {
            c.nodes[n].status().is_some_and(|s| {
                s["nodes"]["nodes"].as_array().is_some_and(|t| {
                    t.iter()
                        .any(|e| e["name"] == other.as_str() && e["rdma"].is_object())
                })
            })
        });
        assert!(
            seen,
            "{} does not see {other}'s lane\n{}",
            c.nodes[n].name,
            c.logs()
        );
    }
    let kc = c.api.kubeconfig(c.work.path());

    // The default pick: the two nodes that publish a lane.
    let (code, report, out) = check(&c, &kc, &[]);
    let logs_of_all = || format!("{out}\n{}", c.logs());
    assert_eq!(code, 0, "{}", logs_of_all());
    let same = pair(&report, "same-node");
    assert_eq!(same["client_node"], "dp-n1", "{out}");
    assert_eq!(same["server_node"], "dp-n1", "{out}");
    assert_eq!(same["expected"], "shm", "{out}");
    assert_eq!(same["lane"], "shm", "{out}");
    assert_eq!(same["bytes_ok"], true, "{out}");
    assert!(same["lane_bytes"].as_u64().unwrap() >= 8 << 20, "{out}");
    let cross = pair(&report, "cross-node");
    assert_eq!(
        (&cross["client_node"], &cross["server_node"]),
        (&json!("dp-n1"), &json!("dp-n2")),
        "{out}"
    );
    assert_eq!(cross["expected"], "relay", "{out}");
    assert_eq!(cross["lane"], "relay", "{out}");
    assert_eq!(
        cross["relay_transport"], "relay",
        "tcp-test's lane label: {out}"
    );
    assert_eq!(cross["ok"], true, "{out}");
    // No NAT between pods: the server saw the client pod's own address.
    assert_eq!(cross["peer_seen"], cross["client_ip"], "{out}");
    assert!(
        cross["client_ip"]
            .as_str()
            .unwrap()
            .starts_with("10.241.11."),
        "{out}"
    );

    // A node without a lane: the cross-node pair stays on TCP, says why,
    // and is no failure.
    let (code, report, out) = check(&c, &kc, &["--node-a", "dp-n1", "--node-b", "dp-n3"]);
    assert_eq!(code, 0, "{out}\n{}", c.logs());
    let cross = pair(&report, "cross-node");
    assert_eq!(cross["server_node"], "dp-n3", "{out}");
    assert_eq!(cross["expected"], "tcp", "{out}");
    assert_eq!(cross["lane"], "tcp", "{out}");
    assert_eq!(cross["ok"], true, "{out}");
    assert_eq!(cross["bytes_ok"], true, "{out}");
    assert!(
        cross["expected_because"]
            .as_str()
            .unwrap()
            .contains("dp-n3 publishes no RDMA lane"),
        "{out}"
    );
    assert!(
        !cross["tcp_reasons"].as_object().unwrap().is_empty(),
        "the daemons counted no fallback reason: {out}"
    );

    // Injection off (a namespace labelled flowlane.io/inject=disabled, which
    // neither webhook entry selects): TCP expected for both pairs, not a
    // failure; the namespace was there before, so it stays.
    c.api.put_namespace(json!({"metadata": {"name": "no-inject",
        "labels": {"flowlane.io/inject": "disabled"}}}));
    let (code, report, out) = check(&c, &kc, &["--namespace", "no-inject"]);
    assert_eq!(code, 0, "{out}\n{}", c.logs());
    for kind in ["same-node", "cross-node"] {
        let p = pair(&report, kind);
        assert_eq!(
            (&p["expected"], &p["lane"]),
            (&json!("tcp"), &json!("tcp")),
            "{out}"
        );
        assert!(
            p["expected_because"]
                .as_str()
                .unwrap()
                .contains("did not inject"),
            "{out}"
        );
    }

    // Nothing left behind: no pod in the API but the DaemonSet's, the
    // namespace it made is gone, no sandbox on any node.
    let left: Vec<String> = c
        .api
        .pods()
        .iter()
        .filter(|p| p["metadata"]["namespace"] != "flowlane-system")
        .map(|p| format!("{}/{}", p["metadata"]["namespace"], p["metadata"]["name"]))
        .collect();
    assert!(left.is_empty(), "pods left: {left:?}");
    let namespaces: Vec<Value> = c
        .api
        .namespaces()
        .iter()
        .map(|n| n["metadata"]["name"].clone())
        .collect();
    assert!(
        !namespaces.contains(&json!("flowlane-check")),
        "{namespaces:?}"
    );
    assert!(namespaces.contains(&json!("no-inject")), "{namespaces:?}");
    assert!(
        wait::until(Duration::from_secs(10), || kubelets
            .iter()
            .all(|k| k.running().is_empty())),
        "a kubelet still runs a pod"
    );
    for n in [n1, n2, n3] {
        let netns = c.nodes[n].sh("ls /run/netns").stdout;
        assert!(
            !netns.split_whitespace().any(|f| f.starts_with("kl")),
            "{}: {netns}",
            c.nodes[n].name
        );
    }
    drop(kubelets);
}
