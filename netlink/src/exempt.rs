//! The cluster's masquerade exemptions: rules at the head of flowlane's
//! nat chain (`ip flowlane postrouting`, `ip6 flowlane postrouting`) that
//! accept traffic to a pod CIDR of the cluster before any per-pod
//! masquerade rule sees it: `ip daddr 10.231.2.0/24 accept`. Only traffic
//! leaving the cluster is masqueraded, as with flannel's `--ip-masq`.
//!
//! Each rule's comment names its owner: `flowlane cluster node <cidr>`
//! (kept equal to every node's pod CIDR by `flowlaned`) or
//! `flowlane cluster conf <cidr>` (the conflist's `clusterCIDRs`, seeded by
//! the plugin at ADD). An owner changes only its own rules.

use std::io;
use std::net::IpAddr;

use ipnetwork::IpNetwork;

use crate::nft::{At, Expr, Nft, NFPROTO_IPV4, NFPROTO_IPV6};

/// flowlane's nat table (both families) and its postrouting chain.
pub const TABLE: &str = "flowlane";
pub const CHAIN: &str = "postrouting";
const PREFIX: &str = "flowlane cluster ";

/// Who keeps a set of exemptions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// `flowlaned`: every node's pod CIDR.
    Node,
    /// The plugin: the conflist's `clusterCIDRs`.
    Conf,
}

impl Owner {
    fn word(self) -> &'static str {
        match self {
            Owner::Node => "node",
            Owner::Conf => "conf",
        }
    }
}

fn comment(owner: Owner, cidr: &IpNetwork) -> String {
    format!("{PREFIX}{} {cidr}", owner.word())
}

/// An exemption rule found in the chain.
#[derive(Debug, Clone)]
struct Found {
    family: u8,
    handle: u64,
    owner: Option<Owner>,
    cidr: String,
}

fn octets(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

fn list(nft: &mut Nft) -> io::Result<Vec<Found>> {
    let mut out = Vec::new();
    for family in [NFPROTO_IPV4, NFPROTO_IPV6] {
        for r in nft.list_rules(family, TABLE, CHAIN)? {
            let Some(rest) = r.comment.strip_prefix(PREFIX) else {
                continue;
            };
            let (word, cidr) = rest.split_once(' ').unwrap_or((rest, ""));
            let owner = match word {
                "node" => Some(Owner::Node),
                "conf" => Some(Owner::Conf),
                _ => None,
            };
            out.push(Found {
                family,
                handle: r.handle,
                owner,
                cidr: cidr.to_string(),
            });
        }
    }
    Ok(out)
}

/// Adds the exemptions of `want` that `owner` has not yet, and (unless
/// `keep_others`) deletes `owner`'s rules for CIDRs not in `want`.
/// Returns (added, removed).
pub fn sync(owner: Owner, want: &[IpNetwork], keep_others: bool) -> io::Result<(usize, usize)> {
    let mut nft = Nft::open()?;
    let have = list(&mut nft)?;
    let mine: Vec<&Found> = have.iter().filter(|f| f.owner == Some(owner)).collect();
    let mut removed = 0;
    if !keep_others {
        for family in [NFPROTO_IPV4, NFPROTO_IPV6] {
            let stale: Vec<u64> = mine
                .iter()
                .filter(|f| f.family == family && !want.iter().any(|w| w.to_string() == f.cidr))
                .map(|f| f.handle)
                .collect();
            removed += stale.len();
            nft.delete_rules(family, TABLE, CHAIN, &stale)?;
        }
    }
    let mut added = 0;
    for v4 in [true, false] {
        let missing: Vec<&IpNetwork> = want
            .iter()
            .filter(|w| w.is_ipv4() == v4 && !mine.iter().any(|f| f.cidr == w.to_string()))
            .collect();
        if missing.is_empty() {
            continue;
        }
        let (off, len) = if v4 { (16, 4) } else { (24, 16) };
        let data: Vec<(Vec<u8>, Vec<u8>, String)> = missing
            .iter()
            .map(|c| (octets(c.mask()), octets(c.network()), comment(owner, c)))
            .collect();
        let rules: Vec<(Vec<Expr>, String)> = data
            .iter()
            .map(|(mask, net, c)| {
                (
                    vec![
                        Expr::Payload { offset: off, len },
                        Expr::Mask(mask),
                        Expr::Cmp {
                            eq: true,
                            data: net,
                        },
                        Expr::Accept,
                    ],
                    c.clone(),
                )
            })
            .collect();
        let family = if v4 { NFPROTO_IPV4 } else { NFPROTO_IPV6 };
        nft.add_rules(family, TABLE, CHAIN, &rules, At::Head)?;
        added += rules.len();
    }
    Ok((added, removed))
}

/// Deletes every exemption rule (both owners); returns how many.
pub fn remove_all() -> io::Result<usize> {
    let mut nft = Nft::open()?;
    let have = list(&mut nft)?;
    for family in [NFPROTO_IPV4, NFPROTO_IPV6] {
        let h: Vec<u64> = have
            .iter()
            .filter(|f| f.family == family)
            .map(|f| f.handle)
            .collect();
        nft.delete_rules(family, TABLE, CHAIN, &h)?;
    }
    Ok(have.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comments_name_owner_and_cidr() {
        let c: IpNetwork = "10.231.2.0/24".parse().unwrap();
        assert_eq!(
            comment(Owner::Node, &c),
            "flowlane cluster node 10.231.2.0/24"
        );
        assert_eq!(
            comment(Owner::Conf, &c),
            "flowlane cluster conf 10.231.2.0/24"
        );
    }
}
