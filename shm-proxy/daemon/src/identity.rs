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

/// The inode of the daemon's own network namespace.
pub fn own_netns_inode() -> io::Result<u64> {
    Ok(std::fs::metadata("/proc/self/ns/net")?.ino())
}

/// The inode the kernel gives its initial network namespace (`init_net`,
/// `PROC_NET_INIT_INO` in include/linux/proc_ns.h): fixed since Linux 3.8.
/// Only processes that already are in it, or that host root moves there
/// (setns needs CAP_SYS_ADMIN over the initial user namespace and a handle
/// on the namespace), can be in it.
pub const INIT_NETNS_INODE: u64 = 0xEFFF_FFF9;

/// The device and inode of the network namespace at `path` (a runtime's
/// bind mount such as `/var/run/netns/cni-…`, or `/proc/PID/ns/net`).
pub fn netns_at(path: &std::path::Path) -> io::Result<(u64, u64)> {
    let m = std::fs::metadata(path)?;
    Ok((m.dev(), m.ino()))
}

/// The device of the namespace filesystem (nsfs): every namespace file,
/// bind-mounted or under `/proc`, has it; a regular file never does.
pub fn nsfs_dev() -> io::Result<u64> {
    Ok(std::fs::metadata("/proc/self/ns/net")?.dev())
}

/// Supplementary groups of process `pid` (the `Groups:` line of
/// `/proc/PID/status`, mapped into the daemon's user namespace).
pub fn groups_of(pid: u32) -> io::Result<Vec<u32>> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    Ok(parse_groups(&status))
}

fn parse_groups(status: &str) -> Vec<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .map(|g| {
            g.split_whitespace()
                .filter_map(|n| n.parse().ok())
                .collect()
        })
        .unwrap_or_default()
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
    fn parses_supplementary_groups() {
        let status = "Name:\tx\nUid:\t0\t0\t0\t0\nGroups:\t4 24 27 \nNSpid:\t1\n";
        assert_eq!(parse_groups(status), vec![4, 24, 27]);
        assert_eq!(parse_groups("Groups:\n"), Vec::<u32>::new());
        assert_eq!(parse_groups("garbage"), Vec::<u32>::new());
        assert!(groups_of(std::process::id()).is_ok());
    }

    #[test]
    fn a_namespace_file_is_on_nsfs() {
        let (dev, ino) = netns_at(std::path::Path::new("/proc/self/ns/net")).unwrap();
        assert_eq!(dev, nsfs_dev().unwrap());
        assert_eq!(ino, own_netns_inode().unwrap());
        let (dev, _) = netns_at(std::path::Path::new("/proc/self/stat")).unwrap();
        assert_ne!(dev, nsfs_dev().unwrap());
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
