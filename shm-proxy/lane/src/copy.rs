//! The two copies of the lane: into a ring (the producer) and out of it (the
//! consumer). Both are plain memory copies; what matters is how the CPU does
//! them, because on a VM the two ends often sit on different core complexes.
//!
//! **Into the ring: streaming stores for bulk.** A ring line the consumer
//! has read sits (shared) in the consumer core's cache, so a plain store to
//! it must first take the line over: a read-for-ownership that invalidates
//! the consumer's copy. On a VM the host often places the two vCPUs on
//! different core complexes, every such take-over is then a cross-complex
//! round trip, and the writer of a bulk stream becomes the bottleneck (the
//! reader waits on it for every message). Non-temporal (streaming) stores
//! write whole lines through the write-combining buffers without reading
//! them first, so the writer runs at one core's store rate wherever the
//! reader sits (SSE2, AVX2 and AVX-512 stores measured the same, so the
//! x86-64 baseline's SSE2 is used and needs no run-time detection). The
//! reader then reads those lines from memory. Figures:
//! docs/benchmarks/2026-11-30-streaming-stores.md.
//!
//! When the two vCPUs sit close, half and half does better: every other
//! 512-byte group of lines streamed, the others stored normally (the cached
//! half reaches the reader through the shared L3, and the two kinds of
//! store use different buffers; see `MIXED_GROUP` for the group size). Far
//! apart, any normal store stalls the copy on its take-over again, whatever
//! the mix. Where the host puts the vCPUs changes while a
//! stream runs, so each ring's [`CopyTuner`] measures what the writer sees
//! end to end and now and then tries the other way (see there).
//!
//! Small copies keep ordinary stores: a line that is read back at once is
//! cheapest in the cache, and the 64-byte ping-pong latency must not pay a
//! trip to memory. `set_streaming_stores(false)` (`FLOWLANE_NT_STORES=0` in
//! the preload library) turns streaming off altogether.
//!
//! Streaming stores are weakly ordered: they can become visible after a
//! later ordinary store. A copy that used them ends with `sfence`, so the
//! producer's `tail` store (Release) that publishes the bytes cannot
//! overtake them.
//!
//! **Out of the ring and unaligned copies:** see [`copy_bytes`].

use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};

/// Largest piece handed to one `memcpy` when source and destination are
/// not co-aligned (see `copy_bytes`). Below glibc's `rep movsb` threshold
/// (2112 bytes on CPUs with FSRM, more elsewhere).
const PIECE: usize = 2048;

/// `Mixed` alternates groups of this many lines (512 bytes): streamed,
/// stored normally, streamed, ... With the vCPUs close together 512-byte
/// groups moved the most of the group sizes tried (single lines to 2 KiB;
/// docs/benchmarks/2026-11-30-streaming-stores.md).
const MIXED_GROUP: usize = 8;

/// Copies into a ring of at least this many bytes use streaming stores.
const STREAMING_MIN: usize = 4096;

static STREAMING: AtomicBool = AtomicBool::new(true);

/// Turns streaming stores for bulk copies into rings on or off (default on).
pub fn set_streaming_stores(on: bool) {
    STREAMING.store(on, Ordering::Relaxed);
}

/// Whether bulk copies into rings use streaming stores. Never under miri,
/// which cannot run `sfence` (the ring's tests run under miri with
/// ordinary copies; `stream_copy` itself is tested natively).
fn streaming_stores() -> bool {
    cfg!(all(target_arch = "x86_64", not(miri))) && STREAMING.load(Ordering::Relaxed)
}

/// Copies `n` bytes. glibc's memcpy hands copies above ~2 KiB to
/// `rep movsb`, which on some CPUs runs an order of magnitude slower when
/// source and destination are not co-aligned on 64 bytes (see
/// docs/benchmarks/2026-11-30-streaming-hand-off.md). A ring position and
/// an application buffer are co-aligned only by chance (one odd-sized
/// message shifts every later one), so such copies go in pieces that stay
/// on memcpy's vector loop, which is fast for any alignment.
///
/// # Safety
/// As `ptr::copy_nonoverlapping(src, dst, n)`.
pub unsafe fn copy_bytes(dst: *mut u8, src: *const u8, n: usize) {
    if n <= PIECE || (dst as usize).wrapping_sub(src as usize) % 64 == 0 {
        // SAFETY: caller contract.
        unsafe { ptr::copy_nonoverlapping(src, dst, n) };
        return;
    }
    let mut off = 0;
    while off < n {
        let k = (n - off).min(PIECE);
        // SAFETY: [off, off + k) lies inside both ranges (caller contract).
        unsafe { ptr::copy_nonoverlapping(src.add(off), dst.add(off), k) };
        off += k;
    }
}

/// How a bulk copy into a ring stores its lines (see the module comment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BulkStores {
    /// Every line streamed (non-temporal).
    Streaming,
    /// Every other group of `MIXED_GROUP` lines streamed, the others
    /// stored normally.
    Mixed,
}

impl BulkStores {
    fn other(self) -> BulkStores {
        match self {
            BulkStores::Streaming => BulkStores::Mixed,
            BulkStores::Mixed => BulkStores::Streaming,
        }
    }
}

/// The tuner compares the writer's cost per byte over windows of this many
/// bytes of bulk copies: the copies themselves plus the time the writer
/// waited for the reader to free room (back-pressure).
const WINDOW: u64 = 1 << 20;
/// One wait for room counts at most this long (TSC cycles, ~0.2 ms): a
/// reader stalled that long is busy elsewhere, whichever way was used.
const PAUSE_CAP: u64 = 500_000;
/// Windows between explorations: the first after this many, doubling after
/// each exploration that did not pay, up to `MAX_GAP` (1 GiB).
const MIN_GAP: u32 = 64;
const MAX_GAP: u32 = 1024;
/// Windows before the first exploration (the first pass over a fresh ring
/// takes page faults; its window only sets the baseline).
const FIRST_GAP: u32 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Using the current way; explore after this many more windows.
    Settled(u32),
    /// Trying the other way: the first window (the ring's switch-over) is
    /// not measured, the second is compared with the baseline.
    Trying { measured: bool },
}

/// Per ring: which way bulk copies store, chosen by what the writer
/// observes end to end. Copy time alone would mislead: streamed lines cost
/// the writer little and the reader a trip to memory, and a mixed copy
/// right after streaming pays for fetching lines no cache holds. So the
/// tuner times windows of `WINDOW` bytes: the copies, plus the time between
/// a write that found the ring full and the next copy (the reader's pace,
/// capped); the time after a complete write is the application's own and
/// does not count, so a bursty writer is judged on its bursts. Now and
/// then it runs two windows the other way; a clear gain (> 13%) switches.
#[derive(Debug)]
pub(crate) struct CopyTuner {
    current: BulkStores,
    phase: Phase,
    /// Windows between explorations now.
    gap: u32,
    /// Cycles per KiB of the last window before an exploration.
    baseline: u64,
    window_cycles: u64,
    window_bytes: u64,
    /// TSC at the end of the last bulk copy (0: none yet).
    last_end: u64,
    /// The last write stopped at a full ring: the time until the next copy
    /// is back-pressure.
    blocked: bool,
}

impl CopyTuner {
    /// Starts streaming: the way that is never slow on this VM.
    pub(crate) const fn new() -> CopyTuner {
        CopyTuner {
            current: BulkStores::Streaming,
            phase: Phase::Settled(FIRST_GAP),
            gap: MIN_GAP,
            baseline: 0,
            window_cycles: 0,
            window_bytes: 0,
            last_end: 0,
            blocked: false,
        }
    }

    /// The producer's write stopped because the ring was full: until the
    /// next copy, the writer waits for the reader.
    pub(crate) fn ring_full(&mut self) {
        self.blocked = true;
    }

    /// Accounts one bulk copy of `n` bytes that ran from TSC `start` to `end`.
    fn copied(&mut self, start: u64, end: u64, n: usize) {
        let pause = match (self.last_end, self.blocked) {
            (0, _) | (_, false) => 0,
            (last, true) => start.saturating_sub(last).min(PAUSE_CAP),
        };
        (self.last_end, self.blocked) = (end, false);
        self.window_cycles += pause + end.saturating_sub(start);
        self.window_bytes += n as u64;
        if self.window_bytes >= WINDOW {
            let cost = (self.window_cycles * 1024 / self.window_bytes).max(1);
            (self.window_cycles, self.window_bytes) = (0, 0);
            self.window_done(cost);
        }
    }

    /// The state machine, one step per finished window of cost `cost`
    /// (cycles per KiB).
    fn window_done(&mut self, cost: u64) {
        self.phase = match self.phase {
            Phase::Settled(0) => {
                self.baseline = cost;
                self.current = self.current.other();
                Phase::Trying { measured: false }
            }
            Phase::Settled(left) => {
                self.baseline = cost;
                Phase::Settled(left - 1)
            }
            Phase::Trying { measured: false } => Phase::Trying { measured: true },
            Phase::Trying { measured: true } => {
                if cost * 100 < self.baseline * 87 {
                    self.gap = MIN_GAP; // the other way pays: it is current now
                } else {
                    self.current = self.current.other();
                    self.gap = (self.gap * 2).min(MAX_GAP);
                }
                Phase::Settled(self.gap)
            }
        };
    }
}

/// Copies `n` bytes into ring memory: streaming stores for bulk (see the
/// module comment), `copy_bytes` otherwise. A copy that streamed ends with
/// `sfence`, so a later `tail` store cannot publish the bytes before they
/// are visible.
///
/// # Safety
/// As `ptr::copy_nonoverlapping(src, dst, n)`.
pub(crate) unsafe fn copy_to_ring(dst: *mut u8, src: *const u8, n: usize, tuner: &mut CopyTuner) {
    #[cfg(target_arch = "x86_64")]
    if n >= STREAMING_MIN && streaming_stores() {
        let start = tsc();
        // SAFETY: caller contract.
        unsafe { stream_copy(dst, src, n, tuner.current) };
        store_fence();
        tuner.copied(start, tsc(), n);
        return;
    }
    let _ = tuner;
    // SAFETY: caller contract.
    unsafe { copy_bytes(dst, src, n) };
}

#[cfg(target_arch = "x86_64")]
fn tsc() -> u64 {
    // SAFETY: rdtsc has no preconditions; x86-64 always has it.
    unsafe { std::arch::x86_64::_rdtsc() }
}

/// Orders earlier streaming stores before every later store (`sfence`).
fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no preconditions (SSE, part of x86-64's baseline).
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// Head and tail with ordinary stores, the 64-byte-aligned middle of the
/// destination line by line: streamed (16-byte streaming stores, unaligned
/// loads), or for `Mixed` every other group of `MIXED_GROUP` lines stored
/// normally.
///
/// # Safety
/// As `ptr::copy_nonoverlapping(src, dst, n)`.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(dst: *mut u8, src: *const u8, n: usize, way: BulkStores) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    let lead = (dst as usize).wrapping_neg() & 63;
    if n < lead + 64 {
        // SAFETY: caller contract.
        unsafe { ptr::copy_nonoverlapping(src, dst, n) };
        return;
    }
    let lines = (n - lead) / 64;
    let mixed = way == BulkStores::Mixed;
    // SAFETY: every offset below stays inside [0, n) of both ranges (caller
    // contract); `dst + lead` is 64-byte aligned, so each streaming store's
    // 16-byte destination is aligned as `_mm_stream_si128` requires; loads
    // are unaligned (`loadu`). SSE2 is part of x86-64's baseline.
    unsafe {
        ptr::copy_nonoverlapping(src, dst, lead);
        let (d, s) = (dst.add(lead), src.add(lead));
        for i in 0..lines {
            let o = i * 64;
            if mixed && (i / MIXED_GROUP) % 2 == 1 {
                ptr::copy_nonoverlapping(s.add(o), d.add(o), 64);
                continue;
            }
            let a = _mm_loadu_si128(s.add(o) as *const __m128i);
            let b = _mm_loadu_si128(s.add(o + 16) as *const __m128i);
            let c = _mm_loadu_si128(s.add(o + 32) as *const __m128i);
            let e = _mm_loadu_si128(s.add(o + 48) as *const __m128i);
            _mm_stream_si128(d.add(o) as *mut __m128i, a);
            _mm_stream_si128(d.add(o + 16) as *mut __m128i, b);
            _mm_stream_si128(d.add(o + 32) as *mut __m128i, c);
            _mm_stream_si128(d.add(o + 48) as *mut __m128i, e);
        }
        let done = lead + lines * 64;
        ptr::copy_nonoverlapping(src.add(done), dst.add(done), n - done);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every length and both misalignments around the streaming threshold
    /// and the 64-byte line: the bytes arrive exactly, nothing outside the
    /// destination range is touched.
    #[test]
    fn ring_copies_are_exact_for_any_alignment_and_length() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        for &n in &[0, 1, 63, 64, 65, 127, 4095, 4096, 4097, 4159, 8191, 16_384] {
            for dst_off in [0usize, 1, 15, 16, 63] {
                for src_off in [0usize, 3, 64] {
                    let mut dst = vec![0xEEu8; n + 256];
                    let at = 64 + dst_off;
                    // SAFETY: both ranges lie inside their vectors.
                    unsafe {
                        copy_to_ring(
                            dst.as_mut_ptr().add(at),
                            src.as_ptr().add(src_off),
                            n,
                            &mut CopyTuner::new(),
                        )
                    };
                    check(&dst, at, &src[src_off..src_off + n]);
                    #[cfg(all(target_arch = "x86_64", not(miri)))]
                    for way in [BulkStores::Streaming, BulkStores::Mixed] {
                        let mut dst = vec![0xEEu8; n + 256];
                        let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
                        // SAFETY: as above.
                        unsafe { stream_copy(d.add(at), s.add(src_off), n, way) };
                        store_fence();
                        check(&dst, at, &src[src_off..src_off + n]);
                    }
                }
            }
        }
    }

    fn check(dst: &[u8], at: usize, want: &[u8]) {
        let n = want.len();
        assert_eq!(&dst[at..at + n], want, "n {n} at {at}");
        assert!(dst[..at].iter().all(|&b| b == 0xEE), "before the range");
        assert!(dst[at + n..].iter().all(|&b| b == 0xEE), "after the range");
    }

    /// The only test that flips the switch (the other copies' results do
    /// not depend on it, only their speed). A bulk copy that streams is
    /// accounted by the tuner, one that does not never is.
    #[test]
    fn streaming_is_on_by_default_for_bulk_and_can_be_turned_off() {
        let src = vec![5u8; 8192];
        let mut dst = vec![0u8; 8192];
        let copy = |dst: &mut [u8], n: usize| {
            let mut tuner = CopyTuner::new();
            // SAFETY: both ranges hold at least n bytes.
            unsafe { copy_to_ring(dst.as_mut_ptr(), src.as_ptr(), n, &mut tuner) };
            tuner.window_bytes
        };
        let on = u64::from(cfg!(all(target_arch = "x86_64", not(miri))));
        assert_eq!(copy(&mut dst, 8192), 8192 * on);
        assert_eq!(
            copy(&mut dst, STREAMING_MIN - 1),
            0,
            "small copies: ordinary stores"
        );
        set_streaming_stores(false);
        let off = copy(&mut dst, 8192);
        set_streaming_stores(true);
        assert_eq!(off, 0);
        assert_eq!(dst, src);
    }

    /// A simulated writer: 64 KiB copies back to back; `cost` gives, for
    /// the way in use, the copy's cycles per KiB and the cycles per KiB the
    /// writer then waits for room (the reader's pace; 0: never full).
    struct Sim {
        clock: u64,
        tuner: CopyTuner,
    }

    impl Sim {
        fn run(
            &mut self,
            windows: u64,
            cost: impl Fn(BulkStores) -> (u64, u64),
        ) -> Vec<BulkStores> {
            let mut ways = Vec::new();
            for _ in 0..windows * (WINDOW / (64 << 10)) {
                let way = self.tuner.current;
                ways.push(way);
                let (copy, wait) = cost(way);
                let start = self.clock;
                self.clock += copy * 64;
                self.tuner.copied(start, self.clock, 64 << 10);
                if wait > 0 {
                    self.tuner.ring_full();
                    self.clock += wait * 64;
                }
            }
            ways
        }

        fn new() -> Sim {
            Sim {
                clock: 1,
                tuner: CopyTuner::new(),
            }
        }
    }

    /// Close together: streaming is cheap for the writer, but the reader
    /// (reading memory) holds it back; mixed is dearer to copy and faster
    /// end to end.
    fn close(way: BulkStores) -> (u64, u64) {
        match way {
            BulkStores::Streaming => (40, 60),
            BulkStores::Mixed => (55, 5),
        }
    }

    /// Far apart: mixed stalls the writer's copy on every take-over.
    fn far(way: BulkStores) -> (u64, u64) {
        match way {
            BulkStores::Streaming => (40, 60),
            BulkStores::Mixed => (800, 0),
        }
    }

    #[test]
    fn the_tuner_finds_the_cheaper_way_and_follows_a_change() {
        let mut sim = Sim::new();
        assert_eq!(sim.tuner.current, BulkStores::Streaming);
        // Close: mixed is tried after the first windows and kept (its
        // copies cost more; the waits for room it saves count).
        sim.run(u64::from(FIRST_GAP) + 3, close);
        assert_eq!(sim.tuner.current, BulkStores::Mixed);
        // Explorations of streaming fail and back off (gap doubles).
        let ways = sim.run(u64::from(MIN_GAP) * 8, close);
        let tries = ways.windows(2).filter(|w| w[0] != w[1]).count() / 2;
        assert!((2..=4).contains(&tries), "explored {tries} times");
        assert_eq!(sim.tuner.current, BulkStores::Mixed);
        assert!(sim.tuner.gap > MIN_GAP);
        // The vCPUs move apart: mixed is 8x dearer; the next exploration
        // finds streaming cheaper and keeps it.
        sim.run(u64::from(sim.tuner.gap) + 3, far);
        assert_eq!(sim.tuner.current, BulkStores::Streaming);
        assert_eq!(sim.tuner.gap, MIN_GAP);
        let ways = sim.run(u64::from(MIN_GAP) * 4, far);
        let mixed = ways.iter().filter(|w| **w == BulkStores::Mixed).count();
        assert!(
            mixed * 10 < ways.len(),
            "far apart, mostly streaming: {mixed}/{}",
            ways.len()
        );
    }

    /// A writer that pauses between complete writes (a training step's
    /// compute) is judged on its copies: the pauses never count, so a pause
    /// before an exploration cannot make the dearer way look cheaper.
    #[test]
    fn the_applications_own_pauses_do_not_count() {
        let mut sim = Sim::new();
        sim.run(u64::from(FIRST_GAP), far);
        // Complete writes (no ring_full) with seconds of compute between.
        for _ in 0..(WINDOW / (64 << 10)) {
            let start = sim.clock;
            sim.clock += 40 * 64;
            sim.tuner.copied(start, sim.clock, 64 << 10);
            sim.clock += 10_000_000_000;
        }
        sim.run(2, far);
        assert_eq!(sim.tuner.current, BulkStores::Streaming);
        assert_eq!(sim.tuner.gap, MIN_GAP * 2, "the exploration did not pay");
    }

    /// A wait for room counts, but capped: one reader stall of seconds
    /// (busy elsewhere) weighs as much as ~0.2 ms.
    #[test]
    fn one_long_wait_for_room_is_capped() {
        let mut t = CopyTuner::new();
        t.copied(1, 1001, 64 << 10);
        t.ring_full();
        t.copied(10_000_000_000, 10_000_001_000, 64 << 10);
        assert_eq!(t.window_cycles, 2000 + PAUSE_CAP);
        // A pause after a complete write does not count at all.
        t.copied(20_000_000_000, 20_000_001_000, 64 << 10);
        assert_eq!(t.window_cycles, 3000 + PAUSE_CAP);
    }
}
