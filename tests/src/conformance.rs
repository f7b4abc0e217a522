//! The event-loop conformance suite's checks (`tests/e2e/shm/event_loops.rs`):
//! the same checks through each runtime's client and server (the programs
//! of [`crate::loop_scripts`]), on the lane (the library on both ends) and
//! across mixed pairs (on one end only, in both directions), with the
//! daemon's counters proving exactly which connections took the lane.
//!
//! One [`run`] per runtime, on a node of its own (two pods):
//!
//! - **one long-lived server with the library** serves, in turn, clients
//!   with and without the library (interleaved), then 6 concurrent clients
//!   (4 with the library), then a client with the library killed
//!   mid-stream, then one more client: every client checks every echoed
//!   byte and the trailer (which proves the half-close: the server replies
//!   after the client's `shutdown(SHUT_WR)`); the server must outlive the
//!   killed client and end with one line per connection;
//! - **a server without the library** serves a client with the library and
//!   one without (no lane);
//! - **a server killed mid-stream**: its client (both with the library)
//!   must end with EOF or a reset, within the timeout, never a hang, a
//!   wrong byte or success.
//!
//! Each check's cell in the printed table is `ok` or what went wrong; the
//! run fails if any cell is not `ok`.

use crate::loop_scripts::{crc32_update, Stream, ASIO_ECHO_CPP, NODE_LOOP, PY_LOOP};
use crate::shm::{wait_listening, Bg, Node, Pod};
use crate::shm_scripts::PYTHON;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(90);
const NODE_JS: &str = "/usr/bin/node";

/// The event loops of the suite.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Runtime {
    /// Node.js `net` (libuv).
    Node,
    /// Python asyncio, default loop (selectors: epoll, level-triggered).
    Asyncio,
    /// Python asyncio on uvloop (libuv).
    Uvloop,
    /// Rust tokio (mio: epoll, edge-triggered).
    Tokio,
    /// Standalone asio (its epoll reactor registers sockets before connect).
    Asio,
    /// TLS (OpenSSL through Python's `ssl`) over asyncio.
    Tls,
}

impl Runtime {
    pub fn name(self) -> &'static str {
        match self {
            Runtime::Node => "node net (libuv)",
            Runtime::Asyncio => "python asyncio",
            Runtime::Uvloop => "python uvloop",
            Runtime::Tokio => "rust tokio",
            Runtime::Asio => "asio (standalone)",
            Runtime::Tls => "TLS (OpenSSL, asyncio)",
        }
    }
}

/// How to run one runtime's programs on a node.
struct Programs {
    /// The program and its leading arguments.
    prefix: Vec<String>,
    /// Trailing options (`uvloop`, `tls DIR`).
    suffix: Vec<String>,
}

impl Programs {
    fn new(rt: Runtime, node: &Node) -> Programs {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let (prefix, suffix) = match rt {
            Runtime::Node => (s(&[NODE_JS, "-e", NODE_LOOP]), vec![]),
            Runtime::Asyncio => (s(&[PYTHON, "-c", PY_LOOP]), vec![]),
            Runtime::Uvloop => (s(&[PYTHON, "-c", PY_LOOP]), s(&["uvloop"])),
            Runtime::Tls => {
                let dir = tls_material(node);
                (
                    s(&[PYTHON, "-c", PY_LOOP]),
                    vec!["tls".into(), dir.display().to_string()],
                )
            }
            Runtime::Tokio => (
                vec![crate::binaries::workspace_artifact("loop-echo-tokio")
                    .display()
                    .to_string()],
                vec![],
            ),
            Runtime::Asio => (vec![asio_binary().display().to_string()], vec![]),
        };
        Programs { prefix, suffix }
    }

    fn cmd(&self, node: &Node, pod: &Pod, lib: bool, args: &[String]) -> Command {
        let argv: Vec<&str> = self
            .prefix
            .iter()
            .chain(args)
            .chain(&self.suffix)
            .map(String::as_str)
            .collect();
        node.cmd(pod, lib, &argv)
    }

    /// A server in the node's second pod.
    fn server(&self, node: &Node, lib: bool, port: u16, conns: usize) -> Bg {
        let pod = &node.pods[1];
        let srv = Bg::spawn(self.cmd(
            node,
            pod,
            lib,
            &["server".into(), port.to_string(), conns.to_string()],
        ));
        wait_listening(pod, port);
        srv
    }

    /// A client in the node's first pod, to the server in its second.
    fn client(&self, node: &Node, port: u16, lib: bool, bytes: u64, seed: u32) -> Bg {
        Bg::spawn(self.cmd(
            node,
            &node.pods[0],
            lib,
            &[
                "client".into(),
                node.pods[1].ip.to_string(),
                port.to_string(),
                bytes.to_string(),
                seed.to_string(),
            ],
        ))
    }
}

/// A self-signed certificate for `flowlane-test` (openssl req) in the
/// node's directory.
fn tls_material(node: &Node) -> PathBuf {
    let dir = node.dir.join("tls");
    std::fs::create_dir_all(&dir).unwrap();
    let (key, cert) = (dir.join("key.pem"), dir.join("cert.pem"));
    let out = Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
        .args(["ec_paramgen_curve:prime256v1", "-nodes", "-days", "2"])
        .args(["-subj", "/CN=flowlane-test", "-addext"])
        .args(["subjectAltName=DNS:flowlane-test", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .expect("openssl (Debian package openssl)");
    assert!(
        out.status.success(),
        "openssl req: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir
}

/// The asio program, compiled with g++ against Debian's `libasio-dev` once
/// per source version into `<target>/release/loop-bin/`.
pub fn asio_binary() -> PathBuf {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    ASIO_ECHO_CPP.hash(&mut h);
    let dir = crate::binaries::build_dir().join("loop-bin");
    let bin = dir.join(format!("asio-echo-{:016x}", h.finish()));
    if bin.exists() {
        return bin;
    }
    assert!(
        std::path::Path::new("/usr/include/asio.hpp").exists(),
        "standalone asio missing: install Debian's libasio-dev (.ci/install-deps)"
    );
    std::fs::create_dir_all(&dir).unwrap();
    let tmp = dir.join(format!("asio-echo-{}.tmp", std::process::id()));
    let src = tmp.with_extension("cpp");
    std::fs::write(&src, ASIO_ECHO_CPP).unwrap();
    let out = Command::new("g++")
        .args(["-O2", "-std=c++17", "-pthread", "-o"])
        .arg(&tmp)
        .arg(&src)
        .output()
        .expect("g++");
    let _ = std::fs::remove_file(&src);
    assert!(
        out.status.success(),
        "g++ asio-echo: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::rename(&tmp, &bin).unwrap();
    bin
}

/// The `ok` line a client must print for `bytes` of the stream of `seed`.
fn expected_ok(bytes: u64, seed: u32) -> String {
    let s = Stream::new(seed);
    let (mut crc, mut p, mut buf) = (0u32, 0u64, Vec::new());
    while p < bytes {
        let n = (bytes - p).min(1 << 20) as usize;
        buf.clear();
        s.span(p, n, &mut buf);
        crc = crc32_update(crc, &buf);
        p += n as u64;
    }
    format!("ok {bytes} {crc:08x}")
}

/// Waits for a finished client; `Err` unless it printed the right `ok` line.
fn client_ok(c: Bg, bytes: u64, seed: u32, what: &str) -> Result<(), String> {
    let (st, out, err) = c.finish(T);
    let want = expected_ok(bytes, seed);
    match st {
        Some(s) if s.success() && out.trim() == want => Ok(()),
        Some(s) => Err(format!(
            "{what}: {s}, stdout {:?} (want {want:?}), stderr {:?}",
            out.trim(),
            last_line(&err)
        )),
        None => Err(format!("{what}: hung (killed after {T:?}), stdout {out:?}")),
    }
}

fn last_line(s: &str) -> &str {
    s.trim().lines().last().unwrap_or("")
}

/// Waits until the node's lane count reaches `want` (up to 10 s).
fn wait_lane(node: &Node, want: u64) -> Result<(), String> {
    let t0 = Instant::now();
    loop {
        let n = node.shm_opened();
        if n >= want {
            return Ok(());
        }
        if t0.elapsed() > Duration::from_secs(10) {
            return Err(format!("{n} lane connections, waited for {want}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn kill9(pid: u32) {
    // SAFETY: signalling a child process this test started.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
}

/// One runtime's row of the results table.
#[derive(Default)]
pub struct Row {
    pub cells: Vec<(&'static str, Result<(), String>)>,
}

impl Row {
    fn put(&mut self, check: &'static str, r: Result<(), String>) {
        match self.cells.iter_mut().find(|(c, _)| *c == check) {
            Some((_, old)) => {
                if old.is_ok() {
                    *old = r;
                }
            }
            None => self.cells.push((check, r)),
        }
    }

    fn lane_count(&mut self, check: &'static str, node: &Node, before: u64, want: u64) {
        let got = node.shm_opened() - before;
        let r = if got == want {
            Ok(())
        } else {
            Err(format!("{got} lane connections, want {want}"))
        };
        self.put(check, r.clone());
        self.put(COUNT, r.map_err(|e| format!("{check}: {e}")));
    }
}

/// The checks, in table order.
pub const CHECKS: [&str; 8] = [
    LANE_BYTES,
    SEQ_CONC,
    INTERLEAVED,
    MIXED_TO_PLAIN,
    MIXED_TO_LIB,
    CLIENT_KILLED,
    SERVER_KILLED,
    COUNT,
];
const LANE_BYTES: &str = "lane: bytes both ways + half-close";
const SEQ_CONC: &str = "lane: sequential + concurrent on one server";
const INTERLEAVED: &str = "lane and plain clients in turn, one server";
const MIXED_TO_PLAIN: &str = "mixed: lib client -> plain server";
const MIXED_TO_LIB: &str = "mixed: plain client -> lib server";
const CLIENT_KILLED: &str = "lane: client killed mid-stream";
const SERVER_KILLED: &str = "lane: server killed mid-stream";
const COUNT: &str = "lane used exactly where both ends can";

/// Runs every check through `rt` on `node` (two pods: client, server);
/// returns the row (every cell `ok` when the runtime conforms).
pub fn run(rt: Runtime, node: &Node) -> Row {
    let p = Programs::new(rt, node);
    let mut row = Row::default();
    const MB: u64 = 1 << 20;
    let mut seed = 0u32;
    let mut next_seed = || {
        seed += 1;
        seed
    };

    // One long-lived server with the library.
    let port = 7401;
    let turns = [true, false, true, true, false];
    let conc = [true, true, false, true, false, true];
    let conns = turns.len() + conc.len() + 2;
    let srv = p.server(node, true, port, conns);
    for (i, lib) in turns.into_iter().enumerate() {
        let before = node.shm_opened();
        let s = next_seed();
        let r = client_ok(
            p.client(node, port, lib, MB, s),
            MB,
            s,
            &format!("turn {i} (client library: {lib})"),
        );
        let check = if lib { LANE_BYTES } else { MIXED_TO_LIB };
        row.put(check, r.clone());
        row.put(INTERLEAVED, r);
        row.lane_count(check, node, before, lib as u64);
        row.lane_count(INTERLEAVED, node, before, lib as u64);
    }
    let before = node.shm_opened();
    let clients: Vec<(Bg, u32, bool)> = conc
        .iter()
        .map(|&lib| {
            let s = next_seed();
            (p.client(node, port, lib, MB / 2, s), s, lib)
        })
        .collect();
    for (i, (c, s, lib)) in clients.into_iter().enumerate() {
        let r = client_ok(
            c,
            MB / 2,
            s,
            &format!("concurrent client {i} (library: {lib})"),
        );
        row.put(SEQ_CONC, r);
    }
    row.lane_count(
        SEQ_CONC,
        node,
        before,
        conc.iter().filter(|l| **l).count() as u64,
    );
    // A client killed mid-stream: the server carries on.
    let before = node.shm_opened();
    let victim = p.client(node, port, true, 0, next_seed());
    let r = wait_lane(node, before + 1);
    std::thread::sleep(Duration::from_millis(300));
    kill9(victim.pid());
    drop(victim);
    row.put(CLIENT_KILLED, r);
    row.lane_count(CLIENT_KILLED, node, before, 1);
    let before = node.shm_opened();
    let s = next_seed();
    let r = client_ok(
        p.client(node, port, true, MB, s),
        MB,
        s,
        "client after the killed one",
    );
    row.put(CLIENT_KILLED, r);
    row.lane_count(CLIENT_KILLED, node, before, 1);
    let (st, out, err) = srv.finish(T);
    if row.cells.iter().any(|(_, r)| r.is_err()) {
        eprintln!("{}: the long-lived server said:\n{out}{err}", rt.name());
    }
    let lines = out.lines().filter(|l| l.starts_with("conn ")).count();
    let r = if st.is_some_and(|s| s.success()) && lines == conns {
        Ok(())
    } else {
        Err(format!(
            "long-lived server: {st:?}, {lines}/{conns} connections ended: {out:?} {:?}",
            last_line(&err)
        ))
    };
    row.put(SEQ_CONC, r.clone());
    row.put(CLIENT_KILLED, r);

    // A server without the library: no lane, in either case.
    let port = 7402;
    let srv = p.server(node, false, port, 2);
    for lib in [true, false] {
        let before = node.shm_opened();
        let s = next_seed();
        let r = client_ok(
            p.client(node, port, lib, MB, s),
            MB,
            s,
            &format!("plain server, client library: {lib}"),
        );
        row.put(MIXED_TO_PLAIN, r);
        row.lane_count(MIXED_TO_PLAIN, node, before, 0);
    }
    let (st, out, err) = srv.finish(T);
    if !st.is_some_and(|s| s.success()) {
        row.put(
            MIXED_TO_PLAIN,
            Err(format!(
                "plain server: {st:?} {out:?} {:?}",
                last_line(&err)
            )),
        );
    }

    // A server killed mid-stream: the client ends with EOF or a reset.
    let port = 7403;
    let srv = p.server(node, true, port, 1);
    let before = node.shm_opened();
    let c = p.client(node, port, true, 0, next_seed());
    let mut r = wait_lane(node, before + 1);
    std::thread::sleep(Duration::from_millis(300));
    kill9(srv.pid());
    drop(srv);
    let (st, out, _) = c.finish(Duration::from_secs(30));
    let code = st.and_then(|s| s.code());
    if code != Some(3) {
        r = Err(format!(
            "client of the killed server: exit {code:?} (want 3: EOF or reset), stdout {:?}",
            out.trim()
        ));
    }
    row.put(SERVER_KILLED, r);
    row.lane_count(SERVER_KILLED, node, before, 1);
    row
}

/// Prints the table header and `rt`'s row (one write, so rows of runtimes
/// running at once do not interleave), then panics unless every cell is ok.
pub fn report(rt: Runtime, row: &Row) {
    let mut s = String::new();
    s.push_str("\n| runtime |");
    for c in CHECKS {
        s.push_str(&format!(" {c} |"));
    }
    s.push_str("\n|---|");
    for _ in CHECKS {
        s.push_str("---|");
    }
    s.push_str(&format!("\n| {} |", rt.name()));
    let mut failed = Vec::new();
    for c in CHECKS {
        let cell = match row.cells.iter().find(|(k, _)| *k == c) {
            Some((_, Ok(()))) => "ok".to_string(),
            Some((_, Err(e))) => {
                failed.push(format!("{c}: {e}"));
                "FAIL".to_string()
            }
            None => {
                failed.push(format!("{c}: not run"));
                "not run".to_string()
            }
        };
        s.push_str(&format!(" {cell} |"));
    }
    println!("{s}\n");
    assert!(failed.is_empty(), "{}:\n{}", rt.name(), failed.join("\n"));
}
