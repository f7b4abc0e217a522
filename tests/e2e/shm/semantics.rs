//! The transparency contract over the shared-memory lane, one case per
//! test: a Python program on each end (unmodified sockets code) checks what
//! a TCP program expects, and the daemon's counters prove the lane was used.

use flowlane_e2e::shm::{fd_and_memfd_count, run_ok, wait_listening, Bg, Node};
use flowlane_e2e::shm_scripts::{ECHO_CLIENT, ECHO_SERVER, PYTHON, SEMANTICS};
use std::io::BufRead;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(120);

/// Runs SEMANTICS `case` with the server in pod 1 and the client in pod 0,
/// both with the library; returns the shm connections the daemon counted.
fn case(tag: &str, case: &str, port: u16) -> u64 {
    let node = Node::new(tag, 2);
    let (c, s) = (&node.pods[0], &node.pods[1]);
    let p = port.to_string();
    let srv = Bg::spawn(node.cmd(s, true, &[PYTHON, "-c", SEMANTICS, "server", &p, case]));
    wait_listening(s, port);
    let ip = s.ip.to_string();
    let out = run_ok(
        node.cmd(c, true, &[PYTHON, "-c", SEMANTICS, "client", &ip, &p, case]),
        T,
        case,
    );
    assert!(out.contains(&format!("ok {case}")), "{out}");
    let (st, out, err) = srv.finish(T);
    assert!(
        st.is_some_and(|s| s.success()),
        "server {case}: {out} {err}"
    );
    node.shm_opened()
}

#[test]
fn msg_flags_fionread_and_socket_names() {
    let _turn = crate::turn::take(module_path!());
    assert_eq!(case("flags", "flags", 7201), 1);
}

#[test]
fn poll_select_and_edge_triggered_epoll() {
    let _turn = crate::turn::take(module_path!());
    assert_eq!(case("waits", "waits", 7202), 1);
}

#[test]
fn prefork_server_accepts_in_children() {
    let _turn = crate::turn::take(module_path!());
    assert_eq!(case("pfork", "prefork", 7203), 4);
}

#[test]
fn dup2_keeps_the_connection_until_the_last_fd() {
    let _turn = crate::turn::take(module_path!());
    assert_eq!(case("dup2", "dup2", 7204), 1);
}

#[test]
fn splice_through_a_pipe_in_both_directions() {
    let _turn = crate::turn::take(module_path!());
    assert_eq!(case("splce", "splice", 7207), 1);
}

#[test]
fn non_blocking_connect_and_io() {
    let _turn = crate::turn::take(module_path!());
    assert_eq!(case("nbcon", "nonblocking", 7205), 1);
}

/// The server is SIGKILLed mid-stream: the client sees EOF or ECONNRESET
/// promptly (printed), never a hang.
#[test]
fn peer_killed_mid_stream_ends_the_reader() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new("kill", 2);
    let (c, s) = (&node.pods[0], &node.pods[1]);
    let srv = Bg::spawn(node.cmd(
        s,
        true,
        &[PYTHON, "-c", SEMANTICS, "server", "7206", "kill"],
    ));
    wait_listening(s, 7206);
    let ip = s.ip.to_string();
    let mut cli = Bg::spawn(node.cmd(
        c,
        true,
        &[PYTHON, "-c", SEMANTICS, "client", &ip, "7206", "kill"],
    ));
    let mut lines = std::io::BufReader::new(cli.0.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "streaming");
    let t0 = Instant::now();
    // SAFETY: killing our own child (ip netns exec / env exec in place).
    unsafe { libc::kill(srv.pid() as i32, libc::SIGKILL) };
    assert_eq!(
        lines.next().map(|l| l.unwrap()),
        Some("eof-after-kill".into()),
        "client did not see the end"
    );
    let took = t0.elapsed();
    eprintln!("reader saw the end {took:?} after SIGKILL");
    assert!(took < Duration::from_secs(10), "far too slow: {took:?}");
    drop(cli);
    assert_shm_opened(&node, 1);
}

/// The daemon counted `expected` shm connections; if not, the message says
/// why connections stayed on TCP (fallback reasons, requests, the daemon's
/// log).
fn assert_shm_opened(node: &Node, expected: u64) {
    let st = node.stats();
    let opened = st.lanes.get("shm").map_or(0, |l| l.connections_opened);
    let log = node.daemon_log();
    let lines: Vec<&str> = log.lines().collect();
    let tail = lines[lines.len().saturating_sub(60)..].join("\n");
    assert_eq!(
        opened, expected,
        "shm connections opened; fallbacks {:?}, requests {:?}, refused {}; daemon log (end):\n{}",
        st.fallbacks, st.requests, st.connections_refused, tail
    );
}

/// Mixed pairs: library on one side only → TCP, identical bytes, and the
/// daemon counted no shm connection. Also: no daemon at all → TCP.
#[test]
fn mixed_pairs_and_no_daemon_stay_on_tcp() {
    let _turn = crate::turn::take(module_path!());
    let mut node = Node::new("mixed", 2);
    let ip = node.pods[1].ip.to_string();
    for (i, (cli_lib, srv_lib)) in [(true, false), (false, true)].into_iter().enumerate() {
        let port = (7210 + i).to_string();
        let srv = Bg::spawn(node.cmd(&node.pods[1], srv_lib, &[PYTHON, "-c", ECHO_SERVER, &port]));
        wait_listening(&node.pods[1], 7210 + i as u16);
        let out = run_ok(
            node.cmd(
                &node.pods[0],
                cli_lib,
                &[PYTHON, "-c", ECHO_CLIENT, &ip, &port, "3000000", "5"],
            ),
            T,
            "mixed echo",
        );
        assert!(out.starts_with("ok 3000000"), "{out}");
        assert!(srv.finish(T).0.is_some_and(|s| s.success()));
    }
    assert_eq!(node.shm_opened(), 0, "a mixed pair must stay on TCP");
    node.stop_daemon();
    let srv = Bg::spawn(node.cmd(&node.pods[1], true, &[PYTHON, "-c", ECHO_SERVER, "7212"]));
    wait_listening(&node.pods[1], 7212);
    let out = run_ok(
        node.cmd(
            &node.pods[0],
            true,
            &[PYTHON, "-c", ECHO_CLIENT, &ip, "7212", "3000000", "6"],
        ),
        T,
        "no daemon",
    );
    assert!(out.starts_with("ok 3000000"), "{out}");
    assert!(srv.finish(T).0.is_some_and(|s| s.success()));
}

/// A long-lived server handles many connections: afterwards its fd count
/// and its memfd mappings are back where they started.
#[test]
fn no_fd_or_mapping_leaks_after_close() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new("leak", 2);
    let (c, s) = (&node.pods[0], &node.pods[1]);
    let srv = Bg::spawn(node.cmd(s, true, &[PYTHON, "-c", ECHO_SERVER, "7220", "21"]));
    wait_listening(s, 7220);
    let ip = s.ip.to_string();
    let run = |seed: &str| {
        let out = run_ok(
            node.cmd(
                c,
                true,
                &[PYTHON, "-c", ECHO_CLIENT, &ip, "7220", "100000", seed],
            ),
            T,
            "leak echo",
        );
        assert!(out.starts_with("ok"), "{out}");
    };
    run("1");
    std::thread::sleep(Duration::from_millis(200));
    let before = fd_and_memfd_count(srv.pid());
    for i in 0..19 {
        run(&(i + 2).to_string());
    }
    std::thread::sleep(Duration::from_millis(200));
    let after = fd_and_memfd_count(srv.pid());
    assert_eq!(
        before, after,
        "(fds, memfd maps) before vs after 19 connections"
    );
    run("99");
    assert!(srv.finish(T).0.is_some_and(|s| s.success()));
    assert_eq!(node.shm_opened(), 21);
    // Close reports are one-way messages: poll until the last ones arrived.
    let settled = flowlane_e2e::wait::until(Duration::from_secs(30), || {
        let l = &node.stats().lanes["shm"];
        l.connections_active == 0 && l.connections_closed == l.connections_opened
    });
    assert!(
        settled,
        "daemon still tracks connections: {:?}",
        node.stats().lanes["shm"]
    );
}

/// CPU ticks (user + system) a process used so far.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields after the command: state is [0]; utime [11], stime [12].
    f.get(11).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0)
}

/// An idle connection costs no CPU: the server blocks in recv, the client
/// in poll, both on a shared-memory connection, for 3 s.
#[test]
fn idle_connection_uses_no_cpu() {
    let _turn = crate::turn::take(module_path!());
    const IDLE_SERVER: &str = "import socket\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\ns.bind(('0.0.0.0', 7230)); s.listen()\nc,_=s.accept()\nwhile c.recv(100): pass\n";
    const IDLE_CLIENT: &str = "import socket, select, sys\nc=socket.create_connection((sys.argv[1], 7230))\nc.sendall(b'hi')\nselect.select([c], [], [], 3.0)\nc.close()\nprint('done')\n";
    let node = Node::new("idle", 2);
    let (c, s) = (&node.pods[0], &node.pods[1]);
    let srv = Bg::spawn(node.cmd(s, true, &[PYTHON, "-c", IDLE_SERVER]));
    wait_listening(s, 7230);
    let ip = s.ip.to_string();
    let cli = Bg::spawn(node.cmd(c, true, &[PYTHON, "-c", IDLE_CLIENT, &ip]));
    std::thread::sleep(Duration::from_millis(800));
    let (s0, c0) = (cpu_ticks(srv.pid()), cpu_ticks(cli.pid()));
    std::thread::sleep(Duration::from_secs(2));
    let (s1, c1) = (cpu_ticks(srv.pid()), cpu_ticks(cli.pid()));
    eprintln!(
        "idle 2 s: server {} ticks, client {} ticks (100 ticks = 1 CPU s)",
        s1 - s0,
        c1 - c0
    );
    // Generous bound (10% of a core) for a loaded machine; busy spinning would be ~200.
    assert!(
        s1 - s0 <= 20 && c1 - c0 <= 20,
        "idle connection burns CPU: server {} client {}",
        s1 - s0,
        c1 - c0
    );
    let (st, out, _) = cli.finish(T);
    assert!(st.is_some_and(|s| s.success()) && out.contains("done"));
    assert!(srv.finish(T).0.is_some_and(|s| s.success()));
    assert_eq!(node.shm_opened(), 1);
}

/// FLOWLANE_DISABLE=1 keeps everything on TCP; FLOWLANE_RING_SIZE sets the
/// ring (seen in the FLOWLANE_LOG line) and the bytes still arrive intact.
#[test]
fn disable_and_ring_size_settings() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new("envs", 2);
    let (c, s) = (&node.pods[0], &node.pods[1]);
    let ip = s.ip.to_string();
    let srv = Bg::spawn(node.cmd(
        s,
        true,
        &["FLOWLANE_DISABLE=1", PYTHON, "-c", ECHO_SERVER, "7240"],
    ));
    wait_listening(s, 7240);
    let out = run_ok(
        node.cmd(
            c,
            true,
            &[
                "FLOWLANE_DISABLE=1",
                PYTHON,
                "-c",
                ECHO_CLIENT,
                &ip,
                "7240",
                "1000000",
                "3",
            ],
        ),
        T,
        "disabled echo",
    );
    assert!(out.starts_with("ok 1000000"), "{out}");
    assert!(srv.finish(T).0.is_some_and(|s| s.success()));
    assert_eq!(node.shm_opened(), 0, "FLOWLANE_DISABLE=1 must stay on TCP");

    let srv = Bg::spawn(node.cmd(
        s,
        true,
        &["FLOWLANE_RING_SIZE=64K", PYTHON, "-c", ECHO_SERVER, "7241"],
    ));
    wait_listening(s, 7241);
    let (st, out, err) = Bg::spawn(node.cmd(
        c,
        true,
        &[
            "FLOWLANE_RING_SIZE=64K",
            "FLOWLANE_LOG=info",
            PYTHON,
            "-c",
            ECHO_CLIENT,
            &ip,
            "7241",
            "20000000",
            "4",
        ],
    ))
    .finish(T);
    assert!(
        st.is_some_and(|s| s.success()) && out.starts_with("ok 20000000"),
        "{out} {err}"
    );
    assert!(
        err.contains("65536 bytes per direction"),
        "ring size not applied: {err}"
    );
    assert!(srv.finish(T).0.is_some_and(|s| s.success()));
    assert_eq!(node.shm_opened(), 1);
}

/// A thread already asleep in `epoll_wait` (here: on a set that held no
/// connection yet, so it slept in the kernel without the library's help)
/// must wake for a shared-memory connection registered afterwards by
/// another thread, and must get the application's own epoll data back,
/// never the library's internal tag. grpcio works exactly like this: its
/// poller thread sleeps in `epoll_wait` while other threads connect and
/// register sockets. (Before the fix the sleeper either received the
/// library's tagged data word, which grpc dereferences as a pointer and
/// crashes, or slept through the data because nobody asked for a doorbell.)
const EPOLL_SLEEPER_SERVER: &str = r#"
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen()
for _ in range(int(sys.argv[2])):
    c, _ = s.accept()
    if c.recv(16) == b'go':
        c.sendall(b'data')
        assert c.recv(16) == b''
    c.close()
print('served')
"#;

const EPOLL_SLEEPER_CLIENT: &str = r#"
import ctypes, socket, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
class Ev(ctypes.Structure):
    _pack_ = 1  # struct epoll_event is packed on x86-64
    _fields_ = [('events', ctypes.c_uint32), ('data', ctypes.c_uint64)]
EPOLLIN, EPOLLET = 0x1, 1 << 31
DATA = 0xABCD0001
ip, port = sys.argv[1], int(sys.argv[2])

def sleeper(epfd, out, started):
    buf = (Ev * 8)()
    started.set()
    n = libc.epoll_wait(epfd, buf, 8, 15000)
    out.append([(buf[i].events, buf[i].data) for i in range(max(n, 0))])

for round in range(2):
    # Round 0: the set is new, the library knows nothing of it when the
    # sleeper enters the kernel. Round 1: a set that already holds a
    # connection (the library's own wait loop) gets a second one.
    epfd = libc.epoll_create1(0)
    if round == 1:
        first = socket.create_connection((ip, port + 1))
        ev = Ev(EPOLLIN, 0x1111)
        assert libc.epoll_ctl(epfd, 1, first.fileno(), ctypes.byref(ev)) == 0
    out, started = [], threading.Event()
    t = threading.Thread(target=sleeper, args=(epfd, out, started))
    t.start(); started.wait()
    import time; time.sleep(0.3)  # the sleeper is in epoll_wait now
    s = socket.create_connection((ip, port))
    ev = Ev(EPOLLIN | EPOLLET, DATA)
    assert libc.epoll_ctl(epfd, 1, s.fileno(), ctypes.byref(ev)) == 0
    s.sendall(b'go')
    t.join(30)
    assert not t.is_alive()
    got = out[0]
    assert len(got) == 1, f'round {round}: sleeper saw {got!r} (expected one event)'
    events, data = got[0]
    assert data == DATA, f'round {round}: sleeper got data {data:#x}, not the application data {DATA:#x}'
    assert events & EPOLLIN, f'round {round}: events {events:#x}'
    assert s.recv(16) == b'data'
    s.close()
    if round == 1:
        first.close()
    libc.close(epfd)
print('ok sleeper')
"#;

#[test]
fn epoll_sleeper_wakes_for_a_connection_registered_later() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new("eslp", 2);
    let (c, s) = (&node.pods[0], &node.pods[1]);
    let srv = Bg::spawn(node.cmd(s, true, &[PYTHON, "-c", EPOLL_SLEEPER_SERVER, "7250", "2"]));
    // Round 1's first connection only needs a listener that accepts.
    let idle = Bg::spawn(node.cmd(s, true, &[PYTHON, "-c", EPOLL_SLEEPER_SERVER, "7251", "1"]));
    wait_listening(s, 7250);
    wait_listening(s, 7251);
    let ip = s.ip.to_string();
    let out = run_ok(
        node.cmd(c, true, &[PYTHON, "-c", EPOLL_SLEEPER_CLIENT, &ip, "7250"]),
        T,
        "epoll sleeper",
    );
    assert!(out.contains("ok sleeper"), "{out}");
    for srv in [srv, idle] {
        let (st, out, err) = srv.finish(T);
        assert!(st.is_some_and(|s| s.success()), "server: {out} {err}");
    }
    assert_shm_opened(&node, 3);
}

/// SO_RCVTIMEO / SO_SNDTIMEO set by the application bound blocking reads
/// and writes on a shared-memory connection as on TCP: EAGAIN when nothing
/// moved, a short count when some bytes did; getsockopt reports the value.
const TIMEO_SERVER: &str = r#"
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen()
c, _ = s.accept()
assert c.recv(4) == b'ping'
c.sendall(b'pong')
time.sleep(4)  # not reading: the client's ring fills up
n = 0
while True:
    d = c.recv(1 << 20)
    if not d: break
    n += len(d)
print('served', n)
"#;

const TIMEO_CLIENT: &str = r#"
import socket, struct, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
tv = struct.pack('ll', 0, 300000)
c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
assert c.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16) == tv
t0 = time.monotonic()
try:
    c.recv(10)
    raise SystemExit('recv returned without data')
except BlockingIOError:
    pass
waited = time.monotonic() - t0
assert waited >= 0.25, f'recv gave up after {waited:.3f} s, before its SO_RCVTIMEO'
c.sendall(b'ping')
assert c.recv(4) == b'pong'  # a read with data still works
c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
big = b'x' * (4 << 20)
n = c.send(big)  # the ring takes part of it, then the timeout
assert 0 < n < len(big), n
try:
    c.send(big)
    raise SystemExit('send into a full ring returned')
except BlockingIOError:
    pass
c.close()
print('ok timeo', n)
"#;

#[test]
fn socket_timeouts_bound_blocking_reads_and_writes() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new("timeo", 2);
    let (c, s) = (&node.pods[0], &node.pods[1]);
    let srv = Bg::spawn(node.cmd(s, true, &[PYTHON, "-c", TIMEO_SERVER, "7260"]));
    wait_listening(s, 7260);
    let ip = s.ip.to_string();
    let out = run_ok(
        node.cmd(c, true, &[PYTHON, "-c", TIMEO_CLIENT, &ip, "7260"]),
        T,
        "socket timeouts",
    );
    let sent = last_number(&out, "ok timeo");
    let (st, srv_out, err) = srv.finish(T);
    assert!(st.is_some_and(|s| s.success()), "server: {srv_out} {err}");
    // The server received exactly the bytes the short send reported, and
    // nothing of the send that timed out.
    assert_eq!(last_number(&srv_out, "served"), sent, "{out} / {srv_out}");
    assert_eq!(node.shm_opened(), 1);
}

/// Options set before the connection existed hold on the ring: set on the
/// client's socket before `connect`, on a socket whose forked child set
/// them (the library cannot see that: it reads them after any fork), and
/// inherited from the listener by an accepted socket (Linux copies them).
/// The set-up skips reading them only for a socket it knows holds the
/// defaults (docs/shm-lane.md, "Doorbells").
/// Both scripts start with `RECV_UNTIL`.
const RECV_UNTIL: &str = r#"
def recv_until(c, want, what):
    got = b''
    while len(got) < len(want):
        try:
            d = c.recv(len(want) - len(got))
        except BlockingIOError:
            continue
        if not d: raise SystemExit('eof: ' + what)
        got += d
    assert got == want, got
"#;

const EARLY_OPTS_SERVER: &str = r#"
import socket, struct, sys, time
tv = struct.pack('ll', 0, 300000)
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen()
for i in range(2):
    c, _ = s.accept()
    assert c.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    t0 = time.monotonic()
    try:
        c.recv(10)
        raise SystemExit('recv returned without data')
    except BlockingIOError:
        pass
    assert time.monotonic() - t0 >= 0.25, 'the listener timeout did not hold'
    # The client times its own recv only after this: nothing is sent to
    # either end while it waits.
    c.sendall(b'a')
    recv_until(c, b'ok', 'server')
    c.sendall(b'go')
    c.close()
print('served ok')
"#;

const EARLY_OPTS_CLIENT: &str = r#"
import os, socket, struct, sys, time
tv = struct.pack('ll', 0, 300000)
addr = (sys.argv[1], int(sys.argv[2]))
def check(c, nodelay, what):
    assert c.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == nodelay, what
    recv_until(c, b'a', what)
    t0 = time.monotonic()
    try:
        c.recv(10)
        raise SystemExit('recv returned without data: ' + what)
    except BlockingIOError:
        pass
    assert time.monotonic() - t0 >= 0.25, what + ': the timeout did not hold'
    c.sendall(b'ok')
    recv_until(c, b'go', what)
    c.close()
c = socket.socket()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
c.connect(addr)
check(c, 1, 'set before connect')
c = socket.socket()
pid = os.fork()
if pid == 0:
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    os._exit(0)
os.waitpid(pid, 0)
c.connect(addr)
check(c, 0, 'set by a forked child')
print('ok early options')
"#;

#[test]
fn options_set_before_the_connection_hold_on_the_ring() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new("eopt", 2);
    let (c, s) = (&node.pods[0], &node.pods[1]);
    let script = |body: &str| format!("{RECV_UNTIL}{body}");
    let srv = Bg::spawn(node.cmd(s, true, &[PYTHON, "-c", &script(EARLY_OPTS_SERVER), "7261"]));
    wait_listening(s, 7261);
    let ip = s.ip.to_string();
    let client = script(EARLY_OPTS_CLIENT);
    let cli = Bg::spawn(node.cmd(c, true, &[PYTHON, "-c", &client, &ip, "7261"]));
    let (cst, out, cerr) = cli.finish(T);
    let (st, srv_out, err) = srv.finish(T);
    let both = format!("client: {out} {cerr}\nserver: {srv_out} {err}");
    assert!(cst.is_some_and(|s| s.success()), "{both}");
    assert!(out.contains("ok early options"), "{both}");
    assert!(st.is_some_and(|s| s.success()), "{both}");
    assert!(srv_out.contains("served ok"), "{both}");
    assert_eq!(node.shm_opened(), 2, "both connections on the lane");
}

/// The number after `tag` on the line that starts with it.
fn last_number(out: &str, tag: &str) -> u64 {
    out.lines()
        .find_map(|l| l.strip_prefix(tag))
        .and_then(|rest| rest.trim().parse().ok())
        .unwrap_or_else(|| panic!("no '{tag} N' line in: {out}"))
}

/// A thread of the parent is blocked in `recv` on a shared-memory
/// connection (holding the connection's read lock) when another thread
/// forks: the child must still be able to use the connection (here: a
/// non-blocking recv answers EAGAIN instead of hanging on the lock).
const FORK_CLIENT: &str = r#"
import os, socket, sys, threading, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
got = []
t = threading.Thread(target=lambda: got.append(c.recv(16)), daemon=True)
t.start()
time.sleep(0.3)  # the thread is blocked in recv now
pid = os.fork()
if pid == 0:
    try:
        c.recv(16, socket.MSG_DONTWAIT)
        os._exit(3)
    except BlockingIOError:
        os._exit(0)
deadline = time.monotonic() + 20
while True:
    p, status = os.waitpid(pid, os.WNOHANG)
    if p:
        break
    if time.monotonic() > deadline:
        os.kill(pid, 9)
        raise SystemExit('the child hung on a lock held by a parent thread')
    time.sleep(0.02)
assert os.waitstatus_to_exitcode(status) == 0, status
c.sendall(b'go')
t.join(20)
assert got == [b'data'], got
c.close()
print('ok fork')
"#;

#[test]
fn forked_child_is_not_blocked_by_a_parent_threads_lock() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new("fklck", 2);
    let (c, s) = (&node.pods[0], &node.pods[1]);
    let srv = Bg::spawn(node.cmd(s, true, &[PYTHON, "-c", EPOLL_SLEEPER_SERVER, "7261", "1"]));
    wait_listening(s, 7261);
    let ip = s.ip.to_string();
    let out = run_ok(
        node.cmd(c, true, &[PYTHON, "-c", FORK_CLIENT, &ip, "7261"]),
        T,
        "fork with a held lock",
    );
    assert!(out.contains("ok fork"), "{out}");
    let (st, out, err) = srv.finish(T);
    assert!(st.is_some_and(|s| s.success()), "server: {out} {err}");
    assert_eq!(node.shm_opened(), 1);
}

// ------------------------------------------------------------------------
// Two threads of one process waiting on the same shared-memory connection
// (docs/shm-lane.md, waiting): every waiter wakes when data or room arrives.

/// Serves the two-waiters client: for each read case it answers the
/// client's `g` with one byte `d` a moment later (so both waiters are
/// asleep by then); for the room case it stops reading until both writers
/// wait, then frees room once and reads the rest.
const TWO_WAITERS_SERVER: &str = r#"
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen()
c, _ = s.accept()
for _ in range(int(sys.argv[2])):
    assert c.recv(1) == b'g'
    time.sleep(0.2)
    c.sendall(b'd')
time.sleep(1.0)  # the client has filled the ring and both writers sleep
n = len(c.recv(65536))
while True:
    d = c.recv(1 << 20)
    if not d: break
    n += len(d)
c.sendall(str(n).encode())
c.close()
print('served', n)
"#;

/// Two threads wait on one socket in each combination (poll, select, epoll
/// in its own set, blocking recv with MSG_PEEK); after one write by the
/// peer both must report readiness. The waits' own timeouts (10 s) and
/// FLOWLANE_WAIT_SLICE_MS=60000 mean a missed wake-up cannot be rescued
/// by a periodic re-check: it fails the case.
const TWO_WAITERS_CLIENT: &str = r#"
import os, select, socket, sys, threading, time
CASES = {'poll+poll': ('poll', 'poll'), 'poll+recv': ('poll', 'peek'),
         'epoll+recv': ('epoll', 'peek'), 'epoll+epoll': ('epoll', 'epoll'),
         'poll+select': ('poll', 'select'), 'select+epoll': ('select', 'epoll'),
         'one epoll set': ('shared', 'shared')}
SHARED = {}
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))

def wait(kind, want, out, i):
    if kind == 'poll':
        p = select.poll(); p.register(c, want)
        ok = any(ev & want for _, ev in p.poll(10000))
    elif kind == 'epoll':
        e = select.epoll(); e.register(c.fileno(), want)
        ok = any(ev & want for _, ev in e.poll(10)); e.close()
    elif kind == 'shared':  # both threads in one epoll set (level-triggered)
        ok = any(ev & want for _, ev in SHARED['set'].poll(10))
    elif kind == 'select':
        r, w, _ = select.select([c] if want == select.POLLIN else [],
                                [c] if want == select.POLLOUT else [], [], 10)
        ok = bool(r or w)
    else:
        ok = c.recv(1, socket.MSG_PEEK) == b'd'
    out[i] = ok

def both(kinds, want, name, kick):
    if 'shared' in kinds:
        SHARED['set'] = select.epoll(); SHARED['set'].register(c.fileno(), want)
    out = [None, None]
    ts = [threading.Thread(target=wait, args=(k, want, out, i), daemon=True)
          for i, k in enumerate(kinds)]
    for t in ts: t.start()
    time.sleep(0.3)  # both threads are past their spin and asleep
    kick()
    for t in ts: t.join(8)
    if out != [True, True]:
        print('FAIL', name, out, flush=True)
        os._exit(1)
    print('woke', name, flush=True)

for name, kinds in CASES.items():
    both(kinds, select.POLLIN, name, lambda: c.sendall(b'g'))
    assert c.recv(1) == b'd'
c.setblocking(False)
sent = 0
try:
    while True: sent += c.send(b'x' * 65536)
except BlockingIOError:
    pass
both(('poll', 'epoll'), select.POLLOUT, 'room poll+epoll', lambda: None)
c.setblocking(True)
c.shutdown(socket.SHUT_WR)
got = b''
while True:
    d = c.recv(100)
    if not d: break
    got += d
assert int(got) == sent, (got, sent)
print('ok two-waiters', sent)
"#;

#[test]
fn two_threads_waiting_on_one_connection_both_wake() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new("twow", 2);
    let (c, s) = (&node.pods[0], &node.pods[1]);
    let srv = Bg::spawn(node.cmd(s, true, &[PYTHON, "-c", TWO_WAITERS_SERVER, "7270", "7"]));
    wait_listening(s, 7270);
    let ip = s.ip.to_string();
    let mut cmd = node.cmd(c, true, &[PYTHON, "-c", TWO_WAITERS_CLIENT, &ip, "7270"]);
    // No periodic re-check may hide a lost wake-up.
    cmd.env("FLOWLANE_WAIT_SLICE_MS", "60000");
    let out = run_ok(cmd, T, "two waiters");
    assert!(out.contains("ok two-waiters"), "{out}");
    let (st, out, err) = srv.finish(T);
    assert!(st.is_some_and(|s| s.success()), "server: {out} {err}");
    assert_eq!(node.shm_opened(), 1);
}

/// TCP urgent data on a shared-memory connection fails visibly and leaves
/// the stream intact: send(MSG_OOB) is refused with EOPNOTSUPP (nothing is
/// written), recv(MSG_OOB) answers EINVAL as TCP does with no urgent data
/// pending (never a read of in-band bytes). copy_file_range with a socket
/// at either end is refused by Linux itself (EINVAL), lane or not.
const URGENT_CLIENT: &str = r#"
import errno, os, socket, sys, tempfile
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
c.sendall(b'before|')
try:
    c.send(b'!', socket.MSG_OOB)
    raise SystemExit('send(MSG_OOB) went through')
except OSError as e:
    assert e.errno == errno.EOPNOTSUPP, e
try:
    c.recv(1, socket.MSG_OOB)
    raise SystemExit('recv(MSG_OOB) returned data')
except OSError as e:
    assert e.errno == errno.EINVAL, e
f = tempfile.TemporaryFile(); f.write(b'file'); f.flush()
for src, dst in ((f.fileno(), c.fileno()), (c.fileno(), f.fileno())):
    try:
        os.copy_file_range(src, dst, 4, 0 if src == f.fileno() else None)
        raise SystemExit('copy_file_range on a socket went through')
    except OSError as e:
        assert e.errno == errno.EINVAL, e
c.sendall(b'after')
c.shutdown(socket.SHUT_WR)
got = b''
while True:
    d = c.recv(100)
    if not d: break
    got += d
assert got == b'before|after', got
print('ok urgent')
"#;

#[test]
fn urgent_data_and_copy_file_range_fail_clearly() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new("urgnt", 2);
    let (c, s) = (&node.pods[0], &node.pods[1]);
    let srv = Bg::spawn(node.cmd(s, true, &[PYTHON, "-c", ECHO_SERVER, "7271", "1"]));
    wait_listening(s, 7271);
    let ip = s.ip.to_string();
    let out = run_ok(
        node.cmd(c, true, &[PYTHON, "-c", URGENT_CLIENT, &ip, "7271"]),
        T,
        "urgent",
    );
    assert!(out.contains("ok urgent"), "{out}");
    assert!(srv.finish(T).0.is_some_and(|s| s.success()));
    assert_eq!(node.shm_opened(), 1);
}

/// The process's kept daemon connection (see docs/shm-lane.md): echoes
/// `one`; then (after the test restarted the daemon) `two` on a fresh
/// daemon connection; `three` after the program closed the daemon fd with
/// a raw close_range behind the library's back; `four` after it dup2'd a
/// pipe onto the (new) daemon fd number, which the library then leaves
/// alone. Every connection must still get the lane.
const KEPT_CLIENT: &str = r#"
import ctypes, os, socket, sys
ip, port = sys.argv[1], int(sys.argv[2])
def echo(tag):
    c = socket.create_connection((ip, port))
    c.sendall(tag.encode())
    got = b''
    while len(got) < len(tag):
        got += c.recv(100)
    assert got == tag.encode(), got
    c.close()
def daemon_fds():
    out = []
    for name in os.listdir('/proc/self/fd'):
        try:
            t = os.readlink('/proc/self/fd/' + name)
        except OSError:
            continue
        if t.startswith('socket:') and int(name) >= 64:
            out.append(int(name))
    return out
echo('one')
fds = daemon_fds()
assert len(fds) == 1, fds
print('one', flush=True)
sys.stdin.readline()  # the daemon restarted meanwhile
echo('two')
fd = daemon_fds()[0]
libc = ctypes.CDLL(None, use_errno=True)
assert libc.syscall(436, fd, fd, 0) == 0  # SYS_close_range, not interposable
echo('three')
fds = daemon_fds()
assert len(fds) == 1, fds
r, w = os.pipe()
os.dup2(r, fds[0])  # the application takes the number over
echo('four')
os.write(w, b'pipe')
assert os.read(fds[0], 4) == b'pipe'  # nothing of the library's went there
print('ok kept', flush=True)
"#;

#[test]
fn kept_daemon_connection_survives_restart_raw_close_and_dup2() {
    let _turn = crate::turn::take(module_path!());
    let mut node = Node::new("kept", 2);
    let ip = node.pods[1].ip.to_string();
    let srv = Bg::spawn(node.cmd(
        &node.pods[1],
        true,
        &[PYTHON, "-c", ECHO_SERVER, "7272", "4"],
    ));
    wait_listening(&node.pods[1], 7272);
    let mut cmd = node.cmd(
        &node.pods[0],
        true,
        &[PYTHON, "-c", KEPT_CLIENT, &ip, "7272"],
    );
    cmd.stdin(std::process::Stdio::piped());
    let mut cli = Bg::spawn(cmd);
    let mut lines = std::io::BufReader::new(cli.0.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().map(|l| l.unwrap()), Some("one".into()));
    assert_eq!(node.shm_opened(), 1);
    node.stop_daemon();
    node.start_daemon();
    use std::io::Write;
    writeln!(cli.0.stdin.as_mut().unwrap()).unwrap();
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let (st, _, err) = cli.finish(T);
    assert!(
        st.is_some_and(|s| s.success()) && rest.iter().any(|l| l == "ok kept"),
        "client: {rest:?} {err}"
    );
    assert!(srv.finish(T).0.is_some_and(|s| s.success()));
    // The restarted daemon saw connections two, three and four on the lane.
    assert_eq!(node.shm_opened(), 3);
}

/// Measurement tool, not a CI test: connection
/// set-up rate and connect + first byte p50 over the lane, plain TCP, and
/// the two fallback paths (server without the library; no daemon), median
/// of 3 alternating rounds. `FLS_LIB=/path/libflowlane_preload.so` compares
/// another build of the library. Run with
/// `cargo test --release -p flowlane-e2e --test e2e -- --ignored shm::semantics::setup_rate --nocapture`.
#[test]
#[ignore]
fn setup_rate_figures() {
    let _turn = crate::turn::take(module_path!());
    use flowlane_e2e::shm::{build_dir, preload_lib};
    let node = Node::new("rate", 2);
    let (c, s) = (&node.pods[0], &node.pods[1]);
    let lib = std::env::var("FLS_LIB").unwrap_or_else(|_| preload_lib().display().to_string());
    let bench = build_dir().join("shm-bench").display().to_string();
    let sock = node.socket().display().to_string();
    let cmd = |pod: &flowlane_e2e::shm::Pod, env: &[String], args: &[&str]| {
        let mut c = std::process::Command::new("ip");
        c.args(["netns", "exec", &pod.netns, "env"]);
        c.args(env).arg(&bench).args(args);
        c
    };
    let with_lib = |extra: &[&str]| -> Vec<String> {
        let mut v = vec![
            format!("LD_PRELOAD={lib}"),
            format!("FLOWLANE_SOCKET={sock}"),
        ];
        v.extend(extra.iter().map(|x| x.to_string()));
        v
    };
    let _servers = [
        Bg::spawn(cmd(s, &[], &["serve", "7100"])),
        Bg::spawn(cmd(s, &with_lib(&[]), &["serve", "7101"])),
        Bg::spawn(cmd(
            s,
            &with_lib(&["FLOWLANE_DISABLE=1"]),
            &["serve", "7102"],
        )),
    ];
    for p in [7100, 7101, 7102] {
        wait_listening(s, p);
    }
    let ip = s.ip.to_string();
    let variants: [(&str, Vec<String>, u16); 4] = [
        ("shm lane", with_lib(&[]), 7101),
        ("tcp, no lib", vec![], 7100),
        ("lib, peer off", with_lib(&[]), 7102),
        (
            "lib, no daemon",
            with_lib(&["FLOWLANE_SOCKET=/nonexistent/fl.sock"]),
            7100,
        ),
    ];
    if let Ok(out) = std::env::var("FLS_STRACE") {
        // Where a lane set-up spends its time: both ends under strace.
        let srv = Bg::spawn(cmd(s, &with_lib(&[]), &["serve", "7103"]));
        wait_listening(s, 7103);
        let mut st = std::process::Command::new("strace");
        st.args(["-f", "-tt", "-T", "-p", &srv.pid().to_string(), "-o"])
            .arg(format!("{out}.server"));
        let mut tracer = Bg::spawn(st);
        std::thread::sleep(Duration::from_millis(500));
        let mut c2 = std::process::Command::new("strace");
        c2.args([
            "-f",
            "-tt",
            "-T",
            "-o",
            &format!("{out}.client"),
            "ip",
            "netns",
            "exec",
        ])
        .arg(&c.netns)
        .arg("env")
        .args(with_lib(&[]))
        .args([&bench, "connrate", &format!("{}:7103", s.ip), "20"]);
        run_ok(c2, T, "strace connrate");
        // SAFETY: stopping the strace we started.
        unsafe { libc::kill(tracer.pid() as i32, libc::SIGINT) };
        let _ = tracer.0.wait();
    }
    if let Ok(out) = std::env::var("FLS_PERF") {
        // Where the daemon spends its time during lane set-ups.
        let mut pr = std::process::Command::new("perf");
        pr.args(["record", "-g", "-o", &out, "-p"])
            .arg(node.daemon_pid().unwrap().to_string());
        let mut rec = Bg::spawn(pr);
        std::thread::sleep(Duration::from_millis(500));
        let addr = format!("{ip}:7101");
        run_ok(
            cmd(c, &with_lib(&[]), &["connrate", &addr, "3000"]),
            T,
            "connrate",
        );
        // SAFETY: stopping the perf we started.
        unsafe { libc::kill(rec.pid() as i32, libc::SIGINT) };
        let _ = rec.0.wait();
    }
    if std::env::var_os("FLS_PHASES").is_some() {
        // p50 of each phase of a short connection, lane vs plain TCP.
        const PHASES: &str = r#"
import socket, sys, time
ip, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ph = [[], [], [], []]
for _ in range(n):
    t0 = time.perf_counter()
    c = socket.create_connection((ip, port)); t1 = time.perf_counter()
    c.sendall(b'Ex'); t2 = time.perf_counter()
    assert c.recv(1); t3 = time.perf_counter()
    c.close(); t4 = time.perf_counter()
    for i, d in enumerate((t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
        ph[i].append(d * 1e6)
print(' '.join('%.1f' % sorted(p)[len(p) // 2] for p in ph))
"#;
        for (name, env, port) in [("shm lane", with_lib(&[]), 7101), ("tcp", vec![], 7100)] {
            let mut c2 = std::process::Command::new("ip");
            c2.args(["netns", "exec", &c.netns, "env"])
                .args(&env)
                .args([PYTHON, "-c", PHASES, &ip, &port.to_string(), "500"]);
            let out = run_ok(c2, T, "phases");
            println!(
                "{name}: p50 us connect / sendall / recv / close: {}",
                out.trim()
            );
        }
    }
    let opened0 = node.shm_opened();
    let mut rate = vec![Vec::new(); variants.len()];
    let mut p50 = vec![Vec::new(); variants.len()];
    for _ in 0..3 {
        for (i, (_, env, port)) in variants.iter().enumerate() {
            let addr = format!("{ip}:{port}");
            let out = run_ok(cmd(c, env, &["connrate", &addr, "1000"]), T, "connrate");
            let v: Vec<f64> = out
                .split_whitespace()
                .skip(1)
                .filter_map(|x| x.parse().ok())
                .collect();
            rate[i].push(v[0]);
            p50[i].push(v[1]);
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    println!("library: {lib}");
    println!(
        "{:<18} {:>14} {:>22}",
        "lane", "connections/s", "connect+1st byte p50 us"
    );
    for (i, (name, _, _)) in variants.iter().enumerate() {
        println!(
            "{name:<18} {:>14.0} {:>22.1}",
            median(rate[i].clone()),
            median(p50[i].clone())
        );
    }
    println!("shm connections opened: {}", node.shm_opened() - opened0);
    let st = node.stats();
    for (name, h) in [
        ("daemon request handling", &st.request_handling),
        ("channel set-up (intent to claim)", &st.channel_setup),
    ] {
        println!(
            "{name}: mean {:.1} us over {} ({:?} ns bounds, counts {:?})",
            h.sum_ns as f64 / h.count.max(1) as f64 / 1000.0,
            h.count,
            h.bounds_ns,
            h.counts
        );
    }
    // The daemon's round trip alone (a request it refuses at once: the test
    // process is no pod), on one kept connection vs a connection each.
    use flowlane_lane::client::DaemonClient;
    let p50 = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    let mut kept = DaemonClient::connect(&node.socket(), Duration::from_secs(2)).unwrap();
    let mut k = Vec::new();
    let mut f = Vec::new();
    for _ in 0..2000 {
        let t = Instant::now();
        let _ = kept.cancel_intent(0);
        k.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        let _ = DaemonClient::connect(&node.socket(), Duration::from_secs(2))
            .map(|mut d| d.cancel_intent(0));
        f.push(t.elapsed().as_secs_f64() * 1e6);
    }
    println!(
        "daemon request p50 us: {:.1} on a kept connection, {:.1} with a connection each",
        p50(k),
        p50(f)
    );
}
