//! Interface addresses.

use std::io;
use std::net::IpAddr;

use ipnetwork::IpNetwork;
use netlink_packet_core::{NLM_F_CREATE, NLM_F_EXCL};
use netlink_packet_route::address::{AddressAttribute, AddressFlags, AddressMessage};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};

use super::RtNetlink;
use crate::cni::ipam::addr::network_first_last;

fn family(ip: IpAddr) -> AddressFamily {
    if ip.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    }
}

/// RTM_NEWADDR for `addr` on `index`. IPv6 addresses skip duplicate address
/// detection (IFA_F_NODAD): the address is usable at once, no DAD wait.
pub fn new_addr_msg(index: u32, addr: IpNetwork) -> (RouteNetlinkMessage, u16) {
    let mut m = AddressMessage::default();
    m.header.family = family(addr.ip());
    m.header.prefix_len = addr.prefix();
    m.header.index = index;
    m.attributes.push(AddressAttribute::Local(addr.ip()));
    m.attributes.push(AddressAttribute::Address(addr.ip()));
    match addr {
        IpNetwork::V4(_) => {
            if let (_, IpAddr::V4(b)) = network_first_last(addr) {
                m.attributes.push(AddressAttribute::Broadcast(b));
            }
        }
        IpNetwork::V6(_) => m
            .attributes
            .push(AddressAttribute::Flags(AddressFlags::Nodad)),
    }
    (
        RouteNetlinkMessage::NewAddress(m),
        NLM_F_CREATE | NLM_F_EXCL,
    )
}

pub fn del_addr_msg(index: u32, addr: IpNetwork) -> RouteNetlinkMessage {
    let mut m = AddressMessage::default();
    m.header.family = family(addr.ip());
    m.header.prefix_len = addr.prefix();
    m.header.index = index;
    m.attributes.push(AddressAttribute::Local(addr.ip()));
    m.attributes.push(AddressAttribute::Address(addr.ip()));
    RouteNetlinkMessage::DelAddress(m)
}

/// Addresses on `index` (both families), as address/prefix.
pub fn list(nl: &mut RtNetlink, index: u32) -> io::Result<Vec<IpNetwork>> {
    list_family(nl, index, None)
}

/// Addresses on `index` of one family (`Some(true)` IPv4) or both. A
/// single-family dump is served without RTNL by current kernels.
pub fn list_family(nl: &mut RtNetlink, index: u32, v4: Option<bool>) -> io::Result<Vec<IpNetwork>> {
    let mut m = AddressMessage::default();
    m.header.index = index;
    if let Some(v4) = v4 {
        m.header.family = if v4 {
            AddressFamily::Inet
        } else {
            AddressFamily::Inet6
        };
    }
    let mut out = Vec::new();
    for msg in nl.dump(RouteNetlinkMessage::GetAddress(m))? {
        let RouteNetlinkMessage::NewAddress(a) = msg else {
            continue;
        };
        if a.header.index != index {
            continue;
        }
        let ip = a.attributes.iter().find_map(|x| match x {
            AddressAttribute::Local(ip) => Some(*ip),
            _ => None,
        });
        let ip = ip.or_else(|| {
            a.attributes.iter().find_map(|x| match x {
                AddressAttribute::Address(ip) => Some(*ip),
                _ => None,
            })
        });
        if let Some(ip) = ip {
            if let Ok(n) = IpNetwork::new(ip, a.header.prefix_len) {
                out.push(n);
            }
        }
    }
    Ok(out)
}
