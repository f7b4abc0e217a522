//! CHECK: the attachment still looks like prevResult says (interface, MAC,
//! addresses, routes, host side), its IP is still reserved, and its
//! masquerade rule is in place.

use super::chained;
use crate::cni::config::{Mode, NetConf};
use crate::cni::env::CniEnv;
use crate::cni::error::{code, CniError, CniResult};
use crate::cni::ipam;
use crate::cni::masq;
use crate::cni::names;
use crate::cni::netlink::{address, link, route, RtNetlink};
use crate::cni::netns::Netns;
use crate::cni::result::AddResult;
use crate::cni::version::Version;

fn mismatch(msg: String) -> CniError {
    CniError::new(code::CHECK_MISMATCH, msg)
}

pub fn run(conf: &NetConf, env: &CniEnv) -> CniResult<()> {
    if conf.version < Version::V0_4_0 {
        return Err(CniError::new(
            code::INCOMPATIBLE_VERSION,
            "config version does not allow CHECK",
        )
        .with_details(format!("cniVersion {} < 0.4.0", conf.cni_version)));
    }
    if conf.mode == Mode::Chained {
        return chained::check(conf, env);
    }
    let prev = conf
        .prev_result
        .as_ref()
        .ok_or_else(|| CniError::config("CHECK requires prevResult"))?;
    let prev = AddResult::from_json(prev)?;
    let ns = Netns::open(&env.netns)?;

    let pod_idx = prev
        .interfaces
        .iter()
        .position(|i| i.name == env.ifname && !i.sandbox.is_empty())
        .ok_or_else(|| {
            mismatch(format!(
                "prevResult has no interface {} in a sandbox",
                env.ifname
            ))
        })?;
    let pod = prev.interfaces[pod_idx].clone();
    if pod.sandbox != env.netns {
        return Err(mismatch(format!(
            "interface {} sandbox {} is not CNI_NETNS {}",
            pod.name, pod.sandbox, env.netns
        )));
    }
    let want_addrs: Vec<_> = prev
        .ips
        .iter()
        .filter(|i| i.interface.is_none_or(|x| x == pod_idx))
        .map(|i| i.address)
        .collect();
    let routes = prev.routes.clone();
    let ifname = env.ifname.clone();
    ns.run(move |nl| {
        let l = link::by_name(nl, &ifname)
            .map_err(|e| CniError::netlink("looking up the pod interface", e))?
            .ok_or_else(|| mismatch(format!("interface {ifname} not found in the container")))?;
        if !pod.mac.is_empty() && !link::mac_string(&l.mac).eq_ignore_ascii_case(&pod.mac) {
            return Err(mismatch(format!(
                "interface {ifname} has MAC {} instead of {}",
                link::mac_string(&l.mac),
                pod.mac
            )));
        }
        let have =
            address::list(nl, l.index).map_err(|e| CniError::netlink("listing addresses", e))?;
        for a in &want_addrs {
            if !have
                .iter()
                .any(|h| h.ip() == a.ip() && h.prefix() == a.prefix())
            {
                return Err(mismatch(format!("address {a} missing on {ifname}")));
            }
        }
        for v4 in [true, false] {
            let wanted: Vec<_> = routes.iter().filter(|r| r.dst.is_ipv4() == v4).collect();
            if wanted.is_empty() {
                continue;
            }
            let have = route::list(nl, v4).map_err(|e| CniError::netlink("listing routes", e))?;
            for r in wanted {
                let dst =
                    ipnetwork::IpNetwork::new(r.dst.network(), r.dst.prefix()).expect("valid");
                let found = have
                    .iter()
                    .any(|h| h.dst == dst && (r.gw.is_none() || h.gw == r.gw));
                if !found {
                    return Err(mismatch(format!(
                        "route {} via {:?} missing in the container",
                        r.dst, r.gw
                    )));
                }
            }
        }
        Ok(())
    })?;

    // Host side: the bridge and our veth enslaved to it.
    let mut host = RtNetlink::open().map_err(|e| CniError::netlink("netlink socket", e))?;
    let br = link::by_name(&mut host, &conf.bridge)
        .map_err(|e| CniError::netlink("looking up the bridge", e))?
        .ok_or_else(|| mismatch(format!("bridge {} is missing", conf.bridge)))?;
    let host_name = names::host_veth(&env.container_id, &env.ifname);
    let veth = link::by_name(&mut host, &host_name)
        .map_err(|e| CniError::netlink("looking up the host veth", e))?
        .ok_or_else(|| mismatch(format!("host veth {host_name} is missing")))?;
    if veth.controller != Some(br.index) {
        return Err(mismatch(format!(
            "host veth {host_name} is not attached to {}",
            conf.bridge
        )));
    }

    let ips: Vec<_> = prev
        .ips
        .iter()
        .filter(|i| i.interface.is_none_or(|x| x == pod_idx))
        .map(|i| i.address.ip())
        .collect();
    ipam::check(conf, env, &ips)?;
    if conf.ip_masq && !ips.is_empty() && !masq::present(conf, &env.container_id, &env.ifname)? {
        return Err(mismatch("masquerade rule missing".to_string()));
    }
    Ok(())
}
