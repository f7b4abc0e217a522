//! Harness for flowlane's end-to-end tests: network namespaces, the real
//! binaries, and third-party programs.
//!
//! Everything here drives real kernel objects and real executables; every
//! object a test creates is owned by a guard whose `Drop` removes it, so a
//! failing (panicking) test still leaves the machine clean.

pub mod attack_scripts;
pub mod binaries;
pub mod cni;
pub mod conformance;
pub mod cri;
pub mod csi;
pub mod daemon;
pub mod fake_api;
pub mod frameworks;
pub mod fsutil;
pub mod host;
pub mod kubelet;
pub mod loop_scripts;
pub mod names;
pub mod netns;
pub mod node_ns;
pub mod ns_cluster;
pub mod outside;
pub mod process;
pub mod result;
pub mod services;
pub mod shm;
pub mod shm_scripts;
pub mod traffic;
pub mod wait;
