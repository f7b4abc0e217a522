//! One pod process as `/proc` shows it: whether the preload library (and
//! not the probe's no-op object) is mapped, which of its fds are sockets
//! and io_urings, its executable's identity, and a network namespace's TCP
//! sockets. Everything here is written by the kernel about a tenant's
//! process (paths and names are the tenant's): every read is bounded and
//! nothing read is used as a host path.

use std::collections::HashSet;
use std::io::{self, BufRead, BufReader};
use std::os::unix::fs::MetadataExt;

/// The file name the library ships under (the probe installs the no-op
/// object under the same name where an image cannot load the library).
pub const LIBRARY_FILE: &str = "libflowlane_preload.so";

/// Most lines of `/proc/PID/maps` read (a process with more mappings is
/// judged on the first ones: the loader maps `LD_PRELOAD` objects early).
const MAX_MAP_LINES: usize = 65536;
/// Most fds looked at per process.
const MAX_FDS: usize = 65536;
/// Most lines read of a namespace's `/proc/PID/net/tcp` (and of `tcp6`).
const MAX_TCP_LINES: usize = 1 << 20;
/// Longest executable path kept for display.
const MAX_PATH: usize = 256;

/// The library in a process's mappings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Library {
    Absent,
    /// Mapped without code: the probe's no-op object (it has none; the
    /// real library always has an executable mapping).
    Noop,
    Loaded,
}

/// The library as the text of `/proc/PID/maps` shows it.
pub fn library_in_maps(maps: impl BufRead) -> Library {
    let mut found = Library::Absent;
    for line in maps.split(b'\n').take(MAX_MAP_LINES) {
        let Ok(line) = line else { break };
        // "start-end perms offset dev inode   path": fields without a '/'
        // up to the path.
        let Some(slash) = line.iter().position(|c| *c == b'/') else {
            continue;
        };
        let path = &line[slash..];
        let path = path.strip_suffix(b" (deleted)").unwrap_or(path);
        let is_library = path
            .rsplit(|c| *c == b'/')
            .next()
            .is_some_and(|name| name == LIBRARY_FILE.as_bytes());
        if !is_library {
            continue;
        }
        let executable = line
            .split(|c| *c == b' ')
            .nth(1)
            .is_some_and(|perms| perms.get(2) == Some(&b'x'));
        if executable {
            return Library::Loaded;
        }
        found = Library::Noop;
    }
    found
}

/// The library in process `pid` (`None`: the process is gone or hidden).
pub fn library_of(pid: u32) -> io::Result<Library> {
    let f = std::fs::File::open(format!("/proc/{pid}/maps"))?;
    Ok(library_in_maps(BufReader::new(f)))
}

/// What a process's fds are, as far as the lane cares.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Fds {
    /// Inodes of its sockets (any kind).
    pub sockets: Vec<u64>,
    /// It holds an io_uring instance.
    pub io_uring: bool,
}

/// Classifies one fd's link text (`socket:[123]`, `anon_inode:[io_uring]`).
pub fn note_fd(link: &[u8], fds: &mut Fds) {
    if let Some(inode) = link
        .strip_prefix(b"socket:[")
        .and_then(|r| r.strip_suffix(b"]"))
        .and_then(|n| std::str::from_utf8(n).ok()?.parse().ok())
    {
        fds.sockets.push(inode);
    } else if link == b"anon_inode:[io_uring]" {
        fds.io_uring = true;
    }
}

/// The fds of process `pid` (at most [`MAX_FDS`]).
pub fn fds_of(pid: u32) -> io::Result<Fds> {
    use std::os::unix::ffi::OsStrExt;
    let mut fds = Fds::default();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))?.take(MAX_FDS) {
        let Ok(entry) = entry else { continue };
        // An fd closed meanwhile has no link: skipped.
        if let Ok(link) = std::fs::read_link(entry.path()) {
            note_fd(link.as_os_str().as_bytes(), &mut fds);
        }
    }
    Ok(fds)
}

/// What identifies an executable's contents for the cache: the file's
/// device, inode, size and change time (a rewritten file gets a new
/// ctime; a pod cannot set it back).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExeKey {
    dev: u64,
    ino: u64,
    size: u64,
    ctime: (i64, i64),
}

/// The identity of process `pid`'s executable (stat through the
/// `/proc/PID/exe` link: the file itself, wherever the pod keeps it).
pub fn exe_key(pid: u32) -> io::Result<ExeKey> {
    let m = std::fs::metadata(format!("/proc/{pid}/exe"))?;
    Ok(ExeKey {
        dev: m.dev(),
        ino: m.ino(),
        size: m.size(),
        ctime: (m.ctime(), m.ctime_nsec()),
    })
}

/// Opens process `pid`'s executable for reading (through the link: the
/// path it names is the pod's, never looked up in the host).
pub fn open_exe(pid: u32) -> io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(format!("/proc/{pid}/exe"))?;
    if !f.metadata()?.is_file() {
        return Err(io::ErrorKind::InvalidInput.into());
    }
    Ok(f)
}

/// The executable's path as the kernel names it (display only), cut at a
/// character boundary, control characters replaced.
pub fn exe_path(pid: u32) -> String {
    let Ok(p) = std::fs::read_link(format!("/proc/{pid}/exe")) else {
        return String::new();
    };
    let p = p.to_string_lossy();
    let mut end = p.len().min(MAX_PATH);
    while !p.is_char_boundary(end) {
        end -= 1;
    }
    p[..end]
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

/// The socket inodes in a `/proc/net/tcp`-format table.
pub fn tcp_table_inodes(table: impl BufRead, into: &mut HashSet<u64>) {
    for line in table.lines().skip(1).take(MAX_TCP_LINES) {
        let Ok(line) = line else { break };
        if let Some(inode) = line.split_whitespace().nth(9).and_then(|i| i.parse().ok()) {
            if inode != 0 {
                into.insert(inode);
            }
        }
    }
}

/// The inodes of the TCP sockets (both families) of process `pid`'s network
/// namespace.
pub fn tcp_inodes(pid: u32) -> io::Result<HashSet<u64>> {
    let mut out = HashSet::new();
    crate::sockets::each_tcp_table(pid, |table| {
        tcp_table_inodes(BufReader::new(table), &mut out);
        Ok(false)
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tells_the_library_from_the_noop_object_and_others() {
        let real = "7f00-7f10 r--p 00000000 fd:01 42   /opt/flowlane/lib/libflowlane_preload.so\n\
                    7f10-7f20 r-xp 00010000 fd:01 42   /opt/flowlane/lib/libflowlane_preload.so\n";
        assert_eq!(library_in_maps(real.as_bytes()), Library::Loaded);
        let noop = "7f00-7f10 r--p 00000000 fd:01 42   /opt/flowlane/lib/libflowlane_preload.so\n\
                    7f20-7f30 rw-p 00000000 fd:01 42   /opt/flowlane/lib/libflowlane_preload.so (deleted)\n";
        assert_eq!(library_in_maps(noop.as_bytes()), Library::Noop);
        let other = "7f00-7f10 r-xp 00000000 fd:01 42   /usr/lib/libc.so.6\n\
                     7f10-7f20 r-xp 00000000 fd:01 43   /srv/not_libflowlane_preload.so\n\
                     7f20-7f30 rw-p 00000000 00:00 0    [heap]\n\
                     garbage\n\n";
        assert_eq!(library_in_maps(other.as_bytes()), Library::Absent);
        // A path with spaces, and a file of that name in a directory with spaces.
        let spaced = "7f00-7f10 r-xp 00000000 fd:01 42   /my dir/libflowlane_preload.so\n";
        assert_eq!(library_in_maps(spaced.as_bytes()), Library::Loaded);
    }

    #[test]
    fn sorts_fd_links() {
        let mut f = Fds::default();
        for l in [
            &b"socket:[1234]"[..],
            b"anon_inode:[eventpoll]",
            b"socket:[x]",
            b"socket:[99999999999999999999999]",
            b"/dev/null",
            b"anon_inode:[io_uring]",
            b"pipe:[5]",
        ] {
            note_fd(l, &mut f);
        }
        assert_eq!(f.sockets, vec![1234]);
        assert!(f.io_uring);
    }

    #[test]
    fn reads_the_inodes_of_a_tcp_table() {
        let t = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5551 1 0 100 0 0 10 0\n   1: 0200CA0A:A410 0300CA0A:0050 06 00000000:00000000 03:00000000 00000000     0        0 0 3\n   2: short\n";
        let mut s = HashSet::new();
        tcp_table_inodes(t.as_bytes(), &mut s);
        assert_eq!(s, HashSet::from([5551]));
    }

    #[test]
    fn sees_its_own_tcp_socket() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let me = std::process::id();
        let fds = fds_of(me).unwrap();
        let tcp = tcp_inodes(me).unwrap();
        assert!(fds.sockets.iter().any(|i| tcp.contains(i)), "{fds:?}");
        drop(l);
        assert_eq!(library_of(me).unwrap(), Library::Absent);
        assert!(exe_path(me).contains("flowlaned"), "{}", exe_path(me));
    }
}
