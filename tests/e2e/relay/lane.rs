//! The cross-node relay (docs/relay.md) on this host: two "nodes", each a network
//! namespace with its own bridge and its own `flowlaned`, joined by an
//! underlay veth with host-gw routes to each other's pod CIDR. Pods are
//! namespaces wired by the real `flowlane` plugin run inside their node's
//! namespace. The daemons carry pod connections over `--lane-transport
//! tcp-test` (the test double behind the `LaneTransport` trait: one TCP
//! connection per stream on the underlay); everything else — preload
//! library, rings, pairing, pumps, doorbells, close and failure handling —
//! is the real code path the RDMA transport uses.
//!
//! Names: netns/links `rr<tag>…`; pod CIDRs 10.173.0.0/16, underlay
//! 10.174.0.0/16.

use std::net::{IpAddr, Ipv4Addr};
use std::process::{Child, Command};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use flowlane_e2e::attack_scripts::{victim_server, HOSTILE};
use flowlane_e2e::node_ns::{DaemonOpts, NsNode as Node, LANE_PORT};
use flowlane_e2e::ns_cluster::{Layout, NsCluster};
use flowlane_e2e::shm::{build_dir, run_ok, sh, Bg};
use flowlane_e2e::shm_scripts::{ECHO_CLIENT, ECHO_SERVER, PEER_KILL, PYTHON, SEMANTICS};
use flowlane_lane::peer_table::Verdict;

/// One cluster at a time in this binary (2 cores).
static SERIAL: Mutex<()> = Mutex::new(());
/// The test cluster's shared lane key.
const LANE_KEY: &[u8] = b"relay_lane: the test cluster's lane key, 32+ bytes\n";
const T: Duration = Duration::from_secs(120);

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Two nodes joined by an underlay, each with `pods` pods and a daemon
/// (`nodes`, `dir`, ... of the [`NsCluster`] it derefs to).
struct Cluster(NsCluster);

impl std::ops::Deref for Cluster {
    type Target = NsCluster;
    fn deref(&self) -> &NsCluster {
        &self.0
    }
}

impl std::ops::DerefMut for Cluster {
    fn deref_mut(&mut self) -> &mut NsCluster {
        &mut self.0
    }
}

impl Cluster {
    fn new(pods: usize) -> Cluster {
        Cluster::build(pods, false, false)
    }

    /// `zero_copy`: the daemons' relay places bytes into the remote pod's
    /// ring (the RDMA transport's zero-copy protocol, emulated by tcp-test).
    /// `chained`: pods wired by bridge + flowlane chained (names `ch…`,
    /// pod CIDRs from 10.232.100.0/24 up, underlay 10.232.200.0/24 up).
    fn build(pods: usize, zero_copy: bool, chained: bool) -> Cluster {
        Cluster::build_with(pods, zero_copy, chained, |_| Vec::new())
    }

    /// `daemon_args(underlay)`: more flags for the daemon of the node with
    /// that underlay address.
    fn build_with(
        pods: usize,
        zero_copy: bool,
        chained: bool,
        daemon_args: impl Fn(Ipv4Addr) -> Vec<String>,
    ) -> Cluster {
        let layout = match chained {
            true => Layout::new("ch", "relay", "RR_KEEP")
                .addresses((232, 100), (232, 200), 50)
                .chained(),
            false => Layout::new("rr", "relay", "RR_KEEP").addresses((173, 0), (174, 0), 120),
        };
        let mut c = NsCluster::new(&layout, 2);
        let file = c.write_nodes_file(|_| Some(LANE_PORT));
        c.add_pods(pods);
        c.start_daemons(|node| {
            DaemonOpts::new("debug")
                .lanes(file.clone(), LANE_KEY)
                .args(daemon_args(node.underlay))
                // The relay moves bytes by (emulated) placement into the
                // remote ring: the zero-copy protocol of the RDMA
                // transport, over tcp-test.
                .env(
                    "FLOWLANE_RELAY_ZERO_COPY",
                    if zero_copy { "1" } else { "0" },
                )
        });
        Cluster(c)
    }

    /// The node table; `n1_lane` false: node n1 offers no lane.
    fn write_nodes_file(&self, n1_lane: bool) {
        self.0
            .write_nodes_file(|n| (n.name == "n0" || n1_lane).then_some(LANE_PORT));
    }

    fn logs(&self) -> String {
        self.0.logs(usize::MAX)
    }
}

/// Runs echo clients from `cn`'s pod 0 to an echo server in `sn`'s pod 0:
/// random write and read sizes, both directions at once, half-close, sha256
/// of both directions checked by the client.
fn echo_across(c: &Cluster, cn: usize, sn: usize, port: u16, conns: usize, bytes: u64) {
    let (client_node, server_node) = (&c.nodes[cn], &c.nodes[sn]);
    let server = &server_node.pods[0];
    let client = &client_node.pods[0];
    let _srv = server_node.serve(
        server,
        true,
        port,
        &[
            PYTHON,
            "-c",
            ECHO_SERVER,
            &port.to_string(),
            &conns.to_string(),
        ],
    );
    let ip = server.ip.to_string();
    for seed in 0..conns {
        let out = run_ok(
            client_node.cmd(
                client,
                true,
                &[
                    PYTHON,
                    "-c",
                    ECHO_CLIENT,
                    &ip,
                    &port.to_string(),
                    &bytes.to_string(),
                    &(seed + 11).to_string(),
                ],
            ),
            T,
            "echo client",
        );
        assert!(
            out.starts_with(&format!("ok {bytes}")),
            "{out}\n{}",
            c.logs()
        );
    }
}

/// Waits until both daemons count `n` closed relay connections.
fn wait_closed(c: &Cluster, n: u64) {
    let t0 = Instant::now();
    while c.nodes.iter().any(|node| node.relay().1 < n) {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "relay connections not closed: {:?}\n{}",
            c.nodes.iter().map(|n| n.relay()).collect::<Vec<_>>(),
            c.logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Checksummed echo with random sizes, both directions at once and a
/// half-close, from node 0 to node 1 and from node 1 to node 0; both
/// daemons prove the relay lane carried it (and the shm lane did not).
#[test]
fn relay_carries_checksummed_echo_both_ways_between_nodes() {
    let _turn = crate::turn::take(module_path!());
    checksummed_echo(false, false);
}

/// The same over the zero-copy protocol (RING/PLACED/ROOM: bytes land in
/// the remote ring before the frame that publishes them; credits are the
/// remote ring's free room), with random sizes across ring wraps.
#[test]
fn zero_copy_relay_carries_checksummed_echo_both_ways_between_nodes() {
    let _turn = crate::turn::take(module_path!());
    checksummed_echo(true, false);
}

/// Chained pods (the reference `bridge` + `host-local` wire them, flowlane
/// in chained mode records them; the cluster's host-gw routes stand in for
/// the other CNI's routing): the same echo rides the relay.
#[test]
fn chained_pods_ride_the_relay_between_nodes() {
    let _turn = crate::turn::take(module_path!());
    checksummed_echo(false, true);
}

fn checksummed_echo(zero_copy: bool, chained: bool) {
    let _g = serial();
    let c = Cluster::build(1, zero_copy, chained);
    if chained {
        // The reference bridge wired the pods; flowlane's own bridge is absent.
        for node in &c.nodes {
            let has = |br: &str| {
                sh(&["ip", "-n", &node.netns, "link", "show", br])
                    .status
                    .success()
            };
            assert!(has("chbr0") && !has("rrbr0"), "{}", node.netns);
        }
    }
    let bytes = 8_000_000u64;
    echo_across(&c, 0, 1, 7501, 3, bytes);
    echo_across(&c, 1, 0, 7502, 2, bytes);
    wait_closed(&c, 5);
    for node in &c.nodes {
        let st = node.stats();
        let relay = &st.lanes["relay"];
        assert_eq!(relay.connections_opened, 5, "{}: {st:?}", node.name);
        assert_eq!(relay.connections_active, 0, "{}: {st:?}", node.name);
        // Each connection moved `bytes` each way through this daemon.
        assert!(relay.bytes >= 5 * 2 * bytes, "{}: {st:?}", node.name);
        assert_eq!(st.lanes["shm"].connections_opened, 0);
        eprintln!("{}: relay lane {relay:?}", node.name);
    }
}

/// The shared-memory lane's socket-semantics cases, run across nodes
/// through the relay: MSG_PEEK/WAITALL/DONTWAIT, FIONREAD and socket names;
/// poll, select and edge-triggered epoll readiness; a pre-fork server
/// accepting in children; dup2; non-blocking connect and I/O; splice.
/// Each case checks what a TCP program expects at both ends.
/// `forked_client.py IP PORT BYTES OUT`: connects, forks, and the parent
/// exits at once; the child (which inherited the connection and the
/// channel) echoes BYTES through the server after the parent is gone and
/// writes its verdict to the file OUT.
const FORKED_CLIENT: &str = r#"
import socket, sys, os, time, hashlib, threading, traceback
ip, port, total, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
c = socket.create_connection((ip, port))
c.sendall(b"x"); assert c.recv(1) == b"x"  # on the lane before the fork
if os.fork() > 0:
    os._exit(0)
try:
    time.sleep(1.0)  # the daemon notices the exit of the parent within 100 ms
    data = os.urandom(total)
    def sender():
        c.sendall(data); c.shutdown(socket.SHUT_WR)
    t = threading.Thread(target=sender); t.start()
    got = bytearray()
    while True:
        d = c.recv(1 << 16)
        if not d:
            break
        got += d
    t.join()
    assert bytes(got) == data, (len(got), total)
    verdict = "ok %d %s\n" % (len(got), hashlib.sha256(got).hexdigest())
except Exception:
    verdict = "failed " + traceback.format_exc().replace("\n", " | ") + "\n"
with open(out + ".tmp", "w") as f:
    f.write(verdict)
os.rename(out + ".tmp", out)
"#;

/// A pod process that forks and exits while its child keeps the
/// connection: the daemon then watches the child (it maps the channel), so
/// the connection goes on instead of being taken for dead. Both the copying
/// and the zero-copy relay.
#[test]
fn a_forked_child_keeps_a_relayed_connection_after_its_parent_exits() {
    let _turn = crate::turn::take(module_path!());
    for zero_copy in [false, true] {
        let _g = serial();
        let c = Cluster::build(1, zero_copy, false);
        let (n0, n1, a, b) = c.first_pods();
        let port = 7591u16;
        let _srv = n1.serve(
            b,
            true,
            port,
            &[PYTHON, "-c", ECHO_SERVER, &port.to_string(), "1"],
        );
        let ip = b.ip.to_string();
        // The parent exits at once; wait for the child's output through a
        // file (the parent's exit closes nothing the child needs).
        let out_file = c.dir.join(format!("forked-{zero_copy}.out"));
        let out_path = out_file.display().to_string();
        run_ok(
            n0.cmd(
                a,
                true,
                &[
                    PYTHON,
                    "-c",
                    FORKED_CLIENT,
                    &ip,
                    &port.to_string(),
                    "3000000",
                    &out_path,
                ],
            ),
            T,
            "forked client",
        );
        let t0 = Instant::now();
        let out = loop {
            let out = std::fs::read_to_string(&out_file).unwrap_or_default();
            if out.contains('\n') || t0.elapsed() > Duration::from_secs(60) {
                break out;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        assert!(
            out.starts_with("ok 3000000"),
            "zero_copy={zero_copy}: {out}\n{}",
            c.logs()
        );
        let (opened, _, _) = n0.relay();
        assert!(opened >= 1, "not relayed: {}", c.logs());
    }
}

#[test]
fn socket_semantics_hold_across_the_relay() {
    let _turn = crate::turn::take(module_path!());
    socket_semantics(false);
}

#[test]
fn socket_semantics_hold_across_the_zero_copy_relay() {
    let _turn = crate::turn::take(module_path!());
    socket_semantics(true);
}

fn socket_semantics(zero_copy: bool) {
    let _g = serial();
    let c = Cluster::build(1, zero_copy, false);
    let (n0, n1, a, b) = c.first_pods();
    let ip = b.ip.to_string();
    let mut expected = 0;
    for (i, (case, conns)) in [
        ("flags", 1),
        ("waits", 1),
        ("prefork", 4),
        ("dup2", 1),
        ("nonblocking", 1),
        ("splice", 1),
    ]
    .into_iter()
    .enumerate()
    {
        let port = 7581 + i as u16;
        let p = port.to_string();
        let srv = n1.serve(
            b,
            true,
            port,
            &[PYTHON, "-c", SEMANTICS, "server", &p, case],
        );
        let out = run_ok(
            n0.cmd(a, true, &[PYTHON, "-c", SEMANTICS, "client", &ip, &p, case]),
            T,
            case,
        );
        assert!(out.contains(&format!("ok {case}")), "{out}\n{}", c.logs());
        let (st, sout, serr) = srv.finish(T);
        assert!(
            st.is_some_and(|s| s.success()),
            "server {case}: {sout} {serr}\n{}",
            c.logs()
        );
        expected += conns;
        assert_eq!(
            n0.relay().0,
            expected,
            "{case}: connections carried by the relay\n{}",
            c.logs()
        );
    }
}

/// A pod whose peer's node offers no lane stays on plain TCP (identical
/// bytes) without asking its daemon (the peer table rules the other node's
/// pods out), a new connection uses the relay once the node offers one, and
/// stays on TCP again once the lane goes away.
#[test]
fn no_lane_on_the_peer_node_stays_on_tcp() {
    let _turn = crate::turn::take(module_path!());
    let _g = serial();
    let c = Cluster::new(1);
    c.write_nodes_file(false);
    let far = c.nodes[1].pods[0].ip;
    wait_peer_table(&c.nodes[0], far, Verdict::NotPeer);
    let asked = c.nodes[0].stats().fallbacks.get("not-local-pod").copied();
    echo_across(&c, 0, 1, 7511, 1, 2_000_000);
    assert_eq!(c.nodes[0].relay().0, 0, "{}", c.logs());
    assert_eq!(c.nodes[1].relay().0, 0, "{}", c.logs());
    assert_eq!(
        c.nodes[0].stats().fallbacks.get("not-local-pod").copied(),
        asked,
        "the daemon was asked\n{}",
        c.logs()
    );
    c.write_nodes_file(true);
    wait_peer_table(&c.nodes[0], far, Verdict::Candidate);
    echo_across(&c, 0, 1, 7512, 1, 2_000_000);
    assert_eq!(c.nodes[0].relay().0, 1, "{}", c.logs());
    c.write_nodes_file(false);
    wait_peer_table(&c.nodes[0], far, Verdict::NotPeer);
    echo_across(&c, 0, 1, 7513, 1, 2_000_000);
    assert_eq!(c.nodes[0].relay().0, 1, "{}", c.logs());
}

/// Waits until `node`'s peer table says `want` about `ip`.
fn wait_peer_table(node: &Node, ip: Ipv4Addr, want: Verdict) {
    let path = flowlane_lane::peer_table::path_for(&node.socket());
    let says = || {
        flowlane_lane::peer_table::Mapped::open_read_only(&path)
            .ok()
            .map(|m| m.table().lookup(IpAddr::V4(ip)))
    };
    let seen = flowlane_e2e::wait::until(Duration::from_secs(10), || says() == Some(want));
    assert!(seen, "peer table: {ip} {:?}, want {want:?}", says());
}

/// A client pod without the library talking to a server pod with it, and
/// the reverse, across nodes: both stay on plain TCP with correct bytes,
/// without waiting for a relay that cannot happen.
#[test]
fn mixed_pairs_across_nodes_stay_on_tcp() {
    let _turn = crate::turn::take(module_path!());
    let _g = serial();
    let c = Cluster::new(1);
    let (n0, n1, a, b) = c.first_pods();
    let ip = b.ip.to_string();
    for (i, (client_lib, server_lib)) in [(false, true), (true, false)].into_iter().enumerate() {
        let port_n = 7561 + i as u16;
        let port = port_n.to_string();
        let _srv = n1.serve(
            b,
            server_lib,
            port_n,
            &[PYTHON, "-c", ECHO_SERVER, &port, "1"],
        );
        let t0 = Instant::now();
        let out = run_ok(
            n0.cmd(
                a,
                client_lib,
                &[PYTHON, "-c", ECHO_CLIENT, &ip, &port, "3000000", "5"],
            ),
            T,
            "echo client",
        );
        assert!(out.starts_with("ok 3000000"), "{out}");
        eprintln!(
            "client lib {client_lib}, server lib {server_lib}: TCP, {:?}",
            t0.elapsed()
        );
    }
    assert_eq!(n0.relay().0, 0, "{}", c.logs());
    assert_eq!(n1.relay().0, 0, "{}", c.logs());
    let st = n0.stats();
    assert!(
        st.fallbacks.get("no-listener").copied().unwrap_or(0) >= 1,
        "the client's daemon must learn that the server pod has no flowlane listener: {st:?}"
    );
}

/// A third pod asks the client's daemon to cancel another pod's relayed
/// set-up (ids are time-based: guessable): refused, and the set-up goes on
/// to carry the connection once the server accepts.
#[test]
fn a_third_pod_cannot_cancel_another_pods_relayed_set_up() {
    let _turn = crate::turn::take(module_path!());
    let _g = serial();
    let c = Cluster::new(2);
    let (n0, n1) = (&c.nodes[0], &c.nodes[1]);
    let (client, attacker, server) = (&n0.pods[0], &n0.pods[1], &n1.pods[0]);
    // Listens at once (the library registers the listener), accepts only
    // once the test says so (the file argv[2] exists), after the attacker's
    // cancel: the client's set-up is still pending when the cancel arrives,
    // however slow the machine (a fixed sleep let a loaded machine claim it
    // first, and the cancel of a finished set-up is rightly a no-op).
    const LATE_SERVER: &str = r#"
import os, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(4)
deadline = time.monotonic() + 30
while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
    time.sleep(0.01)
c, _ = s.accept(); c.sendall(c.recv(64)); c.close()
"#;
    const CLIENT: &str = r#"
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
print("connected", flush=True)
c.sendall(b"ping"); print(c.recv(64).decode(), flush=True)
"#;
    // The daemon protocol by hand: u32 LE length + JSON.
    const CANCEL: &str = r#"
import json, socket, struct, sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
body = json.dumps({"op": "cancel-intent", "channel_id": int(sys.argv[2])}).encode()
s.sendall(struct.pack("<I", len(body)) + body)
n = struct.unpack("<I", s.recv(4))[0]; print(s.recv(n).decode())
"#;
    let go = c.dir.join("late-server-go");
    let go_s = go.display().to_string();
    let _srv = n1.serve(
        server,
        true,
        7570,
        &[PYTHON, "-c", LATE_SERVER, "7570", &go_s],
    );
    let mut cli = Bg::spawn(n0.cmd(
        client,
        true,
        &[PYTHON, "-c", CLIENT, &server.ip.to_string(), "7570"],
    ));
    assert!(first_line(&mut cli).starts_with("connected"));
    // The set-up's id, from the client daemon's log (ANSI codes stripped).
    let id = {
        let mut plain = String::new();
        let log = n0.log();
        let mut chars = log.chars();
        while let Some(ch) = chars.next() {
            if ch == '\x1b' {
                chars.by_ref().find(|c| c.is_ascii_alphabetic());
            } else {
                plain.push(ch);
            }
        }
        plain
            .lines()
            .filter(|l| l.contains("relay: channel announced"))
            .find_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix("id=")))
            .and_then(|id| id.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no announced set-up in n0's log:\n{log}"))
    };
    let socket = n0.socket().display().to_string();
    let id_s = id.to_string();
    let answer = run_ok(
        n0.cmd(attacker, false, &[PYTHON, "-c", CANCEL, &socket, &id_s]),
        T,
        "cancel",
    );
    std::fs::write(&go, b"").expect("go file");
    assert!(answer.contains("forbidden"), "{answer}");
    let auth_failures = n0.stats().auth_failures;
    assert!(auth_failures >= 1);
    // The set-up was not touched: the late accept gets the relayed channel.
    assert_eq!(first_line(&mut cli).trim(), "ping", "{}", c.logs());
    assert_eq!(n0.relay().0, 1, "carried by the relay: {}", c.logs());
    assert_eq!(n1.relay().0, 1, "{}", c.logs());
}

/// Reads a line from the child's stdout (blocking).
fn first_line(b: &mut Bg) -> String {
    use std::io::BufRead;
    let out = b.0.stdout.as_mut().unwrap();
    let mut r = std::io::BufReader::new(out);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    line
}

/// PEER_KILL's server in n1's pod 0 and its client in n0's pod 0 on `port`,
/// connected (each said so) and given time to be carried by the relay.
fn peer_kill_pair(c: &Cluster, port: u16) -> (Bg, Bg) {
    let (n0, n1, a, b) = c.first_pods();
    let mut srv = n1.serve(
        b,
        true,
        port,
        &[PYTHON, "-c", PEER_KILL, "server", &port.to_string()],
    );
    let mut cli = Bg::spawn(n0.cmd(
        a,
        true,
        &[
            PYTHON,
            "-c",
            PEER_KILL,
            "client",
            &b.ip.to_string(),
            &port.to_string(),
        ],
    ));
    assert!(first_line(&mut cli).starts_with("connected"));
    assert!(first_line(&mut srv).starts_with("accepted"));
    std::thread::sleep(Duration::from_millis(500));
    (srv, cli)
}

/// SIGKILL of either pod mid-stream: the other one sees the connection
/// reset (`ECONNRESET`; `EPIPE` on a write), never a clean end-of-stream
/// and never a hang, and both daemons end the relayed connection.
#[test]
fn peer_killed_mid_stream_ends_the_other_side() {
    let _turn = crate::turn::take(module_path!());
    peer_killed(false);
}

#[test]
fn peer_killed_mid_stream_over_the_zero_copy_relay_ends_the_other_side() {
    let _turn = crate::turn::take(module_path!());
    peer_killed(true);
}

fn peer_killed(zero_copy: bool) {
    let _g = serial();
    let c = Cluster::build(1, zero_copy, false);
    let (n0, n1, a, b) = c.first_pods();
    for (round, kill_server) in [(0u16, true), (1, false)] {
        let port = 7521 + round;
        let (srv, cli) = peer_kill_pair(&c, port);
        // Both daemons list the carried connection (`flowlane status`), with
        // their own pod named and the other one remote.
        for (node, local_is_client) in [(n0, true), (n1, false)] {
            let st = node.stats();
            let conn = st
                .connections
                .iter()
                .find(|c| c.lane == "relay" && c.server.addr.port() == port)
                .unwrap_or_else(|| panic!("{}: no relay connection in {st:?}", node.name));
            assert_eq!(conn.client.addr.ip(), std::net::IpAddr::V4(a.ip));
            assert_eq!(conn.server.addr.ip(), std::net::IpAddr::V4(b.ip));
            let (local, remote) = if local_is_client {
                (&conn.client, &conn.server)
            } else {
                (&conn.server, &conn.client)
            };
            assert_ne!(local.pod, "remote", "{conn:?}");
            assert_eq!(remote.pod, "remote", "{conn:?}");
            assert!(conn.bytes_client_to_server > 0, "{conn:?}");
        }
        let (victim, survivor, what) = if kill_server {
            (srv, cli, "client")
        } else {
            (cli, srv, "server")
        };
        // `ip netns exec` and `env` exec in place: the pid is python's.
        // SAFETY: SIGKILL to our own child.
        unsafe { libc::kill(victim.pid() as i32, libc::SIGKILL) };
        let t0 = Instant::now();
        let (st, out, err) = survivor.finish(Duration::from_secs(30));
        let took = t0.elapsed();
        drop(victim);
        assert!(
            st.is_some() && out.contains("ended"),
            "the {what} hung after its peer was killed: {out} {err}\n{}",
            c.logs()
        );
        assert_reset(&out, what == "client", &c);
        eprintln!(
            "peer killed: the {what} ended after {took:?}: {}",
            out.trim()
        );
    }
    wait_closed(&c, 2);
    for node in &c.nodes {
        assert_eq!(node.relay().0, 2, "{}", c.logs());
    }
}

/// PEER_KILL's end line shows a reset: `ConnectionResetError` for the
/// reader (the server), that or `BrokenPipeError` for the writer (the
/// client). A clean end-of-stream (`ended eof`) would make a cut transfer
/// look complete.
fn assert_reset(out: &str, writer: bool, c: &Cluster) {
    let line = out.lines().find(|l| l.starts_with("ended")).unwrap_or("");
    let reset = line.starts_with("ended ConnectionResetError ")
        || (writer && line.starts_with("ended BrokenPipeError "));
    assert!(
        reset,
        "the {} saw no reset: {out}\n{}",
        if writer { "client" } else { "server" },
        c.logs()
    );
}

/// PEER_KILL's server and client after `what` (a failure of the relay):
/// both must end within 30 s, each with a reset (see `assert_reset`),
/// also a pod whose own daemon was killed: it learns of the failure only
/// from the RST the other node sends, which a doorbell `send` of its
/// library may be the first to see (docs/relay.md, "Failures").
fn both_reset(c: &Cluster, srv: Bg, cli: Bg, what: &str) {
    let t0 = Instant::now();
    let (st, out, err) = cli.finish(Duration::from_secs(30));
    let (sst, sout, serr) = srv.finish(Duration::from_secs(30));
    let took = t0.elapsed();
    assert!(
        st.is_some() && out.contains("ended"),
        "{what}: the client hung: {out} {err}\n{}",
        c.logs()
    );
    assert!(
        sst.is_some() && sout.contains("ended"),
        "{what}: the server hung: {sout} {serr}\n{}",
        c.logs()
    );
    eprintln!(
        "{what}: both pods ended within {took:?}: client {}, server {}",
        out.lines().last().unwrap_or(""),
        sout.lines().last().unwrap_or("")
    );
    assert_reset(&out, true, c);
    assert_reset(&sout, false, c);
}

/// One daemon killed (SIGKILL) mid-stream: the relayed connection is reset
/// for both pods (`ECONNRESET`; `EPIPE` on a write), never a clean
/// end-of-stream and never a hang, and the surviving daemon closes its side.
#[test]
fn daemon_killed_mid_stream_ends_the_connection_for_both_pods() {
    let _turn = crate::turn::take(module_path!());
    let _g = serial();
    let mut c = Cluster::new(1);
    let port = 7571u16;
    let (srv, cli) = peer_kill_pair(&c, port);
    assert_eq!(c.nodes[0].relay().0, 1, "{}", c.logs());
    c.nodes[1].kill_daemon();
    both_reset(&c, srv, cli, "daemon killed");
    let t0 = Instant::now();
    while c.nodes[0].relay().1 < 1 {
        assert!(t0.elapsed() < Duration::from_secs(30), "{}", c.logs());
        std::thread::sleep(Duration::from_millis(50));
    }
    c.nodes[1].restart_daemon();
}

/// The lane itself fails mid-stream, both daemons and both pods alive: the
/// relay's stream connections on the underlay are destroyed (`ss -K` in
/// node n0's namespace: ECONNABORTED on n0's daemon, an RST to n1's). Both
/// pods must see the connection reset (`ECONNRESET`; `EPIPE` on a write),
/// never a clean end-of-stream: the transfer was cut short. Both daemons
/// close the connection, keep running, and relay the next one.
#[test]
fn lane_cut_mid_stream_resets_the_connection_for_both_pods() {
    let _turn = crate::turn::take(module_path!());
    let _g = serial();
    let c = Cluster::new(1);
    let port = 7572u16;
    let (srv, cli) = peer_kill_pair(&c, port);
    for node in &c.nodes {
        assert_eq!(node.relay().0, 1, "{}", c.logs());
    }
    let filter = format!("( sport = :{LANE_PORT} or dport = :{LANE_PORT} )");
    let o = sh(&[
        "ip",
        "netns",
        "exec",
        &c.nodes[0].netns,
        "ss",
        "-K",
        "-H",
        "-t",
        &filter,
    ]);
    let killed = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && killed.lines().count() >= 1,
        "no lane connection cut (ss -K needs CONFIG_INET_DIAG_DESTROY): {killed:?} {}",
        String::from_utf8_lossy(&o.stderr)
    );
    both_reset(&c, srv, cli, "lane cut");
    wait_closed(&c, 1);
    // Both daemons survived the cut and relay the next connection.
    let (srv, cli) = peer_kill_pair(&c, port + 10);
    for node in &c.nodes {
        assert_eq!(node.relay().0, 2, "{}", c.logs());
    }
    drop((srv, cli));
}

/// iperf3 through the relay (both directions), with plain TCP between the
/// same pods in the same run for comparison (figures printed, not asserted).
#[test]
fn iperf3_through_the_relay() {
    let _turn = crate::turn::take(module_path!());
    let _g = serial();
    let c = Cluster::new(1);
    let (n0, n1, a, b) = c.first_pods();
    let ip = b.ip.to_string();
    let mut figures = Vec::new();
    for (label, preload, extra) in [
        ("tcp", false, None),
        ("relay", true, None),
        ("relay -R", true, Some("-R")),
        ("relay --bidir", true, Some("--bidir")),
    ] {
        let _srv = n1.serve(b, preload, 7531, &["iperf3", "-s", "-1", "-p", "7531"]);
        let mut argv = vec!["iperf3", "-c", &ip, "-p", "7531", "-t", "3", "-J"];
        argv.extend(extra);
        let out = run_ok(n0.cmd(a, preload, &argv), T, "iperf3 client");
        let v: serde_json::Value = serde_json::from_str(&out).expect("iperf3 -J output");
        let bps = v["end"]["sum_received"]["bits_per_second"]
            .as_f64()
            .expect("received bits per second");
        assert!(bps > 0.0, "{out}");
        figures.push((label, bps / 1e9));
        // Let iperf3 -s -1 exit before the next round.
        std::thread::sleep(Duration::from_millis(200));
    }
    for (label, gbps) in &figures {
        eprintln!("iperf3 {label}: {gbps:.2} Gbit/s");
    }
    eprintln!(
        "relay/tcp: {:.2}x (tcp-test transport: one TCP connection on the underlay per stream)",
        figures[1].1 / figures[0].1
    );
    let (opened, _, _) = n0.relay();
    // iperf3 opens a control and a data connection (two with --bidir) per run.
    assert!(opened >= 7, "iperf3 did not use the relay: {}", c.logs());
}

fn sockperf_p50(out: &str) -> Option<f64> {
    out.lines()
        .find(|l| l.contains("percentile 50.000"))
        .and_then(|l| l.split('=').nth(1))
        .and_then(|x| x.trim().parse().ok())
}

/// sockperf ping-pong in its epoll mode through the relay (the server and
/// the client sleep in epoll_wait between messages, so every message needs
/// the cross-node doorbell path), plain TCP in the same run for comparison.
#[test]
fn sockperf_epoll_ping_pong_through_the_relay() {
    let _turn = crate::turn::take(module_path!());
    let _g = serial();
    let c = Cluster::new(1);
    let (n0, n1, a, b) = c.first_pods();
    let mut p50s = Vec::new();
    for (i, (label, preload)) in [("tcp", false), ("relay", true)].into_iter().enumerate() {
        let port = 7541 + i as u16;
        // sockperf takes its I/O multiplexer (-F) only with a feed file.
        let feed = c.dir.join(format!("feed-{i}"));
        std::fs::write(&feed, format!("T:{}:{port}\n", b.ip)).unwrap();
        let feed = feed.to_str().unwrap();
        let _srv = n1.serve(
            b,
            preload,
            port,
            &["sockperf", "server", "-f", feed, "-F", "e"],
        );
        let before = n0.relay().0;
        let out = run_ok(
            n0.cmd(
                a,
                preload,
                &[
                    "sockperf",
                    "ping-pong",
                    "-f",
                    feed,
                    "-F",
                    "e",
                    "-t",
                    "2",
                    "-m",
                    "64",
                    "--mps",
                    "100000",
                ],
            ),
            T,
            "sockperf ping-pong",
        );
        let p50 = sockperf_p50(&out).unwrap_or_else(|| panic!("no latency in: {out}"));
        if preload {
            assert!(n0.relay().0 > before, "sockperf did not use the relay");
        }
        p50s.push((label, p50));
    }
    for (label, p50) in &p50s {
        eprintln!("sockperf epoll ping-pong 64 B, {label}: one-way p50 {p50:.1} us");
    }
}

/// `idle_client.py IP PORT READY_FILE HOLD_S`: one round trip, then writes
/// READY_FILE and holds the connection open and idle for HOLD_S seconds.
const IDLE_CLIENT: &str = r#"
import socket, sys, time
ip, port, ready, hold = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
c = socket.create_connection((ip, port))
c.sendall(b"ping\n")
got = b""
while len(got) < 5:
    d = c.recv(64)
    if not d:
        sys.exit("EOF before the echo")
    got += d
assert got == b"ping\n", got
open(ready, "w").write("ready\n")
time.sleep(hold)
c.close()
"#;

/// CPU seconds (user + system) a process used so far, from /proc/PID/stat.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("daemon stat");
    // Fields after the parenthesised command name; utime and stime are the
    // 14th and 15th fields overall, the 12th and 13th after it.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    ticks as f64 / hz
}

/// An open relayed connection with no traffic costs the daemons nothing:
/// their threads sleep (ring futexes, the lane's completion wait) instead
/// of polling. A busy loop in any per-connection thread (a zero-copy room
/// reporter once spun like that) burns a whole core on both nodes, which
/// the 3 s window below shows as ~3 CPU seconds; idle is a few ticks.
#[test]
fn an_idle_relayed_connection_costs_the_daemons_no_cpu() {
    let _turn = crate::turn::take(module_path!());
    for zero_copy in [false, true] {
        let _g = serial();
        let c = Cluster::build(1, zero_copy, false);
        let (n0, n1, a, b) = c.first_pods();
        let port = 7592u16;
        let _srv = n1.serve(
            b,
            true,
            port,
            &[PYTHON, "-c", ECHO_SERVER, &port.to_string(), "1"],
        );
        let ready = c.dir.join(format!("idle-{zero_copy}.ready"));
        let _cli = Bg::spawn(n0.cmd(
            a,
            true,
            &[
                PYTHON,
                "-c",
                IDLE_CLIENT,
                &b.ip.to_string(),
                &port.to_string(),
                &ready.display().to_string(),
                "8",
            ],
        ));
        let t0 = Instant::now();
        while !ready.exists() {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "zero_copy={zero_copy}: the client's round trip did not finish\n{}",
                c.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            n0.relay().0 >= 1 && n1.relay().0 >= 1,
            "zero_copy={zero_copy}: not relayed\n{}",
            c.logs()
        );
        // Let the set-up settle (zero-copy registration happens after the
        // claim's answer), then watch both daemons for 3 s of idleness.
        std::thread::sleep(Duration::from_millis(500));
        let pids: Vec<u32> = c
            .nodes
            .iter()
            .map(|n| n.daemon.as_ref().expect("daemon").pid())
            .collect();
        let before: Vec<f64> = pids.iter().map(|&p| cpu_seconds(p)).collect();
        std::thread::sleep(Duration::from_secs(3));
        let used: Vec<f64> = pids
            .iter()
            .zip(&before)
            .map(|(&p, b)| cpu_seconds(p) - b)
            .collect();
        eprintln!("zero_copy={zero_copy}: daemon CPU over 3 s idle: {used:?}");
        assert!(
            used.iter().all(|&u| u < 0.5),
            "zero_copy={zero_copy}: a daemon kept a CPU busy on an idle connection: {used:?} s in 3 s\n{}",
            c.logs()
        );
    }
}

// ---------------------------------------------------------------------
// Impostors on the lane port (issue 11, part 2): each gets nothing and
// changes nothing. The attacks run on threads inside the nodes' and pods'
// network namespaces (setns), with the real handshake code of the lane
// (`flowlane_rdma::lane_auth`).

/// `live_client.py IP PORT GO`: connects (through the relay), swaps one
/// byte, prints "up", waits for the file GO, then swaps 32 x 32 KiB and
/// prints "ok".
const LIVE_CLIENT: &str = r#"
import socket, sys, os, time
ip, port, go = sys.argv[1], int(sys.argv[2]), sys.argv[3]
c = socket.create_connection((ip, port))
c.sendall(b"x"); assert c.recv(1) == b"x"
print("up", flush=True)
while not os.path.exists(go):
    time.sleep(0.05)
for i in range(32):
    data = os.urandom(32768)
    c.sendall(data)
    got = bytearray()
    while len(got) < len(data):
        d = c.recv(len(data) - len(got))
        assert d, "eof"
        got += d
    assert bytes(got) == data, i
c.close()
print("ok", flush=True)
"#;

/// Runs `f` on a thread inside network namespace `ns`: the sockets it makes
/// live there.
fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let fd = std::fs::File::open(&path).expect("netns file");
        nix::sched::setns(&fd, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        f()
    })
    .join()
    .expect("impostor thread")
}

fn lane_auth(key: &[u8]) -> flowlane_rdma::LaneAuth {
    flowlane_rdma::LaneAuth::new(
        flowlane_rdma::LaneKey::from_bytes(key).unwrap(),
        std::sync::Arc::new(|_: std::net::IpAddr| true),
    )
}

fn lane_connect(to: std::net::SocketAddr) -> std::net::TcpStream {
    std::net::TcpStream::connect_timeout(&to, Duration::from_secs(5)).expect("connect lane port")
}

/// Everything the peer sends until it closes (or 3 s pass).
fn read_rest(s: &mut std::net::TcpStream) -> Vec<u8> {
    use std::io::Read;
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut got = Vec::new();
    let mut b = [0u8; 256];
    loop {
        match s.read(&mut b) {
            Ok(0) | Err(_) => return got,
            Ok(n) => got.extend_from_slice(&b[..n]),
        }
    }
}

/// A tcp-test stream header (after the handshake): `FLR1`, u16-le length,
/// the key as JSON.
fn stream_header(client: std::net::SocketAddr, server: std::net::SocketAddr) -> Vec<u8> {
    let body = serde_json::json!({"client": client, "server": server}).to_string();
    let mut h = b"FLR1".to_vec();
    h.extend_from_slice(&(body.len() as u16).to_le_bytes());
    h.extend_from_slice(body.as_bytes());
    h
}

/// An authenticated stream (the right key, from node n0's address) with
/// `client`/`server` as its key; returns the first answer byte (the
/// record `0, u32-le 1, byte`), the stream kept open.
fn authed_stream(
    ns: &str,
    lane: std::net::SocketAddr,
    client: std::net::SocketAddr,
    server: std::net::SocketAddr,
) -> (Option<u8>, std::net::TcpStream) {
    in_netns(ns, move || {
        use std::io::{Read, Write};
        let mut s = lane_connect(lane);
        lane_auth(LANE_KEY)
            .initiate(&mut s)
            .expect("the right key authenticates");
        s.write_all(&stream_header(client, server)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut rec = [0u8; 6];
        let answer = s.read_exact(&mut rec).ok().map(|_| {
            assert_eq!(rec[..5], [0, 1, 0, 0, 0], "one stream byte");
            rec[5]
        });
        (answer, s)
    })
}

fn lane_error(node: &Node, kind: &str) -> u64 {
    node.stats()
        .lane_errors
        .get("relay")
        .and_then(|e| e.get(kind).copied())
        .unwrap_or(0)
}

/// Impostors on node n1's lane port while a relayed connection between
/// n0's and n1's pods is live: a stranger (a pod's address, not a node of
/// the table, even with the key), a daemon without a key (the old header),
/// a wrong key, a replayed transcript, a spoofed client address (a node
/// carrying pod traffic that is not its own), a duplicate stream key
/// (of the live connection, and of a pending stream) and the Service
/// relay's stream question asked for a server that is not the asker's.
/// Each is refused and counted; the live connection, new connections and both daemons go on.
#[test]
fn impostors_on_the_lane_port_get_nothing_and_change_nothing() {
    let _turn = crate::turn::take(module_path!());
    use std::io::{Read, Write};
    let _g = serial();
    let c = Cluster::new(1);
    let (n0, n1, a, b) = c.first_pods();
    let lane: std::net::SocketAddr = (n1.underlay, LANE_PORT).into();
    let port = 7611u16;
    let _srv = n1.serve(
        b,
        true,
        port,
        &[PYTHON, "-c", ECHO_SERVER, &port.to_string(), "2"],
    );
    let go = c.dir.join("go");
    let mut live = Bg::spawn(n0.cmd(
        a,
        true,
        &[
            PYTHON,
            "-c",
            LIVE_CLIENT,
            &b.ip.to_string(),
            &port.to_string(),
            go.to_str().unwrap(),
        ],
    ));
    assert_eq!(first_line(&mut live).trim(), "up");
    let t0 = Instant::now();
    while n1.relay().0 < 1 {
        assert!(
            t0.elapsed() < T,
            "the live connection is relayed\n{}",
            c.logs()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let before = n1.stats();
    let live_conn = before
        .connections
        .iter()
        .find(|x| x.lane == "relay")
        .expect("the live relayed connection")
        .clone();
    let server_addr: std::net::SocketAddr = (b.ip, port).into();

    // 1. A stranger: a pod's address (not in the node table), with the
    // right key and the full handshake: closed before a byte is read.
    let got = in_netns(&a.netns, move || {
        let mut s = lane_connect(lane);
        let r = lane_auth(LANE_KEY).initiate(&mut s);
        (r.is_err(), read_rest(&mut s))
    });
    assert!(got.0 && got.1.is_empty(), "stranger: {got:?}");
    assert_eq!(lane_error(n1, "peer_unknown"), 1, "{}", c.logs());

    // 2. No key: a node's address speaking the old, unauthenticated header.
    let client0: std::net::SocketAddr = (a.ip, 45001).into();
    let got = in_netns(&n0.netns, move || {
        let mut s = lane_connect(lane);
        let _ = s.write_all(&stream_header(client0, server_addr));
        read_rest(&mut s)
    });
    assert!(got.is_empty(), "no key: answered {got:?}");
    assert_eq!(lane_error(n1, "peer_auth_failed"), 1, "{}", c.logs());

    // 3. A wrong key.
    let got = in_netns(&n0.netns, move || {
        let mut s = lane_connect(lane);
        let r = lane_auth(b"a guessed key, 32 bytes or longer....").initiate(&mut s);
        let _ = s.write_all(&stream_header(client0, server_addr));
        (r.is_err(), read_rest(&mut s))
    });
    assert!(got.0 && got.1.is_empty(), "wrong key: {got:?}");
    assert_eq!(lane_error(n1, "peer_auth_failed"), 2, "{}", c.logs());

    // 4. A replayed transcript: the initiator's bytes of a good exchange
    // (recorded as an eavesdropper on the underlay would), sent again.
    let got = in_netns(&n0.netns, move || {
        let mut s = lane_connect(lane);
        let (me, peer) = (s.local_addr().unwrap(), s.peer_addr().unwrap());
        let ni = [0x5a_u8; 32];
        let mut sent = b"FLA1".to_vec();
        sent.extend_from_slice(&ni);
        s.write_all(&sent).unwrap();
        let mut ch = [0u8; 36];
        s.read_exact(&mut ch).unwrap();
        let proof = lane_auth(LANE_KEY).initiator_proof(&ni, &ch[4..], me, peer);
        s.write_all(&proof).unwrap();
        let mut theirs = [0u8; 32];
        s.read_exact(&mut theirs)
            .expect("the recorded exchange was good");
        drop(s);
        sent.extend_from_slice(&proof);
        let mut s = lane_connect(lane);
        s.write_all(&sent).unwrap();
        let got = read_rest(&mut s);
        // The challenge (36 bytes) comes back, nothing after it.
        (got.len(), got.get(..4).map(|m| m == b"FLA1"))
    });
    assert_eq!(got, (36, Some(true)), "replay: only a fresh challenge");
    // (the recorded exchange itself ended before its header: not a refusal)
    assert_eq!(lane_error(n1, "peer_auth_failed"), 3, "{}", c.logs());

    // 5. A spoofed client: node n0 (the key, its own address) opens a
    // stream for an address of n1's pod CIDR, to n1's listening pod.
    let spoofed: std::net::SocketAddr = (b.ip, 45002).into();
    let (answer, _s) = authed_stream(&n0.netns, lane, spoofed, server_addr);
    assert_eq!(answer, Some(0xB2), "spoofed client: STREAM_REFUSED");
    let outside: std::net::SocketAddr = (n1.underlay, 45003).into();
    let (answer, _s2) = authed_stream(&n0.netns, lane, outside, server_addr);
    assert_eq!(
        answer,
        Some(0xB2),
        "client outside every pod CIDR: STREAM_REFUSED"
    );
    assert_eq!(lane_error(n1, "stream_foreign_client"), 2, "{}", c.logs());

    // 6. Duplicate keys: the live connection's, then a pending stream's.
    let (answer, _s3) = authed_stream(
        &n0.netns,
        lane,
        live_conn.client.addr,
        live_conn.server.addr,
    );
    assert_eq!(
        answer,
        Some(0xB2),
        "the live connection's key: STREAM_REFUSED"
    );
    let fresh: std::net::SocketAddr = (a.ip, 45004).into();
    let (first, pending) = authed_stream(&n0.netns, lane, fresh, server_addr);
    assert_eq!(
        first,
        Some(0xB1),
        "a fresh key from n0's pod CIDR: REGISTERED"
    );
    let (second, _s4) = authed_stream(&n0.netns, lane, fresh, server_addr);
    assert_eq!(second, Some(0xB2), "its duplicate: STREAM_REFUSED");
    assert_eq!(lane_error(n1, "stream_duplicate"), 2, "{}", c.logs());
    drop(pending);

    // 7. The Service relay's question (relay/service.rs): the daemon of a
    // key's server asks the daemon of its client whether that stream is
    // coming. Asked by n0 for its own pod as server about n1's pod as
    // client, it is answered, from n1's pending Service intents (none):
    // STREAM_NONE, counted as `peer-stream-query`, nothing else changes.
    // The same question for a server that is no pod of n0 is refused.
    let queries = |n: &Node| {
        n.stats()
            .requests
            .get("peer-stream-query")
            .copied()
            .unwrap_or(0)
    };
    let asked_before = queries(n1);
    let query_client: std::net::SocketAddr = (b.ip, 45005).into();
    let (answer, _q) = authed_stream(&n0.netns, lane, query_client, (a.ip, 7613).into());
    assert_eq!(answer, Some(0xD0), "n0 asks about its own pod: STREAM_NONE");
    assert_eq!(queries(n1), asked_before + 1, "{}", c.logs());
    let (answer, _q2) = authed_stream(&n0.netns, lane, query_client, (b.ip, 7614).into());
    assert_eq!(
        answer,
        Some(0xB2),
        "a question for a server of another node: STREAM_REFUSED"
    );
    assert_eq!(queries(n1), asked_before + 1, "not answered: {}", c.logs());
    assert_eq!(lane_error(n1, "stream_foreign_client"), 3, "{}", c.logs());

    // Nothing changed: the live connection carries on, on the relay.
    std::fs::write(&go, b"").unwrap();
    let (st, out, err) = live.finish(T);
    assert!(
        st.is_some_and(|s| s.success()) && out.contains("ok"),
        "the live connection after the impostors: {out} {err}\n{}",
        c.logs()
    );
    let after = n1.stats();
    assert_eq!(
        after.lanes["relay"].connections_opened, before.lanes["relay"].connections_opened,
        "no impostor stream became a connection"
    );
    // A new connection still rides the relay, and both daemons serve.
    echo_across(&c, 0, 1, 7612, 1, 200_000);
    wait_closed(&c, 2);
    for node in &c.nodes {
        assert_eq!(node.relay().0, 2, "{}: {}", node.name, c.logs());
    }
    // n0 was never refused anything: its own lane errors stay at zero.
    for kind in [
        "peer_unknown",
        "peer_auth_failed",
        "stream_foreign_client",
        "stream_duplicate",
    ] {
        assert_eq!(lane_error(n0, kind), 0, "{kind} on n0");
    }
    // `flowlane status` shows the refusals.
    let out = run_ok(
        {
            let mut cmd = Command::new(build_dir().join("flowlane"));
            cmd.args(["status", "--socket"]).arg(n1.socket());
            cmd
        },
        T,
        "flowlane status",
    );
    assert!(
        out.contains("peer_auth_failed") && out.contains("stream_foreign_client"),
        "{out}"
    );
}

/// The relay's copying path against a hostile pod: the client pod gets a
/// relayed channel (its ring peer is its own node's daemon, a root
/// process), then writes every shared word of the region in turn. Only its
/// own connection ends; the daemon survives, counts `ring-violation`, and
/// relays the honest connection after every attack; the daemon writes no
/// byte into the pod's ring that the pod was not sent.
#[test]
fn a_hostile_pod_cannot_crash_its_daemon_through_the_relay() {
    let _turn = crate::turn::take(module_path!());
    let _g = serial();
    let mut c = Cluster::new(1);
    let (n0, n1, attacker, victim) = c.first_pods();
    let srv = n1.serve(
        victim,
        true,
        7491,
        &[PYTHON, "-c", &victim_server(), "7491"],
    );
    let ip = victim.ip.to_string();
    let modes = "max,back,ahead,random";
    let mut cmd = n0.cmd(
        attacker,
        true,
        &[PYTHON, "-c", HOSTILE, "client", &ip, "7491", modes],
    );
    cmd.env("FLOWLANE_RING_SIZE", "4096");
    let (st, out, err) = Bg::spawn(cmd).finish(Duration::from_secs(300));
    let attacks = 19 * 4;
    assert!(
        st.is_some_and(|s| s.success()) && out.contains(&format!("done {attacks}")),
        "attacker: {out}\n{err}\ndaemon n0:\n{}",
        n0.log()
    );
    assert!(
        !out.lines().any(|l| l.starts_with("tcp ")),
        "not relayed:\n{out}"
    );
    assert!(
        !out.contains("leak"),
        "the daemon wrote bytes it was not given:\n{out}"
    );
    assert_eq!(
        out.lines().filter(|l| *l == "honest ok").count(),
        attacks,
        "the daemon must relay an honest connection after every attack:\n{out}"
    );
    let daemon = c.nodes[0].daemon.as_mut().expect("daemon n0");
    assert!(daemon.child.try_wait().unwrap().is_none(), "daemon n0 died");
    let (n0, _, _, _) = c.first_pods();
    let counted = n0
        .stats()
        .fallbacks
        .get("ring-violation")
        .copied()
        .unwrap_or(0);
    let resets = out.lines().filter(|l| l.ends_with(" reset")).count() as u64;
    eprintln!("{resets} of {attacks} attacks ended the connection; daemon n0 counted {counted} ring violations");
    // The daemon finds a bad word whenever its pump next reads the ring
    // (also after the attacker closed), so this does not depend on timing.
    let failed = n0
        .log()
        .lines()
        .filter(|l| l.contains("the pod broke the ring protocol"))
        .count() as u64;
    assert!(failed >= 1, "no relayed connection failed:\n{}", n0.log());
    assert!(counted >= failed, "{counted} counted, {failed} failed");
    drop(srv);
}

/// A server that keeps every connection until its client half-closes, then
/// answers the byte count and sha256 of what it read.
const HOLD_SERVER: &str = r#"
import hashlib, socket, sys, threading
port = int(sys.argv[1])
ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("0.0.0.0", port)); ls.listen(16)
def serve(c):
    h, n = hashlib.sha256(), 0
    while True:
        b = c.recv(1 << 16)
        if not b: break
        h.update(b); n += len(b)
    c.sendall(f"{n} {h.hexdigest()}\n".encode()); c.close()
while True:
    c, _ = ls.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;

/// Driven line by line on stdin: `open` connects and sends `bytes` bytes
/// (seeded by the connection's number) and keeps the connection open;
/// `close K` half-closes connection K and checks the server's count and
/// sha256 of it.
const HOLD_CLIENT: &str = r#"
import hashlib, random, socket, sys
ip, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
conns = []
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "open":
        k = len(conns)
        data = random.Random(k).randbytes(size)
        s = socket.create_connection((ip, port)); s.sendall(data)
        conns.append((s, data)); print("sent", k, flush=True)
    elif cmd[0] == "close":
        k = int(cmd[1]); s, data = conns[k]
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while not reply.endswith(b"\n"):
            b = s.recv(256)
            if not b: break
            reply += b
        s.close()
        want = f"{len(data)} {hashlib.sha256(data).hexdigest()}"
        print("ok" if reply.decode().strip() == want else f"bad {reply!r}", k, flush=True)
"#;

/// The client's driver: one line in, one line out.
struct HoldClient {
    child: Child,
    out: std::io::BufReader<std::process::ChildStdout>,
}

impl HoldClient {
    fn say(&mut self, line: &str) -> String {
        use std::io::{BufRead, Write};
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
        let mut reply = String::new();
        self.out.read_line(&mut reply).unwrap();
        reply.trim().to_string()
    }
}

impl Drop for HoldClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `flowlane_bytes_total{lane, direction}` from node `n`'s metrics endpoint.
fn scraped_bytes(node: &Node, metrics: std::net::SocketAddr, direction: &str) -> u64 {
    let text = in_netns(&node.netns, move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(metrics).expect("metrics endpoint");
        s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        text
    });
    let key = format!("flowlane_bytes_total{{lane=\"relay\",direction=\"{direction}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(key.as_str()))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
        .unwrap_or_else(|| panic!("no {key} in\n{text}"))
}

/// The relay's memory budget: connections that fit ride the relay, the
/// first one that does not stays on TCP (fallback `relay-budget`) with its
/// bytes intact, and a closed connection gives its room back. The metrics
/// count a relayed connection's bytes while it is open, and keep them once
/// it has closed.
#[test]
fn the_relay_budget_keeps_extra_connections_on_tcp_and_metrics_count_live_bytes() {
    let _turn = crate::turn::take(module_path!());
    const BUDGET: u64 = 6 << 20;
    const BYTES: u64 = 300_000;
    const PORT: u16 = 7590;
    const METRICS_PORT: u16 = 9470;
    let _g = serial();
    let c = Cluster::build_with(1, false, false, |underlay| {
        vec![
            format!("--relay-memory-budget={BUDGET}"),
            format!("--metrics-addr={underlay}:{METRICS_PORT}"),
        ]
    });
    let (n0, n1, a, b) = c.first_pods();
    let metrics = std::net::SocketAddr::new(n0.underlay.into(), METRICS_PORT);
    let _srv = n1.serve(
        b,
        true,
        PORT,
        &[PYTHON, "-c", HOLD_SERVER, &PORT.to_string()],
    );
    let mut cmd = n0.cmd(
        a,
        true,
        &[
            PYTHON,
            "-c",
            HOLD_CLIENT,
            &b.ip.to_string(),
            &PORT.to_string(),
            &BYTES.to_string(),
        ],
    );
    let mut child = cmd
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut client = HoldClient { child, out };
    let budget_fallbacks = || -> u64 {
        c.nodes
            .iter()
            .map(|n| {
                n.stats()
                    .fallbacks
                    .get("relay-budget")
                    .copied()
                    .unwrap_or(0)
            })
            .sum()
    };

    // Open connections, one at a time and all kept open, until one does
    // not get the relay.
    let mut relayed = 0u64;
    loop {
        let k = relayed;
        assert_eq!(client.say("open"), format!("sent {k}"), "{}", c.logs());
        let t0 = Instant::now();
        loop {
            if n0.relay().0 > relayed || budget_fallbacks() > 0 {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "connection {k}: neither relayed nor over the budget\n{}",
                c.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        if budget_fallbacks() > 0 {
            break;
        }
        relayed += 1;
        assert!(relayed < 64, "a 6 MiB budget took {relayed} connections");
    }
    assert!(relayed >= 1, "not even one connection fit\n{}", c.logs());
    let over = relayed; // connection number `over` is on TCP
    println!("relay memory budget {BUDGET}: {relayed} connections relayed, the next one on TCP");
    for n in &c.nodes {
        let m = n.stats().relay_memory.expect("relay memory in stats");
        assert!(m.used_bytes <= m.budget_bytes, "{m:?}");
        assert_eq!(m.budget_bytes, BUDGET);
    }

    // Live bytes: the relayed connections' bytes are counted while they are
    // open (nothing has closed yet).
    assert_eq!(n0.relay().1, 0);
    let t0 = Instant::now();
    let live = loop {
        let v = scraped_bytes(n0, metrics, "client_to_server");
        if v >= relayed * BYTES {
            break v;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "live relay bytes {v} < {}\n{}",
            relayed * BYTES,
            c.logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        live,
        relayed * BYTES,
        "bytes of the TCP connection counted as relayed"
    );

    // The connection over the budget has its bytes intact on TCP; closing
    // a relayed one gives its room back to the next connection.
    assert_eq!(client.say(&format!("close {over}")), format!("ok {over}"));
    assert_eq!(client.say("close 0"), "ok 0");
    wait_closed(&c, 1);
    let before = n0.relay().0;
    assert_eq!(client.say("open"), format!("sent {}", over + 1));
    let t0 = Instant::now();
    while n0.relay().0 == before {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "room given back, yet the next connection did not ride the relay\n{}",
            c.logs()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    for k in (1..over).chain([over + 1]) {
        assert_eq!(client.say(&format!("close {k}")), format!("ok {k}"));
    }
    wait_closed(&c, relayed + 1);
    // After close: every relayed byte still counted, once.
    assert_eq!(
        scraped_bytes(n0, metrics, "client_to_server"),
        (relayed + 1) * BYTES
    );
    assert!(scraped_bytes(n0, metrics, "server_to_client") > 0);
    for n in &c.nodes {
        let m = n.stats().relay_memory.expect("relay memory in stats");
        assert_eq!(m.used_bytes, 0, "room not given back");
    }
}
