//! The cluster's journal: one JSON record per line, appended and synced to
//! disk BEFORE the object it names is created. `down` undoes whatever the
//! journal names, so a `up` killed at any point leaves nothing `down` cannot
//! find.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// One object the launcher is about to create.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Record {
    /// A network namespace (`/var/run/netns/<name>`).
    Netns { name: String },
    /// A pod attachment the CNI plugin is about to make (undone with DEL).
    Pod {
        node: u32,
        pod: u32,
        netns: String,
        container_id: String,
    },
    /// A process started on behalf of the cluster (pid and its start time
    /// from `/proc/PID/stat`, so a reused pid is never killed).
    Process {
        what: String,
        pid: i32,
        start_ticks: u64,
    },
}

pub const FILE_NAME: &str = "journal";

/// An open journal.
pub struct Journal {
    file: File,
    path: PathBuf,
}

impl Journal {
    /// Opens (creating) the journal in `run_dir`.
    pub fn open(run_dir: &Path) -> std::io::Result<Journal> {
        let path = run_dir.join(FILE_NAME);
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
        Ok(Journal { file, path })
    }

    /// Appends `rec` and waits until it is on disk.
    pub fn record(&mut self, rec: &Record) -> std::io::Result<()> {
        let mut line = serde_json::to_string(rec).map_err(std::io::Error::other)?;
        line.push('\n');
        self.file.write_all(line.as_bytes())?;
        self.file.sync_data()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Reads every record of the journal in `run_dir` (none if it does not
/// exist). A torn last line (killed mid-write) is skipped.
pub fn read(run_dir: &Path) -> std::io::Result<Vec<Record>> {
    let path = run_dir.join(FILE_NAME);
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for line in BufReader::new(file).lines() {
        let line = line?;
        if let Ok(rec) = serde_json::from_str(&line) {
            out.push(rec);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_torn_lines_are_skipped() {
        let dir = std::env::temp_dir().join(format!("flc-journal-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut j = Journal::open(&dir).unwrap();
        let a = Record::Netns {
            name: "flcx-u".into(),
        };
        let b = Record::Process {
            what: "flowlaned n0".into(),
            pid: 42,
            start_ticks: 7,
        };
        j.record(&a).unwrap();
        j.record(&b).unwrap();
        std::fs::OpenOptions::new()
            .append(true)
            .open(j.path())
            .unwrap()
            .write_all(b"{\"kind\":\"netns\",\"na")
            .unwrap();
        assert_eq!(read(&dir).unwrap(), vec![a, b]);
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(read(&dir).unwrap().is_empty());
    }
}
