//! The offer word of a stock channel (docs/shm-lane.md, "Pre-created
//! channels"): how a client names, in the region itself, the connection it
//! is about to use a stock channel for, so that the server can pick the
//! channel for the connection it accepted without asking the daemon.
//!
//! A u32 in the header page: the state in the high 16 bits, the client's
//! source port in the low 16 (offered only).
//!
//! - free (0): stock nobody uses yet.
//! - connecting: the client took the channel for a `connect` whose source
//!   port it does not know yet (the kernel picks it in `connect`). The
//!   stamp beside the word holds when (CLOCK_MONOTONIC, milliseconds).
//! - offered(port): the connection from `port` uses the channel.
//! - taken: a server attached it to the connection it accepted (final).
//! - dead: the client gave the channel up (final).
//!
//! The client moves free → connecting (compare-and-swap) → offered (swap,
//! and a futex wake if a server marked the word "connecting, waited for"
//! before it slept on it); when its connect failed
//! or the server never attached, connecting/offered → dead. The server
//! moves offered(port) → taken (compare-and-swap), so one connection gets
//! the channel and a second server process holding the same stock cannot
//! take it too. The daemon revokes stock it no longer stands behind
//! (its listener went away, it expired): free → dead.
//!
//! Hostile client: it can write any value. The server reads the word once
//! per look and treats a value outside the set as a channel it must not
//! use; a port is matched only against a connection accepted from the
//! address the daemon made the stock for, so a client can misdirect only
//! its own connections (as it could by sending wrong bytes over TCP). A
//! connecting stamp older than [`STALE_CONNECTING`], or in the future, is
//! not waited for: a client that died half way costs the server nothing.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use crate::region::Region;
use crate::ring::{futex_wait_for, futex_wake};

/// Offset of the offer word in the header page.
pub const OFFER_OFFSET: usize = 128;
/// Offset of the connecting stamp (u64, its own cache line).
const STAMP_OFFSET: usize = 192;
/// First byte after the offer's words.
pub const OFFER_END: usize = STAMP_OFFSET + 8;

const STATE_SHIFT: u32 = 16;
const FREE: u32 = 0;
const CONNECTING: u32 = 1 << STATE_SHIFT;
/// Connecting, and a server sleeps on the word: the client's next store
/// wakes it (without a sleeper, no wake-up system call).
const CONNECTING_WAITED: u32 = CONNECTING | 1;
const OFFERED: u32 = 2 << STATE_SHIFT;
const TAKEN: u32 = 3 << STATE_SHIFT;
const DEAD: u32 = 4 << STATE_SHIFT;

/// How long a connecting offer is worth waiting for.
pub const STALE_CONNECTING: Duration = Duration::from_millis(200);

/// What the offer word says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offer {
    Free,
    /// Taken for a connect; `fresh`: the stamp is recent enough that the
    /// port is worth waiting for.
    Connecting {
        fresh: bool,
    },
    Offered(u16),
    Taken,
    Dead,
    /// A value no client following the protocol writes.
    Invalid,
}

/// Milliseconds of CLOCK_MONOTONIC: one clock for every process of the
/// node (the client's stamp, the server's age check).
fn now_ms() -> u64 {
    crate::client::monotonic_ms()
}

impl Region {
    fn offer_word(&self) -> &AtomicU32 {
        // SAFETY: OFFER_OFFSET (aligned for a u32) lies in the header page
        // of the mapping, which lives as long as `self`; an atomic is valid
        // for any bits.
        unsafe { &*(self.base().add(OFFER_OFFSET) as *const AtomicU32) }
    }

    fn offer_stamp(&self) -> &AtomicU64 {
        // SAFETY: as for the offer word; STAMP_OFFSET is aligned for a u64.
        unsafe { &*(self.base().add(STAMP_OFFSET) as *const AtomicU64) }
    }

    /// The offer as this end reads it now.
    pub fn offer(&self) -> Offer {
        let w = self.offer_word().load(Ordering::Acquire);
        match (w & !0xffff, w & 0xffff) {
            (FREE, 0) => Offer::Free,
            (CONNECTING, 0 | 1) => {
                let since = self.offer_stamp().load(Ordering::Relaxed);
                let age = now_ms().checked_sub(since);
                Offer::Connecting {
                    fresh: age.is_some_and(|a| a <= STALE_CONNECTING.as_millis() as u64),
                }
            }
            (OFFERED, port) => Offer::Offered(port as u16),
            (TAKEN, 0) => Offer::Taken,
            (DEAD, 0) => Offer::Dead,
            _ => Offer::Invalid,
        }
    }

    /// Client: takes the channel for a connect (free → connecting). False
    /// if it is not free (a forked copy of this process took it).
    pub fn offer_begin(&self) -> bool {
        self.offer_stamp().store(now_ms(), Ordering::Relaxed);
        self.offer_word()
            .compare_exchange(FREE, CONNECTING, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Client: the connect has its source port: offered(port), and a
    /// server waiting on the word wakes.
    pub fn offer_port(&self, port: u16) {
        let was = self
            .offer_word()
            .swap(OFFERED | u32::from(port), Ordering::AcqRel);
        if was == CONNECTING_WAITED {
            futex_wake(self.offer_word());
        }
    }

    /// Client: gives a channel it took up for good (the connect failed, no
    /// port to offer, or no server attached).
    pub fn offer_abandon(&self) {
        let w = self.offer_word().load(Ordering::Acquire);
        if w & !0xffff == OFFERED || w == CONNECTING || w == CONNECTING_WAITED {
            let _ =
                self.offer_word()
                    .compare_exchange(w, DEAD, Ordering::AcqRel, Ordering::Acquire);
        }
        if w == CONNECTING_WAITED {
            futex_wake(self.offer_word());
        }
    }

    /// Daemon: the stock channel is no longer valid (its listener went
    /// away, it expired): free → dead, so that a client still holding it
    /// asks the daemon instead of offering it to a server that will never
    /// look. False if a client had taken it already.
    pub fn offer_revoke(&self) -> bool {
        self.offer_word()
            .compare_exchange(FREE, DEAD, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Server: takes the channel offered for the connection from `port`
    /// (offered(port) → taken). False if it is not offered for that port
    /// (any more).
    pub fn offer_take(&self, port: u16) -> bool {
        self.offer_word()
            .compare_exchange(
                OFFERED | u32::from(port),
                TAKEN,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }

    /// Server: sleeps while the word still says connecting, at most
    /// `timeout` (the client's `offer_port` wakes it: the word says first
    /// that someone sleeps on it).
    pub fn offer_wait(&self, timeout: Duration) {
        let word = self.offer_word();
        let _ = word.compare_exchange(
            CONNECTING,
            CONNECTING_WAITED,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        futex_wait_for(word, CONNECTING_WAITED, timeout);
    }
}

#[cfg(all(test, not(miri)))]
mod tests {
    use super::*;

    fn twins() -> (std::sync::Arc<Region>, std::sync::Arc<Region>) {
        Region::twin_mappings(crate::ring::region_len_for(4096), false).unwrap()
    }

    #[test]
    fn a_fresh_region_offers_nothing() {
        let (c, s) = twins();
        assert_eq!(c.offer(), Offer::Free);
        assert!(!s.offer_take(0));
    }

    #[test]
    fn the_server_takes_only_the_offered_port_and_only_once() {
        let (c, s) = twins();
        assert!(c.offer_begin());
        assert_eq!(s.offer(), Offer::Connecting { fresh: true });
        assert!(!s.offer_take(0), "a connecting offer names no port");
        c.offer_port(40_001);
        assert_eq!(s.offer(), Offer::Offered(40_001));
        assert!(!s.offer_take(40_002));
        assert!(s.offer_take(40_001));
        assert!(!s.offer_take(40_001), "a second server cannot take it too");
        assert_eq!(c.offer(), Offer::Taken);
        c.offer_abandon();
        assert_eq!(s.offer(), Offer::Taken, "a taken channel stays taken");
        assert!(!c.offer_begin());
    }

    #[test]
    fn an_abandoned_or_revoked_channel_is_dead_for_both_ends() {
        let (c, s) = twins();
        assert!(c.offer_begin());
        c.offer_port(6);
        assert!(!s.offer_revoke(), "a taken channel is the client's");
        c.offer_abandon();
        assert_eq!(s.offer(), Offer::Dead);
        assert!(!s.offer_take(6));
        let (c, d) = twins();
        assert!(d.offer_revoke());
        assert!(!c.offer_begin(), "a revoked channel is never offered");
        assert_eq!(c.offer(), Offer::Dead);
    }

    #[test]
    fn hostile_words_are_invalid_and_old_stamps_are_not_waited_for() {
        let (c, s) = twins();
        for bad in [
            CONNECTING | 7,
            CONNECTING | 2,
            TAKEN | 1,
            DEAD | 2,
            5 << STATE_SHIFT,
            u32::MAX,
            FREE | 9,
        ] {
            c.offer_word().store(bad, Ordering::Release);
            assert_eq!(s.offer(), Offer::Invalid, "{bad:#x}");
        }
        c.offer_word().store(CONNECTING, Ordering::Release);
        c.offer_stamp().store(0, Ordering::Relaxed);
        assert_eq!(s.offer(), Offer::Connecting { fresh: false });
        c.offer_stamp().store(u64::MAX, Ordering::Relaxed);
        assert_eq!(
            s.offer(),
            Offer::Connecting { fresh: false },
            "a stamp in the future"
        );
    }

    #[test]
    fn a_waiting_server_wakes_when_the_port_is_offered() {
        let (c, s) = twins();
        assert!(c.offer_begin());
        let t = std::thread::spawn(move || {
            let t0 = std::time::Instant::now();
            while s.offer() != Offer::Offered(9) && t0.elapsed() < Duration::from_secs(10) {
                s.offer_wait(Duration::from_secs(10));
            }
            s.offer()
        });
        std::thread::sleep(Duration::from_millis(20));
        c.offer_port(9);
        assert_eq!(t.join().unwrap(), Offer::Offered(9));
    }

    #[test]
    fn a_waiting_server_wakes_when_the_client_gives_up() {
        let (c, s) = twins();
        assert!(c.offer_begin());
        let t = std::thread::spawn(move || {
            let t0 = std::time::Instant::now();
            s.offer_wait(Duration::from_secs(10));
            (s.offer(), t0.elapsed())
        });
        // The server marks the word before it sleeps.
        let t0 = std::time::Instant::now();
        while c.offer_word().load(Ordering::Acquire) != CONNECTING_WAITED
            && t0.elapsed() < Duration::from_secs(10)
        {
            std::thread::yield_now();
        }
        assert_eq!(c.offer(), Offer::Connecting { fresh: true });
        c.offer_abandon();
        let (seen, waited) = t.join().unwrap();
        assert_eq!(seen, Offer::Dead);
        assert!(waited < Duration::from_secs(10), "the server was not woken");
    }
}
