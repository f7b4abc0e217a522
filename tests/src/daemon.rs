//! A `flowlaned` process as the suites run it: started with its output in a
//! log file, waited for until it answers on its socket, stopped with
//! SIGTERM then SIGKILL (the [`ChildGuard`] it lives in).
//!
//! Why one helper: the multi-node harness ([`crate::node_ns::NsNode`]) and
//! the daemon suites' node (`tests/e2e/daemon/common.rs`) each spawned,
//! waited for and stopped the daemon their own way; a change to how the
//! daemon comes up (a flag, a readiness check) now has one place to go.

use crate::binaries::workspace_artifact;
use crate::process::ChildGuard;
use flowlane_lane::client::DaemonClient;
use flowlane_lane::proto::Stats;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// `flowlaned --state-dir STATE --socket SOCKET`, inside the network
/// namespace `netns` when given (`ip netns exec`, which execs it in place).
pub fn command(netns: Option<&str>, state_dir: &Path, socket: &Path) -> Command {
    let daemon = workspace_artifact("flowlaned");
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(daemon);
            c
        }
        None => Command::new(daemon),
    };
    cmd.arg("--state-dir")
        .arg(state_dir)
        .arg("--socket")
        .arg(socket);
    cmd
}

/// Spawns `cmd` (see [`command`]) with its stdout and stderr appended to
/// `log`; the guard kills the daemon if the caller panics before keeping it.
pub fn spawn(mut cmd: Command, log: &Path) -> ChildGuard {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("daemon log");
    let child = cmd
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("daemon log"))
        .stderr(out)
        .spawn()
        .expect("start flowlaned");
    ChildGuard::new(child)
}

/// Waits until the daemon `d` answers on `socket` (`within` at most);
/// panics with its `log` if it exits first or stays silent.
pub fn wait_up(d: &mut ChildGuard, socket: &Path, log: &Path, within: Duration) {
    let log_text = || std::fs::read_to_string(log).unwrap_or_default();
    let up = crate::wait::until(within, || {
        if let Ok(Some(st)) = d.child.try_wait() {
            panic!("flowlaned exited early ({st}); log:\n{}", log_text());
        }
        stats_opt(socket).is_some()
    });
    assert!(up, "flowlaned did not come up; log:\n{}", log_text());
}

/// [`spawn`], then [`wait_up`].
pub fn start(cmd: Command, socket: &Path, log: &Path, within: Duration) -> ChildGuard {
    let mut d = spawn(cmd, log);
    wait_up(&mut d, socket, log, within);
    d
}

/// The daemon's counters on `socket`, connecting for up to `timeout`.
pub fn stats_within(socket: &Path, timeout: Duration) -> std::io::Result<Stats> {
    DaemonClient::connect(socket, timeout).and_then(|mut c| c.stats())
}

/// The daemon's counters on `socket`, if it answers (2 s).
pub fn stats_opt(socket: &Path) -> Option<Stats> {
    stats_within(socket, Duration::from_secs(2)).ok()
}

/// Writes a lane key file (`--lane-key-file`): `key` (the same bytes on
/// every node of a cluster) at `path`, mode 0600 as the daemon demands.
pub fn write_lane_key(path: PathBuf, key: &[u8]) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(&path, key).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}
