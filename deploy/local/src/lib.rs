//! A flowlane training cluster on one machine, as docs/architecture.md describes it:
//! nodes are network namespaces with their own bridge, pod CIDR and
//! `flowlaned`, joined by veth links to an underlay namespace with host-gw
//! routes to each other's pod CIDRs; pods are network namespaces wired by the
//! real `flowlane` CNI plugin, invoked exactly as a container runtime does.
//!
//! Every object is recorded in the cluster's journal BEFORE it is created,
//! so [`down`] removes everything even after `up` was killed halfway.
//!
//! Links, addresses and routes are set with iproute2's `ip`: this crate is
//! the stand-in for a machine's provisioning (what a cloud or kubeadm does
//! before the CNI plugin runs), not the plugin, and the commands double as
//! documentation a person can replay by hand.

pub mod check;
pub mod cni;
pub mod demo;
pub mod down;
pub mod exec;
pub mod journal;
pub mod kube_check;
pub mod lanes;
pub mod probe;
pub mod procs;
pub mod rdma_rig;
pub mod sh;
pub mod spec;
pub mod status;
pub mod up;

pub use down::down;
pub use spec::{Binaries, ClusterSpec, Plugin};
pub use status::{status, ClusterState, NodeState, PodState};
pub use up::up;
