//! Hands the live connections over to the next daemon.
//!
//! Connections keep flowing while the daemon restarts, and their ends
//! report their close to whichever daemon runs then. So that a successor
//! counts such a report only from the connection's own pods (and only once
//! per side), a daemon that stops gracefully writes its live connections
//! here; the next one takes the file (reads and removes it). After a crash
//! there is no file, and reports of the earlier connections are ignored.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::identity::ProcessId;
use crate::pods::PodId;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelRecord {
    pub id: u64,
    pub client_pod: PodId,
    pub server_pod: PodId,
    /// Milliseconds since the Unix epoch when the connection opened.
    pub opened_unix_ms: u64,
    pub client_process: Option<ProcessId>,
    pub server_process: Option<ProcessId>,
    pub client_reported: bool,
    pub server_reported: bool,
}

#[derive(Debug, Clone)]
pub struct ChannelStore {
    path: PathBuf,
}

impl ChannelStore {
    pub fn new(state_dir: &Path) -> Self {
        ChannelStore {
            path: state_dir.join("daemon").join("connections.json"),
        }
    }

    /// The saved records, removing the file; a missing or corrupt file
    /// yields none (logged).
    pub fn take(&self) -> Vec<ChannelRecord> {
        let records = match std::fs::read(&self.path) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                tracing::warn!(path = %self.path.display(), error = %e, "ignoring corrupt connection file");
                Vec::new()
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot read connection file");
                Vec::new()
            }
        };
        if let Err(e) = std::fs::remove_file(&self.path) {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot remove connection file");
        }
        records
    }

    /// Replaces the saved records atomically (temp file + rename).
    pub fn save(&self, records: &[ChannelRecord]) -> std::io::Result<()> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir)?;
        let tmp = dir.join(".connections.json.tmp");
        let body = serde_json::to_vec(records).map_err(std::io::Error::other)?;
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&body)?;
        std::fs::rename(&tmp, &self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_taken_once() {
        let dir = std::env::temp_dir().join(format!("fld-chstore-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = ChannelStore::new(&dir);
        assert!(store.take().is_empty());
        let r = ChannelRecord {
            id: 7,
            client_pod: 1,
            server_pod: 2,
            opened_unix_ms: 1000,
            client_process: None,
            server_process: None,
            client_reported: true,
            server_reported: false,
        };
        store.save(std::slice::from_ref(&r)).unwrap();
        assert_eq!(store.take(), vec![r]);
        assert!(store.take().is_empty(), "taken, not read");
        std::fs::write(dir.join("daemon/connections.json"), b"{bad").unwrap();
        assert!(store.take().is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
