//! The node's pods as the registry lists them: rereading it (only when it
//! changed), trusting an entry only while its namespace is the one it
//! recorded, and finding the pod that owns an address.

use std::net::IpAddr;

use flowlane_lane::proto::FallbackReason;

use super::channels::IntentKey;
use super::Broker;
use crate::pods::{PodId, PodTable};

impl Broker {
    /// Every address of the node's pods, after rereading the registry if
    /// it changed (what the peer table lists).
    pub fn pod_ips(&mut self) -> Vec<std::net::IpAddr> {
        self.reload_if_changed();
        self.pods.ips().collect()
    }

    /// Whether a registry entry still names a live namespace.
    fn entry_is_live(&self, path: &str, inode: u64) -> bool {
        self.kernel.netns_is_live(path, inode)
    }

    /// Whether pod `pod` is in the table and its namespace is still the
    /// one its entry recorded (checked on every request that needs the
    /// caller's pod: one stat).
    pub(super) fn pod_is_live(&self, pod: PodId) -> bool {
        self.pods.get(pod).is_some_and(|p| {
            p.netns_paths
                .iter()
                .any(|path| self.kernel.netns_is_live(path, pod))
        })
    }

    /// Rereads the pod registry and forgets listeners, pending channels and
    /// stock of pods that left.
    pub fn reload_registry(&mut self) {
        let attachments = match self.kernel.registry() {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the pod registry; keeping the old view");
                return;
            }
        };
        self.registry_stamp = self.kernel.registry_stamp();
        // A runtime that crashed before CNI DEL leaves entries whose
        // namespace is gone; the kernel may give their inodes to new
        // namespaces, which must not become those pods.
        let (live, stale): (Vec<_>, Vec<_>) = attachments
            .into_iter()
            .partition(|a| self.entry_is_live(&a.netns, a.netns_inode));
        for a in &stale {
            tracing::warn!(
                entry = %a.container_id,
                netns = %a.netns,
                inode = a.netns_inode,
                "registry entry names a namespace that is gone (or is another one now): not trusted"
            );
        }
        self.pods = PodTable::from_attachments(&live);
        self.kernel
            .publish_pods(&self.pods.ips().collect::<Vec<_>>());
        self.counters.registry_reloads += 1;
        let pods = &self.pods;
        let before = self.listeners.len();
        self.listeners.retain(|(pod, _), _| pods.contains(*pod));
        self.forget_gone_stock_takers();
        self.forget_stock_of_gone_pods();
        let pods = &self.pods;
        self.inherited
            .retain(|_, r| pods.contains(r.client_pod) && pods.contains(r.server_pod));
        let gone: Vec<IntentKey> = self
            .pending
            .values()
            .filter(|p| {
                !pods.contains(p.client_pod) || p.server_pod.is_some_and(|s| !pods.contains(s))
            })
            .map(|p| p.key)
            .collect();
        for key in gone {
            self.drop_pending(key, FallbackReason::IntentCancelled);
        }
        if self.listeners.len() != before {
            self.save_listeners();
        }
        tracing::debug!(pods = self.pods.len(), "pod registry loaded");
    }

    /// Rereads the registry only if its directories changed since the last
    /// read (cheap: a few stat calls), so unknown callers cannot make the
    /// daemon parse the registry over and over.
    pub(super) fn reload_if_changed(&mut self) -> bool {
        if self.kernel.registry_stamp() != self.registry_stamp {
            self.reload_registry();
            true
        } else {
            false
        }
    }

    /// The name of the local pod that owns `ip` (stats of the relay's
    /// connections).
    pub fn pod_name_at(&self, ip: IpAddr) -> Option<String> {
        self.pods
            .owner_of(ip.to_canonical())
            .map(|p| self.pods.name_of(p.id))
    }

    /// True when `ip` belongs to a pod of this node.
    pub fn is_local_pod_ip(&mut self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.pods.owner_of(ip).is_some()
            || (self.reload_if_changed() && self.pods.owner_of(ip).is_some())
    }

    /// The pod of this node that owns `ip`, rereading the registry once
    /// if none does (a pod added a moment ago may not be in our view yet).
    pub(super) fn local_pod_of(&mut self, ip: IpAddr) -> Option<PodId> {
        match self.pods.owner_of(ip) {
            Some(p) => Some(p.id),
            None => {
                self.reload_if_changed();
                self.pods.owner_of(ip).map(|p| p.id)
            }
        }
    }

    pub(super) fn pod_owns(&self, pod: PodId, ip: IpAddr) -> bool {
        self.pods.get(pod).is_some_and(|p| p.owns(ip))
    }
}
