//! Choosing the GID the node daemon uses for RDMA traffic.
//!
//! Rules, in order:
//! 1. The node's IPv4 addresses come first: the GID wanted is the RoCE v2
//!    entry holding the IPv4-mapped address (`::ffff:a.b.c.d`). RoCE v2 is
//!    routable (UDP/IP), RoCE v1 is not, so v1 entries are never chosen.
//! 2. A node with only IPv6 uses the RoCE v2 entry holding its global IPv6
//!    address (link-local GIDs are not routable across subnets).
//! 3. An InfiniBand port is chosen through its IPoIB netdev: when the node's
//!    address lives on `ib0` of `mlx5_1`, the port GID (index 0) of that port.
//! 4. The port must be ACTIVE, and when the caller knows which netdev
//!    carries the address, the GID's netdev must be that one (a GID on a
//!    macvlan or a bond slave would send from the wrong interface).
//!
//! When nothing qualifies, [`NoUsableGid`] says why, in the order a person
//! would fix it: no devices, no address, port down, netdev mismatch, only
//! RoCE v1, GID table empty, address not in any table.

use std::net::{IpAddr, Ipv6Addr};

use serde::{Deserialize, Serialize};

use crate::discovery::{GidType, Inventory, LinkLayer};

/// One address of the node and, when known, the netdev it is on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeAddress {
    pub ip: IpAddr,
    pub netdev: Option<String>,
}

/// The GID chosen for this node's RDMA lane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SelectedGid {
    pub device: String,
    pub port: u32,
    pub gid_index: u32,
    pub gid: Ipv6Addr,
    #[serde(rename = "type")]
    pub gid_type: GidType,
    pub link_layer: LinkLayer,
    pub netdev: Option<String>,
    /// The node address the GID stands for.
    pub address: IpAddr,
    pub active_mtu: Option<u32>,
}

/// Why no GID can be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NoGidReason {
    NoDevices,
    NoNodeAddress,
    PortDown,
    NoRoceV2Gid,
    NetdevMismatch,
    AllZeroGids,
    AddressNotInGidTable,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NoUsableGid {
    pub reason: NoGidReason,
    /// What was found, in words a person can act on.
    pub detail: String,
}

impl std::fmt::Display for NoUsableGid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.detail)
    }
}

/// The GID a RoCE v2 table holds for `ip`.
pub fn gid_for_ip(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

fn usable_v6(ip: &Ipv6Addr) -> bool {
    !ip.is_loopback() && !ip.is_unspecified() && (ip.segments()[0] & 0xffc0) != 0xfe80
}

/// The addresses to try, in preference order (rules 1 and 2).
fn preferred(addrs: &[NodeAddress]) -> Vec<&NodeAddress> {
    let v4: Vec<&NodeAddress> = addrs
        .iter()
        .filter(|a| matches!(a.ip, IpAddr::V4(v) if !v.is_loopback() && !v.is_unspecified()))
        .collect();
    if !v4.is_empty() {
        return v4;
    }
    addrs
        .iter()
        .filter(|a| matches!(a.ip, IpAddr::V6(v) if usable_v6(&v)))
        .collect()
}

/// Chooses the GID for the node whose addresses are `addrs`.
pub fn select_gid(inv: &Inventory, addrs: &[NodeAddress]) -> Result<SelectedGid, NoUsableGid> {
    let fail = |reason, detail: String| Err(NoUsableGid { reason, detail });
    if inv.devices.is_empty() {
        return fail(
            NoGidReason::NoDevices,
            "no RDMA devices (sysfs class/infiniband is empty or missing)".into(),
        );
    }
    let wanted = preferred(addrs);
    if wanted.is_empty() {
        return fail(
            NoGidReason::NoNodeAddress,
            "the node has no routable IPv4 or IPv6 address to build a GID from".into(),
        );
    }

    // Problems seen on entries that would otherwise match, kept for the explanation.
    let mut down: Vec<String> = Vec::new();
    let mut v1_only: Vec<String> = Vec::new();
    let mut mismatch: Vec<String> = Vec::new();

    for want in &wanted {
        let gid = gid_for_ip(want.ip);
        for dev in &inv.devices {
            let holds_address = dev.ports.iter().any(|p| {
                p.gids.iter().any(|g| g.gid == gid)
                    || (p.link_layer == LinkLayer::InfiniBand
                        && want.netdev.is_some()
                        && want.netdev == p.netdev)
            });
            if dev.removing && holds_address {
                // Reported as a port that is down: nothing can use it, and
                // it comes back (with its ports) when the device is re-added.
                down.push(format!(
                    "{} is being removed (its /dev/infiniband verbs node is gone; the kernel \
                     finishes the removal once every process has closed the device)",
                    dev.name
                ));
                continue;
            }
            if dev.removing {
                continue;
            }
            for port in &dev.ports {
                let where_ = format!("{}/{}", dev.name, port.number);
                // Rule 3: InfiniBand through the IPoIB netdev.
                if port.link_layer == LinkLayer::InfiniBand {
                    let on_this_port = want.netdev.is_some() && want.netdev == port.netdev;
                    if !on_this_port {
                        continue;
                    }
                    let Some(g0) = port.gids.iter().find(|g| g.index == 0) else {
                        continue;
                    };
                    if !port.is_active() {
                        down.push(format!("{where_} is {} ({})", port.state, port.link_layer));
                        continue;
                    }
                    return Ok(SelectedGid {
                        device: dev.name.clone(),
                        port: port.number,
                        gid_index: g0.index,
                        gid: g0.gid,
                        gid_type: g0.gid_type.unwrap_or(GidType::IbRoceV1),
                        link_layer: port.link_layer,
                        netdev: port.netdev.clone(),
                        address: want.ip,
                        active_mtu: port.active_mtu,
                    });
                }
                for entry in port.gids.iter().filter(|g| g.gid == gid) {
                    let at = format!("{where_} gid[{}] {}", entry.index, entry.gid);
                    if entry.gid_type != Some(GidType::RoceV2) {
                        v1_only.push(format!(
                            "{at} is {}",
                            entry
                                .gid_type
                                .map(|t| t.to_string())
                                .unwrap_or("untyped".into())
                        ));
                        continue;
                    }
                    if let (Some(node_dev), Some(gid_dev)) = (&want.netdev, &entry.netdev) {
                        if node_dev != gid_dev {
                            mismatch.push(format!(
                                "{at} belongs to netdev {gid_dev}, but {} is on {node_dev}",
                                want.ip
                            ));
                            continue;
                        }
                    }
                    if !port.is_active() {
                        down.push(format!("{where_} is {} (its GID {at} matches)", port.state));
                        continue;
                    }
                    return Ok(SelectedGid {
                        device: dev.name.clone(),
                        port: port.number,
                        gid_index: entry.index,
                        gid: entry.gid,
                        gid_type: GidType::RoceV2,
                        link_layer: port.link_layer,
                        netdev: entry.netdev.clone().or_else(|| port.netdev.clone()),
                        address: want.ip,
                        active_mtu: port.active_mtu,
                    });
                }
            }
        }
    }

    let addr_list = wanted
        .iter()
        .map(|a| match &a.netdev {
            Some(n) => format!("{} on {n}", a.ip),
            None => a.ip.to_string(),
        })
        .collect::<Vec<_>>()
        .join(", ");
    if !down.is_empty() {
        return fail(
            NoGidReason::PortDown,
            format!("port not ACTIVE: {}", down.join("; ")),
        );
    }
    // A RoCE v2 entry on the wrong netdev says more than its v1 twin.
    if !mismatch.is_empty() {
        return fail(NoGidReason::NetdevMismatch, mismatch.join("; "));
    }
    if !v1_only.is_empty() {
        return fail(
            NoGidReason::NoRoceV2Gid,
            format!(
                "the node address has only non-RoCE-v2 GIDs ({}); RoCE v1 is not routable",
                v1_only.join("; ")
            ),
        );
    }
    let populated = inv
        .devices
        .iter()
        .flat_map(|d| &d.ports)
        .any(|p| !p.gids.is_empty());
    if !populated {
        return fail(
            NoGidReason::AllZeroGids,
            "every GID table is empty (all-zero entries): the RDMA netdevs have no addresses, \
             or the device is not bound to a netdev"
                .into(),
        );
    }
    let rdma_netdevs = inv
        .devices
        .iter()
        .flat_map(|d| {
            d.ports.iter().map(move |p| {
                format!(
                    "{}/{} on {}",
                    d.name,
                    p.number,
                    p.netdev.as_deref().unwrap_or("no netdev")
                )
            })
        })
        .collect::<Vec<_>>()
        .join(", ");
    fail(
        NoGidReason::AddressNotInGidTable,
        format!(
            "no RDMA port has a RoCE v2 GID for the node address ({addr_list}); RDMA ports: {rdma_netdevs}"
        ),
    )
}
