//! Cross-node pod routing and masquerade by `flowlaned` (docs/daemon.md
//! "Pod routes"), with real namespaces, the real plugin and real daemons:
//!
//! - nodes 1 and 2 share an underlay bridge (host-gw between them); node 3
//!   sits on another underlay subnet behind a router namespace (VXLAN to
//!   it); every node runs `flowlaned --nodes-file` (the file starts with
//!   nodes 1 and 2; node 3 is added later, node 2 removed later);
//! - one pod per node, wired by the plugin with `ipMasq: true`;
//! - no route is added by the test: pods reach each other across nodes
//!   only through the daemons' routes, the server sees the client pod's own
//!   address (no NAT), traffic to an address outside the cluster is still
//!   masqueraded, a foreign route survives every reconcile, a table that
//!   does not list the node changes nothing there, routes stay
//!   when a daemon stops, and `flowlaned --remove-pod-routes` leaves none
//!   of flowlane's routes, device or exemptions behind.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use flowlane_e2e::binaries::workspace_artifact;
use flowlane_e2e::daemon;
use flowlane_e2e::fsutil::TempDir;
use flowlane_e2e::netns::Netns;
use flowlane_e2e::process::{self, ChildGuard};
use flowlane_e2e::wait;
use serde_json::json;

const ROUTES: Duration = Duration::from_secs(20);
const PORT: u16 = 7311;

fn name(tag: &str) -> String {
    format!("rt{:04x}{tag}", std::process::id() & 0xffff)
}

/// A veth pair from `a` (named `an`) to `b` (named `bn`).
fn veth(a: &Netns, an: &str, b: &Netns, bn: &str) {
    a.ip(&[
        "link",
        "add",
        an,
        "type",
        "veth",
        "peer",
        "name",
        bn,
        "netns",
        b.name(),
    ])
    .expect_ok("veth");
    a.ip(&["link", "set", an, "up"]).expect_ok("up");
    b.ip(&["link", "set", bn, "up"]).expect_ok("up");
}

struct Node {
    name: String,
    ns: Netns,
    underlay: Ipv4Addr,
    cidr: String,
    dir: TempDir,
    daemon: Option<ChildGuard>,
}

impl Node {
    fn start_daemon(&mut self, nodes_file: &Path) {
        let (state, socket) = (self.dir.join("state"), self.dir.join("flowlaned.sock"));
        let mut cmd = daemon::command(Some(self.ns.name()), &state, &socket);
        cmd.arg("--nodes-file")
            .arg(nodes_file)
            .args(["--node-name", &self.name, "--nodes-refresh", "0.5"])
            .args(["--log-level", "info,flowlaned=debug"]);
        self.daemon = Some(daemon::spawn(cmd, &self.dir.join("flowlaned.log")));
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("flowlaned.log")).unwrap_or_default()
    }

    /// The node's routes of protocol 122 (flowlane's), as `dst via`.
    fn own_routes(&self) -> Vec<String> {
        let out = self
            .ns
            .ip(&["-4", "route", "show", "proto", "122"])
            .expect_ok("ip route");
        out.stdout.lines().map(|l| l.trim().to_string()).collect()
    }

    fn has_route_to(&self, cidr: &str) -> bool {
        self.own_routes().iter().any(|r| r.starts_with(cidr))
    }

    /// Wires a pod with the real plugin; returns its netns and address.
    fn add_pod(&self, tag: &str) -> (Netns, Ipv4Addr) {
        let pod = Netns::named(&name(tag));
        let conf = json!({
            "cniVersion": "1.0.0",
            "name": "rtnet",
            "type": "flowlane",
            "bridge": "rtbr",
            "isGateway": true,
            "isDefaultGateway": true,
            "ipMasq": true,
            // Exempted by the plugin at ADD (a range no node has: the daemon's
            // own exemptions are what the no-NAT checks below rely on).
            "clusterCIDRs": ["10.231.250.0/24"],
            "stateDir": self.dir.join("state").display().to_string(),
            "daemonSocket": self.dir.join("flowlaned.sock").display().to_string(),
            "ipam": {
                "type": "flowlane",
                "ranges": [[{ "subnet": self.cidr }]],
                "dataDir": self.dir.join("ipam").display().to_string(),
            },
        });
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", self.ns.name()])
            .arg(workspace_artifact("flowlane"))
            .env("CNI_COMMAND", "ADD")
            .env("CNI_CONTAINERID", format!("rt-{tag}-0123456789"))
            .env("CNI_NETNS", pod.path_str())
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", "/nonexistent");
        let out = process::run_with_input(&mut cmd, conf.to_string().as_bytes(), ROUTES)
            .expect("run plugin")
            .expect_ok("plugin ADD");
        let res: serde_json::Value = serde_json::from_str(&out.stdout).expect("ADD result");
        let ip = res["ips"][0]["address"]
            .as_str()
            .and_then(|a| a.split('/').next())
            .and_then(|a| a.parse().ok())
            .expect("pod address");
        (pod, ip)
    }
}

/// A TCP server in `ns` that answers each connection with the peer's address.
fn serve_peer_address(ns: &Netns, addr: Ipv4Addr) {
    let l = ns.run(move || TcpListener::bind(SocketAddr::from((addr, PORT))).expect("bind"));
    std::thread::spawn(move || {
        for mut s in l.incoming().flatten() {
            let peer = s
                .peer_addr()
                .map(|p| p.ip().to_string())
                .unwrap_or_default();
            let _ = s.write_all(peer.as_bytes());
        }
    });
}

/// Connects from `ns` to `dst`; the address the server saw, or the error.
fn seen_by_server(ns: &Netns, dst: Ipv4Addr) -> Result<String, String> {
    ns.run(move || {
        let mut s =
            TcpStream::connect_timeout(&SocketAddr::from((dst, PORT)), Duration::from_secs(2))
                .map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(3)))
            .map_err(|e| e.to_string())?;
        let mut out = String::new();
        s.read_to_string(&mut out).map_err(|e| e.to_string())?;
        Ok(out)
    })
}

/// Waits until `a` routes `to_b` and `b` routes `to_a` (flowlane's routes).
fn await_routes(a: &Node, to_b: &str, b: &Node, to_a: &str, what: &str) {
    assert!(
        wait::until(ROUTES, || a.has_route_to(to_b) && b.has_route_to(to_a)),
        "no {what} routes: {} {:?}, {} {:?}\n{}",
        a.name,
        a.own_routes(),
        b.name,
        b.own_routes(),
        a.log()
    );
}

/// `from` reaches `to`'s server, which sees `from`'s own address.
fn assert_no_nat(from: &(Netns, Ipv4Addr), to: &(Netns, Ipv4Addr), what: &str) {
    assert_eq!(
        seen_by_server(&from.0, to.1),
        Ok(from.1.to_string()),
        "{what}"
    );
}

/// The route the test made itself is still there, untouched.
fn assert_foreign_route(node: &Node, when: &str) {
    let out = node
        .ns
        .ip(&["route", "show", "10.231.77.0/24"])
        .expect_ok("ip route");
    assert!(
        out.stdout.contains("via 10.236.1.2"),
        "{when}: the foreign route was touched"
    );
}

fn write_table(path: &Path, nodes: &[&Node]) {
    let nodes: Vec<_> = nodes
        .iter()
        .map(
            |n| json!({ "name": n.name, "podCIDRs": [n.cidr], "underlay": n.underlay.to_string() }),
        )
        .collect();
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, json!({ "nodes": nodes }).to_string()).expect("write table");
    std::fs::rename(tmp, path).expect("rename table");
}

fn sysctl_forward(ns: &Netns) {
    ns.exec(&["sysctl", "-qw", "net.ipv4.ip_forward=1"])
        .expect_ok("ip_forward");
}

#[test]
fn daemons_route_pods_across_nodes_and_masquerade_only_what_leaves_the_cluster() {
    let _turn = crate::turn::take(module_path!());
    let t0 = std::time::Instant::now();
    let dir = TempDir::new("rtpodroutes");
    let table = dir.join("nodes.json");
    // The underlay: a bridge in a switch namespace; a router to node 3's subnet.
    let sw = Netns::named(&name("sw"));
    sw.ip(&["link", "add", "rtul", "type", "bridge"])
        .expect_ok("bridge");
    sw.ip(&["link", "set", "rtul", "up"]).expect_ok("up");
    let router = Netns::named(&name("r"));
    sysctl_forward(&router);
    veth(&router, "rtr0", &sw, "rtsr");
    sw.ip(&["link", "set", "rtsr", "master", "rtul"])
        .expect_ok("port");
    router
        .ip(&["addr", "add", "10.236.1.254/24", "dev", "rtr0"])
        .expect_ok("addr");
    // An address outside the cluster, served by the router.
    router
        .ip(&["addr", "add", "10.236.200.1/32", "dev", "lo"])
        .expect_ok("addr");

    let mut nodes: Vec<Node> = Vec::new();
    for (i, (underlay, gw)) in [
        ("10.236.1.1", "10.236.1.254"),
        ("10.236.1.2", "10.236.1.254"),
        ("10.236.2.3", "10.236.2.254"),
    ]
    .into_iter()
    .enumerate()
    {
        let n = i + 1;
        let ns = Netns::named(&name(&format!("n{n}")));
        sysctl_forward(&ns);
        if n < 3 {
            veth(&ns, "rtu0", &sw, &format!("rts{n}"));
            sw.ip(&["link", "set", &format!("rts{n}"), "master", "rtul"])
                .expect_ok("port");
        } else {
            veth(&ns, "rtu0", &router, "rtr3");
            router
                .ip(&["addr", "add", "10.236.2.254/24", "dev", "rtr3"])
                .expect_ok("addr");
        }
        ns.ip(&["addr", "add", &format!("{underlay}/24"), "dev", "rtu0"])
            .expect_ok("addr");
        ns.ip(&["route", "add", "default", "via", gw])
            .expect_ok("default route");
        nodes.push(Node {
            name: format!("node{n}"),
            ns,
            underlay: underlay.parse().unwrap(),
            cidr: format!("10.231.{n}.0/24"),
            dir: TempDir::new(&format!("rtnode{n}")),
            daemon: None,
        });
    }
    write_table(&table, &[&nodes[0], &nodes[1]]);
    for n in nodes.iter_mut() {
        n.start_daemon(&table);
    }
    let pods: Vec<(Netns, Ipv4Addr)> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| n.add_pod(&format!("p{}", i + 1)))
        .collect();
    for (ns, ip) in &pods {
        serve_peer_address(ns, *ip);
    }
    serve_peer_address(&router, "10.236.200.1".parse().unwrap());
    // A route flowlaned did not make, to a prefix it does not plan.
    nodes[0]
        .ns
        .ip(&["route", "add", "10.231.77.0/24", "via", "10.236.1.2"])
        .expect_ok("foreign route");

    // 1. host-gw between nodes 1 and 2; no NAT between pods.
    await_routes(
        &nodes[0],
        "10.231.2.0/24",
        &nodes[1],
        "10.231.1.0/24",
        "host-gw",
    );
    assert!(nodes[0]
        .own_routes()
        .iter()
        .any(|r| r.contains("via 10.236.1.2")));
    assert_no_nat(&pods[0], &pods[1], "pod1 -> pod2");
    assert_no_nat(&pods[1], &pods[0], "pod2 -> pod1");
    // Rounds with nothing changed leave the routes alone (the kernel lists a
    // host-gw route with the device it resolved; a planned route has none).
    std::thread::sleep(Duration::from_secs(2)); // four refresh rounds
    for n in &nodes[..2] {
        let log = n.log();
        assert!(
            !log.contains("pod route removed"),
            "{}: an unchanged table re-made routes:\n{log}",
            n.name
        );
    }
    let rules = nodes[0]
        .ns
        .exec(&["nft", "list", "table", "ip", "flowlane"])
        .expect_ok("nft");
    for c in [
        "node 10.231.1.0/24",
        "node 10.231.2.0/24",
        "conf 10.231.250.0/24",
    ] {
        assert!(
            rules.stdout.contains(&format!("flowlane cluster {c}")),
            "{c}: {}",
            rules.stdout
        );
    }
    // 2. Leaving the cluster: masqueraded to the node's underlay address.
    assert_eq!(
        seen_by_server(&pods[0].0, "10.236.200.1".parse().unwrap()),
        Ok("10.236.1.1".to_string()),
        "out of the cluster is masqueraded"
    );
    // Node 3 is not in the table yet: nothing routes to it.
    assert!(
        seen_by_server(&pods[0].0, pods[2].1).is_err(),
        "node3 reachable before it is listed"
    );

    // 3. Node 3 joins (another underlay subnet: VXLAN).
    write_table(&table, &[&nodes[0], &nodes[1], &nodes[2]]);
    await_routes(
        &nodes[0],
        "10.231.3.0/24",
        &nodes[2],
        "10.231.1.0/24",
        "vxlan",
    );
    assert!(
        nodes[0].ns.link("flowlane.1").is_some(),
        "no VXLAN device on node1"
    );
    assert!(nodes[0]
        .own_routes()
        .iter()
        .any(|r| r.starts_with("10.231.3.0/24") && r.contains("dev flowlane.1")));
    assert!(
        nodes[0]
            .own_routes()
            .iter()
            .any(|r| r.starts_with("10.231.2.0/24") && r.contains("via 10.236.1.2")),
        "auto keeps host-gw on the shared link"
    );
    assert_no_nat(&pods[0], &pods[2], "pod1 -> pod3 over vxlan");
    assert_no_nat(&pods[2], &pods[1], "pod3 -> pod2 over vxlan");

    // 4. Node 2 leaves: its routes go, the others stay.
    write_table(&table, &[&nodes[0], &nodes[2]]);
    assert!(
        wait::until(ROUTES, || !nodes[0].has_route_to("10.231.2.0/24")
            && !nodes[2].has_route_to("10.231.2.0/24")),
        "a removed node's routes stay: {:?}",
        nodes[0].own_routes()
    );
    assert!(nodes[0].has_route_to("10.231.3.0/24"));
    assert_foreign_route(&nodes[0], "the foreign route was touched");

    // A table that does not list this node (being rewritten) cuts nothing.
    write_table(&table, &[&nodes[2]]);
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        nodes[0].has_route_to("10.231.3.0/24"),
        "a table without this node removed its routes"
    );
    write_table(&table, &[&nodes[0], &nodes[2]]);
    await_routes(
        &nodes[0],
        "10.231.3.0/24",
        &nodes[2],
        "10.231.1.0/24",
        "vxlan",
    );

    // 5. A daemon stopping leaves its routes (pods keep connectivity).
    if let Some(mut d) = nodes[0].daemon.take() {
        d.terminate(Duration::from_secs(5));
    }
    assert!(
        nodes[0].has_route_to("10.231.3.0/24"),
        "routes went with the daemon"
    );
    assert_no_nat(
        &pods[0],
        &pods[2],
        "pod1 -> pod3 with node1's daemon stopped",
    );

    // 6. Uninstall: nothing of flowlane's is left, the foreign route stays.
    let out = nodes[0]
        .ns
        .exec(&[
            &workspace_artifact("flowlaned").display().to_string(),
            "--remove-pod-routes",
        ])
        .expect_ok("flowlaned --remove-pod-routes");
    assert!(out.stdout.contains("removed"), "{}", out.stdout);
    assert!(
        nodes[0].own_routes().is_empty(),
        "{:?}",
        nodes[0].own_routes()
    );
    assert!(
        nodes[0].ns.link("flowlane.1").is_none(),
        "the VXLAN device stays"
    );
    let rules = nodes[0]
        .ns
        .exec(&["nft", "list", "ruleset"])
        .expect_ok("nft");
    assert!(
        !rules.stdout.contains("flowlane cluster"),
        "{}",
        rules.stdout
    );
    assert!(
        rules.stdout.contains("masquerade"),
        "the plugin's pod rule went too"
    );
    assert_foreign_route(&nodes[0], "uninstall removed a foreign route");
    eprintln!("pod_routes: {:?}", t0.elapsed());
}
