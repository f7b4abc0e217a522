//! Harness for the Service IP tests (`shm::service_ips`): nodes as network
//! namespaces (a bridge, pods wired by the real plugin, `flowlaned` with
//! `--service-cidr`, `br_netfilter` on as kube-proxy needs it), joined by
//! an underlay veth with host-gw routes when there are two, and kube-proxy's
//! DNAT rules for a set of Services, reproduced in either of its modes:
//!
//! - iptables mode ([`iptables_rules`]): `iptables-restore` input with
//!   kube-proxy's chains (KUBE-SERVICES, KUBE-SVC-*, KUBE-SEP-* with
//!   `statistic --mode random`, KUBE-MARK-MASQ, KUBE-POSTROUTING), loaded by
//!   iptables-nft as kube-proxy loads it;
//! - nftables mode ([`nftables_rules`]): kube-proxy's nftables transaction
//!   (the `service-ips` verdict map, `service-*` chains choosing an
//!   `endpoint-*` chain with `numgen random mod N vmap`, `dnat to`), in a
//!   table named `svc-kube-proxy` instead of `kube-proxy` (this suite's
//!   name prefix; the table's name changes nothing else).
//!
//! Two nodes may also run the cross-node relay ([`SvcCluster::with_lanes`]:
//! `--lane-transport tcp-test` over the underlay, as `relay_lane` does).
//!
//! Names start with `svc`; pods and underlay in 10.212.0.0/16, ClusterIPs
//! in 10.96.212.0/24 (inside the node namespaces only). Everything is
//! removed on drop, also when a test panics.

use crate::node_ns::{DaemonOpts, NsNode, LANE_PORT};
use crate::ns_cluster::{Layout, NsCluster};
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::{Command, Stdio};

/// The Service CIDR the daemons serve (`--service-cidr`).
pub const SERVICE_CIDR: &str = "10.96.212.0/24";
/// Every pod of the test clusters (kube-proxy's `--cluster-cidr`).
pub const CLUSTER_CIDR: &str = "10.212.0.0/16";

/// How kube-proxy programs the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyMode {
    Iptables,
    Nftables,
}

/// One Service port and its endpoints (TCP).
#[derive(Debug, Clone)]
pub struct Service {
    /// `namespace/name:port`, as kube-proxy names a service port.
    pub name: String,
    pub cluster_ip: Ipv4Addr,
    pub port: u16,
    pub endpoints: Vec<SocketAddrV4>,
}

/// Sixteen characters of base32 (kube-proxy names its chains with the
/// first 16 of a hash of the service port's name).
fn chain_hash(s: &str) -> String {
    const ALPHA: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut out = String::new();
    for round in 0..16u64 {
        for b in s.bytes().chain(round.to_le_bytes()) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x100_0000_01b3);
        }
        out.push(ALPHA[(h >> 59) as usize] as char);
    }
    out
}

/// kube-proxy's iptables-mode NAT rules for `services` (iptables-restore).
pub fn iptables_rules(services: &[Service]) -> String {
    let mut chains = vec![
        ":PREROUTING ACCEPT [0:0]".to_string(),
        ":OUTPUT ACCEPT [0:0]".into(),
        ":POSTROUTING ACCEPT [0:0]".into(),
        ":KUBE-SERVICES - [0:0]".into(),
        ":KUBE-POSTROUTING - [0:0]".into(),
        ":KUBE-MARK-MASQ - [0:0]".into(),
    ];
    let mut rules = vec![
        "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES".to_string(),
        "-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES".into(),
        "-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING".into(),
        "-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000".into(),
        "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN".into(),
        "-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0".into(),
        "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully".into(),
    ];
    for s in services {
        let svc = format!("KUBE-SVC-{}", chain_hash(&format!("{}tcp", s.name)));
        let (ip, port, name) = (s.cluster_ip, s.port, &s.name);
        chains.push(format!(":{svc} - [0:0]"));
        rules.push(format!(
            "-A KUBE-SERVICES -d {ip}/32 -p tcp -m comment --comment \"{name} cluster IP\" -m tcp --dport {port} -j {svc}"
        ));
        rules.push(format!(
            "-A {svc} ! -s {CLUSTER_CIDR} -d {ip}/32 -p tcp -m comment --comment \"{name} cluster IP\" -m tcp --dport {port} -j KUBE-MARK-MASQ"
        ));
        let n = s.endpoints.len();
        for (i, ep) in s.endpoints.iter().enumerate() {
            let sep = format!("KUBE-SEP-{}", chain_hash(&format!("{name}tcp{ep}")));
            chains.push(format!(":{sep} - [0:0]"));
            // Endpoint i of n is taken with probability 1/(n-i) among the
            // ones left: each with 1/n.
            let pick = if i + 1 < n {
                format!(
                    " -m statistic --mode random --probability {:.11}",
                    1.0 / (n - i) as f64
                )
            } else {
                String::new()
            };
            rules.push(format!(
                "-A {svc} -m comment --comment \"{name} -> {ep}\"{pick} -j {sep}"
            ));
            rules.push(format!(
                "-A {sep} -s {}/32 -m comment --comment \"{name}\" -j KUBE-MARK-MASQ",
                ep.ip()
            ));
            rules.push(format!(
                "-A {sep} -p tcp -m comment --comment \"{name}\" -m tcp -j DNAT --to-destination {ep}"
            ));
        }
    }
    format!(
        "*nat\n{}\n{}\nCOMMIT\n",
        chains.join("\n"),
        rules.join("\n")
    )
}

/// kube-proxy's nftables-mode transaction for `services` (nft -f).
pub fn nftables_rules(services: &[Service]) -> String {
    const T: &str = "ip svc-kube-proxy";
    let mut chains = vec![
        format!("add table {T} {{ comment \"rules for kube-proxy\" ; }}"),
        format!("add chain {T} mark-for-masquerade"),
        format!("add chain {T} masquerading"),
        format!("add chain {T} services"),
        format!("add chain {T} nat-prerouting {{ type nat hook prerouting priority -100 ; }}"),
        format!("add chain {T} nat-output {{ type nat hook output priority -100 ; }}"),
        format!("add chain {T} nat-postrouting {{ type nat hook postrouting priority 100 ; }}"),
        format!("add map {T} service-ips {{ type ipv4_addr . inet_proto . inet_service : verdict ; comment \"ClusterIP, ExternalIP and LoadBalancer IP traffic\" ; }}"),
    ];
    let mut rules = vec![
        format!("add rule {T} mark-for-masquerade mark set mark or 0x4000"),
        format!("add rule {T} masquerading mark and 0x4000 == 0 return"),
        format!("add rule {T} masquerading mark set mark xor 0x4000"),
        format!("add rule {T} masquerading masquerade fully-random"),
        format!("add rule {T} nat-prerouting jump services"),
        format!("add rule {T} nat-output jump services"),
        format!("add rule {T} nat-postrouting jump masquerading"),
        format!("add rule {T} services ip daddr . meta l4proto . th dport vmap @service-ips"),
    ];
    let mut elements = Vec::new();
    for s in services {
        // ns/name:port -> ns/name/tcp/port, as kube-proxy names chains.
        let (svc_name, port_name) = s.name.split_once(':').unwrap_or((&s.name, "p"));
        let port_name = format!("{svc_name}/tcp/{port_name}");
        let svc = format!("service-{}-{port_name}", &chain_hash(&port_name)[..8]);
        let (ip, port) = (s.cluster_ip, s.port);
        chains.push(format!("add chain {T} {svc}"));
        rules.push(format!(
            "add rule {T} {svc} ip daddr {ip} tcp dport {port} ip saddr != {CLUSTER_CIDR} jump mark-for-masquerade"
        ));
        let mut picks = Vec::new();
        for (i, ep) in s.endpoints.iter().enumerate() {
            let epc = format!(
                "endpoint-{}-{port_name}__{}/{}",
                &chain_hash(&format!("{port_name}{ep}"))[..8],
                ep.ip(),
                ep.port()
            );
            chains.push(format!("add chain {T} {epc}"));
            rules.push(format!(
                "add rule {T} {epc} ip saddr {} jump mark-for-masquerade",
                ep.ip()
            ));
            rules.push(format!("add rule {T} {epc} meta l4proto tcp dnat to {ep}"));
            picks.push(format!("{i} : goto {epc}"));
        }
        rules.push(format!(
            "add rule {T} {svc} numgen random mod {} vmap {{ {} }}",
            picks.len(),
            picks.join(" , ")
        ));
        elements.push(format!(
            "add element {T} service-ips {{ {ip} . tcp . {port} : goto {svc} }}"
        ));
    }
    let mut all = chains;
    all.extend(rules);
    all.extend(elements);
    all.join("\n") + "\n"
}

const LANE_KEY: &[u8] = b"services: the test cluster's lane key, 32+ bytes\n";

/// One node of a [`SvcCluster`].
pub type SvcNode = NsNode;

impl NsNode {
    /// Programs kube-proxy's rules for `services` in this node's namespace.
    pub fn kube_proxy(&self, mode: ProxyMode, services: &[Service]) {
        let (prog, args, input): (&str, &[&str], String) = match mode {
            ProxyMode::Iptables => ("iptables-restore", &[], iptables_rules(services)),
            ProxyMode::Nftables => ("nft", &["-f", "-"], nftables_rules(services)),
        };
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.netns, prog])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{prog}: {e}"));
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{prog} in {}: {}\n{input}",
            self.netns,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// One or two nodes, each with its pods and its daemon (`nodes`, ... of
/// the [`NsCluster`] it derefs to).
pub struct SvcCluster(NsCluster);

impl std::ops::Deref for SvcCluster {
    type Target = NsCluster;
    fn deref(&self) -> &NsCluster {
        &self.0
    }
}

impl SvcCluster {
    pub fn new(nodes: usize, pods: usize) -> SvcCluster {
        SvcCluster::build(nodes, pods, false)
    }

    /// Two nodes whose daemons also run the cross-node relay
    /// (`--lane-transport tcp-test` between their underlay addresses).
    pub fn with_lanes(pods: usize) -> SvcCluster {
        SvcCluster::build(2, pods, true)
    }

    fn build(nodes: usize, pods: usize, lanes: bool) -> SvcCluster {
        let layout = Layout::new("svc", "services", "SVC_KEEP")
            .addresses((212, 0), (212, 100), 50)
            // kube-proxy needs it: a backend's reply to a client on the
            // same bridge is bridged, and must still be un-DNATed.
            .sysctl("net.bridge.bridge-nf-call-iptables=1")
            // A pod may reach itself through its Service (kube-proxy
            // masquerades that hairpin), as kubelet's bridge does.
            .cni_key("hairpinMode", true.into());
        let mut c = NsCluster::new(&layout, nodes as u8);
        let nodes_file = lanes.then(|| c.write_nodes_file(|_| Some(LANE_PORT)));
        for node in &mut c.nodes {
            for _ in 0..pods {
                node.add_pod();
            }
            let mut opts = DaemonOpts::new("debug").service_cidr(SERVICE_CIDR);
            if let Some(file) = &nodes_file {
                opts = opts.lanes(file.clone(), LANE_KEY);
            }
            node.start_daemon(opts);
        }
        SvcCluster(c)
    }

    /// The daemons' logs (for failure messages).
    pub fn logs(&self) -> String {
        self.0.logs(6000)
    }
}

/// `service_echo_server.py PORT`: accepts connections until killed, one
/// thread each, echoing until EOF; prints `accepted IP PORT` per
/// connection (flushed), so a test can count where a Service sent them.
pub const SERVICE_ECHO_SERVER: &str = r#"
import socket, sys, threading
port = int(sys.argv[1])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', port)); s.listen(128)
def serve(c):
    while True:
        d = c.recv(1 << 20)
        if not d:
            break
        c.sendall(d)
    c.close()
while True:
    c, peer = s.accept()
    print("accepted", peer[0], peer[1], flush=True)
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;
