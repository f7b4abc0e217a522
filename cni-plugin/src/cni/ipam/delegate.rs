//! Delegated IPAM (SPEC.md section 4): find `ipam.type` in `CNI_PATH`, run it
//! with our environment (CNI_COMMAND overridden) and the complete network
//! configuration on stdin, read its result or error.
//!
//! Version bridging: Debian's host-local speaks up to 1.0.0. When the
//! runtime asked for a newer version than the plugin supports, the plugin
//! is called with the highest version both sides know (from its VERSION
//! answer) and its result is converted by our result model.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command as Process, Stdio};

use serde_json::Value;

use super::super::env::{CniEnv, Command};
use super::super::error::{code, CniError, CniResult};
use super::super::result::AddResult;
use super::super::version::Version;

pub struct Delegate<'a> {
    pub plugin: &'a str,
    pub env: &'a CniEnv,
    /// The complete stdin we received.
    pub stdin: &'a [u8],
    pub version: Version,
}

impl Delegate<'_> {
    fn find(&self) -> CniResult<PathBuf> {
        if self.env.path.is_empty() {
            return Err(CniError::env(format!(
                "CNI_PATH is empty: cannot find ipam plugin {:?}",
                self.plugin
            )));
        }
        for dir in &self.env.path {
            let p = PathBuf::from(dir).join(self.plugin);
            if p.is_file() {
                return Ok(p);
            }
        }
        Err(CniError::new(
            code::IPAM_PLUGIN,
            format!("failed to find ipam plugin {:?} in CNI_PATH", self.plugin),
        )
        .with_details(self.env.path.join(":")))
    }

    /// Runs the plugin; returns its stdout on success.
    fn exec(&self, cmd: Command, stdin: &[u8]) -> CniResult<Vec<u8>> {
        let path = self.find()?;
        let mut child = Process::new(&path)
            .env("CNI_COMMAND", cmd.as_str())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| {
                CniError::new(code::IPAM_PLUGIN, format!("cannot run {}", path.display()))
                    .with_details(e)
            })?;
        // The plugin reads all of stdin before answering; write then close.
        let write = child.stdin.take().expect("piped").write_all(stdin);
        let out = child.wait_with_output().map_err(|e| {
            CniError::new(code::IPAM_PLUGIN, format!("waiting for {}", path.display()))
                .with_details(e)
        })?;
        // A plugin may exit without reading stdin (skel ignores it for
        // VERSION): a broken pipe is not an error, its exit status decides.
        if let Err(e) = write {
            if out.status.success() && e.kind() != std::io::ErrorKind::BrokenPipe {
                return Err(CniError::io("writing config to ipam plugin", e));
            }
        }
        if out.status.success() {
            return Ok(out.stdout);
        }
        // Pass the plugin's own error on (spec: "error should be returned").
        let v: Option<Value> = serde_json::from_slice(&out.stdout).ok();
        let err = v.as_ref().and_then(|v| {
            Some(CniError {
                code: v.get("code")?.as_u64()? as u32,
                msg: v
                    .get("msg")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
                details: v
                    .get("details")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
            })
        });
        Err(err.unwrap_or_else(|| {
            CniError::new(
                code::IPAM_PLUGIN,
                format!(
                    "ipam plugin {} {} failed ({})",
                    self.plugin,
                    cmd.as_str(),
                    out.status
                ),
            )
            .with_details(String::from_utf8_lossy(&out.stdout))
        }))
    }

    /// The plugin's supported versions (its VERSION answer).
    fn supported(&self) -> CniResult<Vec<Version>> {
        let out = self.exec(Command::Version, br#"{"cniVersion":"1.0.0"}"#)?;
        let v: Value = serde_json::from_slice(&out).map_err(|e| {
            CniError::new(code::IPAM_PLUGIN, "ipam plugin VERSION answer is not JSON")
                .with_details(e)
        })?;
        Ok(v.get("supportedVersions")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|s| Version::parse(s.as_str()?))
                    .collect()
            })
            .unwrap_or_default())
    }

    /// Highest version both sides speak, at most the requested one.
    fn negotiated(&self) -> CniResult<Option<Version>> {
        // Up to 1.0.0 every IPAM plugin we know speaks the runtime's version;
        // only newer requests need the (extra exec) VERSION probe.
        if self.version <= Version::V1_0_0 {
            return Ok(Some(self.version));
        }
        let theirs = self.supported()?;
        Ok(theirs.into_iter().filter(|v| *v <= self.version).max())
    }

    /// stdin with `cniVersion` replaced, when it must be.
    fn stdin_for(&self, v: Version) -> CniResult<Vec<u8>> {
        if v == self.version {
            return Ok(self.stdin.to_vec());
        }
        let mut conf: Value = serde_json::from_slice(self.stdin)
            .map_err(|e| CniError::new(code::DECODE, "re-reading config").with_details(e))?;
        let s = format!("{}.{}.{}", v.0, v.1, v.2);
        conf["cniVersion"] = Value::String(s);
        Ok(serde_json::to_vec(&conf).expect("json"))
    }

    fn run(&self, cmd: Command) -> CniResult<Vec<u8>> {
        let v = self.negotiated()?.ok_or_else(|| {
            CniError::new(
                code::INCOMPATIBLE_VERSION,
                format!(
                    "ipam plugin {} supports no CNI version <= requested",
                    self.plugin
                ),
            )
        })?;
        self.exec(cmd, &self.stdin_for(v)?)
    }

    pub fn add(&self) -> CniResult<AddResult> {
        let out = self.run(Command::Add)?;
        let v: Value = serde_json::from_slice(&out).map_err(|e| {
            CniError::new(code::IPAM_PLUGIN, "ipam plugin result is not JSON").with_details(e)
        })?;
        let r = AddResult::from_json(&v)?;
        if r.ips.is_empty() {
            return Err(CniError::new(
                code::IPAM_PLUGIN,
                "IPAM plugin returned missing IP config",
            ));
        }
        Ok(r)
    }

    pub fn del(&self) -> CniResult<()> {
        self.run(Command::Del).map(drop)
    }

    pub fn check(&self) -> CniResult<()> {
        self.run(Command::Check).map(drop)
    }

    /// GC and STATUS exist from 1.1.0 on; plugins that cannot take them are
    /// skipped (`Ok(false)`).
    pub fn v11_command(&self, cmd: Command) -> CniResult<bool> {
        if self.version < Version::V1_1_0 {
            return Ok(false);
        }
        if !self.supported()?.contains(&Version::V1_1_0) {
            tracing::debug!(
                plugin = self.plugin,
                "ipam plugin predates CNI 1.1.0; not forwarding {}",
                cmd.as_str()
            );
            return Ok(false);
        }
        self.exec(cmd, self.stdin)?;
        Ok(true)
    }
}
