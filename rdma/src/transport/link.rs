//! One link to a peer daemon: a [`Fabric`] (one RC queue pair), the streams
//! multiplexed over it, credit accounting, keep-alive and failure handling.
//!
//! Threads: a poller (completions → stream arrivals, credit returns,
//! keep-alive) and a watcher on the TCP control connection (the peer
//! daemon's death closes it, which fails the link at once). Senders post
//! from their own threads under the link's state lock.

use std::{
    collections::{HashMap, VecDeque},
    io::{self, Read},
    net::{Shutdown, SocketAddr, TcpStream},
    sync::{
        atomic::{AtomicU64, Ordering},
        mpsc, Arc, Condvar, Mutex, MutexGuard,
    },
    time::{Duration, Instant},
};

use super::credit::LinkCredits;
use super::fabric::{Completion, Fabric, Geometry, Write};
use super::stream::{RdmaStream, StreamShared};
use super::wire::{self, Header, Kind, FLAG_CHECKSUM, FLAG_NEED_CREDIT, HEADER_LEN};
use crate::lane_stream::{LaneStream, StreamKey};

/// How often an idle poller wakes to notice a closed control connection.
const PEER_CLOSED_CHECK: Duration = Duration::from_millis(100);

pub(crate) type AcceptSender = mpsc::Sender<(StreamKey, Box<dyn LaneStream>)>;

#[derive(Debug, Clone)]
pub(crate) struct LinkConfig {
    pub geometry: Geometry,
    /// Bytes each of our streams buffers (what the peer may send us).
    pub recv_window: u32,
    /// The peer's stream window (what we may send).
    pub send_window: u32,
    pub checksums: bool,
    pub keepalive: Duration,
    pub dead_after: Duration,
    /// Return pending credits when nothing was sent for this long.
    pub idle_credit: Duration,
    /// Stream ids this side allocates: odd for the side that opened the link.
    pub odd_ids: bool,
    /// The transport's error counters (shared by all its links).
    pub errors: Arc<LinkErrors>,
}

/// Why a link fails when this side shuts its transport down (not an error).
pub(crate) const LOCAL_SHUTDOWN: &str = "local transport shut down";

/// Link failures of one transport, for the daemon's metrics.
#[derive(Debug, Default)]
pub(crate) struct LinkErrors {
    /// A working link failed: error completion, protocol violation,
    /// keep-alive silence or the peer's control connection closing.
    pub link_failed: AtomicU64,
    /// Connecting or handshaking with a peer daemon failed.
    pub link_setup_failed: AtomicU64,
    /// A connection to the lane port from an address not in the node table.
    pub peer_unknown: AtomicU64,
    /// A peer that did not prove the lane key (either side of a link).
    pub peer_auth_failed: AtomicU64,
}

/// A control message waiting for link credit (sent in order, before data).
pub(crate) struct Outgoing {
    kind: Kind,
    stream: u32,
    arg: u32,
    payload: Vec<u8>,
}

impl Outgoing {
    pub(crate) fn new(kind: Kind, stream: u32, arg: u32) -> Self {
        Outgoing {
            kind,
            stream,
            arg,
            payload: Vec::new(),
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct LinkStats {
    pub bytes_sent: AtomicU64,
    pub bytes_received: AtomicU64,
    pub messages_sent: AtomicU64,
    pub messages_received: AtomicU64,
    pub streams_opened: AtomicU64,
    pub streams_accepted: AtomicU64,
}

struct LinkState {
    failed: Option<String>,
    credits: LinkCredits,
    send_seq: u32,
    recv_seq: u32,
    outbox: VecDeque<Outgoing>,
    last_sent: Instant,
    last_received: Instant,
    peer_needs_credit: bool,
    next_stream_id: u32,
    /// One entry per posted message, in posting order (completions come in
    /// that order): the stream and bytes of a zero-copy placement.
    inflight: VecDeque<Option<(Arc<StreamShared>, u64)>>,
}

pub(crate) struct Link {
    pub(crate) peer: SocketAddr,
    /// The peer daemon's address as the control connection shows it (the
    /// node its streams come from).
    source: std::net::IpAddr,
    fabric: Box<dyn Fabric>,
    cfg: LinkConfig,
    st: Mutex<LinkState>,
    can_post: Condvar,
    streams: Mutex<HashMap<u32, Arc<StreamShared>>>,
    accept: AcceptSender,
    control: TcpStream,
    weak_self: std::sync::Weak<Link>,
    /// Set by the control watcher when the peer's control connection
    /// closed: the poller drains what already arrived, then fails the link.
    peer_closed: Mutex<Option<String>>,
    pub(crate) stats: LinkStats,
}

fn reset_error(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionReset, why.to_string())
}

impl Link {
    /// Starts the link's threads. `control` is the TCP connection the
    /// handshake used; it stays open as the peer's liveness signal.
    pub(crate) fn start(
        peer: SocketAddr,
        fabric: Box<dyn Fabric>,
        cfg: LinkConfig,
        accept: AcceptSender,
        control: TcpStream,
    ) -> io::Result<Arc<Link>> {
        let watcher_sock = control.try_clone()?;
        let source = control.peer_addr()?.ip().to_canonical();
        let now = Instant::now();
        let link = Arc::new_cyclic(|weak_self| Link {
            weak_self: weak_self.clone(),
            peer_closed: Mutex::new(None),
            peer,
            source,
            fabric,
            st: Mutex::new(LinkState {
                failed: None,
                credits: LinkCredits::new(cfg.geometry.slots),
                send_seq: 0,
                recv_seq: 0,
                outbox: VecDeque::new(),
                last_sent: now,
                last_received: now,
                peer_needs_credit: false,
                next_stream_id: if cfg.odd_ids { 1 } else { 2 },
                inflight: VecDeque::new(),
            }),
            cfg,
            can_post: Condvar::new(),
            streams: Mutex::new(HashMap::new()),
            accept,
            control,
            stats: LinkStats::default(),
        });
        let poller = Arc::clone(&link);
        std::thread::Builder::new()
            .name("rdma-link-poll".into())
            .spawn(move || poller.run_poller())?;
        let watcher = Arc::downgrade(&link);
        std::thread::Builder::new()
            .name("rdma-link-ctl".into())
            .spawn(move || watch_control(watcher_sock, watcher))?;
        Ok(link)
    }

    pub(crate) fn is_failed(&self) -> bool {
        self.st.lock().unwrap().failed.is_some()
    }

    /// One line describing the link's flow-control state (diagnostics).
    pub(crate) fn describe(&self) -> String {
        let st = self.st.lock().unwrap();
        format!(
            "peer {} failed={:?} credits={:?} send_seq={} recv_seq={} outbox={} peer_needs_credit={} streams={}",
            self.peer,
            st.failed,
            st.credits,
            st.send_seq,
            st.recv_seq,
            st.outbox.len(),
            st.peer_needs_credit,
            self.streams.lock().unwrap().len()
        )
    }

    pub(crate) fn stream_count(&self) -> usize {
        self.streams.lock().unwrap().len()
    }

    pub(crate) fn fabric(&self) -> &dyn Fabric {
        &*self.fabric
    }

    pub(crate) fn checksums(&self) -> bool {
        self.cfg.checksums
    }

    /// Posts zero-copy `writes` and then `notify` as stream data behind
    /// them, waiting for link credit; `total` bytes are reported to the
    /// stream when the message completed (the NIC has them).
    pub(crate) fn send_placed(
        &self,
        stream: &Arc<StreamShared>,
        writes: &[Write],
        notify: &[u8],
        total: u64,
    ) -> io::Result<()> {
        let mut st = self.st.lock().unwrap();
        loop {
            if let Some(why) = &st.failed {
                return Err(reset_error(why));
            }
            self.pump(&mut st);
            if st.failed.is_none() && st.outbox.is_empty() && st.credits.can_send_data() {
                let placed = Some((Arc::clone(stream), total));
                if let Err(e) =
                    self.post_with(&mut st, Kind::Data, stream.id, 0, notify, writes, placed)
                {
                    self.fail_locked(&mut st, &format!("post failed: {e}"));
                    return Err(reset_error(&format!("post failed: {e}")));
                }
                self.stats
                    .bytes_sent
                    .fetch_add(total + notify.len() as u64, Ordering::Relaxed);
                return Ok(());
            }
            if st.failed.is_some() {
                continue;
            }
            st = self
                .can_post
                .wait_timeout(st, Duration::from_secs(1))
                .unwrap()
                .0;
        }
    }

    fn max_payload(&self) -> usize {
        self.cfg.geometry.slot_size as usize - HEADER_LEN
    }

    pub(crate) fn open_stream(self: &Arc<Self>, key: StreamKey) -> io::Result<RdmaStream> {
        let mut st = self.st.lock().unwrap();
        if let Some(why) = &st.failed {
            return Err(reset_error(why));
        }
        let id = st.next_stream_id;
        st.next_stream_id = st.next_stream_id.wrapping_add(2);
        let shared = StreamShared::new(
            id,
            Arc::downgrade(self),
            self.cfg.recv_window,
            self.cfg.send_window,
        );
        self.streams.lock().unwrap().insert(id, Arc::clone(&shared));
        let mut open = Outgoing::new(Kind::Open, id, 0);
        open.payload = wire::encode_key(&key).to_vec();
        st.outbox.push_back(open);
        self.pump(&mut st);
        self.stats.streams_opened.fetch_add(1, Ordering::Relaxed);
        Ok(RdmaStream {
            shared,
            max_payload: self.max_payload(),
            peer: self.source,
        })
    }

    /// Posts one data message; waits for link credit when `block`. Returns
    /// false when it would have to wait and `block` is false.
    pub(crate) fn send_data(&self, stream: u32, data: &[u8], block: bool) -> io::Result<bool> {
        let mut st = self.st.lock().unwrap();
        loop {
            if let Some(why) = &st.failed {
                return Err(reset_error(why));
            }
            self.pump(&mut st);
            if st.failed.is_none() && st.outbox.is_empty() && st.credits.can_send_data() {
                if let Err(e) = self.post_locked(&mut st, Kind::Data, stream, 0, data) {
                    self.fail_locked(&mut st, &format!("post failed: {e}"));
                    return Err(reset_error(&format!("post failed: {e}")));
                }
                self.stats
                    .bytes_sent
                    .fetch_add(data.len() as u64, Ordering::Relaxed);
                return Ok(true);
            }
            if st.failed.is_some() {
                continue;
            }
            if !block {
                return Ok(false);
            }
            st = self
                .can_post
                .wait_timeout(st, Duration::from_secs(1))
                .unwrap()
                .0;
        }
    }

    /// Queues a stream control message (never blocks: it waits in the
    /// outbox for credit, in order with everything else).
    pub(crate) fn post_control(&self, m: Outgoing) {
        let mut st = self.st.lock().unwrap();
        if st.failed.is_some() {
            return;
        }
        st.outbox.push_back(m);
        self.pump(&mut st);
    }

    /// Waits until everything queued or posted has been delivered (the
    /// peer's NIC acknowledged it), up to `timeout`: a graceful close.
    pub(crate) fn drain(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut st = self.st.lock().unwrap();
        while st.failed.is_none()
            && (!st.outbox.is_empty() || st.credits.in_flight() > 0)
            && Instant::now() < deadline
        {
            st = self
                .can_post
                .wait_timeout(st, Duration::from_millis(20))
                .unwrap()
                .0;
        }
    }

    pub(crate) fn forget(&self, id: u32) {
        self.streams.lock().unwrap().remove(&id);
    }

    /// Fails the link: every stream sees ConnectionReset, the peer sees the
    /// queue pair and the control connection go away.
    pub(crate) fn fail(&self, why: &str) {
        let mut st = self.st.lock().unwrap();
        self.fail_locked(&mut st, why);
    }

    fn fail_locked(&self, st: &mut LinkState, why: &str) {
        if st.failed.is_some() {
            return;
        }
        if why != LOCAL_SHUTDOWN {
            self.cfg.errors.link_failed.fetch_add(1, Ordering::Relaxed);
        }
        tracing::warn!(peer = %self.peer, reason = why, "RDMA link failed");
        st.failed = Some(format!("RDMA link to {} failed: {why}", self.peer));
        st.outbox.clear();
        st.inflight.clear();
        self.fabric.shutdown();
        let _ = self.control.shutdown(Shutdown::Both);
        let streams = std::mem::take(&mut *self.streams.lock().unwrap());
        let msg = st.failed.clone().unwrap();
        for s in streams.values() {
            s.on_link_failed(&msg);
        }
        self.can_post.notify_all();
    }

    fn post_locked(
        &self,
        st: &mut LinkState,
        kind: Kind,
        stream: u32,
        arg: u32,
        payload: &[u8],
    ) -> io::Result<()> {
        self.post_with(st, kind, stream, arg, payload, &[], None)
    }

    #[allow(clippy::too_many_arguments)]
    fn post_with(
        &self,
        st: &mut LinkState,
        kind: Kind,
        stream: u32,
        arg: u32,
        payload: &[u8],
        writes: &[Write],
        placed: Option<(Arc<StreamShared>, u64)>,
    ) -> io::Result<()> {
        let seq = st.send_seq;
        let slot = seq % self.cfg.geometry.slots;
        let (credits, need) = st.credits.on_post();
        let mut flags = if need { FLAG_NEED_CREDIT } else { 0 };
        let checksum = if self.cfg.checksums {
            flags |= FLAG_CHECKSUM;
            wire::crc32(payload)
        } else {
            0
        };
        let h = Header {
            kind,
            flags,
            stream,
            len: payload.len() as u32,
            seq,
            credits,
            arg,
            checksum,
        };
        self.fabric.post(slot, &h.encode(), payload, seq, writes)?;
        st.inflight.push_back(placed);
        st.send_seq = seq.wrapping_add(1);
        st.last_sent = Instant::now();
        self.stats.messages_sent.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Sends what may go now: queued control messages, then credits the peer
    /// asked for or that have piled up, then a keep-alive when idle.
    fn pump(&self, st: &mut LinkState) {
        if let Err(e) = self.try_pump(st) {
            self.fail_locked(st, &format!("post failed: {e}"));
        }
    }

    fn try_pump(&self, st: &mut LinkState) -> io::Result<()> {
        if st.failed.is_some() {
            return Ok(());
        }
        while st.credits.can_send_data() {
            let Some(m) = st.outbox.pop_front() else {
                break;
            };
            self.post_locked(st, m.kind, m.stream, m.arg, &m.payload)?;
        }
        let idle = st.last_sent.elapsed() >= self.cfg.idle_credit;
        if st.credits.should_return(st.peer_needs_credit, idle) {
            st.peer_needs_credit = false;
            self.post_locked(st, Kind::Credit, 0, 0, &[])?;
        }
        if st.last_sent.elapsed() >= self.cfg.keepalive
            && st.outbox.is_empty()
            && st.credits.can_send_data()
        {
            self.post_locked(st, Kind::Ping, 0, 0, &[])?;
        }
        Ok(())
    }

    fn run_poller(self: Arc<Self>) {
        let mut comps = Vec::with_capacity(64);
        let mut placed = Vec::new();
        loop {
            let timeout = {
                let st = self.st.lock().unwrap();
                if st.failed.is_some() {
                    break;
                }
                if st.credits.pending_return() > 0 {
                    self.cfg.idle_credit
                } else {
                    // Bounds how late a closed control connection is noticed.
                    self.cfg.keepalive.min(PEER_CLOSED_CHECK)
                }
            };
            comps.clear();
            if let Err(e) = self.fabric.poll(&mut comps, timeout) {
                self.fail(&format!("polling completions: {e}"));
                break;
            }
            let peer_closed = self.peer_closed.lock().unwrap().clone();
            if peer_closed.is_some() {
                // Messages the peer sent before it closed are already in the
                // completion queue: deliver them before failing the link.
                if let Err(e) = self.fabric.poll(&mut comps, Duration::ZERO) {
                    tracing::debug!(error = %e, "final drain");
                }
            }
            let mut st = self.st.lock().unwrap();
            for c in comps.drain(..) {
                if st.failed.is_some() {
                    break;
                }
                let r = match c {
                    Completion::Sent => {
                        if let Some(Some(p)) = st.inflight.pop_front() {
                            placed.push(p);
                        }
                        st.credits.on_send_complete().map_err(|e| e.to_string())
                    }
                    Completion::Received { imm, len } => self.on_message(&mut st, imm, len),
                    Completion::Failed(why) => Err(why),
                };
                if let Err(why) = r {
                    self.fail_locked(&mut st, &why);
                }
            }
            if let Some(why) = peer_closed {
                self.fail_locked(&mut st, &why);
            }
            if st.failed.is_none() && st.last_received.elapsed() >= self.cfg.dead_after {
                let why = format!(
                    "no message from the peer for {:?} (keep-alive every {:?})",
                    self.cfg.dead_after, self.cfg.keepalive
                );
                self.fail_locked(&mut st, &why);
            }
            self.pump(&mut st);
            self.can_post.notify_all();
            drop(st);
            // Outside the link lock: the relay's callback may wake threads
            // that post.
            for (s, n) in placed.drain(..) {
                s.on_placed(n);
            }
        }
        // Drop the streams' references so everything can be freed.
        self.streams.lock().unwrap().clear();
    }

    /// Reads one message out of its slot, re-arms the receive, and hands it
    /// to its stream.
    fn on_message(
        &self,
        st: &mut MutexGuard<'_, LinkState>,
        imm: u32,
        len: u32,
    ) -> Result<(), String> {
        let expected = st.recv_seq;
        if imm != expected {
            let slot = imm % self.cfg.geometry.slots;
            let mut seen = String::new();
            self.fabric.read_slot(slot, len as usize, &mut |m| {
                seen = match Header::decode(m, imm) {
                    Ok((h, _)) => format!("{:?} seq {} len {}", h.kind, h.seq, h.len),
                    Err(e) => e.to_string(),
                };
            });
            return Err(format!(
                "message {imm} arrived, expected {expected} (len {len}, slot holds {seen})"
            ));
        }
        let slot = imm % self.cfg.geometry.slots;
        let mut parsed = None;
        self.fabric.read_slot(slot, len as usize, &mut |m| {
            parsed = Some(Header::decode(m, expected).map(|(h, p)| (h, p.to_vec())));
        });
        let (h, payload) = parsed
            .expect("read_slot calls back")
            .map_err(|e| format!("bad message in slot {slot}: {e}"))?;
        self.fabric
            .repost_recv()
            .map_err(|e| format!("re-arming a receive: {e}"))?;
        st.recv_seq = expected.wrapping_add(1);
        st.last_received = Instant::now();
        st.credits
            .on_receive(h.credits)
            .map_err(|e| e.to_string())?;
        if h.flags & FLAG_NEED_CREDIT != 0 {
            st.peer_needs_credit = true;
        }
        self.stats.messages_received.fetch_add(1, Ordering::Relaxed);
        self.dispatch(st, h, payload)
    }

    fn dispatch(&self, st: &mut LinkState, h: Header, payload: Vec<u8>) -> Result<(), String> {
        let stream = || self.streams.lock().unwrap().get(&h.stream).cloned();
        match h.kind {
            Kind::Credit | Kind::Ping => {}
            Kind::Data => {
                self.stats
                    .bytes_received
                    .fetch_add(payload.len() as u64, Ordering::Relaxed);
                if let Some(s) = stream() {
                    s.on_data(payload)
                        .map_err(|e| format!("stream {}: {e}", h.stream))?;
                }
            }
            Kind::Window => {
                if let Some(s) = stream() {
                    s.on_window(h.arg);
                }
            }
            Kind::Fin => {
                if let Some(s) = stream() {
                    if s.on_fin() {
                        self.forget(h.stream);
                    }
                }
            }
            Kind::Reset => {
                if let Some(s) = stream() {
                    s.on_reset("stream reset by the peer");
                    self.forget(h.stream);
                }
            }
            Kind::Open => self.accept_stream(st, h.stream, &payload)?,
        }
        Ok(())
    }

    fn accept_stream(&self, st: &mut LinkState, id: u32, payload: &[u8]) -> Result<(), String> {
        let key = wire::decode_key(payload).map_err(|e| format!("open of stream {id}: {e}"))?;
        if (id % 2 == 1) == self.cfg.odd_ids {
            return Err(format!("peer opened stream {id} with our id parity"));
        }
        if self.streams.lock().unwrap().contains_key(&id) {
            return Err(format!("peer opened stream {id} twice"));
        }
        // Streams hold the link weakly: the link owns them, not the reverse.
        let shared = StreamShared::new(
            id,
            self.weak_self.clone(),
            self.cfg.recv_window,
            self.cfg.send_window,
        );
        self.streams.lock().unwrap().insert(id, Arc::clone(&shared));
        let stream = RdmaStream {
            shared: Arc::clone(&shared),
            max_payload: self.max_payload(),
            peer: self.source,
        };
        self.stats.streams_accepted.fetch_add(1, Ordering::Relaxed);
        if let Err(mpsc::SendError((_, stream))) = self.accept.send((key, Box::new(stream))) {
            // Nobody accepts any more: refuse the stream. Mark it reset first
            // so dropping the handle here does not re-enter the link lock.
            shared.on_reset("not accepted");
            self.forget(id);
            st.outbox.push_back(Outgoing::new(Kind::Reset, id, 0));
            drop(stream);
        }
        Ok(())
    }
}

/// Blocks on the control connection; the peer never writes to it after the
/// handshake, so any return means it closed or broke. The poller then
/// delivers what already arrived and fails the link.
fn watch_control(mut sock: TcpStream, link: std::sync::Weak<Link>) {
    let mut b = [0u8; 64];
    let why = match sock.read(&mut b) {
        Ok(0) => "the peer closed the control connection".to_string(),
        Ok(_) => "unexpected bytes on the control connection".to_string(),
        Err(e) => format!("control connection: {e}"),
    };
    if let Some(link) = link.upgrade() {
        let mut pc = link.peer_closed.lock().unwrap();
        if pc.is_none() {
            *pc = Some(why);
        }
    }
}
