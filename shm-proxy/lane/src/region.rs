//! The owner of one connection's shared-memory mapping.
//!
//! A [`Region`] is the only place that maps a channel's memfd. It checks
//! the memfd before mapping it (sealed against shrinking, growing and seal
//! changes, exactly the announced size, a size whose rings fit), and it
//! hands out ring ends ([`crate::ring::Producer`], [`crate::ring::Consumer`],
//! [`crate::ring::Probe`]) that each hold an `Arc` of it, so the memory
//! lives as long as any end does and no caller needs `unsafe`.
//!
//! The region also carries the connection's *broken* flag, in this
//! process's memory (never in the shared mapping, where the peer could
//! clear it): the first end that finds a shared word the protocol does not
//! allow sets it, and from then on every end of the region reports the
//! connection as reset (see `ring`'s "hostile peer" section).
//!
//! It also records whether this process keeps the region's rings at their
//! full size whatever the capacity words say (the daemon's relay,
//! [`Region::map_memfd_fixed`]).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::ring::ring_size_for;

/// The seals a channel memfd must carry: without SHRINK the peer could
/// truncate it under this mapping (SIGBUS on the next access); without
/// GROW or SEAL it could change what was checked here.
pub const REQUIRED_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// One mapped region: the header page and the two rings.
pub struct Region {
    map: Mapping,
    ring_size: usize,
    broken: AtomicBool,
    fixed: bool,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("len", &self.map.len)
            .field("ring_size", &self.ring_size)
            .field("broken", &self.is_broken())
            .finish()
    }
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

impl Region {
    /// Maps a channel memfd of `len` bytes (the length the daemon
    /// announced). Refused unless the memfd is sealed with
    /// [`REQUIRED_SEALS`], is exactly `len` bytes long, and `len` holds two
    /// rings of at least the minimum size.
    pub fn map_memfd(memfd: BorrowedFd<'_>, len: usize) -> io::Result<Arc<Region>> {
        Region::map(memfd, len, false)
    }

    /// As [`Region::map_memfd`], for an end that keeps both rings at their
    /// full size (the daemon's relay: zero-copy placement addresses the
    /// whole ring): this process ignores the capacity words, and the region's
    /// fixed word tells the peer's producer never to change them.
    pub fn map_memfd_fixed(memfd: BorrowedFd<'_>, len: usize) -> io::Result<Arc<Region>> {
        let region = Region::map(memfd, len, true)?;
        region.fixed_word().store(1, Ordering::Release);
        Ok(region)
    }

    fn map(memfd: BorrowedFd<'_>, len: usize, fixed: bool) -> io::Result<Arc<Region>> {
        let ring_size = ring_size_for(len).ok_or_else(|| invalid("region too small"))?;
        // SAFETY: F_GET_SEALS on a descriptor we borrow; no memory is passed.
        let seals = unsafe { libc::fcntl(memfd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & REQUIRED_SEALS != REQUIRED_SEALS {
            return Err(invalid("channel memfd is not sealed"));
        }
        // One fstat on the borrowed fd (no dup: this runs for every lane
        // connection's set-up).
        // SAFETY: libc::stat is plain data, all-zero is a valid value, and
        // fstat writes only into that local.
        let size = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(memfd.as_raw_fd(), &mut st) != 0 {
                return Err(io::Error::last_os_error());
            }
            st.st_size
        };
        if u64::try_from(size).ok() != Some(len as u64) {
            return Err(invalid(
                "channel memfd size differs from the announced length",
            ));
        }
        Ok(Arc::new(Region {
            map: Mapping::new(memfd, len)?,
            ring_size,
            broken: AtomicBool::new(false),
            fixed,
        }))
    }

    /// A fresh region of `len` bytes in a sealed memfd of its own (tests,
    /// benchmarks; a forked child shares it), mapped like a channel.
    #[cfg(not(miri))]
    pub fn anonymous(len: usize) -> io::Result<Arc<Region>> {
        let fd = sealed_memfd(len)?;
        Region::map_memfd(fd.as_fd(), len)
    }

    /// Under miri (no memfd, no mmap of a descriptor): a fresh region of
    /// `len` bytes on the heap, so the ring's tests run under miri.
    #[cfg(miri)]
    pub fn anonymous(len: usize) -> io::Result<Arc<Region>> {
        Region::heap_view(Mapping::heap(len)?, false)
    }

    /// Under miri: a region over heap bytes (one view of them; a second
    /// view of the same bytes is a second process's mapping).
    #[cfg(miri)]
    fn heap_view(map: Mapping, fixed: bool) -> io::Result<Arc<Region>> {
        let ring_size = ring_size_for(map.len).ok_or_else(|| invalid("region too small"))?;
        Ok(Arc::new(Region {
            map,
            ring_size,
            broken: AtomicBool::new(false),
            fixed,
        }))
    }

    /// Two mappings of one fresh channel of `len` bytes, as two processes
    /// have them (each with its own broken flag); the first mapped as the
    /// relay maps it when `first_fixed` (tests). Under miri, two views of
    /// one heap region.
    #[cfg(test)]
    pub(crate) fn twin_mappings(
        len: usize,
        first_fixed: bool,
    ) -> io::Result<(Arc<Region>, Arc<Region>)> {
        #[cfg(not(miri))]
        {
            let fd = sealed_memfd(len)?;
            let first = if first_fixed {
                Region::map_memfd_fixed(fd.as_fd(), len)?
            } else {
                Region::map_memfd(fd.as_fd(), len)?
            };
            Ok((first, Region::map_memfd(fd.as_fd(), len)?))
        }
        #[cfg(miri)]
        {
            let map = Mapping::heap(len)?;
            let first = Region::heap_view(map.share(), first_fixed)?;
            if first_fixed {
                first.fixed_word().store(1, Ordering::Release);
            }
            Ok((first, Region::heap_view(map, false)?))
        }
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.map.len
    }

    /// Never true for a mapped region (rings need at least a page each).
    pub fn is_empty(&self) -> bool {
        self.map.len == 0
    }

    /// Bytes per direction.
    pub fn ring_size(&self) -> usize {
        self.ring_size
    }

    /// Start of the mapping (page aligned, `len()` bytes).
    pub(crate) fn base(&self) -> *mut u8 {
        self.map.base
    }

    /// The peer broke the protocol (a shared word out of its allowed set):
    /// the connection is dead for every end of this region.
    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Relaxed)
    }

    /// Marks the connection dead (first violation found).
    pub fn mark_broken(&self) {
        self.broken.store(true, Ordering::Relaxed);
    }

    pub(crate) fn broken_flag(&self) -> &AtomicBool {
        &self.broken
    }

    /// This process keeps the rings at their full size (see
    /// [`Region::map_memfd_fixed`]).
    pub fn is_fixed(&self) -> bool {
        self.fixed
    }
}

/// A memfd of exactly `len` bytes carrying [`REQUIRED_SEALS`] (what the
/// daemon hands out for every channel).
pub fn sealed_memfd(len: usize) -> io::Result<OwnedFd> {
    // SAFETY: memfd_create with a static NUL-terminated name.
    let raw = unsafe {
        libc::memfd_create(
            c"flowlane-region".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a fresh fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    std::fs::File::from(fd.try_clone()?).set_len(len as u64)?;
    // SAFETY: F_ADD_SEALS on the fd we own; no memory is passed.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, REQUIRED_SEALS) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// A shared mapping of a memfd between two inaccessible guard pages: a
/// stray access just past either end faults instead of touching whatever
/// memory lies next to the region.
#[cfg(not(miri))]
struct Mapping {
    /// Start of the reservation (the leading guard page).
    reservation: *mut libc::c_void,
    reserved: usize,
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory owned by this value; access to
// its contents is governed by the ring protocol (atomics and handed-over
// byte ranges), not by this handle.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

#[cfg(not(miri))]
impl Mapping {
    fn new(fd: BorrowedFd<'_>, len: usize) -> io::Result<Mapping> {
        let page = page_size();
        let reserved = len
            .checked_add(2 * page)
            .ok_or_else(|| invalid("region too large"))?;
        // SAFETY: a fresh anonymous reservation, no address requested.
        let reservation = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                reserved,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if reservation == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `reservation + page` lies inside the reservation (reserved
        // = len + 2 pages), so it is page aligned and ours.
        let want = unsafe { reservation.cast::<u8>().add(page) }.cast::<libc::c_void>();
        // SAFETY: MAP_FIXED over the middle of our own reservation only
        // (len bytes from one page in), which nothing else uses.
        let got = unsafe {
            libc::mmap(
                want,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd.as_raw_fd(),
                0,
            )
        };
        if got == libc::MAP_FAILED {
            let e = io::Error::last_os_error();
            // SAFETY: unmapping the reservation made above, never handed out.
            unsafe { libc::munmap(reservation, reserved) };
            return Err(e);
        }
        Ok(Mapping {
            reservation,
            reserved,
            base: got.cast(),
            len,
        })
    }
}

#[cfg(not(miri))]
impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the whole reservation (guards and the shared mapping in
        // it) is ours; every ring end holds the Region, so none outlives it.
        unsafe { libc::munmap(self.reservation, self.reserved) };
    }
}

/// Under miri: the region's bytes in one zeroed, page-aligned heap
/// allocation, shared by every [`Region`] made from it (miri can map
/// neither a memfd nor guard pages; the ring only needs memory that the
/// ends reach through raw pointers and atomics).
#[cfg(miri)]
struct Mapping {
    heap: Arc<HeapBytes>,
    base: *mut u8,
    len: usize,
}

#[cfg(miri)]
struct HeapBytes {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

// SAFETY: as for the mapping (whose Send/Sync above cover both of its
// forms): plain memory owned by this value, its contents governed by the
// ring protocol.
#[cfg(miri)]
unsafe impl Send for HeapBytes {}
// SAFETY: as above.
#[cfg(miri)]
unsafe impl Sync for HeapBytes {}

#[cfg(miri)]
impl Mapping {
    fn new(_fd: BorrowedFd<'_>, _len: usize) -> io::Result<Mapping> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "miri cannot map a memfd",
        ))
    }

    fn heap(len: usize) -> io::Result<Mapping> {
        let layout = std::alloc::Layout::from_size_align(len, page_size())
            .map_err(|_| invalid("region too large"))?;
        if len == 0 {
            return Err(invalid("region too small"));
        }
        // SAFETY: the layout has a non-zero size (checked above).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(io::Error::from(io::ErrorKind::OutOfMemory));
        }
        Ok(Mapping {
            heap: Arc::new(HeapBytes { ptr, layout }),
            base: ptr,
            len,
        })
    }

    #[cfg(test)]
    fn share(&self) -> Mapping {
        Mapping {
            heap: Arc::clone(&self.heap),
            base: self.base,
            len: self.len,
        }
    }
}

#[cfg(miri)]
impl Drop for HeapBytes {
    fn drop(&mut self) {
        // SAFETY: allocated in Mapping::heap with this layout; the last
        // Mapping (and so every ring end) is gone.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no memory arguments.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd(len: u64, seals: libc::c_int) -> OwnedFd {
        // SAFETY: memfd_create with a static NUL-terminated name.
        let raw = unsafe { libc::memfd_create(c"region-test".as_ptr(), libc::MFD_ALLOW_SEALING) };
        assert!(raw >= 0);
        // SAFETY: a fresh fd nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        std::fs::File::from(fd.try_clone().unwrap())
            .set_len(len)
            .unwrap();
        if seals != 0 {
            // SAFETY: fcntl on an fd we own.
            let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) };
            assert_eq!(r, 0);
        }
        fd
    }

    #[test]
    #[cfg_attr(miri, ignore = "needs memfd_create and mmap of a descriptor")]
    fn a_sealed_memfd_of_the_announced_size_maps() {
        let len = crate::ring::region_len_for(4096);
        let fd = memfd(len as u64, REQUIRED_SEALS);
        let r = Region::map_memfd(fd.as_fd(), len).unwrap();
        assert_eq!((r.len(), r.ring_size()), (len, 4096));
        assert!(!r.is_broken());
    }

    #[test]
    #[cfg_attr(miri, ignore = "needs memfd_create and mmap of a descriptor")]
    fn unsealed_short_long_and_tiny_memfds_are_refused() {
        let len = crate::ring::region_len_for(4096);
        let unsealed = memfd(len as u64, 0);
        assert!(Region::map_memfd(unsealed.as_fd(), len).is_err());
        let only_shrink = memfd(len as u64, libc::F_SEAL_SHRINK);
        assert!(Region::map_memfd(only_shrink.as_fd(), len).is_err());
        let short = memfd(len as u64 - 4096, REQUIRED_SEALS);
        assert!(Region::map_memfd(short.as_fd(), len).is_err());
        let long = memfd(len as u64 + 4096, REQUIRED_SEALS);
        assert!(Region::map_memfd(long.as_fd(), len).is_err());
        let tiny = memfd(4096, REQUIRED_SEALS);
        assert!(Region::map_memfd(tiny.as_fd(), 4096).is_err());
    }
}
