//! One or two [`NsNode`]s as a test cluster: a tag and an address slot of
//! their own (names from [`crate::names::cluster_tag`]), a directory, the
//! underlay (a veth between the two node namespaces, host-gw routes to
//! each other's pod CIDR) and the static node table the relay's daemons
//! share. Pods and daemons are the caller's: each suite starts them in its
//! own order with its own options.
//!
//! Why here: the Service, framework and relay suites built the same
//! cluster three times, differing only in names, address ranges and the
//! daemons' flags (their [`Layout`]).

use crate::fsutil::TempDir;
use crate::names;
use crate::node_ns::{self, DaemonOpts, NetConf, NsNode};
use crate::shm::sh;
use std::net::Ipv4Addr;
use std::path::PathBuf;

/// What tells one suite's clusters from another's: names, addresses, how
/// pods are wired.
pub struct Layout {
    prefix: &'static str,
    dir_suffix: &'static str,
    keep_env: &'static str,
    pods: (u8, u8),
    underlay: (u8, u8),
    slots: u32,
    sysctls: Vec<&'static str>,
    net: NetConf,
}

impl Layout {
    /// Names start with `prefix` (`svc`, `ff`, ...; the network is
    /// `<prefix>net` on the bridge `<prefix>br0`), the directory is
    /// `<tmp>/<tag>-<dir_suffix>` (kept when the variable `keep_env` is set,
    /// for a post-mortem); IP forwarding on in the node namespaces, pods
    /// wired by flowlane alone. Set the addresses with [`Layout::addresses`].
    pub fn new(prefix: &'static str, dir_suffix: &'static str, keep_env: &'static str) -> Layout {
        Layout {
            prefix,
            dir_suffix,
            keep_env,
            pods: (0, 0),
            underlay: (0, 0),
            slots: 1,
            sysctls: vec!["net.ipv4.ip_forward=1"],
            net: NetConf {
                name: format!("{prefix}net"),
                bridge: format!("{prefix}br0"),
                extra: serde_json::Map::new(),
                chained: false,
            },
        }
    }

    /// Node `i` of a cluster in address slot `s` (of `slots`) gets the pod
    /// CIDR `10.<pods.0>.<pods.1 + 2s + i>.0/24` and the underlay address
    /// `10.<underlay.0>.<underlay.1 + s>.<1 + i>`.
    pub fn addresses(mut self, pods: (u8, u8), underlay: (u8, u8), slots: u32) -> Layout {
        (self.pods, self.underlay, self.slots) = (pods, underlay, slots);
        self
    }

    /// One more sysctl (`name=value`) in every node namespace.
    pub fn sysctl(mut self, setting: &'static str) -> Layout {
        self.sysctls.push(setting);
        self
    }

    /// One more key of flowlane's network configuration.
    pub fn cni_key(mut self, key: &str, value: serde_json::Value) -> Layout {
        self.net.extra.insert(key.to_string(), value);
        self
    }

    /// Pods wired by the reference bridge + host-local, then flowlane in
    /// chained mode (the cluster's routes stand in for the other CNI's).
    pub fn chained(mut self) -> Layout {
        self.net.chained = true;
        self
    }
}

/// The nodes, their directory and the underlay link between them. Dropping
/// it removes the nodes (see [`NsNode`]), the link and the directory.
pub struct NsCluster {
    pub nodes: Vec<NsNode>,
    pub dir: PathBuf,
    link: String,
    /// Owns `dir`: removed after the nodes (fields drop after `drop`'s
    /// body), unless the layout's keep variable is set.
    _dir: TempDir,
}

impl NsCluster {
    /// `nodes` (1 or 2) fresh nodes `n0`, `n1` laid out by `l`, joined by
    /// the underlay when there are two; no pods, no daemons.
    pub fn new(l: &Layout, nodes: u8) -> NsCluster {
        assert!((1..=2).contains(&nodes));
        let (tag, n) = names::cluster_tag(l.prefix);
        let slot = ((std::process::id() + n * 7) % l.slots) as u8;
        let tmp = TempDir::fresh(&format!("{tag}-{}", l.dir_suffix), l.keep_env);
        let dir = tmp.path().to_path_buf();
        let mut c = NsCluster {
            nodes: Vec::new(),
            dir: dir.clone(),
            link: format!("{tag}u"),
            _dir: tmp,
        };
        for i in 0..nodes {
            let (p, u) = (l.pods, l.underlay);
            c.nodes.push(NsNode::new(
                format!("n{i}"),
                format!("{tag}n{i}"),
                format!("10.{}.{}.0/24", p.0, p.1 + 2 * slot + i),
                Ipv4Addr::new(10, u.0, u.1 + slot, 1 + i),
                dir.join(format!("n{i}")),
                l.net.clone(),
                &l.sysctls,
            ));
        }
        if let [a, b] = &c.nodes[..] {
            // The veth pair lives in the node namespaces: it goes with them.
            node_ns::join(&c.link, [a.underlay_end(), b.underlay_end()]);
        }
        c
    }

    /// `per_node` more pods on every node.
    pub fn add_pods(&mut self, per_node: usize) {
        for node in &mut self.nodes {
            for _ in 0..per_node {
                node.add_pod();
            }
        }
    }

    /// Starts every node's daemon, with the options `opts` gives it.
    pub fn start_daemons(&mut self, opts: impl Fn(&NsNode) -> DaemonOpts) {
        for node in &mut self.nodes {
            let o = opts(node);
            node.start_daemon(o);
        }
    }

    /// The static node table's path (`--nodes-file`).
    pub fn nodes_file(&self) -> PathBuf {
        self.dir.join("nodes.json")
    }

    /// Writes the node table (atomically: the daemons follow the file),
    /// every node with the lane port `lane_port` gives it (`None`: the node
    /// offers no lane); returns its path.
    pub fn write_nodes_file(&self, lane_port: impl Fn(&NsNode) -> Option<u16>) -> PathBuf {
        let nodes: Vec<_> = self
            .nodes
            .iter()
            .map(|n| {
                let mut v = serde_json::json!({
                    "name": n.name, "podCIDRs": [n.cidr], "underlay": n.underlay.to_string(),
                });
                if let Some(port) = lane_port(n) {
                    v["lanePort"] = port.into();
                }
                v
            })
            .collect();
        let tmp = self.dir.join("nodes.json.tmp");
        std::fs::write(&tmp, serde_json::json!({ "nodes": nodes }).to_string()).unwrap();
        std::fs::rename(&tmp, self.nodes_file()).unwrap();
        self.nodes_file()
    }

    /// Node n0, node n1, and the first pod of each.
    pub fn first_pods(&self) -> (&NsNode, &NsNode, &crate::shm::Pod, &crate::shm::Pod) {
        let (n0, n1) = (&self.nodes[0], &self.nodes[1]);
        (n0, n1, &n0.pods[0], &n1.pods[0])
    }

    /// The daemons' logs, the last `max` bytes of each (for failure
    /// messages).
    pub fn logs(&self, max: usize) -> String {
        self.nodes
            .iter()
            .map(|n| {
                let log = n.log();
                let last = tail(&log, max);
                format!("--- {} ({}) daemon log (tail) ---\n{last}", n.name, n.netns)
            })
            .collect()
    }
}

impl Drop for NsCluster {
    fn drop(&mut self) {
        self.nodes.clear();
        let _ = sh(&["ip", "link", "del", &format!("{}0", self.link)]);
    }
}

/// The last `n` bytes of `s` (on a character boundary).
fn tail(s: &str, n: usize) -> &str {
    let mut cut = s.len().saturating_sub(n);
    while !s.is_char_boundary(cut) {
        cut += 1;
    }
    &s[cut..]
}
