//! flowlane's CSI node plugin: it gives pods the node's flowlane library directory
//! and the daemon's socket directory as CSI ephemeral inline volumes
//! (`csi: {driver: csi.flowlane.io, readOnly: true}`), which Pod Security
//! "restricted" allows, instead of hostPath volumes, which it forbids.
//!
//! The kubelet finds the plugin through its registration socket
//! ([`registration`]), then calls the CSI Identity ([`identity`]) and Node
//! ([`node`]) services on the plugin's endpoint. Each publish is one read-only
//! bind mount of a node directory onto the kubelet's target path ([`mounts`]),
//! after every field of the request was checked ([`request`]): the kubelet is the
//! only expected caller, but its requests carry what pod authors wrote.

pub mod client;
pub mod identity;
pub mod mounts;
pub mod node;
pub mod registration;
pub mod request;
pub mod serve;

/// The generated protocol code (build.rs, from the vendored `proto/`).
pub mod proto {
    /// The CSI spec, package `csi.v1`.
    pub mod csi {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("csi.v1");
    }
    /// The kubelet's plugin registration, `pluginregistration` (v1).
    pub mod registration {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("pluginregistration");
    }
}

/// The driver's name: the CSIDriver object's name and what pods write in
/// `csi.driver`.
pub const DRIVER_NAME: &str = "csi.flowlane.io";
/// What `GetPluginInfo` reports as the vendor version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The CSI versions announced to the kubelet at registration (it accepts major 1).
pub const SUPPORTED_VERSIONS: &[&str] = &["1.0.0"];
/// The largest request the plugin decodes: a NodePublishVolume carries a few
/// paths and the pod's attributes, far below this.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// The gRPC library the generated code uses, for callers that drive the plugin.
pub use tonic;
