//! Routes in the pod.

use std::io;
use std::net::IpAddr;

use netlink_packet_core::{NLM_F_CREATE, NLM_F_EXCL};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteMetric, RouteProtocol,
    RouteScope, RouteType,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};

use super::RtNetlink;
use crate::cni::result::Route;

const RT_TABLE_MAIN: u32 = 254;

/// RTM_NEWROUTE for a result route out of `index`.
pub fn new_route_msg(index: u32, r: &Route) -> (RouteNetlinkMessage, u16) {
    let mut m = RouteMessage::default();
    let v4 = r.dst.is_ipv4();
    m.header.address_family = if v4 {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    m.header.destination_prefix_length = r.dst.prefix();
    let table = r.table.unwrap_or(RT_TABLE_MAIN);
    m.header.table = if table < 256 {
        table as u8
    } else {
        RouteHeader::RT_TABLE_UNSPEC
    };
    m.header.protocol = RouteProtocol::Boot;
    m.header.kind = RouteType::Unicast;
    m.header.scope = match r.scope {
        Some(253) => RouteScope::Link,
        Some(254) => RouteScope::Host,
        Some(_) => RouteScope::Universe,
        None if r.gw.is_none() => RouteScope::Link,
        None => RouteScope::Universe,
    };
    if r.dst.prefix() > 0 {
        m.attributes
            .push(RouteAttribute::Destination(RouteAddress::from(
                r.dst.network(),
            )));
    }
    if let Some(gw) = r.gw {
        m.attributes
            .push(RouteAttribute::Gateway(RouteAddress::from(gw)));
    }
    m.attributes.push(RouteAttribute::Oif(index));
    if table >= 256 {
        m.attributes.push(RouteAttribute::Table(table));
    }
    if let Some(p) = r.priority {
        m.attributes.push(RouteAttribute::Priority(p));
    }
    let mut metrics = Vec::new();
    if let Some(mtu) = r.mtu {
        metrics.push(RouteMetric::Mtu(mtu));
    }
    if let Some(a) = r.advmss {
        metrics.push(RouteMetric::Advmss(a));
    }
    if !metrics.is_empty() {
        m.attributes.push(RouteAttribute::Metrics(metrics));
    }
    (RouteNetlinkMessage::NewRoute(m), NLM_F_CREATE | NLM_F_EXCL)
}

/// A route as CHECK compares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelRoute {
    pub dst: ipnetwork::IpNetwork,
    pub gw: Option<IpAddr>,
    pub oif: Option<u32>,
}

/// Routes of one family (every table).
pub fn list(nl: &mut RtNetlink, v4: bool) -> io::Result<Vec<KernelRoute>> {
    Ok(flowlane_netlink::route::list(nl, v4)?
        .into_iter()
        .map(|r| KernelRoute {
            dst: r.dst,
            gw: r.gw,
            oif: r.oif,
        })
        .collect())
}
