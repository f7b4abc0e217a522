//! The cross-node relay (issue 6): a TCP connection between pods on two
//! nodes rides a lane between the two daemons, each daemon being the ring
//! peer of its own pod:
//!
//! ```text
//! pod A ring <-> flowlaned 1 <-> LaneStream <-> flowlaned 2 <-> pod B ring
//! ```
//!
//! Set-up, with the library's unchanged two round trips (intent before the
//! TCP connect, claim after accept):
//! 1. A's `relayable-intent` for a pod IP of another node with a lane: the
//!    daemon takes its own reference to A's socket (`pidfd_getfd`), creates
//!    and maps A's region, opens a lane stream keyed by (A's address, B's
//!    address) and answers the channel. A connects over TCP as usual and
//!    waits for the attach word (the library's own handshake).
//! 2. Daemon 2 accepts the stream, keeps it for B's claim and answers
//!    REGISTERED; daemon 1 answers A only then, so when B accepts A's
//!    connection its claim finds the stream at once (a claim for a
//!    connection no daemon announced never waits; on daemons serving
//!    Service IPs it first asks A's daemon whether a Service connection's
//!    stream is coming: one lane round trip, `service.rs`).
//! 3. B's `relayable-claim` for a peer on another node: daemon 2 pairs it
//!    with the stream, sends CLAIMED; daemon 1 checks that A mapped its
//!    channel and sets A's attach word (this is where A's lane is decided,
//!    exactly once), answers ATTACHED; daemon 2 answers B's claim with a
//!    fresh region of its own. Any failure or timeout before that point
//!    leaves both pods on plain TCP with identical bytes.
//!
//! Then `carried.rs` pumps bytes (`placed.rs`: without copies, over a
//! transport that can place them). Gated off unless `--lane-listen` is given.

mod backoff;
pub mod budget;
mod carried;
pub mod frames;
pub(crate) mod os;
mod placed;
pub mod route;
mod service;
#[cfg(feature = "test-transport")]
pub mod tcp_test;
mod wait_trace;
mod watchdog;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use flowlane_lane::proto::{
    ConnectionInfo, Endpoint, ErrorCode, FallbackReason, LaneStats, NoChannelReason, RelayMemory,
    Request, Response,
};
use flowlane_lane::ring::{self, Side};
use flowlane_rdma::{LaneStream, LaneTransport, StreamKey};

use crate::broker::{Answer, Caller};
use crate::memfd;
use crate::server::Shared;
use crate::stats::RelayReport;
use carried::Carried;
use flowlane_lane::region::Region;

/// How long an intent waits for the lane stream to open, and then for the
/// server daemon's REGISTERED; together within the pod's 500 ms daemon
/// timeout for its intent.
const OPEN_WAIT: Duration = Duration::from_millis(200);
const REGISTER_WAIT: Duration = Duration::from_millis(250);
/// How long a claim waits for the client daemon's ATTACHED/REFUSED (within
/// the pod's 500 ms daemon timeout for its claim).
const HANDSHAKE_WAIT: Duration = Duration::from_millis(300);
/// How long the client daemon waits for its pod to map the channel (it
/// does right after its connect returns).
const MAP_WAIT: Duration = Duration::from_millis(150);
/// Default ring size of zero-copy relayed connections (see `Relay`): the
/// ring is the window, and a 1 MiB ring was always entirely in flight (the
/// pump waiting for completions), so a larger ring moves more; it pins
/// 8 MiB per connection (docs/relay.md; figures:
/// docs/benchmarks/2026-11-30-relay-zero-copy.md).
const ZERO_COPY_RING: usize = 4 << 20;
/// Answered (refused) streams are dropped after this long.
const LINGER: Duration = Duration::from_secs(5);
/// Accepted streams nobody claimed are dropped after this long.
const UNCLAIMED_TTL: Duration = Duration::from_secs(30);

/// Streams the relay refused, in `lane_errors` next to the transport's
/// (`peer_unknown`, `peer_auth_failed`, ...).
pub mod refusal {
    /// The stream's client address is no pod of the node whose daemon
    /// opened it (node X cannot carry pod traffic of node Y).
    pub const FOREIGN_CLIENT: &str = "stream_foreign_client";
    /// A stream with the key of a live one (waiting for its claim, or
    /// carried): refused, the live one goes on.
    pub const DUPLICATE: &str = "stream_duplicate";
    /// A Service connection's stream that arrived after its server pod's
    /// claim stopped waiting for it (`service.rs`): refused, both pods stay
    /// on TCP.
    pub const LATE: &str = "stream_late";
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A stream a peer daemon opened, and when it arrived.
type Accepted = (Arc<dyn LaneStream>, Instant);

pub struct Relay {
    transport: Arc<dyn LaneTransport>,
    router: route::Router,
    /// Lane name in counters: "relay" (test transport) or "rdma".
    lane: &'static str,
    shared: Shared,
    /// Streams peer daemons opened, waiting for our pod's claim.
    accepted: Mutex<HashMap<StreamKey, Accepted>>,
    /// Signalled when a stream joins `accepted` (a claim may be waiting
    /// for it: `service.rs`).
    arrived: Condvar,
    /// Keys whose claim stopped waiting for their stream, and when: that
    /// stream is refused if it still comes (`service.rs`).
    missed: Mutex<HashMap<StreamKey, Instant>>,
    /// Service connections of our pods being set up, whose stream may not
    /// be registered yet (`service.rs`: a peer daemon may ask).
    service_inflight: Mutex<service::InFlight>,
    /// Answered streams kept a moment so their answer is read before the
    /// drop (the sweep releases them).
    lingering: Mutex<Vec<Accepted>>,
    /// Client-side set-ups waiting for the peer's CLAIMED, by channel id,
    /// with the client pod (netns inode) that alone may cancel it.
    setups: Mutex<HashMap<u64, Setup>>,
    active: Mutex<HashMap<u64, Arc<Carried>>>,
    opened: AtomicU64,
    closed: AtomicU64,
    /// Bytes of ended connections: client to server, server to client.
    closed_bytes: [AtomicU64; 2],
    refused_foreign: AtomicU64,
    refused_duplicate: AtomicU64,
    refused_late: AtomicU64,
    /// Move bytes without copies where the transport can (see `placed.rs`).
    zero_copy: bool,
    /// Ring size (per direction) of zero-copy relayed connections: nothing
    /// is buffered between the two pods' rings, so a ring is a direction's
    /// whole window (docs/relay.md, "Zero copy"); the daemon pins both.
    zero_copy_ring: usize,
    /// Memory the relay may hold for its connections.
    budget: Arc<budget::MemoryBudget>,
    /// The reservation of each carried connection, by id (released when
    /// its pumps end).
    reserved: Mutex<HashMap<u64, budget::Reservation>>,
}

/// `FLOWLANE_RELAY_ZERO_COPY=0|1` overrides the default: zero copy over
/// RDMA, copies over the `tcp-test` double (whose emulated placements,
/// stop-and-wait per ring, exist to test the protocol on hosts, not to be
/// fast).
fn zero_copy_for(transport: &str) -> bool {
    match std::env::var("FLOWLANE_RELAY_ZERO_COPY").as_deref() {
        Ok("0") => false,
        Ok("1") => true,
        _ => transport == "rdma",
    }
}

/// `FLOWLANE_RELAY_RING_KIB` (a power of two within the library's ring
/// limits) overrides the ring size of zero-copy relayed connections.
fn zero_copy_ring() -> usize {
    std::env::var("FLOWLANE_RELAY_RING_KIB")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(ZERO_COPY_RING, |k| k << 10)
}

/// A client-side set-up: the announcing pod (netns inode) and its stream.
type Setup = (u64, Arc<dyn LaneStream>);

/// What the client daemon holds for one connection it set up, until the
/// server daemon's CLAIMED decides it.
struct ClientSetup {
    id: u64,
    /// The client pod (netns inode), which alone may cancel it.
    pod: u64,
    key: StreamKey,
    /// The pod's region, mapped by this daemon (its ring peer).
    region: Arc<Region>,
    /// This daemon's reference to the pod's socket.
    sock: OwnedFd,
    pidfd: Option<OwnedFd>,
    pid: u32,
    /// The region's memfd name, as the pod's process maps it.
    memfd_name: String,
    reservation: budget::Reservation,
}

impl Relay {
    /// Starts the relay: its accept thread runs for the daemon's lifetime.
    pub fn start(
        transport: Arc<dyn LaneTransport>,
        router: route::Router,
        shared: Shared,
        memory_budget: u64,
    ) -> Arc<Relay> {
        let lane = if transport.name() == "rdma" {
            "rdma"
        } else {
            "relay"
        };
        let zero_copy = zero_copy_for(transport.name());
        let zero_copy_ring = zero_copy_ring();
        tracing::info!(
            transport = transport.name(),
            zero_copy,
            zero_copy_ring,
            memory_budget,
            "relay: data path"
        );
        let relay = Arc::new(Relay {
            transport,
            router,
            lane,
            shared,
            accepted: Mutex::new(HashMap::new()),
            arrived: Condvar::new(),
            missed: Mutex::new(HashMap::new()),
            service_inflight: Mutex::new(HashMap::new()),
            lingering: Mutex::new(Vec::new()),
            setups: Mutex::new(HashMap::new()),
            active: Mutex::new(HashMap::new()),
            opened: AtomicU64::new(0),
            closed: AtomicU64::new(0),
            closed_bytes: Default::default(),
            refused_foreign: AtomicU64::new(0),
            refused_duplicate: AtomicU64::new(0),
            refused_late: AtomicU64::new(0),
            zero_copy,
            zero_copy_ring,
            budget: budget::MemoryBudget::new(memory_budget),
            reserved: Mutex::new(HashMap::new()),
        });
        let r = relay.clone();
        std::thread::Builder::new()
            .name("relay-accept".into())
            .spawn(move || r.accept_loop())
            .expect("spawning the relay accept thread");
        let r = relay.clone();
        std::thread::Builder::new()
            .name("relay-sweep".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_secs(5));
                r.sweep();
            })
            .expect("spawning the relay sweep thread");
        relay
    }

    fn accept_loop(&self) {
        loop {
            match self.transport.accept() {
                Ok((key, stream)) => {
                    let key = canonical_key(key);
                    let from = stream.peer_node();
                    tracing::debug!(client = %key.client, server = %key.server, ?from, "lane stream accepted");
                    // The opening daemon (authenticated by the transport)
                    // carries its own node's pods only.
                    if !from.is_some_and(|f| self.router.is_pod_of(f, key.client.ip())) {
                        // The other way round: the daemon of the key's
                        // server asks whether our pod's stream is coming.
                        if from.is_some_and(|f| self.router.is_pod_of(f, key.server.ip()))
                            && self.shared.lock().is_local_pod_ip(key.client.ip())
                        {
                            self.answer_stream_query(&key, stream);
                            continue;
                        }
                        tracing::warn!(client = %key.client, server = %key.server, ?from, "relay: stream refused: its client is no pod of the node that opened it");
                        self.refused_foreign.fetch_add(1, Ordering::Relaxed);
                        self.answer_and_linger(stream, frames::STREAM_REFUSED);
                        continue;
                    }
                    if !self.shared.lock().has_flowlane_listener(key.server) {
                        tracing::debug!(server = %key.server, "relay: no flowlane listener there");
                        self.answer_and_linger(stream, frames::NO_LISTENER);
                        continue;
                    }
                    let now = Instant::now();
                    // (`lane_stats` holds `active` while it takes
                    // `accepted`: never the other way round.)
                    let carried = lock(&self.active).values().any(|c| c.key == key);
                    let mut acc = lock(&self.accepted);
                    // Checked under `accepted`, which a waiting claim holds
                    // when it gives up (`service.rs`).
                    if self.missed_claim(&key) {
                        drop(acc);
                        tracing::info!(client = %key.client, server = %key.server, "relay: stream refused: its claim stopped waiting for it");
                        self.refused_late.fetch_add(1, Ordering::Relaxed);
                        self.answer_and_linger(stream, frames::STREAM_REFUSED);
                        continue;
                    }
                    let live = carried || acc.contains_key(&key);
                    if live {
                        drop(acc);
                        tracing::warn!(client = %key.client, server = %key.server, "relay: stream refused: a live stream has its key");
                        self.refused_duplicate.fetch_add(1, Ordering::Relaxed);
                        self.answer_and_linger(stream, frames::STREAM_REFUSED);
                        continue;
                    }
                    // REGISTERED goes out before any claim can take the
                    // stream (and send CLAIMED on it): the opening daemon
                    // reads them in that order. One byte on a fresh
                    // stream, sent under `accepted` so that a claim
                    // arriving meanwhile finds the stream once it is
                    // announced.
                    if frames::send_all(&*stream, &[frames::REGISTERED]).is_err() {
                        continue;
                    }
                    acc.insert(key, (Arc::from(stream), now));
                    drop(acc);
                    self.arrived.notify_all();
                }
                Err(e) => {
                    tracing::warn!(error = %e, "lane accept failed");
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
    }

    /// Answers a stream we do not take with `answer` and keeps it a moment:
    /// dropping it now could reset it before the answer is read (a reset
    /// may discard unread bytes).
    fn answer_and_linger(&self, stream: Box<dyn LaneStream>, answer: u8) {
        let _ = frames::send_all(&*stream, &[answer]);
        let _ = stream.shutdown_send();
        lock(&self.lingering).push((Arc::from(stream), Instant::now()));
    }

    /// The relay's lane: counters and the carried connections (for stats
    /// answers; the broker fills in the pod names).
    pub fn lane_stats(&self) -> RelayReport {
        // Closed totals are read under `active`, which `pump_ended` holds
        // while it moves a connection's bytes there: no dip, no double count.
        let active = lock(&self.active);
        let [mut c2s_total, mut s2c_total] =
            [0, 1].map(|i| self.closed_bytes[i].load(Ordering::Relaxed));
        let connections = active
            .values()
            .map(|c| {
                let (c2s, s2c) = c.directions();
                c2s_total += c2s;
                s2c_total += s2c;
                let endpoint = |addr| Endpoint {
                    pod: String::new(),
                    addr,
                };
                ConnectionInfo {
                    id: c.id,
                    lane: self.lane.to_string(),
                    client: endpoint(c.key.client),
                    server: endpoint(c.key.server),
                    region_len: c.region_len() as u64,
                    bytes_client_to_server: c2s,
                    bytes_server_to_client: s2c,
                    age_secs: c.opened.elapsed().as_secs(),
                }
            })
            .collect();
        let pending = lock(&self.setups).len() + lock(&self.accepted).len();
        // Zeros only next to a transport's own counts: a node whose RDMA
        // lane never ran shows no invented samples (counters.rs).
        let mut errors = self.transport.error_counts();
        let counting = !errors.is_empty();
        for (kind, n) in [
            (refusal::FOREIGN_CLIENT, &self.refused_foreign),
            (refusal::DUPLICATE, &self.refused_duplicate),
            (refusal::LATE, &self.refused_late),
        ] {
            let n = n.load(Ordering::Relaxed);
            if counting || n > 0 {
                errors.push((kind, n));
            }
        }
        RelayReport {
            lane: self.lane.to_string(),
            stats: LaneStats {
                connections_opened: self.opened.load(Ordering::Relaxed),
                connections_active: active.len() as u64,
                connections_closed: self.closed.load(Ordering::Relaxed),
                bytes: c2s_total + s2c_total,
                channels_pending: pending as u64,
                // The relay keeps no stock.
                channels_stocked: 0,
                bytes_client_to_server: c2s_total,
                bytes_server_to_client: s2c_total,
            },
            connections,
            errors,
            memory: RelayMemory {
                budget_bytes: self.budget.limit(),
                used_bytes: self.budget.used(),
            },
        }
    }

    /// Reserves a connection's memory (`None`: over the budget, logged).
    fn reserve(&self, region_len: u64) -> Option<budget::Reservation> {
        let cost = budget::connection_cost(region_len);
        let r = self.budget.try_reserve(cost);
        if r.is_none() {
            tracing::info!(
                cost,
                used = self.budget.used(),
                budget = self.budget.limit(),
                "relay: memory budget exhausted; TCP"
            );
        }
        r
    }

    /// True when the relay serves `req` (instead of the broker): a
    /// relayable (or stock) intent or claim whose peer is a pod of another
    /// node with a lane, or the cancel of one of our set-ups.
    pub fn takes(&self, req: &Request) -> bool {
        let remote = |ip: std::net::IpAddr| {
            !self.shared.lock().is_local_pod_ip(ip) && self.router.lane_peer(ip).is_some()
        };
        match req {
            Request::RelayableIntent { dst, .. } | Request::StockIntent { dst, .. } => {
                remote(dst.ip())
            }
            Request::RelayableClaim { peer, .. } | Request::StockClaim { peer, .. } => {
                remote(peer.ip())
            }
            // Its backend may be a pod of another node (`service.rs`).
            Request::ResolveService { channel_id, .. } => {
                self.shared.lock().is_pending_service(*channel_id)
            }
            Request::CancelIntent { channel_id } => lock(&self.setups).contains_key(channel_id),
            _ => false,
        }
    }

    /// Serves a request `takes` accepted. Blocking: run off the runtime.
    pub fn handle(self: &Arc<Self>, caller: &Caller, req: Request) -> Answer {
        self.shared.lock().count_request(req.op_name());
        match req {
            // The relay grants no stock: a stock intent or claim is served
            // as the relayable one (its answer is one the library expects).
            Request::RelayableIntent {
                src,
                dst,
                region_len,
                socket_fd,
            }
            | Request::StockIntent {
                src,
                dst,
                region_len,
                socket_fd,
                ..
            } => self.intent(
                caller,
                canonical(src),
                canonical(dst),
                region_len,
                socket_fd,
            ),
            Request::RelayableClaim {
                local,
                peer,
                socket_fd,
            }
            | Request::StockClaim {
                local,
                peer,
                socket_fd,
            } => self.claim(caller, canonical(local), canonical(peer), socket_fd),
            Request::ResolveService {
                channel_id,
                socket_fd,
            } => self.resolve_service(caller, channel_id, socket_fd),
            Request::CancelIntent { channel_id } => {
                let mut setups = lock(&self.setups);
                if setups
                    .get(&channel_id)
                    .is_some_and(|(pod, _)| Some(*pod) != caller.netns)
                {
                    drop(setups);
                    return self.shared.lock().refuse(
                        ErrorCode::Forbidden,
                        "the channel was announced by another pod",
                    );
                }
                let cancelled = setups.remove(&channel_id);
                drop(setups);
                if let Some((_, s)) = cancelled {
                    s.reset();
                    self.shared
                        .lock()
                        .count_fallback(FallbackReason::IntentCancelled);
                }
                Response::Ok.into()
            }
            _ => Response::error(ErrorCode::Internal, "not a relay request").into(),
        }
    }

    fn fallback(&self, why: NoChannelReason, counter: FallbackReason) -> Answer {
        self.shared.lock().count_fallback(counter);
        Response::NoChannel { reason: why }.into()
    }

    /// Our own reference to the caller's socket `socket_fd`, checked to be a
    /// TCP socket bound to `local` (and connected to `peer` when given).
    fn take_socket(
        caller: &Caller,
        socket_fd: i32,
        local: SocketAddr,
        peer: Option<SocketAddr>,
    ) -> Result<(OwnedFd, Option<OwnedFd>, u32), String> {
        let process = caller.process.ok_or("unknown calling process")?;
        let (sock, pidfd) = os::take_tcp_socket(&process, socket_fd)
            .map_err(|e| format!("the caller's fd {socket_fd}: {e}"))?;
        let name = os::socket_name(&sock, false).ok_or("socket has no local address")?;
        let name_ok = name.port() == local.port()
            && (name.ip().is_unspecified() || name.ip().to_canonical() == local.ip());
        if !name_ok {
            return Err(format!("socket is bound to {name}, not {local}"));
        }
        if let Some(peer) = peer {
            let p = os::socket_name(&sock, true).ok_or("socket is not connected")?;
            if canonical(p) != peer {
                return Err(format!("socket is connected to {p}, not {peer}"));
            }
        }
        Ok((sock, Some(pidfd), process.pid))
    }

    /// Opens a stream, giving up after `wait`: the pod waits for our answer
    /// (500 ms), and the first stream to a peer may have to set the link
    /// up (RDMA queue pairs), which can take longer. The open goes on in
    /// the background, so the link is up for the next connection; a stream
    /// that arrives late is reset.
    fn open_within(
        &self,
        peer: SocketAddr,
        key: StreamKey,
        wait: Duration,
    ) -> Result<Arc<dyn LaneStream>, String> {
        let (tx, rx) = std::sync::mpsc::channel();
        let transport = self.transport.clone();
        std::thread::Builder::new()
            .name("relay-open".into())
            .spawn(move || {
                let opened = transport.open(peer, key);
                if let Err(std::sync::mpsc::SendError(Ok(late))) = tx.send(opened) {
                    late.reset();
                }
            })
            .map_err(|e| format!("spawning: {e}"))?;
        match rx.recv_timeout(wait) {
            Ok(Ok(s)) => Ok(Arc::from(s)),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "no stream within {wait:?} (link still being set up?)"
            )),
        }
    }

    fn intent(
        self: &Arc<Self>,
        caller: &Caller,
        src: SocketAddr,
        dst: SocketAddr,
        region_len: u64,
        socket_fd: i32,
    ) -> Answer {
        // The same admission as a same-node intent (broker/admission.rs).
        let admitted = match self
            .shared
            .lock()
            .admit_intent(caller, src, dst, region_len, true)
        {
            Ok(admitted) => admitted,
            Err(refused) => return refused,
        };
        let src = admitted.src;
        let Some(peer_daemon) = self.router.lane_peer(dst.ip()) else {
            return self.fallback(NoChannelReason::NotLocalPod, FallbackReason::NotLocalPod);
        };
        // The library sizes its rings from our answer's length.
        let region_len = if self.zero_copy {
            region_len.max(ring::region_len_for(self.zero_copy_ring) as u64)
        } else {
            region_len
        };
        let Some(reservation) = self.reserve(region_len) else {
            return self.fallback(NoChannelReason::NotLocalPod, FallbackReason::RelayBudget);
        };
        let taken = Self::take_socket(caller, socket_fd, src, None).and_then(|t| {
            if src.port() != 0 {
                return Ok((t, src));
            }
            // A portless intent (broker/channels.rs): the stream key needs
            // the client's port now, so bind its socket here, as the
            // library did before it left binding to `connect`.
            os::bind_to_ip(&t.0, src.ip()).map_err(|e| format!("bind: {e}"))?;
            let bound = os::socket_name(&t.0, false).ok_or("socket has no local address")?;
            Ok((t, canonical(bound)))
        });
        let ((sock, pidfd, pid), src) = match taken {
            Ok(t) => t,
            Err(e) => {
                tracing::debug!(%src, %dst, error = %e, "relay: cannot take the client's socket");
                return self.fallback(
                    NoChannelReason::NotLocalPod,
                    FallbackReason::RelaySetupFailed,
                );
            }
        };
        let id = self.shared.lock().next_channel_id();
        let name = format!("flowlane-relay-{id}");
        let made = memfd::create_sealed(&name, region_len).and_then(|fd| {
            // Fixed capacity: the relay's pumps and zero-copy placement
            // address the whole ring (docs/shm-lane.md, "Rings that grow").
            let region = Region::map_memfd_fixed(fd.as_fd(), region_len as usize)?;
            Ok((fd, region))
        });
        let (memfd, region) = match made {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "relay: cannot create a channel");
                return self.fallback(
                    NoChannelReason::NotLocalPod,
                    FallbackReason::RelaySetupFailed,
                );
            }
        };
        let key = StreamKey {
            client: src,
            server: dst,
        };
        let stream = match self.open_registered(peer_daemon, key) {
            Ok(s) => s,
            Err((why, counter)) => return self.fallback(why, counter),
        };
        let setup = ClientSetup {
            id,
            pod: admitted.client_pod,
            key,
            region,
            sock,
            pidfd,
            pid,
            memfd_name: name,
            reservation,
        };
        if let Err((why, counter)) = self.start_client_setup(setup, stream) {
            return self.fallback(why, counter);
        }
        tracing::debug!(id, %src, %dst, %peer_daemon, "relay: channel announced");
        Answer::with_fd(
            Response::Channel {
                id,
                len: region_len,
            },
            memfd,
        )
    }

    /// Client daemon: opens the stream for `key` to `peer_daemon` and waits
    /// for its REGISTERED (the server daemon found a flowlane listener
    /// there); else the fallback to count.
    fn open_registered(
        &self,
        peer_daemon: SocketAddr,
        key: StreamKey,
    ) -> Result<Arc<dyn LaneStream>, (NoChannelReason, FallbackReason)> {
        let (src, dst) = (key.client, key.server);
        let stream = match self.open_within(peer_daemon, key, OPEN_WAIT) {
            Ok(s) => s,
            Err(e) => {
                tracing::info!(%peer_daemon, error = %e, "relay: lane not open in time; TCP");
                return Err((
                    NoChannelReason::NotLocalPod,
                    FallbackReason::RelayLaneUnreachable,
                ));
            }
        };
        match recv_byte_within(&stream, REGISTER_WAIT) {
            Ok(frames::REGISTERED) => Ok(stream),
            Ok(frames::NO_LISTENER) => {
                Err((NoChannelReason::NoListener, FallbackReason::NoListener))
            }
            Ok(frames::STREAM_REFUSED) => {
                tracing::info!(%peer_daemon, %src, %dst, "relay: the peer daemon refused the stream; TCP");
                Err((
                    NoChannelReason::NotLocalPod,
                    FallbackReason::RelayStreamRefused,
                ))
            }
            other => {
                tracing::info!(%peer_daemon, answer = ?other, "relay: peer daemon did not register the stream; TCP");
                stream.reset();
                Err((
                    NoChannelReason::NotLocalPod,
                    FallbackReason::RelayLaneUnreachable,
                ))
            }
        }
    }

    /// Client daemon: records the set-up (the pod may cancel it) and runs
    /// [`Relay::client_setup`] on its own thread.
    fn start_client_setup(
        self: &Arc<Self>,
        setup: ClientSetup,
        stream: Arc<dyn LaneStream>,
    ) -> Result<(), (NoChannelReason, FallbackReason)> {
        let id = setup.id;
        lock(&self.setups).insert(id, (setup.pod, stream.clone()));
        let r = self.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("relay-setup-{id}"))
            .spawn(move || r.client_setup(setup, stream));
        if spawned.is_err() {
            if let Some((_, s)) = lock(&self.setups).remove(&id) {
                s.reset();
            }
            return Err((
                NoChannelReason::NotLocalPod,
                FallbackReason::RelaySetupFailed,
            ));
        }
        Ok(())
    }

    /// Client daemon: waits for the server daemon's CLAIMED, decides the
    /// client pod's lane (attach word), answers, and starts the pumps.
    fn client_setup(self: Arc<Self>, setup: ClientSetup, stream: Arc<dyn LaneStream>) {
        let ClientSetup {
            id,
            pod: _,
            key,
            region,
            sock,
            pidfd,
            pid,
            memfd_name,
            reservation,
        } = setup;
        let mut b = [0u8; 1];
        let claimed = matches!(stream.recv(&mut b), Ok(1)) && b[0] == frames::CLAIMED;
        let still_ours = lock(&self.setups).remove(&id).is_some();
        if !claimed || !still_ours {
            stream.reset();
            if still_ours {
                // Not cancelled by the pod: the server never claimed.
                self.shared
                    .lock()
                    .count_fallback(FallbackReason::IntentExpired);
            }
            return;
        }
        // The pod maps its channel right after its connect returns.
        let mapped = backoff::until(Instant::now() + MAP_WAIT, || {
            os::process_maps_memfd(pid, &memfd_name).then_some(())
        })
        .is_some();
        let probe = region.probe(Side::Server);
        let attached = mapped && probe.server_attach();
        // A pod thread blocked on the attach sleeps on the region's futex
        // (a doorbell byte could come only from the remote end).
        if attached && probe.server_attach_wake().futex {
            probe.wake_attach_sleeper();
        }
        let answer = if attached {
            frames::ATTACHED
        } else {
            frames::REFUSED
        };
        if let Err(e) = frames::send_all(&*stream, &[answer]) {
            tracing::info!(id, error = %e, "relay: lane failed during set-up");
            if attached {
                // The pod is on the ring already: end it visibly.
                os::abort_connection(&sock);
            }
            stream.reset();
            return;
        }
        if !attached {
            tracing::debug!(id, "relay: client pod gave up; both stay on TCP");
            self.shared
                .lock()
                .count_fallback(FallbackReason::RelayRefused);
            let _ = stream.shutdown_send();
            return;
        }
        let c = Carried::new(
            id,
            key,
            region,
            Side::Server,
            sock,
            pidfd,
            stream,
            self.zero_copy,
        );
        self.run(c, reservation);
    }

    fn claim(
        self: &Arc<Self>,
        caller: &Caller,
        local: SocketAddr,
        peer: SocketAddr,
        socket_fd: i32,
    ) -> Answer {
        // The same admission as a same-node claim (broker/admission.rs).
        if let Err(refused) = self.shared.lock().admit_claim(caller, local) {
            return refused;
        }
        let key = StreamKey {
            client: peer,
            server: local,
        };
        let stream = match self.take_accepted(&key) {
            Some(s) => s,
            None => match self.await_service_stream(&key) {
                Ok(s) => s,
                Err(counter) => return self.fallback(NoChannelReason::NoIntent, counter),
            },
        };
        let (sock, pidfd, _pid) = match Self::take_socket(caller, socket_fd, local, Some(peer)) {
            Ok(t) => t,
            Err(e) => {
                tracing::debug!(%local, %peer, error = %e, "relay: cannot take the server's socket");
                stream.reset();
                return self.fallback(NoChannelReason::NoIntent, FallbackReason::RelaySetupFailed);
            }
        };
        let id = self.shared.lock().next_channel_id();
        let len = ring::region_len_for(if self.zero_copy {
            self.zero_copy_ring
        } else {
            ring::DEFAULT_RING_SIZE
        });
        let Some(reservation) = self.reserve(len as u64) else {
            stream.reset();
            return self.fallback(NoChannelReason::NoIntent, FallbackReason::RelayBudget);
        };
        let made = memfd::create_sealed(&format!("flowlane-relay-{id}"), len as u64)
            .and_then(|fd| Ok((Region::map_memfd_fixed(fd.as_fd(), len)?, fd)));
        let (region, memfd) = match made {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "relay: cannot create a channel");
                stream.reset();
                return self.fallback(NoChannelReason::NoIntent, FallbackReason::RelaySetupFailed);
            }
        };
        match handshake(&stream) {
            Ok(true) => {}
            Ok(false) => {
                let _ = stream.shutdown_send();
                return self.fallback(NoChannelReason::NoIntent, FallbackReason::RelayRefused);
            }
            Err(e) => {
                tracing::info!(%local, %peer, error = %e, "relay: set-up handshake failed; TCP");
                stream.reset();
                return self.fallback(
                    NoChannelReason::NoIntent,
                    FallbackReason::RelayLaneUnreachable,
                );
            }
        }
        // The pod waits for this answer (500 ms): registering its rings with
        // the NIC (zero copy: pinning their pages) happens after it, off its
        // path. The pod attaches to the region on its own; the pumps wait
        // for that (and for nothing else from the daemon's side).
        let zero_copy = self.zero_copy;
        let carry = move |r: &Arc<Relay>| {
            let c = Carried::new(
                id,
                key,
                region,
                Side::Client,
                sock,
                pidfd,
                stream,
                zero_copy,
            );
            r.run(c, reservation);
            tracing::debug!(id, client = %peer, server = %local, "relay: connection carried");
        };
        // A failed spawn drops its closure: keep `carry` reachable for the
        // synchronous fallback.
        let carry = Arc::new(Mutex::new(Some(carry)));
        let run_once = {
            let carry = carry.clone();
            move |r: &Arc<Relay>| {
                if let Some(f) = lock(&carry).take() {
                    f(r)
                }
            }
        };
        let r = self.clone();
        let spawned = zero_copy
            && std::thread::Builder::new()
                .name(format!("relay-carry-{id}"))
                .spawn({
                    let run_once = run_once.clone();
                    move || run_once(&r)
                })
                .is_ok();
        if !spawned {
            run_once(self);
        }
        Answer::with_fd(
            Response::Channel {
                id,
                len: len as u64,
            },
            memfd,
        )
    }

    /// The stream a peer daemon opened for `key` (for a pod-IP connection
    /// registered before the client pod's connect, so it is there or not
    /// coming; a Service connection's may come later: `service.rs`).
    fn take_accepted(&self, key: &StreamKey) -> Option<Arc<dyn LaneStream>> {
        lock(&self.accepted).remove(key).map(|(s, _)| s)
    }

    /// Drops accepted streams nobody claimed in time (the server pod has no
    /// library, or its claim failed).
    fn sweep(&self) {
        let now = Instant::now();
        lock(&self.lingering).retain(|(_, at)| now.duration_since(*at) < LINGER);
        lock(&self.missed).retain(|_, at| now.duration_since(*at) < LINGER);
        lock(&self.accepted).retain(|_, (s, at)| {
            let keep = now.duration_since(*at) < UNCLAIMED_TTL;
            if !keep {
                s.reset();
            }
            keep
        });
    }

    /// Registers a carried connection and starts its two pumps.
    fn run(self: &Arc<Self>, c: Carried, reservation: budget::Reservation) {
        let c = Arc::new(c);
        self.opened.fetch_add(1, Ordering::Relaxed);
        lock(&self.reserved).insert(c.id, reservation);
        lock(&self.active).insert(c.id, c.clone());
        // Zero copy: our rings' description goes first, before any data.
        if let Some(d) = &c.direct {
            if let Err(e) = c.send_frame(&d.ring_frame()) {
                c.fail(&format!("lane send: {e}"));
            }
        }
        for dir in ["out", "in"] {
            let (r, c2) = (self.clone(), c.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("relay-{dir}-{}", c.id))
                .spawn(move || {
                    if dir == "out" {
                        c2.pump_out();
                    } else {
                        c2.pump_in();
                    }
                    r.pump_ended(&c2);
                });
            if spawned.is_err() {
                c.fail("cannot start a pump thread");
                self.pump_ended(&c);
            }
        }
    }

    fn pump_ended(&self, c: &Arc<Carried>) {
        if c.pumps_left.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let (c2s, s2c) = c.directions();
        {
            let mut active = lock(&self.active);
            active.remove(&c.id);
            lock(&self.reserved).remove(&c.id);
            self.closed_bytes[0].fetch_add(c2s, Ordering::Relaxed);
            self.closed_bytes[1].fetch_add(s2c, Ordering::Relaxed);
        }
        if c.ring_broken() {
            // Counted like the library counts its own (`ring-violation`).
            self.shared
                .lock()
                .count_fallback(FallbackReason::RingViolation);
        }
        self.closed.fetch_add(1, Ordering::Relaxed);
        let bytes = c2s + s2c;
        tracing::debug!(
            id = c.id,
            bytes,
            failed = c.failed(),
            secs = c.opened.elapsed().as_secs_f64(),
            "relay: connection ended"
        );
    }
}

/// Server daemon: CLAIMED, then the client daemon's verdict within
/// `HANDSHAKE_WAIT`.
fn handshake(stream: &Arc<dyn LaneStream>) -> std::io::Result<bool> {
    frames::send_all(&**stream, &[frames::CLAIMED])?;
    match recv_byte_within(stream, HANDSHAKE_WAIT)? {
        frames::ATTACHED => Ok(true),
        frames::REFUSED => Ok(false),
        other => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("bad set-up answer {other:#x}"),
        )),
    }
}

/// One byte from the stream within `wait`; the daemon's watchdog resets
/// the stream when the wait runs out (the blocking `recv` has no timeout
/// of its own).
fn recv_byte_within(stream: &Arc<dyn LaneStream>, wait: Duration) -> std::io::Result<u8> {
    let armed = watchdog::Watchdog::get().arm(wait, Box::new(stream.clone()));
    let mut b = [0u8; 1];
    let r = stream.recv(&mut b);
    if armed.disarm() {
        return Err(std::io::ErrorKind::TimedOut.into());
    }
    match r? {
        1 => Ok(b[0]),
        _ => Err(std::io::ErrorKind::UnexpectedEof.into()),
    }
}

fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

fn canonical_key(k: StreamKey) -> StreamKey {
    StreamKey {
        client: canonical(k.client),
        server: canonical(k.server),
    }
}
