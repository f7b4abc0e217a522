//! Temporary directories and file listings.

use std::fs;
use std::path::{Path, PathBuf};

/// A directory removed with everything below it when dropped.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
    /// Kept when this environment variable is set at drop (to look at a
    /// failed test's logs and state).
    keep_env: Option<&'static str>,
}

impl TempDir {
    /// Creates `/tmp/flt-<tag>-<pid>-<n>`, a directory no one else has.
    ///
    /// Kept short on purpose: suites bind Unix sockets several directories
    /// below it (the kubelet's plugin registry, containerd's socket), and a
    /// socket path has at most 107 bytes. The counter is shared by every
    /// suite of the one e2e binary, so it grows to three or four digits in a
    /// run; a runtime-style container id here (pid, counter and 16 hex digits
    /// of the clock) once pushed the CSI registration socket to 108 bytes.
    pub fn new(tag: &str) -> Self {
        let tmp = std::env::temp_dir();
        loop {
            let path = tmp.join(crate::names::temp_dir_name(tag));
            // `create_dir`, not `create_dir_all`: a directory left by an
            // earlier process with the same pid is never reused.
            match fs::create_dir(&path) {
                Ok(()) => {
                    return TempDir {
                        path,
                        keep_env: None,
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => panic!("create temp dir {}: {e}", path.display()),
            }
        }
    }

    /// `<tmp>/<name>`, made afresh (a directory left there by an earlier
    /// run is removed first), kept at drop when `keep_env` is set then.
    /// For harnesses whose names are already unique on the machine
    /// (`crate::names`).
    pub fn fresh(name: &str, keep_env: &'static str) -> Self {
        let path = std::env::temp_dir().join(name);
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path)
            .unwrap_or_else(|e| panic!("create temp dir {}: {e}", path.display()));
        TempDir {
            path,
            keep_env: Some(keep_env),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn join(&self, p: impl AsRef<Path>) -> PathBuf {
        self.path.join(p)
    }

    /// The path as a string (for JSON configs).
    pub fn str(&self) -> String {
        self.path.display().to_string()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if self.keep_env.is_some_and(|v| std::env::var_os(v).is_some()) {
            return;
        }
        // Best effort: a mount left below (CRI test) would make this fail; such
        // tests unmount first.
        let _ = fs::remove_dir_all(&self.path);
    }
}

/// Every regular file below `dir` (recursive), sorted; empty if `dir` is missing.
pub fn files_below(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(p),
                Ok(_) => out.push(p),
                Err(_) => {}
            }
        }
    }
    out.sort();
    out
}

/// Files below `dir` whose name is an IP address: the lease files of
/// host-local's on-disk layout (`<dataDir>/<network>/<ip>`), which
/// flowlane's allocator follows too.
pub fn lease_files(dir: &Path) -> Vec<PathBuf> {
    files_below(dir)
        .into_iter()
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.parse::<std::net::IpAddr>().is_ok())
        })
        .collect()
}

/// Files below `dir` whose content mentions `needle` (e.g. a container id).
pub fn files_mentioning(dir: &Path, needle: &str) -> Vec<PathBuf> {
    files_below(dir)
        .into_iter()
        .filter(|p| {
            fs::read(p)
                .map(|b| String::from_utf8_lossy(&b).contains(needle))
                .unwrap_or(false)
        })
        .collect()
}
