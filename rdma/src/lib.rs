//! The cross-node RDMA lane: verbs, the transport, the lane handshake.
//!
//! - [`discovery`], [`gid`] and [`sysfs`] are re-exported from
//!   `flowlane-rdma-discovery` (NIC discovery from sysfs, GID selection: no
//!   RDMA library), and [`topology`] from `flowlane-nodes` (the cluster's
//!   node table: which node owns which pod CIDR and which nodes have an RDMA
//!   lane). Both are light crates of their own so the CNI plugin uses them
//!   without this crate's verbs and kube.
//! - [`lane_auth`] admits only the cluster's daemons on the lane port (node
//!   table, shared-key challenge/response), for every transport.

pub use flowlane_nodes as topology;
pub use flowlane_rdma_discovery::{discovery, gid, sysfs};
pub mod lane_auth;
pub mod lane_stream;
pub mod transport;

pub use discovery::{discover, Device, GidEntry, GidType, Inventory, LinkLayer, Port, PortState};
pub use gid::{select_gid, NoGidReason, NoUsableGid, NodeAddress, SelectedGid};
pub use lane_auth::{AuthError, KeyError, LaneAuth, LaneKey, PeerFilter};
pub use lane_stream::{DirectLane, LaneStream, LaneTransport, Piece, RingArea, StreamKey};
pub use sysfs::Sysfs;
pub use topology::kubernetes::KubeNodeDirectory;
pub use topology::{ClusterView, NodeDirectory, NodeEntry, RdmaLane, StaticNodeFile};
pub use transport::{RdmaOptions, RdmaTransport};
