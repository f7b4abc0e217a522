//! What a running cluster is made of (written by `up`, read by the demo and
//! `flowlane cluster status`), and a live check of it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::procs;
use crate::spec::{self, ClusterSpec};

pub const STATE_FILE: &str = "state.json";
pub const SPEC_FILE: &str = "cluster.json";
/// The static node table for the daemons (`{"nodes": [{"name",
/// "podCIDRs", "underlay"}]}`, the format of `flowlane_nodes`).
pub const NODES_FILE: &str = "nodes.json";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeState {
    pub index: u32,
    pub name: String,
    pub netns: String,
    pub underlay_ip: String,
    pub pod_cidr: String,
    pub daemon_socket: PathBuf,
    /// `Some(pid)` when the node's flowlaned started and answered.
    pub daemon_pid: Option<i32>,
    /// Why the daemon is not running, when it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub daemon_problem: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PodState {
    pub node: u32,
    pub index: u32,
    pub name: String,
    pub netns: String,
    pub container_id: String,
    pub ip: String,
}

/// A cluster as `up` left it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterState {
    pub spec: ClusterSpec,
    pub nodes: Vec<NodeState>,
    pub pods: Vec<PodState>,
}

impl ClusterState {
    pub fn run_dir(&self) -> PathBuf {
        self.spec.run_dir()
    }

    /// Loads the state of cluster `name` under `run_root`.
    pub fn load(run_root: &Path, name: &str) -> Result<ClusterState, String> {
        let path = spec::run_dir(run_root, name).join(STATE_FILE);
        let bytes = std::fs::read(&path).map_err(|e| {
            format!(
                "cluster {name:?} is not up (or `up` did not finish): {}: {e}",
                path.display()
            )
        })?;
        serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn save(&self) -> std::io::Result<()> {
        let path = self.run_dir().join(STATE_FILE);
        let tmp = path.with_extension("tmp");
        std::fs::write(
            &tmp,
            serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?,
        )?;
        std::fs::rename(tmp, path)
    }

    pub fn node(&self, index: u32) -> &NodeState {
        &self.nodes[index as usize]
    }
}

/// A live look at a cluster: every namespace and daemon, each checked.
#[derive(Debug, Clone, Serialize)]
pub struct StatusReport {
    pub name: String,
    pub up: bool,
    pub problems: Vec<String>,
    pub state: Option<ClusterState>,
}

/// Checks cluster `name`: its state file, namespaces and daemons.
pub fn status(run_root: &Path, name: &str) -> StatusReport {
    let state = match ClusterState::load(run_root, name) {
        Ok(s) => s,
        Err(e) => {
            return StatusReport {
                name: name.to_string(),
                up: false,
                problems: vec![e],
                state: None,
            }
        }
    };
    let mut problems = Vec::new();
    let mut netns: Vec<&str> = vec![];
    let underlay = state.spec.underlay_netns();
    netns.push(&underlay);
    netns.extend(state.nodes.iter().map(|n| n.netns.as_str()));
    netns.extend(state.pods.iter().map(|p| p.netns.as_str()));
    for ns in netns {
        if procs::netns_inode(ns).is_none() {
            problems.push(format!("network namespace {ns} is missing"));
        }
    }
    for n in &state.nodes {
        match n.daemon_pid {
            Some(pid) if procs::start_ticks(pid).is_some() => {}
            Some(pid) => problems.push(format!("node {}: flowlaned (pid {pid}) is gone", n.name)),
            None => problems.push(format!(
                "node {}: flowlaned not running ({})",
                n.name,
                n.daemon_problem.as_deref().unwrap_or("unknown")
            )),
        }
    }
    StatusReport {
        name: name.to_string(),
        up: true,
        problems,
        state: Some(state),
    }
}
