//! RDMA NIC discovery (sysfs) and the cross-node view the RDMA lane needs.
//!
//! - [`discovery`] reads `/sys/class/infiniband` (and `/sys/class/net` for the
//!   netdev mapping) into an [`Inventory`]: devices, ports, state, link layer,
//!   MTU, rate and the GID table. Pure file reading: no RDMA library is
//!   loaded, so it runs on any node, and the sysfs root is a parameter so
//!   tests run against fake trees (`tests/fixtures/`).
//! - [`gid`] chooses the GID a node's daemon uses for RoCE/InfiniBand
//!   traffic, or explains why there is none.
//! - [`topology`] is the cluster's node table: which node owns which pod
//!   CIDR and which nodes have an RDMA lane.
//! - [`lane_auth`] admits only the cluster's daemons on the lane port (node
//!   table, shared-key challenge/response), for every transport.

pub mod discovery;
pub mod gid;
pub mod lane_auth;
pub mod lane_stream;
pub mod sysfs;
pub mod topology;
pub mod transport;

pub use discovery::{discover, Device, GidEntry, GidType, Inventory, LinkLayer, Port, PortState};
pub use gid::{select_gid, NoGidReason, NoUsableGid, NodeAddress, SelectedGid};
pub use lane_auth::{AuthError, KeyError, LaneAuth, LaneKey, PeerFilter};
pub use lane_stream::{DirectLane, LaneStream, LaneTransport, Piece, RingArea, StreamKey};
pub use sysfs::Sysfs;
pub use topology::kubernetes::KubeNodeDirectory;
pub use topology::{ClusterView, NodeDirectory, NodeEntry, RdmaLane, StaticNodeFile};
pub use transport::{RdmaOptions, RdmaTransport};
