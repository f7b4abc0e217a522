//! `down`: removes everything a cluster's journal names, plus anything
//! carrying the cluster's name, in the order that cannot strand an object:
//! processes first (they could still be creating things), then pod
//! attachments (CNI DEL), then namespaces (which take their links and
//! bridges with them), then the run directory. Every step runs even when an
//! earlier one failed; all errors are reported together. Running it again,
//! or on a cluster that never existed, succeeds.

use std::path::Path;
use std::time::Duration;

use crate::cni::{self, PodRef};
use crate::journal::{self, Record};
use crate::procs;
use crate::sh;
use crate::spec::{self, Binaries, ClusterSpec, PREFIX};
use crate::status::SPEC_FILE;

/// How many times `down` sweeps for namespaces that appeared meanwhile.
const TEARDOWN_ROUNDS: usize = 10;

/// What `down` did.
#[derive(Debug, Default)]
pub struct DownReport {
    pub processes_ended: usize,
    pub pods_deleted: usize,
    pub namespaces_deleted: usize,
    pub run_dir_removed: bool,
    /// Problems that did not stop the teardown (e.g. a CNI DEL error on a
    /// namespace that is then deleted anyway).
    pub warnings: Vec<String>,
    /// Objects that are still there.
    pub errors: Vec<String>,
}

/// Named namespaces of cluster `name`, whether journaled or not (a journal
/// record is written before creation, but a namespace with the cluster's
/// prefix is the cluster's in any case).
fn cluster_netns(name: &str) -> Vec<String> {
    let prefix = format!("{PREFIX}{name}-");
    let mut out: Vec<String> = std::fs::read_dir("/var/run/netns")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

/// Tears cluster `name` down.
pub fn down(run_root: &Path, name: &str, bins: &Binaries) -> DownReport {
    let mut rep = DownReport::default();
    if let Err(e) = spec::validate_name(name) {
        rep.errors.push(e);
        return rep;
    }
    let run_dir = spec::run_dir(run_root, name);
    let records = journal::read(&run_dir).unwrap_or_else(|e| {
        rep.warnings.push(format!("journal: {e}"));
        Vec::new()
    });
    let spec: Option<ClusterSpec> = std::fs::read(run_dir.join(SPEC_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());

    // Steps 1 and 3 repeat until no namespace of the cluster remains: a
    // program started by a killed `up` (e.g. an `ip netns add` in flight)
    // may still create one while we tear down.
    let journaled: Vec<String> = records
        .iter()
        .filter_map(|r| match r {
            Record::Netns { name } => Some(name.clone()),
            _ => None,
        })
        .collect();
    for round in 0..TEARDOWN_ROUNDS {
        let mut namespaces = journaled.clone();
        for ns in cluster_netns(name) {
            if !namespaces.contains(&ns) {
                namespaces.push(ns);
            }
        }
        if round > 0 && cluster_netns(name).is_empty() {
            break;
        }
        end_processes(
            &namespaces,
            if round == 0 { &records } else { &[] },
            &mut rep,
        );
        if round == 0 {
            delete_pods(spec.as_ref(), &records, bins, &mut rep);
        }
        delete_namespaces(&mut namespaces, &mut rep);
        if cluster_netns(name).is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    for ns in cluster_netns(name) {
        rep.errors
            .push(format!("network namespace {ns} is still there"));
    }

    // 4. The run directory: journal, state, registries, leases, sockets, logs.
    match std::fs::remove_dir_all(&run_dir) {
        Ok(()) => rep.run_dir_removed = true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => rep
            .errors
            .push(format!("remove {}: {e}", run_dir.display())),
    }
    rep
}

/// 1. Processes: the journaled ones (daemons) and every process living in
///    one of the cluster's namespaces (workloads, a plugin that a killed
///    `up` left running).
fn end_processes(namespaces: &[String], records: &[Record], rep: &mut DownReport) {
    let inodes: Vec<u64> = namespaces
        .iter()
        .filter_map(|n| procs::netns_inode(n))
        .collect();
    let mut victims = procs::in_namespaces(&inodes);
    for r in records {
        if let Record::Process {
            pid, start_ticks, ..
        } = r
        {
            if procs::is_same_process(*pid, *start_ticks) && !victims.iter().any(|v| v.0 == *pid) {
                victims.push((*pid, *start_ticks));
            }
        }
    }
    let survivors = procs::terminate(&victims, Duration::from_secs(5));
    rep.processes_ended += victims.len() - survivors.len();
    for pid in survivors {
        rep.errors.push(format!("process {pid} survived SIGKILL"));
    }
}

/// 2. Pod attachments: CNI DEL as a runtime would, while the node
///    namespace (where the plugin runs) still exists.
fn delete_pods(
    spec: Option<&ClusterSpec>,
    records: &[Record],
    bins: &Binaries,
    rep: &mut DownReport,
) {
    let Some(spec) = spec else {
        return;
    };
    for r in records.iter().rev() {
        if let Record::Pod {
            node,
            pod,
            netns,
            container_id,
        } = r
        {
            if procs::netns_inode(&spec.node_netns(*node)).is_none() {
                continue;
            }
            let pod_name = spec.pod_name(*node, *pod);
            let pr = PodRef {
                node: *node,
                pod_name: &pod_name,
                netns,
                container_id,
            };
            match cni::del(spec, bins, &pr) {
                Ok(()) => rep.pods_deleted += 1,
                Err(e) => rep.warnings.push(e),
            }
        }
    }
}

/// 3. Namespaces, pods before nodes before the underlay (reverse of
///    creation); their veths and bridges go with them.
fn delete_namespaces(namespaces: &mut [String], rep: &mut DownReport) {
    namespaces.sort_by_key(|n| std::cmp::Reverse(n.len()));
    for ns in namespaces.iter() {
        if !std::path::Path::new("/var/run/netns").join(ns).exists() {
            continue;
        }
        match sh::ip(&["netns", "del", ns]) {
            Ok(_) => rep.namespaces_deleted += 1,
            Err(e) => rep.warnings.push(e.to_string()),
        }
    }
}
