//! The cluster's node table: which node owns which pod CIDR, where its
//! daemon is reached (underlay address), and whether it has an RDMA lane.
//!
//! Two sources fill it: a static JSON file for the local cluster
//! ([`StaticNodeFile`]), and in Kubernetes `Node.spec.podCIDRs` plus what
//! each `flowlaned` publishes on its Node ([`node_object`] turns API
//! objects into entries, [`kubernetes::KubeNodeDirectory`] reads them with
//! kube-rs).
//!
//! ## Why the trait is synchronous
//!
//! `flowlaned` asks "which node owns this pod IP, and does it have an RDMA
//! lane?" on every intercepted `connect`, while the application waits. That
//! lookup must never wait on the network. So the trait hands out an
//! immutable snapshot ([`ClusterView`], behind an `Arc`) and lookups are
//! plain in-memory work. Keeping the snapshot fresh is the implementation's
//! own business: the static file is parsed again when its contents change; the
//! Kubernetes implementation re-lists the Nodes from a task on the daemon's
//! tokio runtime and swaps in a new `Arc<ClusterView>` (the same way
//! kube-rs's own `reflector::Store` is read: synchronously). An `async fn` here would force every caller, including
//! the blocking diag command, onto a runtime for no gain.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ipnetwork::IpNetwork;
use serde::{Deserialize, Serialize};

use flowlane_rdma_discovery::discovery::LinkLayer;
use flowlane_rdma_discovery::gid::SelectedGid;

#[cfg(feature = "kubernetes")]
pub mod kubernetes;
pub mod node_object;
pub mod view_file;

pub use view_file::{LocalRdma, NodeViewFile};

#[cfg(feature = "kubernetes")]
pub use kubernetes::KubeNodeDirectory;

/// One node of the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeEntry {
    pub name: String,
    /// `Node.spec.podCIDRs` (one per family).
    #[serde(rename = "podCIDRs")]
    pub pod_cidrs: Vec<IpNetwork>,
    /// Where the node's daemon and its pod CIDRs are reached.
    pub underlay: IpAddr,
    /// The node's RDMA lane, `None` when it has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma: Option<RdmaLane>,
    /// The port on `underlay` where the node's daemon accepts cross-node
    /// lane streams (`flowlaned --lane-listen`). `None` when it does not
    /// say (older tables and annotations): peers then have no lane to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lane_port: Option<u16>,
}

/// What a peer daemon needs to reach this node over RDMA.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RdmaLane {
    pub device: String,
    pub port: u32,
    pub gid_index: u32,
    pub gid: Ipv6Addr,
    pub link_layer: LinkLayer,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_mtu: Option<u32>,
}

impl From<&SelectedGid> for RdmaLane {
    fn from(g: &SelectedGid) -> Self {
        RdmaLane {
            device: g.device.clone(),
            port: g.port,
            gid_index: g.gid_index,
            gid: g.gid,
            link_layer: g.link_layer,
            active_mtu: g.active_mtu,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    #[error("node table {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("node table {path}: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("node table: {0}")]
    Invalid(String),
    #[error("node table from the Kubernetes API: {0}")]
    Kubernetes(String),
}

/// An immutable snapshot of the node table.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ClusterView {
    nodes: Vec<NodeEntry>,
}

impl ClusterView {
    /// Validates the table: unique node names, each CIDR owned by one node.
    /// Nested CIDRs of different nodes are allowed (longest prefix wins).
    pub fn new(nodes: Vec<NodeEntry>) -> Result<Self, TopologyError> {
        let mut names = BTreeSet::new();
        let mut cidrs = BTreeSet::new();
        for n in &nodes {
            if n.name.is_empty() {
                return Err(TopologyError::Invalid("a node has an empty name".into()));
            }
            if !names.insert(n.name.as_str()) {
                return Err(TopologyError::Invalid(format!(
                    "node {} is listed twice",
                    n.name
                )));
            }
            for c in &n.pod_cidrs {
                // Normalise to the network address so 10.0.1.5/24 and 10.0.1.0/24 clash.
                let key = (c.network(), c.prefix());
                if !cidrs.insert(key) {
                    return Err(TopologyError::Invalid(format!(
                        "pod CIDR {c} of node {} is owned by another node too",
                        n.name
                    )));
                }
            }
        }
        Ok(ClusterView { nodes })
    }

    pub fn nodes(&self) -> &[NodeEntry] {
        &self.nodes
    }

    pub fn node(&self, name: &str) -> Option<&NodeEntry> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// The node whose pod CIDR holds `ip` (longest prefix).
    pub fn owner_of(&self, ip: IpAddr) -> Option<&NodeEntry> {
        self.nodes
            .iter()
            .flat_map(|n| n.pod_cidrs.iter().map(move |c| (n, c)))
            .filter(|(_, c)| c.contains(ip))
            .max_by_key(|(_, c)| c.prefix())
            .map(|(n, _)| n)
    }

    /// True when both nodes exist and both have an RDMA lane of the same
    /// link layer (RoCE cannot talk to InfiniBand).
    pub fn rdma_between(&self, a: &str, b: &str) -> bool {
        match (
            self.node(a).and_then(|n| n.rdma.as_ref()),
            self.node(b).and_then(|n| n.rdma.as_ref()),
        ) {
            (Some(x), Some(y)) => x.link_layer == y.link_layer,
            _ => false,
        }
    }
}

/// Where the node table comes from.
pub trait NodeDirectory: Send + Sync {
    /// The current snapshot. Cheap: implementations keep it cached.
    fn view(&self) -> Result<Arc<ClusterView>, TopologyError>;
}

/// File format of the static node table.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct NodeFile {
    nodes: Vec<NodeEntry>,
}

/// The local cluster's node table: a JSON file
/// `{"nodes": [{"name", "podCIDRs", "underlay", "rdma"?, "lanePort"?}]}`, parsed again
/// when its contents change. Compared by content, not mtime: a rewrite within the
/// filesystem's timestamp tick keeps the mtime (and often the size), and the file is
/// small enough to read on every lookup.
pub struct StaticNodeFile {
    path: PathBuf,
    cache: Mutex<Option<(Vec<u8>, Arc<ClusterView>)>>,
}

impl StaticNodeFile {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        StaticNodeFile {
            path: path.into(),
            cache: Mutex::new(None),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes a node table atomically (for the cluster scripts and tests).
    pub fn write(path: &Path, nodes: &[NodeEntry]) -> Result<(), TopologyError> {
        let io = |source| TopologyError::Io {
            path: path.to_path_buf(),
            source,
        };
        let body = serde_json::to_vec_pretty(&NodeFile {
            nodes: nodes.to_vec(),
        })
        .expect("node table serialises");
        let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
        std::fs::write(&tmp, body).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io(e)
        })
    }

    fn parse(&self, bytes: &[u8]) -> Result<ClusterView, TopologyError> {
        let file: NodeFile =
            serde_json::from_slice(bytes).map_err(|source| TopologyError::Parse {
                path: self.path.clone(),
                source,
            })?;
        ClusterView::new(file.nodes)
    }
}

impl NodeDirectory for StaticNodeFile {
    fn view(&self) -> Result<Arc<ClusterView>, TopologyError> {
        let bytes = std::fs::read(&self.path).map_err(|source| TopologyError::Io {
            path: self.path.clone(),
            source,
        })?;
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((seen, view)) = cache.as_ref() {
            if *seen == bytes {
                return Ok(view.clone());
            }
        }
        let view = Arc::new(self.parse(&bytes)?);
        *cache = Some((bytes, view.clone()));
        Ok(view)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, cidrs: &[&str], underlay: &str, rdma: Option<LinkLayer>) -> NodeEntry {
        NodeEntry {
            name: name.into(),
            pod_cidrs: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
            underlay: underlay.parse().unwrap(),
            rdma: rdma.map(|ll| RdmaLane {
                device: "rxe0".into(),
                port: 1,
                gid_index: 1,
                gid: "::ffff:192.0.2.1".parse().unwrap(),
                link_layer: ll,
                active_mtu: Some(1024),
            }),
            lane_port: None,
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn pod_ip_owner_is_the_longest_prefix() {
        let view = ClusterView::new(vec![
            node(
                "n1",
                &["10.204.0.0/16", "fd00:204::/48"],
                "192.168.204.1",
                Some(LinkLayer::Ethernet),
            ),
            node(
                "n2",
                &["10.204.2.0/24"],
                "192.168.204.2",
                Some(LinkLayer::Ethernet),
            ),
            node("n3", &["10.205.0.0/24"], "192.168.204.3", None),
        ])
        .unwrap();
        assert_eq!(view.owner_of(ip("10.204.2.7")).unwrap().name, "n2");
        assert_eq!(view.owner_of(ip("10.204.3.7")).unwrap().name, "n1");
        assert_eq!(view.owner_of(ip("fd00:204::9")).unwrap().name, "n1");
        assert_eq!(view.owner_of(ip("10.205.0.4")).unwrap().name, "n3");
        assert!(view.owner_of(ip("10.9.0.1")).is_none());
        assert!(view.rdma_between("n1", "n2"));
        assert!(!view.rdma_between("n1", "n3"), "n3 has no RDMA lane");
        assert!(!view.rdma_between("n1", "nope"));
    }

    #[test]
    fn roce_and_infiniband_nodes_have_no_lane_between_them() {
        let view = ClusterView::new(vec![
            node(
                "a",
                &["10.204.1.0/24"],
                "192.168.204.1",
                Some(LinkLayer::Ethernet),
            ),
            node(
                "b",
                &["10.204.2.0/24"],
                "192.168.204.2",
                Some(LinkLayer::InfiniBand),
            ),
        ])
        .unwrap();
        assert!(!view.rdma_between("a", "b"));
    }

    #[test]
    fn ambiguous_tables_are_rejected() {
        let dup = ClusterView::new(vec![
            node("a", &["10.204.1.0/24"], "192.168.204.1", None),
            node("a", &["10.204.2.0/24"], "192.168.204.2", None),
        ]);
        assert!(matches!(dup, Err(TopologyError::Invalid(m)) if m.contains("twice")));
        let same_cidr = ClusterView::new(vec![
            node("a", &["10.204.1.0/24"], "192.168.204.1", None),
            node("b", &["10.204.1.9/24"], "192.168.204.2", None),
        ]);
        assert!(matches!(same_cidr, Err(TopologyError::Invalid(m)) if m.contains("another node")));
    }

    #[test]
    fn static_file_is_read_and_reloaded_on_change() {
        let dir = std::env::temp_dir().join(format!("flowlane-topology-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("nodes.json");
        let file = StaticNodeFile::new(&path);
        assert!(
            matches!(file.view(), Err(TopologyError::Io { .. })),
            "missing file"
        );

        // The documented format, written by hand.
        std::fs::write(
            &path,
            r#"{"nodes": [
                {"name": "node1", "podCIDRs": ["10.204.1.0/24"], "underlay": "192.168.204.1",
                 "rdma": {"device": "rxe0", "port": 1, "gidIndex": 1, "gid": "::ffff:192.168.204.1",
                          "linkLayer": "Ethernet", "activeMtu": 1024},
                 "lanePort": 7471},
                {"name": "node2", "podCIDRs": ["10.204.2.0/24"], "underlay": "192.168.204.2"}
            ]}"#,
        )
        .unwrap();
        let v1 = file.view().unwrap();
        assert_eq!(v1.owner_of(ip("10.204.1.5")).unwrap().name, "node1");
        assert_eq!(
            v1.node("node1").unwrap().rdma.as_ref().unwrap().gid_index,
            1
        );
        assert!(v1.node("node2").unwrap().rdma.is_none());
        assert_eq!(v1.node("node1").unwrap().lane_port, Some(7471));
        assert_eq!(
            v1.node("node2").unwrap().lane_port,
            None,
            "a table without lanePort still reads"
        );
        assert!(
            Arc::ptr_eq(&v1, &file.view().unwrap()),
            "unchanged file: cached snapshot"
        );

        let mut nodes = v1.nodes().to_vec();
        nodes.push(node(
            "node3",
            &["10.204.3.0/24"],
            "192.168.204.3",
            Some(LinkLayer::Ethernet),
        ));
        StaticNodeFile::write(&path, &nodes).unwrap();
        let v2 = file.view().unwrap();
        assert_eq!(v2.owner_of(ip("10.204.3.5")).unwrap().name, "node3");
        assert_eq!(
            v2.node("node1").unwrap().lane_port,
            Some(7471),
            "write() keeps the lane port"
        );
        assert!(v2.rdma_between("node1", "node3"));

        // Rewritten in place, same size, at once (same mtime tick): still noticed.
        let same_size = std::fs::read_to_string(&path)
            .unwrap()
            .replace("node3", "node4");
        std::fs::write(&path, same_size).unwrap();
        assert_eq!(
            file.view()
                .unwrap()
                .owner_of(ip("10.204.3.5"))
                .unwrap()
                .name,
            "node4"
        );

        std::fs::write(&path, "{ not json").unwrap();
        assert!(matches!(file.view(), Err(TopologyError::Parse { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
