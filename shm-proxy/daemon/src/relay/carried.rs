//! One pod connection carried across nodes: this daemon is the ring peer
//! of its local pod (it maps the channel like the other pod would on the
//! shared-memory lane) and pumps the pod's rings into and out of a lane
//! stream to the peer daemon.
//!
//! Two threads per connection, both blocking:
//! - `out`: pod's sending ring -> lane (DATA, then EOF); it also notices
//!   when the pod stops reading (GONE) and when its process died;
//! - `in`: lane -> pod's receiving ring, and the peer's control frames.
//!
//! Wake-ups (see docs/rdma.md, "Cross-node relay"): the daemon sleeps on the
//! region's futexes (`WAIT_FUTEX`), so the pod library wakes it with
//! `FUTEX_WAKE` and never sends a doorbell byte for it. A pod thread blocked
//! in read/write is woken by the daemon's futex wake. A pod thread asleep in
//! poll/epoll/select waits on its TCP socket, which only the REMOTE end can
//! make readable: the daemon sends WAKE, and the peer daemon writes one byte
//! on its dup of the remote pod's socket — which arrives on our pod's socket.
//!
//! End: the daemon keeps its dup of the pod's socket until both directions
//! are settled and the peer confirmed (FINAL) that all our bytes reached its
//! pod's ring. Only then can the kernel send the pod connection's FIN, so the
//! remote library never sees TCP end-of-stream before the ring's last byte.
//! Failures (lane reset, peer daemon gone, pod killed) reset the pod
//! connection for both pods (`os::abort_connection`): they see
//! `ECONNRESET` (or `EPIPE` on a write), like a TCP reset, never a clean
//! end-of-stream and never a hang.

use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use flowlane_lane::region::Region;
use flowlane_lane::ring::{Attach, Consumer, Probe, Producer, ReadState, Side};
use flowlane_rdma::{LaneStream, StreamKey};

use super::frames::{self, Frame, InBuf, DATA_HEADER, MAX_DATA};
use super::os;
use super::placed::DirectState;

/// Longest futex sleep of a pump; between slices it checks the pod's
/// process and the connection's state. Idle cost: a few wake-ups a second.
pub(super) const SLICE_MS: u32 = 100;

/// How long the server pod may take to attach to its region after its
/// claim was answered (it does so at once; longer means it fell back).
const ATTACH_GRACE: Duration = Duration::from_secs(3);

/// Why a connection ends when its pod wrote a ring word out of protocol.
pub(super) const BROKEN: &str = "the pod broke the ring protocol";

/// What a sending pump does after [`Carried::gone_or_idle`].
pub(super) enum SendTurn {
    /// Forward the pod's bytes.
    Forward,
    /// Start the turn again.
    Again,
    /// The connection failed: the pump ends.
    Stop,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub struct Carried {
    pub id: u64,
    pub key: StreamKey,
    /// The pod's ends as the daemon sees them: it produces into the pod's
    /// receiving ring and consumes the pod's sending ring.
    pub(super) to_pod: Mutex<Producer>,
    pub(super) from_pod: Mutex<Consumer>,
    pub(super) probe: Probe,
    /// Our reference to the pod's TCP socket (doorbells for the remote pod,
    /// and it holds the pod connection's FIN back until the relay is done).
    sock: OwnedFd,
    /// The pod process that holds the connection: the one that set it up,
    /// then a forked child that kept it (see `pod_exited`).
    pidfd: Mutex<Option<OwnedFd>>,
    pub(super) stream: Arc<dyn LaneStream>,
    /// The server daemon waits for its pod to attach.
    wait_attach: bool,
    pub(super) send_lock: Mutex<()>,
    wake_pending: AtomicBool,
    failed: AtomicBool,
    pub(super) sent_eof: AtomicBool,
    pub(super) sent_gone: AtomicBool,
    pub(super) got_eof: AtomicBool,
    pub(super) got_gone: AtomicBool,
    pub(super) sent_final: AtomicBool,
    got_final: AtomicBool,
    pub bytes_out: AtomicU64,
    pub bytes_in: AtomicU64,
    pub pumps_left: AtomicUsize,
    pub opened: Instant,
    /// Zero copy (`placed.rs`), over a transport that can place; its
    /// registration is dropped before the region.
    pub(super) direct: Option<DirectState>,
    /// The mapping the rings live in (each end holds it too).
    region: Arc<Region>,
}

impl Carried {
    /// `side` is the daemon's side of the region: `Server` towards a client
    /// pod, `Client` towards a server pod.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: u64,
        key: StreamKey,
        region: Arc<Region>,
        side: Side,
        sock: OwnedFd,
        pidfd: Option<OwnedFd>,
        stream: Arc<dyn LaneStream>,
        zero_copy: bool,
    ) -> Carried {
        let (mut tx, mut rx) = region.endpoints(side);
        let probe = region.probe(side);
        let direct = stream
            .direct()
            .filter(|_| zero_copy)
            .map(|dl| DirectState::register(id, dl, &mut tx, &mut rx, probe.clone()));
        Carried {
            id,
            key,
            to_pod: Mutex::new(tx),
            from_pod: Mutex::new(rx),
            probe,
            sock,
            pidfd: Mutex::new(pidfd),
            stream,
            wait_attach: side == Side::Client,
            send_lock: Mutex::new(()),
            wake_pending: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            sent_eof: AtomicBool::new(false),
            sent_gone: AtomicBool::new(false),
            got_eof: AtomicBool::new(false),
            got_gone: AtomicBool::new(false),
            sent_final: AtomicBool::new(false),
            got_final: AtomicBool::new(false),
            bytes_out: AtomicU64::new(0),
            bytes_in: AtomicU64::new(0),
            pumps_left: AtomicUsize::new(2),
            opened: Instant::now(),
            direct,
            region,
        }
    }

    /// True on the client pod's node (the daemon holds the server side of
    /// the region).
    pub fn serves_client(&self) -> bool {
        !self.wait_attach
    }

    /// Bytes carried so far: (client to server, server to client). Our pod
    /// sends `bytes_out`: it is the client on the client's node. Both are
    /// the daemon's own counts (never a pod's word).
    pub fn directions(&self) -> (u64, u64) {
        let (out, inn) = (
            self.bytes_out.load(Ordering::Relaxed),
            self.bytes_in.load(Ordering::Relaxed),
        );
        if self.serves_client() {
            (out, inn)
        } else {
            (inn, out)
        }
    }

    pub fn region_len(&self) -> usize {
        self.region.len()
    }

    /// The pod wrote a ring word the protocol does not allow; the
    /// connection was ended for both pods.
    pub fn ring_broken(&self) -> bool {
        self.region.is_broken()
    }

    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Sends one frame whole, then any wake request that waited for the lock.
    pub(super) fn send_frame(&self, bytes: &[u8]) -> io::Result<()> {
        let r = {
            let _g = lock(&self.send_lock);
            frames::send_all(&*self.stream, bytes)
        };
        self.flush_wake();
        r
    }

    /// Sends a pending WAKE if nobody else is sending; a thread holding the
    /// lock calls this again after releasing it, so no request is lost.
    pub(super) fn flush_wake(&self) {
        while self.wake_pending.load(Ordering::Acquire) {
            let Ok(_g) = self.send_lock.try_lock() else {
                return;
            };
            if self.wake_pending.swap(false, Ordering::AcqRel)
                && !self.sent_final.load(Ordering::Acquire)
            {
                if let Err(e) = frames::send_all(&*self.stream, &[frames::WAKE]) {
                    drop(_g);
                    self.fail(&format!("lane send: {e}"));
                    return;
                }
            }
        }
    }

    /// Our pod needs a doorbell: ask the peer daemon to ring it.
    pub(super) fn request_wake(&self) {
        self.wake_pending.store(true, Ordering::Release);
        self.flush_wake();
    }

    /// Ends the connection for both pods after a failure.
    pub fn fail(&self, why: &str) {
        if self.failed.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::info!(id = self.id, client = %self.key.client, server = %self.key.server, why, "relayed connection failed; ending it for both pods");
        self.stream.reset();
        // A reset for both pods (ours now; the remote one by the RST and by
        // its own daemon, which sees the lane reset): never a clean
        // end-of-stream, which would make a cut transfer look complete.
        os::abort_connection(&self.sock);
    }

    /// Both directions settled here: tell the peer (FINAL) and end our side.
    pub(super) fn maybe_finish(&self) {
        let out_done =
            self.sent_eof.load(Ordering::Acquire) || self.got_gone.load(Ordering::Acquire);
        let in_done =
            self.got_eof.load(Ordering::Acquire) || self.sent_gone.load(Ordering::Acquire);
        if !(out_done && in_done) || self.sent_final.load(Ordering::Acquire) {
            return;
        }
        let _g = lock(&self.send_lock);
        if self.sent_final.swap(true, Ordering::AcqRel) {
            return;
        }
        let r = frames::send_all(&*self.stream, &[frames::FINAL])
            .and_then(|()| self.stream.shutdown_send());
        drop(_g);
        if let Err(e) = r {
            self.fail(&format!("lane send: {e}"));
        }
    }

    /// True when no pod process holds the connection any more. When the
    /// watched process exited, a process it forked that still maps the
    /// channel (and so holds the connection: pre-fork servers, daemonizing
    /// clients) is watched instead.
    pub(super) fn pod_exited(&self) -> bool {
        let mut g = lock(&self.pidfd);
        let Some(p) = g.as_ref() else {
            return false;
        };
        if !os::process_exited(p, 0) {
            return false;
        }
        let name = format!("flowlane-relay-{}", self.id);
        match os::process_mapping_memfd(&name, std::process::id())
            .and_then(|pid| os::pidfd_open(pid).ok().map(|fd| (pid, fd)))
        {
            Some((pid, fd)) => {
                tracing::debug!(
                    id = self.id,
                    pid,
                    "relay: the pod process exited; a process it forked keeps the connection"
                );
                *g = Some(fd);
                false
            }
            None => true,
        }
    }

    /// Sleeps one slice without a ring to wait on.
    pub(super) fn idle_slice(&self) {
        // A duplicate: `pod_exited` may replace the watched process meanwhile.
        let watched = lock(&self.pidfd).as_ref().and_then(|p| p.try_clone().ok());
        match &watched {
            // An exited process answers at once: sleep the slice anyway.
            Some(p) if !os::process_exited(p, SLICE_MS as i32) => {}
            _ => std::thread::sleep(Duration::from_millis(SLICE_MS as u64)),
        }
    }

    /// Sends one frame; on a lane error fails the connection and answers
    /// false (the pump ends).
    pub(super) fn send_or_fail(&self, bytes: &[u8]) -> bool {
        match self.send_frame(bytes) {
            Ok(()) => true,
            Err(e) => {
                self.fail(&format!("lane send: {e}"));
                false
            }
        }
    }

    /// The pod closed its sending side and all its bytes went out: tells
    /// the peer (EOF). False when the lane failed (the pump ends).
    pub(super) fn send_eof(&self) -> bool {
        if !self.send_or_fail(&[frames::EOF]) {
            return false;
        }
        self.sent_eof.store(true, Ordering::Release);
        self.maybe_finish();
        true
    }

    /// The pod process is gone without closing its sending side: killed.
    /// Fails the connection so the remote pod sees a reset, not a clean EOF.
    pub(super) fn pod_killed(&self) {
        self.fail("the pod process exited without closing the connection");
    }

    /// The part of a sending pump's turn that copies and placements share,
    /// before it looks at the pod's ring: a pod that closed (or, after its
    /// last byte, exited) reads no more, so the peer is told (GONE); with
    /// nothing more to forward, the pump waits a slice for the other
    /// direction.
    pub(super) fn gone_or_idle(&self) -> SendTurn {
        if self.ring_broken() {
            self.fail(BROKEN);
            return SendTurn::Stop;
        }
        if !self.sent_gone.load(Ordering::Acquire)
            && (self.probe.tx_peer_gone()
                || (self.sent_eof.load(Ordering::Acquire) && self.pod_exited()))
        {
            if !self.send_or_fail(&[frames::GONE]) {
                return SendTurn::Stop;
            }
            self.sent_gone.store(true, Ordering::Release);
            self.maybe_finish();
            return SendTurn::Again;
        }
        if self.sent_eof.load(Ordering::Acquire) || self.got_gone.load(Ordering::Acquire) {
            self.idle_slice();
            return SendTurn::Again;
        }
        SendTurn::Forward
    }

    /// The server daemon: the pod attaches right after its claim's answer;
    /// a pod that never does stayed on TCP, which the client pod (already on
    /// the ring) must not silently miss.
    fn await_attach(&self) -> bool {
        let decided = super::backoff::until(Instant::now() + ATTACH_GRACE, || {
            match self.probe.attach_state() {
                Attach::ServerAttached => Some(true),
                Attach::ClientGaveUp => Some(false),
                Attach::Undecided => None,
            }
        });
        decided.unwrap_or(false)
    }

    /// Pod's sending ring -> lane.
    pub fn pump_out(&self) {
        if self.wait_attach && !self.await_attach() {
            self.fail("the server pod did not attach to its ring");
            return;
        }
        match self.out_mode() {
            None => return,
            Some(Some(peer_size)) => return self.pump_out_placing(peer_size),
            Some(None) => {}
        }
        let mut buf = vec![0u8; DATA_HEADER + MAX_DATA];
        loop {
            if self.failed() || self.sent_final.load(Ordering::Acquire) {
                return;
            }
            self.flush_wake();
            match self.gone_or_idle() {
                SendTurn::Stop => return,
                SendTurn::Again => continue,
                SendTurn::Forward => {}
            }
            let mut rx = lock(&self.from_pod);
            match rx.state() {
                ReadState::Data(_) => {
                    let n = rx.read(&mut buf[DATA_HEADER..]);
                    let wake = rx.take_writer_wakeup();
                    drop(rx);
                    frames::data_header(&mut buf, n);
                    if !self.send_or_fail(&buf[..DATA_HEADER + n]) {
                        return;
                    }
                    self.bytes_out.fetch_add(n as u64, Ordering::Relaxed);
                    if wake {
                        self.request_wake();
                    }
                }
                ReadState::Broken => {
                    drop(rx);
                    self.fail(BROKEN);
                    return;
                }
                ReadState::Eof => {
                    drop(rx);
                    if !self.send_eof() {
                        return;
                    }
                }
                ReadState::Empty => {
                    rx.wait_data(SLICE_MS);
                    let empty = rx.state() == ReadState::Empty;
                    drop(rx);
                    if empty && self.pod_exited() {
                        self.pod_killed();
                        return;
                    }
                }
            }
        }
    }

    /// Lane -> pod's receiving ring, and the peer's control frames.
    pub fn pump_in(self: &Arc<Self>) {
        let mut inb = InBuf::new(DATA_HEADER + MAX_DATA);
        loop {
            let frame = match inb.next_frame(&*self.stream) {
                Ok(f) => f,
                Err(e) => {
                    self.fail(&format!("lane receive: {e}"));
                    return;
                }
            };
            match frame {
                Frame::End if self.got_final.load(Ordering::Acquire) => return,
                Frame::End => {
                    self.fail("lane stream ended without FINAL (peer daemon gone?)");
                    return;
                }
                Frame::Control(frames::WAKE) => os::ring_doorbell(&self.sock),
                Frame::Control(frames::EOF) => {
                    lock(&self.to_pod).close();
                    // Always ring: a reader may wait for POLLRDHUP only.
                    self.request_wake();
                    self.got_eof.store(true, Ordering::Release);
                    self.maybe_finish();
                }
                Frame::Control(frames::GONE) => {
                    self.probe.close_rx();
                    self.request_wake();
                    self.got_gone.store(true, Ordering::Release);
                    self.maybe_finish();
                }
                Frame::Control(frames::FINAL) => self.got_final.store(true, Ordering::Release),
                Frame::Ring { can_place, desc } => {
                    if let Err(e) = self.on_ring(can_place, &desc) {
                        self.fail(&e);
                        return;
                    }
                }
                Frame::Placed { len, crc } => {
                    if let Err(e) = self.on_placed(len, crc) {
                        self.fail(&e);
                        return;
                    }
                }
                Frame::Room(head) => self.on_room(head),
                Frame::Control(other) => {
                    self.fail(&format!("unknown lane frame {other:#x}"));
                    return;
                }
                Frame::Data(len) => {
                    if let Err(e) = self.deliver(&mut inb, len) {
                        self.fail(&e);
                        return;
                    }
                }
            }
            if self.failed() {
                return;
            }
        }
    }

    /// Copies one DATA payload into the pod's receiving ring (discarding it
    /// if the pod stopped reading).
    fn deliver(&self, inb: &mut InBuf, len: usize) -> Result<(), String> {
        let mut tx = lock(&self.to_pod);
        let mut left = len;
        while left > 0 {
            let piece = inb
                .payload(&*self.stream, left)
                .map_err(|e| format!("lane receive: {e}"))?;
            let m = piece.len();
            let mut off = 0;
            while off < m {
                if tx.is_broken() {
                    return Err(BROKEN.into());
                }
                if tx.peer_gone() {
                    break; // the pod closed: like TCP after close, bytes are dropped
                }
                let n = tx.write(&piece[off..]);
                if n > 0 {
                    off += n;
                    self.bytes_in.fetch_add(n as u64, Ordering::Relaxed);
                    if tx.take_reader_wakeup() {
                        self.request_wake();
                    }
                    continue;
                }
                if self.failed() {
                    return Err("failed".into());
                }
                tx.wait_room(SLICE_MS);
            }
            inb.consume(m);
            left -= m;
        }
        Ok(())
    }
}
