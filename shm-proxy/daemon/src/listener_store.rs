//! Persists the flowlane listeners across daemon restarts.
//!
//! Listeners are announced once, at `listen()`, by processes that keep
//! running while the daemon restarts; without this file a restarted daemon
//! would answer "no listener" for every existing server until it re-listens.
//! Each record names the registering process (pid + start time), so records
//! of processes that died meanwhile are dropped on load.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::identity::ProcessId;
use crate::pods::PodId;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListenerRecord {
    pub pod: PodId,
    pub addr: SocketAddr,
    pub process: ProcessId,
}

#[derive(Debug, Clone)]
pub struct ListenerStore {
    path: PathBuf,
}

impl ListenerStore {
    pub fn new(state_dir: &Path) -> Self {
        ListenerStore {
            path: state_dir.join("daemon").join("listeners.json"),
        }
    }

    /// The saved records; a missing or corrupt file yields none (logged).
    pub fn load(&self) -> Vec<ListenerRecord> {
        match std::fs::read(&self.path) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                tracing::warn!(path = %self.path.display(), error = %e, "ignoring corrupt listener file");
                Vec::new()
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot read listener file");
                Vec::new()
            }
        }
    }

    /// Replaces the saved records atomically (temp file + rename).
    pub fn save(&self, records: &[ListenerRecord]) -> std::io::Result<()> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir)?;
        let tmp = dir.join(".listeners.json.tmp");
        let body = serde_json::to_vec(records).map_err(std::io::Error::other)?;
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&body)?;
        // No fsync: after a machine crash every process is gone anyway.
        std::fs::rename(&tmp, &self.path)
    }
}
