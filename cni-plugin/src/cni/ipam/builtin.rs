//! The built-in allocator (`"ipam": {"type": "flowlane"}`): host-local's
//! round-robin allocation over the on-disk store, in-process (no exec).

use std::collections::HashSet;
use std::net::IpAddr;

use ipnetwork::IpNetwork;

use super::super::config::AttachmentRef;
use super::super::error::{code, CniError, CniResult};
use super::super::result::{AddResult, IpConfig};
use super::addr::{add, bits};
use super::config::{BuiltinConf, RangeSet};
use super::store::Store;

fn store_err(conf: &BuiltinConf) -> impl Fn(std::io::Error) -> CniError + '_ {
    move |e| CniError::io(format!("ipam store {}", conf.dir.display()), e)
}

/// Allocates one address per range set for (container_id, ifname).
pub fn allocate(conf: &BuiltinConf, container_id: &str, ifname: &str) -> CniResult<AddResult> {
    let store = Store::lock(&conf.dir).map_err(store_err(conf))?;
    // Names only: reading every lease to refuse a duplicate (as host-local
    // does) would make the time under the lock grow with the pod count. A
    // second ADD of an attachment never gets here: its host veth already
    // exists and ADD fails before IPAM (error 100); `check_duplicate` is
    // for callers without that guarantee.
    let used: HashSet<IpAddr> = store
        .leased_ips()
        .map_err(store_err(conf))?
        .into_iter()
        .collect();
    let mut result = AddResult::default();
    for (idx, set) in conf.range_sets.iter().enumerate() {
        match next_free(&store, set, idx, &used, container_id, ifname) {
            Ok(Some((ip, range))) => {
                let _ = store.set_last_reserved(idx, ip);
                result.ips.push(IpConfig {
                    address: IpNetwork::new(ip, range.subnet.prefix()).expect("valid prefix"),
                    gateway: Some(range.gateway),
                    interface: None,
                });
            }
            outcome => {
                // Leak nothing: give back what earlier sets handed out.
                for ip in &result.ips {
                    let _ = store.release(ip.address.ip());
                }
                return Err(match outcome {
                    Err(e) => store_err(conf)(e),
                    _ => CniError::new(
                        code::IPAM_EXHAUSTED,
                        format!("no IP addresses available in range set {}", describe(set)),
                    ),
                });
            }
        }
    }
    result.routes = conf.routes.clone();
    Ok(result)
}

/// host-local's duplicate rule: an attachment holds at most one lease per
/// network. Reads every lease, so it stays off the ADD fast path.
#[allow(dead_code)] // kept for tools and tests; ADD relies on the veth check
pub fn check_duplicate(conf: &BuiltinConf, container_id: &str, ifname: &str) -> CniResult<()> {
    let held = leased(conf, container_id, ifname)?;
    match held.first() {
        None => Ok(()),
        Some(ip) => Err(CniError::new(
            code::IPAM_DUPLICATE,
            format!("{ip} has already been allocated to {container_id}/{ifname}, duplicate allocation is not allowed"),
        )),
    }
}

fn describe(set: &RangeSet) -> String {
    set.0
        .iter()
        .map(|r| format!("{}-{}", r.start, r.end))
        .collect::<Vec<_>>()
        .join(",")
}

/// host-local's iteration: from the address after the last one reserved in
/// this set, through every range of the set, wrapping once.
fn next_free<'a>(
    store: &Store,
    set: &'a RangeSet,
    idx: usize,
    used: &HashSet<IpAddr>,
    container_id: &str,
    ifname: &str,
) -> std::io::Result<Option<(IpAddr, &'a super::config::Range)>> {
    let ranges = &set.0;
    let (mut ri, mut cur) = match store.last_reserved(idx) {
        Some(last) => match ranges.iter().position(|r| r.contains(last)) {
            Some(ri) if last != ranges[ri].end => (ri, add(last, 1)),
            Some(ri) => (
                (ri + 1) % ranges.len(),
                ranges[(ri + 1) % ranges.len()].start,
            ),
            None => (0, ranges[0].start),
        },
        None => (0, ranges[0].start),
    };
    let total: u128 = ranges
        .iter()
        .map(|r| bits(r.end) - bits(r.start) + 1)
        .fold(0u128, |a, b| a.saturating_add(b));
    let mut steps: u128 = 0;
    while steps < total {
        let r = &ranges[ri];
        if cur != r.gateway && !used.contains(&cur) && store.reserve(cur, container_id, ifname)? {
            return Ok(Some((cur, r)));
        }
        steps += 1;
        if cur == r.end {
            ri = (ri + 1) % ranges.len();
            cur = ranges[ri].start;
        } else {
            cur = add(cur, 1);
        }
    }
    Ok(None)
}

/// Releases every lease of (container_id, ifname); releasing nothing is fine.
pub fn release(conf: &BuiltinConf, container_id: &str, ifname: &str) -> CniResult<()> {
    if !conf.dir.exists() {
        return Ok(());
    }
    let store = Store::lock(&conf.dir).map_err(store_err(conf))?;
    for l in store.leases().map_err(store_err(conf))? {
        if l.owned_by(container_id, ifname) {
            store.release(l.ip).map_err(store_err(conf))?;
        }
    }
    Ok(())
}

/// The addresses (container_id, ifname) holds, for CHECK.
pub fn leased(conf: &BuiltinConf, container_id: &str, ifname: &str) -> CniResult<Vec<IpAddr>> {
    let store = Store::lock(&conf.dir).map_err(store_err(conf))?;
    Ok(store
        .leases()
        .map_err(store_err(conf))?
        .into_iter()
        .filter(|l| l.owned_by(container_id, ifname))
        .map(|l| l.ip)
        .collect())
}

/// Releases every lease not held by a valid attachment; returns how many.
pub fn gc(conf: &BuiltinConf, valid: &[AttachmentRef]) -> CniResult<usize> {
    if !conf.dir.exists() {
        return Ok(0);
    }
    let store = Store::lock(&conf.dir).map_err(store_err(conf))?;
    let mut released = 0;
    for l in store.leases().map_err(store_err(conf))? {
        let keep = valid.iter().any(|v| l.owned_by(&v.container_id, &v.ifname));
        if !keep {
            store.release(l.ip).map_err(store_err(conf))?;
            released += 1;
        }
    }
    Ok(released)
}

/// STATUS: the store is usable and every range set has a free address.
pub fn status(conf: &BuiltinConf) -> CniResult<()> {
    let unavailable = |msg: String, e: &dyn std::fmt::Display| {
        CniError::new(code::NOT_AVAILABLE, msg).with_details(e)
    };
    let store = Store::lock(&conf.dir)
        .map_err(|e| unavailable(format!("ipam data dir {} unusable", conf.dir.display()), &e))?;
    let probe = conf
        .dir
        .join(format!(".status-probe-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .and_then(|_| std::fs::remove_file(&probe))
        .map_err(|e| {
            unavailable(
                format!("ipam data dir {} not writable", conf.dir.display()),
                &e,
            )
        })?;
    let leases = store
        .leases()
        .map_err(|e| unavailable("cannot read ipam leases".into(), &e))?;
    for set in &conf.range_sets {
        let mut capacity: u128 = 0;
        let mut taken: u128 = 0;
        for r in &set.0 {
            capacity = capacity.saturating_add(bits(r.end) - bits(r.start) + 1);
            if r.contains(r.gateway) {
                taken += 1;
            }
            taken += leases
                .iter()
                .filter(|l| r.contains(l.ip) && l.ip != r.gateway)
                .count() as u128;
        }
        if taken >= capacity {
            return Err(CniError::new(
                code::NOT_AVAILABLE,
                format!("no free IP addresses in range set {}", describe(set)),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cni::ipam::config::IpamConf;
    use serde_json::{json, Value};
    use std::path::PathBuf;

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("flowlane-ipam-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn conf(dir: &std::path::Path, mut ipam: Value) -> BuiltinConf {
        ipam["type"] = json!("flowlane");
        ipam["dataDir"] = json!(dir.to_str().unwrap());
        match IpamConf::parse(ipam, "net").unwrap().unwrap() {
            IpamConf::BuiltIn(b) => b,
            _ => unreachable!(),
        }
    }

    fn ips(r: &AddResult) -> Vec<String> {
        r.ips.iter().map(|i| i.address.to_string()).collect()
    }

    #[test]
    fn allocates_in_order_skipping_gateway_and_writes_host_local_layout() {
        let d = tmp("order");
        let c = conf(&d, json!({"subnet": "10.7.0.0/24"}));
        let a = allocate(&c, "c1", "eth0").unwrap();
        assert_eq!(ips(&a), ["10.7.0.2/24"]);
        assert_eq!(a.ips[0].gateway.unwrap().to_string(), "10.7.0.1");
        let b = allocate(&c, "c2", "eth0").unwrap();
        assert_eq!(ips(&b), ["10.7.0.3/24"]);
        let lease = std::fs::read_to_string(d.join("net/10.7.0.2")).unwrap();
        assert_eq!(lease, "c1\r\neth0");
        assert_eq!(
            std::fs::read_to_string(d.join("net/last_reserved_ip.0")).unwrap(),
            "10.7.0.3"
        );
        // Same attachment twice is detected, a second ifname is fine.
        assert_eq!(
            check_duplicate(&c, "c1", "eth0").unwrap_err().code,
            code::IPAM_DUPLICATE
        );
        check_duplicate(&c, "c1", "net1").unwrap();
        assert_eq!(ips(&allocate(&c, "c1", "net1").unwrap()), ["10.7.0.4/24"]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn release_is_idempotent_and_round_robin_continues() {
        let d = tmp("release");
        let c = conf(&d, json!({"subnet": "10.7.1.0/24"}));
        allocate(&c, "c1", "eth0").unwrap();
        release(&c, "c1", "eth0").unwrap();
        release(&c, "c1", "eth0").unwrap();
        assert!(!d.join("net/10.7.1.2").exists());
        // host-local does not immediately reuse the released address.
        assert_eq!(ips(&allocate(&c, "c2", "eth0").unwrap()), ["10.7.1.3/24"]);
        // Releasing in a network that never allocated is fine too.
        release(
            &conf(&tmp("never"), json!({"subnet": "10.7.2.0/24"})),
            "x",
            "eth0",
        )
        .unwrap();
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn range_start_end_and_exhaustion_and_wraparound() {
        let d = tmp("exhaust");
        let c = conf(
            &d,
            json!({"subnet": "10.7.3.0/24", "rangeStart": "10.7.3.10", "rangeEnd": "10.7.3.12"}),
        );
        let got: Vec<String> = (0..3)
            .map(|i| ips(&allocate(&c, &format!("c{i}"), "eth0").unwrap())[0].clone())
            .collect();
        assert_eq!(got, ["10.7.3.10/24", "10.7.3.11/24", "10.7.3.12/24"]);
        let e = allocate(&c, "c9", "eth0").unwrap_err();
        assert_eq!(e.code, code::IPAM_EXHAUSTED);
        assert_eq!(status(&c).unwrap_err().code, code::NOT_AVAILABLE);
        release(&c, "c1", "eth0").unwrap();
        status(&c).unwrap();
        // Wraps around to the one free address.
        assert_eq!(ips(&allocate(&c, "c9", "eth0").unwrap()), ["10.7.3.11/24"]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn dual_stack_one_address_per_set_and_rollback_on_exhaustion() {
        let d = tmp("dual");
        let c = conf(
            &d,
            json!({"ranges": [[{"subnet": "10.7.4.0/24"}], [{"subnet": "fd00:7::/64"}]],
                                 "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]}),
        );
        let a = allocate(&c, "c1", "eth0").unwrap();
        assert_eq!(ips(&a), ["10.7.4.2/24", "fd00:7::2/64"]);
        assert_eq!(a.routes.len(), 2);
        // A v6 set with a single usable address runs out while v4 has room:
        // the v4 lease must be rolled back.
        let d2 = tmp("dual2");
        let c2 = conf(
            &d2,
            json!({"ranges": [[{"subnet": "10.7.5.0/24"}],
            [{"subnet": "fd00:8::/120", "rangeStart": "fd00:8::5", "rangeEnd": "fd00:8::5"}]]}),
        );
        allocate(&c2, "c1", "eth0").unwrap();
        assert_eq!(
            allocate(&c2, "c2", "eth0").unwrap_err().code,
            code::IPAM_EXHAUSTED
        );
        let store = Store::lock(&c2.dir).unwrap();
        assert_eq!(
            store.leases().unwrap().len(),
            2,
            "c2's v4 lease was rolled back"
        );
        drop(store);
        std::fs::remove_dir_all(&d).unwrap();
        std::fs::remove_dir_all(&d2).unwrap();
    }

    #[test]
    fn gc_keeps_only_valid_attachments() {
        let d = tmp("gc");
        let c = conf(&d, json!({"subnet": "10.7.6.0/24"}));
        for i in 0..4 {
            allocate(&c, &format!("c{i}"), "eth0").unwrap();
        }
        let valid = vec![AttachmentRef {
            container_id: "c1".into(),
            ifname: "eth0".into(),
        }];
        assert_eq!(gc(&c, &valid).unwrap(), 3);
        assert_eq!(leased(&c, "c1", "eth0").unwrap().len(), 1);
        assert!(leased(&c, "c0", "eth0").unwrap().is_empty());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn concurrent_threads_get_distinct_addresses() {
        let d = tmp("conc");
        let c = conf(&d, json!({"subnet": "10.7.8.0/24"}));
        let handles: Vec<_> = (0..64)
            .map(|i| {
                let c = c.clone();
                std::thread::spawn(move || {
                    ips(&allocate(&c, &format!("c{i}"), "eth0").unwrap())[0].clone()
                })
            })
            .collect();
        let got: HashSet<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(got.len(), 64);
        let handles: Vec<_> = (0..64)
            .map(|i| {
                let c = c.clone();
                std::thread::spawn(move || release(&c, &format!("c{i}"), "eth0").unwrap())
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert!(Store::lock(&c.dir).unwrap().leases().unwrap().is_empty());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
