//! ADD: bridge, veth pair (pod end born in the pod netns), IPAM, addresses
//! and routes in the pod, gateway on the bridge, forwarding, masquerade,
//! registry. Any failure after the first change undoes what was done.

use std::net::IpAddr;

use ipnetwork::IpNetwork;

use crate::cni::config::NetConf;
use crate::cni::env::CniEnv;
use crate::cni::error::{code, CniError, CniResult};
use crate::cni::ipam;
use crate::cni::masq;
use crate::cni::names;
use crate::cni::netlink::{self, address, link, route, RtNetlink};
use crate::cni::netns::Netns;
use crate::cni::podreg;
use crate::cni::result::{AddResult, Interface, Route};
use crate::cni::sysctl;

/// Undo list for a failed ADD, run in reverse order of the changes.
#[derive(Default)]
struct Rollback {
    veth: Option<String>,
    ipam: bool,
    masq: Vec<IpNetwork>,
}

impl Rollback {
    fn run(&self, conf: &NetConf, env: &CniEnv, host: &mut RtNetlink) {
        if !self.masq.is_empty() {
            if let Err(e) = masq::remove(conf, &env.container_id, &env.ifname) {
                tracing::warn!(error = %e, "rollback: masquerade rule");
            }
        }
        if self.ipam {
            if let Err(e) = ipam::del(conf, env) {
                tracing::warn!(error = %e, "rollback: ipam release");
            }
        }
        if let Some(v) = &self.veth {
            if let Err(e) = link::delete_by_name(host, v) {
                tracing::warn!(error = %e, veth = v, "rollback: veth delete");
            }
        }
    }
}

pub fn run(conf: &NetConf, env: &CniEnv) -> CniResult<AddResult> {
    let ns = Netns::open(&env.netns)?;
    let mut host = RtNetlink::open().map_err(|e| CniError::netlink("netlink socket", e))?;
    let mut undo = Rollback::default();
    match wire(conf, env, &ns, &mut host, &mut undo) {
        Ok(r) => Ok(r),
        Err(e) => {
            undo.run(conf, env, &mut host);
            Err(e)
        }
    }
}

fn wire(
    conf: &NetConf,
    env: &CniEnv,
    ns: &Netns,
    host: &mut RtNetlink,
    undo: &mut Rollback,
) -> CniResult<AddResult> {
    let bridge = ensure_bridge(host, conf)?;
    tracing::debug!("bridge ready");

    let host_name = names::host_veth(&env.container_id, &env.ifname);
    let host_mac = link::random_mac();
    let pod_mac = link::random_mac();
    let spec = link::VethSpec {
        host_name: &host_name,
        host_mac: &host_mac,
        pod_name: &env.ifname,
        pod_mac: &pod_mac,
        pod_netns: std::os::fd::AsRawFd::as_raw_fd(&ns.file),
        mtu: conf.mtu,
        bridge_index: bridge.index,
    };
    if let Err(e) = link::create_veth(host, &spec) {
        if netlink::errno(&e) != libc::EEXIST {
            return Err(CniError::netlink("creating the veth pair", e));
        }
        // Which name is taken? Only this slow path looks.
        return Err(match link::by_name(host, &host_name) {
            Ok(Some(_)) => CniError::new(
                code::IFACE_EXISTS,
                format!(
                    "attachment {}/{} already exists (host veth {host_name} present)",
                    env.container_id, env.ifname
                ),
            ),
            _ => CniError::new(
                code::IFACE_EXISTS,
                format!(
                    "interface {} already exists in container {}",
                    env.ifname, env.netns
                ),
            ),
        });
    }
    undo.veth = Some(host_name.clone());
    tracing::debug!(veth = %host_name, "veth pair created");
    if conf.hairpin_mode {
        let v = link::by_name(host, &host_name)
            .map_err(|e| CniError::netlink("looking up the host veth", e))?
            .ok_or_else(|| CniError::new(code::NETLINK, format!("{host_name} vanished")))?;
        link::set_hairpin(host, v.index)
            .map_err(|e| CniError::netlink("setting hairpin mode", e))?;
    }

    let mut result = AddResult {
        interfaces: vec![
            Interface {
                name: bridge.name.clone(),
                mac: link::mac_string(&bridge.mac),
                mtu: conf.mtu,
                ..Default::default()
            },
            Interface {
                name: host_name.clone(),
                mac: link::mac_string(&host_mac),
                mtu: conf.mtu,
                ..Default::default()
            },
            Interface {
                name: env.ifname.clone(),
                mac: link::mac_string(&pod_mac),
                mtu: conf.mtu,
                sandbox: env.netns.clone(),
                ..Default::default()
            },
        ],
        ..Default::default()
    };
    const POD: usize = 2;

    if let Some(ip_result) = ipam::add(conf, env)? {
        undo.ipam = true;
        result.ips = ip_result.ips;
        result.routes = ip_result.routes;
        result.dns = ip_result.dns;
        apply_gateways(conf, &mut result, POD);
    }
    if let Some(dns) = conf.dns.as_ref().filter(|d| !d.is_empty()) {
        result.dns = dns.clone();
    }

    tracing::debug!("ipam done");
    configure_pod(ns, &env.ifname, &result, POD)?;
    tracing::debug!("pod configured");

    if conf.is_gateway {
        let mut v4 = false;
        let mut v6 = false;
        for ip in &result.ips {
            if let Some(gw) = ip.gateway {
                let gw_net = IpNetwork::new(gw, ip.address.prefix()).expect("prefix valid");
                ensure_bridge_addr(host, &bridge, gw_net, conf.force_address)?;
                v4 |= gw.is_ipv4();
                v6 |= gw.is_ipv6();
            }
        }
        if v4 {
            sysctl::ensure_one(sysctl::IPV4_FORWARD)?;
        }
        if v6 {
            sysctl::ensure_one(sysctl::IPV6_FORWARD)?;
        }
    }

    if conf.ip_masq && !result.ips.is_empty() {
        let nets: Vec<IpNetwork> = result.ips.iter().map(|i| i.address).collect();
        undo.masq = nets.clone();
        masq::add(conf, &env.container_id, &env.ifname, &nets)?;
    }

    tracing::debug!("host side done");
    podreg::record(conf, env, ns.inode(), &result, POD)?;
    tracing::debug!("registry written");

    Ok(merge_prev(conf, result))
}

/// Reference bridge semantics (calcGateways): with isGateway an IP without
/// gateway gets its subnet's first address; with isDefaultGateway a default
/// route via that gateway is added per family unless one is present.
fn apply_gateways(conf: &NetConf, r: &mut AddResult, pod: usize) {
    for i in 0..r.ips.len() {
        let ip = &mut r.ips[i];
        ip.interface = Some(pod);
        if ip.gateway.is_none() && conf.is_gateway {
            let net = ip.address.network();
            ip.gateway = Some(crate::cni::ipam::addr::add(net, 1));
        }
        if conf.is_default_gateway {
            let v4 = ip.address.is_ipv4();
            let gw = ip.gateway;
            let default: IpNetwork = if v4 {
                "0.0.0.0/0".parse().unwrap()
            } else {
                "::/0".parse().unwrap()
            };
            if !r
                .routes
                .iter()
                .any(|rt| rt.dst == default && rt.gw.is_some())
                && !r.routes.iter().any(|rt| rt.dst == default)
            {
                r.routes.push(Route::new(default, gw));
            }
        }
    }
}

/// The gateway of the family of `dst`, for routes that name none
/// (libcni's ConfigureIface does the same).
fn family_gateway(r: &AddResult, dst: &IpNetwork) -> Option<IpAddr> {
    r.ips
        .iter()
        .filter(|i| i.address.is_ipv4() == dst.is_ipv4())
        .find_map(|i| i.gateway)
}

/// Inside the pod: one lookup, then one batch (link up, addresses, routes).
fn configure_pod(ns: &Netns, ifname: &str, r: &AddResult, pod: usize) -> CniResult<()> {
    ns.run(|nl| {
        let l = link::by_name(nl, ifname)
            .map_err(|e| CniError::netlink("looking up the pod interface", e))?
            .ok_or_else(|| CniError::new(code::NETLINK, format!("{ifname} missing in the pod")))?;
        let mut batch = vec![link::set_up_msg(l.index)];
        let mut what = vec![format!("setting {ifname} up")];
        for ip in r.ips.iter().filter(|i| i.interface == Some(pod)) {
            batch.push(address::new_addr_msg(l.index, ip.address));
            what.push(format!("adding address {}", ip.address));
        }
        for rt in &r.routes {
            let mut rt = rt.clone();
            if rt.gw.is_none() {
                rt.gw = family_gateway(r, &rt.dst);
            }
            batch.push(route::new_route_msg(l.index, &rt));
            what.push(format!("adding route {} via {:?}", rt.dst, rt.gw));
        }
        let outcomes = nl
            .batch(batch)
            .map_err(|e| CniError::netlink("configuring the pod interface", e))?;
        for (o, w) in outcomes.into_iter().zip(what) {
            o.map_err(|e| CniError::netlink(format!("{w} in the pod"), e))?;
        }
        Ok(())
    })
}

/// The bridge, created (up, stable MAC) on first use. Concurrent ADDs may
/// race to create it: EEXIST means someone else won, so look again.
fn ensure_bridge(host: &mut RtNetlink, conf: &NetConf) -> CniResult<link::Link> {
    let lookup = |host: &mut RtNetlink| {
        link::by_name(host, &conf.bridge).map_err(|e| CniError::netlink("looking up the bridge", e))
    };
    let br = match lookup(host)? {
        Some(b) => b,
        None => {
            match link::create_bridge(host, &conf.bridge, conf.mtu, conf.promisc_mode) {
                Ok(()) => {}
                Err(e) if netlink::errno(&e) == libc::EEXIST => {}
                Err(e) => {
                    return Err(CniError::netlink(
                        format!("creating bridge {}", conf.bridge),
                        e,
                    ))
                }
            }
            lookup(host)?.ok_or_else(|| {
                CniError::new(
                    code::TRY_AGAIN_LATER,
                    format!("bridge {} vanished after creation", conf.bridge),
                )
            })?
        }
    };
    if br.kind.as_deref() != Some("bridge") {
        return Err(CniError::new(
            code::NOT_A_BRIDGE,
            format!("{:?} already exists but is not a bridge", conf.bridge),
        ));
    }
    let need_up = !br.up;
    let need_promisc = conf.promisc_mode && !br.promisc;
    if need_up || need_promisc {
        link::set_flags(host, br.index, need_up, need_promisc)
            .map_err(|e| CniError::netlink(format!("setting {} up", conf.bridge), e))?;
    }
    Ok(br)
}

/// Puts the gateway address on the bridge. The common case (already there)
/// costs one read-only request. A new address is checked against others of the same
/// family in the same subnet (reference `ensureAddr`): replaced with
/// forceAddress, an error otherwise.
fn ensure_bridge_addr(
    host: &mut RtNetlink,
    br: &link::Link,
    gw: IpNetwork,
    force: bool,
) -> CniResult<()> {
    // Reading is lock-free in the kernel (RCU), adding takes RTNL: in the
    // steady state the gateway is there and ADD never queues for RTNL here.
    let existing = address::list_family(host, br.index, Some(gw.is_ipv4()))
        .map_err(|e| CniError::netlink("listing bridge addresses", e))?;
    if existing.contains(&gw) {
        return Ok(());
    }
    let (msg, flags) = address::new_addr_msg(br.index, gw);
    match host.request(msg, flags) {
        Err(e) if netlink::errno(&e) == libc::EEXIST => return Ok(()),
        Err(e) => return Err(CniError::netlink(format!("adding {gw} to {}", br.name), e)),
        Ok(()) => {}
    }
    let conflicts: Vec<IpNetwork> = existing
        .into_iter()
        .filter(|a| *a != gw && a.is_ipv4() == gw.is_ipv4())
        .filter(|a| gw.is_ipv4() || a.contains(gw.ip()) || gw.contains(a.ip()))
        .filter(|a| !matches!(a.ip(), IpAddr::V6(v6) if v6.is_unicast_link_local()))
        .collect();
    if conflicts.is_empty() {
        return Ok(());
    }
    if !force {
        let _ = host.request(address::del_addr_msg(br.index, gw), 0);
        return Err(CniError::config(format!(
            "{:?} already has an IP address different from {gw}",
            br.name
        ))
        .with_details(format!(
            "existing: {conflicts:?}; set forceAddress to replace it"
        )));
    }
    for c in conflicts {
        host.request(address::del_addr_msg(br.index, c), 0)
            .map_err(|e| CniError::netlink(format!("removing {c} from {}", br.name), e))?;
    }
    // Deleting a primary IPv4 address takes its secondaries (ours) with it
    // unless promote_secondaries is set: add the gateway again.
    let (msg, flags) = address::new_addr_msg(br.index, gw);
    match host.request(msg, flags) {
        Err(e) if netlink::errno(&e) != libc::EEXIST => {
            Err(CniError::netlink(format!("adding {gw} to {}", br.name), e))
        }
        _ => Ok(()),
    }
}

/// A chained ADD (prevResult given) returns the previous result plus ours.
fn merge_prev(conf: &NetConf, mut ours: AddResult) -> AddResult {
    let Some(prev) = conf
        .prev_result
        .as_ref()
        .and_then(|p| AddResult::from_json(p).ok())
    else {
        return ours;
    };
    let offset = prev.interfaces.len();
    let mut out = prev;
    for ip in &mut ours.ips {
        ip.interface = ip.interface.map(|i| i + offset);
    }
    out.interfaces.extend(ours.interfaces);
    out.ips.extend(ours.ips);
    out.routes.extend(ours.routes);
    if !ours.dns.is_empty() {
        out.dns = ours.dns;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cni::result::IpConfig;

    fn conf(extra: &str) -> NetConf {
        let s = format!(
            r#"{{"cniVersion":"1.0.0","name":"n","type":"flowlane"{extra},
                "ipam":{{"type":"flowlane","subnet":"10.9.0.0/24"}}}}"#
        );
        crate::cni::config::parse(s.as_bytes()).unwrap()
    }

    fn ipam_result(gw: Option<&str>, routes: &[(&str, Option<&str>)]) -> AddResult {
        AddResult {
            ips: vec![
                IpConfig {
                    address: "10.9.0.5/24".parse().unwrap(),
                    gateway: gw.map(|g| g.parse().unwrap()),
                    interface: None,
                },
                IpConfig {
                    address: "fd00:9::5/64".parse().unwrap(),
                    gateway: None,
                    interface: None,
                },
            ],
            routes: routes
                .iter()
                .map(|(d, g)| Route::new(d.parse().unwrap(), g.map(|g| g.parse().unwrap())))
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn default_gateway_adds_one_default_route_per_family() {
        let c = conf(r#","isDefaultGateway":true"#);
        let mut r = ipam_result(Some("10.9.0.1"), &[]);
        apply_gateways(&c, &mut r, 2);
        assert!(r.ips.iter().all(|i| i.interface == Some(2)));
        // The v6 IP had no gateway: isGateway computes the subnet's first.
        assert_eq!(r.ips[1].gateway.unwrap().to_string(), "fd00:9::1");
        let dsts: Vec<String> = r
            .routes
            .iter()
            .map(|r| format!("{} {:?}", r.dst, r.gw))
            .collect();
        assert_eq!(dsts, ["0.0.0.0/0 Some(10.9.0.1)", "::/0 Some(fd00:9::1)"]);
        // A default route from IPAM is kept, not doubled.
        let mut r = ipam_result(Some("10.9.0.1"), &[("0.0.0.0/0", None)]);
        apply_gateways(&c, &mut r, 2);
        assert_eq!(
            r.routes
                .iter()
                .filter(|r| r.dst.prefix() == 0 && r.dst.is_ipv4())
                .count(),
            1
        );
    }

    #[test]
    fn is_gateway_alone_adds_no_route_and_plain_bridge_no_gateway() {
        let mut r = ipam_result(None, &[]);
        apply_gateways(&conf(r#","isGateway":true"#), &mut r, 2);
        assert!(r.routes.is_empty());
        assert_eq!(r.ips[0].gateway.unwrap().to_string(), "10.9.0.1");
        let mut r = ipam_result(None, &[]);
        apply_gateways(&conf(""), &mut r, 2);
        assert!(r.ips.iter().all(|i| i.gateway.is_none()));
    }

    #[test]
    fn routes_without_gw_use_their_family_gateway() {
        let mut r = ipam_result(Some("10.9.0.1"), &[]);
        apply_gateways(&conf(r#","isGateway":true"#), &mut r, 2);
        assert_eq!(
            family_gateway(&r, &"192.0.2.0/24".parse().unwrap())
                .unwrap()
                .to_string(),
            "10.9.0.1"
        );
        assert_eq!(
            family_gateway(&r, &"::/0".parse().unwrap())
                .unwrap()
                .to_string(),
            "fd00:9::1"
        );
    }

    #[test]
    fn chained_add_appends_to_prev_result_with_shifted_indices() {
        let prev = r#","prevResult":{"cniVersion":"1.0.0",
            "interfaces":[{"name":"other0"}],
            "ips":[{"address":"192.168.0.2/24","interface":0}]}"#;
        let c = conf(prev);
        let mut ours = ipam_result(Some("10.9.0.1"), &[]);
        ours.interfaces = vec![
            Interface::default(),
            Interface::default(),
            Interface::default(),
        ];
        apply_gateways(&c, &mut ours, 2);
        let merged = merge_prev(&c, ours);
        assert_eq!(merged.interfaces.len(), 4);
        assert_eq!(merged.ips[0].interface, Some(0));
        assert_eq!(merged.ips[1].interface, Some(3));
    }
}
