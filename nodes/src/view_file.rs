//! The node view a running `flowlaned` keeps in
//! `<state-dir>/daemon/nodes.json`, for people and tools: one type, written
//! by the daemon's refresher and read by `flowlane diag`, so writer and
//! reader cannot drift apart.
//!
//! The file is another process's output: the reader takes every field but
//! `nodes` as optional (an older or newer daemon may lack one), and the
//! table it carries goes through [`ClusterView::new`]'s checks like any other.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{NodeEntry, RdmaLane};

/// The file's name under `<state-dir>/daemon/`.
pub const FILE_NAME: &str = "nodes.json";

/// What RDMA discovery found on this node at the daemon's last refresh.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct LocalRdma {
    /// RDMA devices found in sysfs.
    pub devices: Vec<String>,
    /// The lane this node offers (the selected GID), if any.
    pub lane: Option<RdmaLane>,
    /// Why there is no lane (`select_gid`'s reason), when there is none.
    pub no_lane: Option<String>,
}

/// What `<state-dir>/daemon/nodes.json` holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeViewFile {
    /// This node's name (`--node-name`).
    #[serde(default)]
    pub node: String,
    /// Where the table came from (the static file's path, or the Kubernetes API).
    #[serde(default)]
    pub source: String,
    #[serde(default)]
    pub updated_unix: u64,
    /// This node's entry in the table, if it is listed.
    #[serde(default)]
    pub listed: bool,
    #[serde(default)]
    pub lane_port: Option<u16>,
    #[serde(default)]
    pub rdma: LocalRdma,
    /// Kubernetes: what the last publish did ("lane", "none", "unchanged",
    /// or why it did not happen).
    #[serde(default)]
    pub publish: Option<String>,
    /// The last refresh's error; the table is then the last good one.
    #[serde(default)]
    pub error: Option<String>,
    pub nodes: Vec<NodeEntry>,
}

/// Why the file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ViewFileError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Parse(#[from] serde_json::Error),
}

impl NodeViewFile {
    /// Reads the file; `Ok(None)` when there is none (no daemon ran here).
    pub fn read(path: &Path) -> Result<Option<Self>, ViewFileError> {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        Ok(Some(serde_json::from_slice(&bytes)?))
    }

    /// Writes the file whole or not at all (a reader never sees half of it):
    /// into a temporary file beside it, then renamed over it.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let body = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, body)?;
        std::fs::rename(&tmp, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_written_reads_back_and_a_bare_table_is_enough() {
        let dir = std::env::temp_dir().join(format!("cg-view-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(FILE_NAME);
        assert!(NodeViewFile::read(&path).unwrap().is_none());
        let view = NodeViewFile {
            node: "n0".into(),
            source: "test".into(),
            updated_unix: 7,
            listed: true,
            lane_port: Some(7000),
            rdma: LocalRdma {
                devices: vec!["rxe0".into()],
                lane: None,
                no_lane: Some("no GID".into()),
            },
            publish: None,
            error: Some("last refresh failed".into()),
            nodes: vec![NodeEntry {
                name: "n0".into(),
                pod_cidrs: vec!["10.240.0.0/24".parse().unwrap()],
                underlay: "192.0.2.1".parse().unwrap(),
                lane_port: Some(7000),
                rdma: None,
            }],
        };
        view.write(&path).unwrap();
        assert_eq!(NodeViewFile::read(&path).unwrap(), Some(view));
        std::fs::write(&path, r#"{"nodes": []}"#).unwrap();
        let bare = NodeViewFile::read(&path).unwrap().unwrap();
        assert!(bare.nodes.is_empty() && bare.source.is_empty() && bare.error.is_none());
        std::fs::write(&path, r#"{"node": "n0"}"#).unwrap();
        assert!(matches!(
            NodeViewFile::read(&path),
            Err(ViewFileError::Parse(_))
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
