//! Running the programs the launcher drives (`ip`, the CNI plugin), with
//! their output kept for error messages.

use std::process::{Command, Output, Stdio};

/// A program that failed, with what it said.
#[derive(Debug, thiserror::Error)]
#[error("{command}: {reason}")]
pub struct CommandError {
    pub command: String,
    pub reason: String,
}

fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Runs `cmd` to completion; an error unless it exits 0.
///
/// The program dies with the launcher: a killed `up` leaves no `ip` half
/// way through creating something nobody recorded as done.
pub fn run(cmd: &mut Command) -> Result<Output, CommandError> {
    crate::procs::die_with_parent(cmd);
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| CommandError {
            command: describe(cmd),
            reason: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(CommandError {
            command: describe(cmd),
            reason: format!(
                "{}: {}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim(),
                String::from_utf8_lossy(&out.stdout).trim()
            ),
        });
    }
    Ok(out)
}

/// Runs `ip ARGS`.
pub fn ip(args: &[&str]) -> Result<Output, CommandError> {
    run(Command::new("ip").args(args))
}

/// Runs `ip -n NETNS ARGS`.
pub fn ip_in(netns: &str, args: &[&str]) -> Result<Output, CommandError> {
    let mut full = vec!["-n", netns];
    full.extend_from_slice(args);
    ip(&full)
}

/// Writes a sysctl inside `netns` (through /proc/sys as seen from there).
pub fn sysctl_in(netns: &str, key: &str, value: &str) -> Result<Output, CommandError> {
    let path = format!("/proc/sys/{}", key.replace('.', "/"));
    run(Command::new("ip").args([
        "netns",
        "exec",
        netns,
        "sh",
        "-c",
        &format!("echo {value} > {path}"),
    ]))
}
