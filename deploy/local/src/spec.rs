//! What a cluster is made of, and the names of its objects. All names are
//! derived from the cluster name, so `down` can find them again from the
//! name alone.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Every namespace of every cluster starts with this.
pub const PREFIX: &str = "flc";
/// Default parent directory of the clusters' run directories.
pub const DEFAULT_RUN_ROOT: &str = flowlane_defaults::CLUSTER_RUN_ROOT;
/// The underlay network joining the nodes: node `i` is `10.209.0.(10+i)`.
pub const UNDERLAY_PREFIX: [u8; 3] = [10, 209, 0];
/// First host number of the nodes on the underlay.
pub const UNDERLAY_FIRST_HOST: u8 = 10;
/// The bridge inside every node namespace (names are per namespace, so
/// every node can use the same one).
pub const NODE_BRIDGE: &str = "flcbr0";
/// The bridge inside the underlay namespace.
pub const UNDERLAY_BRIDGE: &str = "flcul";
/// Most nodes and pods per node a cluster may have.
pub const MAX_NODES: u32 = 16;
pub const MAX_PODS_PER_NODE: u32 = 32;

/// Which CNI plugin wires the pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Plugin {
    /// The real `flowlane` plugin with its built-in IPAM.
    Flowlane,
    /// Debian's reference `bridge` + `host-local` (for comparison).
    Bridge,
}

impl std::str::FromStr for Plugin {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "flowlane" => Ok(Plugin::Flowlane),
            "bridge" => Ok(Plugin::Bridge),
            other => Err(format!("plugin must be flowlane or bridge, not {other:?}")),
        }
    }
}

impl Plugin {
    /// The conflist template under `deploy/local/`.
    pub fn conflist_template(self) -> &'static str {
        match self {
            Plugin::Flowlane => include_str!("../flowlane-node.conflist"),
            Plugin::Bridge => include_str!("../bridge-node.conflist"),
        }
    }
}

/// A cluster to create.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterSpec {
    /// Lower-case letters and digits, at most 8.
    pub name: String,
    pub nodes: u32,
    pub pods_per_node: u32,
    /// The cluster's pod network, a /16; node `i` gets the `i`-th /24 of it.
    pub pod_network: Ipv4Addr,
    pub plugin: Plugin,
    pub run_root: PathBuf,
}

impl ClusterSpec {
    pub fn new(name: &str, nodes: u32, pods_per_node: u32) -> Self {
        ClusterSpec {
            name: name.to_string(),
            nodes,
            pods_per_node,
            pod_network: Ipv4Addr::new(10, 210, 0, 0),
            plugin: Plugin::Flowlane,
            run_root: PathBuf::from(DEFAULT_RUN_ROOT),
        }
    }

    /// Checks the spec; the error says what to change.
    pub fn validate(&self) -> Result<(), String> {
        validate_name(&self.name)?;
        if self.nodes == 0 || self.nodes > MAX_NODES {
            return Err(format!("nodes must be 1..={MAX_NODES}, not {}", self.nodes));
        }
        if self.pods_per_node == 0 || self.pods_per_node > MAX_PODS_PER_NODE {
            return Err(format!(
                "pods per node must be 1..={MAX_PODS_PER_NODE}, not {}",
                self.pods_per_node
            ));
        }
        let o = self.pod_network.octets();
        if o[2] != 0 || o[3] != 0 {
            return Err(format!(
                "pod network {} must be a /16 (x.y.0.0)",
                self.pod_network
            ));
        }
        if !self.run_root.is_absolute() {
            return Err(format!(
                "run root {} must be absolute",
                self.run_root.display()
            ));
        }
        Ok(())
    }

    pub fn run_dir(&self) -> PathBuf {
        run_dir(&self.run_root, &self.name)
    }

    pub fn underlay_netns(&self) -> String {
        format!("{PREFIX}{}-u", self.name)
    }

    pub fn node_name(&self, node: u32) -> String {
        format!("n{node}")
    }

    pub fn node_netns(&self, node: u32) -> String {
        format!("{PREFIX}{}-n{node}", self.name)
    }

    pub fn pod_name(&self, node: u32, pod: u32) -> String {
        format!("n{node}p{pod}")
    }

    pub fn pod_netns(&self, node: u32, pod: u32) -> String {
        format!("{PREFIX}{}-n{node}p{pod}", self.name)
    }

    /// The container id a runtime would give the pod's sandbox.
    pub fn container_id(&self, node: u32, pod: u32) -> String {
        format!("{PREFIX}-{}-{}", self.name, self.pod_name(node, pod))
    }

    /// The underlay end of node `node`'s link (lives in the underlay netns).
    pub fn underlay_link(&self, node: u32) -> String {
        format!("{PREFIX}u{node}")
    }

    pub fn node_ip(&self, node: u32) -> Ipv4Addr {
        let [a, b, c] = UNDERLAY_PREFIX;
        Ipv4Addr::new(a, b, c, UNDERLAY_FIRST_HOST + node as u8)
    }

    /// Node `node`'s pod CIDR (`x.y.node.0/24`).
    pub fn pod_cidr(&self, node: u32) -> String {
        let o = self.pod_network.octets();
        format!("{}.{}.{node}.0/24", o[0], o[1])
    }

    /// The gateway address on node `node`'s bridge.
    pub fn gateway(&self, node: u32) -> Ipv4Addr {
        let o = self.pod_network.octets();
        Ipv4Addr::new(o[0], o[1], node as u8, 1)
    }

    pub fn node_dir(&self, node: u32) -> PathBuf {
        self.run_dir().join("nodes").join(self.node_name(node))
    }

    pub fn daemon_socket(&self, node: u32) -> PathBuf {
        self.node_dir(node).join("flowlaned.sock")
    }
}

/// The run directory of cluster `name` under `root`.
pub fn run_dir(root: &Path, name: &str) -> PathBuf {
    root.join(name)
}

/// A cluster name: 1..=8 lower-case letters or digits (it ends up in
/// namespace names and container ids).
pub fn validate_name(name: &str) -> Result<(), String> {
    if name.is_empty()
        || name.len() > 8
        || !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    {
        return Err(format!(
            "cluster name {name:?} must be 1 to 8 lower-case letters or digits"
        ));
    }
    Ok(())
}

/// Where the project's binaries are: by default next to the running
/// executable (`target/release`), as `cargo build --workspace` leaves them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Binaries {
    pub dir: PathBuf,
}

impl Binaries {
    pub fn beside_current_exe() -> std::io::Result<Self> {
        let exe = std::env::current_exe()?;
        let mut dir = exe
            .parent()
            .ok_or_else(|| std::io::Error::other("executable has no directory"))?
            .to_path_buf();
        // Test executables live in target/<profile>/deps.
        if dir.file_name().is_some_and(|n| n == "deps") {
            dir.pop();
        }
        Ok(Binaries { dir })
    }

    pub fn flowlane(&self) -> PathBuf {
        self.dir.join("flowlane")
    }
    pub fn flowlaned(&self) -> PathBuf {
        self.dir.join("flowlaned")
    }
    /// The shipped library (`shm-proxy/preload/ship.sh`: glibc 2.17
    /// floor) when it was built, else the workspace build's.
    pub fn preload(&self) -> PathBuf {
        let shipped = self.dir.join("shipped/libflowlane_preload.so");
        if shipped.exists() {
            return shipped;
        }
        self.dir.join("libflowlane_preload.so")
    }
    pub fn train(&self) -> PathBuf {
        self.dir.join("flowlane-train")
    }

    /// `CNI_PATH`: our binaries first, then the usual plugin directories.
    pub fn cni_path(&self) -> String {
        format!("{}:/usr/lib/cni:/opt/cni/bin", self.dir.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_fit_and_are_derived() {
        let s = ClusterSpec::new("abcdefgh", 16, 32);
        assert!(s.validate().is_ok());
        assert_eq!(s.pod_netns(15, 31), "flcabcdefgh-n15p31");
        assert!(s.underlay_link(15).len() <= 15);
        assert_eq!(s.pod_cidr(3), "10.210.3.0/24");
        assert_eq!(s.gateway(3).to_string(), "10.210.3.1");
        assert_eq!(s.node_ip(1).to_string(), "10.209.0.11");
    }

    #[test]
    fn bad_specs_are_refused() {
        for name in ["", "UPPER", "toolongname", "a-b", "a/b"] {
            assert!(validate_name(name).is_err(), "{name:?}");
        }
        let mut s = ClusterSpec::new("ok", 0, 1);
        assert!(s.validate().unwrap_err().contains("nodes"));
        s.nodes = 1;
        s.pods_per_node = 33;
        assert!(s.validate().unwrap_err().contains("pods"));
        s.pods_per_node = 1;
        s.pod_network = Ipv4Addr::new(10, 1, 2, 0);
        assert!(s.validate().unwrap_err().contains("/16"));
    }
}
