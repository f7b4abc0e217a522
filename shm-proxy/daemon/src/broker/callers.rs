//! Who may ask what: the calling pod (by its network namespace, rechecked
//! on every request) and the node's administrators (node requests).

use flowlane_lane::proto::ErrorCode;

use super::{Answer, Broker, Caller};
use crate::pods::PodId;

impl Broker {
    /// The caller's pod, rereading the registry once if it is unknown.
    pub(super) fn caller_pod(&mut self, caller: &Caller) -> Result<PodId, Answer> {
        let Some(netns) = caller.netns else {
            return Err(self.deny(ErrorCode::UnknownPod, "cannot identify the calling process"));
        };
        if !(self.pods.contains(netns) || (self.reload_if_changed() && self.pods.contains(netns))) {
            return Err(self.deny(
                ErrorCode::UnknownPod,
                format!("network namespace {netns} is not a pod of this node"),
            ));
        }
        // The entry was live at the last reread; the pod may have died
        // since and its inode gone to a new namespace (the caller's).
        if !self.pod_is_live(netns) {
            return Err(self.deny(
                ErrorCode::UnknownPod,
                format!("the registry entry of network namespace {netns} is stale"),
            ));
        }
        Ok(netns)
    }

    /// Node-level requests (stats: every connection, pod names, byte
    /// counts; the registry poke) come only from the node's administrators:
    /// uid 0, or a member of `--admin-gid`, in the daemon's own or the
    /// initial network namespace. Not from a pod (a pod must not learn
    /// about other pods' connections), not from a namespace a process
    /// made for itself (`unshare -n`: root in a pod can do that), not from
    /// other uids of the node.
    pub(super) fn node_caller(&mut self, caller: &Caller) -> Result<(), Answer> {
        let (Some(netns), Some(_)) = (caller.netns, caller.process) else {
            return Err(self.deny(ErrorCode::Forbidden, "cannot identify the calling process"));
        };
        if self.pods.contains(netns) {
            return Err(self.deny(
                ErrorCode::Forbidden,
                "node requests are not allowed from a pod",
            ));
        }
        if !self.node_netns.contains(&netns) {
            return Err(self.deny(
                ErrorCode::Forbidden,
                "node requests are answered only in the node's network namespace",
            ));
        }
        if caller.uid == Some(0) || self.in_admin_group(caller) {
            return Ok(());
        }
        Err(self.deny(
            ErrorCode::Forbidden,
            "node requests need uid 0 or the daemon's admin group (--admin-gid)",
        ))
    }

    /// Whether the caller's effective gid, or one of its supplementary
    /// groups (read from /proc, then the process checked to be the same),
    /// is the admin group.
    fn in_admin_group(&self, caller: &Caller) -> bool {
        let Some(admin) = self.admin_gid else {
            return false;
        };
        if caller.gid == Some(admin) {
            return true;
        }
        caller.process.is_some_and(|p| {
            self.kernel
                .groups_of(p.pid)
                .is_ok_and(|g| g.contains(&admin))
                && self.kernel.is_alive(&p)
        })
    }
}
