//! Helpers shared by the webhook crate's integration tests (each test file
//! includes this module with `mod common;`).

#![allow(dead_code)] // not every test file uses every helper

use std::path::PathBuf;

/// A temporary directory, made empty on creation and removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// `<tmp>/flowlane-<tag>-<pid>`: unique per test process and tag.
    pub fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("flowlane-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `<target>/release` (or debug): where the workspace's binaries are, one
/// level above the test executable's `deps/`.
pub fn release_dir() -> PathBuf {
    std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf()
}
