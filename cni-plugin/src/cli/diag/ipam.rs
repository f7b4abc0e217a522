//! IPAM usage and leaked leases, for the built-in allocator and host-local
//! (same on-disk layout: `<dataDir>/<network>/<ip>` holding
//! `"<containerID>\r\n<ifname>"`).
//!
//! A lease is leaked when no registered pod holds it, or when the pod that
//! holds it has lost its network namespace: the address stays taken until
//! someone runs CNI DEL, and a full pool stops new pods from starting. A
//! live pod's address without a lease is the opposite fault: the address
//! can be handed out twice.

use std::net::IpAddr;
use std::path::Path;

use serde::Serialize;

use super::cni_config::{nth_host, FlowlaneNet, Range};
use super::pods::{short, NetnsState, PodState};
use super::report::Section;

#[derive(Debug, Clone, Serialize)]
pub struct Lease {
    pub ip: IpAddr,
    pub container_id: String,
    pub ifname: Option<String>,
    /// `live`, `no_pod` or `netns_gone`.
    pub state: &'static str,
}

pub fn check(net: Option<&FlowlaneNet>, pods: &[PodState]) -> Section {
    let mut s = Section::new("ipam", "IP address management");
    let Some(net) = net else {
        s.info(
            "ipam.skipped",
            "no usable flowlane config, so no address pool to check",
        );
        return s;
    };
    if net.chained {
        s.info(
            "ipam.chained",
            format!(
                "flowlane is chained after {}: addresses are that plugin's",
                net.plugin_types[0]
            ),
        );
        return s;
    }
    let Some(dir) = &net.lease_dir else {
        s.info(
            "ipam.external",
            format!(
                "IPAM is delegated to {:?}; its leases are not inspected",
                net.ipam_type.as_deref().unwrap_or("none")
            ),
        );
        return s;
    };
    let leases = match read_leases(dir) {
        Ok(l) => l,
        Err(e) => {
            s.error(
                "ipam.unreadable",
                format!("cannot read the lease directory {}: {e}", dir.display()),
                "check its permissions; the plugin must be able to write there",
            );
            return s;
        }
    };
    let leases: Vec<Lease> = leases
        .into_iter()
        .map(|(ip, cid, ifname)| {
            let holder = pods.iter().find(|p| {
                let a = &p.attachment;
                a.network == net.network
                    && a.container_id == cid
                    && ifname.as_ref().is_none_or(|i| *i == a.ifname)
            });
            let state = match holder.map(|p| p.netns_state) {
                None => "no_pod",
                Some(NetnsState::Present) => "live",
                Some(_) => "netns_gone",
            };
            Lease {
                ip,
                container_id: cid,
                ifname,
                state,
            }
        })
        .collect();

    for r in &net.ranges {
        let used = leases.iter().filter(|l| r.subnet.contains(l.ip)).count() as u128;
        let cap = capacity(r);
        let pct = (used * 100).checked_div(cap).unwrap_or(100);
        let line = format!(
            "{}: {used} of {cap} address(es) leased ({pct}%), leases in {}",
            r.subnet,
            dir.display()
        );
        if cap > 0 && pct >= 90 {
            s.warn(
                "ipam.pool_nearly_full",
                line,
                "free leaked leases (below) or give the node a larger pod CIDR",
            );
        } else {
            s.info("ipam.usage", line);
        }
    }
    // The other way round: a live pod's address without its lease is free
    // in the allocator's eyes, and the next pod can get it too.
    for p in pods
        .iter()
        .filter(|p| p.attachment.network == net.network && p.netns_state == NetnsState::Present)
    {
        for ip in p.attachment.addresses() {
            let in_pool = net.ranges.iter().any(|r| r.subnet.contains(ip));
            if in_pool && !leases.iter().any(|l| l.ip == ip) {
                s.error(
                    "ipam.lease_missing",
                    format!(
                        "{ip} of container {} has no lease in {}: the allocator can hand it to another pod",
                        short(&p.attachment.container_id),
                        dir.display()
                    ),
                    format!(
                        "recreate the lease (printf '%s\\r\\n%s' {} {} > {}) or restart the pod so it gets a fresh address",
                        p.attachment.container_id,
                        p.attachment.ifname,
                        dir.join(ip.to_string()).display()
                    ),
                );
            }
        }
    }
    for l in leases.iter().filter(|l| l.state != "live") {
        let why = if l.state == "no_pod" {
            "has no pod registry entry"
        } else {
            "belongs to a pod whose network namespace is gone"
        };
        s.error(
            "ipam.leaked_lease",
            format!(
                "lease {} (container {}, {}) {why}",
                l.ip,
                short(&l.container_id),
                l.ifname.as_deref().unwrap_or("?")
            ),
            format!(
                "run CNI DEL for container {} (the runtime does when it removes the pod); if that \
                 container no longer exists anywhere, remove {}",
                l.container_id,
                dir.join(l.ip.to_string()).display()
            ),
        );
    }
    s.data = serde_json::json!({ "lease_dir": dir, "leases": leases });
    s
}

/// Lease files of one network; other files (`lock`, `last_reserved_ip.0`) are skipped.
fn read_leases(dir: &Path) -> std::io::Result<Vec<(IpAddr, String, Option<String>)>> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let Some(ip) = e
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<IpAddr>().ok())
        else {
            continue;
        };
        let Ok(text) = std::fs::read_to_string(e.path()) else {
            continue;
        };
        let mut lines = text.split(['\r', '\n']).filter(|l| !l.trim().is_empty());
        let cid = lines.next().unwrap_or_default().trim().to_string();
        let ifname = lines.next().map(|l| l.trim().to_string());
        out.push((ip, cid, ifname));
    }
    out.sort_by_key(|l| l.0);
    Ok(out)
}

/// Addresses the allocator can hand out in a range (host-local's rules:
/// network and broadcast addresses and the gateway are never leased).
fn capacity(r: &Range) -> u128 {
    let bits = if r.subnet.is_ipv4() { 32 } else { 128 };
    let size: u128 = if bits - r.subnet.prefix() as u32 >= 128 {
        u128::MAX
    } else {
        1u128 << (bits - r.subnet.prefix() as u32)
    };
    let to_u128 = |ip: IpAddr| match ip {
        IpAddr::V4(a) => u32::from(a) as u128,
        IpAddr::V6(a) => u128::from(a),
    };
    let first = r.range_start.or_else(|| nth_host(r.subnet, 1));
    let last = r.range_end.or_else(|| {
        let broadcast_skip = if r.subnet.is_ipv4() { 2 } else { 1 };
        size.checked_sub(broadcast_skip)
            .and_then(|n| nth_host(r.subnet, n))
    });
    let (Some(first), Some(last)) = (first, last) else {
        return 0;
    };
    let (a, b) = (to_u128(first), to_u128(last));
    if b < a {
        return 0;
    }
    let mut n = b - a + 1;
    if let Some(gw) = r.effective_gateway() {
        let g = to_u128(gw);
        if g >= a && g <= b {
            n -= 1;
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(subnet: &str, start: Option<&str>, end: Option<&str>, gw: Option<&str>) -> Range {
        Range {
            subnet: subnet.parse().unwrap(),
            gateway: gw.map(|g| g.parse().unwrap()),
            range_start: start.map(|s| s.parse().unwrap()),
            range_end: end.map(|s| s.parse().unwrap()),
        }
    }

    #[test]
    fn capacity_follows_host_local_rules() {
        // .1 is the gateway, .0 and .255 are never leased.
        assert_eq!(capacity(&range("10.0.0.0/24", None, None, None)), 253);
        assert_eq!(
            capacity(&range("10.0.0.0/24", None, None, Some("10.0.0.254"))),
            253
        );
        assert_eq!(
            capacity(&range(
                "10.0.0.0/24",
                Some("10.0.0.10"),
                Some("10.0.0.19"),
                None
            )),
            10
        );
        assert_eq!(capacity(&range("10.0.0.0/30", None, None, None)), 1);
        // IPv6 has no broadcast address.
        assert_eq!(capacity(&range("fd00::/120", None, None, None)), 254);
        assert_eq!(
            capacity(&range("fd00::/64", None, None, None)),
            (1u128 << 64) - 2
        );
    }

    #[test]
    fn lease_files_are_read_and_other_files_skipped() {
        let d = std::env::temp_dir().join(format!("flowlane-diag-leases-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("10.0.0.5"), "c1\r\neth0").unwrap();
        std::fs::write(d.join("fd00::5"), "c1\r\neth0").unwrap();
        std::fs::write(d.join("10.0.0.6"), "old-style-id-only").unwrap();
        std::fs::write(d.join("last_reserved_ip.0"), "10.0.0.6").unwrap();
        std::fs::write(d.join("lock"), "").unwrap();
        let leases = read_leases(&d).unwrap();
        assert_eq!(leases.len(), 3);
        assert_eq!(
            leases[0],
            (
                "10.0.0.5".parse().unwrap(),
                "c1".into(),
                Some("eth0".into())
            )
        );
        assert_eq!(
            leases[1],
            (
                "10.0.0.6".parse().unwrap(),
                "old-style-id-only".into(),
                None
            )
        );
        assert!(read_leases(&d.join("missing")).unwrap().is_empty());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
