//! The ring against a hostile peer: every shared word is scribbled with
//! extreme, backwards, far-ahead and random values while the victim end
//! reads, peeks, writes and polls. The region sits between guard pages
//! (see `region`), so an access past the mapping faults the test; a read
//! that ran past ring 0 into ring 1 would return ring 1's marker bytes.

use super::tests::Rng;
use super::*;

const RING: usize = 4096;

/// Offsets (in the region) of every word the peer can write: per ring the
/// two positions (u64) and the flag words (u32, and `writer_need` u64).
fn words() -> Vec<(usize, bool)> {
    let mut w = vec![(ATTACH_OFFSET, false), (FIXED_OFFSET, false)];
    for ctl in CTL_OFFSET {
        w.push((ctl, true)); // tail
        w.push((ctl + 8, true)); // capacity
        w.push((ctl + 128, true)); // head
        for f in 0..6 {
            w.push((ctl + 256 + 4 * f, false)); // waiting, closed, futex words
        }
        w.push((ctl + 256 + 24, true)); // writer_need
    }
    w
}

/// A hostile value for a word now holding `cur`.
fn hostile(rng: &mut Rng, cur: u64, wide: bool) -> u64 {
    let max = if wide { u64::MAX } else { u32::MAX as u64 };
    let v = match rng.below(10) {
        9 => 1u64 << rng.below(40), // capacities: valid or not
        0 => max,
        1 => 0,
        2 => cur.wrapping_sub(1),
        3 => cur.wrapping_sub(1 + rng.below(2 * RING) as u64),
        4 => cur.wrapping_add(1 << 20),
        5 => cur.wrapping_add(RING as u64 + 1),
        6 => cur.wrapping_add(1 + rng.below(RING) as u64),
        7 => rng.below(4) as u64,
        _ => rng.next(),
    };
    v & max
}

/// Writes `v` into the word at `off` of the region, as the peer would.
fn scribble(region: &Region, off: usize, wide: bool, v: u64) {
    // SAFETY: `off` is one of `words()`, inside the header page, aligned
    // for its width; the peer's writes are atomic stores like these.
    unsafe {
        let p = region.base().add(off);
        if wide {
            (*(p as *const AtomicU64)).store(v, Ordering::Release);
        } else {
            (*(p as *const AtomicU32)).store(v as u32, Ordering::Release);
        }
    }
}

fn read_word(region: &Region, off: usize, wide: bool) -> u64 {
    // SAFETY: as in `scribble`.
    unsafe {
        let p = region.base().add(off);
        if wide {
            (*(p as *const AtomicU64)).load(Ordering::Acquire)
        } else {
            (*(p as *const AtomicU32)).load(Ordering::Acquire) as u64
        }
    }
}

/// Bytes the attacker sends are below 0x80; bytes the victim sends have the
/// top bit set: a victim read returning a byte >= 0x80 read past ring 0.
fn attacker_byte(i: usize) -> u8 {
    (i % 0x80) as u8
}

/// The attacker's and the victim's mappings of one channel memfd (two
/// processes in real life: each has its own broken flag).
fn two_mappings() -> (Arc<Region>, Arc<Region>) {
    two_mappings_of(RING)
}

fn two_mappings_of(ring: usize) -> (Arc<Region>, Arc<Region>) {
    let len = region_len_for(ring);
    Region::twin_mappings(len, false).unwrap()
}

/// One episode: a fresh region, an honest-looking start, then a mix of
/// scribbles, honest peer steps and victim steps. Returns whether the
/// victim found a violation.
fn episode(seed: u64, steps: usize) -> bool {
    episode_of(seed, steps, RING)
}

/// An episode on rings of `ring` bytes; above `MIN_RING_SIZE` both ends
/// start small and grow (capacity words in play).
fn episode_of(seed: u64, steps: usize, ring: usize) -> bool {
    let mut rng = Rng(seed | 1);
    let (attacker, region) = two_mappings_of(ring);
    let (mut ptx, mut prx) = attacker.endpoints(Side::Client); // the attacker's own ends
    let (mut vtx, mut vrx) = region.endpoints(Side::Server); // the victim
    ptx.start_small(MIN_RING_SIZE);
    vtx.start_small(MIN_RING_SIZE);
    let vprobe = region.probe(Side::Server);
    let words = words();
    // Under miri each byte costs: buffers just over three rings.
    let len = super::tests::under_miri(70_000.max(3 * ring + 1), 3 * ring + 1);
    let mut big = vec![0u8; len];
    let out: Vec<u8> = (0..len).map(|i| 0x80 | (i % 0x80) as u8).collect();
    // The attacker's stream repeats every 0x80 bytes: its writes are slices
    // of this, not bytes made one by one (each costs under miri).
    let attacker_stream: Vec<u8> = (0..3 * ring + 0x80).map(attacker_byte).collect();
    let mut sent = 0usize;
    for _ in 0..steps {
        match rng.below(10) {
            0 | 1 => {
                let (off, wide) = words[rng.below(words.len())];
                let v = hostile(&mut rng, read_word(&attacker, off, wide), wide);
                scribble(&attacker, off, wide, v);
            }
            2 => {
                // The attacker's library-like steps (they may also trip on
                // its own scribbles; that is its problem).
                let n = rng.below(3 * ring);
                let from = sent % 0x80;
                sent += ptx.write(&attacker_stream[from..from + n]);
                let _ = ptx.take_reader_wakeup();
                let _ = prx.read(&mut big[..rng.below(3 * ring)]);
            }
            3 => {
                let want = rng.below(big.len());
                let n = vrx.read(&mut big[..want]);
                assert!(n <= want.min(ring), "read {n} of {want}");
                assert!(big[..n].iter().all(|b| *b < 0x80), "read past ring 0");
                let _ = vrx.take_writer_wakeup();
            }
            4 => {
                let want = rng.below(big.len());
                let n = vrx.peek(&mut big[..want]);
                assert!(n <= want.min(ring), "peek {n} of {want}");
                assert!(big[..n].iter().all(|b| *b < 0x80), "peek past ring 0");
            }
            5 => {
                let (a, b) = big.split_at_mut(rng.below(len / 2));
                let (la, lb) = (a.len(), b.len());
                let mut bufs = [&mut a[..], &mut b[..]];
                let n = vrx.read_vectored(&mut bufs);
                assert!(n <= (la + lb).min(ring));
            }
            6 => {
                let want = rng.below(out.len());
                let n = vtx.write(&out[..want]);
                assert!(n <= want.min(ring), "write {n} of {want}");
                let _ = vtx.take_reader_wakeup();
            }
            7 => {
                let max = rng.below(3 * ring);
                let n = vtx.write_with(max, |dst| {
                    assert!(dst.len() <= ring && dst.len() <= max);
                    dst.fill(0x81);
                    dst.len()
                });
                assert!(n <= max.min(ring));
            }
            8 => {
                assert!(vtx.free() <= ring);
                assert!(vrx.available() <= ring);
                assert!(vprobe.tx_free() <= ring);
                if let ReadState::Data(n) = vprobe.rx_state() {
                    assert!(n <= ring);
                }
                let _ = vprobe.attach_state();
                let _ = vrx.state();
            }
            _ => {
                vrx.consume(rng.below(2 * ring));
                let _ = vtx.tail();
                let _ = vrx.head();
                let _ = vrx.tail();
                let _ = vtx.commit(rng.below(2 * ring));
            }
        }
        if region.is_broken() {
            // Once broken, stays broken, and nothing moves.
            assert_eq!(vrx.state(), ReadState::Broken);
            assert_eq!(vprobe.rx_state(), ReadState::Broken);
            assert_eq!(vrx.read(&mut big[..100]), 0);
            assert_eq!(vrx.peek(&mut big[..100]), 0);
            assert_eq!(vtx.write(&out[..100]), 0);
            assert_eq!(vtx.free(), 0);
            assert_eq!(vprobe.tx_free(), 0);
            assert!(vtx.peer_gone() && vprobe.tx_peer_gone());
            assert!(!vtx.commit(1));
        }
    }
    region.is_broken()
}

#[test]
fn scribbled_control_words_never_move_an_access_outside_the_ring() {
    let mut broken = 0;
    let episodes = super::tests::under_miri(3000, 8);
    for seed in 0..episodes {
        broken += episode(seed, 60) as u32;
    }
    // Most episodes must reach a violation, or the scribbles were too timid
    // to test anything; some must not (harmless words: futex words, need).
    assert!(broken > episodes as u32 / 2, "{broken} of {episodes} broke");
    // Under miri (a few episodes, for undefined behaviour) every one may
    // break: the first seeds all do.
    assert!(
        cfg!(miri) || broken < episodes as u32,
        "every episode broke"
    );
}

/// The same on rings that start small and grow: capacity words that are
/// valid, stale or invented never move an access outside the ring.
#[test]
fn scribbled_capacity_words_never_move_an_access_outside_the_ring() {
    let mut broken = 0;
    let episodes = super::tests::under_miri(1500, 2);
    for seed in 0..episodes {
        // Under miri two sizes: start at MIN_RING_SIZE, grow once.
        let ring = super::tests::under_miri(64 << 10, 2 * MIN_RING_SIZE);
        broken += episode_of(seed, 80, ring) as u32;
    }
    assert!(broken > episodes as u32 / 2, "{broken} of {episodes} broke");
    // Under miri (a few episodes, for undefined behaviour) every one may
    // break: the first seeds all do.
    assert!(
        cfg!(miri) || broken < episodes as u32,
        "every episode broke"
    );
}

/// Each bad capacity or fixed word is found by the end that reads it: the
/// consumer for its producer's capacity word, the producer for its own
/// (the peer may scribble it too), the growing producer for the fixed
/// word. A capacity that is not a power of two, below the minimum, or
/// beyond the mapped ring resets the connection; it never indexes.
#[test]
fn bad_capacity_words_are_violations() {
    const BIG: usize = 64 << 10;
    let c2s = CTL_OFFSET[0] + 8; // the attacker's (client's) producer ring
    let s2c = CTL_OFFSET[1] + 8; // the victim's own producer ring
    let cases: [(&str, usize, bool, u64); 8] = [
        ("capacity not a power of two", c2s, true, 12 << 10),
        ("capacity below the minimum", c2s, true, 2048),
        ("capacity of one byte", c2s, true, 1),
        ("capacity beyond the mapped ring", c2s, true, 2 * BIG as u64),
        ("capacity at the top bit", c2s, true, 1 << 63),
        ("own capacity not a power of two", s2c, true, 40_000),
        ("own capacity beyond the mapped ring", s2c, true, 1 << 40),
        ("fixed word out of its set", FIXED_OFFSET, false, 2),
    ];
    for (what, off, wide, value) in cases {
        let (attacker, region) = two_mappings_of(BIG);
        let (mut ctx, _) = attacker.endpoints(Side::Client);
        let (mut stx, mut srx) = region.endpoints(Side::Server);
        ctx.start_small(4096);
        stx.start_small(4096);
        let probe = region.probe(Side::Server);
        assert_eq!(ctx.write(b"hello"), 5);
        let mut b = [0u8; 3];
        assert_eq!(srx.read(&mut b), 3);
        assert_eq!(stx.write(b"abc"), 3);
        let _ = ctx.take_reader_wakeup();
        // The victim's ring empties and wants to grow: it reads the fixed
        // word at its next write.
        let mut cb = [0u8; 8];
        let (_, mut crx) = attacker.endpoints(Side::Client);
        assert_eq!(crx.read(&mut cb), 3);
        scribble(&attacker, off, wide, value);
        let _ = srx.state();
        let _ = srx.read(&mut [0u8; 64]);
        let _ = stx.free();
        let _ = stx.write(&[0x80u8; 9000]);
        let _ = (probe.rx_state(), probe.tx_free());
        assert!(region.is_broken(), "{what}: not detected");
        assert_eq!(srx.state(), ReadState::Broken, "{what}");
        assert_eq!(stx.write(b"x"), 0, "{what}");
    }
    // Valid words are not violations: 0 (the whole ring), the minimum,
    // the mapped size, and the fixed word's two values.
    for (off, wide, value) in [
        (c2s, true, 0),
        (c2s, true, 4096),
        (c2s, true, BIG as u64),
        (FIXED_OFFSET, false, 1),
        (FIXED_OFFSET, false, 0),
    ] {
        let (attacker, region) = two_mappings_of(BIG);
        let (mut ctx, _) = attacker.endpoints(Side::Client);
        let (mut stx, mut srx) = region.endpoints(Side::Server);
        stx.start_small(4096);
        assert_eq!(ctx.write(b"hello"), 5);
        let mut b = [0u8; 8];
        assert_eq!(srx.read(&mut b), 5);
        scribble(&attacker, off, wide, value);
        let _ = (srx.state(), srx.read(&mut b), stx.write(&[0x80u8; 9000]));
        assert!(!region.is_broken(), "word {off} = {value}");
    }
}

/// Each kind of bad value is found, by the end that reads it.
#[test]
fn each_violation_is_detected() {
    let c2s = CTL_OFFSET[0];
    let s2c = CTL_OFFSET[1];
    let cases: [(&str, usize, bool, u64); 9] = [
        (
            "tail far ahead (the issue's attack)",
            c2s,
            true,
            5 + (1 << 20),
        ),
        ("head beyond the tail", s2c + 128, true, 1 << 20),
        ("tail moved backwards", c2s, true, 2),
        ("own head moved backwards", c2s + 128, true, 1),
        ("closed flag out of its set", c2s + 256 + 8, false, 7),
        (
            "consumer flag out of its set",
            s2c + 256 + 12,
            false,
            0xdead,
        ),
        ("waiting word with unknown bits", s2c + 256, false, 0x10),
        ("attach word out of its set", ATTACH_OFFSET, false, 9),
        ("own head wrapped to the top", c2s + 128, true, u64::MAX),
    ];
    for (what, off, wide, value) in cases {
        let (attacker, region) = two_mappings();
        let (mut ctx, _) = attacker.endpoints(Side::Client);
        let (mut stx, mut srx) = region.endpoints(Side::Server);
        let probe = region.probe(Side::Server);
        assert_eq!(ctx.write(b"hello"), 5);
        let mut b = [0u8; 3];
        assert_eq!(srx.read(&mut b), 3);
        assert_eq!(stx.write(b"abc"), 3);
        let _ = ctx.take_reader_wakeup();
        scribble(&attacker, off, wide, value);
        // The victim (server) does what the library does on a connection.
        let _ = srx.state();
        let _ = srx.read(&mut [0u8; 64]);
        let _ = srx.state();
        let _ = stx.free();
        let _ = stx.write(b"xyz");
        let _ = stx.take_reader_wakeup();
        let _ = stx.peer_gone();
        let _ = (probe.rx_state(), probe.tx_free(), probe.tx_peer_gone());
        let _ = probe.attach_state();
        assert!(region.is_broken(), "{what}: not detected");
        assert_eq!(srx.state(), ReadState::Broken, "{what}");
    }
}

/// The values a healthy peer writes never count as violations, including
/// futex words at any value and any `writer_need`.
#[test]
fn harmless_words_are_not_violations() {
    let region = Region::anonymous(region_len_for(RING)).unwrap();
    let (mut ctx, _) = region.endpoints(Side::Client);
    let (_, mut srx) = region.endpoints(Side::Server);
    for (off, v) in [
        (CTL_OFFSET[0] + 256 + 16, u32::MAX as u64), // data_seq
        (CTL_OFFSET[0] + 256 + 20, 12345),           // room_seq
    ] {
        scribble(&region, off, false, v);
    }
    scribble(&region, CTL_OFFSET[0] + 256 + 24, true, u64::MAX); // writer_need
    assert_eq!(ctx.write(&[1u8; 3000]), 3000);
    let mut b = vec![0u8; 4096];
    assert_eq!(srx.read(&mut b), 3000);
    let _ = srx.take_writer_wakeup();
    assert!(!region.is_broken());
}

/// The guard pages: an access just before or just after the mapping
/// faults (in a forked child, so the test sees the signal).
#[test]
#[cfg_attr(miri, ignore = "needs fork and guard pages (mmap)")]
fn the_mapping_sits_between_guard_pages() {
    let len = region_len_for(RING);
    let region = Region::anonymous(len).unwrap();
    for at in [-1isize, len as isize] {
        // SAFETY: fork in a test; the child only reads one byte and exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: deliberately out of bounds: the guard page must fault
            // before `_exit(0)` runs.
            unsafe {
                std::ptr::read_volatile(region.base().offset(at));
                libc::_exit(0);
            }
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(
            libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSEGV,
            "offset {at}: status {status:#x}"
        );
    }
}
