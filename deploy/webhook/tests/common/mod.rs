//! Helpers shared by the webhook crate's integration tests (each test file
//! includes this module with `mod common;`).

#![allow(dead_code)] // not every test file uses every helper

use serde_json::Value;
use std::path::{Path, PathBuf};

/// `deploy/kubernetes/<rel>`.
pub fn kubernetes_file(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../kubernetes")
        .join(rel)
}

/// The `data` of deploy/kubernetes/configmap.yaml (install.sh, the template, ...).
pub fn config_data() -> Value {
    let text = std::fs::read_to_string(kubernetes_file("configmap.yaml")).unwrap();
    let cm: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    serde_json::to_value(cm).unwrap()["data"].clone()
}

/// The uninstall DaemonSet's script (deploy/kubernetes/uninstall/uninstall.yaml),
/// run with `/bin/sh -c` as its init container runs it.
pub fn uninstall_script() -> String {
    let text = std::fs::read_to_string(kubernetes_file("uninstall/uninstall.yaml")).unwrap();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let v: Value = serde_json::to_value(
            <serde_yaml::Value as serde::Deserialize>::deserialize(doc).unwrap(),
        )
        .unwrap();
        if v["kind"] == "DaemonSet" {
            let command = &v["spec"]["template"]["spec"]["initContainers"][0]["command"];
            assert_eq!(command[0], "/bin/sh");
            assert_eq!(command[1], "-c");
            return command[2].as_str().unwrap().to_string();
        }
    }
    panic!("no DaemonSet in uninstall.yaml")
}

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

/// A node's host tree for running install.sh below `r`: the directories
/// `dirs` and the built binaries in `r/src` (install.sh's FLOWLANE_SRC_DIR).
pub fn install_tree(r: &Path, dirs: &[&str]) {
    for d in std::iter::once(&"src").chain(dirs) {
        std::fs::create_dir_all(r.join(d)).unwrap();
    }
    for bin in [
        "flowlane",
        "flowlaned",
        "shipped/libflowlane_preload.so",
        "shipped/libflowlane_noop.so",
        "shipped/flowlane-probe",
    ] {
        let from = release_dir().join(bin);
        let bin = bin.rsplit('/').next().unwrap();
        std::fs::copy(&from, r.join("src").join(bin))
            .unwrap_or_else(|e| panic!("{}: {e} (build the workspace first)", from.display()));
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
