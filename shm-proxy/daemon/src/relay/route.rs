//! Which peer daemon carries a connection to a pod IP: the daemon's
//! cross-node view (`nodes.rs`) names the node owning the IP; another node
//! with a lane port (and an RDMA lane when the transport is RDMA) is reached
//! at `underlay:lane_port`. Everything else has no lane: TCP.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use crate::nodes::{Destination, Nodes};

pub struct Router {
    nodes: Arc<Nodes>,
    /// Only nodes that publish an RDMA lane qualify (RDMA transport).
    need_rdma: bool,
}

impl Router {
    pub fn new(nodes: Arc<Nodes>, need_rdma: bool) -> Self {
        Router { nodes, need_rdma }
    }

    /// Whether a stream from the daemon at `peer` (its underlay address)
    /// may carry a connection of the pod `client`: only a pod of that node.
    pub fn is_pod_of(&self, peer: IpAddr, client: IpAddr) -> bool {
        self.nodes.is_pod_of_node_at(peer, client)
    }

    /// The lane address of the daemon of the node owning `ip`, when that is
    /// another node with a lane.
    pub fn lane_peer(&self, ip: IpAddr) -> Option<SocketAddr> {
        match self.nodes.route_for(ip.to_canonical()) {
            Destination::Remote(node) if !self.need_rdma || node.rdma.is_some() => node.lane_addr(),
            _ => None,
        }
    }
}
