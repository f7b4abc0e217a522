//! Running a CNI plugin exactly as a runtime does: environment variables
//! (`CNI_COMMAND`, `CNI_CONTAINERID`, `CNI_NETNS`, `CNI_IFNAME`, `CNI_ARGS`,
//! `CNI_PATH`) and the network configuration on stdin (CNI spec 1.1.0).
//!
//! - [`invocation`]: one plugin exec and what it printed;
//! - [`net`]: a network and pods a test owns, and the "nothing leaked" check;
//! - [`chain`]: a conflist run as libcni runs it.

pub mod chain;
pub mod invocation;
pub mod net;

pub use chain::{Chain, ChainAttachment};
pub use invocation::{code, CniError, Invocation, PluginOutput, VERSIONS};
pub use net::{DelOnDrop, Pod, TestNet};
