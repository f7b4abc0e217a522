//! Links: look up, create the bridge, create the veth pair with its
//! container end born inside the pod netns, delete, bridge port flags.

use std::io;
use std::os::fd::RawFd;

use netlink_packet_core::{DefaultNla, NLM_F_CREATE, NLM_F_EXCL};
use netlink_packet_route::link::{
    InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage,
    LinkProtoInfoBridge,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};

use super::{errno, RtNetlink};

/// What we need to know about a link.
#[derive(Debug, Clone, Default)]
pub struct Link {
    pub index: u32,
    pub name: String,
    pub mac: Vec<u8>,
    pub up: bool,
    pub promisc: bool,
    pub mtu: u32,
    pub kind: Option<String>,
    pub controller: Option<u32>,
}

impl Link {
    fn from_msg(m: LinkMessage) -> Link {
        let mut l = Link {
            index: m.header.index,
            up: m.header.flags.contains(LinkFlags::Up),
            promisc: m.header.flags.contains(LinkFlags::Promisc),
            ..Default::default()
        };
        for a in m.attributes {
            match a {
                LinkAttribute::IfName(n) => l.name = n,
                LinkAttribute::Address(mac) => l.mac = mac,
                LinkAttribute::Mtu(mtu) => l.mtu = mtu,
                LinkAttribute::Controller(c) => l.controller = Some(c),
                LinkAttribute::LinkInfo(infos) => {
                    for i in infos {
                        if let LinkInfo::Kind(k) = i {
                            l.kind = Some(k.to_string());
                        }
                    }
                }
                _ => {}
            }
        }
        l
    }
}

/// Formats a MAC as the results print it ("0a:1b:...").
pub fn mac_string(mac: &[u8]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// A random locally administered unicast MAC. Choosing MACs ourselves
/// saves a round trip to read back what the kernel picked, and pins the
/// bridge's MAC so it does not follow its lowest-numbered port.
pub fn random_mac() -> Vec<u8> {
    let mut b = [0u8; 6];
    // SAFETY: getrandom writes at most b.len() bytes into the buffer we own.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        // Extremely unlikely; fall back to time and pid mixing.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
            ^ ((std::process::id() as u128) << 64);
        b.copy_from_slice(&t.to_le_bytes()[..6]);
    }
    b[0] = (b[0] & 0xfe) | 0x02;
    b.to_vec()
}

/// The link called `name`, `None` if there is none.
pub fn by_name(nl: &mut RtNetlink, name: &str) -> io::Result<Option<Link>> {
    let mut m = LinkMessage::default();
    m.attributes.push(LinkAttribute::IfName(name.to_string()));
    match nl.get(RouteNetlinkMessage::GetLink(m)) {
        Ok(RouteNetlinkMessage::NewLink(m)) => Ok(Some(Link::from_msg(m))),
        Ok(_) => Ok(None),
        Err(e) if errno(&e) == libc::ENODEV => Ok(None),
        Err(e) => Err(e),
    }
}

fn up_flags(m: &mut LinkMessage) {
    m.header.flags |= LinkFlags::Up;
    m.header.change_mask |= LinkFlags::Up;
}

/// Creates an up bridge; EEXIST is returned to the caller (a concurrent
/// ADD may have won the race).
pub fn create_bridge(
    nl: &mut RtNetlink,
    name: &str,
    mtu: Option<u32>,
    promisc: bool,
) -> io::Result<()> {
    let mut m = LinkMessage::default();
    up_flags(&mut m);
    if promisc {
        m.header.flags |= LinkFlags::Promisc;
        m.header.change_mask |= LinkFlags::Promisc;
    }
    m.attributes.push(LinkAttribute::IfName(name.to_string()));
    m.attributes.push(LinkAttribute::Address(random_mac()));
    if let Some(mtu) = mtu {
        m.attributes.push(LinkAttribute::Mtu(mtu));
    }
    m.attributes
        .push(LinkAttribute::LinkInfo(vec![LinkInfo::Kind(
            InfoKind::Bridge,
        )]));
    nl.request(RouteNetlinkMessage::NewLink(m), NLM_F_CREATE | NLM_F_EXCL)
}

/// RTM_SETLINK bringing `index` up, for a batch.
pub fn set_up_msg(index: u32) -> (RouteNetlinkMessage, u16) {
    let mut m = LinkMessage::default();
    m.header.index = index;
    up_flags(&mut m);
    (RouteNetlinkMessage::SetLink(m), 0)
}

/// Brings a link up and/or sets promiscuous mode.
pub fn set_flags(nl: &mut RtNetlink, index: u32, up: bool, promisc: bool) -> io::Result<()> {
    let mut m = LinkMessage::default();
    m.header.index = index;
    if up {
        up_flags(&mut m);
    }
    if promisc {
        m.header.flags |= LinkFlags::Promisc;
        m.header.change_mask |= LinkFlags::Promisc;
    }
    nl.request(RouteNetlinkMessage::SetLink(m), 0)
}

/// Parameters of the veth pair.
pub struct VethSpec<'a> {
    pub host_name: &'a str,
    pub host_mac: &'a [u8],
    pub pod_name: &'a str,
    pub pod_mac: &'a [u8],
    /// Open fd of the pod's network namespace.
    pub pod_netns: RawFd,
    pub mtu: Option<u32>,
    pub bridge_index: u32,
}

/// One RTM_NEWLINK creates both ends, the host end up and enslaved to the
/// bridge, the pod end created directly inside the pod netns
/// (IFLA_NET_NS_FD on the peer, as netavark does), so its name can never
/// collide with a host link.
pub fn create_veth(nl: &mut RtNetlink, s: &VethSpec) -> io::Result<()> {
    // The peer cannot be brought up in the same request: veth_open() on it
    // fails with ENOTCONN until the host end is registered. The pod side
    // sets it up in its own batch.
    let mut peer = LinkMessage::default();
    peer.attributes
        .push(LinkAttribute::IfName(s.pod_name.to_string()));
    peer.attributes
        .push(LinkAttribute::Address(s.pod_mac.to_vec()));
    peer.attributes.push(LinkAttribute::NetNsFd(s.pod_netns));
    if let Some(mtu) = s.mtu {
        peer.attributes.push(LinkAttribute::Mtu(mtu));
    }
    let mut m = LinkMessage::default();
    up_flags(&mut m);
    m.attributes
        .push(LinkAttribute::IfName(s.host_name.to_string()));
    m.attributes
        .push(LinkAttribute::Address(s.host_mac.to_vec()));
    if let Some(mtu) = s.mtu {
        m.attributes.push(LinkAttribute::Mtu(mtu));
    }
    m.attributes.push(LinkAttribute::Controller(s.bridge_index));
    m.attributes.push(LinkAttribute::LinkInfo(vec![
        LinkInfo::Kind(InfoKind::Veth),
        LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(peer))),
    ]));
    nl.request(RouteNetlinkMessage::NewLink(m), NLM_F_CREATE | NLM_F_EXCL)
}

/// Deletes the link called `name`; a missing link is not an error.
pub fn delete_by_name(nl: &mut RtNetlink, name: &str) -> io::Result<bool> {
    let mut m = LinkMessage::default();
    m.attributes.push(LinkAttribute::IfName(name.to_string()));
    match nl.request(RouteNetlinkMessage::DelLink(m), 0) {
        Ok(()) => Ok(true),
        Err(e) if errno(&e) == libc::ENODEV => Ok(false),
        Err(e) => Err(e),
    }
}

/// Bridge port hairpin mode (IFLA_BRPORT_MODE in IFLA_PROTINFO, AF_BRIDGE),
/// so a pod can reach itself through a service address.
pub fn set_hairpin(nl: &mut RtNetlink, index: u32) -> io::Result<()> {
    const IFLA_BRPORT_MODE: u16 = 4;
    let mut m = LinkMessage::default();
    m.header.interface_family = AddressFamily::Bridge;
    m.header.index = index;
    m.attributes.push(LinkAttribute::ProtoInfoBridge(vec![
        LinkProtoInfoBridge::Other(DefaultNla::new(IFLA_BRPORT_MODE, vec![1])),
    ]));
    nl.request(RouteNetlinkMessage::SetLink(m), 0)
}
