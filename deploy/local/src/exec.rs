//! Running a program in a pod of the cluster, the way the deploy layer
//! injects flowlane into pods: `LD_PRELOAD` of the preload library plus the
//! node daemon's socket (`FLOWLANE_SOCKET`). A pod here shares the host's
//! mount namespace, so the socket path is reachable as it is; in Kubernetes
//! the socket directory is mounted into the pod.

use std::process::Command;

use crate::spec::Binaries;
use crate::status::{ClusterState, PodState};

/// A command prefix that runs its program inside `pod`'s network
/// namespace, with the preload library injected when `preload` is set.
/// Append the program and its arguments.
pub fn in_pod(bins: &Binaries, state: &ClusterState, pod: &PodState, preload: bool) -> Command {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &pod.netns, "env"]);
    if preload {
        cmd.arg(format!("LD_PRELOAD={}", bins.preload().display()));
        cmd.arg(format!(
            "FLOWLANE_SOCKET={}",
            state.node(pod.node).daemon_socket.display()
        ));
    }
    cmd
}

/// Finds a pod by name (`n0p1`) or network namespace name.
pub fn find_pod<'a>(state: &'a ClusterState, name: &str) -> Option<&'a PodState> {
    state
        .pods
        .iter()
        .find(|p| p.name == name || p.netns == name)
}
