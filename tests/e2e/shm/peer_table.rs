//! The peer table (issue 12, item 1): a connection whose destination
//! cannot be a lane peer costs the library no system call and no daemon
//! round trip; the daemon keeps the table current while processes run; the
//! fast path holds under concurrency. Real pods (the plugin), the real
//! daemon, the real library, programs traced with strace. Needs root.

use std::io::{BufRead, BufReader, Write};
use std::net::IpAddr;
use std::process::Stdio;
use std::time::Duration;

use flowlane_e2e::outside::OutsideHost;
use flowlane_e2e::shm::{self, run_ok, wait_listening, Bg, Node};
use flowlane_lane::peer_table::Verdict;

const T: Duration = Duration::from_secs(120);

fn bench_bin() -> String {
    shm::build_dir().join("shm-bench").display().to_string()
}

/// How often each traced system call appears in an strace log.
fn count(log: &str, call: &str) -> usize {
    let needle = format!(" {call}(");
    log.lines()
        .filter(|l| l.contains(&needle) || l.starts_with(&format!("{call}(")))
        .count()
}

/// `connrate ADDR n` under strace in pod 0 with the library; the log.
fn traced_connrate(node: &Node, addr: &str, n: usize) -> String {
    let log = node
        .dir
        .join(format!("strace-{}.log", addr.replace(':', "-")));
    let calls = "trace=socket,bind,connect,getsockopt,getsockname,sendmsg,recvmsg,sendto,recvfrom";
    let bin = bench_bin();
    let n = n.to_string();
    let argv = [
        "strace",
        "-f",
        "-qq",
        "-e",
        calls,
        "-o",
        log.to_str().unwrap(),
        &bin,
        "connrate",
        addr,
        &n,
    ];
    run_ok(node.cmd(&node.pods[0], true, &argv), T, "traced connrate");
    std::fs::read_to_string(&log).unwrap()
}

#[test]
fn pt_outside_destinations_cost_no_system_call_and_no_daemon_round_trip() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new("ptsc", 2);
    let out = OutsideHost::new(&node.pods[0], "ptsc");
    let _srv = Bg::spawn(out.cmd(&[&bench_bin(), "serve", "7300"]));
    let _pod_srv = Bg::spawn(node.cmd(&node.pods[1], false, &[&bench_bin(), "serve", "7301"]));
    out.wait_listening(7300);
    wait_listening(&node.pods[1], 7301);
    let ip: IpAddr = out.ip.parse().unwrap();
    assert_eq!(node.peer_table_says(ip), Some(Verdict::NotPeer));
    let n = 40;
    let log = traced_connrate(&node, &format!("{}:7300", out.ip), n);
    // Exactly the program's own calls: one TCP socket, one connect, one
    // send and one recv (std's write and read) per connection; no
    // route-lookup socket, no bind, no option reads, no daemon connection
    // or request.
    for call in ["socket", "connect", "sendto", "recvfrom"] {
        assert_eq!(count(&log, call), n, "{call}:\n{log}");
    }
    for call in ["bind", "getsockopt", "getsockname", "sendmsg", "recvmsg"] {
        assert_eq!(count(&log, call), 0, "{call}:\n{log}");
    }
    // The same trace towards a pod (a lane candidate whose server has no
    // library) shows the library's set-up: a daemon round trip per
    // connection (the trace sees it), and still no bind: the port is left
    // to connect (a portless intent, flowlaned's broker/channels.rs).
    let log = traced_connrate(&node, &format!("{}:7301", node.pods[1].ip), n);
    assert!(count(&log, "recvmsg") >= n, "{log}");
    assert_eq!(count(&log, "bind"), 0, "{log}");
    assert_eq!(node.shm_opened(), 0);
}

/// Lane connections take ports as plain TCP does: `connect` picks them,
/// and one port serves several destinations at once. With a `bind(ip, 0)`
/// before `connect` (the library's set-up until portless intents), each
/// lane connection held its port against every destination, so a pod ran
/// out of ports at a fraction of what its plain TCP could open. The client
/// pod gets 64 ephemeral ports; one process opens 48 lane connections to
/// each of two servers and keeps all 96 open (open sockets, not TIME_WAIT
/// ones, hold the ports: whether a closed lane connection leaves a
/// TIME_WAIT depends on who reads the last doorbell): every one must
/// succeed, on the lane.
#[test]
fn pt_lane_connections_reserve_no_port_beyond_what_connect_would() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new("ptpo", 2);
    let _srv_a = Bg::spawn(node.cmd(&node.pods[1], true, &[&bench_bin(), "serve", "7310"]));
    let _srv_b = Bg::spawn(node.cmd(&node.pods[1], true, &[&bench_bin(), "serve", "7311"]));
    wait_listening(&node.pods[1], 7310);
    wait_listening(&node.pods[1], 7311);
    let client = &node.pods[0];
    shm::sh_ok(&[
        "ip",
        "netns",
        "exec",
        &client.netns,
        "sysctl",
        "-q",
        "-w",
        "net.ipv4.ip_local_port_range=40000 40063",
    ]);
    let before = node.shm_opened();
    let host = node.pods[1].ip.to_string();
    let out = run_ok(
        node.cmd(
            client,
            true,
            &["python3", "-c", HOLD_OPEN, &host, "7310", "7311"],
        ),
        T,
        "96 connections held open through 64 ports",
    );
    assert_eq!(out.trim(), "ok 96", "{out}");
    assert_eq!(
        node.shm_opened() - before,
        96,
        "every connection on the lane\n{}",
        node.daemon_log()
    );
}

/// Opens 48 connections to each port given (shm-bench's echo server),
/// checks one echoed byte on each and keeps them all open to the end.
const HOLD_OPEN: &str = r#"
import socket, sys
host, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
held = []
for port in ports:
    for _ in range(48):
        s = socket.create_connection((host, port), timeout=30)
        s.sendall(b"Ex")
        assert s.recv(1) == b"x"
        held.append(s)
print("ok", len(held), flush=True)
"#;

/// A client process that stays up and connects on command: `N THREADS
/// ADDR...` on stdin makes THREADS threads each open N connections (1-byte
/// echo, checked), thread k to the k-th address (round robin), and prints
/// `ok`.
const CLIENT: &str = r#"
import socket, sys, threading
def one(host, port, n, errors):
    for _ in range(n):
        try:
            s = socket.create_connection((host, port), timeout=30)
            s.sendall(b"Ex")
            if s.recv(1) != b"x":
                errors.append("bad echo")
            s.close()
        except Exception as e:
            errors.append(repr(e))
for line in sys.stdin:
    n, threads, *addrs = line.split()
    errors = []
    ts = []
    for k in range(int(threads)):
        host, port = addrs[k % len(addrs)].rsplit(":", 1)
        ts.append(threading.Thread(target=one, args=(host, int(port), int(n), errors)))
    for t in ts: t.start()
    for t in ts: t.join()
    print("ok" if not errors else "errors " + "; ".join(errors[:3]), flush=True)
"#;

struct Client {
    child: std::process::Child,
    out: BufReader<std::process::ChildStdout>,
}

impl Client {
    fn start(node: &Node) -> Client {
        let mut c = node.cmd(&node.pods[0], true, &["python3", "-c", CLIENT]);
        let mut child = c
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        Client { child, out }
    }

    fn run(&mut self, addrs: &[&str], n: usize, threads: usize) {
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{n} {threads} {}", addrs.join(" ")).unwrap();
        let mut line = String::new();
        self.out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ok", "{addrs:?}");
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_verdict(node: &Node, ip: IpAddr, want: Verdict) {
    let seen = flowlane_e2e::wait::until(Duration::from_secs(10), || {
        node.peer_table_says(ip) == Some(want)
    });
    assert!(
        seen,
        "peer table: {ip} {:?}, want {want:?}\n{}",
        node.peer_table_says(ip),
        node.daemon_log()
    );
}

/// A running process sees the table change: a pod added after its first
/// connection is reached over the lane, a pod removed is ruled out; the
/// fast path (outside host) and the lane (pod) mixed over many threads at
/// once all succeed, and only the pod connections use the lane; the daemon
/// holds no channel afterwards.
#[test]
fn pt_a_running_process_follows_the_table_under_concurrency() {
    let _turn = crate::turn::take(module_path!());
    let mut node = Node::new("ptup", 2);
    let out = OutsideHost::new(&node.pods[0], "ptup");
    let bin = bench_bin();
    let _out_srv = Bg::spawn(out.cmd(&[&bin, "serve", "7310"]));
    let _srv1 = Bg::spawn(node.cmd(&node.pods[1], true, &[&bin, "serve", "7311"]));
    out.wait_listening(7310);
    wait_listening(&node.pods[1], 7311);
    let mut client = Client::start(&node);
    let pod1 = format!("{}:7311", node.pods[1].ip);
    let outside = format!("{}:7310", out.ip);
    client.run(&[&pod1], 1, 1);
    assert_eq!(node.shm_opened(), 1, "{}", node.daemon_log());

    // A pod added while the client runs.
    let i = node.add_extra_pod();
    let ip2 = IpAddr::V4(node.pods[i].ip);
    wait_verdict(&node, ip2, Verdict::Candidate);
    let _srv2 = Bg::spawn(node.cmd(&node.pods[i], true, &[&bin, "serve", "7312"]));
    wait_listening(&node.pods[i], 7312);
    client.run(&[&format!("{ip2}:7312")], 1, 1);
    assert_eq!(node.shm_opened(), 2, "{}", node.daemon_log());

    // Concurrency: outside and pod connections from 8 threads at once,
    // half of them to each.
    let (threads, n) = (8, 25);
    client.run(&[&outside, &pod1], n, threads);
    assert_eq!(
        node.shm_opened(),
        2 + (threads / 2 * n) as u64,
        "{}",
        node.daemon_log()
    );

    // The pod removed: ruled out again.
    drop(_srv2);
    node.remove_pod(i);
    wait_verdict(&node, ip2, Verdict::NotPeer);
    drop(client);
    let settled = flowlane_e2e::wait::until(Duration::from_secs(10), || {
        let st = node.stats();
        st.lanes.get("shm").is_some_and(|l| {
            l.channels_pending == 0 && l.connections_closed == l.connections_opened
        })
    });
    assert!(settled, "{:?}\n{}", node.stats(), node.daemon_log());
}

/// Two clients of two processes mixing both kinds of destination at once
/// (each process maps the table on its first connect, at the same time).
#[test]
fn pt_many_processes_map_the_table_at_once() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new("ptmp", 2);
    let out = OutsideHost::new(&node.pods[0], "ptmp");
    let bin = bench_bin();
    let _out_srv = Bg::spawn(out.cmd(&[&bin, "serve", "7320"]));
    let _srv = Bg::spawn(node.cmd(&node.pods[1], true, &[&bin, "serve", "7321"]));
    out.wait_listening(7320);
    wait_listening(&node.pods[1], 7321);
    let pod = format!("{}:7321", node.pods[1].ip);
    let outside = format!("{}:7320", out.ip);
    let procs: Vec<Bg> = (0..6)
        .map(|k| {
            let addr = if k % 2 == 0 { &pod } else { &outside };
            Bg::spawn(node.cmd(&node.pods[0], true, &[&bin, "connrate", addr, "50"]))
        })
        .collect();
    for p in procs {
        let (st, o, e) = p.finish(T);
        assert!(st.is_some_and(|s| s.success()), "{o} {e}");
    }
    assert_eq!(node.shm_opened(), 150, "{}", node.daemon_log());
}
