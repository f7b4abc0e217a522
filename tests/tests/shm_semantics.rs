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
    assert_eq!(case("flags", "flags", 7201), 1);
}

#[test]
fn poll_select_and_edge_triggered_epoll() {
    assert_eq!(case("waits", "waits", 7202), 1);
}

#[test]
fn prefork_server_accepts_in_children() {
    assert_eq!(case("pfork", "prefork", 7203), 4);
}

#[test]
fn dup2_keeps_the_connection_until_the_last_fd() {
    assert_eq!(case("dup2", "dup2", 7204), 1);
}

#[test]
fn splice_through_a_pipe_in_both_directions() {
    assert_eq!(case("splce", "splice", 7207), 1);
}

#[test]
fn non_blocking_connect_and_io() {
    assert_eq!(case("nbcon", "nonblocking", 7205), 1);
}

/// The server is SIGKILLed mid-stream: the client sees EOF or ECONNRESET
/// promptly (printed), never a hang.
#[test]
fn peer_killed_mid_stream_ends_the_reader() {
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
    assert_eq!(node.shm_opened(), 1);
}

/// Mixed pairs: library on one side only → TCP, identical bytes, and the
/// daemon counted no shm connection. Also: no daemon at all → TCP.
#[test]
fn mixed_pairs_and_no_daemon_stay_on_tcp() {
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
    let st = node.stats();
    assert_eq!(
        st.lanes["shm"].connections_active, 0,
        "daemon still tracks connections"
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
    assert_eq!(node.shm_opened(), 3);
}
