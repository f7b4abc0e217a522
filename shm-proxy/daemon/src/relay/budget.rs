//! The relay's memory budget (`--relay-memory-budget`).
//!
//! A relayed connection holds, in this daemon, its pod's channel region
//! (mapped; the daemon writes the receiving ring, and with zero copy it
//! pins both rings for the NIC: 2 x 4 MiB + the 4 KiB control page) and its
//! lane buffers (the copying pump's 256 KiB frame buffer). That is about
//! 8 MiB per connection with zero copy, 2.3 MiB on the copying path. The
//! relay reserves a connection's cost before it creates the region and
//! releases it when the connection ends (or its set-up fails): a
//! connection that would exceed the budget stays on TCP, counted as
//! `relay-budget`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::frames::{DATA_HEADER, MAX_DATA};

/// What the daemon itself needs besides its relayed connections (runtime,
/// registry, shm-lane bookkeeping, thread stacks): kept out of the default
/// budget, and added to it in the manifests' memory limit.
pub const DAEMON_BASE: u64 = 128 << 20;

/// The default budget when the daemon's cgroup sets no memory limit.
pub const UNLIMITED_DEFAULT: u64 = 1 << 30;

/// Bytes one relayed connection holds for a region of `region_len`.
pub fn connection_cost(region_len: u64) -> u64 {
    region_len + (DATA_HEADER + MAX_DATA) as u64
}

/// The default budget: the container's memory limit (cgroup v2
/// `memory.max` of this process) less [`DAEMON_BASE`], at least a quarter
/// of the limit; [`UNLIMITED_DEFAULT`] without a limit.
pub fn default_budget() -> u64 {
    let limit = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|c| {
            c.lines()
                .find_map(|l| l.strip_prefix("0::").map(str::to_string))
        })
        .and_then(|path| {
            std::fs::read_to_string(format!("/sys/fs/cgroup{}/memory.max", path.trim())).ok()
        })
        .and_then(|v| v.trim().parse::<u64>().ok());
    budget_for_limit(limit)
}

fn budget_for_limit(limit: Option<u64>) -> u64 {
    match limit {
        Some(l) => l.saturating_sub(DAEMON_BASE).max(l / 4),
        None => UNLIMITED_DEFAULT,
    }
}

#[derive(Debug)]
pub struct MemoryBudget {
    limit: u64,
    used: AtomicU64,
}

/// Memory reserved for one connection; released when dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<MemoryBudget>,
    bytes: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

impl MemoryBudget {
    pub fn new(limit: u64) -> Arc<Self> {
        Arc::new(MemoryBudget {
            limit,
            used: AtomicU64::new(0),
        })
    }

    /// Reserves `bytes`, or `None` when they do not fit.
    pub fn try_reserve(self: &Arc<Self>, bytes: u64) -> Option<Reservation> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(bytes).filter(|n| *n <= self.limit)
            })
            .ok()?;
        Some(Reservation {
            budget: self.clone(),
            bytes,
        })
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_fit_the_budget_and_are_released_on_drop() {
        let b = MemoryBudget::new(10);
        let r1 = b.try_reserve(6).unwrap();
        assert!(b.try_reserve(5).is_none());
        let r2 = b.try_reserve(4).unwrap();
        assert_eq!(b.used(), 10);
        drop(r1);
        assert_eq!(b.used(), 4);
        assert!(b.try_reserve(6).is_some());
        drop(r2);
        assert_eq!(b.used(), 0);
        assert!(MemoryBudget::new(0).try_reserve(1).is_none());
    }

    #[test]
    fn the_default_follows_the_container_limit() {
        assert_eq!(budget_for_limit(Some(640 << 20)), 512 << 20);
        assert_eq!(budget_for_limit(Some(128 << 20)), 32 << 20);
        assert_eq!(budget_for_limit(None), UNLIMITED_DEFAULT);
        // The zero-copy connection: two 4 MiB rings, the control page, the
        // copy buffer.
        let zc = connection_cost(flowlane_lane::ring::region_len_for(4 << 20) as u64);
        assert!((8 << 20..9 << 20).contains(&zc), "{zc}");
    }
}
