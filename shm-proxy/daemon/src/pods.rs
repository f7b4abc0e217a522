//! The pods of this node as the daemon sees them: built from the pod
//! registry the CNI plugin writes, indexed by network-namespace inode (how a
//! client process is recognised) and by IP (how a destination is recognised).

use std::collections::HashMap;
use std::net::IpAddr;

use flowlane_registry::Attachment;

/// A pod is identified by the inode of its network namespace: every process
/// of the pod shares it, and `/proc/PID/ns/net` reveals it for any client.
pub type PodId = u64;

/// One address of a pod with its prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodAddr {
    pub ip: IpAddr,
    pub prefix: u8,
}

impl PodAddr {
    fn contains(&self, other: IpAddr) -> bool {
        match (self.ip, other) {
            (IpAddr::V4(a), IpAddr::V4(b)) => {
                let p = u32::from(self.prefix.min(32));
                let mask = u32::MAX.checked_shl(32 - p).unwrap_or(0);
                u32::from(a) & mask == u32::from(b) & mask
            }
            (IpAddr::V6(a), IpAddr::V6(b)) => {
                let p = u32::from(self.prefix.min(128));
                let mask = u128::MAX.checked_shl(128 - p).unwrap_or(0);
                u128::from(a) & mask == u128::from(b) & mask
            }
            _ => false,
        }
    }
}

/// A pod: one network namespace with all the addresses its attachments got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    pub id: PodId,
    /// `namespace/name`, or the container id when the runtime gave no name.
    pub name: String,
    pub addrs: Vec<PodAddr>,
    /// Where the runtime pinned the namespace (`CNI_NETNS` of each
    /// attachment): how the daemon tells a live pod from a stale entry
    /// whose inode the kernel gave to a new namespace.
    pub netns_paths: Vec<String>,
}

impl Pod {
    pub fn owns(&self, ip: IpAddr) -> bool {
        self.addrs.iter().any(|a| a.ip == ip)
    }

    /// The pod's source address for a connection to `dst`: same family,
    /// preferring the address whose subnet contains `dst`.
    pub fn source_for(&self, dst: IpAddr) -> Option<IpAddr> {
        let same_family = |a: &&PodAddr| a.ip.is_ipv4() == dst.is_ipv4();
        self.addrs
            .iter()
            .filter(same_family)
            .find(|a| a.contains(dst))
            .or_else(|| self.addrs.iter().find(same_family))
            .map(|a| a.ip)
    }
}

/// Every pod of the node.
#[derive(Debug, Default, Clone)]
pub struct PodTable {
    by_id: HashMap<PodId, Pod>,
    by_ip: HashMap<IpAddr, PodId>,
}

impl PodTable {
    pub fn from_attachments(attachments: &[Attachment]) -> Self {
        let mut t = PodTable::default();
        for a in attachments {
            let pod = t.by_id.entry(a.netns_inode).or_insert_with(|| Pod {
                id: a.netns_inode,
                name: pod_name(a),
                addrs: Vec::new(),
                netns_paths: Vec::new(),
            });
            if !a.netns.is_empty() && !pod.netns_paths.contains(&a.netns) {
                pod.netns_paths.push(a.netns.clone());
            }
            for s in &a.ips {
                let Some(addr) = parse_cidr(s) else {
                    tracing::warn!(entry = %a.container_id, ip = %s, "ignoring unparsable registry address");
                    continue;
                };
                if !pod.addrs.contains(&addr) {
                    pod.addrs.push(addr);
                }
                if let Some(other) = t.by_ip.insert(addr.ip, a.netns_inode) {
                    if other != a.netns_inode {
                        tracing::warn!(ip = %addr.ip, "address claimed by two pods; the later entry wins");
                    }
                }
            }
        }
        t
    }

    pub fn get(&self, id: PodId) -> Option<&Pod> {
        self.by_id.get(&id)
    }

    /// The pod that owns `ip`.
    pub fn owner_of(&self, ip: IpAddr) -> Option<&Pod> {
        self.by_ip.get(&ip).and_then(|id| self.by_id.get(id))
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Every address of every pod.
    pub fn ips(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.by_ip.keys().copied()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    pub fn contains(&self, id: PodId) -> bool {
        self.by_id.contains_key(&id)
    }

    /// Display name of a pod, or a placeholder for one that left.
    pub fn name_of(&self, id: PodId) -> String {
        self.by_id
            .get(&id)
            .map(|p| p.name.clone())
            .unwrap_or_else(|| format!("netns:{id}"))
    }
}

/// Whether the namespace an attachment names is still the one it recorded:
/// its path (`CNI_NETNS`) is a namespace file (on nsfs, device `nsfs_dev`)
/// with the recorded inode. A runtime that crashed before CNI DEL leaves
/// an entry whose path is gone (or, for `/proc/PID/ns/net` paths, names
/// another process's namespace); the kernel may give the inode to a new
/// namespace, which must not become that pod. An empty path cannot be
/// checked and is not trusted.
pub fn netns_is_live(path: &str, inode: u64, nsfs_dev: u64) -> bool {
    !path.is_empty()
        && crate::identity::netns_at(std::path::Path::new(path))
            .is_ok_and(|(dev, ino)| dev == nsfs_dev && ino == inode)
}

fn pod_name(a: &Attachment) -> String {
    match (&a.pod_namespace, &a.pod_name) {
        (Some(ns), Some(name)) => format!("{ns}/{name}"),
        (None, Some(name)) => name.clone(),
        _ => a.container_id.chars().take(12).collect(),
    }
}

fn parse_cidr(s: &str) -> Option<PodAddr> {
    let (ip, prefix) = match s.split_once('/') {
        Some((ip, p)) => (ip.parse::<IpAddr>().ok()?, p.parse::<u8>().ok()?),
        None => {
            let ip: IpAddr = s.parse().ok()?;
            (ip, if ip.is_ipv4() { 32 } else { 128 })
        }
    };
    let max = if ip.is_ipv4() { 32 } else { 128 };
    (prefix <= max).then_some(PodAddr { ip, prefix })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn att(id: &str, inode: u64, ips: &[&str]) -> Attachment {
        Attachment {
            network: "n".into(),
            container_id: id.into(),
            ifname: "eth0".into(),
            netns: String::new(),
            netns_inode: inode,
            ips: ips.iter().map(|s| s.to_string()).collect(),
            mac: String::new(),
            pod_namespace: Some("default".into()),
            pod_name: Some(id.into()),
            pod_uid: None,
            created_unix: 0,
        }
    }

    #[test]
    fn indexes_by_inode_and_ip_and_merges_attachments() {
        let mut second = att("a", 1, &["10.1.0.2/24"]);
        second.ifname = "net1".into();
        second.ips = vec!["192.168.5.2/24".into(), "fd00::2/64".into()];
        let t = PodTable::from_attachments(&[
            att("a", 1, &["10.1.0.2/24"]),
            second,
            att("b", 2, &["10.1.0.3/24"]),
        ]);
        assert_eq!(t.len(), 2);
        let a = t.get(1).unwrap();
        assert_eq!(a.name, "default/a");
        assert_eq!(a.addrs.len(), 3);
        assert_eq!(t.owner_of("192.168.5.2".parse().unwrap()).unwrap().id, 1);
        assert_eq!(t.owner_of("10.1.0.3".parse().unwrap()).unwrap().id, 2);
        assert!(t.owner_of("10.1.0.4".parse().unwrap()).is_none());
        // Source selection: subnet match first, then family.
        assert_eq!(
            a.source_for("192.168.5.9".parse().unwrap()),
            Some("192.168.5.2".parse().unwrap())
        );
        assert_eq!(
            a.source_for("10.1.0.3".parse().unwrap()),
            Some("10.1.0.2".parse().unwrap())
        );
        assert_eq!(
            a.source_for("8.8.8.8".parse().unwrap()),
            Some("10.1.0.2".parse().unwrap())
        );
        assert_eq!(
            a.source_for("fd00::9".parse().unwrap()),
            Some("fd00::2".parse().unwrap())
        );
    }

    #[test]
    fn only_a_namespace_file_with_the_recorded_inode_is_live() {
        use crate::identity::{nsfs_dev, own_netns_inode};
        let dev = nsfs_dev().unwrap();
        let own = own_netns_inode().unwrap();
        let me = format!("/proc/{}/ns/net", std::process::id());
        assert!(netns_is_live(&me, own, dev));
        // The inode went to another namespace, or the path is gone.
        assert!(!netns_is_live(&me, own + 1, dev));
        assert!(!netns_is_live(
            "/var/run/netns/flowlane-no-such-ns",
            own,
            dev
        ));
        assert!(!netns_is_live("", own, dev));
        // A regular file with the right inode number is no namespace.
        use std::os::unix::fs::MetadataExt;
        let f = std::env::temp_dir().join(format!("fld-pods-{}", std::process::id()));
        std::fs::write(&f, b"x").unwrap();
        let ino = std::fs::metadata(&f).unwrap().ino();
        assert!(!netns_is_live(f.to_str().unwrap(), ino, dev));
        std::fs::remove_file(&f).unwrap();
        // The paths of every attachment are kept.
        let mut a = att("a", own, &["10.1.0.2/24"]);
        a.netns = me.clone();
        let t = PodTable::from_attachments(&[a.clone(), a]);
        assert_eq!(t.get(own).unwrap().netns_paths, vec![me]);
    }

    #[test]
    fn bad_addresses_are_skipped() {
        let t = PodTable::from_attachments(&[att("a", 1, &["garbage", "10.0.0.1/40", "10.0.0.2"])]);
        assert_eq!(
            t.get(1).unwrap().addrs,
            vec![PodAddr {
                ip: "10.0.0.2".parse().unwrap(),
                prefix: 32
            }]
        );
    }
}
