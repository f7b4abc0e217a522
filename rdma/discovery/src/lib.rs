//! RDMA NIC discovery (sysfs) and GID selection, without an RDMA library.
//!
//! - [`discovery`] reads `/sys/class/infiniband` (and `/sys/class/net` for the
//!   netdev mapping) into an [`Inventory`]: devices, ports, state, link layer,
//!   MTU, rate and the GID table. Pure file reading: no RDMA library is
//!   loaded, so it runs on any node, and the sysfs root is a parameter so
//!   tests run against fake trees (`rdma/tests/fixtures/`).
//! - [`gid`] chooses the GID a node's daemon uses for RoCE/InfiniBand
//!   traffic, or explains why there is none.
//!
//! Its own crate so that `flowlane diag` (in the CNI plugin binary) reads the
//! NICs without linking verbs, tokio or kube (`flowlane-rdma` has those).

pub mod discovery;
pub mod gid;
pub mod sysfs;

pub use discovery::{discover, Device, GidEntry, GidType, Inventory, LinkLayer, Port, PortState};
pub use gid::{select_gid, NoGidReason, NoUsableGid, NodeAddress, SelectedGid};
pub use sysfs::Sysfs;
