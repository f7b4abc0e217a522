//! Every default path of flowlane, in one place.
//!
//! The plugin, the daemon, the preload library, the webhook, the CSI plugin
//! and the local cluster must agree on these paths (the plugin pokes the
//! daemon's socket, the webhook mounts the directory the CSI plugin serves,
//! the library connects where the daemon listens), so each is spelt once,
//! here. Each can be overridden where it is used (a flag, the CNI config, an
//! environment variable); this crate only holds the value used when nothing
//! says otherwise. No dependencies: the preload library (loaded into every
//! application) and the CNI plugin (run on every pod start) link it.
//!
//! `concat!` takes literals only, so a path inside a directory repeats the
//! directory; the tests below check that each such pair agrees.

// ---- The node daemon (flowlaned) and who talks to it ----

/// The daemon's socket directory on the node. flowlaned creates it; the
/// CSI plugin (`--run-dir`) publishes it read-only into injected pods, where
/// the webhook mounts it at the same path.
pub const RUN_DIR: &str = "/run/flowlane";

/// The daemon's Unix socket. flowlaned listens here (`--socket`); the preload
/// library connects here (`FLOWLANE_SOCKET` overrides); the CNI plugin pokes
/// it (`daemonSocket` in the network config); `flowlane status` and
/// `flowlane diag` read it; the webhook sets `FLOWLANE_SOCKET` to it.
pub const DAEMON_SOCKET: &str = "/run/flowlane/flowlaned.sock";

/// The node's state directory: the pod registry (written by the CNI plugin,
/// `stateDir` in the network config), the daemon's files (`--state-dir`),
/// what `flowlane diag` reads.
pub const STATE_DIR: &str = "/var/lib/flowlane";

// ---- The preload library and the probe on the node and in pods ----

/// The node's flowlane library directory: the DaemonSet installs the preload
/// library, the no-op object and the probe there; the CSI plugin serves it
/// (`--lib-dir`, volume `content: lib`).
pub const HOST_LIB_DIR: &str = "/opt/flowlane/lib";

/// Where an injected pod's application containers find the library (the
/// pod's emptyDir that the probe fills; the webhook mounts it here).
pub const POD_LIB_DIR: &str = "/opt/flowlane/lib";

/// The library as `LD_PRELOAD` names it in an injected pod (the webhook).
pub const POD_PRELOAD_LIB: &str = "/opt/flowlane/lib/libflowlane_preload.so";

/// Where the webhook's probe init containers see [`HOST_LIB_DIR`].
pub const PROBE_LIB_DIR: &str = "/opt/flowlane/node";

/// The probe, as the webhook's init containers run it.
pub const PROBE: &str = "/opt/flowlane/node/flowlane-probe";

// ---- CNI, the kubelet, the kernel ----

/// The runtime's CNI network configuration directory (`flowlane diag
/// --cni-conf-dir`).
pub const CNI_CONF_DIR: &str = "/etc/cni/net.d";

/// The runtime's CNI plugin directory (`flowlane diag --cni-bin-dir`).
pub const CNI_BIN_DIR: &str = "/opt/cni/bin";

/// host-local IPAM's data directory when the config names none (the
/// plugin's IPAM, and `flowlane diag` reading its leases), as the reference
/// host-local plugin defaults it.
pub const IPAM_DATA_DIR: &str = "/var/lib/cni/networks";

/// The kubelet's root directory (`--root-dir`; the CSI plugin's
/// `--kubelet-dir`).
pub const KUBELET_DIR: &str = "/var/lib/kubelet";

/// Where sysfs is mounted (RDMA discovery: flowlaned's and `flowlane
/// diag`'s `--sysfs`).
pub const SYSFS: &str = "/sys";

// ---- The local cluster (deploy/local) ----

/// The local cluster's run root: its nodes' and pods' state, sockets and
/// logs (`flowlane-cluster --run-root`, the demo).
pub const CLUSTER_RUN_ROOT: &str = "/run/flowlane-cluster";

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn paths_inside_a_directory_agree_with_it() {
        assert_eq!(Path::new(DAEMON_SOCKET).parent(), Some(Path::new(RUN_DIR)));
        assert_eq!(
            Path::new(POD_PRELOAD_LIB).parent(),
            Some(Path::new(POD_LIB_DIR))
        );
        assert_eq!(Path::new(PROBE).parent(), Some(Path::new(PROBE_LIB_DIR)));
    }

    #[test]
    fn every_default_is_absolute() {
        for p in [
            RUN_DIR,
            DAEMON_SOCKET,
            STATE_DIR,
            HOST_LIB_DIR,
            POD_LIB_DIR,
            POD_PRELOAD_LIB,
            PROBE_LIB_DIR,
            PROBE,
            CNI_CONF_DIR,
            CNI_BIN_DIR,
            IPAM_DATA_DIR,
            KUBELET_DIR,
            SYSFS,
            CLUSTER_RUN_ROOT,
        ] {
            assert!(Path::new(p).is_absolute(), "{p}");
        }
    }
}
