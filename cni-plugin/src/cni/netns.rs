//! Work inside a pod's network namespace: on a dedicated thread that
//! setns()es into it and opens its own rtnetlink socket there (a netlink
//! socket belongs to the netns of the thread that creates it). The calling
//! thread never changes namespace.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;

use super::error::{code, CniError, CniResult};
use super::netlink::RtNetlink;

/// An open pod netns.
pub struct Netns {
    pub file: File,
    pub path: String,
}

impl Netns {
    /// Opens `CNI_NETNS`: a missing path is "container unknown" (3); a path
    /// that is not a network namespace, or is our own, is a bad CNI_NETNS (4).
    pub fn open(path: &str) -> CniResult<Netns> {
        let file = File::open(path).map_err(|e| {
            if e.kind() == io::ErrorKind::NotFound {
                CniError::new(
                    code::UNKNOWN_CONTAINER,
                    format!("network namespace {path} does not exist"),
                )
            } else {
                CniError::env(format!("CNI_NETNS {path} cannot be opened")).with_details(e)
            }
        })?;
        if !is_nsfs(&file) {
            return Err(CniError::env(format!(
                "CNI_NETNS {path} is not a network namespace"
            )));
        }
        let meta = file
            .metadata()
            .map_err(|e| CniError::io("stat CNI_NETNS", e))?;
        if let Ok(own) = std::fs::metadata("/proc/self/ns/net") {
            if own.ino() == meta.ino() && own.dev() == meta.dev() {
                return Err(CniError::env(format!(
                    "CNI_NETNS {path} is the plugin's own network namespace"
                )));
            }
        }
        Ok(Netns {
            file,
            path: path.to_string(),
        })
    }

    /// Inode of the namespace (what `/proc/PID/ns/net` links to).
    pub fn inode(&self) -> u64 {
        self.file.metadata().map(|m| m.ino()).unwrap_or(0)
    }

    /// Runs `f` with a netlink socket inside this namespace, on its own thread.
    pub fn run<T: Send>(
        &self,
        f: impl FnOnce(&mut RtNetlink) -> CniResult<T> + Send,
    ) -> CniResult<T> {
        let fd = self.file.as_raw_fd();
        let path = &self.path;
        std::thread::scope(|s| {
            s.spawn(move || {
                // SAFETY: setns on a valid namespace fd owned by `self`, which
                // outlives this scoped thread; only this thread changes netns.
                if unsafe { libc::setns(fd, libc::CLONE_NEWNET) } != 0 {
                    let e = io::Error::last_os_error();
                    return Err(if e.raw_os_error() == Some(libc::EINVAL) {
                        CniError::env(format!("CNI_NETNS {path} is not a network namespace"))
                    } else {
                        CniError::io(format!("entering network namespace {path}"), e)
                    });
                }
                let mut nl = RtNetlink::open()
                    .map_err(|e| CniError::netlink("netlink socket in pod netns", e))?;
                f(&mut nl)
            })
            .join()
            .unwrap_or_else(|_| Err(CniError::new(code::NETLINK, "pod netns worker panicked")))
        })
    }
}

/// Namespace files live on nsfs (`/proc/PID/ns/net` or a bind mount of it).
// f_type's integer type differs between architectures, hence the cast.
#[allow(clippy::unnecessary_cast)]
fn is_nsfs(file: &File) -> bool {
    const NSFS_MAGIC: i64 = 0x6e73_6673;
    let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: fstatfs fills the statfs buffer we pass for a valid open fd.
    let rc = unsafe { libc::fstatfs(file.as_raw_fd(), st.as_mut_ptr()) };
    // SAFETY: rc == 0 means the kernel initialised the buffer.
    rc == 0 && unsafe { st.assume_init() }.f_type as i64 == NSFS_MAGIC
}
