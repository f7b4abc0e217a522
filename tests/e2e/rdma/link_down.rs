//! The RDMA lane losing its link while pods stream through it, on the
//! Soft-RoCE two-guest rig (`docs/rdma.md`, "Test rig"; both daemons with
//! `--lane-transport rdma` on `rxe0`). Two failure cases, each in one guest:
//!
//! - the underlay goes down (`ip link set eth0 down` for longer than the
//!   transport's `dead_after`, 10 s) and comes back;
//! - the RDMA device goes away while TCP stays up (`rdma link delete rxe0`)
//!   and is added back.
//!
//! Relayed connections must be reset for both pods (`ECONNRESET` on the
//! receiving side: a cut transfer never looks complete; never a hang), with
//! every byte that arrived intact: both pods stream a pattern in
//! which every byte is a function of its offset, checked on arrival. Then new
//! connections must use the lane again. Timings are printed, never asserted:
//! `cargo test --release -p flowlane-e2e --test e2e -- rdma::link_down:: --nocapture`.

use std::time::{Duration, Instant};

use flowlane_cluster::rdma_rig::{self, shell_quote, Job, RdmaRig};
use flowlane_e2e::shm_scripts::{ECHO_CLIENT, ECHO_SERVER};
use serde_json::Value;

const T: Duration = Duration::from_secs(180);

/// `pattern.py server PORT MAXSECS` / `pattern.py client IP PORT MAXSECS`:
/// both ends send an endless stream in which byte n is a function of n (a
/// different one per direction) and check every byte they receive against
/// it. When the connection ends each prints
/// `ended recv=<how>@<epoch> send=<how>@<epoch> sent=N recv=N intact`;
/// `CORRUPT at N` (exit 2) on a wrong byte, `hung ...` (exit 3) when the
/// connection has not ended after MAXSECS.
const PATTERN: &str = r#"
import socket, sys, threading, time, os
role = sys.argv[1]
def pattern(mult, period):
    one = bytes((i * mult + 7) % 256 for i in range(period))
    return len(one), one * ((1 << 17) // period + 2)
if role == "server":
    port, maxs = int(sys.argv[2]), float(sys.argv[3])
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(('0.0.0.0', port)); s.listen(8)
    c, _ = s.accept()
    mine, theirs = (37, 241), (31, 251)
else:
    ip, port, maxs = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    c = socket.create_connection((ip, port))
    mine, theirs = (31, 251), (37, 241)
print("connected", flush=True)
st = {"sent": 0, "recv": 0, "send_end": None, "recv_end": None}
def watchdog():
    time.sleep(maxs)
    print("hung sent=%d recv=%d" % (st["sent"], st["recv"]), flush=True)
    os._exit(3)
threading.Thread(target=watchdog, daemon=True).start()
def sender():
    p, big = pattern(*mine); n = 0
    try:
        while True:
            o = n % p
            c.sendall(big[o:o + 65536]); n += 65536; st["sent"] = n
    except OSError as e:
        st["send_end"] = "%s@%.2f" % (type(e).__name__, time.time())
t = threading.Thread(target=sender, daemon=True); t.start()
p, big = pattern(*theirs); n = 0
try:
    while True:
        d = c.recv(65536)
        if not d:
            st["recv_end"] = "eof@%.2f" % time.time(); break
        o = n % p
        if d != big[o:o + len(d)]:
            print("CORRUPT at", n, flush=True); os._exit(2)
        n += len(d); st["recv"] = n
except OSError as e:
    st["recv_end"] = "%s@%.2f" % (type(e).__name__, time.time())
t.join(timeout=60)
print("ended recv=%s send=%s sent=%d recv=%d intact" % (st["recv_end"], st["send_end"], st["sent"], n), flush=True)
"#;

/// Both guests healthy (an earlier failed test may have left rxe0 removed
/// or eth0 down), then both daemons (re)started with the RDMA lane.
fn nodes_up(rig: &RdmaRig) {
    for node in rdma_rig::NODES {
        rig.run_ok(
            node,
            "ip link set eth0 up; ip route replace $RIG_PEER_POD_CIDR via $RIG_PEER_ADDR dev eth0; \
             [ -e /sys/class/infiniband/rxe0 ] || rdma link add rxe0 type rxe netdev eth0; \
             for _ in $(seq 1 100); do grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state && exit 0; sleep 0.1; done; exit 1",
            T,
        );
    }
    rig.nodes_up_with_rdma_lane(&[
        "--log-level",
        "info,flowlaned=debug",
        "--metrics-addr",
        "127.0.0.1:9464",
    ])
    .unwrap_or_else(|e| panic!("{e:#}"));
}

fn stats(rig: &RdmaRig, node: u8) -> flowlane_lane::proto::Stats {
    rig.daemon_stats(node).expect("flowlaned answers")
}

/// (opened, active) of node `n`'s RDMA relay lane.
fn rdma_lane(rig: &RdmaRig, node: u8) -> (u64, u64) {
    stats(rig, node)
        .lanes
        .get("rdma")
        .map(|l| (l.connections_opened, l.connections_active))
        .unwrap_or_default()
}

fn link_failures(rig: &RdmaRig, node: u8) -> u64 {
    stats(rig, node)
        .lane_errors
        .get("rdma")
        .and_then(|e| e.get("link_failed"))
        .copied()
        .unwrap_or(0)
}

fn logs(rig: &RdmaRig) -> String {
    let tail = |s: String| {
        let l: Vec<&str> = s.lines().collect();
        l[l.len().saturating_sub(40)..].join("\n")
    };
    format!(
        "--- node1 flowlaned.log ---\n{}\n--- node2 flowlaned.log ---\n{}",
        tail(rig.node_log(1, "flowlaned.log")),
        tail(rig.node_log(2, "flowlaned.log"))
    )
}

fn wait_listening(rig: &RdmaRig, node: u8, pod: &str, port: u16) {
    rig.run_ok(
        node,
        &format!(
            "for _ in $(seq 1 300); do ip netns exec {pod} ss -Hltn 'sport = :{port}' | grep -q . && exit 0; sleep 0.1; done; exit 1"
        ),
        T,
    );
}

/// A checksummed echo from `cli` (node 1) to `srv` (node 2) on `port`;
/// returns whether node 1's daemon carried it over RDMA. (The first
/// connection towards a peer whose link is not up yet stays on TCP while
/// the link comes up: correct, and why callers try a few times.)
fn echo_used_rdma(rig: &RdmaRig, cli: &str, srv: &str, srv_ip: &str, port: u16) -> bool {
    let before = rdma_lane(rig, 1).0;
    let server = rig
        .spawn(
            2,
            &format!(
                "pod-exec.sh --lane {srv} python3 -c {} {port} 1",
                shell_quote(ECHO_SERVER)
            ),
            T,
        )
        .expect("echo server");
    wait_listening(rig, 2, srv, port);
    let out = rig
        .run(
            1,
            &format!(
                "pod-exec.sh --lane {cli} python3 -c {} {srv_ip} {port} 200000 {port}",
                shell_quote(ECHO_CLIENT)
            ),
            T,
        )
        .expect("echo client ran");
    assert!(
        out.success() && out.stdout.starts_with("ok 200000"),
        "echo: {}{}\n{}",
        out.stdout,
        out.stderr,
        logs(rig)
    );
    let _ = server.wait();
    rdma_lane(rig, 1).0 > before
}

/// Echo connections until one is carried over RDMA (at most `tries`);
/// returns the number of connections it took.
fn until_rdma_carries(
    rig: &RdmaRig,
    cli: &str,
    srv: &str,
    srv_ip: &str,
    port: &mut u16,
    tries: u32,
) -> Option<u32> {
    for i in 1..=tries {
        *port += 1;
        if echo_used_rdma(rig, cli, srv, srv_ip, *port) {
            return Some(i);
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    None
}

/// A pattern stream pod node1 -> pod node2, both ways, carried over RDMA:
/// returns (server job, client job) once node 1's daemon carries it. A
/// connection that stays on TCP (the link to the peer still being set up)
/// or whose set-up fails is stopped and tried again on the next port.
fn carried_stream<'a>(
    rig: &'a RdmaRig,
    cli: &str,
    srv: &str,
    srv_ip: &str,
    port: &mut u16,
) -> (Job<'a>, Job<'a>) {
    let quoted = shell_quote(PATTERN);
    for _attempt in 0..3 {
        *port += 1;
        let p = *port;
        let (opened, active) = rdma_lane(rig, 1);
        let server = rig
            .spawn(
                2,
                &format!(
                    "pod-exec.sh --lane {srv} python3 -c {quoted} server {p} 150 & echo $! > /tmp/pattern-{p}.pid; wait $!"
                ),
                T,
            )
            .expect("pattern server");
        wait_listening(rig, 2, srv, p);
        let client = rig
            .spawn(
                1,
                &format!(
                    "pod-exec.sh --lane {cli} python3 -c {quoted} client {srv_ip} {p} 150 & echo $! > /tmp/pattern-{p}.pid; wait $!"
                ),
                T,
            )
            .expect("pattern client");
        let t0 = Instant::now();
        let carried = loop {
            let (o, a) = rdma_lane(rig, 1);
            if o > opened {
                // Carried; still flowing?
                break a > active;
            }
            if t0.elapsed() > Duration::from_secs(20) {
                break false;
            }
            std::thread::sleep(Duration::from_millis(500));
        };
        if carried {
            // Bytes flow for a moment before the failure.
            std::thread::sleep(Duration::from_secs(2));
            if rdma_lane(rig, 1).1 > active {
                return (server, client);
            }
        }
        eprintln!("pattern stream on port {p} not carried over RDMA (or ended at once); next port");
        for node in rdma_rig::NODES {
            let _ = rig.run(
                node,
                &format!("kill $(cat /tmp/pattern-{p}.pid) 2>/dev/null"),
                T,
            );
        }
        let _ = client.wait();
        let _ = server.wait();
    }
    panic!(
        "no pattern stream was carried over RDMA in 3 tries\n{}",
        logs(rig)
    )
}

/// How a pattern end ended: its `ended ...` line, checked for a clean end
/// with intact bytes, and the epoch second of its first end (receive or
/// send side).
fn clean_end(rig: &RdmaRig, job: Job, what: &str) -> (String, f64) {
    let out = job.wait().expect("pattern job");
    let line = out
        .stdout
        .lines()
        .find(|l| l.starts_with("ended") || l.starts_with("hung") || l.starts_with("CORRUPT"))
        .unwrap_or("")
        .to_string();
    assert!(
        out.success() && line.starts_with("ended") && line.ends_with("intact"),
        "the {what} pod did not end cleanly (exit {}): {}{}\n{}",
        out.status,
        out.stdout,
        out.stderr,
        logs(rig)
    );
    // The failure reaches the reader as a reset, not a clean end-of-stream.
    assert!(
        line.contains(" recv=ConnectionResetError@"),
        "the {what} pod's read did not see a reset: {line}\n{}",
        logs(rig)
    );
    let first_end = line
        .split_whitespace()
        .filter_map(|w| w.split_once('@'))
        .filter_map(|(_, t)| t.parse::<f64>().ok())
        .fold(f64::INFINITY, f64::min);
    (line, first_end)
}

/// Node `n`'s RDMA devices as `flowlane diag --json` reads them from sysfs.
fn diag_devices(rig: &RdmaRig, node: u8) -> Value {
    let out = rig
        .run(node, "$FLOWLANE_BIN_DIR/flowlane diag --json", T)
        .expect("flowlane diag");
    let v: Value = serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("diag --json: {e}: {}{}", out.stdout, out.stderr));
    v["sections"]
        .as_array()
        .and_then(|s| s.iter().find(|s| s["name"] == "rdma"))
        .map(|s| s["data"]["inventory"]["devices"].clone())
        .unwrap_or(Value::Null)
}

/// The daemon's own view of its lane (`flowlane status --json`, key
/// `nodes.rdma`): the lane, or why there is none.
fn daemon_lane_view(rig: &RdmaRig, node: u8) -> Value {
    let out = rig.run_ok(node, "$FLOWLANE_BIN_DIR/flowlane status --json", T);
    let v: Value = serde_json::from_str(&out.stdout).expect("status --json");
    v["nodes"]["rdma"].clone()
}

/// Polls `f` every half second until it is true (at most `limit`); returns
/// how long it took.
fn within(limit: Duration, what: &str, rig: &RdmaRig, mut f: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !f() {
        assert!(
            t0.elapsed() < limit,
            "{what}: not within {limit:?}\n{}",
            logs(rig)
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    t0.elapsed()
}

fn epoch_now(rig: &RdmaRig, node: u8) -> f64 {
    rig.run_ok(node, "date +%s.%N", T)
        .stdout
        .trim()
        .parse()
        .unwrap()
}

/// The underlay of node 1 goes down for 15 s (longer than the transport's
/// 10 s `dead_after`) under a carried stream: both pods see their
/// connection end (node 1's QP fails at once; node 2 notices the silence),
/// bytes intact, the failures are counted and diag shows the port down;
/// once the link is back, new connections use the RDMA lane again.
#[test]
fn underlay_down_ends_relayed_connections_and_the_lane_comes_back() {
    let _turn = crate::turn::take(module_path!());
    let Some(rig) = rdma_rig::shared() else {
        return;
    };
    let rig = rig.lock();
    nodes_up(&rig);
    rig.add_pod(1, "ldcli").expect("client pod on node1");
    let srv_ip = rig
        .add_pod(2, "ldsrv")
        .expect("server pod on node2")
        .to_string();
    let mut port = 7800;
    until_rdma_carries(&rig, "ldcli", "ldsrv", &srv_ip, &mut port, 5)
        .expect("the RDMA lane carries a connection before the failure");
    let failed_before = (link_failures(&rig, 1), link_failures(&rig, 2));

    let (server, client) = carried_stream(&rig, "ldcli", "ldsrv", &srv_ip, &mut port);
    // Down for 15 s, then up again; link-down also deleted the host-gw
    // route through eth0, which the node's routing (here: the rig) restores.
    let down_at = epoch_now(&rig, 1);
    let outage = rig
        .spawn(
            1,
            "ip link set eth0 down; sleep 15; ip link set eth0 up; \
             ip route replace $RIG_PEER_POD_CIDR via $RIG_PEER_ADDR dev eth0",
            T,
        )
        .expect("link down");
    // While it is down, diag (sysfs) shows node 1's port DOWN.
    std::thread::sleep(Duration::from_secs(3));
    let devices = diag_devices(&rig, 1);
    let state = devices[0]["ports"][0]["state"]["name"].clone();
    let (c_line, c_end) = clean_end(&rig, client, "client (node1)");
    let (s_line, s_end) = clean_end(&rig, server, "server (node2)");
    outage
        .wait()
        .expect("outage job")
        .expect_ok("link down and up");
    eprintln!("underlay down at {down_at:.2}: client {c_line}\n  server {s_line}");
    eprintln!(
        "underlay down: client pod's connection ended {:.1} s after, server pod's {:.1} s after (dead_after 10 s)",
        c_end - down_at,
        s_end - down_at
    );
    assert_eq!(state, "DOWN", "diag during the outage: {devices}");

    // Both daemons counted the failed RDMA link (metrics:
    // flowlane_rdma_errors_total{kind="link_failed"}).
    within(
        Duration::from_secs(30),
        "link failures counted",
        &rig,
        || link_failures(&rig, 1) > failed_before.0 && link_failures(&rig, 2) > failed_before.1,
    );
    let metrics = rig.run_ok(1, "curl -s 127.0.0.1:9464/metrics", T).stdout;
    let line = metrics
        .lines()
        .find(|l| l.starts_with("flowlane_rdma_errors_total") && l.contains("link_failed"))
        .unwrap_or_else(|| panic!("no link_failed in the metrics:\n{metrics}"));
    eprintln!("node1 metrics: {line}");

    // The link is back: node 1's view has its lane again, and new
    // connections ride RDMA again.
    within(Duration::from_secs(30), "node1's lane back", &rig, || {
        daemon_lane_view(&rig, 1)["lane"].is_object()
    });
    let back = Instant::now();
    let tries = until_rdma_carries(&rig, "ldcli", "ldsrv", &srv_ip, &mut port, 6);
    eprintln!(
        "after the underlay came back: connection {tries:?} was carried over RDMA ({:.1?})",
        back.elapsed()
    );
    assert!(
        tries.is_some(),
        "no connection used the RDMA lane again\n{}",
        logs(&rig)
    );
    let _ = rig.del_pod(1, "ldcli");
    let _ = rig.del_pod(2, "ldsrv");
}

/// Node 1's RDMA device is removed (`rdma link delete rxe0`) under a
/// carried stream while the TCP underlay stays up: both pods see their
/// connection end cleanly with intact bytes, and the daemon's view and diag
/// say the device is being removed. rxe cannot revoke open contexts, so
/// the kernel finishes the removal only once the daemon has released the
/// device, which it does when its view drops the lane. New connections stay
/// on TCP (a fallback counted with its reason) until the device is added
/// back (`rdma link add`), then use the RDMA lane again, without a restart.
#[test]
fn rdma_device_removed_under_a_stream_ends_it_cleanly_and_the_lane_comes_back() {
    let _turn = crate::turn::take(module_path!());
    let Some(rig) = rdma_rig::shared() else {
        return;
    };
    let rig = rig.lock();
    nodes_up(&rig);
    rig.add_pod(1, "lrcli").expect("client pod on node1");
    let srv_ip = rig
        .add_pod(2, "lrsrv")
        .expect("server pod on node2")
        .to_string();
    let mut port = 7900;
    until_rdma_carries(&rig, "lrcli", "lrsrv", &srv_ip, &mut port, 5)
        .expect("the RDMA lane carries a connection before the failure");

    let (server, client) = carried_stream(&rig, "lrcli", "lrsrv", &srv_ip, &mut port);
    let removed_at = epoch_now(&rig, 1);
    // In the background: it blocks in the kernel for as long as a process
    // holds the device open.
    rig.run_ok(
        1,
        "setsid rdma link delete rxe0 </dev/null >/dev/null 2>&1 & echo $! > /run/rdma-delete.pid",
        T,
    );
    let (c_line, c_end) = clean_end(&rig, client, "client (node1)");
    let (s_line, s_end) = clean_end(&rig, server, "server (node2)");
    eprintln!("rxe0 removed at {removed_at:.2}: client {c_line}\n  server {s_line}");
    eprintln!(
        "device removed: client pod's connection ended {:.1} s after, server pod's {:.1} s after",
        c_end - removed_at,
        s_end - removed_at
    );

    // The daemon's view drops the lane (it polls the verbs nodes), with the reason.
    let took = within(
        Duration::from_secs(30),
        "node1's view drops the lane",
        &rig,
        || {
            let v = daemon_lane_view(&rig, 1);
            v["lane"].is_null()
                && v["noLane"]
                    .as_str()
                    .is_some_and(|r| r.contains("being removed") || r.contains("no RDMA devices"))
        },
    );
    eprintln!(
        "node1's view: {} ({:.1?} after the removal was seen)",
        daemon_lane_view(&rig, 1)["noLane"],
        took
    );
    let devices = diag_devices(&rig, 1);
    assert!(
        devices.as_array().is_some_and(|d| d.is_empty()) || devices[0]["removing"] == true,
        "diag shows the device gone or being removed: {devices}"
    );

    // The daemon closes the device (its transport follows the lane), so the
    // kernel finishes the removal.
    let took = within(
        Duration::from_secs(60),
        "the removal of rxe0 finishes",
        &rig,
        || {
            rig.run_ok(1, "ls /sys/class/infiniband", T)
                .stdout
                .trim()
                .is_empty()
        },
    );
    eprintln!("rxe0 removal finished {took:.1?} later (the daemon released the device)");
    // A new connection while node 1 has no lane stays on plain TCP, intact,
    // counted as a fallback with its reason.
    let fallbacks_before = stats(&rig, 1).fallbacks;
    port += 1;
    assert!(
        !echo_used_rdma(&rig, "lrcli", "lrsrv", &srv_ip, port),
        "no RDMA device on node1, yet a connection was carried over RDMA"
    );
    let fallbacks = stats(&rig, 1).fallbacks;
    let counted: Vec<_> = fallbacks
        .iter()
        .filter(|(k, v)| **v > fallbacks_before.get(*k).copied().unwrap_or(0))
        .collect();
    eprintln!(
        "node1 without rxe0 ({}): the new connection stayed on TCP, fallbacks {counted:?}",
        daemon_lane_view(&rig, 1)["noLane"]
    );
    assert!(
        !counted.is_empty(),
        "a fallback reason is counted: {fallbacks:?}"
    );

    // The device comes back: the daemon's view has the lane within its
    // poll, the transport re-opens it, and new connections use the lane
    // again, with no daemon restart.
    let readded = Instant::now();
    rig.run_ok(1, "rdma link add rxe0 type rxe netdev eth0", T);
    within(Duration::from_secs(30), "node1's lane back", &rig, || {
        daemon_lane_view(&rig, 1)["lane"].is_object()
    });
    eprintln!(
        "rxe0 re-added: node1's view has its lane after {:.1?}",
        readded.elapsed()
    );
    let tries = until_rdma_carries(&rig, "lrcli", "lrsrv", &srv_ip, &mut port, 6);
    eprintln!(
        "after rxe0 came back: connection {tries:?} was carried over RDMA ({:.1?} after the re-add)",
        readded.elapsed()
    );
    assert!(
        tries.is_some(),
        "no connection used the RDMA lane again\n{}",
        logs(&rig)
    );
    let _ = rig.del_pod(1, "lrcli");
    let _ = rig.del_pod(2, "lrsrv");
}
