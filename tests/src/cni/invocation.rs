//! One plugin execution: the CNI environment and stdin in, the result or the
//! spec's error JSON out.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::Duration;

use serde_json::Value;

use crate::process;

/// Spec versions a 1.1.0 plugin must be able to answer in.
pub const VERSIONS: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// The spec's well-known error codes.
pub mod code {
    pub const INCOMPATIBLE_VERSION: u64 = 1;
    pub const UNSUPPORTED_FIELD: u64 = 2;
    pub const UNKNOWN_CONTAINER: u64 = 3;
    pub const INVALID_ENV: u64 = 4;
    pub const IO_FAILURE: u64 = 5;
    pub const DECODE_FAILURE: u64 = 6;
    pub const INVALID_CONFIG: u64 = 7;
    pub const TRY_AGAIN_LATER: u64 = 11;
    pub const NOT_AVAILABLE: u64 = 50;
    pub const LIMITED_CONNECTIVITY: u64 = 51;
}

/// One plugin execution being prepared. Every variable can be left unset
/// (to test the plugin's handling of a missing one).
#[derive(Debug, Clone)]
pub struct Invocation {
    plugin: PathBuf,
    node: Option<String>,
    env: BTreeMap<String, String>,
    stdin: Vec<u8>,
    timeout: Duration,
}

impl Invocation {
    /// `CNI_COMMAND=<command>` for `plugin`, nothing else set yet.
    pub fn new(plugin: impl AsRef<Path>, command: &str) -> Self {
        let mut env = BTreeMap::new();
        env.insert("CNI_COMMAND".to_string(), command.to_string());
        Invocation {
            plugin: plugin.as_ref().to_path_buf(),
            node: None,
            env,
            stdin: Vec::new(),
            timeout: Duration::from_secs(120),
        }
    }

    pub fn env(mut self, key: &str, value: impl Into<String>) -> Self {
        self.env.insert(key.to_string(), value.into());
        self
    }

    pub fn unset(mut self, key: &str) -> Self {
        self.env.remove(key);
        self
    }

    pub fn container_id(self, id: &str) -> Self {
        self.env("CNI_CONTAINERID", id)
    }

    pub fn netns(self, path: impl Into<String>) -> Self {
        self.env("CNI_NETNS", path)
    }

    pub fn ifname(self, name: &str) -> Self {
        self.env("CNI_IFNAME", name)
    }

    pub fn args(self, args: &str) -> Self {
        self.env("CNI_ARGS", args)
    }

    pub fn cni_path(self, path: &str) -> Self {
        self.env("CNI_PATH", path)
    }

    /// The network configuration (serialised as stdin).
    pub fn config(mut self, conf: &Value) -> Self {
        self.stdin = serde_json::to_vec(conf).expect("config serialises");
        self
    }

    /// Raw stdin bytes (for malformed-input tests).
    pub fn stdin(mut self, bytes: impl Into<Vec<u8>>) -> Self {
        self.stdin = bytes.into();
        self
    }

    /// Runs the plugin inside the network namespace `node` (named, as
    /// `ip netns` knows it) instead of the test's: a "node" of a cluster
    /// simulated on one machine, whose bridge and host-side veths live there.
    pub fn in_netns(mut self, node: &str) -> Self {
        self.node = Some(node.to_string());
        self
    }

    /// Runs the plugin with exactly these variables (plus `PATH`), as
    /// libcni does (it passes the runtime's environment, which has no CNI_*).
    pub fn run(&self) -> PluginOutput {
        let mut cmd = match &self.node {
            Some(node) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", node]).arg(&self.plugin);
                c
            }
            None => Command::new(&self.plugin),
        };
        cmd.env_clear().env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        );
        if let Ok(v) = std::env::var("RUST_LOG") {
            cmd.env("RUST_LOG", v);
        }
        cmd.envs(&self.env);
        let out = process::run_with_input(&mut cmd, &self.stdin, self.timeout)
            .unwrap_or_else(|e| panic!("running {}: {e}", self.plugin.display()));
        PluginOutput {
            // Debian's reference plugins predate the 1.0 rule that errors carry cniVersion.
            strict: !self.plugin.starts_with(crate::binaries::REFERENCE_CNI_DIR),
            command: self.env.get("CNI_COMMAND").cloned().unwrap_or_default(),
            status: out.status,
            stdout: out.stdout,
            stderr: out.stderr,
        }
    }
}

/// What a plugin execution produced.
#[derive(Debug, Clone)]
pub struct PluginOutput {
    /// Whether spec-1.0 strictness applies (error JSON carries `cniVersion`).
    pub strict: bool,
    pub command: String,
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

/// The spec's error object.
#[derive(Debug, Clone)]
pub struct CniError {
    pub code: u64,
    pub msg: String,
    pub details: Option<String>,
    pub raw: Value,
}

impl PluginOutput {
    fn describe(&self) -> String {
        format!(
            "CNI {} exit {}:\nstdout: {}\nstderr: {}",
            self.command, self.status, self.stdout, self.stderr
        )
    }

    /// Stdout parsed as exactly one JSON document (logs must never appear there).
    pub fn json(&self) -> Value {
        serde_json::from_str(self.stdout.trim()).unwrap_or_else(|e| {
            panic!(
                "stdout is not exactly one JSON document ({e}); {}",
                self.describe()
            )
        })
    }

    pub fn success(&self) -> bool {
        self.status.success()
    }

    /// Exit 0 with a JSON document on stdout (ADD, VERSION, STATUS-less results).
    pub fn expect_json(&self) -> Value {
        assert!(self.success(), "expected success; {}", self.describe());
        self.json()
    }

    /// Exit 0; stdout empty or a single JSON document (DEL, CHECK, GC, STATUS
    /// print nothing on success).
    pub fn expect_ok(&self) {
        assert!(self.success(), "expected success; {}", self.describe());
        if !self.stdout.trim().is_empty() {
            let _ = self.json();
        }
    }

    /// A non-zero exit with the spec's error JSON on stdout.
    pub fn error(&self) -> CniError {
        assert!(
            !self.success(),
            "expected a failure, got success; {}",
            self.describe()
        );
        let v = self.json();
        let code = v["code"]
            .as_u64()
            .unwrap_or_else(|| panic!("error JSON has no numeric code; {}", self.describe()));
        let msg = v["msg"].as_str().unwrap_or_default().to_string();
        assert!(
            !msg.is_empty(),
            "error JSON has no msg; {}",
            self.describe()
        );
        assert!(
            !self.strict || v.get("cniVersion").and_then(Value::as_str).is_some(),
            "error JSON has no cniVersion; {}",
            self.describe()
        );
        CniError {
            code,
            msg,
            details: v["details"].as_str().map(str::to_string),
            raw: v,
        }
    }

    /// A failure with error code `code`.
    pub fn expect_error(&self, code: u64) -> CniError {
        let e = self.error();
        assert_eq!(e.code, code, "wrong error code; {}", self.describe());
        e
    }

    /// A failure with one of `codes`.
    pub fn expect_error_in(&self, codes: &[u64]) -> CniError {
        let e = self.error();
        assert!(
            codes.contains(&e.code),
            "error code {} not in {codes:?}; {}",
            e.code,
            self.describe()
        );
        e
    }
}
