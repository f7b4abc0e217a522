//! The shared-memory region of one connection: a small header page holding
//! two ring control blocks, then two single-producer/single-consumer byte
//! rings, one per direction (client→server, server→client).
//!
//! ```text
//! offset 0      page 0: attach word (u32 at 0), fixed word (u32 at 64),
//!                       offer word (u32 at 128) and its stamp (u64 at
//!                       192; `offer`, stock channels only), attach-waiter
//!                       word (u32 at 256),
//!                       control blocks (RingCtl c2s at 512, s2c at 1024)
//! offset 4096   ring data client→server   (ring_size bytes, a power of two)
//! offset 4096+R ring data server→client   (ring_size bytes)
//! ```
//!
//! A freshly created (all-zero) region is a valid empty region, so neither
//! side has to initialise it and neither has to wait for the other.
//!
//! Positions (`head`, `tail`) are free-running `u64` byte counters; the byte
//! at position `p` lives at `p & (capacity - 1)`. `tail - head` is the fill.
//!
//! Capacity (rings that grow): each ring has a capacity word next to its
//! `tail`: 0 means the whole mapped ring (`ring_size`), anything else is the
//! power of two, between [`MIN_RING_SIZE`] and `ring_size`, of the ring in
//! use: only the first `capacity` bytes of the data area are ever touched,
//! so a connection costs memory (memfd pages are allocated on first touch)
//! for the traffic it carries, not for the configured size. Only the
//! producer writes the word, and only while the ring is empty (every byte
//! written so far consumed: its checked `head == tail`): the first write
//! of a library producer sets its starting size
//! ([`Producer::start_small`]); a write that found the ring full marks the
//! ring to grow, and the next moment the producer finds it empty it doubles
//! the capacity (or more, up to a size that fits the write at hand), up to
//! `ring_size`. The word is stored before the bytes that use it and before
//! the `tail` that publishes them (Release); the consumer re-reads it after
//! every Acquire load of `tail`, so it always masks with the capacity those
//! bytes were written under: the capacity cannot change again while any
//! byte at or after the consumer's `head` is unconsumed (the producer needs
//! `head == tail` for that), and `head` is the consumer's own. A producer
//! that found the ring full and wants to grow waits for the ring to empty
//! in its blocking path only (`Producer::wait_room`, bounded by
//! [`GROW_WAIT_MS`] so a reader that stops half way never stalls it
//! longer); poll/epoll writers grow when they happen to find it empty.
//! The fixed word (set by the daemon's relay, whose zero-copy placement
//! needs the whole ring at a fixed size) tells a producer never to change
//! the capacity; the daemon's own ends of such a region ignore the
//! capacity word altogether (a local property of its `Region`).
//! `tail` is written only by the producer, `head` only by the consumer, each
//! on its own 128-byte line (two lines, so the adjacent-line prefetcher does
//! not couple them). The rarely written flags live on a third line, so the
//! producer's per-write check of `reader_waiting` hits a line that stays
//! shared in both cores' caches.
//!
//! Memory ordering (the whole argument):
//! - Data: the producer copies bytes, then `tail.store(Release)`; the consumer
//!   `tail.load(Acquire)` then copies them out: the bytes happen-before the read.
//!   Symmetrically the consumer copies out, then `head.store(Release)`; the
//!   producer `head.load(Acquire)` before overwriting that space.
//! - Sleeping without lost wake-ups (Dekker): a consumer that wants to sleep
//!   stores `reader_waiting = 1`, issues a SeqCst fence, and re-checks `tail`.
//!   A producer stores `tail`, issues a SeqCst fence, and loads
//!   `reader_waiting`. The two fences are totally ordered, so at least one of
//!   them sees the other's store: either the consumer sees the new data and
//!   does not sleep, or the producer sees the flag and rings the doorbell.
//!   The same pattern with `writer_waiting`/`head` covers a producer waiting
//!   for room. Whoever rings clears the flag with `swap`, so one sleep costs
//!   at most one doorbell.
//! - Close: the producer publishes its last `tail`, then `producer_closed`
//!   (Release). A consumer that finds the ring empty and the flag set
//!   re-reads `tail` once more (the Acquire on the flag makes every earlier
//!   `tail` visible) before reporting end-of-stream.
//!
//! Hostile peer (every word of the region is written by another process,
//! which may be an attacker's pod):
//! - Each position is loaded once per operation into a local, checked, and
//!   only the local is used: `head <= tail <= head + size` (the fill never
//!   exceeds the ring's capacity), no position beyond `POSITION_LIMIT`, and
//!   neither position ever moves backwards from what this end saw last. The
//!   capacity word is checked with the positions: 0, or a power of two
//!   between [`MIN_RING_SIZE`] and the mapped ring size, else a violation.
//!   So every copy is at most `capacity <= ring_size` bytes at an offset
//!   masked by `capacity - 1`: inside the data area whatever the peer
//!   writes. The cost is a few comparisons per call, never per byte.
//! - Flag words may hold only their defined bits (`WAIT_BELL | WAIT_FUTEX`,
//!   closed flags 0 or 1, attach word 0, 1 or 2, fixed word 0 or 1; the
//!   attach-waiter word only decides whether the server rings a bell);
//!   `writer_need` is clamped
//!   to the ring size; futex words may hold anything (a futex compares,
//!   nothing is indexed by them).
//! - A violation marks the [`Region`] broken (a flag in this process's
//!   memory): every end of the region then reports a reset connection
//!   ([`ReadState::Broken`], no room, `peer_gone`), and the callers end it
//!   (`ECONNRESET` in the library, a counted failure in the daemon).
//! - What a peer can still do is only what it could do over TCP: send
//!   wrong bytes, stop reading, or stall.

use std::io::IoSlice;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crate::copy::{copy_bytes, copy_to_ring, CopyTuner};
pub use crate::region::Region;

/// Size of the control page at the start of the region.
pub const HEADER_LEN: usize = 4096;
/// Default bytes per direction (`FLOWLANE_RING_SIZE`): 1 MiB.
pub const DEFAULT_RING_SIZE: usize = 1 << 20;
/// Smallest ring the library accepts.
pub const MIN_RING_SIZE: usize = 4096;
/// Largest ring the library asks for (the daemon may bound it lower).
pub const MAX_RING_SIZE: usize = 64 << 20;
/// Default capacity a library producer starts its ring with
/// (`FLOWLANE_RING_INITIAL`): 16 KiB, the largest power of two for which a
/// connection whose rings have both wrapped at that size still costs at
/// most 64 KiB (4 KiB control page + 2 x 16 KiB = 36 KiB; 32 KiB would be
/// 68 KiB), so 1,000 idle connections stay under 64 MiB; it holds sixteen
/// 1 KiB messages in flight, and a bulk writer grows past it at once.
pub const DEFAULT_INITIAL_RING: usize = 16 << 10;
/// Longest a blocking writer waits for its ring to empty so that it can
/// grow (once per growth attempt; see the module doc).
pub const GROW_WAIT_MS: u32 = 10;

const CTL_OFFSET: [usize; 2] = [512, 1024];

/// Large copies publish their progress every this many bytes, so the
/// other side can start on the first part (pipelining within one call).
const CHUNK: usize = 64 << 10;

/// Offset of the attach word: 0 = undecided, 1 = the server mapped the
/// region and uses it, 2 = the client gave up waiting and both stay on TCP.
/// Whoever moves it first from 0 decides for both (compare-and-swap), so the
/// two ends can never disagree about the lane.
const ATTACH_OFFSET: usize = 0;

/// Offset of the fixed word: 0 = producers may change their rings'
/// capacity, 1 = they must not (set by the daemon's relay before it hands
/// the region out). Any other value is a violation.
const FIXED_OFFSET: usize = 64;

/// Offset of the attach-waiter word, written by the client: 0 = a client
/// that never says (an older library: the server rings the attach bell
/// always), 1 = a client that says when it waits, not waiting, 2 = waiting
/// for the attach in poll/epoll on the socket (the server rings the attach
/// bell), 3 = asleep on the server→client ring's data futex (the server
/// bumps it and wakes it: no TCP segment), 4 = both. The server reads it
/// after its compare-and-swap of the attach word, the client writes it
/// before its last look at the attach word ahead of a sleep, each behind a
/// SeqCst fence (the Dekker pattern of the rings' waiting flags): either
/// the client sees the attach, or the server sees it waiting and wakes it.
const ATTACH_WAITER_OFFSET: usize = 256;

/// Values of the attach-waiter word (see `ATTACH_WAITER_OFFSET`).
const WAITER_NOT_WAITING: u32 = 1;
const WAITER_BELL: u32 = 2;
const WAITER_FUTEX: u32 = 3;
const WAITER_BOTH: u32 = 4;

/// How the server wakes a client that waits for its attach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AttachWake {
    /// A doorbell byte on the socket (a client in poll/epoll, or one that
    /// never says).
    pub bell: bool,
    /// The server→client ring's data futex (a client blocked in a call).
    pub futex: bool,
}

/// Values of the attach word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attach {
    Undecided,
    ServerAttached,
    ClientGaveUp,
}

/// Which end of the connection a process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The connecting end: produces into ring 0, consumes ring 1.
    Client,
    /// The accepting end: produces into ring 1, consumes ring 0.
    Server,
}

/// A value alone on a 128-byte line.
#[repr(C, align(128))]
struct Line<T>(T);

/// Control block of one direction, inside the shared region.
#[repr(C)]
pub struct RingCtl {
    tail: Line<TailLine>,
    head: Line<AtomicU64>,
    flags: Line<Flags>,
}

/// The producer's line: its position and the ring's capacity word (see
/// the module doc), read together by the consumer: no extra cache line on
/// either side.
#[repr(C)]
struct TailLine {
    pos: AtomicU64,
    /// 0 = the whole mapped ring; else the capacity in use (a power of two
    /// between `MIN_RING_SIZE` and the mapped ring size).
    cap: AtomicU64,
}

#[repr(C)]
struct Flags {
    /// Consumer is (about to be) asleep and needs a doorbell for new data.
    reader_waiting: AtomicU32,
    /// Producer is (about to be) asleep and needs a doorbell for free room.
    writer_waiting: AtomicU32,
    /// Producer will write no more (shutdown(SHUT_WR) or close).
    producer_closed: AtomicU32,
    /// Consumer will read no more (close): writes fail with EPIPE.
    consumer_closed: AtomicU32,
    /// Futex words: bumped by the producer / consumer when it wakes a
    /// consumer / producer that sleeps on the futex (`WAIT_FUTEX`).
    data_seq: AtomicU32,
    room_seq: AtomicU32,
    /// Free bytes a producer asleep on the futex waits for (hysteresis,
    /// see `Producer::wait_room`); the consumer wakes it only from there on.
    writer_need: AtomicU64,
}

/// Bits of `reader_waiting` / `writer_waiting`: how the sleeper waits.
/// A thread asleep in poll/epoll on the TCP socket needs a doorbell byte; a
/// thread blocked inside the library's read/write sleeps on a futex in the
/// region (no doorbell, so no thread of the process can steal its wake-up).
pub const WAIT_BELL: u32 = 1;
pub const WAIT_FUTEX: u32 = 2;

/// No real stream comes near `u64` overflow (2^62 bytes is over a century
/// at 1 TB/s), so a larger position is a peer's invention; below it,
/// `position + length` cannot overflow.
pub const POSITION_LIMIT: u64 = 1 << 62;

/// Which position word of a ring this process writes, for
/// [`Ring::snapshot`]: the head when it consumes, the tail when it produces.
#[derive(Clone, Copy)]
enum Own {
    Head,
    Tail,
}

/// Attempts at a `(tail, head)` pair whose own word held still.
const SNAPSHOT_TRIES: usize = 8;

/// The bits a waiting word may hold.
const WAIT_BITS: u32 = WAIT_BELL | WAIT_FUTEX;

fn announce(word: &AtomicU32, bit: u32) {
    word.fetch_or(bit, Ordering::Relaxed);
    fence(Ordering::SeqCst);
}

fn withdraw(word: &AtomicU32, bit: u32) {
    word.fetch_and(!bit, Ordering::Relaxed);
}

pub(crate) fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a valid, aligned u32 in a shared mapping (not
    // FUTEX_PRIVATE: the waiter may be in another process).
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            0,
            0,
            0,
        )
    };
}

/// Moves a futex word on, then wakes its sleepers: a thread that read the
/// old value and is about to sleep on it returns at once instead of
/// missing the wake-up.
fn bump_and_wake(seq: &AtomicU32) {
    seq.fetch_add(1, Ordering::Release);
    futex_wake(seq);
}

/// Sleeps on `word` while it still holds `expected`, at most `timeout_ms`.
fn futex_wait(word: &AtomicU32, expected: u32, timeout_ms: u32) {
    futex_wait_for(
        word,
        expected,
        std::time::Duration::from_millis(timeout_ms.into()),
    )
}

/// Sleeps on `word` while it still holds `expected`, at most `timeout`.
pub(crate) fn futex_wait_for(word: &AtomicU32, expected: u32, timeout: std::time::Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a valid aligned u32 with a relative timeout.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            0,
            0,
        )
    };
}

const _: () = assert!(std::mem::size_of::<RingCtl>() == 384);
const _: () = assert!(FIXED_OFFSET + 4 <= crate::offer::OFFER_OFFSET);
const _: () = assert!(crate::offer::OFFER_END <= ATTACH_WAITER_OFFSET);
const _: () = assert!(ATTACH_WAITER_OFFSET + 4 <= CTL_OFFSET[0]);
const _: () = assert!(CTL_OFFSET[0] + std::mem::size_of::<RingCtl>() <= CTL_OFFSET[1]);
const _: () = assert!(CTL_OFFSET[1] + std::mem::size_of::<RingCtl>() <= HEADER_LEN);

/// The per-direction ring size that fits a region of `region_len` bytes:
/// the largest power of two with `HEADER_LEN + 2 * size <= region_len`.
/// Both ends compute it from the same length, so they always agree.
pub fn ring_size_for(region_len: usize) -> Option<usize> {
    let per_dir = region_len.checked_sub(HEADER_LEN)? / 2;
    if per_dir < MIN_RING_SIZE {
        return None;
    }
    Some(1usize << (usize::BITS - 1 - per_dir.leading_zeros()))
}

/// The region length to request for `ring_size` bytes per direction
/// (rounded to a power of two and clamped to the library's bounds).
pub fn region_len_for(ring_size: usize) -> usize {
    let r = ring_size
        .clamp(MIN_RING_SIZE, MAX_RING_SIZE)
        .next_power_of_two();
    HEADER_LEN + 2 * r
}

/// One direction of a region, as raw pointers into the mapping. Every
/// holder of a `RingRef` also holds the `Arc<Region>` it points into.
#[derive(Clone, Copy)]
struct RingRef {
    ctl: *const RingCtl,
    data: *mut u8,
    /// The mapped ring size: the largest capacity.
    size: usize,
    broken: *const AtomicBool,
    /// This process ignores the capacity word (see `Region::is_fixed`).
    fixed: bool,
}

// SAFETY: RingRef only points into a region that outlives it (its holder
// keeps the `Arc<Region>`); all shared mutable state is atomics or byte
// ranges handed over by the SPSC protocol above.
unsafe impl Send for RingRef {}
// SAFETY: as above; `&RingRef` only allows atomic access and copies guarded
// by the protocol.
unsafe impl Sync for RingRef {}

impl RingRef {
    /// Direction `i` (0: client→server, 1: server→client) of `region`.
    fn of(region: &Region, i: usize) -> RingRef {
        let size = region.ring_size();
        let base = region.base();
        RingRef {
            // SAFETY: the offset is below HEADER_LEN <= region.len().
            ctl: unsafe { base.add(CTL_OFFSET[i]) } as *const RingCtl,
            // SAFETY: the offset is below HEADER_LEN + 2 * size <=
            // region.len() (`ring_size_for`).
            data: unsafe { base.add(HEADER_LEN + i * size) },
            size,
            broken: region.broken_flag(),
            fixed: region.is_fixed(),
        }
    }

    /// The capacity a capacity word stands for, checked: 0 is the whole
    /// ring; else a power of two between `MIN_RING_SIZE` and the mapped
    /// size. Anything else is a violation (`None`). A fixed end always
    /// uses the whole ring.
    fn capacity_of(&self, word: u64) -> Option<usize> {
        if self.fixed || word == 0 {
            return Some(self.size);
        }
        if word.is_power_of_two() && word >= MIN_RING_SIZE as u64 && word <= self.size as u64 {
            return Some(word as usize);
        }
        self.violation();
        None
    }

    /// Loads and checks the capacity word (after an Acquire load of `tail`
    /// on the consumer's side: see the module doc).
    fn capacity(&self) -> Option<usize> {
        self.capacity_of(self.ctl().tail.0.cap.load(Ordering::Relaxed))
    }

    fn ctl(&self) -> &RingCtl {
        // SAFETY: `ctl` points at an aligned RingCtl inside a live mapping
        // (see `of`); RingCtl is all atomics, valid for any bits.
        unsafe { &*self.ctl }
    }

    /// A word of the region broke the protocol earlier.
    fn is_broken(&self) -> bool {
        // SAFETY: points into the live Region (see the struct).
        unsafe { &*self.broken }.load(Ordering::Relaxed)
    }

    /// The peer wrote a value the protocol does not allow: the connection
    /// is dead for every end of the region.
    #[cold]
    fn violation(&self) {
        // SAFETY: as in `is_broken`.
        unsafe { &*self.broken }.store(true, Ordering::Relaxed);
    }

    /// A `(tail, head)` pair that the protocol could have produced at one
    /// moment, for the lock-free readiness views ([`Probe`]), which run
    /// beside this process's own reader and writer threads.
    ///
    /// Loaded one after the other, the two positions can be inconsistent
    /// without anyone breaking the protocol: the word this process writes
    /// (`own`) may move between the loads (another of its threads read or
    /// wrote), and the peer's word may then move too, so a head loaded
    /// after the tail can pass it, or a head loaded before it can lag it by
    /// more than the capacity. Both look like violations to
    /// [`Ring::bounded`] and would reset a healthy connection. So the own
    /// word is loaded on both sides of the peer's, and the pair is taken
    /// when it held still: then the peer's word obeys the protocol against
    /// it, and a violation is the peer's. `None` when it kept moving: a
    /// thread of this process is busy on this ring, so the view may answer
    /// "ready" (a spurious readiness the application's next call resolves),
    /// and that thread's own calls check the positions under the end's lock.
    fn snapshot(&self, own: Own) -> Option<(u64, u64)> {
        let ctl = self.ctl();
        let (own_word, peer_word) = match own {
            Own::Head => (&ctl.head.0, &ctl.tail.0.pos),
            Own::Tail => (&ctl.tail.0.pos, &ctl.head.0),
        };
        let mut before = own_word.load(Ordering::Acquire);
        for _ in 0..SNAPSHOT_TRIES {
            let theirs = peer_word.load(Ordering::Acquire);
            let after = own_word.load(Ordering::Acquire);
            if after == before {
                return Some(match own {
                    Own::Head => (theirs, after),
                    Own::Tail => (after, theirs),
                });
            }
            before = after;
            std::hint::spin_loop();
        }
        None
    }

    /// The fill `tail - head`, or `None` (a violation) for a pair the
    /// protocol cannot produce: a head beyond the tail, more than the
    /// ring's capacity `cap` between them, or a position past
    /// [`POSITION_LIMIT`].
    fn bounded(&self, tail: u64, head: u64, cap: usize) -> Option<usize> {
        if tail > POSITION_LIMIT || head > tail || tail - head > cap as u64 {
            self.violation();
            return None;
        }
        Some((tail - head) as usize)
    }

    /// A closed flag: 0 open, 1 closed; anything else is a violation
    /// (reported as closed, so the caller stops).
    fn closed_flag(&self, word: &AtomicU32) -> bool {
        let v = word.load(Ordering::Acquire);
        if v > 1 {
            self.violation();
        }
        v != 0
    }

    /// The producer closed (Acquire: every `tail` it stored before is visible).
    fn producer_closed(&self) -> bool {
        self.closed_flag(&self.ctl().flags.0.producer_closed)
    }

    /// The consumer closed (or the region is broken): writes fail.
    fn consumer_closed(&self) -> bool {
        self.closed_flag(&self.ctl().flags.0.consumer_closed) || self.is_broken()
    }

    /// Takes a waiting word's sleep requests after publishing; wakes futex
    /// sleepers here, returns true if a doorbell is needed.
    fn take(&self, word: &AtomicU32, seq: &AtomicU32) -> bool {
        fence(Ordering::SeqCst);
        if word.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let v = word.swap(0, Ordering::AcqRel);
        if v & !WAIT_BITS != 0 {
            self.violation();
        }
        if v & WAIT_FUTEX != 0 {
            bump_and_wake(seq);
        }
        v & WAIT_BELL != 0
    }

    /// The producer's side after publishing data: wake the reader.
    fn take_reader(&self) -> bool {
        let f = &self.ctl().flags.0;
        self.take(&f.reader_waiting, &f.data_seq)
    }

    /// The consumer's side on close: wake the writer, whatever it waits for.
    fn take_writer(&self) -> bool {
        let f = &self.ctl().flags.0;
        self.take(&f.writer_waiting, &f.room_seq)
    }

    /// The consumer's side of `writer_waiting` after it freed room up to
    /// its checked `head`: a doorbell sleeper (poll/epoll) is woken for any
    /// room, a futex sleeper (a blocking write) only once the room reaches
    /// its `writer_need` (clamped to the ring), so that a streaming writer
    /// wakes once per half ring instead of once per chunk the reader frees.
    /// Only a wake-up depends on `tail` and `writer_need` here, never an
    /// access. Returns true if a doorbell is needed.
    fn take_room(&self, head: u64) -> bool {
        let f = &self.ctl().flags.0;
        fence(Ordering::SeqCst);
        let v = f.writer_waiting.load(Ordering::Relaxed);
        if v == 0 {
            return false;
        }
        if v & !WAIT_BITS != 0 {
            self.violation();
        }
        let mut bits = v & WAIT_BELL;
        if v & WAIT_FUTEX != 0 {
            let used = self
                .ctl()
                .tail
                .0
                .pos
                .load(Ordering::Acquire)
                .wrapping_sub(head);
            let free = (self.size as u64).saturating_sub(used);
            let need = f.writer_need.load(Ordering::Relaxed).min(self.size as u64);
            if free >= need {
                bits |= WAIT_FUTEX;
            }
        }
        if bits == 0 {
            return false;
        }
        let old = f.writer_waiting.fetch_and(!bits, Ordering::AcqRel) & bits;
        if old & WAIT_FUTEX != 0 {
            bump_and_wake(&f.room_seq);
        }
        old & WAIT_BELL != 0
    }
}

impl Region {
    /// The producer and consumer ends of `side`.
    pub fn endpoints(self: &Arc<Self>, side: Side) -> (Producer, Consumer) {
        let (tx, rx) = self.rings(side);
        (
            Producer {
                ring: tx,
                tail_seen: 0,
                head_cache: 0,
                bell: false,
                tuner: CopyTuner::new(),
                cap: tx.size,
                initial: tx.size,
                grow: false,
                grow_blocked: false,
                _region: self.clone(),
            },
            Consumer {
                ring: rx,
                head_seen: 0,
                tail_cache: 0,
                cap: rx.size,
                bell: false,
                _region: self.clone(),
            },
        )
    }

    /// The lock-free view of `side`'s end.
    pub fn probe(self: &Arc<Self>, side: Side) -> Probe {
        let (tx, rx) = self.rings(side);
        Probe {
            tx,
            rx,
            region: self.clone(),
        }
    }

    /// What a third party that maps the region (the daemon) sees of the
    /// connection: bytes written per direction (the free-running tails:
    /// client→server, server→client) and whether both producers closed.
    /// Raw words of the two ends, unchecked: the caller bounds them.
    pub fn observe(&self) -> (u64, u64, bool) {
        let c2s = RingRef::of(self, 0);
        let s2c = RingRef::of(self, 1);
        let closed = |r: &RingRef| r.ctl().flags.0.producer_closed.load(Ordering::Acquire) != 0;
        (
            c2s.ctl().tail.0.pos.load(Ordering::Acquire),
            s2c.ctl().tail.0.pos.load(Ordering::Acquire),
            closed(&c2s) && closed(&s2c),
        )
    }

    /// (sending ring, receiving ring) of `side`.
    fn rings(&self, side: Side) -> (RingRef, RingRef) {
        match side {
            Side::Client => (RingRef::of(self, 0), RingRef::of(self, 1)),
            Side::Server => (RingRef::of(self, 1), RingRef::of(self, 0)),
        }
    }

    fn attach_word(&self) -> &AtomicU32 {
        // SAFETY: offset 0 of the page-aligned mapping, which lives as long
        // as `self`; an atomic is valid for any bits.
        unsafe { &*(self.base().add(ATTACH_OFFSET) as *const AtomicU32) }
    }

    fn attach_waiter_word(&self) -> &AtomicU32 {
        // SAFETY: ATTACH_WAITER_OFFSET (aligned for a u32) lies in the
        // header page of the mapping, which lives as long as `self`; an
        // atomic is valid for any bits.
        unsafe { &*(self.base().add(ATTACH_WAITER_OFFSET) as *const AtomicU32) }
    }

    pub(crate) fn fixed_word(&self) -> &AtomicU32 {
        // SAFETY: FIXED_OFFSET (aligned for a u32) lies in the header page
        // of the mapping, which lives as long as `self`; an atomic is valid
        // for any bits.
        unsafe { &*(self.base().add(FIXED_OFFSET) as *const AtomicU32) }
    }

    /// Producers may change this region's ring capacities: this process
    /// does not keep them fixed, and neither does the region's fixed word
    /// (0 or 1; anything else is a violation, read as fixed).
    fn growable(&self) -> bool {
        if self.is_fixed() {
            return false;
        }
        match self.fixed_word().load(Ordering::Acquire) {
            0 => true,
            1 => false,
            _ => {
                self.mark_broken();
                false
            }
        }
    }
}

/// Lock-free, read-only view of both directions of one end, for readiness
/// checks (poll/epoll) that must not contend with a blocked reader or writer.
#[derive(Clone)]
pub struct Probe {
    tx: RingRef,
    rx: RingRef,
    region: Arc<Region>,
}

impl Probe {
    /// The lane decision so far. A value outside the three is a violation
    /// (reported as `ClientGaveUp`: nobody uses the rings).
    pub fn attach_state(&self) -> Attach {
        match self.region.attach_word().load(Ordering::Acquire) {
            0 => Attach::Undecided,
            1 => Attach::ServerAttached,
            2 => Attach::ClientGaveUp,
            _ => {
                self.region.mark_broken();
                Attach::ClientGaveUp
            }
        }
    }

    /// Server: claim the lane. False if the client already gave up (then
    /// the connection is plain TCP on both ends).
    pub fn server_attach(&self) -> bool {
        match self
            .region
            .attach_word()
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => true,
            Err(v) => v == 1,
        }
    }

    /// Client, once its end is set up: it says when it waits for the
    /// attach, so the server need not ring the attach bell otherwise.
    pub fn client_says_when_it_waits(&self) {
        self.region.attach_waiter_word().store(1, Ordering::Relaxed);
    }

    /// Client, before its last look at the attach word ahead of a sleep
    /// in poll/epoll on the socket until the attach (the attach bell wakes
    /// it).
    pub fn client_waits_for_attach(&self) {
        self.mark_attach_waiter(WAITER_BELL);
    }

    /// Client, before its last look at the attach word ahead of a sleep in
    /// [`Self::sleep_until_attach`]: returns the futex value to sleep on
    /// (read before the mark, so a wake between the look and the sleep is
    /// not lost).
    pub fn client_sleeps_for_attach(&self) -> u32 {
        let seq = self.rx.ctl().flags.0.data_seq.load(Ordering::Acquire);
        self.mark_attach_waiter(WAITER_FUTEX);
        seq
    }

    /// Client: sleeps until the server attaches (or writes, or closes),
    /// at most `timeout_ms`; `seq` from `client_sleeps_for_attach`.
    pub fn sleep_until_attach(&self, seq: u32, timeout_ms: u32) {
        futex_wait(&self.rx.ctl().flags.0.data_seq, seq, timeout_ms);
    }

    /// Adds a way of waiting to the word (the other one stays: two threads
    /// of the client may wait each its own way).
    fn mark_attach_waiter(&self, how: u32) {
        let word = self.region.attach_waiter_word();
        let _ = word.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
            Some(match (v, how) {
                (WAITER_BELL | WAITER_BOTH, WAITER_FUTEX)
                | (WAITER_FUTEX | WAITER_BOTH, WAITER_BELL) => WAITER_BOTH,
                _ => how,
            })
        });
        fence(Ordering::SeqCst);
    }

    /// Server, after `server_attach`: how the client may be asleep waiting
    /// for the attach, so how it must be woken. Any value but the four a
    /// client writes (one that never says, or nonsense) gets the bell: it
    /// can only cost the client a byte.
    pub fn server_attach_wake(&self) -> AttachWake {
        fence(Ordering::SeqCst);
        let v = self.region.attach_waiter_word().load(Ordering::Relaxed);
        AttachWake {
            bell: !matches!(v, WAITER_NOT_WAITING | WAITER_FUTEX),
            futex: matches!(v, WAITER_FUTEX | WAITER_BOTH),
        }
    }

    /// Server: wakes a client asleep in `sleep_until_attach` (the futex
    /// value moves first, so a client about to sleep does not).
    pub fn wake_attach_sleeper(&self) {
        bump_and_wake(&self.tx.ctl().flags.0.data_seq);
    }

    /// Client: give up on the lane. False if the server attached first (then
    /// the ring must be used).
    pub fn client_give_up(&self) -> bool {
        match self
            .region
            .attach_word()
            .compare_exchange(0, 2, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => true,
            Err(v) => v == 2,
        }
    }

    /// The region is broken (the peer violated the protocol): the
    /// connection must be ended as reset.
    pub fn is_broken(&self) -> bool {
        self.region.is_broken()
    }

    /// What a read would find now.
    pub fn rx_state(&self) -> ReadState {
        let ring = &self.rx;
        let fill = || {
            // Unsettled: another thread of this process is consuming, so
            // data is flowing; report it as readable (see `snapshot`).
            let Some((tail, head)) = ring.snapshot(Own::Head) else {
                return Some(1);
            };
            let cap = ring.capacity()?;
            ring.bounded(tail, head, cap)
        };
        if ring.is_broken() {
            return ReadState::Broken;
        }
        match fill() {
            None => return ReadState::Broken,
            Some(n) if n > 0 => return ReadState::Data(n),
            Some(_) => {}
        }
        if ring.producer_closed() {
            return match fill() {
                None => ReadState::Broken,
                Some(0) => ReadState::Eof,
                Some(n) => ReadState::Data(n),
            };
        }
        ReadState::Empty
    }

    /// Free room in the sending ring now (0 when broken).
    pub fn tx_free(&self) -> usize {
        let ring = &self.tx;
        // Unsettled: another thread of this process is writing; report room
        // (see `snapshot`), which its next write call settles.
        let Some((tail, head)) = ring.snapshot(Own::Tail) else {
            return 1;
        };
        let Some(cap) = ring.capacity() else {
            return 0;
        };
        match ring.bounded(tail, head, cap) {
            Some(used) if !ring.is_broken() => cap - used,
            _ => 0,
        }
    }

    /// Receive-ring producer position (changes whenever data arrives).
    pub fn rx_tail(&self) -> u64 {
        self.rx.ctl().tail.0.pos.load(Ordering::Acquire)
    }

    /// Send-ring consumer position (changes whenever room is freed).
    pub fn tx_head(&self) -> u64 {
        self.tx.ctl().head.0.load(Ordering::Acquire)
    }

    /// The peer stopped reading (closed), or the region is broken: writes fail.
    pub fn tx_peer_gone(&self) -> bool {
        self.tx.consumer_closed()
    }

    /// Announce a sleeping reader (see [`Consumer::prepare_wait`]).
    pub fn prepare_read_wait(&self) {
        announce(&self.rx.ctl().flags.0.reader_waiting, WAIT_BELL);
    }

    /// Announce a sleeping writer (see [`Producer::prepare_wait`]).
    pub fn prepare_write_wait(&self) {
        announce(&self.tx.ctl().flags.0.writer_waiting, WAIT_BELL);
    }

    /// Closes the sending direction (shutdown/close) without the producer
    /// lock; true if the peer needs a doorbell.
    pub fn close_tx(&self) -> bool {
        self.tx
            .ctl()
            .flags
            .0
            .producer_closed
            .store(1, Ordering::Release);
        self.tx.take_reader()
    }

    /// Closes the receiving direction (close); true if the peer needs a doorbell.
    pub fn close_rx(&self) -> bool {
        self.rx
            .ctl()
            .flags
            .0
            .consumer_closed
            .store(1, Ordering::Release);
        self.rx.take_writer()
    }

    /// Withdraw both announcements.
    pub fn cancel_waits(&self) {
        withdraw(&self.rx.ctl().flags.0.reader_waiting, WAIT_BELL);
        withdraw(&self.tx.ctl().flags.0.writer_waiting, WAIT_BELL);
    }
}

/// The writing end of one ring.
pub struct Producer {
    ring: RingRef,
    /// Last `tail` this end stored or loaded: the shared `tail` may only
    /// move forward from it (another process of ours may have written more
    /// after a fork; the peer may not move it back).
    tail_seen: u64,
    /// Last checked `head`; stale values only under-estimate free room.
    head_cache: u64,
    /// A chunk publish inside a call found a consumer that wants a doorbell.
    bell: bool,
    /// How bulk copies into this ring store (see `copy`).
    tuner: CopyTuner,
    /// The ring's capacity (from the checked capacity word, reloaded with
    /// `tail`: a forked sibling of ours may have grown it).
    cap: usize,
    /// The capacity a fresh ring starts with (`start_small`); the mapped
    /// size (no growth) unless set.
    initial: usize,
    /// A write found the ring full: grow at the next empty moment.
    grow: bool,
    /// A wait for the ring to empty timed out (a reader that stopped half
    /// way): no new growth attempt until the ring is seen empty.
    grow_blocked: bool,
    _region: Arc<Region>,
}

/// The reading end of one ring.
pub struct Consumer {
    ring: RingRef,
    /// Last `head` this end stored or loaded (see `Producer::tail_seen`).
    head_seen: u64,
    /// Last checked `tail`; stale values only under-estimate available bytes.
    tail_cache: u64,
    /// The capacity word's checked value, loaded after `tail_cache`: the
    /// capacity the bytes up to `tail_cache` were written under.
    cap: usize,
    /// A chunk consume inside a call found a producer that wants a doorbell.
    bell: bool,
    _region: Arc<Region>,
}

impl Producer {
    /// The ring's capacity in bytes now (as of this end's last look).
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// The largest capacity: the mapped ring size.
    pub fn max_capacity(&self) -> usize {
        self.ring.size
    }

    /// Lets this ring start at `initial` bytes (rounded up to a power of
    /// two, at least `MIN_RING_SIZE`) and grow with the traffic up to the
    /// mapped size (see the module doc). Takes effect at the first write;
    /// no effect on a region whose capacity is fixed. Without it the ring
    /// stays at its full size.
    pub fn start_small(&mut self, initial: usize) {
        self.initial = initial
            .max(MIN_RING_SIZE)
            .checked_next_power_of_two()
            .unwrap_or(self.ring.size)
            .min(self.ring.size);
    }

    /// A write found the ring full and the ring will grow (in its blocking
    /// path the writer waits, briefly, for the ring to empty: `wait_room`).
    pub fn wants_to_grow(&self) -> bool {
        self.grow
    }

    /// Our `tail` and the free room, checked. `fresh` reloads `head`
    /// (else the cached one is used, reloaded only if it cannot be right).
    /// `None` once the region is broken.
    fn room(&mut self, fresh: bool) -> Option<(u64, usize)> {
        let ctl = self.ring.ctl();
        let tail = ctl.tail.0.pos.load(Ordering::Relaxed);
        if tail < self.tail_seen {
            self.ring.violation();
        }
        self.tail_seen = tail;
        let cap = self.ring.capacity()?;
        self.cap = cap;
        if fresh || tail.wrapping_sub(self.head_cache) > cap as u64 {
            let head = ctl.head.0.load(Ordering::Acquire);
            if head < self.head_cache {
                self.ring.violation();
            }
            self.head_cache = head;
        }
        let used = self.ring.bounded(tail, self.head_cache, cap)?;
        if self.ring.is_broken() {
            return None;
        }
        if used == 0 {
            self.grow_blocked = false;
        }
        Some((tail, cap - used))
    }

    /// At an empty moment (`free` is the whole capacity), sets the capacity
    /// a write of `want` bytes starting at `tail` goes on with: a fresh ring
    /// starts small, a ring that was found full doubles, and a ring smaller
    /// than the write grows to fit it; never beyond the mapped size. The
    /// word is stored before the bytes and the `tail` that publish them
    /// (module doc). Returns the free room under the capacity now in force.
    fn settle(&mut self, tail: u64, free: usize, want: usize) -> usize {
        let size = self.ring.size;
        if free != self.cap || self.initial >= size || !self._region.growable() {
            return free;
        }
        let word = &self.ring.ctl().tail.0.cap;
        let mut new = self.cap;
        if tail == 0 && word.load(Ordering::Relaxed) == 0 {
            new = self.initial;
        }
        if std::mem::take(&mut self.grow) {
            new = new.saturating_mul(2);
        }
        while new < want && new < size {
            new = new.saturating_mul(2);
        }
        let new = new.clamp(MIN_RING_SIZE, size);
        if new != self.cap || word.load(Ordering::Relaxed) == 0 {
            word.store(new as u64, Ordering::Relaxed);
            self.cap = new;
        }
        new
    }

    /// After a short write: ask for growth at the next empty moment.
    fn found_full(&mut self) {
        if self.cap < self.ring.size && self.initial < self.ring.size && !self.grow_blocked {
            self.grow = true;
        }
    }

    /// Publishes `tail` (bytes up to it are in the ring).
    fn publish(&mut self, tail: u64) {
        self.ring.ctl().tail.0.pos.store(tail, Ordering::Release);
        self.tail_seen = tail;
    }

    /// Bytes that can be written now without blocking (0 when broken).
    pub fn free(&mut self) -> usize {
        self.room(true).map_or(0, |(_, free)| free)
    }

    /// Copies as much of `src` as fits; returns the count (0 when full).
    pub fn write(&mut self, src: &[u8]) -> usize {
        self.write_vectored(&[IoSlice::new(src)])
    }

    /// Copies as much of the slices (in order) as fits, publishing once.
    pub fn write_vectored(&mut self, srcs: &[IoSlice<'_>]) -> usize {
        let want: usize = srcs.iter().map(|s| s.len()).sum();
        let Some((start, mut free)) = self.room(false) else {
            return 0;
        };
        if free < want || self.grow {
            match self.room(true) {
                Some((_, f)) => free = f,
                None => return 0,
            }
        }
        let free = self.settle(start, free, want);
        let mut pos = start;
        let mut published = start;
        for s in srcs {
            let mut s = &s[..];
            while !s.is_empty() {
                let room = free - (pos - start) as usize;
                if room == 0 {
                    break;
                }
                let n = s.len().min(room).min(CHUNK);
                // SAFETY: [pos, pos+n) is free room owned by the producer
                // (n <= room <= free <= size, from checked positions).
                unsafe { self.copy_in(pos, &s[..n]) };
                pos += n as u64;
                s = &s[n..];
                if (pos - published) as usize >= CHUNK && want - ((pos - start) as usize) > 0 {
                    self.publish(pos);
                    published = pos;
                    self.bell |= self.ring.take_reader();
                }
            }
        }
        if pos != published {
            self.publish(pos);
        }
        let wrote = (pos - start) as usize;
        if wrote < want {
            self.tuner.ring_full();
            self.found_full();
        }
        wrote
    }

    /// Copies `len` bytes produced by `fill` (which writes into the given
    /// slice and returns how many it wrote) straight into the ring; used for
    /// sendfile (pread into the ring). Returns the bytes published.
    pub fn write_with(&mut self, max: usize, mut fill: impl FnMut(&mut [u8]) -> usize) -> usize {
        let Some((tail, free)) = self.room(true) else {
            return 0;
        };
        let free = self.settle(tail, free, max);
        if free < max {
            self.found_full();
        }
        let off = (tail as usize) & (self.cap - 1);
        let n = max.min(free).min(self.cap - off); // contiguous part only
        if n == 0 {
            return 0;
        }
        // SAFETY: [off, off+n) is inside the data area (off + n <= size) and
        // owned by the producer (n <= free, from checked positions).
        let dst = unsafe { std::slice::from_raw_parts_mut(self.ring.data.add(off), n) };
        let got = fill(dst).min(n);
        if got > 0 {
            self.publish(tail + got as u64);
        }
        got
    }

    /// # Safety
    /// `[pos, pos + src.len())` must be free room (not readable by the
    /// consumer), and `src.len()` at most the ring size.
    unsafe fn copy_in(&mut self, pos: u64, src: &[u8]) {
        let off = (pos as usize) & (self.cap - 1);
        let first = src.len().min(self.cap - off);
        let (data, tuner) = (self.ring.data, &mut self.tuner);
        // SAFETY: both ranges lie inside the data area (off + first <= cap
        // <= size,
        // and the rest, src.len() - first <= off, starts at 0); the caller
        // guarantees the consumer does not access them until `tail` is
        // published (each copy that streams ends with its own fence, see
        // `copy`).
        unsafe {
            copy_to_ring(data.add(off), src.as_ptr(), first, tuner);
            copy_to_ring(data, src.as_ptr().add(first), src.len() - first, tuner);
        }
    }

    /// After publishing data: true if the consumer may be asleep and must get
    /// a doorbell (consumes the request).
    pub fn take_reader_wakeup(&mut self) -> bool {
        self.ring.take_reader() | std::mem::take(&mut self.bell)
    }

    /// Before sleeping for room: announce it. The caller must re-check
    /// `free()` afterwards and only sleep if still full.
    pub fn prepare_wait(&self) {
        announce(&self.ring.ctl().flags.0.writer_waiting, WAIT_BELL);
    }

    /// Blocks (futex) until the consumer has freed half the ring, up to
    /// `timeout_ms`. Returns at once if that much room is there already or
    /// the consumer is gone. Waiting for half the ring rather than for any
    /// room is the hysteresis of a streaming writer: it then refills half
    /// the ring per wake-up instead of one chunk (as TCP's write-space
    /// wake-up waits for a third of the send buffer). A ring that wants to
    /// grow ([`Producer::wants_to_grow`]) waits for the ring to empty
    /// instead, at most [`GROW_WAIT_MS`]; if it does not, this growth
    /// attempt is dropped until the ring is next seen empty.
    ///
    /// `writer_need` is in the consumer's terms, free room in the mapped
    /// ring (`size - used`), which needs no capacity on its side.
    pub fn wait_room(&mut self, timeout_ms: u32) {
        let ring = self.ring;
        let f = &ring.ctl().flags.0;
        let growing = self.grow;
        let (max_used, timeout_ms) = if growing {
            (0, timeout_ms.min(GROW_WAIT_MS))
        } else {
            (self.cap / 2, timeout_ms)
        };
        let seq = f.room_seq.load(Ordering::Acquire);
        f.writer_need
            .store((ring.size - max_used) as u64, Ordering::Relaxed);
        announce(&f.writer_waiting, WAIT_FUTEX);
        let used = self.room(true).map(|(_, free)| self.cap - free);
        if used.is_some_and(|u| u > max_used) && !self.peer_gone() {
            futex_wait(&f.room_seq, seq, timeout_ms);
        }
        withdraw(&f.writer_waiting, WAIT_FUTEX);
        if growing && self.room(true).is_some_and(|(_, free)| free != self.cap) {
            self.grow = false;
            self.grow_blocked = true;
        }
    }

    /// Withdraws a `prepare_wait` (woken or not going to sleep).
    pub fn cancel_wait(&self) {
        withdraw(&self.ring.ctl().flags.0.writer_waiting, WAIT_BELL);
    }

    /// The producer will write no more; the consumer sees end-of-stream.
    /// Wakes a futex-sleeping consumer; true if a doorbell is needed too.
    pub fn close(&self) -> bool {
        let f = &self.ring.ctl().flags.0;
        f.producer_closed.store(1, Ordering::Release);
        self.ring.take_reader()
    }

    /// The producer already closed (shutdown(SHUT_WR)).
    pub fn is_closed(&self) -> bool {
        self.ring.producer_closed()
    }

    /// The consumer will read no more (or the region is broken): writes
    /// should fail.
    pub fn peer_gone(&self) -> bool {
        self.ring.consumer_closed()
    }

    /// The region is broken: the connection must end as reset.
    pub fn is_broken(&self) -> bool {
        self.ring.is_broken()
    }
}

/// What a consumer found in its ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadState {
    /// This many bytes are available (> 0).
    Data(usize),
    /// Empty, and the producer closed: end of stream.
    Eof,
    /// Empty, producer still open.
    Empty,
    /// The peer broke the protocol: the connection is reset.
    Broken,
}

impl Consumer {
    /// The ring's capacity in bytes (as of this end's last look at `tail`).
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Our `head` and the bytes readable from it, checked. The cached
    /// `tail` is used when it already shows `want` bytes, else reloaded.
    /// `None` once the region is broken.
    fn fill(&mut self, want: usize) -> Option<(u64, usize)> {
        let ctl = self.ring.ctl();
        let head = ctl.head.0.load(Ordering::Relaxed);
        if head < self.head_seen {
            self.ring.violation();
        }
        self.head_seen = head;
        let cached = self.tail_cache.wrapping_sub(head);
        if cached < want as u64 || cached > self.cap as u64 {
            let tail = ctl.tail.0.pos.load(Ordering::Acquire);
            if tail < self.tail_cache {
                self.ring.violation();
            }
            self.tail_cache = tail;
            // After the Acquire on tail: the capacity those bytes use.
            self.cap = self.ring.capacity()?;
        }
        let fill = self.ring.bounded(self.tail_cache, head, self.cap)?;
        if self.ring.is_broken() {
            return None;
        }
        Some((head, fill))
    }

    /// Copies `dst.len()` bytes from position `head` out of the ring.
    fn copy_out(&self, head: u64, dst: &mut [u8]) {
        let n = dst.len();
        debug_assert!(n <= self.cap);
        let off = (head as usize) & (self.cap - 1);
        let first = n.min(self.cap - off);
        // SAFETY: n <= the checked fill <= cap <= size (checked capacity
        // word), so both ranges lie inside the data area; [head, head+n) was published by the producer
        // (Acquire on tail) and is not overwritten before we publish a
        // larger head.
        unsafe {
            copy_bytes(dst.as_mut_ptr(), self.ring.data.add(off), first);
            copy_bytes(dst.as_mut_ptr().add(first), self.ring.data, n - first);
        }
    }

    /// Publishes `head` (bytes before it may be overwritten).
    fn release(&mut self, head: u64) {
        self.ring.ctl().head.0.store(head, Ordering::Release);
        self.head_seen = head;
    }

    /// Bytes readable now (0 when broken).
    pub fn available(&mut self) -> usize {
        self.fill(usize::MAX).map_or(0, |(_, n)| n)
    }

    /// Data, end-of-stream, empty or broken, without consuming anything.
    pub fn state(&mut self) -> ReadState {
        match self.fill(usize::MAX) {
            None => return ReadState::Broken,
            Some((_, n)) if n > 0 => return ReadState::Data(n),
            Some(_) => {}
        }
        if self.ring.producer_closed() {
            // Every tail stored before the flag is visible now.
            return match self.fill(usize::MAX) {
                None => ReadState::Broken,
                Some((_, 0)) => ReadState::Eof,
                Some((_, n)) => ReadState::Data(n),
            };
        }
        ReadState::Empty
    }

    /// Copies up to `dst.len()` bytes out and consumes them.
    pub fn read(&mut self, dst: &mut [u8]) -> usize {
        let mut total = 0;
        let len = dst.len();
        // Large reads hand room back chunk by chunk (see CHUNK).
        for part in dst.chunks_mut(CHUNK) {
            let Some((head, avail)) = self.fill(part.len()) else {
                break;
            };
            let n = part.len().min(avail);
            self.copy_out(head, &mut part[..n]);
            if n > 0 {
                self.release(head + n as u64);
            }
            total += n;
            if n < part.len() {
                break;
            }
            if total < len {
                self.bell |= self.ring.take_room(self.head_seen);
            }
        }
        total
    }

    /// Copies up to `dst.len()` bytes out without consuming them.
    pub fn peek(&mut self, dst: &mut [u8]) -> usize {
        let Some((head, avail)) = self.fill(dst.len()) else {
            return 0;
        };
        let n = dst.len().min(avail);
        self.copy_out(head, &mut dst[..n]);
        n
    }

    /// Copies out into several buffers in order; consumes what was copied.
    pub fn read_vectored(&mut self, dsts: &mut [&mut [u8]]) -> usize {
        let mut total = 0;
        for d in dsts.iter_mut() {
            let n = self.read(d);
            total += n;
            if n < d.len() {
                break;
            }
        }
        total
    }

    /// Consumes `n` bytes (at most the available ones) without copying.
    pub fn consume(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        if let Some((head, avail)) = self.fill(n) {
            self.release(head + n.min(avail) as u64);
        }
    }

    /// After consuming: true if the producer may be asleep waiting for room
    /// and must get a doorbell (consumes the request).
    pub fn take_writer_wakeup(&mut self) -> bool {
        self.ring.take_room(self.head_seen) | std::mem::take(&mut self.bell)
    }

    /// Before sleeping for data: announce it. The caller must re-check
    /// `state()` afterwards and only sleep if still empty.
    pub fn prepare_wait(&self) {
        announce(&self.ring.ctl().flags.0.reader_waiting, WAIT_BELL);
    }

    /// Blocks (futex) until the producer publishes data or closes, up to
    /// `timeout_ms`. Returns at once if the ring is not empty.
    pub fn wait_data(&mut self, timeout_ms: u32) {
        let ring = self.ring;
        let f = &ring.ctl().flags.0;
        let seq = f.data_seq.load(Ordering::Acquire);
        announce(&f.reader_waiting, WAIT_FUTEX);
        if self.state() == ReadState::Empty {
            futex_wait(&f.data_seq, seq, timeout_ms);
        }
        withdraw(&f.reader_waiting, WAIT_FUTEX);
    }

    /// Withdraws a `prepare_wait`.
    pub fn cancel_wait(&self) {
        withdraw(&self.ring.ctl().flags.0.reader_waiting, WAIT_BELL);
    }

    /// The consumer will read no more (its process closed the connection).
    /// Wakes a futex-sleeping producer; true if a doorbell is needed too.
    pub fn close(&self) -> bool {
        let f = &self.ring.ctl().flags.0;
        f.consumer_closed.store(1, Ordering::Release);
        self.ring.take_writer()
    }

    /// The producer closed its side (used when the TCP connection reset, to
    /// tell an orderly close from a crash).
    pub fn producer_closed(&self) -> bool {
        self.ring.producer_closed()
    }

    /// The region is broken: the connection must end as reset.
    pub fn is_broken(&self) -> bool {
        self.ring.is_broken()
    }
}

/// Zero-copy access for the cross-node relay (flowlaned): the daemon is a
/// ring peer whose bytes are moved by the NIC (RDMA WRITE) straight out of
/// the pod's sending ring and into the remote pod's receiving ring, so it
/// needs the rings' memory and positions rather than copies. Nothing here
/// changes the layout or the protocol above; it only exposes it, with the
/// same checks.
impl Consumer {
    /// Start of the ring's data area (`capacity()` bytes; the byte at
    /// position `p` is at offset `p & (capacity - 1)`).
    pub fn data_ptr(&self) -> *mut u8 {
        self.ring.data
    }

    /// The consumer position (bytes consumed so far), checked.
    pub fn head(&mut self) -> u64 {
        self.fill(0).map_or(self.head_seen, |(head, _)| head)
    }

    /// The producer position (Acquire: the bytes before it are readable),
    /// checked: at most a ring beyond `head()`. Once broken, the last
    /// checked value.
    pub fn tail(&mut self) -> u64 {
        let _ = self.fill(usize::MAX);
        self.tail_cache
    }

    /// The futex word a sleeping consumer waits on; load it BEFORE looking
    /// at the ring, then pass it to [`Consumer::wait_change`].
    pub fn data_seq(&self) -> u32 {
        self.ring.ctl().flags.0.data_seq.load(Ordering::Acquire)
    }

    /// Blocks (futex) until the producer publishes beyond `tail_seen`,
    /// closes (when `closed_seen` was false), or anyone bumps the futex
    /// word past `seq` ([`Probe::wake_rx_waiter`]); up to `timeout_ms`.
    /// Unlike [`Consumer::wait_data`] it also sleeps on a non-empty ring
    /// (bytes the daemon has already handed to the NIC).
    pub fn wait_change(&mut self, seq: u32, tail_seen: u64, closed_seen: bool, timeout_ms: u32) {
        let f = &self.ring.ctl().flags.0;
        announce(&f.reader_waiting, WAIT_FUTEX);
        let tail = self.ring.ctl().tail.0.pos.load(Ordering::Acquire);
        let closed = f.producer_closed.load(Ordering::Acquire) != 0;
        if tail == tail_seen && closed == closed_seen && !self.ring.is_broken() {
            futex_wait(&f.data_seq, seq, timeout_ms);
        }
        withdraw(&f.reader_waiting, WAIT_FUTEX);
    }
}

impl Producer {
    /// Start of the ring's data area (`capacity()` bytes).
    pub fn data_ptr(&self) -> *mut u8 {
        self.ring.data
    }

    /// The producer position (bytes published so far), checked (see
    /// `room`). Once broken, the last checked value.
    pub fn tail(&mut self) -> u64 {
        let _ = self.room(false);
        self.tail_seen
    }

    /// Publishes `n` bytes that something else (the NIC) already wrote into
    /// the free room at the tail. Returns false (and publishes nothing) if
    /// `n` exceeds the free room: the writer overran the ring.
    pub fn commit(&mut self, n: usize) -> bool {
        match self.room(true) {
            Some((tail, free)) if n <= free => {
                self.publish(tail + n as u64);
                true
            }
            _ => false,
        }
    }
}

impl Probe {
    /// Wakes a thread in [`Consumer::wait_change`] on the receiving ring
    /// (bumps its futex word first, so a wake-up cannot be lost).
    pub fn wake_rx_waiter(&self) {
        bump_and_wake(&self.rx.ctl().flags.0.data_seq);
    }

    /// Wakes a thread in [`Probe::wait_tx_free`] (bumps the futex word
    /// first), so it recomputes what it waits for.
    pub fn wake_tx_waiter(&self) {
        bump_and_wake(&self.tx.ctl().flags.0.room_seq);
    }

    /// Sending-ring producer position.
    pub fn tx_tail(&self) -> u64 {
        self.tx.ctl().tail.0.pos.load(Ordering::Acquire)
    }

    /// Sending-ring capacity.
    pub fn tx_capacity(&self) -> usize {
        self.tx.size
    }

    /// Blocks (futex) until the consumer of the sending ring has freed room
    /// up to `need` bytes, up to `timeout_ms`, without the producer's lock
    /// (the relay's producer only commits; this thread only watches). Same
    /// hand-shake as [`Producer::wait_room`]; use one or the other per ring.
    pub fn wait_tx_free(&self, need: usize, timeout_ms: u32) {
        let f = &self.tx.ctl().flags.0;
        let seq = f.room_seq.load(Ordering::Acquire);
        f.writer_need.store(need as u64, Ordering::Relaxed);
        announce(&f.writer_waiting, WAIT_FUTEX);
        if self.tx_free() < need && !self.tx_peer_gone() {
            futex_wait(&f.room_seq, seq, timeout_ms);
        }
        withdraw(&f.writer_waiting, WAIT_FUTEX);
    }
}

#[cfg(test)]
#[path = "ring_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "ring_hostile_tests.rs"]
mod hostile_tests;
