//! One scan of the node's pod processes: the pods from the registry (only
//! entries whose namespace is still live), then every process under
//! `/proc` whose network namespace is a pod's, each classified by
//! [`classify_process`]. A round is bounded: at most `max_processes`
//! entries of `/proc` and `deadline` of time; a scan cut short says so.
//! Executables are parsed once per identity (device, inode, size, ctime).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use flowlane_lane::proto::{OffLaneProcess, OffLaneReason, PodProcesses, ProcessScan};

use super::exe::{self, ExeFacts};
use super::procfs::{self, ExeKey, Fds, Library};
use crate::pods::{PodId, PodTable};

/// Most processes listed per pod (all are counted).
pub const MAX_LISTED: usize = 64;
/// Most executables remembered.
const MAX_CACHED: usize = 4096;

/// The bounds of one round.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub deadline: Duration,
    pub max_processes: usize,
}

impl Default for Bounds {
    fn default() -> Self {
        Bounds {
            deadline: Duration::from_secs(2),
            max_processes: 1 << 17,
        }
    }
}

/// What one process is, for the lane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Empty: the process runs the library and nothing bypasses it.
    pub reasons: Vec<OffLaneReason>,
}

/// Why a process is off the lane, from its executable, mappings and fds.
pub fn classify_process(exe: Option<ExeFacts>, library: Library, fds: &Fds) -> Verdict {
    let mut reasons = Vec::new();
    match exe {
        None => reasons.push(OffLaneReason::UnknownExe),
        Some(f) => {
            if f.is_static {
                reasons.push(OffLaneReason::Static);
            }
            if f.is_go {
                reasons.push(OffLaneReason::Go);
            }
        }
    }
    // A static program cannot load the library: saying so again is noise.
    if !exe.is_some_and(|f| f.is_static) {
        match library {
            Library::Absent => reasons.push(OffLaneReason::NoLibrary),
            Library::Noop => reasons.push(OffLaneReason::NoopLibrary),
            Library::Loaded => {}
        }
    }
    if fds.io_uring {
        reasons.push(OffLaneReason::IoUring);
    }
    Verdict { reasons }
}

/// The scanner: where the registry is, and the executables it has parsed.
pub struct Scanner {
    registry: flowlane_registry::Registry,
    nsfs_dev: Option<u64>,
    cache: HashMap<ExeKey, Option<ExeFacts>>,
    bounds: Bounds,
}

impl Scanner {
    pub fn new(state_dir: PathBuf, bounds: Bounds) -> Self {
        Scanner {
            registry: flowlane_registry::Registry::new(state_dir),
            nsfs_dev: crate::identity::nsfs_dev().ok(),
            cache: HashMap::new(),
            bounds,
        }
    }

    /// The pods whose registry entries name a live namespace.
    fn pods(&self) -> PodTable {
        let Some(dev) = self.nsfs_dev else {
            return PodTable::default();
        };
        match self.registry.list() {
            Ok(all) => {
                let live: Vec<_> = all
                    .into_iter()
                    .filter(|a| crate::pods::netns_is_live(&a.netns, a.netns_inode, dev))
                    .collect();
                PodTable::from_attachments(&live)
            }
            Err(e) => {
                tracing::warn!(error = %e, "process scan: cannot read the pod registry");
                PodTable::default()
            }
        }
    }

    /// The executable's facts, parsed once per identity.
    fn exe_facts(&mut self, pid: u32, key: ExeKey, used: &mut HashSet<ExeKey>) -> Option<ExeFacts> {
        used.insert(key);
        if let Some(f) = self.cache.get(&key) {
            return *f;
        }
        let facts = match procfs::open_exe(pid) {
            Ok(file) => match exe::classify(&file) {
                Ok(f) => Some(f),
                Err(e) => {
                    tracing::debug!(pid, error = ?e, "process scan: executable not classified");
                    None
                }
            },
            Err(_) => None,
        };
        if self.cache.len() < MAX_CACHED {
            self.cache.insert(key, facts);
        }
        facts
    }

    /// One round.
    pub fn scan(&mut self) -> ProcessScan {
        let started = Instant::now();
        let pods = self.pods();
        let mut per_pod: BTreeMap<PodId, PodProcesses> = BTreeMap::new();
        let mut tcp_of: HashMap<PodId, HashSet<u64>> = HashMap::new();
        let mut used = HashSet::new();
        let mut complete = true;
        let mut unreadable = 0;
        let entries = match std::fs::read_dir("/proc") {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "process scan: cannot list /proc");
                return ProcessScan::default();
            }
        };
        if pods.is_empty() {
            return ProcessScan {
                complete: true,
                ..ProcessScan::default()
            };
        }
        for (n, entry) in entries.enumerate() {
            if n >= self.bounds.max_processes || started.elapsed() > self.bounds.deadline {
                complete = false;
                break;
            }
            let Some(pid) = entry
                .ok()
                .and_then(|e| e.file_name().to_str()?.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(netns) = crate::identity::netns_inode_of_pid(pid) else {
                continue;
            };
            if !pods.contains(netns) {
                continue;
            }
            // Kernel threads and zombies have no executable; a process
            // that exited meanwhile is gone: neither is counted. One the
            // daemon may not read (no CAP_SYS_PTRACE) is counted as such.
            let read = procfs::exe_key(pid)
                .and_then(|key| Ok((key, procfs::library_of(pid)?, procfs::fds_of(pid)?)));
            let (key, library, fds) = match read {
                Ok(r) => r,
                Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                    unreadable += 1;
                    continue;
                }
                Err(_) => continue,
            };
            let facts = self.exe_facts(pid, key, &mut used);
            let verdict = classify_process(facts, library, &fds);
            let tcp = tcp_of
                .entry(netns)
                .or_insert_with(|| procfs::tcp_inodes(pid).unwrap_or_default());
            let tcp_sockets = fds.sockets.iter().filter(|i| tcp.contains(i)).count() as u32;
            let pod = per_pod.entry(netns).or_insert_with(|| PodProcesses {
                pod: pods.name_of(netns),
                ..PodProcesses::default()
            });
            if verdict.reasons.is_empty() {
                pod.lane += 1;
                continue;
            }
            if tcp_sockets > 0 {
                pod.tcp += 1;
            } else {
                pod.idle += 1;
            }
            for r in &verdict.reasons {
                *pod.reasons.entry(*r).or_default() += 1;
            }
            pod.off_lane.push(OffLaneProcess {
                pid,
                exe: procfs::exe_path(pid),
                tcp_sockets,
                reasons: verdict.reasons,
            });
        }
        // Executables no process runs any more are forgotten.
        self.cache.retain(|k, _| used.contains(k));
        let mut pods: Vec<PodProcesses> = per_pod.into_values().collect();
        for p in &mut pods {
            p.off_lane.sort_by_key(|o| (o.tcp_sockets == 0, o.pid));
            p.off_lane.truncate(MAX_LISTED);
        }
        pods.sort_by(|a, b| a.pod.cmp(&b.pod));
        if unreadable > 0 {
            tracing::warn!(
                unreadable,
                "process scan: pod processes the daemon may not read (it needs root with CAP_SYS_PTRACE)"
            );
        }
        ProcessScan {
            age_ms: 0,
            duration_ms: started.elapsed().as_millis() as u64,
            complete,
            unreadable,
            pods,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DYNAMIC: Option<ExeFacts> = Some(ExeFacts {
        is_static: false,
        is_go: false,
    });

    #[test]
    fn reasons_follow_executable_library_and_fds() {
        let none = Fds::default();
        let uring = Fds {
            sockets: vec![1],
            io_uring: true,
        };
        assert!(classify_process(DYNAMIC, Library::Loaded, &none)
            .reasons
            .is_empty());
        assert_eq!(
            classify_process(DYNAMIC, Library::Absent, &none).reasons,
            vec![OffLaneReason::NoLibrary]
        );
        assert_eq!(
            classify_process(DYNAMIC, Library::Noop, &none).reasons,
            vec![OffLaneReason::NoopLibrary]
        );
        assert_eq!(
            classify_process(DYNAMIC, Library::Loaded, &uring).reasons,
            vec![OffLaneReason::IoUring]
        );
        let go_static = Some(ExeFacts {
            is_static: true,
            is_go: true,
        });
        assert_eq!(
            classify_process(go_static, Library::Absent, &none).reasons,
            vec![OffLaneReason::Static, OffLaneReason::Go]
        );
        let go_dynamic = Some(ExeFacts {
            is_static: false,
            is_go: true,
        });
        assert_eq!(
            classify_process(go_dynamic, Library::Loaded, &none).reasons,
            vec![OffLaneReason::Go]
        );
        assert_eq!(
            classify_process(None, Library::Loaded, &none).reasons,
            vec![OffLaneReason::UnknownExe]
        );
    }
}
