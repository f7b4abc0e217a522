//! Adaptive spinning before a kernel sleep.
//!
//! Spinning only pays when the peer runs on another core at the same time.
//! On a busy machine the peer may need the very core the spinner holds, and
//! every spin then adds its full budget to the latency. So each waiter
//! keeps a score: a spin that saw the event raises it, a spin that ran out
//! lowers it, and at score zero only every 16th wait tries spinning again.

use crate::config;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Per-waiter spin statistics (one per connection, one per process for
/// poll/epoll sets).
pub struct Spinner {
    score: AtomicU32,
    waits: AtomicU32,
    /// A connection's spinner: its outcomes also set the score the next
    /// connection of the process starts with.
    seeds: bool,
}

const MAX_SCORE: u32 = 8;

/// The last score of any connection's spinner in this process: a new
/// connection starts from what the process's connections found lately,
/// not from scratch. A process opening connection after connection (a
/// connection per request) would otherwise spin its full budget on the
/// first waits of every one, on a machine where that spin fails.
static CONNECTION_SCORE: AtomicU32 = AtomicU32::new(MAX_SCORE / 2);

impl Spinner {
    pub const fn new() -> Spinner {
        Spinner {
            score: AtomicU32::new(MAX_SCORE / 2),
            waits: AtomicU32::new(0),
            seeds: false,
        }
    }

    /// A new connection's spinner.
    pub fn for_connection() -> Spinner {
        Spinner {
            score: AtomicU32::new(CONNECTION_SCORE.load(Ordering::Relaxed)),
            waits: AtomicU32::new(0),
            seeds: true,
        }
    }

    /// The spin budget of this wait in microseconds (0: do not spin). A
    /// waiter whose spins keep failing probes again only every 16th wait,
    /// and then briefly: a failed probe holds a core the peer may need, so
    /// its length shows up directly in the tail latency of a busy machine.
    pub fn budget_us(&self) -> u64 {
        let full = config::get().spin_us;
        if full == 0 || self.score.load(Ordering::Relaxed) > 0 {
            return full;
        }
        if self.waits.fetch_add(1, Ordering::Relaxed) % 16 == 0 {
            (full / 8).max(1)
        } else {
            0
        }
    }

    /// Records a spin's outcome.
    pub fn record(&self, success: bool) {
        let s = self.score.load(Ordering::Relaxed);
        let n = if success {
            (s + 1).min(MAX_SCORE)
        } else {
            s / 2
        };
        self.score.store(n, Ordering::Relaxed);
        if self.seeds {
            CONNECTION_SCORE.store(n, Ordering::Relaxed);
        }
    }

    /// The spin deadline for a wait starting now, if it should spin.
    pub fn deadline(&self) -> Option<Instant> {
        match self.budget_us() {
            0 => None,
            us => Some(Instant::now() + Duration::from_micros(us)),
        }
    }

    /// Spins until `ready()` or the budget is spent; true if ready.
    pub fn spin(&self, mut ready: impl FnMut() -> bool) -> bool {
        let Some(end) = self.deadline() else {
            return false;
        };
        loop {
            for _ in 0..64 {
                if ready() {
                    self.record(true);
                    return true;
                }
                std::hint::spin_loop();
            }
            if Instant::now() >= end {
                self.record(false);
                return false;
            }
        }
    }
}

/// The spinner of poll/select/epoll waits in this process.
pub static WAITS: Spinner = Spinner::new();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_connection_starts_from_what_the_last_ones_found() {
        let first = Spinner::for_connection();
        // Its spins keep failing: it stops spinning (but for probes).
        for _ in 0..8 {
            first.record(false);
        }
        let next = Spinner::for_connection();
        assert_eq!(next.score.load(Ordering::Relaxed), 0);
        let budgets: Vec<u64> = (0..16).map(|_| next.budget_us()).collect();
        assert_eq!(budgets.iter().filter(|b| **b > 0).count(), 1, "{budgets:?}");
        // Spins that succeed bring the next connections back to spinning.
        for _ in 0..4 {
            next.record(true);
        }
        assert!(Spinner::for_connection().budget_us() > 0);
        // The poll/epoll spinner neither sets nor takes the score.
        let waits = Spinner::new();
        for _ in 0..8 {
            waits.record(false);
        }
        assert_eq!(CONNECTION_SCORE.load(Ordering::Relaxed), 4);
    }
}
