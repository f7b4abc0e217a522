//! DEL: best effort and idempotent. Everything is attempted even when an
//! earlier step fails; only failures that would leak state are reported.

use crate::cni::config::{Mode, NetConf};
use crate::cni::env::CniEnv;
use crate::cni::error::{CniError, CniResult};
use crate::cni::ipam;
use crate::cni::masq;
use crate::cni::names;
use crate::cni::netlink::{link, RtNetlink};
use crate::cni::netns::Netns;
use crate::cni::podreg;

pub fn run(conf: &NetConf, env: &CniEnv) -> CniResult<()> {
    if conf.mode == Mode::Chained {
        // Another plugin owns the links and addresses: only our entry goes.
        return podreg::remove(conf, &env.container_id, &env.ifname).map(drop);
    }
    let mut errors: Vec<CniError> = Vec::new();

    // The host end's name is derived from (containerID, ifname): deleting it
    // removes the pod end too, without entering the netns.
    let host_name = names::host_veth(&env.container_id, &env.ifname);
    let deleted = match RtNetlink::open() {
        Ok(mut nl) => match link::delete_by_name(&mut nl, &host_name) {
            Ok(d) => d,
            Err(e) => {
                errors.push(CniError::netlink(format!("deleting {host_name}"), e));
                false
            }
        },
        Err(e) => {
            errors.push(CniError::netlink("netlink socket", e));
            false
        }
    };
    // No host end (e.g. it was renamed): remove the pod interface from
    // inside the netns, if the netns is still there.
    if !deleted && !env.netns.is_empty() {
        match Netns::open(&env.netns) {
            Ok(ns) => {
                let ifname = env.ifname.clone();
                if let Err(e) = ns.run(move |nl| {
                    link::delete_by_name(nl, &ifname)
                        .map(drop)
                        .map_err(|e| CniError::netlink(format!("deleting {ifname} in the pod"), e))
                }) {
                    errors.push(e);
                }
            }
            Err(e) => tracing::debug!(error = %e, "pod netns gone; nothing to delete inside"),
        }
    }

    if conf.ip_masq {
        if let Err(e) = masq::remove(conf, &env.container_id, &env.ifname) {
            errors.push(e);
        }
    }
    if let Err(e) = ipam::del(conf, env) {
        errors.push(e);
    }
    if let Err(e) = podreg::remove(conf, &env.container_id, &env.ifname) {
        errors.push(e);
    }
    for e in &errors {
        tracing::warn!(error = %e, "DEL step failed");
    }
    match errors.into_iter().next() {
        None => Ok(()),
        Some(first) => Err(first),
    }
}
