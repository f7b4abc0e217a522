//! The library's side of the peer table (`flowlane_lane::peer_table`):
//! the daemon's list of destinations that can be lane peers, mapped
//! read-only once per process and read on every `connect` without a
//! system call. A destination the table rules out stays on TCP with no
//! daemon round trip; anything the table cannot say (no table yet, a
//! daemon rewriting it, a page this library does not understand) is asked
//! about as before.

use crate::config;
use flowlane_lane::peer_table::{self, Mapped, Verdict};
use std::net::IpAddr;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};

/// The mapping, once made (leaked: kept for the life of the process).
static MAPPED: AtomicPtr<Mapped> = AtomicPtr::new(std::ptr::null_mut());
/// No table found: when to look again (coarse monotonic milliseconds), so
/// a node without a daemon costs one `open` per second, not per connect.
static NEXT_TRY_MS: AtomicU64 = AtomicU64::new(0);
const RETRY_MS: u64 = 1000;

fn coarse_now_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime into a local timespec (vDSO, no system call).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    (ts.tv_sec as u64).saturating_mul(1000) + (ts.tv_nsec as u64) / 1_000_000
}

fn mapped() -> Option<&'static Mapped> {
    let p = MAPPED.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: a pointer stored below from a leaked Box, never freed.
        return Some(unsafe { &*p });
    }
    let now = coarse_now_ms();
    if now < NEXT_TRY_MS.load(Ordering::Relaxed) {
        return None;
    }
    NEXT_TRY_MS.store(now + RETRY_MS, Ordering::Relaxed);
    let m = Mapped::open_read_only(&peer_table::path_for(&config::get().socket)).ok()?;
    let fresh = Box::into_raw(Box::new(m));
    match MAPPED.compare_exchange(
        std::ptr::null_mut(),
        fresh,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        // SAFETY: just stored; never freed.
        Ok(_) => Some(unsafe { &*fresh }),
        Err(other) => {
            // Another thread mapped it first: drop ours (unmaps it).
            // SAFETY: `fresh` came from Box::into_raw above and was not shared.
            drop(unsafe { Box::from_raw(fresh) });
            // SAFETY: as for the first load.
            Some(unsafe { &*other })
        }
    }
}

/// What the table says about `ip` (`Unknown` without a table).
pub fn lookup(ip: IpAddr) -> Verdict {
    mapped().map_or(Verdict::Unknown, |m| m.table().lookup(ip))
}
