//! A node as a network namespace ([`NsNode`]): its pods wired by the real
//! plugin run inside the node's namespace (flowlane as the main plugin, or
//! the reference `bridge` + `host-local` with flowlane chained), its state
//! directory, and its `flowlaned` started there (optionally with the relay
//! on the test transport) and waited for.
//!
//! Why one type: the Service suite (`services::SvcCluster`), the framework
//! suites (`frameworks::RelayPair`) and the relay suite (`relay::lane`)
//! each had a copy of this node; [`crate::ns_cluster`] builds their
//! clusters of it.

use crate::daemon;
use crate::process::ChildGuard;
use crate::shm::{build_dir, fresh_netns, pod_cmd, run_cni, sh, sh_ok, wait_listening, Bg, Pod};
use flowlane_lane::proto::Stats;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

/// The port of every test daemon's relay listener (`--lane-listen`).
pub const LANE_PORT: u16 = 7470;
/// How long a node's daemon may take to answer after its start.
const DAEMON_UP: Duration = Duration::from_secs(20);
/// The reference bridge plugin (Debian's containernetworking-plugins).
const REFERENCE_BRIDGE: &str = "/usr/lib/cni/bridge";

/// How the node's pods are wired.
#[derive(Debug, Clone)]
pub struct NetConf {
    /// The network's name (`name`) and its bridge (`bridge`).
    pub name: String,
    pub bridge: String,
    /// More keys of flowlane's configuration (e.g. `hairpinMode`).
    pub extra: serde_json::Map<String, serde_json::Value>,
    /// The conflist bridge + host-local → flowlane in chained mode instead
    /// of flowlane alone.
    pub chained: bool,
}

/// The relay part of a daemon's flags.
#[derive(Debug, Clone)]
struct Lanes {
    nodes_file: PathBuf,
    key: &'static [u8],
}

/// How a node's `flowlaned` runs, besides its state dir and socket.
#[derive(Debug, Clone)]
pub struct DaemonOpts {
    log_level: &'static str,
    service_cidr: Option<&'static str>,
    lanes: Option<Lanes>,
    args: Vec<String>,
    env: Vec<(&'static str, String)>,
}

impl DaemonOpts {
    /// At `log_level`, nothing else.
    pub fn new(log_level: &'static str) -> DaemonOpts {
        DaemonOpts {
            log_level,
            service_cidr: None,
            lanes: None,
            args: Vec::new(),
            env: Vec::new(),
        }
    }

    /// Serving the Services of `cidr` (`--service-cidr`).
    pub fn service_cidr(mut self, cidr: &'static str) -> DaemonOpts {
        self.service_cidr = Some(cidr);
        self
    }

    /// With the relay on `--lane-transport tcp-test` over the underlay: the
    /// node table `nodes_file`, the cluster's lane `key` (the same bytes on
    /// every node).
    pub fn lanes(mut self, nodes_file: PathBuf, key: &'static [u8]) -> DaemonOpts {
        self.lanes = Some(Lanes { nodes_file, key });
        self
    }

    /// More flags, after all the others.
    pub fn args(mut self, args: Vec<String>) -> DaemonOpts {
        self.args = args;
        self
    }

    /// `name=value` in the daemon's environment, on top of the test's.
    pub fn env(mut self, name: &'static str, value: &str) -> DaemonOpts {
        self.env.push((name, value.to_string()));
        self
    }
}

/// One node: its namespace, pods, state directory and daemon. Dropping it
/// stops the daemon, removes the pods (CNI DEL) and the namespaces.
pub struct NsNode {
    /// The node's name in the nodes file (`n0`, `n1`).
    pub name: String,
    pub netns: String,
    /// How its pods are wired.
    net: NetConf,
    pub cidr: String,
    pub underlay: Ipv4Addr,
    pub dir: PathBuf,
    pub pods: Vec<Pod>,
    /// The options of the last [`NsNode::start_daemon`] (for a restart).
    opts: Option<DaemonOpts>,
    /// The running daemon, if any.
    pub daemon: Option<ChildGuard>,
}

impl NsNode {
    /// A fresh namespace `netns` with `sysctls` set in it, and the empty
    /// directory `dir`; no pods, no daemon yet.
    pub fn new(
        name: String,
        netns: String,
        cidr: String,
        underlay: Ipv4Addr,
        dir: PathBuf,
        net: NetConf,
        sysctls: &[&str],
    ) -> NsNode {
        fresh_netns(&netns);
        for sysctl in sysctls {
            sh_ok(&["ip", "netns", "exec", &netns, "sysctl", "-qw", sysctl]);
        }
        std::fs::create_dir_all(&dir).unwrap();
        NsNode {
            name,
            netns,
            net,
            cidr,
            underlay,
            dir,
            pods: Vec::new(),
            opts: None,
            daemon: None,
        }
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.join("d.sock")
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("state")
    }

    /// This node's end of the underlay link.
    pub fn underlay_end(&self) -> Underlay<'_> {
        Underlay {
            netns: &self.netns,
            addr: self.underlay,
            cidr: &self.cidr,
        }
    }

    fn log_file(&self) -> PathBuf {
        self.dir.join("daemon.log")
    }

    /// flowlane's network configuration as the main plugin.
    pub fn cni_conf(&self) -> String {
        let mut conf = serde_json::json!({
            "cniVersion": "1.0.0", "name": self.net.name, "type": "flowlane",
            "bridge": self.net.bridge, "isGateway": true, "isDefaultGateway": true,
            "stateDir": self.state_dir(), "daemonSocket": self.socket(),
            "ipam": {"type": "flowlane", "ranges": [[{"subnet": self.cidr}]],
                     "dataDir": self.dir.join("ipam")},
        });
        for (k, v) in &self.net.extra {
            conf[k] = v.clone();
        }
        conf.to_string()
    }

    /// The plugin(s), run inside the node's namespace as a runtime would,
    /// for the pod namespace `pod_ns` (container `id`).
    pub fn cni(&self, command: &str, pod_ns: &str, id: &str) -> Output {
        if self.net.chained {
            return self.cni_chained(command, pod_ns, id);
        }
        let flowlane = build_dir().join("flowlane");
        self.run_plugin(&flowlane, &self.cni_conf(), command, pod_ns, id)
    }

    fn run_plugin(
        &self,
        binary: &Path,
        conf: &str,
        command: &str,
        pod_ns: &str,
        id: &str,
    ) -> Output {
        let mut plugin = Command::new("ip");
        plugin.args(["netns", "exec", &self.netns]).arg(binary);
        run_cni(plugin, conf, command, pod_ns, id).expect("run the CNI plugin")
    }

    /// The conflist bridge → flowlane (chained) as libcni runs it: ADD in
    /// order with bridge's result as flowlane's prevResult, DEL in reverse.
    fn cni_chained(&self, command: &str, pod_ns: &str, id: &str) -> Output {
        let bridge = serde_json::json!({
            "cniVersion": "1.0.0", "name": self.net.name, "type": "bridge", "bridge": self.net.bridge,
            "isGateway": true, "isDefaultGateway": true,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": self.cidr}]],
                     "dataDir": self.dir.join("ipam")},
        })
        .to_string();
        let flowlane = |prev: Option<serde_json::Value>| {
            serde_json::json!({
                "cniVersion": "1.0.0", "name": self.net.name, "type": "flowlane", "mode": "chained",
                "stateDir": self.state_dir(), "daemonSocket": self.socket(), "prevResult": prev,
            })
            .to_string()
        };
        let (bridge_bin, flowlane_bin) =
            (Path::new(REFERENCE_BRIDGE), build_dir().join("flowlane"));
        if command == "ADD" {
            let out = self.run_plugin(bridge_bin, &bridge, command, pod_ns, id);
            if !out.status.success() {
                return out;
            }
            let prev = serde_json::from_slice(&out.stdout).expect("bridge result");
            return self.run_plugin(&flowlane_bin, &flowlane(Some(prev)), command, pod_ns, id);
        }
        let out = self.run_plugin(&flowlane_bin, &flowlane(None), command, pod_ns, id);
        if !out.status.success() {
            return out;
        }
        self.run_plugin(bridge_bin, &bridge, command, pod_ns, id)
    }

    /// One more pod (namespace `<netns>p<i>`), wired by the plugin.
    pub fn add_pod(&mut self) {
        let ns = format!("{}p{}", self.netns, self.pods.len());
        fresh_netns(&ns);
        let id = format!("{ns}-{}", std::process::id());
        let out = self.cni("ADD", &ns, &id);
        assert!(
            out.status.success(),
            "CNI ADD in {}: {}",
            self.netns,
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let ip = v["ips"][0]["address"]
            .as_str()
            .and_then(|a| a.split('/').next()?.parse().ok())
            .expect("pod IP in the CNI result");
        self.pods.push(Pod {
            netns: ns,
            ip,
            container_id: id,
        });
    }

    /// Starts the node's daemon with `opts` (the lane key, if any, written
    /// to `<dir>/lane.key` first) and waits until it answers.
    pub fn start_daemon(&mut self, opts: DaemonOpts) {
        let mut cmd = daemon::command(Some(&self.netns), &self.state_dir(), &self.socket());
        cmd.args(["--log-level", opts.log_level]);
        if let Some(cidr) = opts.service_cidr {
            cmd.args(["--service-cidr", cidr]);
        }
        if let Some(lanes) = &opts.lanes {
            let key = daemon::write_lane_key(self.dir.join("lane.key"), lanes.key);
            cmd.args(["--lane-listen", &format!("{}:{LANE_PORT}", self.underlay)])
                // The test double, said explicitly (the default is rdma).
                .args(["--lane-transport", "tcp-test"])
                .arg("--lane-key-file")
                .arg(key)
                .arg("--nodes-file")
                .arg(&lanes.nodes_file)
                .args(["--node-name", &self.name]);
        }
        cmd.args(&opts.args);
        cmd.envs(opts.env.iter().map(|(k, v)| (*k, v)));
        self.daemon = Some(daemon::start(
            cmd,
            &self.socket(),
            &self.log_file(),
            DAEMON_UP,
        ));
        self.opts = Some(opts);
    }

    /// Starts the daemon again as it was last started.
    pub fn restart_daemon(&mut self) {
        let opts = self.opts.clone().expect("the daemon was started before");
        self.start_daemon(opts);
    }

    /// SIGKILL (a crash) of the running daemon.
    pub fn kill_daemon(&mut self) {
        let mut d = self.daemon.take().expect("daemon running");
        d.child.kill().unwrap();
        d.child.wait().unwrap();
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_file()).unwrap_or_default()
    }

    /// The daemon's counters, if it answers.
    pub fn stats_opt(&self) -> Option<Stats> {
        daemon::stats_opt(&self.socket())
    }

    /// The daemon's counters.
    pub fn stats(&self) -> Stats {
        self.stats_opt().expect("daemon stats")
    }

    /// (opened, closed, bytes) of the relay lane.
    pub fn relay(&self) -> (u64, u64, u64) {
        self.stats()
            .lanes
            .get("relay")
            .map(|l| (l.connections_opened, l.connections_closed, l.bytes))
            .unwrap_or_default()
    }

    /// A command run inside `pod` (of this node), with the preload library
    /// talking to this node's daemon if `preload`.
    pub fn cmd(&self, pod: &Pod, preload: bool, argv: &[&str]) -> Command {
        pod_cmd(pod, preload, &self.socket(), argv)
    }

    /// Starts the server `argv` in `pod` (see [`NsNode::cmd`]) and waits
    /// until it listens on `port`.
    pub fn serve(&self, pod: &Pod, preload: bool, port: u16, argv: &[&str]) -> Bg {
        let srv = Bg::spawn(self.cmd(pod, preload, argv));
        wait_listening(pod, port);
        srv
    }
}

impl Drop for NsNode {
    fn drop(&mut self) {
        if let Some(mut d) = self.daemon.take() {
            d.terminate(Duration::from_secs(5));
        }
        for p in std::mem::take(&mut self.pods) {
            let _ = self.cni("DEL", &p.netns, &p.container_id);
            let _ = sh(&["ip", "netns", "del", &p.netns]);
        }
        let _ = sh(&["ip", "netns", "del", &self.netns]);
    }
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
