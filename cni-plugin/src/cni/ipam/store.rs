//! host-local's on-disk lease layout, so both tools (and people) read it:
//! `<dataDir>/<network>/<ip>` holds "<containerID>\r\n<ifname>",
//! `last_reserved_ip.<set index>` the last address handed out from a range
//! set, and `lock` is flock()ed for the duration of every operation.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

const LINE_BREAK: &str = "\r\n";
const LAST_RESERVED: &str = "last_reserved_ip.";

/// One lease file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub ip: IpAddr,
    pub container_id: String,
    /// Absent in leases written by very old host-local versions.
    pub ifname: Option<String>,
}

impl Lease {
    pub fn owned_by(&self, container_id: &str, ifname: &str) -> bool {
        self.container_id == container_id && self.ifname.as_deref().is_none_or(|i| i == ifname)
    }
}

/// The lease directory of one network, locked while this value lives.
pub struct Store {
    dir: PathBuf,
    // Held for its flock; closing the file releases the lock.
    _lock: File,
}

impl Store {
    /// Creates the directory if needed and takes the exclusive lock.
    pub fn lock(dir: &Path) -> io::Result<Store> {
        fs::create_dir_all(dir)?;
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(dir.join("lock"))?;
        loop {
            // SAFETY: flock on a file descriptor we own; no memory involved.
            let rc = unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) };
            if rc == 0 {
                break;
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(err);
            }
        }
        Ok(Store {
            dir: dir.to_path_buf(),
            _lock: lock,
        })
    }

    /// The leased addresses (file names only: one getdents, no reads), for
    /// the allocation fast path.
    pub fn leased_ips(&self) -> io::Result<Vec<IpAddr>> {
        let mut out = Vec::new();
        for entry in fs::read_dir(&self.dir)? {
            if let Some(ip) = entry?.file_name().to_str().and_then(|n| n.parse().ok()) {
                out.push(ip);
            }
        }
        Ok(out)
    }

    /// Every lease in the directory.
    pub fn leases(&self) -> io::Result<Vec<Lease>> {
        let mut out = Vec::new();
        for entry in fs::read_dir(&self.dir)? {
            let entry = entry?;
            let name = entry.file_name();
            let Some(ip) = name.to_str().and_then(|n| n.parse::<IpAddr>().ok()) else {
                continue; // lock, last_reserved_ip.N, anything foreign
            };
            let body = match fs::read_to_string(entry.path()) {
                Ok(b) => b,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            let body = body.trim();
            let (id, ifname) = match body.split_once(LINE_BREAK) {
                Some((id, ifn)) => (id.trim(), Some(ifn.trim().to_string())),
                None => (body, None),
            };
            out.push(Lease {
                ip,
                container_id: id.to_string(),
                ifname,
            });
        }
        Ok(out)
    }

    /// Creates the lease file; `Ok(false)` if the address is taken.
    pub fn reserve(&self, ip: IpAddr, container_id: &str, ifname: &str) -> io::Result<bool> {
        let path = self.dir.join(ip.to_string());
        let mut f = match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(false),
            Err(e) => return Err(e),
        };
        if let Err(e) = f.write_all(format!("{container_id}{LINE_BREAK}{ifname}").as_bytes()) {
            let _ = fs::remove_file(&path);
            return Err(e);
        }
        Ok(true)
    }

    pub fn release(&self, ip: IpAddr) -> io::Result<()> {
        match fs::remove_file(self.dir.join(ip.to_string())) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    pub fn last_reserved(&self, set: usize) -> Option<IpAddr> {
        fs::read_to_string(self.dir.join(format!("{LAST_RESERVED}{set}")))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    pub fn set_last_reserved(&self, set: usize, ip: IpAddr) -> io::Result<()> {
        fs::write(
            self.dir.join(format!("{LAST_RESERVED}{set}")),
            ip.to_string(),
        )
    }
}
