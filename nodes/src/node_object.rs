//! Reading the node table from Kubernetes `Node` objects (as the API server
//! returns them), kept free of any client library so that the kube-rs
//! implementation of [`super::NodeDirectory`] ([`super::kubernetes`]) is
//! only the list loop around it, and so that this part is tested against
//! API responses (`tests/fixtures/kube/nodelist.json`: a `GET /api/v1/nodes`
//! answer written after the v1 Node schema).
//!
//! - name: `metadata.name`
//! - pod CIDRs: `spec.podCIDRs` (dual stack), else the older `spec.podCIDR`
//! - underlay: the first `InternalIP` of `status.addresses` (of the family
//!   of the first pod CIDR when there is one), else the first `ExternalIP`
//! - RDMA lane and lane port: the annotation [`RDMA_ANNOTATION`], which each
//!   node's `flowlaned` publishes (the JSON of [`PublishedLane`]: the fields
//!   of [`super::RdmaLane`] plus `lanePort`, the port its daemon accepts
//!   lane streams on; annotations written before `lanePort` existed still
//!   read, with no port).

use std::net::IpAddr;

use ipnetwork::IpNetwork;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{ClusterView, NodeEntry, RdmaLane, TopologyError};

/// Annotation on the Node holding its daemon's published RDMA lane.
pub const RDMA_ANNOTATION: &str = "flowlane.io/rdma-lane";

/// The value of [`RDMA_ANNOTATION`]: the node's RDMA lane and where its
/// daemon accepts lane streams, in one JSON object so that a peer never sees
/// one without the other.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PublishedLane {
    #[serde(flatten)]
    pub rdma: RdmaLane,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lane_port: Option<u16>,
}

impl PublishedLane {
    /// The annotation's value (a JSON string).
    pub fn to_annotation(&self) -> String {
        serde_json::to_string(self).expect("lane serialises")
    }

    pub fn from_annotation(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }
}

/// One `Node` object -> its entry. Nodes without a pod CIDR yet (not
/// allocated by the controller manager) or without an address are skipped
/// with `Ok(None)`: they cannot own pods yet.
pub fn node_entry(node: &Value) -> Result<Option<NodeEntry>, TopologyError> {
    let name = node["metadata"]["name"]
        .as_str()
        .ok_or_else(|| TopologyError::Invalid("a Node without metadata.name".into()))?
        .to_string();
    let bad = |what: String| TopologyError::Invalid(format!("node {name}: {what}"));
    let mut cidrs: Vec<&str> = node["spec"]["podCIDRs"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if cidrs.is_empty() {
        cidrs.extend(node["spec"]["podCIDR"].as_str());
    }
    let pod_cidrs = cidrs
        .iter()
        .map(|c| {
            c.parse::<IpNetwork>()
                .map_err(|e| bad(format!("pod CIDR {c:?}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if pod_cidrs.is_empty() {
        return Ok(None);
    }
    let want_v4 = pod_cidrs[0].is_ipv4();
    let addrs: Vec<(&str, IpAddr)> = node["status"]["addresses"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| Some((x["type"].as_str()?, x["address"].as_str()?.parse().ok()?)))
                .collect()
        })
        .unwrap_or_default();
    let pick = |kind: &str| {
        addrs
            .iter()
            .filter(|(t, _)| *t == kind)
            .map(|(_, ip)| *ip)
            .find(|ip| ip.is_ipv4() == want_v4)
            .or_else(|| addrs.iter().find(|(t, _)| *t == kind).map(|(_, ip)| *ip))
    };
    let Some(underlay) = pick("InternalIP").or_else(|| pick("ExternalIP")) else {
        return Ok(None);
    };
    let published = match node["metadata"]["annotations"][RDMA_ANNOTATION].as_str() {
        None => None,
        Some(text) => Some(
            PublishedLane::from_annotation(text)
                .map_err(|e| bad(format!("annotation {RDMA_ANNOTATION}: {e}")))?,
        ),
    };
    let (rdma, lane_port) = match published {
        Some(p) => (Some(p.rdma), p.lane_port),
        None => (None, None),
    };
    Ok(Some(NodeEntry {
        name,
        pod_cidrs,
        underlay,
        rdma,
        lane_port,
    }))
}

/// A `NodeList` (`GET /api/v1/nodes`) -> the node table.
pub fn cluster_view(list: &Value) -> Result<ClusterView, TopologyError> {
    let items = list["items"]
        .as_array()
        .ok_or_else(|| TopologyError::Invalid("a NodeList without items".into()))?;
    let mut nodes = Vec::new();
    for item in items {
        nodes.extend(node_entry(item)?);
    }
    ClusterView::new(nodes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flowlane_rdma_discovery::LinkLayer;

    /// The `GET /api/v1/nodes` answer of a four-node cluster.
    fn node_list() -> Value {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/kube/nodelist.json"
        );
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
    }

    #[test]
    fn a_node_list_becomes_the_node_table() {
        let view = cluster_view(&node_list()).unwrap();
        let names: Vec<&str> = view.nodes().iter().map(|n| n.name.as_str()).collect();
        assert_eq!(
            names,
            vec!["gpu-a1", "gpu-a2", "cpu-b1"],
            "gpu-new has no pod CIDR yet"
        );

        let a1 = view.node("gpu-a1").unwrap();
        assert_eq!(a1.pod_cidrs.len(), 2, "dual stack from spec.podCIDRs");
        assert_eq!(a1.underlay, "172.16.0.11".parse::<IpAddr>().unwrap());
        let lane = a1.rdma.as_ref().unwrap();
        assert_eq!((lane.device.as_str(), lane.gid_index), ("mlx5_0", 3));
        assert_eq!(lane.link_layer, LinkLayer::Ethernet);

        let b1 = view.node("cpu-b1").unwrap();
        assert_eq!(
            b1.pod_cidrs[0].to_string(),
            "10.244.7.0/24",
            "legacy spec.podCIDR"
        );
        assert_eq!(
            b1.underlay,
            "203.0.113.7".parse::<IpAddr>().unwrap(),
            "ExternalIP when no InternalIP"
        );
        assert!(b1.rdma.is_none());

        assert_eq!(
            view.owner_of("10.244.2.17".parse().unwrap()).unwrap().name,
            "gpu-a2"
        );
        assert_eq!(
            view.owner_of("fd00:10:244:1::5".parse().unwrap())
                .unwrap()
                .name,
            "gpu-a1"
        );
        assert!(view.rdma_between("gpu-a1", "gpu-a2"));
        assert!(!view.rdma_between("gpu-a1", "cpu-b1"));
    }

    #[test]
    fn the_lane_port_travels_in_the_annotation_and_old_annotations_still_read() {
        let lane = RdmaLane {
            device: "rxe0".into(),
            port: 1,
            gid_index: 1,
            gid: "::ffff:192.168.204.1".parse().unwrap(),
            link_layer: LinkLayer::Ethernet,
            active_mtu: Some(1024),
        };
        let published = PublishedLane {
            rdma: lane.clone(),
            lane_port: Some(7471),
        };
        let text = published.to_annotation();
        let value: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(value["lanePort"], 7471, "{text}");
        assert_eq!(
            value["gid"], "::ffff:192.168.204.1",
            "flat, not nested: {text}"
        );
        assert_eq!(PublishedLane::from_annotation(&text).unwrap(), published);
        // A reader that only knows RdmaLane ignores the port.
        assert_eq!(serde_json::from_str::<RdmaLane>(&text).unwrap(), lane);

        let mut list = node_list();
        list["items"][1]["metadata"]["annotations"][RDMA_ANNOTATION] = text.into();
        let view = cluster_view(&list).unwrap();
        let a2 = view.node("gpu-a2").unwrap();
        assert_eq!(a2.lane_port, Some(7471));
        assert_eq!(a2.rdma.as_ref().unwrap(), &lane);
        let a1 = view.node("gpu-a1").unwrap();
        assert!(a1.rdma.is_some(), "annotation without lanePort");
        assert_eq!(a1.lane_port, None);
    }

    #[test]
    fn a_malformed_annotation_is_an_error_naming_the_node() {
        let mut list = node_list();
        list["items"][1]["metadata"]["annotations"][RDMA_ANNOTATION] = "{not json".into();
        let err = cluster_view(&list).unwrap_err().to_string();
        assert!(
            err.contains("gpu-a2") && err.contains(RDMA_ANNOTATION),
            "{err}"
        );
        let mut list = node_list();
        list["items"][0]["spec"]["podCIDRs"][0] = "10.244.1.0/33".into();
        assert!(cluster_view(&list)
            .unwrap_err()
            .to_string()
            .contains("gpu-a1"));
    }
}
