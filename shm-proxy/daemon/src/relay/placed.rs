//! Zero copy across nodes: the NIC moves a pod's bytes straight from its
//! sending ring (in this daemon's mapping of the pod's channel) into the
//! remote pod's receiving ring, over a transport with
//! [`LaneStream::direct`](flowlane_rdma::LaneStream::direct) (RDMA WRITE).
//!
//! ```text
//! pod A ring --(RDMA WRITE, no CPU copy)--> pod B ring
//!   daemon 1: PLACED(n) on the stream, behind the write   -> daemon 2 publishes tail += n
//!   daemon 1 <- ROOM(head) when pod B consumed a quarter ring <- daemon 2
//!   daemon 1: pod A's head += n when the write completed (the NIC has the bytes)
//! ```
//!
//! - Set-up: each daemon registers its pod's two ring data areas and sends
//!   `RING` (its receiving ring's description, and whether it can place)
//!   as its first frame; a direction places iff its receiver offered a ring
//!   and its sender can place, else it copies (`DATA`) as before.
//! - Positions: both rings of a direction start empty, so the stream
//!   position `p` is the local ring's `head0 + p` and the remote ring's `p`;
//!   the two rings may differ in size (the client chose its own), so a
//!   transfer is cut at both wraps.
//! - Credits: the sender may place up to the remote ring's size beyond the
//!   last `ROOM`; the receiving daemon (the remote ring's producer) sleeps on
//!   the ring's room futex and reports the pod's consumption.
//! - The receiving daemon checks every `PLACED` against the ring's free room
//!   (and, with transport checksums on, the CRC-32 of the bytes) before it
//!   publishes: a peer that overruns fails the connection, never a pod's data.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use flowlane_lane::ring::{Consumer, Probe, Producer};
use flowlane_rdma::transport::wire::crc32_parts;
use flowlane_rdma::{DirectLane, Piece, RingArea};

use super::carried::{lock, Carried, SendTurn, SLICE_MS};
use super::frames;
use super::wait_trace::{ReceiverTrace, SenderTrace, Want};

/// Largest transfer announced by one PLACED frame (a quarter of the default
/// ring: several are in flight while the first completes).
const MAX_PLACE: usize = 256 << 10;

/// A connection's zero-copy state (both directions).
pub(super) struct DirectState {
    /// We registered our pod's rings: we offer our receiving ring and can
    /// place from our sending ring.
    registered: bool,
    desc: Vec<u8>,
    /// The peer's RING frame decided the outgoing direction: `Some(size)`
    /// of the peer's ring when we place, `None` when we copy.
    out: OnceLock<Option<usize>>,
    /// The peer places into our pod's receiving ring.
    in_placed: AtomicBool,
    /// Bytes of our placements the NIC completed (fed by the transport).
    placed_done: Arc<AtomicU64>,
    /// The remote pod's consumption (stream position), from ROOM frames.
    peer_head: AtomicU64,
    /// Ring positions of stream position 0: our pod's sending ring (head)
    /// and receiving ring (tail) when the connection was set up.
    tx_base: u64,
    rx_base: u64,
    checksums: bool,
    /// PLACED frames received, and how many of them needed a doorbell for
    /// our pod (its reader asleep in poll/select): for the wait trace.
    placed_frames: AtomicU64,
    placed_wakes: AtomicU64,
    /// Keeps the rings registered; dropped (with the Carried) before the
    /// region is unmapped.
    _guard: Mutex<Option<Box<dyn Send + Sync>>>,
}

impl DirectState {
    /// Registers the pod's rings with the transport. `to_pod`/`from_pod`
    /// are this daemon's ends; `probe` its view (for wake-ups).
    pub(super) fn register(
        id: u64,
        dl: &dyn DirectLane,
        to_pod: &mut Producer,
        from_pod: &mut Consumer,
        probe: Probe,
    ) -> DirectState {
        let placed_done = Arc::new(AtomicU64::new(0));
        let done = placed_done.clone();
        let on_placed = Box::new(move |n: u64| {
            done.fetch_add(n, Ordering::AcqRel);
            probe.wake_rx_waiter();
        });
        let src = RingArea {
            ptr: from_pod.data_ptr(),
            len: from_pod.capacity(),
        };
        let dst = RingArea {
            ptr: to_pod.data_ptr(),
            len: to_pod.capacity(),
        };
        // SAFETY: both areas lie in the Carried's region mapping, which is
        // dropped after this state (and so after the guard); past its tail
        // the pod's receiving ring is written only by the peer's placements
        // (this daemon, its only producer, copies into it only when the peer
        // does not place).
        let registered = unsafe { dl.register_rings(src, dst, on_placed) };
        let (registered, desc, guard) = match registered {
            Ok((desc, guard)) => (true, desc, Some(guard)),
            Err(e) => {
                tracing::warn!(id, error = %e, "relay: cannot register the pod's rings; this connection copies");
                (false, Vec::new(), None)
            }
        };
        DirectState {
            registered,
            desc,
            tx_base: from_pod.head(),
            rx_base: to_pod.tail(),
            out: OnceLock::new(),
            in_placed: AtomicBool::new(false),
            placed_done,
            peer_head: AtomicU64::new(0),
            checksums: dl.checksums(),
            placed_frames: AtomicU64::new(0),
            placed_wakes: AtomicU64::new(0),
            _guard: Mutex::new(guard),
        }
    }

    /// Our RING frame.
    pub(super) fn ring_frame(&self) -> Vec<u8> {
        frames::ring_frame(self.registered, &self.desc)
    }

    pub(super) fn in_placed(&self) -> bool {
        self.in_placed.load(Ordering::Acquire)
    }
}

/// CRC-32 of `len` ring bytes from position `pos`.
///
/// # Safety
/// `data` must be a ring data area of `size` bytes (a power of two) whose
/// bytes `[pos, pos + len)` nobody writes during the call.
unsafe fn ring_crc(data: *const u8, size: usize, pos: u64, len: usize) -> u32 {
    let off = (pos as usize) & (size - 1);
    let first = len.min(size - off);
    // SAFETY: both slices lie inside the area (caller contract).
    let (a, b) = unsafe {
        (
            std::slice::from_raw_parts(data.add(off), first),
            std::slice::from_raw_parts(data, len - first),
        )
    };
    crc32_parts(&[a, b])
}

impl Carried {
    /// The peer's RING frame: decides both directions' modes.
    pub(super) fn on_ring(self: &Arc<Self>, can_place: bool, desc: &[u8]) -> Result<(), String> {
        let (Some(d), Some(dl)) = (&self.direct, self.stream.direct()) else {
            return Err("RING frame over a copying transport".into());
        };
        let out = if d.registered && !desc.is_empty() {
            match dl.set_peer_ring(desc) {
                Ok(size) if size.is_power_of_two() => Some(size),
                Ok(size) => return Err(format!("peer ring of {size} bytes")),
                Err(e) => {
                    tracing::warn!(id = self.id, error = %e, "relay: cannot use the peer's ring; copying");
                    None
                }
            }
        } else {
            None
        };
        if d.out.set(out).is_err() {
            return Err("a second RING frame".into());
        }
        self.probe.wake_rx_waiter();
        if d.registered && can_place {
            d.in_placed.store(true, Ordering::Release);
            let c = self.clone();
            std::thread::Builder::new()
                .name(format!("relay-room-{}", self.id))
                .spawn(move || c.report_room())
                .map_err(|e| format!("spawning the room reporter: {e}"))?;
        }
        tracing::debug!(id = self.id, out = ?out, placed_in = d.in_placed(), "relay: zero-copy modes");
        Ok(())
    }

    /// The outgoing direction's mode, once the peer's RING arrived:
    /// `Some(Some(size))` place, `Some(None)` copy, `None` failed first.
    pub(super) fn out_mode(&self) -> Option<Option<usize>> {
        let Some(d) = &self.direct else {
            return Some(None);
        };
        loop {
            if let Some(m) = d.out.get() {
                return Some(*m);
            }
            if self.failed() {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The peer's ROOM frame.
    pub(super) fn on_room(&self, head: u64) {
        if let Some(d) = &self.direct {
            d.peer_head.fetch_max(head, Ordering::AcqRel);
            self.probe.wake_rx_waiter();
        }
    }

    /// A PLACED frame: the bytes are at our pod's ring's tail; check and
    /// publish them.
    pub(super) fn on_placed(&self, len: usize, crc: Option<u32>) -> Result<(), String> {
        if !self.direct.as_ref().is_some_and(|d| d.in_placed()) {
            return Err("PLACED frame, but no ring was offered to the peer".into());
        }
        let mut tx = lock(&self.to_pod);
        if tx.is_broken() {
            return Err(super::carried::BROKEN.into());
        }
        // The length is the peer daemon's word: checked against the free
        // room (our checked positions) before a byte is read.
        if len > tx.free() {
            return Err(format!(
                "the peer placed {len} bytes beyond the ring's free room"
            ));
        }
        if let Some(want) = crc {
            let tail = tx.tail();
            // SAFETY: len <= the free room <= the ring size, so the range is
            // inside the data area; the bytes past the tail belong to the
            // producer (us) until published; the peer wrote them before
            // this frame.
            let got = unsafe { ring_crc(tx.data_ptr(), tx.capacity(), tail, len) };
            if got != want {
                return Err(format!(
                    "placed bytes at stream position {tail}: CRC-32 {got:#010x}, the sender's {want:#010x}"
                ));
            }
        }
        if !tx.commit(len) {
            return Err(format!(
                "the peer placed {len} bytes beyond the ring's free room"
            ));
        }
        self.bytes_in.fetch_add(len as u64, Ordering::Relaxed);
        let wake = tx.take_reader_wakeup();
        drop(tx);
        // The room reporter's target depends on the tail: let it recompute.
        self.probe.wake_tx_waiter();
        if let Some(d) = &self.direct {
            d.placed_frames.fetch_add(1, Ordering::Relaxed);
            if wake {
                d.placed_wakes.fetch_add(1, Ordering::Relaxed);
            }
        }
        if wake {
            self.request_wake();
        }
        Ok(())
    }

    /// Receiving side: tells the peer how far our pod consumed, a quarter
    /// ring at a time, so its placements never overrun. Runs on its own thread until this direction ends.
    fn report_room(self: Arc<Self>) {
        let size = self.probe.tx_capacity() as u64;
        let base = self.direct.as_ref().map_or(0, |d| d.rx_base);
        let mut reported = 0u64;
        let mut trace = ReceiverTrace::new(SLICE_MS);
        loop {
            if self.failed()
                || self.sent_final.load(Ordering::Acquire)
                || self.got_eof.load(Ordering::Acquire)
                || self.sent_gone.load(Ordering::Acquire)
                || self.probe.tx_peer_gone()
            {
                // A pod that stopped reading needs no more reports, and its
                // ring's room wait would return at once from now on (it
                // spun until the sending pump's slice ended): hand the
                // GONE to the sending pump now, not after its slice.
                self.probe.wake_rx_waiter();
                if let Some(d) = &self.direct {
                    trace.log(
                        self.id,
                        d.placed_frames.load(Ordering::Relaxed),
                        d.placed_wakes.load(Ordering::Relaxed),
                    );
                }
                return;
            }
            let head = self.probe.tx_head().wrapping_sub(base);
            let tail = self.probe.tx_tail().wrapping_sub(base);
            // A quarter ring at a time: the sender can be short of room only
            // when it placed a whole ring since the last report, and then the
            // pod consuming a quarter of it triggers one. (Reporting every
            // consumption would add a message per message to a ping-pong.)
            if head - reported >= size / 4 {
                if let Err(e) = self.send_room(head) {
                    self.fail(&format!("lane send: {e}"));
                    return;
                }
                reported = head;
                trace.rooms += 1;
                continue;
            }
            // Free room at which the pod will have consumed a quarter ring
            // since the last report. With less than a quarter ring placed
            // since then, that is more than the ring's size: only a new
            // PLACED (which wakes us to recompute) can make a report due,
            // so we sleep until one. (Capping it at the ring's size made
            // an emptied ring satisfy the wait at once: the thread spun,
            // one busy CPU per connection; see
            // docs/benchmarks/2026-11-30-relay-zero-copy.md.)
            let need = size - (tail - reported).min(size) + size / 4;
            if self.probe.tx_tail().wrapping_sub(base) != tail {
                continue; // a placement landed meanwhile: recompute
            }
            let since = Instant::now();
            self.probe.wait_tx_free(need as usize, SLICE_MS);
            trace.waited(since);
        }
    }

    /// A ROOM frame, unless the peer needs none any more (it sent EOF: no
    /// more placements) or this side already ended the stream.
    fn send_room(&self, head: u64) -> std::io::Result<()> {
        let r = {
            let _g = lock(&self.send_lock);
            if self.sent_final.load(Ordering::Acquire) || self.got_eof.load(Ordering::Acquire) {
                return Ok(());
            }
            frames::send_all(&*self.stream, &frames::room_frame(head))
        };
        self.flush_wake();
        r
    }

    /// Pod's sending ring -> the remote pod's ring by placement.
    pub(super) fn pump_out_placing(&self, peer_size: usize) {
        let d = self
            .direct
            .as_ref()
            .expect("placing needs the direct state");
        let dl = self.stream.direct().expect("placing needs a direct lane");
        let mut rx = lock(&self.from_pod);
        let size = rx.capacity();
        let base = d.tx_base;
        // Stream positions: freed in the pod's ring, and handed to the NIC.
        let (mut consumed, mut posted) = (0u64, 0u64);
        let mut trace = SenderTrace::new(SLICE_MS);
        loop {
            if self.failed() || self.sent_final.load(Ordering::Acquire) {
                trace.log(self.id);
                return;
            }
            let seq = rx.data_seq();
            self.flush_wake();
            let done = d.placed_done.load(Ordering::Acquire);
            if done > consumed {
                trace.completed(done);
                rx.consume((done - consumed) as usize);
                consumed = done;
                if rx.take_writer_wakeup() {
                    self.request_wake();
                }
            }
            match self.gone_or_idle() {
                SendTurn::Stop => return,
                SendTurn::Again => continue,
                SendTurn::Forward => {}
            }
            // Checked: at most a ring beyond the pod's head, and the pod's
            // head is at least `base + consumed` (ours to move), so
            // `unposted` never exceeds the ring.
            let tail = rx.tail();
            let closed = rx.producer_closed();
            if rx.is_broken() {
                drop(rx);
                self.fail(super::carried::BROKEN);
                return;
            }
            let unposted = tail.wrapping_sub(base).saturating_sub(posted);
            if unposted > 0 {
                let peer_head = d.peer_head.load(Ordering::Acquire);
                let room = (peer_size as u64).saturating_sub(posted.saturating_sub(peer_head));
                if room > 0 {
                    let k = unposted.min(room).min(MAX_PLACE as u64) as usize;
                    let local = base.wrapping_add(posted);
                    let ps = Piece::split(local, size, posted, peer_size, k);
                    // SAFETY: [local, local + k) is published by the pod and
                    // not consumed by us yet, so nobody writes it.
                    let crc = d
                        .checksums
                        .then(|| unsafe { ring_crc(rx.data_ptr(), size, local, k) });
                    let notify = frames::placed_frame(k, crc);
                    let r = {
                        let _g = lock(&self.send_lock);
                        dl.place(&ps, &notify)
                    };
                    self.flush_wake();
                    if let Err(e) = r {
                        self.fail(&format!("lane place: {e}"));
                        return;
                    }
                    posted += k as u64;
                    trace.placed(posted, k, posted - consumed);
                    self.bytes_out.fetch_add(k as u64, Ordering::Relaxed);
                    continue;
                }
            } else if closed && consumed == posted {
                // Every byte placed and completed, and the pod closed.
                drop(rx);
                if !self.send_eof() {
                    return;
                }
                rx = lock(&self.from_pod);
                continue;
            }
            let want = if unposted > 0 {
                Want::Room
            } else if posted > consumed {
                Want::Completion
            } else {
                Want::Data
            };
            let since = Instant::now();
            rx.wait_change(seq, tail, closed, SLICE_MS);
            trace.waited(want, since);
            let drained = rx.tail().wrapping_sub(base) == consumed && posted == consumed;
            if drained && !rx.producer_closed() && self.pod_exited() {
                self.pod_killed();
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfers_are_cut_at_both_rings_wraps() {
        // No wrap.
        assert_eq!(
            Piece::split(0, 16, 0, 32, 10),
            vec![Piece {
                src: 0,
                dst: 0,
                len: 10
            }]
        );
        // Local wrap at 16, remote (32) not.
        assert_eq!(
            Piece::split(12, 16, 12, 32, 8),
            vec![
                Piece {
                    src: 12,
                    dst: 12,
                    len: 4
                },
                Piece {
                    src: 0,
                    dst: 16,
                    len: 4
                }
            ]
        );
        // Both wrap at different points: three pieces.
        let p = Piece::split(96 + 12, 16, 30, 32, 10);
        assert_eq!(p.iter().map(|p| p.len).sum::<usize>(), 10);
        let p: Vec<_> = p.iter().map(|p| (p.src, p.dst, p.len)).collect();
        assert_eq!(p, vec![(12, 30, 2), (14, 0, 2), (0, 2, 6)]);
    }
}
