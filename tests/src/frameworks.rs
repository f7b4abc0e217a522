//! Harness for the real-framework suites (`frameworks::tf`, `frameworks::torch`):
//! where a job's tasks run (a [`Site`]: a pod and its node's daemon), the
//! task processes ([`Task`]: line-by-line stdout, held open until released),
//! the two-node relay cluster ([`RelayPair`], as `relay::lane` builds it) and
//! the lane evidence of a job ([`Evidence`]: every TCP connection between the
//! job's pods, seen with `ss` in the pods, against the channels the daemons
//! list at the same moment).
//!
//! Addresses: 10.245.0.0/16 only (same-node pods 10.245.128-247.0/24 through
//! [`crate::shm::Node::new_in`]; relay pods 10.245.0-99.0/24, underlay
//! 10.245.100-149.0/24).

use crate::node_ns::{DaemonOpts, NsNode, LANE_PORT};
use crate::ns_cluster::{Layout, NsCluster};
use crate::shm::{preload_lib, sh, Pod};
use flowlane_lane::proto::Stats;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The venv `.ci/install-deps` makes for the ML frameworks (TensorFlow).
pub const ML_VENV_PYTHON: &str = "/opt/flowlane-ml/bin/python";
/// Debian's python3 (python3-torch).
pub const SYSTEM_PYTHON: &str = "/usr/bin/python3";

/// A script of `tests/frameworks/`.
pub fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("frameworks")
        .join(name)
}

/// Panics with `hint` unless `python -c code` succeeds: a framework that
/// cannot be imported fails the suite, it never passes silently.
pub fn require_python_module(python: &str, module: &str, hint: &str) {
    let out = Command::new(python)
        .args(["-c", &format!("import {module}")])
        .env("TF_CPP_MIN_LOG_LEVEL", "3")
        .output();
    match out {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "{python} cannot import {module} ({hint}):\n{}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => panic!("{python}: {e} ({hint})"),
    }
}

/// Where one task of a job runs: a pod, and the socket of its node's daemon.
#[derive(Debug, Clone)]
pub struct Site {
    pub netns: String,
    pub ip: Ipv4Addr,
    pub socket: PathBuf,
}

impl Site {
    pub fn of(pod: &Pod, socket: &Path) -> Site {
        Site {
            netns: pod.netns.clone(),
            ip: pod.ip,
            socket: socket.to_path_buf(),
        }
    }

    /// `argv` in this pod with the environment `env`, and the preload
    /// library (talking to this site's daemon) if `preload`.
    pub fn cmd(&self, preload: bool, env: &[(&str, String)], argv: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.netns, "env"]);
        if preload {
            c.arg(format!("LD_PRELOAD={}", preload_lib().display()));
            c.arg(format!("FLOWLANE_SOCKET={}", self.socket.display()));
        }
        for (k, v) in env {
            c.arg(format!("{k}={v}"));
        }
        c.args(argv);
        c
    }
}

impl Site {
    /// Waits until something listens on `port` in this pod (`ss`), up to
    /// `timeout` (a framework's import takes seconds on a busy machine).
    pub fn wait_listening(&self, port: u16, timeout: Duration) {
        let t0 = Instant::now();
        let filter = format!("sport = :{port}");
        loop {
            let o = sh(&["ip", "netns", "exec", &self.netns, "ss", "-Htln", &filter]);
            if !String::from_utf8_lossy(&o.stdout).trim().is_empty() {
                return;
            }
            assert!(
                t0.elapsed() < timeout,
                "nothing listens on {port} in {} after {timeout:?}",
                self.netns
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A task process: stdout read line by line, stderr kept for error
/// messages, stdin open (a line on it releases a held task); killed on drop.
pub struct Task {
    pub what: String,
    child: Child,
    lines: Receiver<String>,
    stderr: Arc<Mutex<String>>,
}

impl Task {
    pub fn spawn(mut cmd: Command, what: &str) -> Task {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let (tx, lines) = channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let (mut err, keep) = (child.stderr.take().unwrap(), stderr.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            while let Ok(n @ 1..) = err.read(&mut buf) {
                let mut s = keep.lock().unwrap_or_else(|e| e.into_inner());
                s.push_str(&String::from_utf8_lossy(&buf[..n]));
                // Keep the tail only (TensorFlow logs a lot).
                if s.len() > 64 * 1024 {
                    let cut = s.len() - 32 * 1024;
                    let cut = (cut..s.len()).find(|&i| s.is_char_boundary(i)).unwrap();
                    s.drain(..cut);
                }
            }
        });
        Task {
            what: what.to_string(),
            child,
            lines,
            stderr,
        }
    }

    pub fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The stdout lines up to and including the first one equal to
    /// `marker`; panics (with the task's stderr) if the task exits first
    /// or `timeout` passes.
    pub fn until(&mut self, marker: &str, timeout: Duration) -> Vec<String> {
        let t0 = Instant::now();
        let mut seen = Vec::new();
        loop {
            let left = timeout.saturating_sub(t0.elapsed());
            match self.lines.recv_timeout(left.max(Duration::from_millis(1))) {
                Ok(l) if l.trim() == marker => {
                    seen.push(l);
                    return seen;
                }
                Ok(l) => seen.push(l),
                Err(RecvTimeoutError::Disconnected) => {
                    let st = self.child.wait().ok();
                    panic!(
                        "{} exited ({st:?}) before {marker:?}:\nstdout: {seen:?}\nstderr: {}",
                        self.what,
                        self.stderr()
                    );
                }
                Err(RecvTimeoutError::Timeout) => panic!(
                    "{}: no {marker:?} within {timeout:?}:\nstdout: {seen:?}\nstderr: {}",
                    self.what,
                    self.stderr()
                ),
            }
        }
    }

    /// The first JSON object among the lines up to `HOLD`.
    pub fn result_held(&mut self, timeout: Duration) -> serde_json::Value {
        let lines = self.until("HOLD", timeout);
        lines
            .iter()
            .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v.is_object())
            .unwrap_or_else(|| panic!("{}: no JSON result in {lines:?}", self.what))
    }

    /// Releases a held task (one line on its stdin).
    pub fn release(&mut self) {
        if let Some(stdin) = self.child.stdin.as_mut() {
            let _ = stdin.write_all(b"\n");
            let _ = stdin.flush();
        }
    }

    /// Waits for a released task to exit successfully.
    pub fn finish(mut self, timeout: Duration) {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                assert!(st.success(), "{} exited {st}: {}", self.what, self.stderr());
                return;
            }
            assert!(
                t0.elapsed() < timeout,
                "{} did not exit within {timeout:?}: {}",
                self.what,
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Task {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One TCP connection, its two ends in a fixed order (the smaller first).
pub type ConnKey = (SocketAddr, SocketAddr);

fn conn_key(a: SocketAddr, b: SocketAddr) -> ConnKey {
    let (a, b) = (unmapped(a), unmapped(b));
    if a <= b {
        (a, b)
    } else {
        (b, a)
    }
}

/// An IPv4-mapped IPv6 address (`[::ffff:10.245.0.2]:2300`, what `ss`
/// shows for a socket of a dual-stack listener such as gRPC's `[::]`) as
/// the IPv4 address it is.
fn unmapped(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => a,
        },
        v4 => v4,
    }
}

/// The lane evidence of a job, taken while every task holds its connections.
#[derive(Debug, Default)]
pub struct Evidence {
    /// Every established TCP connection between two of the job's pods (or
    /// a pod and itself), from `ss` in each pod.
    pub job: BTreeSet<ConnKey>,
    /// The channels the daemons list at the same moment, with their lane.
    pub channels: BTreeMap<ConnKey, String>,
}

impl Evidence {
    /// Takes the snapshot: `ss` in every distinct pod of `sites`, then the
    /// stats of every daemon in `sockets`.
    pub fn take(sites: &[Site], sockets: &[PathBuf]) -> Evidence {
        let ips: BTreeSet<IpAddr> = sites.iter().map(|s| IpAddr::V4(s.ip)).collect();
        let netns: BTreeSet<&str> = sites.iter().map(|s| s.netns.as_str()).collect();
        let mut job = BTreeSet::new();
        for ns in netns {
            let o = sh(&[
                "ip",
                "netns",
                "exec",
                ns,
                "ss",
                "-Htn",
                "state",
                "established",
            ]);
            assert!(o.status.success(), "ss in {ns}");
            for line in String::from_utf8_lossy(&o.stdout).lines() {
                let f: Vec<&str> = line.split_whitespace().collect();
                if f.len() < 4 {
                    continue;
                }
                let (Ok(l), Ok(p)) = (
                    f[f.len() - 2].parse::<SocketAddr>(),
                    f[f.len() - 1].parse::<SocketAddr>(),
                ) else {
                    continue;
                };
                let (l, p) = (unmapped(l), unmapped(p));
                if ips.contains(&l.ip()) && ips.contains(&p.ip()) {
                    job.insert(conn_key(l, p));
                }
            }
        }
        let mut channels = BTreeMap::new();
        for s in sockets {
            for c in stats(s).connections {
                channels.insert(conn_key(c.client.addr, c.server.addr), c.lane.clone());
            }
        }
        Evidence { job, channels }
    }

    /// The job's connections on the lane `lane_of` expects for them, and
    /// the others (with the lane they are on, `tcp` when no daemon lists
    /// them).
    pub fn split(&self, lane_of: impl Fn(&ConnKey) -> &'static str) -> (usize, Vec<String>) {
        let mut on = 0;
        let mut off = Vec::new();
        for k in &self.job {
            let want = lane_of(k);
            match self.channels.get(k).map(String::as_str) {
                Some(l) if l == want => on += 1,
                other => off.push(format!(
                    "{} <-> {}: {} (expected {want})",
                    k.0,
                    k.1,
                    other.unwrap_or("tcp")
                )),
            }
        }
        (on, off)
    }

    /// Every connection of the job is a channel of the lane `lane_of`
    /// expects for it (`shm` on one node, `relay` across nodes).
    pub fn assert_all_on(&self, lane_of: impl Fn(&ConnKey) -> &'static str, what: &str) {
        assert!(
            !self.job.is_empty(),
            "{what}: no connection between the job's pods"
        );
        let (on, off) = self.split(lane_of);
        assert!(
            off.is_empty(),
            "{what}: {on} of {} connections on their lane, not these: {off:#?}",
            self.job.len()
        );
    }

    /// No connection of the job is a daemon's channel (the plain-TCP run).
    pub fn assert_none_brokered(&self, what: &str) {
        assert!(
            !self.job.is_empty(),
            "{what}: no connection between the job's pods"
        );
        let brokered: Vec<_> = self
            .job
            .iter()
            .filter(|k| self.channels.contains_key(k))
            .collect();
        assert!(
            brokered.is_empty(),
            "{what}: brokered without the library: {brokered:?}"
        );
    }
}

/// A daemon's stats.
pub fn stats(socket: &Path) -> Stats {
    crate::daemon::stats_within(socket, Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("stats of {}: {e}", socket.display()))
}

/// Lane counters summed over daemons: connections opened per lane, and
/// connections that stayed on TCP (all fallback reasons).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    pub opened: BTreeMap<String, u64>,
    pub fallbacks: BTreeMap<String, u64>,
}

impl Counters {
    pub fn read(sockets: &[PathBuf]) -> Counters {
        let mut c = Counters::default();
        for s in sockets {
            let st = stats(s);
            for (lane, l) in st.lanes {
                *c.opened.entry(lane).or_default() += l.connections_opened;
            }
            for (why, n) in st.fallbacks {
                *c.fallbacks.entry(why).or_default() += n;
            }
        }
        c
    }

    /// What happened since `before`: (opened per lane, fallbacks per reason), zeros left out.
    pub fn since(&self, before: &Counters) -> Counters {
        let diff = |now: &BTreeMap<String, u64>, then: &BTreeMap<String, u64>| {
            now.iter()
                .map(|(k, v)| (k.clone(), v - then.get(k).copied().unwrap_or(0)))
                .filter(|(_, v)| *v > 0)
                .collect()
        };
        Counters {
            opened: diff(&self.opened, &before.opened),
            fallbacks: diff(&self.fallbacks, &before.fallbacks),
        }
    }
}

const LANE_KEY: &[u8] = b"frameworks: the test cluster's lane key, 32+ bytes\n";

/// One node of a [`RelayPair`].
pub type RelayNode = NsNode;

impl NsNode {
    /// Where a task may run on this node: each of its pods.
    pub fn sites(&self) -> Vec<Site> {
        self.pods
            .iter()
            .map(|p| Site::of(p, &self.socket()))
            .collect()
    }
}

/// Two nodes (network namespaces, each with its bridge, pods wired by the
/// real plugin, and its own `flowlaned` with the relay on `--lane-transport
/// tcp-test`) joined by an underlay veth with host-gw routes: the set-up of
/// the `relay::lane` suite (`nodes`, ... of the [`NsCluster`] it derefs to).
pub struct RelayPair(NsCluster);

impl std::ops::Deref for RelayPair {
    type Target = NsCluster;
    fn deref(&self) -> &NsCluster {
        &self.0
    }
}

impl RelayPair {
    pub fn new(pods_per_node: usize) -> RelayPair {
        let layout = Layout::new("ff", "frameworks", "FF_KEEP").addresses((245, 0), (245, 100), 50);
        let mut c = NsCluster::new(&layout, 2);
        let nodes_file = c.write_nodes_file(|_| Some(LANE_PORT));
        c.add_pods(pods_per_node);
        c.start_daemons(|_| DaemonOpts::new("info").lanes(nodes_file.clone(), LANE_KEY));
        RelayPair(c)
    }

    pub fn sockets(&self) -> Vec<PathBuf> {
        self.nodes.iter().map(RelayNode::socket).collect()
    }

    pub fn logs(&self) -> String {
        self.0.logs(4000)
    }
}

/// The lane a connection between two of `sites` should ride: `shm` when
/// both ends are pods of one node (one daemon), `relay` across nodes.
pub fn expected_lane(sites: &[Site]) -> impl Fn(&ConnKey) -> &'static str {
    let node: BTreeMap<IpAddr, PathBuf> = sites
        .iter()
        .map(|s| (IpAddr::V4(s.ip), s.socket.clone()))
        .collect();
    move |k: &ConnKey| {
        if node.get(&k.0.ip()) == node.get(&k.1.ip()) {
            "shm"
        } else {
            "relay"
        }
    }
}

/// The checks of a job run with the preload library: every connection
/// between the job's pods (`evidence`) is a channel of the lane
/// [`expected_lane`] gives it, no connection fell back to TCP meanwhile
/// (`counted`), and the daemons counted at least that many opened per lane
/// (a relayed connection counts on both daemons). Returns a summary line.
pub fn assert_job_on_lanes(
    evidence: &Evidence,
    counted: &Counters,
    sites: &[Site],
    what: &str,
) -> String {
    let lane_of = expected_lane(sites);
    evidence.assert_all_on(&lane_of, what);
    assert!(
        counted.fallbacks.is_empty(),
        "{what}: connections stayed on TCP: {counted:?}"
    );
    let mut per_lane = Vec::new();
    for l in ["shm", "relay"] {
        let want = evidence.job.iter().filter(|k| lane_of(k) == l).count() as u64;
        let got = counted.opened.get(l).copied().unwrap_or(0);
        assert!(
            got >= want,
            "{what}: {want} connections on {l} now, the daemons counted {got} opened"
        );
        per_lane.push(format!("{want} {l}"));
    }
    format!(
        "{what}: {} connections between the job's pods, all on their lane ({}); \
         daemons counted {:?} opened, no fallback",
        evidence.job.len(),
        per_lane.join(", "),
        counted.opened
    )
}

/// The checks of the same job without the library: it made connections
/// between its pods, and no daemon brokered or counted any of them.
pub fn assert_job_on_tcp(evidence: &Evidence, counted: &Counters, what: &str) {
    evidence.assert_none_brokered(what);
    assert_eq!(
        counted,
        &Counters::default(),
        "{what}: the daemons saw the job"
    );
}

/// Every daemon socket among `sites`, once.
pub fn sockets_of(sites: &[Site]) -> Vec<PathBuf> {
    let set: BTreeSet<PathBuf> = sites.iter().map(|s| s.socket.clone()).collect();
    set.into_iter().collect()
}
