//! Harness for the shared-memory lane tests: one node (a bridge, pods as
//! network namespaces wired by the real `flowlane` CNI plugin, its own
//! `flowlaned`), programs run in pods with the preload library, and the
//! daemon's counters to prove which lane carried the bytes.
//!
//! Names use the prefix `fls`, subnets come from 10.202.128.0/17 (one /24
//! per node; a suite may pick its own second octet, `Node::new_in`).
//! Everything is removed on drop, also when a test panics.

use flowlane_lane::proto::Stats;
use std::io::Write;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Heavy tests (throughput, many connections) take this so that at most one
/// runs at a time on the 2-core machine.
pub static HEAVY: Mutex<()> = Mutex::new(());

/// Locks [`HEAVY`], ignoring poisoning by an earlier failed test.
pub fn heavy() -> std::sync::MutexGuard<'static, ()> {
    HEAVY.lock().unwrap_or_else(|e| e.into_inner())
}

/// The `<target>/release` directory holding the workspace's artifacts.
pub fn build_dir() -> PathBuf {
    crate::binaries::build_dir()
}

/// The preload library under test.
pub fn preload_lib() -> PathBuf {
    // A benchmark may compare another build of the library.
    if let Some(lib) = std::env::var_os("FLOWLANE_PRELOAD_LIB") {
        return PathBuf::from(lib);
    }
    crate::binaries::workspace_artifact("libflowlane_preload.so")
}

/// Runs a command; its output (for callers that tolerate failure).
pub fn sh(args: &[&str]) -> std::process::Output {
    Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("{args:?}: {e}"))
}

/// Runs a command that must succeed.
pub fn sh_ok(args: &[&str]) {
    let o = sh(args);
    assert!(
        o.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A fresh network namespace `ns` (one left by an earlier run is deleted
/// first) with its loopback up.
pub fn fresh_netns(ns: &str) {
    let _ = sh(&["ip", "netns", "del", ns]);
    sh_ok(&["ip", "netns", "add", ns]);
    sh_ok(&["ip", "-n", ns, "link", "set", "lo", "up"]);
}

/// Runs the CNI plugin as a runtime does: `plugin` (the `flowlane` binary,
/// or a command that runs it, e.g. inside a node's namespace) gets
/// `command` for container `id` in the pod namespace `pod_ns` (interface
/// eth0) and the network configuration `conf` on its stdin.
pub fn run_cni(
    mut plugin: Command,
    conf: &str,
    command: &str,
    pod_ns: &str,
    id: &str,
) -> std::io::Result<std::process::Output> {
    let mut child = plugin
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", id)
        .env("CNI_NETNS", format!("/var/run/netns/{pod_ns}"))
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", "/usr/lib/cni")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    child.stdin.take().unwrap().write_all(conf.as_bytes())?;
    child.wait_with_output()
}

/// A pod: a named network namespace with one address on the node's bridge.
#[derive(Debug, Clone)]
pub struct Pod {
    pub netns: String,
    pub ip: Ipv4Addr,
    pub container_id: String,
}

/// `argv` run inside `pod`, with the preload library talking to the
/// daemon on `socket` if `preload` (`ip netns exec` and `env` exec it in
/// place: the child's pid is the program's).
pub fn pod_cmd(pod: &Pod, preload: bool, socket: &Path, argv: &[&str]) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", &pod.netns, "env"]);
    if preload {
        c.arg(format!("LD_PRELOAD={}", preload_lib().display()));
        c.arg(format!("FLOWLANE_SOCKET={}", socket.display()));
    }
    c.args(argv);
    c
}

/// A node: bridge, pods, state directory, daemon.
pub struct Node {
    pub bridge: String,
    pub dir: PathBuf,
    pub subnet: u8,
    /// Second octet of the node's 10.x.subnet.0/24 (202 unless a suite
    /// asks for its own range, see [`Node::new_in`]).
    pub net: u8,
    pub pods: Vec<Pod>,
    daemon: Option<crate::process::ChildGuard>,
    /// Owns `dir`: removed after `drop` has stopped the daemon and removed
    /// the pods (fields drop after the body), unless `FLS_KEEP` is set.
    _dir: crate::fsutil::TempDir,
    /// How the pods were wired: "cni" (the real plugin) or "ip" (fallback).
    pub wiring: &'static str,
}

impl Node {
    /// A node tagged `tag` (≤ 5 chars) with `pods` pods and a running daemon.
    pub fn new(tag: &str, pods: usize) -> Node {
        Node::new_in(tag, pods, 202)
    }

    /// As [`Node::new`], with the pods in 10.`net`.x.0/24 (a suite's own
    /// range, so that it cannot collide with other suites running at once).
    pub fn new_in(tag: &str, pods: usize, net: u8) -> Node {
        let (n, bridge) = crate::names::host_node(tag);
        // Mix in the pid so a crashed earlier run's leftovers are less
        // likely to collide.
        let subnet = ((n + std::process::id()) % 120) as u8 + 128;
        let tmp = crate::fsutil::TempDir::fresh(
            &format!("fls-{tag}-{}-{n}", std::process::id()),
            "FLS_KEEP",
        );
        let dir = tmp.path().to_path_buf();
        let mut node = Node {
            bridge,
            dir,
            _dir: tmp,
            subnet,
            net,
            pods: Vec::new(),
            daemon: None,
            wiring: "ip",
        };
        let _ = sh(&["ip", "link", "del", &node.bridge]);
        for i in 0..pods {
            let pod = node.add_pod(&format!("{}p{i}", &node.bridge[..node.bridge.len() - 1]));
            node.pods.push(pod);
        }
        node.start_daemon();
        node
    }

    /// One more pod, wired like the first ones (the daemon learns it from
    /// the plugin's poke); its index in `pods`.
    pub fn add_extra_pod(&mut self) -> usize {
        let ns = format!(
            "{}x{}",
            &self.bridge[..self.bridge.len() - 1],
            self.pods.len()
        );
        let pod = self.add_pod(&ns);
        self.pods.push(pod);
        self.pods.len() - 1
    }

    /// Removes pod `i` (CNI DEL, then its namespace) and forgets it.
    pub fn remove_pod(&mut self, i: usize) {
        let p = self.pods.remove(i);
        if self.wiring == "cni" {
            let _ = self.cni("DEL", &p.netns, &p.container_id);
        }
        let _ = sh(&["ip", "netns", "del", &p.netns]);
    }

    /// What this node's peer table says about `ip` now (`None`: no table).
    pub fn peer_table_says(
        &self,
        ip: std::net::IpAddr,
    ) -> Option<flowlane_lane::peer_table::Verdict> {
        let path = flowlane_lane::peer_table::path_for(&self.socket());
        let m = flowlane_lane::peer_table::Mapped::open_read_only(&path).ok()?;
        Some(m.table().lookup(ip))
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("state")
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.join("d.sock")
    }

    fn cni_conf(&self) -> String {
        serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "flsnet",
            "type": "flowlane",
            "bridge": self.bridge,
            "isGateway": true,
            "stateDir": self.state_dir(),
            "daemonSocket": self.socket(),
            "ipam": {
                "type": "flowlane",
                "ranges": [[{"subnet": format!("10.{}.{}.0/24", self.net, self.subnet)}]],
                "dataDir": self.dir.join("ipam"),
            }
        })
        .to_string()
    }

    fn cni(&self, command: &str, pod_ns: &str, id: &str) -> std::io::Result<std::process::Output> {
        let plugin = Command::new(build_dir().join("flowlane"));
        run_cni(plugin, &self.cni_conf(), command, pod_ns, id)
    }

    fn add_pod(&mut self, ns: &str) -> Pod {
        fresh_netns(ns);
        let id = format!("{ns}-{}", std::process::id());
        // The real plugin, exactly as a runtime runs it.
        if let Ok(out) = self.cni("ADD", ns, &id) {
            if out.status.success() {
                if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&out.stdout) {
                    let ip = v["ips"][0]["address"]
                        .as_str()
                        .and_then(|a| a.split('/').next()?.parse().ok());
                    if let Some(ip) = ip {
                        self.wiring = "cni";
                        return Pod {
                            netns: ns.to_string(),
                            ip,
                            container_id: id,
                        };
                    }
                }
            }
            if self.pods.is_empty() {
                eprintln!(
                    "shm harness: flowlane CNI ADD failed, wiring with ip: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        self.add_pod_manually(ns, id)
    }

    /// Fallback wiring (when the plugin is unavailable): veth into the
    /// bridge, address, default route, and the registry entry the plugin
    /// would have written.
    fn add_pod_manually(&mut self, ns: &str, id: String) -> Pod {
        if !sh(&["ip", "link", "show", &self.bridge]).status.success() {
            sh_ok(&["ip", "link", "add", &self.bridge, "type", "bridge"]);
            sh_ok(&[
                "ip",
                "addr",
                "add",
                &format!("10.{}.{}.1/24", self.net, self.subnet),
                "dev",
                &self.bridge,
            ]);
            sh_ok(&["ip", "link", "set", &self.bridge, "up"]);
        }
        let i = self.pods.len() as u8;
        let ip = Ipv4Addr::new(10, self.net, self.subnet, 10 + i);
        let host = format!("{}h{i}", &self.bridge[..self.bridge.len() - 1]);
        let _ = sh(&["ip", "link", "del", &host]);
        sh_ok(&[
            "ip", "link", "add", &host, "type", "veth", "peer", "name", "eth0", "netns", ns,
        ]);
        sh_ok(&["ip", "link", "set", &host, "master", &self.bridge, "up"]);
        sh_ok(&[
            "ip",
            "-n",
            ns,
            "addr",
            "add",
            &format!("{ip}/24"),
            "dev",
            "eth0",
        ]);
        sh_ok(&["ip", "-n", ns, "link", "set", "eth0", "up"]);
        sh_ok(&[
            "ip",
            "-n",
            ns,
            "route",
            "add",
            "default",
            "via",
            &format!("10.{}.{}.1", self.net, self.subnet),
        ]);
        let path = format!("/var/run/netns/{ns}");
        let inode = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&path).unwrap());
        let reg = flowlane_registry::Registry::new(self.state_dir());
        reg.put(&flowlane_registry::Attachment {
            network: "flsnet".into(),
            container_id: id.clone(),
            ifname: "eth0".into(),
            netns: path,
            netns_inode: inode,
            ips: vec![format!("{ip}/24")],
            mac: String::new(),
            pod_namespace: None,
            pod_name: None,
            pod_uid: None,
            created_unix: flowlane_registry::now_unix(),
        })
        .unwrap();
        Pod {
            netns: ns.to_string(),
            ip,
            container_id: id,
        }
    }

    /// Starts `flowlaned` for this node and waits until it answers.
    pub fn start_daemon(&mut self) {
        assert!(self.daemon.is_none());
        let log = self.dir.join("daemon.log");
        let _ = std::fs::remove_file(&log);
        let mut cmd = crate::daemon::command(None, &self.state_dir(), &self.socket());
        // Debug by default (test failures show what the daemon did);
        // benchmarks run it at the production level (`FLS_DAEMON_LOG`).
        let level = std::env::var("FLS_DAEMON_LOG").unwrap_or_else(|_| "debug".into());
        cmd.args(["--log-level", &level]);
        let d = crate::daemon::start(cmd, &self.socket(), &log, Duration::from_secs(20));
        self.daemon = Some(d);
    }

    /// Stops the daemon (SIGTERM, up to 10 s to exit, then SIGKILL).
    pub fn stop_daemon(&mut self) {
        if let Some(mut d) = self.daemon.take() {
            d.terminate(Duration::from_secs(10));
        }
    }

    /// The daemon's pid, if running.
    pub fn daemon_pid(&self) -> Option<u32> {
        self.daemon.as_ref().map(|c| c.pid())
    }

    pub fn daemon_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("daemon.log")).unwrap_or_default()
    }

    fn stats_opt(&self) -> Option<Stats> {
        crate::daemon::stats_opt(&self.socket())
    }

    /// The daemon's counters.
    pub fn stats(&self) -> Stats {
        self.stats_opt().expect("daemon stats")
    }

    /// Shared-memory connections opened so far.
    pub fn shm_opened(&self) -> u64 {
        self.stats()
            .lanes
            .get("shm")
            .map(|l| l.connections_opened)
            .unwrap_or(0)
    }

    /// The Python echo pair with the preload library: the server in
    /// `server`, the client in `client` sending `bytes` to `port` (both
    /// directions at once, half-close); panics unless both succeed.
    pub fn python_echo(&self, client: &Pod, server: &Pod, port: u16, bytes: u64) {
        use crate::shm_scripts::{ECHO_CLIENT, ECHO_SERVER, PYTHON};
        let t = Duration::from_secs(120);
        let port = port.to_string();
        let srv = Bg::spawn(self.cmd(server, true, &[PYTHON, "-c", ECHO_SERVER, &port]));
        wait_listening(server, port.parse().unwrap());
        let (ip, n) = (server.ip.to_string(), bytes.to_string());
        let out = run_ok(
            self.cmd(
                client,
                true,
                &[PYTHON, "-c", ECHO_CLIENT, &ip, &port, &n, "1"],
            ),
            t,
            "echo client",
        );
        assert!(out.starts_with(&format!("ok {n}")), "{out}");
        let (st, _, err) = srv.finish(t);
        assert!(st.is_some_and(|s| s.success()), "server: {err}");
    }

    /// A command run inside `pod`, with the preload library if `preload`.
    pub fn cmd(&self, pod: &Pod, preload: bool, argv: &[&str]) -> Command {
        pod_cmd(pod, preload, &self.socket(), argv)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop_daemon();
        let pods = std::mem::take(&mut self.pods);
        for p in &pods {
            if self.wiring == "cni" {
                let _ = self.cni("DEL", &p.netns, &p.container_id);
            }
            let _ = sh(&["ip", "netns", "del", &p.netns]);
        }
        let _ = sh(&["ip", "link", "del", &self.bridge]);
    }
}

/// A background process killed (and reaped) on drop.
pub struct Bg(pub Child);

impl Bg {
    pub fn spawn(mut cmd: Command) -> Bg {
        Bg(cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn"))
    }

    /// The pid of the program itself (`ip netns exec` and `env` exec it in place).
    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    /// Waits up to `timeout` for exit; returns (status, stdout, stderr), killing on timeout.
    pub fn finish(
        mut self,
        timeout: Duration,
    ) -> (Option<std::process::ExitStatus>, String, String) {
        let t0 = Instant::now();
        let status = loop {
            if let Some(s) = self.0.try_wait().unwrap() {
                break Some(s);
            }
            if t0.elapsed() > timeout {
                let _ = self.0.kill();
                let _ = self.0.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let mut out = String::new();
        let mut err = String::new();
        use std::io::Read;
        if let Some(mut o) = self.0.stdout.take() {
            let _ = o.read_to_string(&mut out);
        }
        if let Some(mut e) = self.0.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        (status, out, err)
    }
}

impl Drop for Bg {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Runs `cmd` to completion within `timeout`; panics on failure or timeout.
pub fn run_ok(cmd: Command, timeout: Duration, what: &str) -> String {
    let (st, out, err) = Bg::spawn(cmd).finish(timeout);
    match st {
        Some(s) if s.success() => out,
        Some(s) => panic!("{what} failed ({s}):\nstdout: {out}\nstderr: {err}"),
        None => panic!("{what} timed out after {timeout:?}:\nstdout: {out}\nstderr: {err}"),
    }
}

/// Whether something listens on `port` inside `pod` now (ss).
pub fn listening(pod: &Pod, port: u16) -> bool {
    let o = sh(&[
        "ip",
        "netns",
        "exec",
        &pod.netns,
        "ss",
        "-Htln",
        &format!("sport = :{port}"),
    ]);
    !String::from_utf8_lossy(&o.stdout).trim().is_empty()
}

/// Waits until something listens on `port` inside `pod` (ss), up to 20 s.
pub fn wait_listening(pod: &Pod, port: u16) {
    let t0 = Instant::now();
    loop {
        if listening(pod, port) {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "nothing listens on {port} in {}",
            pod.netns
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Counts fds and memfd mappings of a process (leak checks).
pub fn fd_and_memfd_count(pid: u32) -> (usize, usize) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0);
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    (fds, maps.lines().filter(|l| l.contains("/memfd:")).count())
}

/// The channel memfds a daemon holds (it keeps one fd of each live
/// same-node channel, or a mapping: stock and the connections made of it):
/// (a `/proc/PID/fd/N` or `/proc/PID/map_files/RANGE` path to it, bytes
/// allocated in it, from `st_blocks`), each memfd once. The sum is the
/// lane's shared memory on the node.
pub fn channel_memfds(daemon: u32) -> Vec<(PathBuf, u64)> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for kind in ["fd", "map_files"] {
        let Ok(dir) = std::fs::read_dir(format!("/proc/{daemon}/{kind}")) else {
            continue;
        };
        for e in dir.flatten() {
            let Ok(link) = std::fs::read_link(e.path()) else {
                continue;
            };
            if !link.to_string_lossy().starts_with("/memfd:flowlane-ch-") {
                continue;
            }
            if let Ok(m) = std::fs::metadata(e.path()) {
                if seen.insert((m.dev(), m.ino())) {
                    out.push((e.path(), m.blocks() * 512));
                }
            }
        }
    }
    out
}

/// Raises the soft fd limit to the hard one (a program holding many
/// connections at once).
pub fn raise_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid rlimit struct of our own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// The directory of the python helper scripts used by the tests.
pub fn scripts_dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/shm-scripts"))
}
