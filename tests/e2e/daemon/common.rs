//! Shared pieces of the `daemon_*` suites: a node (temporary state dir,
//! socket and a real `flowlaned` process), pods (real network namespaces
//! recorded in the node's pod registry), and agents: processes running
//! inside a pod's namespace that talk to the daemon through
//! `flowlane_lane::client::DaemonClient`, exactly as the preload library
//! does. Agents must be separate processes: the daemon identifies a client
//! by the netns of its process (`/proc/PID/ns/net` of SO_PEERCRED's pid),
//! which a thread-level `setns` would not change.
//!
//! An agent is this very test executable re-run under `ip netns exec` with
//! `FLD_AGENT_SOCKET` set and the filter `daemon::common::agent_entry`; it
//! reads one command per line on stdin and answers one `@@ ...` line.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use flowlane_e2e::daemon;
use flowlane_e2e::fsutil::TempDir;
use flowlane_e2e::netns::Netns;
use flowlane_e2e::process::ChildGuard;
use flowlane_lane::client::DaemonClient;
use flowlane_lane::proto::Stats;
use flowlane_registry::{Attachment, Registry};

const AGENT_ENV: &str = "FLD_AGENT_SOCKET";
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Generous: the machine is small and other suites run concurrently.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);

/// `fld<tag>-<pid>-<n>`: this suite's netns prefix, unique on the machine
/// while this process runs ([`flowlane_e2e::names::netns`]).
pub fn unique_name(tag: &str) -> String {
    flowlane_e2e::names::netns(&format!("fld{tag}"))
}

/// A node: state dir + socket + (while running) a `flowlaned` process.
pub struct Node {
    pub dir: TempDir,
    pub socket: PathBuf,
    pub daemon: Option<ChildGuard>,
    extra_args: Vec<String>,
    log: PathBuf,
}

impl Node {
    /// A node with a running daemon (extra `flowlaned` flags in `args`).
    pub fn start(tag: &str, args: &[&str]) -> Node {
        let dir = TempDir::new(&format!("fld{tag}"));
        let socket = dir.join("run/flowlaned.sock");
        let log = dir.join("flowlaned.log");
        let mut node = Node {
            dir,
            socket,
            daemon: None,
            extra_args: args.iter().map(|s| s.to_string()).collect(),
            log,
        };
        node.start_daemon();
        node
    }

    pub fn state_dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn registry(&self) -> Registry {
        Registry::new(self.state_dir())
    }

    /// Starts `flowlaned` (its output appended to the node's log) and
    /// waits until it answers.
    pub fn start_daemon(&mut self) {
        assert!(self.daemon.is_none(), "daemon already running");
        let mut cmd = daemon::command(None, self.state_dir(), &self.socket);
        if !self.extra_args.iter().any(|a| a == "--log-level") {
            cmd.args(["--log-level", "debug"]);
        }
        cmd.args(&self.extra_args);
        let up_within = Duration::from_secs(30);
        self.daemon = Some(daemon::start(cmd, &self.socket, &self.log, up_within));
    }

    /// SIGTERM and wait for a clean exit; returns whether it exited 0.
    pub fn stop_daemon(&mut self) -> bool {
        let mut d = self.daemon.take().expect("daemon running");
        let pid = nix::unistd::Pid::from_raw(d.pid() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
        let mut status = None;
        flowlane_e2e::wait::until(Duration::from_secs(30), || {
            status = d.child.try_wait().ok().flatten();
            status.is_some()
        });
        status.is_some_and(|s| s.success())
    }

    /// SIGKILL (a crash): the socket file stays behind.
    pub fn kill_daemon(&mut self) {
        let mut d = self.daemon.take().expect("daemon running");
        let _ = d.child.kill();
        let _ = d.child.wait();
    }

    pub fn daemon_pid(&self) -> u32 {
        self.daemon.as_ref().expect("daemon running").pid()
    }

    pub fn daemon_alive(&mut self) -> bool {
        matches!(
            self.daemon.as_mut().map(|d| d.child.try_wait()),
            Some(Ok(None))
        )
    }

    /// Open fds of the daemon process.
    pub fn daemon_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.daemon_pid()))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    /// Stats as the node (this test process is not in a pod) sees them.
    pub fn stats(&self) -> Stats {
        daemon::stats_within(&self.socket, CALL_TIMEOUT)
            .unwrap_or_else(|e| panic!("stats: {e}; log:\n{}", self.log_text()))
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A pod: a fresh network namespace recorded in the registry with `ip`.
    pub fn add_pod(&self, tag: &str, ip: &str) -> Pod {
        let ns = Netns::named(&unique_name(tag));
        let container_id = format!("{}-{}", ns.name(), std::process::id());
        let att = Attachment {
            network: "fldnet".into(),
            container_id: container_id.clone(),
            ifname: "eth0".into(),
            netns: ns.path_str(),
            netns_inode: ns.inode(),
            ips: vec![format!("{ip}/17")],
            mac: "02:00:00:00:00:01".into(),
            pod_namespace: Some("default".into()),
            pod_name: Some(tag.to_string()),
            pod_uid: None,
            created_unix: 0,
        };
        self.registry().put(&att).expect("registry put");
        Pod {
            ns,
            ip: ip.parse().expect("pod ip"),
            name: format!("default/{tag}"),
            container_id,
            socket: self.socket.clone(),
        }
    }

    /// Removes a pod's registry entry (CNI DEL).
    pub fn remove_pod(&self, pod: &Pod) {
        self.registry()
            .remove("fldnet", &pod.container_id, "eth0")
            .expect("registry remove");
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(mut d) = self.daemon.take() {
            d.terminate(Duration::from_secs(5));
        }
        if std::thread::panicking() {
            eprintln!("flowlaned log:\n{}", self.log_text());
        }
    }
}

/// A copy of the executable `exe` that any uid can run, next to the
/// daemon's `socket` (in the node's temporary directory, removed with it):
/// the checkout, and so the target directory, may sit where only root may
/// look (a clone under /root), yet processes run as other uids must exec.
pub fn runnable_by_anyone(exe: &Path, socket: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = socket.parent().expect("the socket has a directory");
    let to = dir.join(exe.file_name().expect("executable name"));
    if !to.exists() {
        // Copied under a temporary name, then renamed: two threads may ask.
        let name = to.file_name().expect("file name").to_string_lossy();
        let tmp = dir.join(format!(".{name}.{:?}", std::thread::current().id()));
        std::fs::copy(exe, &tmp).expect("copy the executable");
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))
            .expect("chmod the copy");
        std::fs::rename(&tmp, &to).expect("rename the copy");
    }
    to
}

/// A pod: its namespace (deleted on drop) and address.
pub struct Pod {
    pub ns: Netns,
    pub ip: IpAddr,
    pub name: String,
    pub container_id: String,
    socket: PathBuf,
}

impl Pod {
    pub fn addr(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.ip, port)
    }

    /// Starts an agent process inside this pod's namespace.
    pub fn agent(&self) -> Agent {
        Agent::spawn(&self.ns, &self.socket)
    }
}

/// A process inside a pod speaking the daemon protocol on command.
pub struct Agent {
    child: ChildGuard,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl Agent {
    /// An agent in `ns` (or in the test's own namespace when `None`).
    pub fn spawn(ns: &Netns, socket: &Path) -> Agent {
        let exe = std::env::current_exe().expect("current_exe");
        let mut cmd = ns.command(exe.to_str().expect("utf-8 exe path"));
        Self::start(cmd.env(AGENT_ENV, socket))
    }

    /// An agent in the test's own network namespace running as `uid` and
    /// `gid` (no supplementary groups).
    pub fn spawn_as(uid: u32, gid: u32, socket: &Path) -> Agent {
        use std::os::unix::process::CommandExt;
        let exe = std::env::current_exe().expect("current_exe");
        let mut cmd = Command::new(runnable_by_anyone(&exe, socket));
        Self::start(cmd.uid(uid).gid(gid).env(AGENT_ENV, socket))
    }

    /// An agent started through `wrapper` (e.g. `["unshare", "-n"]`, or
    /// `["ip", "netns", "exec", POD, "unshare", "-n"]`), which must exec it.
    pub fn spawn_via(wrapper: &[&str], socket: &Path) -> Agent {
        let exe = std::env::current_exe().expect("current_exe");
        let mut cmd = Command::new(wrapper[0]);
        cmd.args(&wrapper[1..]).arg(exe);
        Self::start(cmd.env(AGENT_ENV, socket))
    }

    fn start(cmd: &mut Command) -> Agent {
        let mut child = cmd
            .args([
                "--exact",
                "daemon::common::agent_entry",
                "--nocapture",
                "--test-threads=1",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn agent");
        let stdin = child.stdin.take().expect("agent stdin");
        let stdout = child.stdout.take().expect("agent stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                // libtest prints "test NAME ... " before the first answer.
                if let Some(at) = line.find("@@ ") {
                    if tx.send(line[at + 3..].to_string()).is_err() {
                        break;
                    }
                }
            }
        });
        Agent {
            child: ChildGuard::new(child),
            stdin,
            lines: rx,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// Sends one command, returns the answer line (without `@@ `).
    pub fn cmd(&mut self, line: &str) -> String {
        writeln!(self.stdin, "{line}").expect("write to agent");
        self.stdin.flush().expect("flush agent");
        self.lines
            .recv_timeout(ANSWER_TIMEOUT)
            .unwrap_or_else(|e| panic!("agent gave no answer to {line:?}: {e}"))
    }

    /// `cmd` expecting `channel ID LEN`; returns the id.
    pub fn expect_channel(&mut self, line: &str) -> u64 {
        let a = self.cmd(line);
        let mut parts = a.split_whitespace();
        assert_eq!(parts.next(), Some("channel"), "{line:?} -> {a:?}");
        parts
            .next()
            .and_then(|s| s.parse().ok())
            .expect("channel id")
    }
}

/// Runs the agent loop when spawned by [`Agent::spawn`]; a no-op test
/// otherwise (it is the agent's entry point, not a test of its own).
#[test]
fn agent_entry() {
    let Some(socket) = std::env::var_os(AGENT_ENV) else {
        return;
    };
    agent_loop(Path::new(&socket));
}

struct Mapped {
    fd: OwnedFd,
    ptr: *mut u8,
    len: usize,
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` come from a successful mmap of this mapping.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn map(ch: flowlane_lane::client::Channel) -> Result<Mapped, String> {
    // SAFETY: mapping a memfd we own, of the length the daemon gave it; the
    // pointer is only used within that length.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            ch.len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            ch.memfd.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(format!("mmap: {}", std::io::Error::last_os_error()));
    }
    Ok(Mapped {
        fd: ch.memfd,
        ptr: ptr.cast(),
        len: ch.len,
    })
}

fn agent_loop(socket: &Path) {
    let mut state = AgentState::default();
    let stdin = std::io::stdin();
    for line in stdin.lock().lines().map_while(Result::ok) {
        let answer = agent_command(socket, &line, &mut state);
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "@@ {answer}");
        let _ = out.flush();
    }
}

/// What an agent keeps between commands.
#[derive(Default)]
struct AgentState {
    mapped: Option<Mapped>,
    sockets: std::collections::HashMap<SocketAddr, std::net::TcpListener>,
    held: Vec<std::os::unix::net::UnixStream>,
}

fn agent_command(socket: &Path, line: &str, st: &mut AgentState) -> String {
    let AgentState {
        mapped,
        sockets,
        held,
    } = st;
    let words: Vec<&str> = line.split_whitespace().collect();
    let client = || DaemonClient::connect(socket, CALL_TIMEOUT);
    let addr = |i: usize| -> SocketAddr { words[i].parse().expect("address argument") };
    let num = |i: usize| -> u64 { words[i].parse().expect("number argument") };
    let unit = |r: std::io::Result<()>| match r {
        Ok(()) => "ok".to_string(),
        Err(e) => format!("err {:?} {e}", e.kind()),
    };
    let mut channel = |r: std::io::Result<Option<flowlane_lane::client::Channel>>| match r {
        Ok(Some(ch)) => {
            let (id, len) = (ch.id, ch.len);
            match map(ch) {
                Ok(m) => {
                    *mapped = Some(m);
                    format!("channel {id} {len}")
                }
                Err(e) => format!("err mmap {e}"),
            }
        }
        Ok(None) => "none".to_string(),
        Err(e) => format!("err {:?} {e}", e.kind()),
    };
    match words.first().copied().unwrap_or("") {
        "listen" => {
            // Like the preload library: a real listening socket first (the
            // daemon drops registrations whose socket is gone). Any address
            // of the port will do; the daemon checks the registered one.
            let a = addr(1);
            let any = SocketAddr::new(
                if a.is_ipv4() {
                    IpAddr::from([0u8; 4])
                } else {
                    IpAddr::from([0u16; 8])
                },
                a.port(),
            );
            if let Ok(l) = std::net::TcpListener::bind(any) {
                sockets.insert(a, l);
            }
            unit(client().and_then(|mut c| c.register_listener(a)))
        }
        "unlisten" => {
            sockets.remove(&addr(1));
            unit(client().and_then(|mut c| c.unregister_listener(addr(1))))
        }
        "intent" => {
            channel(client().and_then(|mut c| c.connect_intent(addr(1), addr(2), num(3) as usize)))
        }
        "claim" => channel(client().and_then(|mut c| c.claim_accepted(addr(1), addr(2)))),
        "cancel" => unit(client().and_then(|mut c| c.cancel_intent(num(1)))),
        "closed" => unit(client().and_then(|mut c| c.report_closed(num(1), num(2), num(3)))),
        "fallback" => unit(client().and_then(|mut c| {
            c.report_fallback(flowlane_lane::client::FallbackReason::Unsupported)
        })),
        "stats" => unit(client().and_then(|mut c| c.stats().map(|_| ()))),
        "registry-changed" => unit(client().and_then(|mut c| c.registry_changed())),
        "write" => match mapped {
            Some(m) => {
                let off = num(1) as usize;
                let text = words[2].as_bytes();
                assert!(off + text.len() <= m.len);
                // SAFETY: within the mapping, checked above.
                unsafe { std::ptr::copy_nonoverlapping(text.as_ptr(), m.ptr.add(off), text.len()) };
                "ok".to_string()
            }
            None => "err no channel".to_string(),
        },
        "read" => match mapped {
            Some(m) => {
                let (off, len) = (num(1) as usize, num(2) as usize);
                assert!(off + len <= m.len);
                // SAFETY: within the mapping, checked above.
                let bytes = unsafe { std::slice::from_raw_parts(m.ptr.add(off), len) };
                format!("data {}", String::from_utf8_lossy(bytes))
            }
            None => "err no channel".to_string(),
        },
        "shrink" => match mapped {
            Some(m) => {
                // SAFETY: ftruncate on an fd we own.
                let r = unsafe { libc::ftruncate(m.fd.as_raw_fd(), 0) };
                if r == 0 {
                    "shrunk".to_string()
                } else {
                    format!("err {}", std::io::Error::last_os_error())
                }
            }
            None => "err no channel".to_string(),
        },
        // Timed loops for the benchmark: a fresh connection per call, as
        // the preload library does. Answers `bench P50_NS P99_NS TOTAL_NS CHANNELS`.
        "bench-intent" => {
            let (count, base, dst, len) = (num(1), num(2) as u16, addr(3), num(4) as usize);
            bench(count, |i| {
                let src = SocketAddr::new(IpAddr::from([0, 0, 0, 0]), base + i as u16);
                client().and_then(|mut c| c.connect_intent(src, dst, len))
            })
        }
        // The same over ONE daemon connection (what a persistent client
        // would save).
        "bench-intent-reuse" => {
            let (count, base, dst, len) = (num(1), num(2) as u16, addr(3), num(4) as usize);
            let mut c = match client() {
                Ok(c) => c,
                Err(e) => return format!("err {e}"),
            };
            bench(count, |i| {
                let src = SocketAddr::new(IpAddr::from([0, 0, 0, 0]), base + i as u16);
                c.connect_intent(src, dst, len)
            })
        }
        "bench-claim" => {
            let (count, local, peer_ip, base) = (num(1), addr(2), words[3], num(4) as u16);
            let peer_ip: IpAddr = peer_ip.parse().expect("peer ip");
            bench(count, |i| {
                let peer = SocketAddr::new(peer_ip, base + i as u16);
                client().and_then(|mut c| c.claim_accepted(local, peer))
            })
        }
        // Opens N idle connections to the daemon and keeps them.
        "hold" => {
            flowlane_e2e::shm::raise_fd_limit();
            for _ in 0..num(1) {
                match std::os::unix::net::UnixStream::connect(socket) {
                    Ok(s) => held.push(s),
                    Err(e) => return format!("err {e}"),
                }
            }
            format!("held {}", held.len())
        }
        "release" => {
            held.clear();
            "ok".to_string()
        }
        "drop" => {
            *mapped = None;
            "ok".to_string()
        }
        other => format!("err unknown command {other:?}"),
    }
}

/// Runs `op` `count` times; per-call latency percentiles and channel count.
fn bench(
    count: u64,
    mut op: impl FnMut(u64) -> std::io::Result<Option<flowlane_lane::client::Channel>>,
) -> String {
    let mut times = Vec::with_capacity(count as usize);
    let mut channels = 0;
    let start = std::time::Instant::now();
    for i in 0..count {
        let t = std::time::Instant::now();
        match op(i) {
            Ok(Some(_)) => channels += 1,
            Ok(None) => {}
            Err(e) => return format!("err {e}"),
        }
        times.push(t.elapsed().as_nanos() as u64);
    }
    let total = start.elapsed().as_nanos();
    times.sort_unstable();
    let pct = |p: usize| times.get(times.len() * p / 100).copied().unwrap_or(0);
    format!("bench {} {} {total} {channels}", pct(50), pct(99))
}
