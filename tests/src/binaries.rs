//! Locating the binaries under test and the third-party programs they are
//! tested against.

use std::path::{Path, PathBuf};

/// Where Debian's `containernetworking-plugins` installs the reference plugins.
pub const REFERENCE_CNI_DIR: &str = "/usr/lib/cni";

/// The cargo profile directory holding the workspace's binaries
/// (`<target>/release`), found from the running test executable
/// (`<target>/release/deps/<test>` or `<target>/release/<bin>`).
///
/// `FLOWLANE_BIN_DIR` overrides it (for running the suite against an
/// installed build).
pub fn build_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("FLOWLANE_BIN_DIR") {
        return PathBuf::from(dir);
    }
    let exe = std::env::current_exe().expect("current_exe");
    let parent = exe.parent().expect("exe has a parent");
    if parent.file_name().is_some_and(|n| n == "deps") {
        parent.parent().expect("deps has a parent").to_path_buf()
    } else {
        parent.to_path_buf()
    }
}

/// A workspace binary (`flowlane`, `flowlaned`, ...) or library next to the
/// tests. Panics with a hint when it has not been built.
pub fn workspace_artifact(name: &str) -> PathBuf {
    if name == PRELOAD {
        return shipped_preload();
    }
    let path = build_dir().join(name);
    assert!(
        path.exists(),
        "{} not found: build the workspace first (cargo build --release --workspace)",
        path.display()
    );
    path
}

const PRELOAD: &str = "libflowlane_preload.so";

/// The preload library as flowlane ships it (`shm-proxy/preload/ship.sh`:
/// linked against glibc 2.17's symbol versions), which every test loads
/// into its pods, not the build machine's `cargo build` output.
pub fn shipped_preload() -> PathBuf {
    let path = build_dir().join("shipped").join(PRELOAD);
    assert!(
        path.exists(),
        "{} not found: build the shipped preload library (bash shm-proxy/preload/ship.sh; tests/run does)",
        path.display()
    );
    path
}

/// The `flowlane` binary under test.
pub fn flowlane() -> PathBuf {
    workspace_artifact("flowlane")
}

/// A reference CNI plugin from Debian's package (`bridge`, `host-local`, ...).
pub fn reference_plugin(name: &str) -> PathBuf {
    let path = Path::new(REFERENCE_CNI_DIR).join(name);
    assert!(
        path.exists(),
        "{} not found: install containernetworking-plugins",
        path.display()
    );
    path
}

/// Which main plugin the CNI suites drive. `FLOWLANE_E2E_PLUGIN=reference`
/// points them at Debian's `bridge` + `host-local` instead of `flowlane`,
/// which validates the harness itself against a known-good plugin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PluginUnderTest {
    Flowlane,
    Reference,
}

impl PluginUnderTest {
    pub fn from_env() -> Self {
        match std::env::var("FLOWLANE_E2E_PLUGIN").as_deref() {
            Ok("reference") | Ok("bridge") => PluginUnderTest::Reference,
            _ => PluginUnderTest::Flowlane,
        }
    }

    /// The executable the runtime would exec.
    pub fn binary(self) -> PathBuf {
        match self {
            PluginUnderTest::Flowlane => flowlane(),
            PluginUnderTest::Reference => reference_plugin("bridge"),
        }
    }

    /// `type` in the network configuration.
    pub fn type_name(self) -> &'static str {
        match self {
            PluginUnderTest::Flowlane => "flowlane",
            PluginUnderTest::Reference => "bridge",
        }
    }

    /// `ipam.type` for the plugin's own allocator.
    pub fn builtin_ipam(self) -> &'static str {
        match self {
            PluginUnderTest::Flowlane => "flowlane",
            PluginUnderTest::Reference => "host-local",
        }
    }

    /// `CNI_PATH` for the plugin: its own directory, then the reference plugins.
    pub fn cni_path(self) -> String {
        let own = self.binary();
        let own_dir = own
            .parent()
            .expect("binary has a dir")
            .display()
            .to_string();
        format!("{own_dir}:{REFERENCE_CNI_DIR}")
    }
}
