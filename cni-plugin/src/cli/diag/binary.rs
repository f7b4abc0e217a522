//! Is the plugin binary the runtime will exec installed, and is it this
//! version? (A node upgraded halfway runs an old plugin against a new
//! daemon.) Also: every chained plugin of the config must be there.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use super::cni_config::FlowlaneNet;
use super::report::Section;

const OURS: &str = env!("CARGO_PKG_VERSION");

pub fn check(bin_dir: &Path, net: Option<&FlowlaneNet>) -> Section {
    let mut s = Section::new(
        "binaries",
        format!("Plugin binaries ({})", bin_dir.display()),
    );
    let flowlane = bin_dir.join("flowlane");
    match std::fs::metadata(&flowlane) {
        Err(_) => s.error(
            "bin.flowlane_missing",
            format!("{} does not exist: the runtime cannot run the plugin", flowlane.display()),
            format!("install it: install -m 0755 flowlane {}/", bin_dir.display()),
        ),
        Ok(m) if m.permissions().mode() & 0o111 == 0 => s.error(
            "bin.flowlane_not_executable",
            format!("{} is not executable", flowlane.display()),
            format!("chmod 0755 {}", flowlane.display()),
        ),
        Ok(_) => match installed_version(&flowlane) {
            Ok(v) if v == OURS => s.ok(
                "bin.version_ok",
                format!("{} is version {v}, the same as this diag", flowlane.display()),
            ),
            Ok(v) => s.error(
                "bin.version_mismatch",
                format!("{} is version {v}, this diag (and presumably the daemon) is {OURS}", flowlane.display()),
                "finish the upgrade: copy the new flowlane binary into the bin dir (the DaemonSet's \
                 init container does this on restart)",
            ),
            Err(e) => s.error(
                "bin.version_unknown",
                format!("{} did not report a version: {e}", flowlane.display()),
                "the file is not a working flowlane binary: reinstall it",
            ),
        },
    }
    if let Some(net) = net {
        for t in net.plugin_types.iter().filter(|t| t.as_str() != "flowlane") {
            if !bin_dir.join(t).exists() {
                s.error(
                    "bin.chained_plugin_missing",
                    format!("the config chains plugin {t:?}, but {} does not exist", bin_dir.join(t).display()),
                    format!("install the {t} plugin (containernetworking-plugins) or remove it from the chain"),
                );
            }
        }
        if let Some(t) = net.ipam_type.as_deref().filter(|t| *t != "flowlane") {
            if !bin_dir.join(t).exists() {
                s.error(
                    "bin.ipam_plugin_missing",
                    format!(
                        "the config delegates IPAM to {t:?}, but {} does not exist",
                        bin_dir.join(t).display()
                    ),
                    format!("install the {t} IPAM plugin or use \"type\": \"flowlane\" (built in)"),
                );
            }
        }
    }
    s
}

/// Runs `<bin> version` (without `CNI_COMMAND`, so it answers as the CLI).
fn installed_version(bin: &Path) -> Result<String, String> {
    let out = Command::new(bin)
        .arg("version")
        .env_remove("CNI_COMMAND")
        .output()
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim()
        .strip_prefix("flowlane ")
        .map(str::to_string)
        .ok_or_else(|| format!("unexpected output {:?}", text.trim()))
}
