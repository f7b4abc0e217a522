//! Who is calling: the client process's network namespace and start time,
//! read from `/proc` for the pid the kernel reports with SO_PEERCRED.

use std::io;
use std::os::unix::fs::MetadataExt;

/// A process, robust against pid reuse: pid plus its start time (clock
/// ticks since boot, field 22 of `/proc/PID/stat`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct ProcessId {
    pub pid: u32,
    pub start: u64,
}

impl ProcessId {
    /// The process `pid` as it is now.
    pub fn of(pid: u32) -> io::Result<Self> {
        Ok(ProcessId {
            pid,
            start: start_time(pid)?,
        })
    }

    /// True while this very process (not a later one with the same pid) runs.
    pub fn is_alive(&self) -> bool {
        start_time(self.pid)
            .map(|s| s == self.start)
            .unwrap_or(false)
    }
}

/// The inode of the network namespace of process `pid`.
pub fn netns_inode_of_pid(pid: u32) -> io::Result<u64> {
    Ok(std::fs::metadata(format!("/proc/{pid}/ns/net"))?.ino())
}

#[cfg(test)]
/// The inode of the daemon's own network namespace.
pub fn own_netns_inode() -> io::Result<u64> {
    Ok(std::fs::metadata("/proc/self/ns/net")?.ino())
}

fn start_time(pid: u32) -> io::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_start_time(&stat)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "unparsable /proc/PID/stat"))
}

/// Field 22 of `/proc/PID/stat`; the command name (field 2) may contain
/// spaces and parentheses, so count from the last ')'.
fn parse_start_time(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // After ')' come fields 3.. ; starttime is field 22 → index 19.
    rest.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_start_time_with_odd_command_names() {
        let stat =
            "1234 (a b) c)) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(parse_start_time(stat), Some(987654));
        assert_eq!(parse_start_time("garbage"), None);
    }

    #[test]
    fn own_process_is_alive_and_has_a_netns() {
        let me = ProcessId::of(std::process::id()).unwrap();
        assert!(me.is_alive());
        let stale = ProcessId {
            start: me.start + 1,
            ..me
        };
        assert!(!stale.is_alive());
        assert_eq!(
            netns_inode_of_pid(std::process::id()).unwrap(),
            own_netns_inode().unwrap()
        );
    }
}
