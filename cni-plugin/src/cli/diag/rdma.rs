//! RDMA devices, ports and the GID the cross-node lane would use, from
//! sysfs (no RDMA library needed). A node without RDMA is fine: its
//! cross-node traffic stays on TCP.

use std::net::IpAddr;
use std::path::Path;

use flowlane_rdma_discovery::{
    discover, select_gid, GidType, Inventory, NoGidReason, NodeAddress, SelectedGid, Sysfs,
};

use super::netinfo;
use super::report::Section;

/// The section, the inventory, and the GID the RDMA lane would use.
pub fn check(
    sysfs_root: &Path,
    node_ip: Option<IpAddr>,
) -> (Section, Inventory, Option<SelectedGid>) {
    let mut s = Section::new(
        "rdma",
        format!("RDMA ({}/class/infiniband)", sysfs_root.display()),
    );
    let inv = match discover(&Sysfs::new(sysfs_root)) {
        Ok(i) => i,
        Err(e) => {
            s.warn(
                "rdma.unreadable",
                format!("cannot read RDMA devices: {e}"),
                "check that sysfs is mounted (the daemon's container needs /sys)",
            );
            return (s, Inventory::default(), None);
        }
    };
    if inv.devices.is_empty() {
        s.info(
            "rdma.none",
            "no RDMA devices: traffic to other nodes stays on TCP",
        );
        s.data = serde_json::json!({ "inventory": inv });
        return (s, inv, None);
    }
    for d in &inv.devices {
        let kind = match (&d.driver, &d.parent) {
            (Some(drv), _) => drv.clone(),
            (None, Some(p)) => format!("software, on {p}"),
            (None, None) => "software".into(),
        };
        s.info(
            "rdma.device",
            format!(
                "{}: {} ({kind}), fw {}, node GUID {}",
                d.name,
                d.node_type.as_deref().unwrap_or("?"),
                d.fw_ver.as_deref().unwrap_or("?"),
                d.node_guid.as_deref().unwrap_or("?")
            ),
        );
        for p in &d.ports {
            let v2 = p
                .gids
                .iter()
                .filter(|g| g.gid_type == Some(GidType::RoceV2))
                .count();
            let mut text =
                format!(
                "{}/{}: {}, {}, {}, {}, netdev {}, active MTU {}, {} GID(s) ({v2} RoCE v2) of {}",
                d.name,
                p.number,
                p.state.name,
                p.phys_state.as_ref().map(|s| s.name.as_str()).unwrap_or("?"),
                p.link_layer,
                p.rate.as_deref().unwrap_or("rate ?"),
                p.netdev.as_deref().unwrap_or("-"),
                p.active_mtu.map(|m| m.to_string()).unwrap_or("? (not in sysfs)".into()),
                p.gids.len(),
                p.gid_table_len
            );
            for g in &p.gids {
                let line = format!(
                    "\n  gid[{}] {} {} {}",
                    g.index,
                    g.gid,
                    g.gid_type.map(|t| t.to_string()).unwrap_or("-".into()),
                    g.netdev.as_deref().unwrap_or("")
                );
                text.push_str(line.trim_end());
            }
            if p.is_active() {
                s.info("rdma.port", text);
            } else {
                s.warn(
                    "rdma.port_down",
                    text,
                    format!(
                        "check the cable/switch port of {}; `ip link set {} up` for RoCE",
                        d.name,
                        p.netdev.as_deref().unwrap_or("<netdev>")
                    ),
                );
            }
        }
    }
    if sysfs_root == Path::new("/sys") && !Path::new("/dev/infiniband").exists() {
        s.warn(
            "rdma.no_uverbs",
            "RDMA devices exist but /dev/infiniband does not: user-space verbs cannot open them",
            "modprobe ib_uverbs (and rdma_ucm); the daemon's container needs /dev/infiniband",
        );
    }

    let addrs = node_addresses(node_ip);
    let selection = select_gid(&inv, &addrs);
    match &selection {
        Ok(g) => s.ok(
            "rdma.gid_selected",
            format!(
                "RDMA lane: {}/{} gid[{}] {} ({}, netdev {}, for {})",
                g.device,
                g.port,
                g.gid_index,
                g.gid,
                g.gid_type,
                g.netdev.as_deref().unwrap_or("-"),
                g.address
            ),
        ),
        Err(e) => s.warn(
            "rdma.no_usable_gid",
            format!("no usable GID, cross-node traffic stays on TCP: {e}"),
            fix_for(e.reason),
        ),
    }
    s.data = serde_json::json!({
        "inventory": inv,
        "node_addresses": addrs,
        "selection": match &selection {
            Ok(g) => serde_json::json!({ "selected": g }),
            Err(e) => serde_json::json!({ "none": e }),
        },
    });
    (s, inv, selection.ok())
}

fn fix_for(r: NoGidReason) -> &'static str {
    match r {
        NoGidReason::NoDevices => "nothing to do unless this node should have RDMA",
        NoGidReason::NoNodeAddress => "give the node's underlay interface an address, or pass --node-ip",
        NoGidReason::PortDown => "bring the port up: cable/switch for InfiniBand, `ip link set <netdev> up` for RoCE",
        NoGidReason::NoRoceV2Gid => {
            "enable RoCE v2 (mlx5: `cma_roce_mode -d <dev> -p 1 -m 2`; it is the default on ConnectX-4 and later)"
        }
        NoGidReason::NetdevMismatch => {
            "put the node IP on the RDMA netdev itself (not on a macvlan/bridge on top of it), or pass --node-ip"
        }
        NoGidReason::AllZeroGids => "assign the node's IP to the RDMA netdev; the kernel fills the GID table from its addresses",
        NoGidReason::AddressNotInGidTable => {
            "the node IP is on a netdev without RDMA: use the RDMA NIC's address as the node's underlay address, \
             or pass --node-ip"
        }
    }
}

/// The node's addresses: `--node-ip` when given, else those of the
/// interface holding the default route, else every non-loopback address.
fn node_addresses(node_ip: Option<IpAddr>) -> Vec<NodeAddress> {
    let all = netinfo::addresses();
    if let Some(ip) = node_ip {
        let netdev = all
            .iter()
            .find(|a| a.addr.ip() == ip)
            .map(|a| a.ifname.clone());
        return vec![NodeAddress { ip, netdev }];
    }
    let default_dev = netinfo::routes()
        .into_iter()
        .find(|r| r.dst.prefix() == 0)
        .map(|r| r.dev);
    let pick = |a: &netinfo::IfAddr| match &default_dev {
        Some(d) => &a.ifname == d,
        None => a.ifname != "lo",
    };
    all.iter()
        .filter(|a| pick(a))
        .map(|a| NodeAddress {
            ip: a.addr.ip(),
            netdev: Some(a.ifname.clone()),
        })
        .collect()
}
