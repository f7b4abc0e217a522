//! What RDMA hardware this node has, read from sysfs.
//!
//! Layout read (kernel `Documentation/ABI/stable/sysfs-class-infiniband`):
//!
//! ```text
//! class/infiniband/<dev>/node_type            "1: CA"
//! class/infiniband/<dev>/node_guid            "b859:9f03:00d4:1e2a"
//! class/infiniband/<dev>/fw_ver               "16.35.2000"
//! class/infiniband/<dev>/parent               rxe/siw only: the netdev it is bound to
//! class/infiniband/<dev>/device/driver ->     .../mlx5_core (absent for rxe)
//! class/infiniband/<dev>/device/net/<if>      netdevs of the same PCI function
//! class/infiniband/<dev>/ports/<n>/state      "4: ACTIVE"
//! class/infiniband/<dev>/ports/<n>/phys_state "5: LinkUp"
//! class/infiniband/<dev>/ports/<n>/link_layer "InfiniBand" | "Ethernet"
//! class/infiniband/<dev>/ports/<n>/rate       "100 Gb/sec (4X EDR)"
//! class/infiniband/<dev>/ports/<n>/gids/<i>   "fe80:0000:0000:0000:ba59:9fff:fed4:1e2a"
//! class/infiniband/<dev>/ports/<n>/gid_attrs/types/<i>  "IB/RoCE v1" | "RoCE v2" (EINVAL when unpopulated)
//! class/infiniband/<dev>/ports/<n>/gid_attrs/ndevs/<i>  netdev of a RoCE GID (EINVAL otherwise)
//! class/net/<if>/device/infiniband/<dev>      netdev -> device (PCI NICs)
//! class/net/<if>/mtu                          RoCE's active MTU derives from it
//! class/infiniband_verbs/uverbs<n>/ibdev      "rxe0": the device's /dev/infiniband/uverbs<n>
//! ```
//!
//! A device being removed (`rdma link delete`, a driver unbind) loses its
//! `infiniband_verbs` node first; when its driver cannot revoke open
//! contexts (rxe, siw), the kernel then waits, with the device still in
//! `class/infiniband` and its ports still ACTIVE, until every process has
//! closed it. Such a device is reported `removing`: nothing can open it.
//!
//! sysfs has no port MTU attribute (`ibv_query_port` gets it from the
//! driver). For RoCE ports the kernel derives it from the netdev MTU
//! (`iboe_get_mtu`), so we do the same; for InfiniBand ports it stays unknown.

use std::collections::BTreeMap;
use std::io;
use std::net::Ipv6Addr;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::sysfs::{attr, entries, link_name, Sysfs};

/// Every RDMA device of the node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Inventory {
    pub devices: Vec<Device>,
}

/// One RDMA device (`mlx5_0`, `rxe0`, ...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Device {
    pub name: String,
    /// `CA`, `RNIC`, ... (without the numeric code).
    pub node_type: Option<String>,
    pub node_guid: Option<String>,
    pub fw_ver: Option<String>,
    /// Kernel driver of the underlying PCI function (`mlx5_core`); `None`
    /// for software devices (rxe, siw), which have no `device` link.
    pub driver: Option<String>,
    /// The netdev a software device is bound to (`parent`).
    pub parent: Option<String>,
    /// Every netdev linked to this device, by any of the mappings.
    pub netdevs: Vec<String>,
    pub ports: Vec<Port>,
    /// Its user-space verbs node (`uverbs0` = `/dev/infiniband/uverbs0`);
    /// `None` when unknown (no `class/infiniband_verbs`: ib_uverbs is not
    /// loaded) or gone.
    #[serde(default)]
    pub uverbs: Option<String>,
    /// `class/infiniband_verbs` exists but has no node for this device: it
    /// is being removed (see the module comment), or the verbs node failed;
    /// either way no process can open it.
    #[serde(default)]
    pub removing: bool,
}

/// One port of a device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Port {
    pub number: u32,
    pub state: PortState,
    pub phys_state: Option<PortState>,
    pub link_layer: LinkLayer,
    /// As the kernel prints it: `100 Gb/sec (4X EDR)`.
    pub rate: Option<String>,
    /// The netdev this port's traffic uses (RoCE: the Ethernet netdev; IB:
    /// the IPoIB netdev when there is one).
    pub netdev: Option<String>,
    pub netdev_mtu: Option<u32>,
    /// Path MTU in bytes: derived from the netdev MTU for RoCE (as the
    /// kernel does), unknown from sysfs for InfiniBand.
    pub active_mtu: Option<u32>,
    /// Number of entries in the GID table (populated or not).
    pub gid_table_len: usize,
    /// The populated (non-zero) GID entries.
    pub gids: Vec<GidEntry>,
}

/// A `"<code>: <NAME>"` attribute such as `4: ACTIVE` or `5: LinkUp`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortState {
    pub code: u32,
    pub name: String,
}

impl PortState {
    /// Parses `4: ACTIVE`; a bare name or number is accepted too.
    pub fn parse(s: &str) -> PortState {
        match s.split_once(':') {
            Some((code, name)) => PortState {
                code: code.trim().parse().unwrap_or(0),
                name: name.trim().to_string(),
            },
            None => PortState {
                code: s.trim().parse().unwrap_or(0),
                name: s.trim().to_string(),
            },
        }
    }

    fn unknown() -> PortState {
        PortState {
            code: 0,
            name: "unknown".into(),
        }
    }
}

impl std::fmt::Display for PortState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.name)
    }
}

/// `ib_port_state`: 4 is ACTIVE.
pub const PORT_ACTIVE: u32 = 4;

impl Port {
    pub fn is_active(&self) -> bool {
        self.state.code == PORT_ACTIVE
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LinkLayer {
    InfiniBand,
    /// RoCE.
    Ethernet,
    Unknown,
}

impl LinkLayer {
    fn parse(s: Option<&str>) -> LinkLayer {
        match s {
            Some("InfiniBand") => LinkLayer::InfiniBand,
            Some("Ethernet") => LinkLayer::Ethernet,
            _ => LinkLayer::Unknown,
        }
    }
}

impl std::fmt::Display for LinkLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LinkLayer::InfiniBand => "InfiniBand",
            LinkLayer::Ethernet => "Ethernet (RoCE)",
            LinkLayer::Unknown => "unknown",
        })
    }
}

/// One populated GID table entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GidEntry {
    pub index: u32,
    pub gid: Ipv6Addr,
    #[serde(rename = "type")]
    pub gid_type: Option<GidType>,
    /// The netdev the GID belongs to (RoCE only).
    pub netdev: Option<String>,
}

/// `gid_attrs/types/<i>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GidType {
    /// InfiniBand GIDs and RoCE v1 (Ethernet, not routable) share this name.
    #[serde(rename = "IB/RoCE v1")]
    IbRoceV1,
    /// RoCE v2: UDP/IP encapsulated, routable.
    #[serde(rename = "RoCE v2")]
    RoceV2,
    #[serde(rename = "unknown")]
    Unknown,
}

impl GidType {
    fn parse(s: &str) -> GidType {
        match s {
            "IB/RoCE v1" => GidType::IbRoceV1,
            "RoCE v2" => GidType::RoceV2,
            _ => GidType::Unknown,
        }
    }
}

impl std::fmt::Display for GidType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GidType::IbRoceV1 => "IB/RoCE v1",
            GidType::RoceV2 => "RoCE v2",
            GidType::Unknown => "unknown",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("reading {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: io::Error,
    },
}

/// Reads every RDMA device under `sysfs`. A node without RDMA (no
/// `class/infiniband` directory) yields an empty inventory, not an error.
pub fn discover(sysfs: &Sysfs) -> Result<Inventory, DiscoveryError> {
    let ib_dir = sysfs.infiniband();
    let names = entries(&ib_dir).map_err(|source| DiscoveryError::Io {
        path: ib_dir.display().to_string(),
        source,
    })?;
    let netdev_map = netdevs_by_device(sysfs);
    let verbs = verbs_nodes(sysfs);
    let mut devices = Vec::new();
    for name in names {
        let mut dev = read_device(sysfs, &name, netdev_map.get(&name));
        if let Some(nodes) = &verbs {
            dev.uverbs = nodes.get(&name).cloned();
            dev.removing = dev.uverbs.is_none();
        }
        devices.push(dev);
    }
    Ok(Inventory { devices })
}

/// device name -> its `uverbs<n>` node, from `class/infiniband_verbs/*/ibdev`;
/// `None` when that class does not exist (ib_uverbs not loaded: nothing
/// can be said about any device).
fn verbs_nodes(sysfs: &Sysfs) -> Option<BTreeMap<String, String>> {
    let dir = sysfs.root().join("class/infiniband_verbs");
    if !dir.is_dir() {
        return None;
    }
    let mut map = BTreeMap::new();
    for node in entries(&dir).unwrap_or_default() {
        if let Some(dev) = attr(&dir.join(&node).join("ibdev")) {
            map.insert(dev, node);
        }
    }
    Some(map)
}

/// A cheap summary of what decides this node's lane, for polling between
/// full discoveries: every device with its verbs node and each port's
/// state. Reads two or three small files per port (no GID tables).
pub fn lane_fingerprint(sysfs: &Sysfs) -> String {
    let mut out = String::new();
    let verbs = verbs_nodes(sysfs);
    for dev in entries(&sysfs.infiniband()).unwrap_or_default() {
        let node = verbs
            .as_ref()
            .map(|v| v.get(&dev).cloned().unwrap_or_default());
        out.push_str(&format!("{dev} verbs={node:?}"));
        let ports = sysfs.infiniband().join(&dev).join("ports");
        for p in entries(&ports).unwrap_or_default() {
            let state = attr(&ports.join(&p).join("state")).unwrap_or_default();
            out.push_str(&format!(" {p}={state}"));
        }
        out.push('\n');
    }
    out
}

/// device name -> netdevs whose `device/infiniband/` lists it, with the
/// port each belongs to (`dev_port` is 0-based; ports are 1-based).
fn netdevs_by_device(sysfs: &Sysfs) -> BTreeMap<String, Vec<(String, u32)>> {
    let mut map: BTreeMap<String, Vec<(String, u32)>> = BTreeMap::new();
    let net = sysfs.net();
    for ifname in entries(&net).unwrap_or_default() {
        let ifdir = net.join(&ifname);
        let port = attr(&ifdir.join("dev_port"))
            .and_then(|s| s.parse::<u32>().ok())
            .map(|p| p + 1)
            .unwrap_or(1);
        for dev in entries(&ifdir.join("device/infiniband")).unwrap_or_default() {
            map.entry(dev).or_default().push((ifname.clone(), port));
        }
    }
    map
}

fn read_device(sysfs: &Sysfs, name: &str, pci_netdevs: Option<&Vec<(String, u32)>>) -> Device {
    let dir = sysfs.infiniband().join(name);
    let parent = attr(&dir.join("parent")).filter(|s| !s.is_empty());
    let mut port_netdev: BTreeMap<u32, String> = BTreeMap::new();
    let mut netdevs: Vec<String> = Vec::new();
    if let Some(list) = pci_netdevs {
        for (ifname, port) in list {
            port_netdev.entry(*port).or_insert_with(|| ifname.clone());
            netdevs.push(ifname.clone());
        }
    }
    for ifname in entries(&dir.join("device/net")).unwrap_or_default() {
        netdevs.push(ifname);
    }
    if let Some(p) = &parent {
        // Software devices have one port, on their parent netdev.
        port_netdev.entry(1).or_insert_with(|| p.clone());
        netdevs.push(p.clone());
    }

    let mut ports = Vec::new();
    for port_name in entries(&dir.join("ports")).unwrap_or_default() {
        let Ok(number) = port_name.parse::<u32>() else {
            continue;
        };
        let port = read_port(
            sysfs,
            &dir.join("ports").join(&port_name),
            number,
            port_netdev.get(&number),
        );
        for g in &port.gids {
            if let Some(n) = &g.netdev {
                netdevs.push(n.clone());
            }
        }
        ports.push(port);
    }
    let mut seen = std::collections::BTreeSet::new();
    netdevs.retain(|n| seen.insert(n.clone()));

    Device {
        name: name.to_string(),
        node_type: attr(&dir.join("node_type")).map(|s| PortState::parse(&s).name),
        node_guid: attr(&dir.join("node_guid")),
        fw_ver: attr(&dir.join("fw_ver")).filter(|s| !s.is_empty()),
        driver: link_name(&dir.join("device/driver")),
        parent,
        netdevs,
        ports,
        uverbs: None,
        removing: false,
    }
}

fn read_port(sysfs: &Sysfs, dir: &Path, number: u32, mapped_netdev: Option<&String>) -> Port {
    let link_layer = LinkLayer::parse(attr(&dir.join("link_layer")).as_deref());
    let mut gid_table_len = 0;
    let mut gids = Vec::new();
    for idx in entries(&dir.join("gids")).unwrap_or_default() {
        let Ok(index) = idx.parse::<u32>() else {
            continue;
        };
        gid_table_len += 1;
        let Some(gid) = attr(&dir.join("gids").join(&idx)).and_then(|s| s.parse::<Ipv6Addr>().ok())
        else {
            continue;
        };
        if gid.is_unspecified() {
            continue;
        }
        gids.push(GidEntry {
            index,
            gid,
            gid_type: attr(&dir.join("gid_attrs/types").join(&idx))
                .filter(|s| !s.is_empty())
                .map(|s| GidType::parse(&s)),
            netdev: attr(&dir.join("gid_attrs/ndevs").join(&idx)).filter(|s| !s.is_empty()),
        });
    }
    // The GID table names the netdev authoritatively for RoCE; the PCI
    // mapping covers InfiniBand (IPoIB) and ports with an empty table.
    let netdev = gids
        .iter()
        .find_map(|g| g.netdev.clone())
        .or_else(|| mapped_netdev.cloned());
    let netdev_mtu = netdev
        .as_ref()
        .and_then(|n| attr(&sysfs.net().join(n).join("mtu")))
        .and_then(|s| s.parse::<u32>().ok());
    let active_mtu = match link_layer {
        LinkLayer::Ethernet => netdev_mtu.and_then(roce_mtu),
        _ => None,
    };
    Port {
        number,
        state: attr(&dir.join("state"))
            .map(|s| PortState::parse(&s))
            .unwrap_or_else(PortState::unknown),
        phys_state: attr(&dir.join("phys_state")).map(|s| PortState::parse(&s)),
        link_layer,
        rate: attr(&dir.join("rate")),
        netdev,
        netdev_mtu,
        active_mtu,
        gid_table_len,
        gids,
    }
}

/// The RoCE path MTU the kernel uses for a netdev MTU (`iboe_get_mtu`): the
/// largest IB MTU that fits after the GRH, UDP, BTH, extended headers and
/// ICRC (96 bytes in all).
pub fn roce_mtu(netdev_mtu: u32) -> Option<u32> {
    const OVERHEAD: u32 = 40 + 8 + 12 + 4 + 28 + 4;
    let room = netdev_mtu.checked_sub(OVERHEAD)?;
    [4096, 2048, 1024, 512, 256]
        .into_iter()
        .find(|&m| room >= m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_state_parses_kernel_format() {
        let s = PortState::parse("4: ACTIVE");
        assert_eq!((s.code, s.name.as_str()), (4, "ACTIVE"));
        let p = PortState::parse("3: Disabled");
        assert_eq!((p.code, p.name.as_str()), (3, "Disabled"));
        assert_eq!(PortState::parse("1: CA").name, "CA");
    }

    /// A copy of a fixture tree that the test may change.
    fn fixture_copy(tree: &str, tag: &str) -> std::path::PathBuf {
        let src = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures")
            .join(tree);
        let dst = std::env::temp_dir().join(format!("fl-disc-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dst);
        let ok = std::process::Command::new("cp")
            .arg("-a")
            .arg(&src)
            .arg(&dst)
            .status()
            .unwrap()
            .success();
        assert!(ok, "cp -a {}", src.display());
        dst
    }

    #[test]
    fn a_device_whose_verbs_node_is_gone_is_being_removed_and_offers_no_gid() {
        use crate::gid::{select_gid, NoGidReason, NodeAddress};
        let root = fixture_copy("rxe", "uverbs");
        let sysfs = Sysfs::new(&root);
        let addr = [NodeAddress {
            ip: "192.0.2.1".parse().unwrap(),
            netdev: Some("vA".into()),
        }];
        // No class/infiniband_verbs (ib_uverbs not loaded, or an old tree): unknown, usable.
        let inv = discover(&sysfs).unwrap();
        assert_eq!(
            (inv.devices[0].uverbs.as_deref(), inv.devices[0].removing),
            (None, false)
        );
        assert!(select_gid(&inv, &addr).is_ok());
        let before = lane_fingerprint(&sysfs);

        // The verbs node of rxe0, as ib_uverbs exposes it.
        let node = root.join("class/infiniband_verbs/uverbs0");
        std::fs::create_dir_all(&node).unwrap();
        std::fs::write(node.join("ibdev"), "rxe0\n").unwrap();
        let inv = discover(&sysfs).unwrap();
        assert_eq!(inv.devices[0].uverbs.as_deref(), Some("uverbs0"));
        assert!(!inv.devices[0].removing);
        assert_eq!(select_gid(&inv, &addr).unwrap().device, "rxe0");
        let with_node = lane_fingerprint(&sysfs);
        assert_ne!(before, with_node);

        // `rdma link delete rxe0` while a process holds it: the verbs node goes,
        // the device and its ACTIVE port stay until every process closed it.
        std::fs::remove_dir_all(&node).unwrap();
        let inv = discover(&sysfs).unwrap();
        assert!(inv.devices[0].removing);
        assert!(inv.devices[0].ports[0].is_active());
        let err = select_gid(&inv, &addr).unwrap_err();
        assert_eq!(err.reason, NoGidReason::PortDown);
        assert!(
            err.detail.contains("rxe0 is being removed"),
            "{}",
            err.detail
        );
        assert_ne!(lane_fingerprint(&sysfs), with_node, "the poll sees it");

        // A port that goes down changes the fingerprint too.
        std::fs::write(node.parent().unwrap().join("x"), "").unwrap();
        let state = root.join("class/infiniband/rxe0/ports/1/state");
        let f1 = lane_fingerprint(&sysfs);
        std::fs::write(&state, "1: DOWN\n").unwrap();
        assert_ne!(lane_fingerprint(&sysfs), f1);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn roce_mtu_matches_kernel_derivation() {
        // rxe on a 1500-byte veth reports active_mtu 1024 (softroce recipe log).
        assert_eq!(roce_mtu(1500), Some(1024));
        assert_eq!(roce_mtu(9000), Some(4096));
        assert_eq!(roce_mtu(4200), Some(4096));
        assert_eq!(roce_mtu(4000), Some(2048));
        assert_eq!(roce_mtu(300), None);
    }
}
