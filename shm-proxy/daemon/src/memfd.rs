//! The shared memory of one channel: a sealed memfd.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Creates a memfd of exactly `len` bytes, sealed so that neither end can
/// shrink it (which would SIGBUS the other end's mapping), grow it, or
/// change the seals. The fd is close-on-exec in the daemon.
pub fn create_sealed(name: &str, len: u64) -> io::Result<OwnedFd> {
    let cname = std::ffi::CString::new(name).map_err(|_| io::ErrorKind::InvalidInput)?;
    // SAFETY: `cname` is a valid NUL-terminated string for the call.
    let raw =
        unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a fresh fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let len = libc::off_t::try_from(len).map_err(|_| io::ErrorKind::InvalidInput)?;
    // SAFETY: plain syscalls on an fd we own.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memfd_has_the_size_and_refuses_to_shrink() {
        let fd = create_sealed("flowlane-test", 8192).unwrap();
        let f = std::fs::File::from(fd);
        assert_eq!(f.metadata().unwrap().len(), 8192);
        assert!(f.set_len(4096).is_err(), "shrink must be sealed");
        assert!(f.set_len(1 << 20).is_err(), "grow must be sealed");
        // SAFETY: fcntl on an fd we own.
        let seals = unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&f), libc::F_GET_SEALS) };
        assert_eq!(seals & libc::F_SEAL_SEAL, libc::F_SEAL_SEAL);
    }
}
