//! The plugin's only effect on the node: a read-only bind mount of a node directory
//! onto a kubelet target path, and its removal. Both are idempotent, as the CSI
//! spec asks (the kubelet retries after timeouts and restarts).

use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};

/// What a publish found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Published {
    /// The bind mount was made now.
    Mounted,
    /// The target already showed this source, read-only (a retried call).
    AlreadyThere,
}

/// Why a publish or an unpublish failed, by the gRPC status it maps to.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    /// Something else is mounted at the target (ALREADY_EXISTS).
    #[error("{0}")]
    Conflict(String),
    /// The target is not what the kubelet makes (FAILED_PRECONDITION).
    #[error("{0}")]
    Precondition(String),
    /// A system call failed (INTERNAL).
    #[error("{what}: {err}")]
    Io { what: String, err: io::Error },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> MountError {
    let what = what.into();
    move |err| MountError::Io { what, err }
}

/// At most this many mounts stacked on one target are taken off by one unpublish
/// (two racing publishes of an older plugin could have stacked two).
const MAX_STACKED: usize = 16;

/// Bind-mounts `source` read-only (and `nosuid`, `nodev`, plus `noexec` when
/// `exec` is false) at `target`, creating `target` (its parent must exist: the
/// kubelet makes it). `source` is created (0755) when missing, as hostPath's
/// `DirectoryOrCreate` did: a pod may start before the daemon made its socket
/// directory, and the socket appears in the mounted directory when it does.
pub fn publish(source: &Path, target: &Path, exec: bool) -> Result<Published, MountError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(source)
        .map_err(io_err(format!("creating {}", source.display())))?;
    let src = std::fs::metadata(source).map_err(io_err(format!("stat {}", source.display())))?;
    no_symlinks(target)?;
    match std::fs::symlink_metadata(target) {
        Ok(m) if !m.is_dir() => {
            return Err(MountError::Precondition(format!(
                "target_path {} exists and is not a directory",
                target.display()
            )))
        }
        Ok(m) => {
            if m.dev() == src.dev() && m.ino() == src.ino() {
                if !read_only(target)? {
                    return Err(MountError::Conflict(format!(
                        "{} shows {} writable",
                        target.display(),
                        source.display()
                    )));
                }
                return Ok(Published::AlreadyThere);
            }
            if is_mount_point(target)? {
                return Err(MountError::Conflict(format!(
                    "something else is mounted at {}",
                    target.display()
                )));
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => std::fs::DirBuilder::new()
            .mode(0o750)
            .create(target)
            .map_err(io_err(format!("creating {}", target.display())))?,
        Err(e) => return Err(io_err(format!("stat {}", target.display()))(e)),
    }
    mount(
        Some(source),
        target,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(|e| io_err(format!("bind {} on {}", source.display(), target.display()))(e.into()))?;
    // A bind mount takes its flags only from a remount.
    let mut flags = MsFlags::MS_BIND
        | MsFlags::MS_REMOUNT
        | MsFlags::MS_RDONLY
        | MsFlags::MS_NOSUID
        | MsFlags::MS_NODEV;
    if !exec {
        flags |= MsFlags::MS_NOEXEC;
    }
    if let Err(e) = mount(None::<&str>, target, None::<&str>, flags, None::<&str>) {
        // Never leave a writable mount behind.
        let _ = umount2(target, MntFlags::UMOUNT_NOFOLLOW | MntFlags::MNT_DETACH);
        return Err(io_err(format!("remounting {} read-only", target.display()))(e.into()));
    }
    Ok(Published::Mounted)
}

/// Takes every mount off `target` and removes the directory. An absent target is
/// success (the call was retried, or the publish never happened).
pub fn unpublish(target: &Path) -> Result<(), MountError> {
    // Absent (its parent too, once the kubelet cleaned up): nothing to do.
    if let Err(e) = std::fs::symlink_metadata(target) {
        if e.kind() == io::ErrorKind::NotFound {
            return Ok(());
        }
    }
    no_symlinks(target)?;
    match std::fs::symlink_metadata(target) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_err(format!("stat {}", target.display()))(e)),
        Ok(m) if !m.is_dir() => {
            return Err(MountError::Precondition(format!(
                "target_path {} is not a directory",
                target.display()
            )))
        }
        Ok(_) => {}
    }
    for _ in 0..MAX_STACKED {
        if !is_mount_point(target)? {
            break;
        }
        umount2(target, MntFlags::UMOUNT_NOFOLLOW)
            .map_err(|e| io_err(format!("unmounting {}", target.display()))(e.into()))?;
    }
    if is_mount_point(target)? {
        return Err(MountError::Precondition(format!(
            "more than {MAX_STACKED} mounts at {}",
            target.display()
        )));
    }
    match std::fs::remove_dir(target) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(io_err(format!("removing {}", target.display()))(e))
        }
        _ => Ok(()),
    }
}

/// The target's parent must be reached without a symbolic link: the path was
/// checked as text, and a link would carry the mount elsewhere.
fn no_symlinks(target: &Path) -> Result<(), MountError> {
    let parent = target.parent().unwrap_or(Path::new("/"));
    let real = std::fs::canonicalize(parent).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => MountError::Precondition(format!(
            "the target's parent {} does not exist (the kubelet makes it)",
            parent.display()
        )),
        _ => io_err(format!("resolving {}", parent.display()))(e),
    })?;
    if real != parent {
        return Err(MountError::Precondition(format!(
            "{} goes through a symbolic link (to {})",
            parent.display(),
            real.display()
        )));
    }
    Ok(())
}

fn read_only(path: &Path) -> Result<bool, MountError> {
    let st = nix::sys::statvfs::statvfs(path)
        .map_err(|e| io_err(format!("statvfs {}", path.display()))(e.into()))?;
    Ok(st.flags().contains(nix::sys::statvfs::FsFlags::ST_RDONLY))
}

/// Whether `path` (absolute, no symbolic links) is a mount point in this mount
/// namespace.
pub fn is_mount_point(path: &Path) -> Result<bool, MountError> {
    Ok(mount_points()?.iter().any(|m| m == path))
}

/// The mount points of this mount namespace (`/proc/self/mountinfo`, field 5).
pub fn mount_points() -> Result<Vec<PathBuf>, MountError> {
    mount_points_in(Path::new("/proc/self/mountinfo"))
}

/// The mount points listed in a `mountinfo` file (another process's namespace).
pub fn mount_points_in(mountinfo: &Path) -> Result<Vec<PathBuf>, MountError> {
    let text = std::fs::read_to_string(mountinfo)
        .map_err(io_err(format!("reading {}", mountinfo.display())))?;
    Ok(text
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape(p)))
        .collect())
}

/// mountinfo writes space, tab, newline and backslash as `\ooo` octal.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let oct = b
            .get(i + 1..i + 4)
            .filter(|o| o.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], oct) {
            (b'\\', Some(o)) => {
                let v = o.iter().fold(0u32, |v, c| v * 8 + u32::from(c - b'0'));
                out.push(u8::try_from(v).unwrap_or(b'?'));
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_decoded() {
        assert_eq!(unescape(r"/a\040b\011c\134d"), "/a b\tc\\d");
        assert_eq!(unescape(r"/plain"), "/plain");
        assert_eq!(unescape(r"/short\04"), r"/short\04");
    }

    #[test]
    fn the_root_is_a_mount_point() {
        assert!(is_mount_point(Path::new("/")).unwrap());
    }
}
