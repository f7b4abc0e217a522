//! The host's interfaces, addresses and routes, read without running any
//! tool: `getifaddrs(3)`, `/sys/class/net` and `/proc/net/{route,ipv6_route}`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;

use ipnetwork::IpNetwork;
use nix::net::if_::InterfaceFlags;

/// One address of an interface.
#[derive(Debug, Clone, serde::Serialize)]
pub struct IfAddr {
    pub ifname: String,
    pub addr: IpNetwork,
}

/// Every IPv4/IPv6 address of this network namespace.
pub fn addresses() -> Vec<IfAddr> {
    let Ok(iter) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for ifa in iter {
        let (Some(addr), Some(mask)) = (ifa.address, ifa.netmask) else {
            continue;
        };
        let net = if let (Some(a), Some(m)) = (addr.as_sockaddr_in(), mask.as_sockaddr_in()) {
            let prefix = u32::from(m.ip()).count_ones() as u8;
            IpNetwork::new(IpAddr::V4(a.ip()), prefix).ok()
        } else if let (Some(a), Some(m)) = (addr.as_sockaddr_in6(), mask.as_sockaddr_in6()) {
            let prefix = u128::from(m.ip()).count_ones() as u8;
            IpNetwork::new(IpAddr::V6(a.ip()), prefix).ok()
        } else {
            None
        };
        if let Some(addr) = net {
            out.push(IfAddr {
                ifname: ifa.interface_name,
                addr,
            });
        }
    }
    out
}

/// State of a link from `/sys/class/net/<if>`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LinkState {
    pub exists: bool,
    pub is_bridge: bool,
    /// Administratively up (`IFF_UP`).
    pub admin_up: bool,
    /// `operstate`: `up`, `down`, `lowerlayerdown`, `unknown`...
    pub operstate: String,
    pub mtu: Option<u32>,
    /// Ports enslaved to the bridge.
    pub ports: usize,
}

pub fn link_state(sys_class_net: &Path, ifname: &str) -> LinkState {
    let dir = sys_class_net.join(ifname);
    let read = |f: &str| {
        std::fs::read_to_string(dir.join(f))
            .ok()
            .map(|s| s.trim().to_string())
    };
    let flags = read("flags")
        .and_then(|s| u32::from_str_radix(s.trim_start_matches("0x"), 16).ok())
        .unwrap_or(0);
    LinkState {
        exists: dir.exists(),
        is_bridge: dir.join("bridge").is_dir(),
        admin_up: flags & InterfaceFlags::IFF_UP.bits() as u32 != 0,
        operstate: read("operstate").unwrap_or_else(|| "unknown".into()),
        mtu: read("mtu").and_then(|s| s.parse().ok()),
        ports: std::fs::read_dir(dir.join("brif"))
            .map(|d| d.count())
            .unwrap_or(0),
    }
}

/// One route of the main table.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Route {
    pub dst: IpNetwork,
    pub gateway: Option<IpAddr>,
    pub dev: String,
}

/// IPv4 and IPv6 routes of the main table (`/proc/net/route`, `/proc/net/ipv6_route`).
pub fn routes() -> Vec<Route> {
    let mut out = Vec::new();
    if let Ok(text) = std::fs::read_to_string("/proc/net/route") {
        // Iface Destination Gateway Flags RefCnt Use Metric Mask ...; addresses
        // are little-endian hex.
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 8 {
                continue;
            }
            let hex = |s: &str| {
                u32::from_str_radix(s, 16)
                    .ok()
                    .map(|v| Ipv4Addr::from(v.swap_bytes()))
            };
            let (Some(dst), Some(gw), Some(mask)) = (hex(f[1]), hex(f[2]), hex(f[7])) else {
                continue;
            };
            let prefix = u32::from(mask).count_ones() as u8;
            if let Ok(dst) = IpNetwork::new(IpAddr::V4(dst), prefix) {
                out.push(Route {
                    dst,
                    gateway: (!gw.is_unspecified()).then_some(IpAddr::V4(gw)),
                    dev: f[0].to_string(),
                });
            }
        }
    }
    if let Ok(text) = std::fs::read_to_string("/proc/net/ipv6_route") {
        // dst dst_len src src_len nexthop metric refcnt use flags iface
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 || f[9] == "lo" {
                continue;
            }
            let hex6 = |s: &str| u128::from_str_radix(s, 16).ok().map(Ipv6Addr::from);
            let (Some(dst), Ok(len), Some(nh)) =
                (hex6(f[0]), u8::from_str_radix(f[1], 16), hex6(f[4]))
            else {
                continue;
            };
            if let Ok(dst) = IpNetwork::new(IpAddr::V6(dst), len) {
                out.push(Route {
                    dst,
                    gateway: (!nh.is_unspecified()).then_some(IpAddr::V6(nh)),
                    dev: f[9].to_string(),
                });
            }
        }
    }
    out
}
