//! Service ClusterIPs (issue 16, item 3): a connection to a Service IP,
//! DNATed by kube-proxy's rules in the node, gets the lane of the backend
//! it reached, read from the node's conntrack table; a backend that is no
//! lane peer costs no wait. kube-proxy's iptables and nftables modes
//! (`flowlane_e2e::services`), real pods wired by the plugin in node
//! namespaces with `br_netfilter`, the real daemon (`--service-cidr`) and
//! library, unmodified Python programs. Needs root.
//!
//! "No added wait" is asserted by what the library did, never by a clock:
//! a client whose server does not attach gives up after 2 s and reports
//! `no-peer-library`; a Service connection to a backend without a lane must
//! instead be told at connect (`no-listener`, `not-local-pod`), so the
//! daemons' fallback counters must hold exactly those reasons.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::{Command, Stdio};
use std::time::Duration;

use flowlane_e2e::services::{ProxyMode, Service, SvcCluster, SvcNode, SERVICE_ECHO_SERVER};
use flowlane_e2e::shm::{run_ok, wait_listening, Bg, Pod};
use flowlane_e2e::shm_scripts::{ECHO_CLIENT, PYTHON};
use flowlane_lane::peer_table::{self, Verdict};
use flowlane_lane::proto::Stats;

const T: Duration = Duration::from_secs(120);
/// The Services' port and their pods' (targetPort).
const PORT: u16 = 80;
const TARGET: u16 = 8080;

fn cluster_ip(last: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 96, 212, last)
}

fn service(last: u8, backends: &[&Pod]) -> Service {
    Service {
        name: format!("default/echo{last}:http"),
        cluster_ip: cluster_ip(last),
        port: PORT,
        endpoints: backends
            .iter()
            .map(|p| SocketAddrV4::new(p.ip, TARGET))
            .collect(),
    }
}

/// An echo server on TARGET in `pod` that counts its connections.
fn backend(node: &SvcNode, pod: &Pod, preload: bool) -> Bg {
    let port = TARGET.to_string();
    let srv = Bg::spawn(node.cmd(pod, preload, &[PYTHON, "-c", SERVICE_ECHO_SERVER, &port]));
    wait_listening(pod, TARGET);
    srv
}

/// Stops a backend; the connections it accepted.
fn accepted(mut srv: Bg) -> usize {
    let _ = srv.0.kill();
    let (_, out, _) = srv.finish(Duration::from_secs(10));
    out.lines().filter(|l| l.starts_with("accepted ")).count()
}

/// Makes `socket.create_connection` bind the source port `SRC_PORT`.
/// Each connection of a test gets its own: a source port reused towards
/// the same backend while conntrack still holds the earlier entry is
/// remapped by the node's NAT (docs/daemon.md, "Known limits"), which is
/// not what these tests are about.
///
/// `SO_REUSEADDR` on every such socket: the client half-closes first, so
/// its port may be left in TIME_WAIT (which end's FIN leaves first is a
/// race on the lane, where the EOF travels in the ring), and a second
/// `bind` of the port would fail with `EADDRINUSE` without it.
const FIXED_SOURCE_PORT: &str = r#"
import os, socket
def _from_fixed_port(a, *r, **k):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("", int(os.environ["SRC_PORT"])))
    s.connect(a)
    return s
socket.create_connection = _from_fixed_port
"#;

/// `bytes` checksummed both ways from `client` (with the library) to
/// the Service at `ip`, from source port 40000 + `seed`.
fn echo(node: &SvcNode, client: &Pod, ip: Ipv4Addr, bytes: u64, seed: u32) {
    echo_to(node, client, SocketAddrV4::new(ip, PORT), bytes, seed);
}

/// [`echo`] to any address.
fn echo_to(node: &SvcNode, client: &Pod, to: SocketAddrV4, bytes: u64, seed: u32) {
    echo_with(node, client, true, to, bytes, seed);
}

/// [`echo_to`], the client with the library if `preload`.
fn echo_with(node: &SvcNode, client: &Pod, preload: bool, to: SocketAddrV4, bytes: u64, seed: u32) {
    let (ip, port, n) = (
        to.ip().to_string(),
        to.port().to_string(),
        bytes.to_string(),
    );
    let src = format!("SRC_PORT={}", 40000 + seed);
    let script = format!("{FIXED_SOURCE_PORT}{ECHO_CLIENT}");
    let seed = seed.to_string();
    let argv = [&src, PYTHON, "-c", &script, &ip, &port, &n, &seed];
    let out = run_ok(
        node.cmd(client, preload, &argv),
        T,
        "echo client through the Service",
    );
    assert!(out.starts_with(&format!("ok {n}")), "{out}");
}

/// What a daemon counted since `before`: shm connections opened, and the
/// fallbacks by reason (zeros left out).
fn since(before: &Stats, after: &Stats) -> (u64, BTreeMap<String, u64>) {
    let opened = |s: &Stats| s.lanes.get("shm").map_or(0, |l| l.connections_opened);
    let fallbacks = after
        .fallbacks
        .iter()
        .map(|(k, v)| (k.clone(), v - before.fallbacks.get(k).copied().unwrap_or(0)))
        .filter(|(_, v)| *v > 0)
        .collect();
    (opened(after) - opened(before), fallbacks)
}

fn counts(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
    pairs
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(k, n)| (k.to_string(), *n))
        .collect()
}

fn pending(node: &SvcNode) -> u64 {
    node.stats()
        .lanes
        .get("shm")
        .map_or(0, |l| l.channels_pending)
}

/// The library learns the Service range from the peer table.
fn assert_service_listed(node: &SvcNode, ip: Ipv4Addr) {
    let m = peer_table::Mapped::open_read_only(&peer_table::path_for(&node.socket()))
        .expect("peer table");
    assert_eq!(m.table().lookup(ip.into()), Verdict::Service);
}

/// One backend, a pod of the client's node with the library: every
/// connection through the Service rides the lane, nothing falls back.
fn one_local_backend(mode: ProxyMode) {
    let c = SvcCluster::new(1, 2);
    let node = &c.nodes[0];
    let (client, server) = (&node.pods[0], &node.pods[1]);
    node.kube_proxy(mode, &[service(10, &[server])]);
    assert_service_listed(node, cluster_ip(10));
    let srv = backend(node, server, true);
    let before = node.stats();
    for seed in 0..3 {
        echo(node, client, cluster_ip(10), 1 << 20, seed);
    }
    let (opened, fallbacks) = since(&before, &node.stats());
    assert_eq!(accepted(srv), 3);
    assert_eq!(
        (opened, fallbacks),
        (3, BTreeMap::new()),
        "every Service connection on the lane\n{}",
        c.logs()
    );
    assert_eq!(pending(node), 0);
}

#[test]
fn svc_iptables_mode_a_local_backend_with_the_library_gets_the_lane() {
    let _turn = crate::turn::take(module_path!());
    one_local_backend(ProxyMode::Iptables);
}

#[test]
fn svc_nftables_mode_a_local_backend_with_the_library_gets_the_lane() {
    let _turn = crate::turn::take(module_path!());
    one_local_backend(ProxyMode::Nftables);
}

/// Three backends behind one Service: two pods with the library, one
/// without. Each connection is right and on the lane its backend allows;
/// the plain backend's are told at connect (`no-listener`), none waits for
/// an attach (`no-peer-library`).
fn several_backends(mode: ProxyMode) {
    // 30 connections over 3 backends picked at random: the plain one gets
    // none with probability (2/3)^30 < 6e-6.
    const CONNS: u32 = 30;
    let c = SvcCluster::new(1, 4);
    let node = &c.nodes[0];
    let p = &node.pods;
    node.kube_proxy(mode, &[service(20, &[&p[1], &p[2], &p[3]])]);
    let lane_a = backend(node, &p[1], true);
    let plain = backend(node, &p[2], false);
    let lane_b = backend(node, &p[3], true);
    let before = node.stats();
    for seed in 0..CONNS {
        echo(node, &p[0], cluster_ip(20), 256 << 10, seed);
    }
    let (opened, fallbacks) = since(&before, &node.stats());
    let lane = (accepted(lane_a) + accepted(lane_b)) as u64;
    let tcp = accepted(plain) as u64;
    println!("figure service-backends mode={mode:?} lane={lane} tcp={tcp}");
    assert_eq!(lane + tcp, u64::from(CONNS));
    assert!(lane > 0 && tcp > 0, "lane {lane}, tcp {tcp}");
    assert_eq!(
        (opened, fallbacks),
        (lane, counts(&[("no-listener", tcp)])),
        "each connection on its backend's lane, no wait for an attach\n{}",
        c.logs()
    );
    assert_eq!(pending(node), 0);
}

#[test]
fn svc_iptables_mode_several_backends_each_connection_on_its_backends_lane() {
    let _turn = crate::turn::take(module_path!());
    several_backends(ProxyMode::Iptables);
}

#[test]
fn svc_nftables_mode_several_backends_each_connection_on_its_backends_lane() {
    let _turn = crate::turn::take(module_path!());
    several_backends(ProxyMode::Nftables);
}

#[test]
fn svc_a_backend_without_the_library_costs_no_wait() {
    let _turn = crate::turn::take(module_path!());
    // No pod of the node serves the lane at all: the intent is answered
    // at once, no channel is made.
    let c = SvcCluster::new(1, 2);
    let node = &c.nodes[0];
    node.kube_proxy(ProxyMode::Nftables, &[service(30, &[&node.pods[1]])]);
    let srv = backend(node, &node.pods[1], false);
    let before = node.stats();
    for seed in 0..3 {
        echo(node, &node.pods[0], cluster_ip(30), 64 << 10, seed);
    }
    let (opened, fallbacks) = since(&before, &node.stats());
    assert_eq!(accepted(srv), 3);
    assert_eq!(
        (opened, fallbacks),
        (0, counts(&[("no-listener", 3)])),
        "{}",
        c.logs()
    );
}

#[test]
fn svc_a_backend_on_another_node_stays_on_tcp_at_once() {
    let _turn = crate::turn::take(module_path!());
    // Nodes without a lane (no relay): the client's daemon says so at
    // connect (`not-local-pod`), the client does not wait; the backend's
    // claim finds no intent on its node.
    let c = SvcCluster::new(2, 2);
    let (n0, n1) = (&c.nodes[0], &c.nodes[1]);
    let far = &n1.pods[0];
    for n in [n0, n1] {
        n.kube_proxy(ProxyMode::Iptables, &[service(40, &[far])]);
    }
    // A lane server on the client's node too (not behind the Service), so
    // the client's daemon makes a channel and resolves the backend.
    let near = backend(n0, &n0.pods[1], true);
    let srv = backend(n1, far, true);
    let (before0, before1) = (n0.stats(), n1.stats());
    for seed in 0..3 {
        echo(n0, &n0.pods[0], cluster_ip(40), 256 << 10, seed);
    }
    assert_eq!(accepted(srv), 3);
    assert_eq!(accepted(near), 0);
    let (opened0, fallbacks0) = since(&before0, &n0.stats());
    let (opened1, fallbacks1) = since(&before1, &n1.stats());
    assert_eq!(
        (opened0, fallbacks0, opened1, fallbacks1),
        (
            0,
            counts(&[("not-local-pod", 3)]),
            0,
            counts(&[("claim-without-intent", 3)])
        ),
        "{}",
        c.logs()
    );
    assert_eq!(pending(n0), 0);
}

/// Connections a daemon's relay opened since `before`.
fn relayed(before: &Stats, after: &Stats) -> u64 {
    let opened = |s: &Stats| s.lanes.get("relay").map_or(0, |l| l.connections_opened);
    opened(after) - opened(before)
}

/// Peer daemons' questions "is a stream with this key coming?" that a
/// daemon answered since `before` (`requests`, op `peer-stream-query`).
fn queries(before: &Stats, after: &Stats) -> u64 {
    let n = |s: &Stats| s.requests.get("peer-stream-query").copied().unwrap_or(0);
    n(after) - n(before)
}

/// Streams a daemon's relay refused because their claim had stopped
/// waiting (`stream_late`).
fn late_streams(s: &Stats) -> u64 {
    s.lane_errors
        .get("relay")
        .and_then(|e| e.get("stream_late"))
        .copied()
        .unwrap_or(0)
}

/// The daemon log's lines with `message`, colours removed (the daemon's
/// log is tracing's fmt output, with ANSI colour codes).
fn log_lines(node: &SvcNode, message: &str) -> Vec<String> {
    node.log()
        .lines()
        .map(|l| {
            let mut out = String::new();
            let mut chars = l.chars();
            while let Some(c) = chars.next() {
                if c == '\u{1b}' {
                    // An SGR sequence: ESC [ ... m.
                    for c in chars.by_ref() {
                        if c == 'm' {
                            break;
                        }
                    }
                } else {
                    out.push(c);
                }
            }
            out
        })
        .filter(|l| l.contains(message))
        .collect()
}

/// The value of field `name` (`name=value`) in a log line.
fn field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
}

/// What the backend's daemon asked the client's about its claims.
struct Asked {
    /// Told a stream is coming.
    coming: u64,
    /// Told none is.
    none: u64,
    /// No answer in time (a lane too slow under load): TCP too, logged.
    unanswered: u64,
    /// The answered round trips, in microseconds.
    us: Vec<u64>,
}

/// What the backend's daemon logged per claim it asked about.
fn asked(node: &SvcNode) -> Asked {
    let unanswered = log_lines(
        node,
        "relay: the client's daemon did not answer whether a stream is coming",
    )
    .len() as u64;
    let lines = log_lines(node, "relay: asked the client's daemon");
    let said = |v: &str| {
        lines
            .iter()
            .filter(|l| field(l, "coming") == Some(v))
            .count() as u64
    };
    Asked {
        coming: said("true"),
        none: said("false"),
        unanswered,
        us: lines
            .iter()
            .filter_map(|l| field(l, "us")?.parse().ok())
            .collect(),
    }
}

/// Two nodes with the relay; a Service with three backends: a pod of the
/// client's node with the library, a pod of the other node with the
/// library, one there without. Each connection takes its backend's path:
/// the shm lane, the relay (opened by both daemons), TCP told at connect
/// (`no-listener`: the other daemon answered the stream so; never a wait
/// for an attach, which would count `no-peer-library`).
fn backends_on_two_nodes(mode: ProxyMode) {
    // 30 connections over 3 backends: one gets none with probability
    // 3 * (2/3)^30 < 2e-5.
    const CONNS: u32 = 30;
    let c = SvcCluster::with_lanes(2);
    let (n0, n1) = (&c.nodes[0], &c.nodes[1]);
    let svc = service(50, &[&n0.pods[1], &n1.pods[0], &n1.pods[1]]);
    for n in [n0, n1] {
        n.kube_proxy(mode, std::slice::from_ref(&svc));
    }
    let near = backend(n0, &n0.pods[1], true);
    let far = backend(n1, &n1.pods[0], true);
    let plain = backend(n1, &n1.pods[1], false);
    let (before0, before1) = (n0.stats(), n1.stats());
    for seed in 0..CONNS {
        echo(n0, &n0.pods[0], cluster_ip(50), 256 << 10, seed);
    }
    let (after0, after1) = (n0.stats(), n1.stats());
    let (near, far, plain) = (
        accepted(near) as u64,
        accepted(far) as u64,
        accepted(plain) as u64,
    );
    println!("figure service-two-nodes mode={mode:?} shm={near} relay={far} tcp={plain}");
    assert_eq!(near + far + plain, u64::from(CONNS));
    assert!(near > 0 && far > 0 && plain > 0, "{near} {far} {plain}");
    let (shm0, fallbacks0) = since(&before0, &after0);
    let (shm1, fallbacks1) = since(&before1, &after1);
    assert_eq!(
        (shm0, relayed(&before0, &after0), fallbacks0),
        (near, far, counts(&[("no-listener", plain)])),
        "client node: each connection on its backend's path\n{}",
        c.logs()
    );
    assert_eq!(
        (shm1, relayed(&before1, &after1), fallbacks1),
        (0, far, counts(&[])),
        "backend node: the relayed ones, nothing fell back\n{}",
        c.logs()
    );
    assert_eq!(pending(n0), 0);
}

#[test]
fn svc_iptables_mode_a_backend_on_another_node_gets_the_relay() {
    let _turn = crate::turn::take(module_path!());
    backends_on_two_nodes(ProxyMode::Iptables);
}

#[test]
fn svc_nftables_mode_a_backend_on_another_node_gets_the_relay() {
    let _turn = crate::turn::take(module_path!());
    backends_on_two_nodes(ProxyMode::Nftables);
}

/// A client WITHOUT the library on one node, a server with it on the
/// other, both daemons serving Service IPs and running the relay: through
/// the Service and to the pod IP, every connection stays on TCP and the
/// backend's claim waits for no stream. Its daemon asks the client's once
/// per claim (`peer-stream-query` there) and is told that none is coming:
/// `claim-without-intent`, never `service-stream-missed` (what a claim
/// counts that waited for an announced stream in vain), no late stream
/// refused, and both daemons logged "none" for every claim. No clock.
fn a_plain_client_on_another_node(mode: ProxyMode) {
    const CONNS: u64 = 6;
    let c = SvcCluster::with_lanes(1);
    let (n0, n1) = (&c.nodes[0], &c.nodes[1]);
    let server = &n1.pods[0];
    let svc = service(85, &[server]);
    for n in [n0, n1] {
        n.kube_proxy(mode, std::slice::from_ref(&svc));
    }
    let srv = backend(n1, server, true);
    let (before0, before1) = (n0.stats(), n1.stats());
    for seed in 0..CONNS as u32 {
        // Through the Service and straight to the pod, in turn.
        let to = if seed % 2 == 0 {
            SocketAddrV4::new(cluster_ip(85), PORT)
        } else {
            SocketAddrV4::new(server.ip, TARGET)
        };
        echo_with(n0, &n0.pods[0], false, to, 64 << 10, seed);
    }
    let (after0, after1) = (n0.stats(), n1.stats());
    assert_eq!(accepted(srv) as u64, CONNS);
    assert_eq!(
        (
            relayed(&before1, &after1),
            since(&before1, &after1).1,
            late_streams(&after1),
        ),
        (0, counts(&[("claim-without-intent", CONNS)]), 0),
        "backend node: each claim went on over TCP, none waited for a stream\n{}",
        c.logs()
    );
    // The client's node: nothing relayed, nothing announced by the plain
    // client, so nothing fell back there either.
    assert_eq!(
        (relayed(&before0, &after0), since(&before0, &after0).1),
        (0, BTreeMap::new()),
        "{}",
        c.logs()
    );
    // What the daemons said: every claim asked once; the client's daemon
    // said "none" to each question that reached it (a question that found
    // no answer in time under load is logged as such, and also stays on
    // TCP without waiting for a stream).
    let a = asked(n1);
    let answered = log_lines(n0, "relay: answered whether a stream is coming");
    let answered_coming = answered
        .iter()
        .filter(|l| field(l, "coming") != Some("false"))
        .count();
    let queried = queries(&before0, &after0);
    assert_eq!(
        (a.coming, a.none + a.unanswered, answered_coming),
        (0, CONNS, 0),
        "what the daemons said\n{}",
        c.logs()
    );
    assert!(
        (a.none..=CONNS).contains(&queried) && answered.len() as u64 == queried,
        "{queried} questions answered, {} told none\n{}",
        a.none,
        c.logs()
    );
}

#[test]
fn svc_iptables_mode_a_client_without_the_library_on_another_node_waits_for_no_stream() {
    let _turn = crate::turn::take(module_path!());
    a_plain_client_on_another_node(ProxyMode::Iptables);
}

#[test]
fn svc_nftables_mode_a_client_without_the_library_on_another_node_waits_for_no_stream() {
    let _turn = crate::turn::take(module_path!());
    a_plain_client_on_another_node(ProxyMode::Nftables);
}

/// `claim.py SOCKET LOCAL PEER`: a hostile pod's raw claim on the daemon
/// socket (the library's wire format); prints the answer.
const RAW_CLAIM: &str = r#"
import json, socket, struct, sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
body = json.dumps({"op": "claim-accepted", "local": sys.argv[2], "peer": sys.argv[3]}).encode()
s.sendall(struct.pack("<I", len(body)) + body)
n = struct.unpack("<I", s.recv(4))[0]
print(s.recv(n).decode())
"#;

/// `client.py IP PORT SRCPORT`: connects from a fixed source port, says
/// `connected`, waits for a line on stdin, then echoes 64 KiB and checks it.
const WAITING_CLIENT: &str = r#"
import socket, sys
c = socket.socket(); c.bind(("0.0.0.0", int(sys.argv[3])))
c.connect((sys.argv[1], int(sys.argv[2])))
print("connected", flush=True)
sys.stdin.readline()
data = bytes(range(256)) * 256
c.sendall(data); c.shutdown(socket.SHUT_WR)
got = b""
while True:
    d = c.recv(65536)
    if not d:
        break
    got += d
assert got == data, len(got)
print("ok", len(got), flush=True)
"#;

/// `server.py PORT`: listens, waits for a line on stdin, then accepts one
/// connection and echoes it.
const WAITING_SERVER: &str = r#"
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(8)
print("listening", flush=True)
sys.stdin.readline()
c, _ = s.accept()
while True:
    d = c.recv(65536)
    if not d:
        break
    c.sendall(d)
c.close()
"#;

fn spawn_piped(mut cmd: Command) -> (Bg, BufReader<std::process::ChildStdout>) {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let out = BufReader::new(child.stdout.take().unwrap());
    (Bg(child), out)
}

fn expect_line(out: &mut BufReader<std::process::ChildStdout>, want: &str) {
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(line.starts_with(want), "expected {want:?}, got {line:?}");
}

#[test]
fn svc_a_pod_cannot_claim_a_service_connection_sent_to_another() {
    let _turn = crate::turn::take(module_path!());
    let c = SvcCluster::new(1, 3);
    let node = &c.nodes[0];
    let (client, server, thief) = (&node.pods[0], &node.pods[1], &node.pods[2]);
    node.kube_proxy(ProxyMode::Nftables, &[service(50, &[server])]);
    // The thief serves the lane on the same port, so only conntrack tells
    // it from the real backend.
    let _thief_srv = backend(node, thief, true);
    let port = TARGET.to_string();
    let (mut srv, mut srv_out) =
        spawn_piped(node.cmd(server, true, &[PYTHON, "-c", WAITING_SERVER, &port]));
    expect_line(&mut srv_out, "listening");
    let before = node.stats();
    let (ip, svc_port) = (cluster_ip(50).to_string(), PORT.to_string());
    let (mut cli, mut cli_out) = spawn_piped(node.cmd(
        client,
        true,
        &[PYTHON, "-c", WAITING_CLIENT, &ip, &svc_port, "45123"],
    ));
    // Connected: the kernel finished the handshake, the server has not
    // accepted, the channel waits for its claim.
    expect_line(&mut cli_out, "connected");
    let socket = node.socket().display().to_string();
    let answer = run_ok(
        node.cmd(
            thief,
            false,
            &[
                PYTHON,
                "-c",
                RAW_CLAIM,
                &socket,
                &format!("{}:{TARGET}", thief.ip),
                &format!("{}:45123", client.ip),
            ],
        ),
        T,
        "the thief's claim",
    );
    assert!(
        answer.contains("\"forbidden\""),
        "the thief got: {answer}\n{}",
        c.logs()
    );
    // The real backend still gets the lane.
    writeln!(srv.0.stdin.as_mut().unwrap()).unwrap();
    writeln!(cli.0.stdin.as_mut().unwrap()).unwrap();
    expect_line(&mut cli_out, "ok 65536");
    let (st, _, err) = srv.finish(T);
    assert!(st.is_some_and(|s| s.success()), "server: {err}");
    drop(cli);
    let (opened, fallbacks) = since(&before, &node.stats());
    assert_eq!(
        (opened, fallbacks),
        (1, counts(&[("auth-failed", 1)])),
        "{}",
        c.logs()
    );
}

/// `shm-bench connrate` (connect, 1-byte echo, close) in `pod`: connections/s.
fn connrate(node: &SvcNode, pod: &Pod, preload: bool, addr: &str, n: usize) -> f64 {
    let bin = flowlane_e2e::shm::build_dir().join("shm-bench");
    let n = n.to_string();
    let argv = [bin.to_str().unwrap(), "connrate", addr, &n];
    let out = run_ok(node.cmd(pod, preload, &argv), T, "connrate");
    let rate = out
        .split_whitespace()
        .nth(1)
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("connrate printed {out:?}"));
    rate
}

#[test]
fn svc_figures_connection_set_up_through_a_service() {
    let _turn = crate::turn::take(module_path!());
    // Figures only (printed, never asserted: the machine is shared); what
    // is asserted is which lane carried the connections.
    const N: usize = 300;
    let c = SvcCluster::new(1, 2);
    let node = &c.nodes[0];
    let (client, server) = (&node.pods[0], &node.pods[1]);
    node.kube_proxy(ProxyMode::Nftables, &[service(60, &[server])]);
    let bin = flowlane_e2e::shm::build_dir().join("shm-bench");
    let port = TARGET.to_string();
    let _srv = Bg::spawn(node.cmd(server, true, &[bin.to_str().unwrap(), "serve", &port]));
    // The pod-IP run goes to another port: a direct connection that reuses
    // the source port of a Service connection to the same backend, still in
    // conntrack, has its source port remapped by the node's NAT (the tuples
    // would clash), its claim misses and it waits for the attach timeout
    // (docs/daemon.md, "Known limits").
    let direct = (TARGET + 1).to_string();
    let _direct = Bg::spawn(node.cmd(server, true, &[bin.to_str().unwrap(), "serve", &direct]));
    wait_listening(server, TARGET);
    wait_listening(server, TARGET + 1);
    let svc = format!("{}:{PORT}", cluster_ip(60));
    let pod = format!("{}:{direct}", server.ip);
    let tcp_svc = connrate(node, client, false, &svc, N);
    let before = node.stats();
    let lane_svc = connrate(node, client, true, &svc, N);
    let mid = node.stats();
    let lane_pod = connrate(node, client, true, &pod, N);
    let after = node.stats();
    assert_eq!(
        (since(&before, &mid), since(&mid, &after)),
        ((N as u64, BTreeMap::new()), (N as u64, BTreeMap::new())),
        "through the Service, then to the pod IP"
    );
    println!(
        "figure service-connrate tcp-via-service={tcp_svc:.0} lane-via-service={lane_svc:.0} \
         lane-to-pod-ip={lane_pod:.0} connections/s ({N} each)"
    );
}

#[test]
fn svc_figures_set_up_through_a_service_to_another_node() {
    let _turn = crate::turn::take(module_path!());
    // As above, the backend on the other node: the relay. Figures printed,
    // never asserted; asserted is that every library connection was
    // relayed (both daemons) and none fell back, and that the claims of a
    // client without the library were told at once that no stream comes
    // (the round trip of that question is printed).
    const N: usize = 200;
    let c = SvcCluster::with_lanes(1);
    let (n0, n1) = (&c.nodes[0], &c.nodes[1]);
    let (client, server) = (&n0.pods[0], &n1.pods[0]);
    let svc = service(70, &[server]);
    for n in [n0, n1] {
        n.kube_proxy(ProxyMode::Nftables, std::slice::from_ref(&svc));
    }
    let bin = flowlane_e2e::shm::build_dir().join("shm-bench");
    let bin = bin.to_str().unwrap();
    let (port, direct) = (TARGET.to_string(), (TARGET + 1).to_string());
    let _srv = Bg::spawn(n1.cmd(server, true, &[bin, "serve", &port]));
    let _direct = Bg::spawn(n1.cmd(server, true, &[bin, "serve", &direct]));
    wait_listening(server, TARGET);
    wait_listening(server, TARGET + 1);
    let via_svc = format!("{}:{PORT}", cluster_ip(70));
    let to_pod = format!("{}:{direct}", server.ip);
    let plain = [n0.stats(), n1.stats()];
    let tcp_svc = connrate(n0, client, false, &via_svc, N);
    let tcp_pod = connrate(n0, client, false, &to_pod, N);
    let before = [n0.stats(), n1.stats()];
    // A client without the library: each claim asked the client's daemon
    // and was never told a stream is coming (no wait for one).
    let n = 2 * N as u64;
    let a = asked(n1);
    assert_eq!(
        (
            since(&plain[1], &before[1]).1,
            relayed(&plain[1], &before[1]),
            a.coming,
            a.none + a.unanswered
        ),
        (counts(&[("claim-without-intent", n)]), 0, 0, n),
        "without the library\n{}",
        c.logs()
    );
    let mut us = a.us;
    us.sort_unstable();
    let pct = |p: usize| {
        let i = (us.len() * p / 100).min(us.len().saturating_sub(1));
        us.get(i).copied().unwrap_or(0)
    };
    println!(
        "figure service-stream-query median={}us p90={}us max={}us ({} claims of a client \
         without the library asked the client's daemon, {} unanswered in time; it answered {})",
        pct(50),
        pct(90),
        pct(100),
        us.len(),
        a.unanswered,
        queries(&plain[0], &before[0])
    );
    let relay_svc = connrate(n0, client, true, &via_svc, N);
    let mid = [n0.stats(), n1.stats()];
    let relay_pod = connrate(n0, client, true, &to_pod, N);
    let after = [n0.stats(), n1.stats()];
    for (from, to, what) in [
        (&before, &mid, "through the Service"),
        (&mid, &after, "to the pod IP"),
    ] {
        for i in 0..2 {
            assert_eq!(
                (relayed(&from[i], &to[i]), since(&from[i], &to[i]).1),
                (N as u64, BTreeMap::new()),
                "{what}, node {i}\n{}",
                c.logs()
            );
        }
    }
    println!(
        "figure service-connrate-remote tcp-via-service={tcp_svc:.0} tcp-to-pod-ip={tcp_pod:.0} \
         relay-via-service={relay_svc:.0} relay-to-pod-ip={relay_pod:.0} connections/s ({N} each; \
         tcp: a client without the library, the server with it)"
    );
}

/// `async_client.py IP PORT N`: N sequential asyncio connections (a
/// non-blocking connect: the library resolves the Service while the
/// handshake is in progress), each echoing 64 KiB and checking it.
const ASYNC_CLIENT: &str = r#"
import asyncio, sys
async def one(ip, port, i):
    r, w = await asyncio.open_connection(ip, port)
    data = bytes([i % 256]) * 65536
    w.write(data); await w.drain(); w.write_eof()
    got = await r.read(-1)
    assert got == data, len(got)
    w.close(); await w.wait_closed()
async def main():
    for i in range(int(sys.argv[3])):
        await one(sys.argv[1], int(sys.argv[2]), i)
    print("ok", sys.argv[3])
asyncio.run(main())
"#;

#[test]
fn svc_a_non_blocking_connect_is_resolved_too() {
    let _turn = crate::turn::take(module_path!());
    let c = SvcCluster::new(1, 2);
    let node = &c.nodes[0];
    node.kube_proxy(ProxyMode::Iptables, &[service(70, &[&node.pods[1]])]);
    let srv = backend(node, &node.pods[1], true);
    let before = node.stats();
    let (ip, port) = (cluster_ip(70).to_string(), PORT.to_string());
    let out = run_ok(
        node.cmd(
            &node.pods[0],
            true,
            &[PYTHON, "-c", ASYNC_CLIENT, &ip, &port, "10"],
        ),
        T,
        "asyncio client through the Service",
    );
    assert!(out.starts_with("ok 10"), "{out}");
    assert_eq!(accepted(srv), 10);
    let (opened, fallbacks) = since(&before, &node.stats());
    assert_eq!(
        (opened, fallbacks),
        (10, BTreeMap::new()),
        "every non-blocking Service connection resolved and on the lane\n{}",
        c.logs()
    );
}

#[test]
fn svc_a_pod_reaching_itself_through_its_service_stays_on_tcp_at_once() {
    let _turn = crate::turn::take(module_path!());
    // kube-proxy masquerades a connection whose backend is its own client
    // (KUBE-MARK-MASQ / mark-for-masquerade on the endpoint's own source):
    // the server sees the node's address, not the client's, so no lane can
    // pair; conntrack's reply tuple says so and the client does not wait.
    let c = SvcCluster::new(1, 1);
    let node = &c.nodes[0];
    let pod = &node.pods[0];
    node.kube_proxy(ProxyMode::Nftables, &[service(80, &[pod])]);
    let srv = backend(node, pod, true);
    let before = node.stats();
    echo(node, pod, cluster_ip(80), 64 << 10, 1);
    assert_eq!(accepted(srv), 1);
    let (opened, fallbacks) = since(&before, &node.stats());
    assert_eq!(
        (opened, fallbacks),
        (
            0,
            counts(&[("service-unresolved", 1), ("claim-without-intent", 1)])
        ),
        "{}",
        c.logs()
    );
}

#[test]
fn svc_a_source_port_remapped_by_the_nodes_nat_still_gets_the_lane() {
    let _turn = crate::turn::take(module_path!());
    // The same client port to the same backend, through the Service and
    // then directly (and the other way round), while conntrack holds the
    // first entry: the node's NAT remaps the second connection's source
    // port (the reply tuples would clash), so the server sees another peer
    // than the client announced. The daemon finds the announced source
    // in conntrack by the reply tuple.
    let c = SvcCluster::new(1, 2);
    let node = &c.nodes[0];
    let (client, server) = (&node.pods[0], &node.pods[1]);
    node.kube_proxy(ProxyMode::Iptables, &[service(90, &[server])]);
    let srv = backend(node, server, true);
    let direct = SocketAddrV4::new(server.ip, TARGET);
    let before = node.stats();
    echo(node, client, cluster_ip(90), 64 << 10, 7);
    echo_to(node, client, direct, 64 << 10, 7);
    echo_to(node, client, direct, 64 << 10, 8);
    echo(node, client, cluster_ip(90), 64 << 10, 8);
    assert_eq!(accepted(srv), 4);
    let (opened, fallbacks) = since(&before, &node.stats());
    assert_eq!((opened, fallbacks), (4, BTreeMap::new()), "{}", c.logs());
}
