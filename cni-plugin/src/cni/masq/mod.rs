//! Masquerade for `ipMasq`: traffic from a pod address to anything outside
//! its subnet, the cluster's pod CIDRs (`flowlane_netlink::exempt`) and
//! multicast is source-NATed, like the reference
//! plugin's per-container rule. One nf_tables rule per pod address in
//! tables `ip flowlane` / `ip6 flowlane`, chain `postrouting`
//! (nat, srcnat priority), tagged with a comment naming the network and
//! attachment so DEL and GC find their rules. Talks netlink directly: no
//! `nft` or `iptables` process.

use std::collections::HashSet;
use std::net::IpAddr;

use ipnetwork::IpNetwork;

use super::config::{AttachmentRef, NetConf};
use super::error::{code, CniError, CniResult};
use super::names::fnv1a64;
use flowlane_netlink::exempt::Owner;
use flowlane_netlink::nft::{At, Expr, Nft, NFPROTO_IPV4, NFPROTO_IPV6};

pub use flowlane_netlink::exempt::{CHAIN, TABLE};

fn err(what: &str, e: std::io::Error) -> CniError {
    CniError::new(code::MASQUERADE, format!("masquerade: {what}")).with_details(e)
}

fn net_tag(network: &str) -> String {
    format!("{:08x}", fnv1a64(&[network]) as u32)
}

fn att_tag(network: &str, container_id: &str, ifname: &str) -> String {
    format!(
        "{:012x}",
        fnv1a64(&[network, container_id, ifname]) & 0xffff_ffff_ffff
    )
}

/// "flowlane <net tag><attachment tag> <readable part>"; the first 29 bytes
/// identify the rule, the rest is for people reading `nft list ruleset`.
fn comment(network: &str, container_id: &str, ifname: &str) -> String {
    let id: String = container_id.chars().take(12).collect();
    format!(
        "flowlane {}{} {network} {id}/{ifname}",
        net_tag(network),
        att_tag(network, container_id, ifname)
    )
}

fn key_of(comment: &str) -> Option<(&str, &str)> {
    let rest = comment.strip_prefix("flowlane ")?;
    Some((rest.get(..8)?, rest.get(8..20)?))
}

fn family(v4: bool) -> u8 {
    if v4 {
        NFPROTO_IPV4
    } else {
        NFPROTO_IPV6
    }
}

fn octets(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// Installs the rules for an attachment's addresses.
pub fn add(conf: &NetConf, container_id: &str, ifname: &str, addrs: &[IpNetwork]) -> CniResult<()> {
    let mut nft = Nft::open().map_err(|e| err("netfilter socket", e))?;
    let c = comment(&conf.name, container_id, ifname);
    for v4 in [true, false] {
        let mine: Vec<&IpNetwork> = addrs.iter().filter(|a| a.is_ipv4() == v4).collect();
        if mine.is_empty() {
            continue;
        }
        let (saddr_off, daddr_off, len) = if v4 { (12, 16, 4) } else { (8, 24, 16) };
        let (mcast_mask, mcast_net): (Vec<u8>, Vec<u8>) = if v4 {
            (vec![0xf0, 0, 0, 0], vec![0xe0, 0, 0, 0])
        } else {
            let mut m = vec![0u8; 16];
            m[0] = 0xff;
            (m.clone(), m)
        };
        let mut data = Vec::new();
        for a in &mine {
            let ip = octets(a.ip());
            let mask = octets(a.mask());
            let net = octets(a.network());
            data.push((ip, mask, net));
        }
        let rules: Vec<(Vec<Expr>, String)> = data
            .iter()
            .map(|(ip, mask, net)| {
                (
                    vec![
                        Expr::Payload {
                            offset: saddr_off,
                            len,
                        },
                        Expr::Cmp { eq: true, data: ip },
                        Expr::Payload {
                            offset: daddr_off,
                            len,
                        },
                        Expr::Mask(mask),
                        Expr::Cmp {
                            eq: false,
                            data: net,
                        },
                        Expr::Payload {
                            offset: daddr_off,
                            len,
                        },
                        Expr::Mask(&mcast_mask),
                        Expr::Cmp {
                            eq: false,
                            data: &mcast_net,
                        },
                        Expr::Masquerade,
                    ],
                    c.clone(),
                )
            })
            .collect();
        nft.add_rules(family(v4), TABLE, CHAIN, &rules, At::Tail)
            .map_err(|e| err("adding rule", e))?;
    }
    // The conflist's clusterCIDRs are never masqueraded (flowlaned keeps
    // every node's pod CIDR exempt too; docs/cni.md).
    if !conf.cluster_cidrs.is_empty() {
        flowlane_netlink::exempt::sync(Owner::Conf, &conf.cluster_cidrs, true)
            .map_err(|e| err("cluster exemptions", e))?;
    }
    Ok(())
}

/// Deletes rules of this network for which `stale(attachment tag)` holds.
fn delete_where(conf: &NetConf, stale: impl Fn(&str) -> bool) -> CniResult<usize> {
    let mut nft = Nft::open().map_err(|e| err("netfilter socket", e))?;
    let want_net = net_tag(&conf.name);
    let mut n = 0;
    for v4 in [true, false] {
        let rules = nft
            .list_rules(family(v4), TABLE, CHAIN)
            .map_err(|e| err("listing rules", e))?;
        let handles: Vec<u64> = rules
            .iter()
            .filter(
                |r| matches!(key_of(&r.comment), Some((net, att)) if net == want_net && stale(att)),
            )
            .map(|r| r.handle)
            .collect();
        n += handles.len();
        nft.delete_rules(family(v4), TABLE, CHAIN, &handles)
            .map_err(|e| err("deleting rules", e))?;
    }
    Ok(n)
}

/// Removes an attachment's rules; none present is fine.
pub fn remove(conf: &NetConf, container_id: &str, ifname: &str) -> CniResult<()> {
    let tag = att_tag(&conf.name, container_id, ifname);
    delete_where(conf, |att| att == tag).map(drop)
}

/// Whether an attachment has a rule (CHECK).
pub fn present(conf: &NetConf, container_id: &str, ifname: &str) -> CniResult<bool> {
    let mut nft = Nft::open().map_err(|e| err("netfilter socket", e))?;
    let want = (
        net_tag(&conf.name),
        att_tag(&conf.name, container_id, ifname),
    );
    for v4 in [true, false] {
        let rules = nft
            .list_rules(family(v4), TABLE, CHAIN)
            .map_err(|e| err("listing rules", e))?;
        if rules
            .iter()
            .any(|r| key_of(&r.comment) == Some((want.0.as_str(), want.1.as_str())))
        {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Removes this network's rules of attachments not in `valid`.
pub fn gc(conf: &NetConf, valid: &[AttachmentRef]) -> CniResult<()> {
    let keep: HashSet<String> = valid
        .iter()
        .map(|v| att_tag(&conf.name, &v.container_id, &v.ifname))
        .collect();
    let n = delete_where(conf, |att| !keep.contains(att))?;
    tracing::info!(removed = n, "masquerade gc");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comment_keys_identify_network_and_attachment() {
        let c = comment("net1", "0123456789abcdef0123", "eth0");
        assert!(c.len() < 127);
        let (n, a) = key_of(&c).unwrap();
        assert_eq!(n, net_tag("net1"));
        assert_eq!(a, att_tag("net1", "0123456789abcdef0123", "eth0"));
        assert_ne!(a, att_tag("net1", "0123456789abcdef0123", "eth1"));
        assert_eq!(key_of("something else"), None);
    }
}
