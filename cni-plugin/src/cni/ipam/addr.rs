//! Address arithmetic on `IpAddr` as integers (both families in a u128).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnetwork::IpNetwork;

pub fn bits(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u32::from(a) as u128,
        IpAddr::V6(a) => u128::from(a),
    }
}

pub fn from_bits(b: u128, v4: bool) -> IpAddr {
    if v4 {
        IpAddr::V4(Ipv4Addr::from(b as u32))
    } else {
        IpAddr::V6(Ipv6Addr::from(b))
    }
}

pub fn add(ip: IpAddr, n: u128) -> IpAddr {
    from_bits(bits(ip).wrapping_add(n), ip.is_ipv4())
}

/// First (network) and last (broadcast) address of a subnet.
pub fn network_first_last(net: IpNetwork) -> (IpAddr, IpAddr) {
    let width = if net.is_ipv4() { 32 } else { 128 };
    let host_bits = width - net.prefix() as u32;
    let mask: u128 = if host_bits >= 128 {
        u128::MAX
    } else {
        (1u128 << host_bits) - 1
    };
    let first = bits(net.network()) & !mask;
    (
        from_bits(first, net.is_ipv4()),
        from_bits(first | mask, net.is_ipv4()),
    )
}
