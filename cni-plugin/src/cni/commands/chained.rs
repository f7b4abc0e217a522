//! Chained mode (`"mode": "chained"`): flowlane as a later plugin of a
//! conflist whose first plugin (the reference `bridge`, Calico, Cilium,
//! flannel, ...) wired the pod. ADD records the pod from `prevResult` in the
//! registry and passes `prevResult` on; CHECK compares the registry entry
//! with `prevResult` and the netns. Nothing is wired: no links, IPAM,
//! routes or masquerade. DEL and GC only touch the registry (del.rs, gc.rs).

use crate::cni::config::NetConf;
use crate::cni::env::CniEnv;
use crate::cni::error::{code, CniError, CniResult};
use crate::cni::netlink::link;
use crate::cni::netns::Netns;
use crate::cni::podreg;
use crate::cni::result::AddResult;

/// `prevResult` and the index of the pod interface in it (`CNI_IFNAME` in
/// a sandbox), with every IP of that interface tagged with the index (IPs
/// without `interface` count as the pod's, as libcni's CHECK reads them).
fn pod_of_prev(conf: &NetConf, env: &CniEnv) -> CniResult<(AddResult, usize)> {
    let prev = conf.prev_result.as_ref().ok_or_else(|| {
        CniError::config(
            "chained mode needs prevResult: flowlane must come after the plugin that wires the pod",
        )
    })?;
    let mut prev = AddResult::from_json(prev)?;
    let idx = prev
        .interfaces
        .iter()
        .position(|i| i.name == env.ifname && !i.sandbox.is_empty())
        .ok_or_else(|| {
            CniError::config(format!(
                "prevResult has no interface {} in the container",
                env.ifname
            ))
        })?;
    for ip in prev.ips.iter_mut().filter(|i| i.interface.is_none()) {
        ip.interface = Some(idx);
    }
    if !prev.ips.iter().any(|i| i.interface == Some(idx)) {
        return Err(CniError::config(format!(
            "prevResult has no IP on interface {} in the container",
            env.ifname
        )));
    }
    Ok((prev, idx))
}

/// ADD: the registry entry (what primary mode writes), the daemon poked,
/// and `prevResult` returned in the requested version's format.
pub fn add(conf: &NetConf, env: &CniEnv) -> CniResult<serde_json::Value> {
    let (prev, idx) = pod_of_prev(conf, env)?;
    let ns = Netns::open(&env.netns)?;
    podreg::record(conf, env, ns.inode(), &prev, idx)?;
    tracing::debug!("chained: registry written");
    prev_json(conf)
}

/// `prevResult` as given (IPs without `interface` stay so), in the format
/// of `cniVersion` (SPEC.md: a plugin that changes nothing returns its
/// prevResult, converted to the requested version).
fn prev_json(conf: &NetConf) -> CniResult<serde_json::Value> {
    let prev = conf.prev_result.as_ref().expect("checked by pod_of_prev");
    Ok(AddResult::from_json(prev)?.to_json(&conf.cni_version, conf.version))
}

fn mismatch(msg: String) -> CniError {
    CniError::new(code::CHECK_MISMATCH, msg)
}

/// CHECK: the registry entry exists and matches `prevResult` (IPs, MAC)
/// and the netns (path, inode), and the interface is in the netns.
pub fn check(conf: &NetConf, env: &CniEnv) -> CniResult<()> {
    let (prev, idx) = pod_of_prev(conf, env)?;
    let ns = Netns::open(&env.netns)?;
    let entry = flowlane_registry::Registry::new(&conf.state_dir)
        .get(&conf.name, &env.container_id, &env.ifname)
        .map_err(|e| CniError::io("reading the pod registry", e))?
        .ok_or_else(|| {
            mismatch(format!(
                "no registry entry for {}/{}",
                env.container_id, env.ifname
            ))
        })?;
    if entry.netns != env.netns || entry.netns_inode != ns.inode() {
        return Err(mismatch(format!(
            "registry entry names netns {} (inode {}), not CNI_NETNS {} (inode {})",
            entry.netns,
            entry.netns_inode,
            env.netns,
            ns.inode()
        )));
    }
    let mut want: Vec<String> = prev
        .ips
        .iter()
        .filter(|i| i.interface == Some(idx))
        .map(|i| i.address.to_string())
        .collect();
    let mut have = entry.ips.clone();
    want.sort();
    have.sort();
    if want != have {
        return Err(mismatch(format!(
            "registry entry has IPs {have:?}, prevResult {want:?}"
        )));
    }
    let mac = &prev.interfaces[idx].mac;
    if !entry.mac.eq_ignore_ascii_case(mac) {
        return Err(mismatch(format!(
            "registry entry has MAC {:?}, prevResult {mac:?}",
            entry.mac
        )));
    }
    let ifname = env.ifname.clone();
    ns.run(move |nl| {
        link::by_name(nl, &ifname)
            .map_err(|e| CniError::netlink("looking up the pod interface", e))?
            .map(drop)
            .ok_or_else(|| mismatch(format!("interface {ifname} not found in the container")))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conf(prev: &str) -> NetConf {
        conf_v("1.0.0", prev)
    }

    fn conf_v(version: &str, prev: &str) -> NetConf {
        let s = format!(
            r#"{{"cniVersion":"{version}","name":"n","type":"flowlane","mode":"chained"{prev}}}"#
        );
        crate::cni::config::parse(s.as_bytes()).unwrap()
    }

    fn env() -> CniEnv {
        crate::cni::env::from_lookup(crate::cni::env::Command::Add, |k| {
            Some(
                match k {
                    "CNI_CONTAINERID" => "c1",
                    "CNI_NETNS" => "/var/run/netns/x",
                    "CNI_IFNAME" => "eth0",
                    "CNI_PATH" => "/opt/cni/bin",
                    _ => return None,
                }
                .to_string(),
            )
        })
        .unwrap()
    }

    #[test]
    fn bad_prev_results_are_config_errors() {
        for prev in [
            "",
            r#","prevResult":{"cniVersion":"1.0.0","ips":[{"address":"10.0.0.2/24"}]}"#,
            r#","prevResult":{"cniVersion":"1.0.0","interfaces":[{"name":"eth0"}],"ips":[{"address":"10.0.0.2/24","interface":0}]}"#,
            r#","prevResult":{"cniVersion":"1.0.0","interfaces":[{"name":"br"},{"name":"eth0","sandbox":"/x"}],"ips":[{"address":"10.0.0.2/24","interface":0}]}"#,
        ] {
            let e = pod_of_prev(&conf(prev), &env()).unwrap_err();
            assert_eq!(e.code, code::INVALID_CONFIG, "{prev}: {e}");
        }
    }

    #[test]
    fn pod_interface_and_untagged_ips_are_found() {
        let c = conf(
            r#","prevResult":{"cniVersion":"1.0.0","interfaces":[{"name":"br"},{"name":"eth0","sandbox":"/x"}],
                "ips":[{"address":"10.0.0.2/24"},{"address":"fd00::2/64","interface":1}]}"#,
        );
        let (r, idx) = pod_of_prev(&c, &env()).unwrap();
        assert_eq!(idx, 1);
        assert!(r.ips.iter().all(|i| i.interface == Some(1)));
    }

    #[test]
    fn prev_result_is_converted_to_the_requested_version() {
        let c = conf_v(
            "0.4.0",
            r#","prevResult":{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/x"}],
                "ips":[{"address":"10.0.0.2/24","interface":0}]}"#,
        );
        let out = prev_json(&c).unwrap();
        assert_eq!(out["cniVersion"], "0.4.0");
        assert_eq!(out["ips"][0]["version"], "4");
    }
}
