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
//! Shown: pod-to-pod across nodes with no route added by the test; the
//! server sees the client pod's own address (no NAT between pods); the
//! same-node pair on shared memory; a node that joins later is reachable;
//! `flowlane diag` on a node is healthy. Not shown here: cross-node
//! connections on the relay. A daemon in Kubernetes mode publishes a lane
//! only with a usable RDMA port, which this kernel cannot have; the relay
//! between daemons is shown by relay_lane (node table from a file, the
//! tcp-test transport) and relay_rdma (Soft-RoCE guests).
//!
//! Names: netns `dpu*` (underlay), `dpn*` (nodes); pods 10.234.(10+i).0/24.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use flowlane_e2e::binaries;
use flowlane_e2e::fake_api::{node_object, FakeApi};
use flowlane_e2e::fsutil::TempDir;
use flowlane_e2e::netns::Netns;
use flowlane_e2e::process::{self, ChildGuard};
use flowlane_e2e::wait;
use serde_json::{json, Value};

const API_IP: &str = "10.235.0.1";
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

/// The ConfigMap's data, with the operator's two settings of this test.
fn config_data() -> BTreeMap<String, String> {
    let cm = deploy_doc("configmap.yaml");
    let mut data: BTreeMap<String, String> = serde_yaml::from_value(cm["data"].clone()).unwrap();
    data.insert("FLOWLANE_NODES_REFRESH".into(), "2".into());
    data.insert("FLOWLANE_LANE_TRANSPORT".into(), "tcp-test".into());
    data
}

/// `$(VAR)` expanded as the kubelet expands container args.
fn kubelet_expand(s: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find("$(") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        match after.find(')') {
            Some(j) if env.contains_key(&after[..j]) => {
                out.push_str(&env[&after[..j]]);
                rest = &after[j + 1..];
            }
            _ => {
                out.push_str("$(");
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
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
    daemon: Option<ChildGuard>,
    log: PathBuf,
}

impl Node {
    /// `nsenter` into the node's mount and network namespaces.
    fn command(&self, program: &str) -> Command {
        let mut c = Command::new("nsenter");
        c.args([
            "-t",
            &self.holder.pid().to_string(),
            "--mount",
            "--net",
            "--",
        ])
        .arg(program)
        .env_remove("CNI_COMMAND");
        c
    }

    fn sh(&self, script: &str) -> process::Output {
        let mut c = self.command("sh");
        c.args(["-c", script]);
        process::run(&mut c, Duration::from_secs(60)).unwrap()
    }

    fn status(&self) -> Option<Value> {
        let out = self.sh(&format!(
            "/opt/cni/bin/flowlane status --json --socket {SOCKET}"
        ));
        serde_json::from_str(&out.stdout).ok()
    }
}

struct Cluster {
    underlay: Netns,
    api: FakeApi,
    work: TempDir,
    nodes: Vec<Node>,
    created_dirs: Vec<PathBuf>,
}

impl Cluster {
    fn new() -> Cluster {
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
            .ip(&["addr", "add", &format!("{API_IP}/24"), "dev", "br0"])
            .expect_ok("addr");
        underlay
            .ip(&["link", "set", "br0", "up"])
            .expect_ok("br0 up");
        let listener = underlay.run(|| std::net::TcpListener::bind((API_IP, 0)).unwrap());
        let api = FakeApi::serve(listener, Vec::new());
        Cluster {
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
    fn join(&mut self, i: u32) -> usize {
        let name = format!("dp-n{i}");
        let ip = format!("10.235.0.{}", 10 + i);
        let cidr = format!("10.234.{}.0/24", 10 + i);
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
        let mut holder = Command::new("ip");
        holder
            .args(["netns", "exec", net.name(), "unshare", "--mount"])
            .args(["--propagation", "private", "sh", "-c"])
            .arg(format!(
                "set -e; for d in {}; do mount -t tmpfs tmpfs $d; done; echo ready; exec sleep 100000",
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
        let mut node = Node {
            name: name.clone(),
            ip: ip.clone(),
            cidr: cidr.clone(),
            _net: net,
            holder,
            daemon: None,
            log,
        };
        // The machine's own CNI plugins (kubeadm installs them), the
        // cluster's lane key (the Secret, mode 0400).
        node.sh("cp /usr/lib/cni/portmap /opt/cni/bin/ && printf 'deploy_cluster: a lane key of 32 bytes or more' > /etc/flowlane-lane/key && chmod 0400 /etc/flowlane-lane/key")
            .expect_ok("provision");
        self.api.put_node(node_object(&name, &[&cidr], &ip, None));
        self.install(&mut node);
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    fn install(&self, node: &mut Node) {
        let data = config_data();
        let dir = self.work.join(&node.name);
        std::fs::create_dir_all(dir.join("sa")).unwrap();
        std::fs::write(dir.join("install.sh"), &data["install.sh"]).unwrap();
        std::fs::write(dir.join("tmpl"), &data["10-flowlane.conflist.tmpl"]).unwrap();
        std::fs::write(dir.join("sa/token"), "deploy-cluster-token").unwrap();
        std::fs::write(dir.join("sa/ca.crt"), &self.api.ca_pem).unwrap();
        let mut c = node.command("/bin/sh");
        c.arg(dir.join("install.sh"))
            .env("NODE_NAME", &node.name)
            .env("FLOWLANE_SRC_DIR", binaries::build_dir())
            .env("CONFLIST_TEMPLATE", dir.join("tmpl"))
            .env("CONFLIST_NAME", &data["CONFLIST_NAME"])
            .env("HOST_CNI_BIN_DIR", "/opt/cni/bin")
            .env("HOST_CNI_NET_DIR", "/etc/cni/net.d")
            .env("HOST_LIB_DIR", "/opt/flowlane/lib")
            .env("SERVICE_ACCOUNT_DIR", dir.join("sa"))
            .env("KUBERNETES_API", format!("https://{}", self.api.addr));
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
        let conflist: Value = serde_json::from_str(
            &node
                .sh("cat /etc/cni/net.d/10-flowlane.conflist")
                .expect_ok("conflist")
                .stdout,
        )
        .unwrap();
        let mut prev: Option<Value> = None;
        for plugin in conflist["plugins"].as_array().unwrap() {
            let mut conf = plugin.clone();
            conf["cniVersion"] = conflist["cniVersion"].clone();
            conf["name"] = conflist["name"].clone();
            if let Some(p) = &prev {
                conf["prevResult"] = p.clone();
            }
            let ty = plugin["type"].as_str().unwrap();
            let mut c = node.command(&format!("/opt/cni/bin/{ty}"));
            c.env("CNI_COMMAND", "ADD")
                .env("CNI_CONTAINERID", format!("dp{tag}"))
                .env("CNI_NETNS", &netns)
                .env("CNI_IFNAME", "eth0")
                .env("CNI_PATH", "/opt/cni/bin")
                .env(
                    "CNI_ARGS",
                    format!("K8S_POD_NAMESPACE=train;K8S_POD_NAME={tag}"),
                );
            let out = process::run_with_input(
                &mut c,
                conf.to_string().as_bytes(),
                Duration::from_secs(60),
            )
            .unwrap()
            .expect_ok(&format!("CNI ADD {ty} on {}", node.name));
            prev = Some(serde_json::from_str(&out.stdout).unwrap());
        }
        let result = prev.unwrap();
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
    let mut c = Cluster::new();
    let n1 = c.join(1);
    let n2 = c.join(2);

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

    // Same node: shared memory.
    let shm_before = c.opened(n1, "shm");
    let b_ip = c.pod_ip(n1, "dpb");
    c.transfer((n1, "dpa"), (n1, "dpb", &b_ip), 18_601).unwrap();
    assert!(
        c.opened(n1, "shm") > shm_before,
        "same-node pair not on shm\n{}",
        c.logs()
    );

    // A node that joins later becomes reachable from the others.
    let n3 = c.join(3);
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

    // diag on a node, with the DaemonSet's paths: healthy.
    let out = c.nodes[n1].sh("/opt/cni/bin/flowlane diag --json");
    let report: Value = serde_json::from_str(&out.stdout).unwrap_or(Value::Null);
    assert_eq!(report["healthy"], true, "{}", out.stdout);
}

impl Cluster {
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
