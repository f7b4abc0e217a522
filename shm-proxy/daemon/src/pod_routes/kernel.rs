//! The kernel half of pod routing over rtnetlink (no `ip` processes):
//! this node's connected subnets, flowlane's routes (tagged with
//! [`RTPROT_FLOWLANE`], the only ones it lists as its own, changes or
//! deletes), the VXLAN device and its FDB and neighbour entries.

use std::collections::BTreeSet;
use std::io;
use std::net::{IpAddr, Ipv4Addr};

use flowlane_netlink::{errno, RtNetlink};
use ipnetwork::IpNetwork;
use netlink_packet_core::{NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE};
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::link::{
    InfoData, InfoKind, InfoVxlan, LinkAttribute, LinkFlags, LinkInfo, LinkMessage,
};
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteFlags, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};

use super::plan::{LocalVtep, Route, Via, VxlanPeer};

/// The route protocol number flowlane's routes carry (`ip route` shows
/// `proto 122`); unassigned in the kernel's and iproute2's lists.
pub const RTPROT_FLOWLANE: u8 = 122;
/// The VXLAN device.
pub const VXLAN_DEV: &str = "flowlane.1";
pub const VXLAN_VNI: u32 = 1;
/// UDP port of the tunnel (the Linux and flannel default, not IANA's 4789).
pub const VXLAN_PORT: u16 = 8472;
/// The tunnel costs 50 bytes of an IPv4 underlay's MTU.
const VXLAN_OVERHEAD: u32 = 50;
const RT_TABLE_MAIN: u8 = 254;

fn family(v4: bool) -> AddressFamily {
    if v4 {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    }
}

/// The link index of `name`, `None` when there is none.
pub fn link_index(nl: &mut RtNetlink, name: &str) -> io::Result<Option<u32>> {
    let mut m = LinkMessage::default();
    m.attributes.push(LinkAttribute::IfName(name.to_string()));
    match nl.get(RouteNetlinkMessage::GetLink(m)) {
        Ok(RouteNetlinkMessage::NewLink(m)) => Ok(Some(m.header.index)),
        Ok(_) => Ok(None),
        Err(e) if errno(&e) == libc::ENODEV => Ok(None),
        Err(e) => Err(e),
    }
}

/// This node's addresses with their prefixes, but for links in `skip`,
/// and the MTU of the link holding `underlay`.
pub fn connected(
    nl: &mut RtNetlink,
    skip: &[u32],
    underlay: Option<IpAddr>,
) -> io::Result<(Vec<IpNetwork>, Option<u32>)> {
    let mut out = Vec::new();
    let mut underlay_link = None;
    for msg in nl.dump(RouteNetlinkMessage::GetAddress(AddressMessage::default()))? {
        let RouteNetlinkMessage::NewAddress(a) = msg else {
            continue;
        };
        if skip.contains(&a.header.index) {
            continue;
        }
        let ip = a.attributes.iter().find_map(|x| match x {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        });
        if let Some(ip) = ip {
            if Some(ip) == underlay {
                underlay_link = Some(a.header.index);
            }
            if let Ok(n) = IpNetwork::new(ip, a.header.prefix_len) {
                if !ip.is_loopback() {
                    out.push(n);
                }
            }
        }
    }
    let mtu = match underlay_link {
        Some(i) => link_mtu(nl, i)?,
        None => None,
    };
    Ok((out, mtu))
}

fn link_mtu(nl: &mut RtNetlink, index: u32) -> io::Result<Option<u32>> {
    let mut m = LinkMessage::default();
    m.header.index = index;
    Ok(match nl.get(RouteNetlinkMessage::GetLink(m))? {
        RouteNetlinkMessage::NewLink(m) => m.attributes.iter().find_map(|a| match a {
            LinkAttribute::Mtu(v) => Some(*v),
            _ => None,
        }),
        _ => None,
    })
}

/// A route of flowlane's found in the main table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Installed {
    pub dst: IpNetwork,
    pub gw: Option<IpAddr>,
    pub oif: Option<u32>,
}

impl Installed {
    /// Whether this route, as the kernel lists it, is the planned `want`
    /// ([`installed_form`]). A host-gw route is planned without a device,
    /// but the kernel lists the device it resolved the gateway to: any
    /// device then matches (comparing it exactly would delete and re-add
    /// every route on every round).
    pub fn satisfies(&self, want: &Installed) -> bool {
        self.dst == want.dst && self.gw == want.gw && (want.oif.is_none() || self.oif == want.oif)
    }
}

/// flowlane's routes (protocol [`RTPROT_FLOWLANE`]) in the main table.
pub fn own_routes(nl: &mut RtNetlink) -> io::Result<Vec<Installed>> {
    let mut out = Vec::new();
    for v4 in [true, false] {
        out.extend(
            flowlane_netlink::route::list(nl, v4)?
                .into_iter()
                .filter(|r| r.protocol == RTPROT_FLOWLANE && r.table == RT_TABLE_MAIN)
                .map(|r| Installed {
                    dst: r.dst,
                    gw: r.gw,
                    oif: r.oif,
                }),
        );
    }
    Ok(out)
}

fn route_msg(dst: IpNetwork, gw: Option<IpAddr>, oif: Option<u32>, onlink: bool) -> RouteMessage {
    let mut m = RouteMessage::default();
    m.header.address_family = family(dst.is_ipv4());
    m.header.destination_prefix_length = dst.prefix();
    m.header.table = RT_TABLE_MAIN;
    m.header.protocol = RouteProtocol::Other(RTPROT_FLOWLANE);
    m.header.kind = RouteType::Unicast;
    m.header.scope = RouteScope::Universe;
    if onlink {
        m.header.flags |= RouteFlags::Onlink;
    }
    m.attributes
        .push(RouteAttribute::Destination(RouteAddress::from(
            dst.network(),
        )));
    if let Some(gw) = gw {
        m.attributes
            .push(RouteAttribute::Gateway(RouteAddress::from(gw)));
    }
    if let Some(oif) = oif {
        m.attributes.push(RouteAttribute::Oif(oif));
    }
    m
}

/// What a planned route looks like installed (`vxlan`: the device's index).
pub fn installed_form(r: &Route, vxlan: Option<u32>) -> Installed {
    match r.via {
        Via::Gateway(gw) => Installed {
            dst: r.dst,
            gw: Some(gw),
            oif: None,
        },
        Via::Vxlan(ip) => Installed {
            dst: r.dst,
            gw: Some(ip.into()),
            oif: vxlan,
        },
    }
}

/// Adds a route; never replaces one (a route to the same prefix that
/// flowlane did not make stays: EEXIST).
pub fn add_route(nl: &mut RtNetlink, r: &Route, vxlan: Option<u32>) -> io::Result<()> {
    let (gw, oif, onlink) = match r.via {
        Via::Gateway(gw) => (Some(gw), None, false),
        Via::Vxlan(ip) => (Some(IpAddr::V4(ip)), vxlan, true),
    };
    nl.request(
        RouteNetlinkMessage::NewRoute(route_msg(r.dst, gw, oif, onlink)),
        NLM_F_CREATE | NLM_F_EXCL,
    )
}

/// Deletes one of flowlane's routes (by its protocol too: the kernel
/// deletes only a route of that protocol). Gone already is fine.
pub fn del_route(nl: &mut RtNetlink, r: &Installed) -> io::Result<()> {
    match nl.request(
        RouteNetlinkMessage::DelRoute(route_msg(r.dst, r.gw, r.oif, false)),
        0,
    ) {
        Err(e) if errno(&e) == libc::ESRCH => Ok(()),
        other => other,
    }
}

/// The VXLAN device's local address, when it exists: `Some(None)` for a
/// device without one (or of another kind).
fn vxlan_local(nl: &mut RtNetlink) -> io::Result<Option<(u32, Option<Ipv4Addr>)>> {
    let mut m = LinkMessage::default();
    m.attributes
        .push(LinkAttribute::IfName(VXLAN_DEV.to_string()));
    let m = match nl.get(RouteNetlinkMessage::GetLink(m)) {
        Ok(RouteNetlinkMessage::NewLink(m)) => m,
        Ok(_) => return Ok(None),
        Err(e) if errno(&e) == libc::ENODEV => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut local = None;
    for a in &m.attributes {
        if let LinkAttribute::LinkInfo(infos) = a {
            for i in infos {
                if let LinkInfo::Data(InfoData::Vxlan(v)) = i {
                    for x in v {
                        if let InfoVxlan::Local(ip) = x {
                            local = Some(*ip);
                        }
                    }
                }
            }
        }
    }
    Ok(Some((m.header.index, local)))
}

/// Makes the VXLAN device match `vtep` (created, or re-created when its
/// local address changed), up, with the VTEP address as its only one.
/// Returns its index.
pub fn ensure_vxlan(nl: &mut RtNetlink, vtep: &LocalVtep, mtu: Option<u32>) -> io::Result<u32> {
    let index = match vxlan_local(nl)? {
        Some((i, Some(local))) if local == vtep.underlay => Some(i),
        Some((i, _)) => {
            tracing::info!(
                device = VXLAN_DEV,
                "underlay address changed; re-creating the VXLAN device"
            );
            delete_link(nl, i)?;
            None
        }
        None => None,
    };
    let index = match index {
        Some(i) => i,
        None => {
            let mut m = LinkMessage::default();
            m.header.flags |= LinkFlags::Up;
            m.header.change_mask |= LinkFlags::Up;
            m.attributes
                .push(LinkAttribute::IfName(VXLAN_DEV.to_string()));
            m.attributes.push(LinkAttribute::Address(vtep.mac.to_vec()));
            if let Some(mtu) = mtu {
                m.attributes
                    .push(LinkAttribute::Mtu(mtu.saturating_sub(VXLAN_OVERHEAD)));
            }
            m.attributes.push(LinkAttribute::LinkInfo(vec![
                LinkInfo::Kind(InfoKind::Vxlan),
                LinkInfo::Data(InfoData::Vxlan(vec![
                    InfoVxlan::Id(VXLAN_VNI),
                    InfoVxlan::Local(vtep.underlay),
                    InfoVxlan::Port(VXLAN_PORT),
                    InfoVxlan::Learning(false),
                ])),
            ]));
            nl.request(RouteNetlinkMessage::NewLink(m), NLM_F_CREATE | NLM_F_EXCL)?;
            tracing::info!(device = VXLAN_DEV, vni = VXLAN_VNI, port = VXLAN_PORT, local = %vtep.underlay, "VXLAN device created");
            link_index(nl, VXLAN_DEV)?
                .ok_or_else(|| io::Error::other("the VXLAN device vanished after its creation"))?
        }
    };
    // Up (a restart finds it up; a hand-downed one comes back).
    let mut m = LinkMessage::default();
    m.header.index = index;
    m.header.flags |= LinkFlags::Up;
    m.header.change_mask |= LinkFlags::Up;
    nl.request(RouteNetlinkMessage::SetLink(m), 0)?;
    // Its address: the VTEP address only.
    let want = IpNetwork::new(IpAddr::V4(vtep.vtep_ip), 32).map_err(io::Error::other)?;
    let mut have = Vec::new();
    let mut q = AddressMessage::default();
    q.header.index = index;
    for msg in nl.dump(RouteNetlinkMessage::GetAddress(q))? {
        if let RouteNetlinkMessage::NewAddress(a) = msg {
            if a.header.index != index {
                continue;
            }
            for x in &a.attributes {
                if let AddressAttribute::Address(ip) = x {
                    have.push((*ip, a.header.prefix_len, a.header.family));
                }
            }
        }
    }
    for (ip, len, fam) in &have {
        if (*ip, *len) != (want.ip(), 32) && ip.is_ipv4() {
            let mut d = AddressMessage::default();
            d.header.index = index;
            d.header.family = *fam;
            d.header.prefix_len = *len;
            d.attributes.push(AddressAttribute::Address(*ip));
            d.attributes.push(AddressAttribute::Local(*ip));
            nl.request(RouteNetlinkMessage::DelAddress(d), 0)?;
        }
    }
    if !have
        .iter()
        .any(|(ip, len, _)| (*ip, *len) == (want.ip(), 32))
    {
        let mut a = AddressMessage::default();
        a.header.index = index;
        a.header.family = AddressFamily::Inet;
        a.header.prefix_len = 32;
        a.attributes.push(AddressAttribute::Address(want.ip()));
        a.attributes.push(AddressAttribute::Local(want.ip()));
        nl.request(
            RouteNetlinkMessage::NewAddress(a),
            NLM_F_CREATE | NLM_F_EXCL,
        )?;
    }
    Ok(index)
}

fn delete_link(nl: &mut RtNetlink, index: u32) -> io::Result<()> {
    let mut m = LinkMessage::default();
    m.header.index = index;
    match nl.request(RouteNetlinkMessage::DelLink(m), 0) {
        Err(e) if errno(&e) == libc::ENODEV => Ok(()),
        other => other,
    }
}

/// Deletes the VXLAN device (its routes, FDB and neighbour entries go with
/// it); true when there was one.
pub fn remove_vxlan(nl: &mut RtNetlink) -> io::Result<bool> {
    match link_index(nl, VXLAN_DEV)? {
        Some(i) => delete_link(nl, i).map(|_| true),
        None => Ok(false),
    }
}

fn neigh_msg(index: u32, bridge: bool, peer: &VxlanPeer) -> NeighbourMessage {
    let mut m = NeighbourMessage::default();
    m.header.ifindex = index;
    m.header.state = NeighbourState::Permanent;
    m.header.kind = RouteType::Unicast;
    if bridge {
        // FDB: the peer's MAC lives behind its underlay address.
        m.header.family = AddressFamily::Bridge;
        m.header.flags = NeighbourFlags::Own;
        m.attributes
            .push(NeighbourAttribute::LinkLayerAddress(peer.mac.to_vec()));
        m.attributes
            .push(NeighbourAttribute::Destination(NeighbourAddress::Inet(
                peer.underlay,
            )));
    } else {
        // ARP: the peer's VTEP address has the peer's MAC.
        m.header.family = AddressFamily::Inet;
        m.attributes
            .push(NeighbourAttribute::Destination(NeighbourAddress::Inet(
                peer.vtep_ip,
            )));
        m.attributes
            .push(NeighbourAttribute::LinkLayerAddress(peer.mac.to_vec()));
    }
    m
}

/// A permanent entry found on the device: (bridge FDB?, MAC, address).
type Entry = (bool, Vec<u8>, Option<Ipv4Addr>);

fn entries(nl: &mut RtNetlink, index: u32) -> io::Result<Vec<Entry>> {
    let mut out = Vec::new();
    for bridge in [true, false] {
        let mut q = NeighbourMessage::default();
        q.header.family = if bridge {
            AddressFamily::Bridge
        } else {
            AddressFamily::Inet
        };
        q.header.ifindex = index;
        for msg in nl.dump(RouteNetlinkMessage::GetNeighbour(q))? {
            let RouteNetlinkMessage::NewNeighbour(n) = msg else {
                continue;
            };
            if n.header.ifindex != index || n.header.state != NeighbourState::Permanent {
                continue;
            }
            let mut mac = Vec::new();
            let mut ip = None;
            for a in n.attributes {
                match a {
                    NeighbourAttribute::LinkLayerAddress(m) => mac = m,
                    NeighbourAttribute::Destination(NeighbourAddress::Inet(a)) => ip = Some(a),
                    _ => {}
                }
            }
            out.push((bridge, mac, ip));
        }
    }
    Ok(out)
}

/// Makes the device's permanent FDB and neighbour entries exactly `peers`'.
pub fn sync_peers(nl: &mut RtNetlink, index: u32, peers: &BTreeSet<VxlanPeer>) -> io::Result<()> {
    let want: Vec<Entry> = peers
        .iter()
        .flat_map(|p| {
            [
                (true, p.mac.to_vec(), Some(p.underlay)),
                (false, p.mac.to_vec(), Some(p.vtep_ip)),
            ]
        })
        .collect();
    for e in entries(nl, index)? {
        // The kernel's own all-zero default FDB entry is not one of ours.
        if want.contains(&e) || e.1.iter().all(|b| *b == 0) {
            continue;
        }
        let (bridge, mac, ip) = e;
        let mut m = NeighbourMessage::default();
        m.header.ifindex = index;
        m.header.family = if bridge {
            AddressFamily::Bridge
        } else {
            AddressFamily::Inet
        };
        if bridge {
            m.header.flags = NeighbourFlags::Own;
            m.attributes.push(NeighbourAttribute::LinkLayerAddress(mac));
        }
        if let Some(ip) = ip {
            m.attributes
                .push(NeighbourAttribute::Destination(NeighbourAddress::Inet(ip)));
        }
        match nl.request(RouteNetlinkMessage::DelNeighbour(m), 0) {
            Err(e) if errno(&e) != libc::ENOENT => return Err(e),
            _ => {}
        }
    }
    for p in peers {
        for bridge in [true, false] {
            nl.request(
                RouteNetlinkMessage::NewNeighbour(neigh_msg(index, bridge, p)),
                NLM_F_CREATE | NLM_F_REPLACE,
            )?;
        }
    }
    Ok(())
}
