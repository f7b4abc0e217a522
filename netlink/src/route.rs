//! Listing the routes of one family.

use std::io;
use std::net::IpAddr;

use ipnetwork::IpNetwork;
use netlink_packet_route::route::{RouteAddress, RouteAttribute, RouteMessage};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};

use crate::RtNetlink;

/// A route as the kernel reports it (what the callers compare).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelRoute {
    pub dst: IpNetwork,
    pub gw: Option<IpAddr>,
    pub oif: Option<u32>,
    /// `rtm_protocol` (who made it: boot, kernel, a daemon's own number).
    pub protocol: u8,
    /// `rtm_table` (254: main).
    pub table: u8,
}

/// The routes of one family, every table.
pub fn list(nl: &mut RtNetlink, v4: bool) -> io::Result<Vec<KernelRoute>> {
    let mut m = RouteMessage::default();
    m.header.address_family = if v4 {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let mut out = Vec::new();
    for msg in nl.dump(RouteNetlinkMessage::GetRoute(m))? {
        let RouteNetlinkMessage::NewRoute(r) = msg else {
            continue;
        };
        let mut dst_ip: Option<IpAddr> = None;
        let mut gw = None;
        let mut oif = None;
        for a in &r.attributes {
            match a {
                RouteAttribute::Destination(RouteAddress::Inet(a)) => dst_ip = Some((*a).into()),
                RouteAttribute::Destination(RouteAddress::Inet6(a)) => dst_ip = Some((*a).into()),
                RouteAttribute::Gateway(RouteAddress::Inet(a)) => gw = Some((*a).into()),
                RouteAttribute::Gateway(RouteAddress::Inet6(a)) => gw = Some((*a).into()),
                RouteAttribute::Oif(i) => oif = Some(*i),
                _ => {}
            }
        }
        let dst_ip = dst_ip.unwrap_or(if v4 {
            IpAddr::from([0u8; 4])
        } else {
            IpAddr::from([0u16; 8])
        });
        if let Ok(dst) = IpNetwork::new(dst_ip, r.header.destination_prefix_length) {
            out.push(KernelRoute {
                dst,
                gw,
                oif,
                protocol: u8::from(r.header.protocol),
                table: r.header.table,
            });
        }
    }
    Ok(out)
}
