//! Processes of a cluster: finding them by the network namespace they live
//! in, and ending them without ever touching a process that is not ours.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// Inode of a named network namespace, if it exists.
pub fn netns_inode(name: &str) -> Option<u64> {
    std::fs::metadata(Path::new("/var/run/netns").join(name))
        .ok()
        .map(|m| m.ino())
}

/// The start time (clock ticks since boot) of `pid`, field 22 of its stat.
pub fn start_ticks(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: fields
    // are counted after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether `pid` is alive and still the process started at `ticks`.
pub fn is_same_process(pid: i32, ticks: u64) -> bool {
    start_ticks(pid) == Some(ticks) && !is_zombie(pid)
}

fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rfind(')')
                .map(|i| s[i + 1..].trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// Every process (with its start time) whose network namespace is one of
/// `inodes`.
pub fn in_namespaces(inodes: &[u64]) -> Vec<(i32, u64)> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    let me = std::process::id() as i32;
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(meta) = std::fs::metadata(format!("/proc/{pid}/ns/net")) else {
            continue;
        };
        if inodes.contains(&meta.ino()) && !is_zombie(pid) {
            if let Some(t) = start_ticks(pid) {
                out.push((pid, t));
            }
        }
    }
    out
}

/// Ends the processes: SIGTERM, then SIGKILL for those still there after
/// `grace`. A pid whose start time changed (reused) is left alone. Returns
/// the processes that survived even SIGKILL (should be none).
pub fn terminate(procs: &[(i32, u64)], grace: Duration) -> Vec<i32> {
    let signal = |sig| {
        for &(pid, t) in procs {
            if is_same_process(pid, t) {
                // SAFETY: kill(2) has no memory-safety preconditions; the pid
                // was just checked to be the process we mean.
                unsafe {
                    libc::kill(pid, sig);
                }
            }
        }
    };
    let wait = |limit: Duration| {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if procs.iter().all(|&(p, t)| !is_same_process(p, t)) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    };
    signal(libc::SIGTERM);
    if !wait(grace) {
        signal(libc::SIGKILL);
        wait(Duration::from_secs(10));
    }
    reap(procs);
    procs
        .iter()
        .filter(|&&(p, t)| is_same_process(p, t))
        .map(|&(p, _)| p)
        .collect()
}

/// Collects the exit status of those of `procs` that are our own children
/// (the demo starts the node daemons itself), so no zombie outlives `down`.
/// Processes that are not our children are not affected.
fn reap(procs: &[(i32, u64)]) {
    for &(pid, _) in procs {
        // SAFETY: waitpid(2) with WNOHANG and a null status pointer only
        // reaps `pid` if it is an exited child of this process; it touches
        // no memory of ours.
        unsafe {
            libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG);
        }
    }
}

/// Makes a child spawned by the launcher die with it (set in `pre_exec`),
/// so a killed `up` leaves no plugin invocation running on its own.
pub fn die_with_parent(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs between fork and exec and only calls
    // prctl(2), which is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Detaches a long-lived child (the node daemons) from the launcher's
/// session, so it outlives `up` and a terminal's Ctrl-C.
pub fn detach(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs between fork and exec and only calls
    // setsid(2), which is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_start_time_is_readable() {
        let me = std::process::id() as i32;
        let t = start_ticks(me).unwrap();
        assert!(is_same_process(me, t));
        assert!(!is_same_process(me, t + 1));
    }
}
