//! Registered pods against the network namespaces that exist: an entry
//! whose namespace is gone (or was replaced: same path, other inode) is a
//! pod the runtime removed without CNI DEL; the daemon would still trust
//! its IPs.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use flowlane_registry::{Attachment, Registry};
use serde::Serialize;

use super::report::Section;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NetnsState {
    Present,
    Missing,
    InodeMismatch,
}

#[derive(Debug, Clone, Serialize)]
pub struct PodState {
    #[serde(flatten)]
    pub attachment: Attachment,
    pub netns_state: NetnsState,
}

impl PodState {
    fn label(&self) -> String {
        let a = &self.attachment;
        let who = match (&a.pod_namespace, &a.pod_name) {
            (Some(ns), Some(n)) => format!("{ns}/{n}"),
            _ => format!("container {}", short(&a.container_id)),
        };
        format!("{who} ({}, {})", a.ifname, a.ips.join(" "))
    }
}

/// A container id as people read it: runtimes' 64-hex-digit ids cut to 12
/// (as `crictl ps` shows them), other ids whole.
pub fn short(id: &str) -> &str {
    if id.len() > 16 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
        &id[..12]
    } else {
        id
    }
}

fn netns_state(a: &Attachment) -> NetnsState {
    match std::fs::metadata(&a.netns) {
        Err(_) => NetnsState::Missing,
        Ok(m) if a.netns_inode != 0 && m.ino() != a.netns_inode => NetnsState::InodeMismatch,
        Ok(_) => NetnsState::Present,
    }
}

pub fn check(state_dir: &Path) -> (Section, Vec<PodState>) {
    let reg = Registry::new(state_dir);
    let mut s = Section::new(
        "pods",
        format!("Registered pods ({})", reg.root().display()),
    );
    let entries = match reg.list() {
        Ok(e) => e,
        Err(e) => {
            s.error(
                "pods.registry_unreadable",
                format!("cannot read the pod registry: {e}"),
                "check the permissions of the state directory (the plugin and the daemon run as root)",
            );
            return (s, Vec::new());
        }
    };
    let pods: Vec<PodState> = entries
        .into_iter()
        .map(|a| PodState {
            netns_state: netns_state(&a),
            attachment: a,
        })
        .collect();
    s.data = serde_json::to_value(&pods).unwrap_or_default();
    let live = pods
        .iter()
        .filter(|p| p.netns_state == NetnsState::Present)
        .count();
    if pods.is_empty() {
        s.info("pods.none", "no pods registered on this node");
    } else if live > 0 {
        s.ok(
            "pods.live",
            format!("{live} registered pod attachment(s) with a live network namespace"),
        );
    }
    for p in &pods {
        let a = &p.attachment;
        match p.netns_state {
            NetnsState::Present => s.info("pods.pod", format!("{} in {}", p.label(), a.netns)),
            NetnsState::Missing => s.error(
                "pods.netns_missing",
                format!("{} is registered, but its network namespace {} is gone", p.label(), a.netns),
                format!(
                    "the runtime removed the pod without CNI DEL; run CNI DEL (or GC) for container {} \
                     or remove {}",
                    a.container_id,
                    reg.root().join(&a.network).join(format!("{}-{}.json", a.container_id, a.ifname)).display()
                ),
            ),
            NetnsState::InodeMismatch => s.error(
                "pods.netns_replaced",
                format!(
                    "{} is registered for network namespace {} (inode {}), but that path is now another namespace",
                    p.label(),
                    a.netns,
                    a.netns_inode
                ),
                "the entry is stale (the path was reused); run CNI DEL for the old container so the \
                 daemon stops trusting its IPs",
            ),
        }
    }
    (s, pods)
}
