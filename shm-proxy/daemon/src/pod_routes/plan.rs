//! The pure half of pod routing: from the node table, this node's name
//! and its directly connected subnets, what the kernel should hold (routes,
//! the VXLAN device and its peers, the masquerade exemptions). No I/O, so
//! every decision is unit-tested.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};

use flowlane_rdma::topology::NodeEntry;
use ipnetwork::IpNetwork;

/// `--pod-routes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Per peer: host-gw when its underlay address is on a connected
    /// subnet of this node, else VXLAN (flannel's DirectRouting).
    Auto,
    HostGw,
    Vxlan,
    Off,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Mode, String> {
        match s {
            "auto" => Ok(Mode::Auto),
            "host-gw" => Ok(Mode::HostGw),
            "vxlan" => Ok(Mode::Vxlan),
            "off" => Ok(Mode::Off),
            other => Err(format!("{other}: unknown (auto, host-gw, vxlan, off)")),
        }
    }
}

/// How a route reaches the peer's pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Via {
    /// Through the peer's underlay address, on a shared link.
    Gateway(IpAddr),
    /// Through the VXLAN device, to the peer's VTEP address (onlink).
    Vxlan(Ipv4Addr),
}

/// One route to a peer's pod CIDR.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Route {
    pub dst: IpNetwork,
    pub via: Via,
}

/// This node's VXLAN endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalVtep {
    /// The underlay address the tunnel's packets leave from.
    pub underlay: Ipv4Addr,
    /// The device's address: the network address of this node's IPv4 pod CIDR.
    pub vtep_ip: Ipv4Addr,
    pub mac: [u8; 6],
}

/// A peer reached through VXLAN: one FDB entry (its MAC at its underlay
/// address) and one neighbour entry (its VTEP address at its MAC).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct VxlanPeer {
    pub underlay: Ipv4Addr,
    pub vtep_ip: Ipv4Addr,
    pub mac: [u8; 6],
}

/// What the kernel should hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Desired {
    pub routes: BTreeSet<Route>,
    /// `Some` when at least one peer is reached through VXLAN.
    pub vtep: Option<LocalVtep>,
    pub peers: BTreeSet<VxlanPeer>,
    /// Every node's pod CIDR (this node's too): traffic to them is not
    /// masqueraded.
    pub exempt: BTreeSet<IpNetwork>,
}

/// The VTEP MAC of a node: locally administered, derived from its IPv4
/// underlay address, so every node computes every peer's MAC from the node
/// table alone (nothing else to publish).
pub fn vtep_mac(underlay: Ipv4Addr) -> [u8; 6] {
    let o = underlay.octets();
    [0x0e, 0xf1, o[0], o[1], o[2], o[3]]
}

/// The VTEP address of a node: the network address of its first IPv4 pod
/// CIDR (as flannel's), `None` without one.
fn vtep_ip(n: &NodeEntry) -> Option<Ipv4Addr> {
    n.pod_cidrs.iter().find_map(|c| match c {
        IpNetwork::V4(v4) => Some(v4.network()),
        IpNetwork::V6(_) => None,
    })
}

fn v4(ip: IpAddr) -> Option<Ipv4Addr> {
    match ip.to_canonical() {
        IpAddr::V4(a) => Some(a),
        IpAddr::V6(_) => None,
    }
}

/// The plan. `connected`: this node's addresses with their prefixes (its
/// directly connected subnets), pod bridges and the VXLAN device excluded.
pub fn plan(nodes: &[NodeEntry], me: &str, connected: &[IpNetwork], mode: Mode) -> Desired {
    let mut d = Desired {
        exempt: nodes
            .iter()
            .flat_map(|n| n.pod_cidrs.iter().copied())
            .collect(),
        ..Desired::default()
    };
    let Some(local) = nodes.iter().find(|n| n.name == me) else {
        return d;
    };
    if mode == Mode::Off {
        return d;
    }
    let overlaps_mine = |c: &IpNetwork| {
        local
            .pod_cidrs
            .iter()
            .any(|m| m.contains(c.ip()) || c.contains(m.ip()))
    };
    let local_vtep = match (v4(local.underlay), vtep_ip(local)) {
        (Some(u), Some(ip)) => Some(LocalVtep {
            underlay: u,
            vtep_ip: ip,
            mac: vtep_mac(u),
        }),
        _ => None,
    };
    for peer in nodes.iter().filter(|n| n.name != me) {
        let underlay = peer.underlay.to_canonical();
        if underlay == local.underlay.to_canonical() {
            continue;
        }
        let direct = connected.iter().any(|c| c.contains(underlay));
        let use_vxlan = match mode {
            Mode::HostGw => false,
            Mode::Vxlan => true,
            _ => !direct,
        };
        if use_vxlan {
            let (Some(lv), Some(pu), Some(pv)) = (local_vtep, v4(underlay), vtep_ip(peer)) else {
                continue;
            };
            d.vtep = Some(lv);
            d.peers.insert(VxlanPeer {
                underlay: pu,
                vtep_ip: pv,
                mac: vtep_mac(pu),
            });
            for c in peer.pod_cidrs.iter().filter(|c| c.is_ipv4()) {
                if !overlaps_mine(c) {
                    d.routes.insert(Route {
                        dst: *c,
                        via: Via::Vxlan(pv),
                    });
                }
            }
        } else {
            for c in &peer.pod_cidrs {
                if c.is_ipv4() == underlay.is_ipv4() && !overlaps_mine(c) {
                    d.routes.insert(Route {
                        dst: *c,
                        via: Via::Gateway(underlay),
                    });
                }
            }
        }
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, cidr: &str, underlay: &str) -> NodeEntry {
        NodeEntry {
            name: name.into(),
            pod_cidrs: vec![cidr.parse().unwrap()],
            underlay: underlay.parse().unwrap(),
            rdma: None,
            lane_port: None,
        }
    }

    fn table() -> Vec<NodeEntry> {
        vec![
            node("a", "10.231.1.0/24", "10.236.0.1"),
            node("b", "10.231.2.0/24", "10.236.0.2"),
            node("c", "10.231.3.0/24", "10.236.9.3"),
        ]
    }

    fn connected() -> Vec<IpNetwork> {
        vec!["10.236.0.1/24".parse().unwrap()]
    }

    fn route(dst: &str, via: Via) -> Route {
        Route {
            dst: dst.parse().unwrap(),
            via,
        }
    }

    #[test]
    fn auto_picks_host_gw_on_a_shared_link_and_vxlan_elsewhere() {
        let d = plan(&table(), "a", &connected(), Mode::Auto);
        let want: BTreeSet<Route> = [
            route("10.231.2.0/24", Via::Gateway("10.236.0.2".parse().unwrap())),
            route("10.231.3.0/24", Via::Vxlan("10.231.3.0".parse().unwrap())),
        ]
        .into();
        assert_eq!(d.routes, want);
        let vtep = d.vtep.expect("a vxlan peer needs the device");
        assert_eq!(vtep.underlay, "10.236.0.1".parse::<Ipv4Addr>().unwrap());
        assert_eq!(vtep.vtep_ip, "10.231.1.0".parse::<Ipv4Addr>().unwrap());
        let peers: Vec<_> = d.peers.iter().copied().collect();
        assert_eq!(
            peers,
            [VxlanPeer {
                underlay: "10.236.9.3".parse().unwrap(),
                vtep_ip: "10.231.3.0".parse().unwrap(),
                mac: [0x0e, 0xf1, 10, 236, 9, 3],
            }]
        );
        assert_eq!(d.exempt.len(), 3);
    }

    #[test]
    fn forced_modes_and_off() {
        let d = plan(&table(), "a", &connected(), Mode::HostGw);
        assert!(d.vtep.is_none() && d.peers.is_empty());
        assert!(d.routes.iter().all(|r| matches!(r.via, Via::Gateway(_))));
        assert_eq!(d.routes.len(), 2);
        let d = plan(&table(), "a", &connected(), Mode::Vxlan);
        assert_eq!(d.peers.len(), 2);
        assert!(d.routes.iter().all(|r| matches!(r.via, Via::Vxlan(_))));
        let d = plan(&table(), "a", &connected(), Mode::Off);
        assert!(d.routes.is_empty() && d.vtep.is_none());
        assert_eq!(
            d.exempt.len(),
            3,
            "off still exempts the cluster from masquerade"
        );
    }

    #[test]
    fn unlisted_self_overlaps_and_shared_underlay_get_no_route() {
        assert!(plan(&table(), "zz", &connected(), Mode::Auto)
            .routes
            .is_empty());
        let mut t = table();
        t.push(node("overlap", "10.231.1.128/25", "10.236.0.7"));
        t.push(node("twin", "10.231.8.0/24", "10.236.0.1"));
        let d = plan(&t, "a", &connected(), Mode::Auto);
        assert!(d
            .routes
            .iter()
            .all(|r| r.dst != "10.231.1.128/25".parse().unwrap()
                && r.dst != "10.231.8.0/24".parse().unwrap()));
        assert_eq!(d.routes.len(), 2);
    }

    #[test]
    fn a_peer_changing_address_or_cidr_changes_its_route() {
        let mut t = table();
        t[1] = node("b", "10.231.20.0/24", "10.236.0.22");
        let d = plan(&t, "a", &connected(), Mode::Auto);
        assert!(d.routes.contains(&route(
            "10.231.20.0/24",
            Via::Gateway("10.236.0.22".parse().unwrap())
        )));
        assert!(!d
            .routes
            .iter()
            .any(|r| r.dst == "10.231.2.0/24".parse().unwrap()));
    }

    #[test]
    fn modes_parse() {
        assert_eq!("auto".parse(), Ok(Mode::Auto));
        assert_eq!("host-gw".parse(), Ok(Mode::HostGw));
        assert!("hostgw".parse::<Mode>().is_err());
    }
}
