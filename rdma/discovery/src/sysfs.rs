//! Reading attribute files under a (configurable) sysfs root.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// Default sysfs mount point.
pub const DEFAULT_SYSFS: &str = "/sys";

/// A sysfs tree: the real `/sys`, or a fake one in tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sysfs {
    root: PathBuf,
}

impl Default for Sysfs {
    fn default() -> Self {
        Sysfs::new(DEFAULT_SYSFS)
    }
}

impl Sysfs {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Sysfs { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `<root>/class/infiniband`: one entry per RDMA device.
    pub fn infiniband(&self) -> PathBuf {
        self.root.join("class/infiniband")
    }

    /// `<root>/class/net`: one entry per network interface.
    pub fn net(&self) -> PathBuf {
        self.root.join("class/net")
    }
}

/// Reads one attribute, trimmed. `None` when it is missing or unreadable:
/// the kernel answers `EINVAL` for attributes that do not apply (the type or
/// netdev of an unpopulated GID entry), which is "no value", not a failure.
pub fn attr(path: &Path) -> Option<String> {
    fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

/// Names of the entries of a directory, sorted. A missing directory is empty;
/// other errors are reported.
pub fn entries(dir: &Path) -> io::Result<Vec<String>> {
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut names: Vec<String> = rd
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort_by(|a, b| natural_cmp(a, b));
    Ok(names)
}

/// Orders `2` before `10` (port and GID indices are decimal file names).
fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    match (a.parse::<u64>(), b.parse::<u64>()) {
        (Ok(x), Ok(y)) => x.cmp(&y),
        _ => a.cmp(b),
    }
}

/// The last path component a symlink points to (`device/driver` -> `mlx5_core`).
pub fn link_name(path: &Path) -> Option<String> {
    fs::read_link(path)
        .ok()
        .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
}
