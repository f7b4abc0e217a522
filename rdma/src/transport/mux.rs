//! The transport: listens for peer daemons on the lane port, sets up one
//! link per peer (TCP control connection + fabric handshake), and opens and
//! accepts streams over the links.

use std::{
    collections::HashMap,
    io::{self, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    os::fd::AsRawFd,
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        mpsc, Arc, Mutex, Weak,
    },
    time::Duration,
};

use serde::{Deserialize, Serialize};

use super::fabric::{FabricProvider, Geometry};
use super::link::{AcceptSender, Link, LinkConfig, LinkErrors, LinkStats, LOCAL_SHUTDOWN};
use super::RdmaOptions;
use crate::lane_auth::{AuthError, LaneAuth, PEER_AUTH_FAILED, PEER_UNKNOWN};
use crate::lane_stream::{LaneStream, LaneTransport, StreamKey};

/// Bumped when the link protocol changes; peers with another version are
/// refused at the handshake (the daemon then keeps those pods on TCP).
/// 2: zero-copy placements (the relay's RING/PLACED/ROOM frames).
const PROTOCOL: u32 = 2;
const MAX_HELLO: usize = 64 * 1024;
/// Connections on the lane port being authenticated at once; more are
/// closed unread (a flood of silent connections cannot pile up threads).
const MAX_HANDSHAKES: usize = 32;

#[derive(Debug, Serialize, Deserialize)]
struct Hello {
    protocol: u32,
    /// Where the sender's transport listens: the key the other side files
    /// the link under, so its own opens to us reuse it.
    lane: SocketAddr,
    geometry: Geometry,
    window: u32,
    fabric: serde_json::Value,
}

/// Counters for the daemon's metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TransportStats {
    pub links_up: u64,
    pub links_failed: u64,
    pub streams_open: u64,
    pub streams_opened: u64,
    pub streams_accepted: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub messages_sent: u64,
    pub messages_received: u64,
}

impl TransportStats {
    /// Adds one link's running totals (streams, bytes, messages).
    fn add_link_totals(&mut self, st: &LinkStats) {
        self.streams_opened += st.streams_opened.load(Ordering::Relaxed);
        self.streams_accepted += st.streams_accepted.load(Ordering::Relaxed);
        self.bytes_sent += st.bytes_sent.load(Ordering::Relaxed);
        self.bytes_received += st.bytes_received.load(Ordering::Relaxed);
        self.messages_sent += st.messages_sent.load(Ordering::Relaxed);
        self.messages_received += st.messages_received.load(Ordering::Relaxed);
    }
}

struct Inner<P: FabricProvider> {
    provider: P,
    opts: RdmaOptions,
    local: SocketAddr,
    /// Healthy links (up to `links_per_peer`) per peer lane address.
    links: Mutex<HashMap<SocketAddr, Vec<Arc<Link>>>>,
    /// Every link ever started (for shutdown and counters).
    all: Mutex<Vec<Weak<Link>>>,
    retired: Mutex<TransportStats>,
    connecting: Mutex<()>,
    accept_tx: AcceptSender,
    accept_rx: Mutex<mpsc::Receiver<(StreamKey, Box<dyn LaneStream>)>>,
    closed: AtomicBool,
    links_failed: AtomicU64,
    errors: Arc<LinkErrors>,
    /// Peers an extra link is being made to in the background.
    growing: Mutex<std::collections::HashSet<SocketAddr>>,
    /// Who may set up a link (`lane_auth`): node table and shared key.
    auth: LaneAuth,
    /// Handshakes in progress on the lane port.
    handshakes: AtomicUsize,
}

/// A [`LaneTransport`] over any [`FabricProvider`]: [`super::RdmaTransport`]
/// with verbs, or the in-process fabric in tests.
pub struct MuxTransport<P: FabricProvider> {
    inner: Arc<Inner<P>>,
}

impl<P: FabricProvider> MuxTransport<P> {
    /// Binds the lane port and starts accepting peer daemons: those that
    /// `auth` admits (a node of the node table that proves the lane key);
    /// our own links are authenticated the same way.
    pub fn start(
        provider: P,
        listen: SocketAddr,
        opts: RdmaOptions,
        auth: LaneAuth,
    ) -> io::Result<Self> {
        opts.validate()?;
        let listener = TcpListener::bind(listen)?;
        let local = listener.local_addr()?;
        let (accept_tx, accept_rx) = mpsc::channel();
        let inner = Arc::new(Inner {
            provider,
            opts,
            local,
            links: Mutex::new(HashMap::new()),
            all: Mutex::new(Vec::new()),
            retired: Mutex::new(TransportStats::default()),
            connecting: Mutex::new(()),
            accept_tx,
            accept_rx: Mutex::new(accept_rx),
            closed: AtomicBool::new(false),
            links_failed: AtomicU64::new(0),
            errors: Arc::default(),
            growing: Mutex::default(),
            auth,
            handshakes: AtomicUsize::new(0),
        });
        let weak = Arc::downgrade(&inner);
        std::thread::Builder::new()
            .name("rdma-lane-listen".into())
            .spawn(move || listen_loop(listener, weak))?;
        Ok(MuxTransport { inner })
    }

    /// The lane address actually bound (resolves port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local
    }

    pub fn stats(&self) -> TransportStats {
        let mut s = *self.inner.retired.lock().unwrap();
        s.links_failed = self.inner.links_failed.load(Ordering::Relaxed);
        for l in self
            .inner
            .all
            .lock()
            .unwrap()
            .iter()
            .filter_map(Weak::upgrade)
        {
            if !l.is_failed() {
                s.links_up += 1;
            }
            s.streams_open += l.stream_count() as u64;
            s.add_link_totals(&l.stats);
        }
        s
    }

    /// One line per link with its flow-control state (diagnostics).
    pub fn describe_links(&self) -> Vec<String> {
        let all = self.inner.all.lock().unwrap();
        all.iter()
            .filter_map(Weak::upgrade)
            .map(|l| l.describe())
            .collect()
    }

    /// Stops listening, lets every link deliver what is queued (up to 2 s),
    /// then fails the links: streams still open are reset on both sides.
    pub fn shutdown(&self) {
        if self.inner.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        let links: Vec<_> = self
            .inner
            .all
            .lock()
            .unwrap()
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for l in &links {
            l.drain(Duration::from_secs(2));
        }
        for l in links {
            l.fail(LOCAL_SHUTDOWN);
        }
        self.inner.links.lock().unwrap().clear();
    }

    /// Fails the link to `peer` as if the fabric had broken (tests, and the
    /// daemon when it learns the peer's node is gone).
    pub fn fail_link(&self, peer: SocketAddr, why: &str) -> bool {
        let links = self.inner.links.lock().unwrap().remove(&peer);
        match links {
            Some(links) => {
                for l in links {
                    l.fail(why);
                }
                true
            }
            None => false,
        }
    }

    fn link_to(&self, peer: SocketAddr) -> io::Result<Arc<Link>> {
        let inner = &self.inner;
        let (link, below) = healthy(inner, peer);
        if let Some(l) = link {
            if below {
                grow_in_background(inner, peer);
            }
            return Ok(l);
        }
        let _one_at_a_time = inner.connecting.lock().unwrap();
        if let (Some(l), _) = healthy(inner, peer) {
            return Ok(l);
        }
        connect_link(inner, peer)
    }
}

impl<P: FabricProvider> Drop for MuxTransport<P> {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl<P: FabricProvider> LaneTransport for MuxTransport<P> {
    fn name(&self) -> &'static str {
        self.inner.provider.name()
    }

    fn error_counts(&self) -> Vec<(&'static str, u64)> {
        let e = &self.inner.errors;
        vec![
            ("link_failed", e.link_failed.load(Ordering::Relaxed)),
            (
                "link_setup_failed",
                e.link_setup_failed.load(Ordering::Relaxed),
            ),
            (PEER_UNKNOWN, e.peer_unknown.load(Ordering::Relaxed)),
            (PEER_AUTH_FAILED, e.peer_auth_failed.load(Ordering::Relaxed)),
        ]
    }

    fn open(&self, peer: SocketAddr, key: StreamKey) -> io::Result<Box<dyn LaneStream>> {
        if self.inner.closed.load(Ordering::SeqCst) {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "transport shut down",
            ));
        }
        let link = self.link_to(peer)?;
        Ok(Box::new(link.open_stream(key)?))
    }

    fn accept(&self) -> io::Result<(StreamKey, Box<dyn LaneStream>)> {
        let rx = self.inner.accept_rx.lock().unwrap();
        loop {
            match rx.recv_timeout(Duration::from_millis(250)) {
                Ok(s) => return Ok(s),
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if self.inner.closed.load(Ordering::SeqCst) {
                        return Err(io::Error::new(
                            io::ErrorKind::NotConnected,
                            "transport shut down",
                        ));
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(io::Error::new(
                        io::ErrorKind::NotConnected,
                        "transport shut down",
                    ))
                }
            }
        }
    }
}

/// The least loaded healthy link to `peer`, and whether fewer than
/// `links_per_peer` exist (then another one is worth making, so streams
/// spread over several queue pairs).
fn healthy<P: FabricProvider>(inner: &Inner<P>, peer: SocketAddr) -> (Option<Arc<Link>>, bool) {
    let mut links = inner.links.lock().unwrap();
    let Some(v) = links.get_mut(&peer) else {
        return (None, true);
    };
    v.retain(|l| !l.is_failed());
    if v.is_empty() {
        links.remove(&peer);
        return (None, true);
    }
    let below = v.len() < inner.opts.links_per_peer;
    (v.iter().min_by_key(|l| l.stream_count()).cloned(), below)
}

/// Connects and registers one more link to `peer`.
fn connect_link<P: FabricProvider>(inner: &Inner<P>, peer: SocketAddr) -> io::Result<Arc<Link>> {
    let setup_failed = |e: io::Error| {
        inner
            .errors
            .link_setup_failed
            .fetch_add(1, Ordering::Relaxed);
        e
    };
    let mut sock = crate::lane_auth::connect_from(inner.local, peer, inner.opts.connect_timeout)
        .map_err(setup_failed)?;
    // The peer proves the key before it learns anything about us.
    // (A peer with another key closes the connection without a word: we
    // see an I/O error, counted as a set-up failure; it counts the refusal.)
    match inner.auth.initiate(&mut sock) {
        Ok(()) => {}
        Err(e @ AuthError::Io(_)) => {
            tracing::info!(%peer, error = %e, "RDMA lane handshake with the peer failed");
            return Err(setup_failed(e.into()));
        }
        Err(e) => {
            count_refusal(inner, &e);
            tracing::warn!(%peer, error = %e, "RDMA lane peer not authenticated");
            return Err(e.into());
        }
    }
    let (lane, link) = handshake(inner, sock, true).map_err(setup_failed)?;
    if lane != peer {
        tracing::debug!(%peer, %lane, "peer announces another lane address");
    }
    register(inner, peer, &link);
    Ok(link)
}

/// Makes the extra links to `peer` off the caller's path: an open never
/// waits for a queue pair to come up while a healthy link can carry it
/// (the relay gives a stream 200 ms before it leaves a connection on TCP).
fn grow_in_background<P: FabricProvider>(inner: &Arc<Inner<P>>, peer: SocketAddr) {
    if !inner.growing.lock().unwrap().insert(peer) {
        return; // already under way
    }
    let inner2 = Arc::clone(inner);
    let spawned = std::thread::Builder::new()
        .name("rdma-lane-grow".into())
        .spawn(move || {
            {
                let _one_at_a_time = inner2.connecting.lock().unwrap();
                let (_, below) = healthy(&inner2, peer);
                if below && !inner2.closed.load(Ordering::SeqCst) {
                    if let Err(e) = connect_link(&inner2, peer) {
                        tracing::debug!(%peer, error = %e, "extra RDMA link not made; streams share the existing ones");
                    }
                }
            }
            inner2.growing.lock().unwrap().remove(&peer);
        });
    if spawned.is_err() {
        inner.growing.lock().unwrap().remove(&peer);
    }
}

fn register<P: FabricProvider>(inner: &Inner<P>, peer: SocketAddr, link: &Arc<Link>) {
    let mut all = inner.all.lock().unwrap();
    // Fold the counters of links that are gone into `retired`.
    all.retain(|w| {
        let Some(l) = w.upgrade() else { return false };
        if l.is_failed() && l.stream_count() == 0 {
            inner.links_failed.fetch_add(1, Ordering::Relaxed);
            inner.retired.lock().unwrap().add_link_totals(&l.stats);
            return false;
        }
        true
    });
    all.push(Arc::downgrade(link));
    drop(all);
    // Links the peer opened to us serve our opens to it too. Beyond
    // `links_per_peer` (both daemons opened at once) a link is not offered
    // for new streams but still carries the ones opened over it.
    let mut links = inner.links.lock().unwrap();
    let v = links.entry(peer).or_default();
    v.retain(|l| !l.is_failed());
    if v.len() < inner.opts.links_per_peer {
        v.push(Arc::clone(link));
    }
    if inner.closed.load(Ordering::SeqCst) {
        link.fail(LOCAL_SHUTDOWN);
    }
}

fn listen_loop<P: FabricProvider>(listener: TcpListener, inner: Weak<Inner<P>>) {
    let fd = listener.as_raw_fd();
    loop {
        // Wake every 250 ms to notice shutdown; no CPU is used in between.
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is a valid pollfd for the duration of the call and
        // `fd` stays open: `listener` lives until this function returns.
        let n = unsafe { libc::poll(&mut pfd, 1, 250) };
        let Some(inner) = inner.upgrade() else { return };
        if inner.closed.load(Ordering::SeqCst) {
            return;
        }
        if n <= 0 {
            continue;
        }
        let Ok((mut sock, from)) = listener.accept() else {
            continue;
        };
        // Before anything else: the source must be a node of the table.
        if let Err(e) = inner.auth.admit(from) {
            count_refusal(&inner, &e);
            tracing::info!(%from, error = %e, "lane connection refused");
            continue;
        }
        if inner.handshakes.fetch_add(1, Ordering::AcqRel) >= MAX_HANDSHAKES {
            inner.handshakes.fetch_sub(1, Ordering::AcqRel);
            inner
                .errors
                .peer_auth_failed
                .fetch_add(1, Ordering::Relaxed);
            tracing::info!(%from, "too many lane handshakes at once; connection closed");
            continue;
        }
        let inner2 = Arc::clone(&inner);
        let spawned = std::thread::Builder::new()
            .name("rdma-lane-hs".into())
            .spawn(move || {
                let authed = inner2.auth.respond(&mut sock);
                inner2.handshakes.fetch_sub(1, Ordering::AcqRel);
                if let Err(e) = authed {
                    count_refusal(&inner2, &e);
                    tracing::info!(%from, error = %e, "lane peer not authenticated; connection closed");
                    return;
                }
                match handshake(&inner2, sock, false) {
                    Ok((lane, link)) => register(&inner2, lane, &link),
                    Err(e) => {
                        inner2
                            .errors
                            .link_setup_failed
                            .fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(%from, error = %e, "RDMA lane handshake failed")
                    }
                }
            });
        if let Err(e) = spawned {
            inner.handshakes.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(error = %e, "cannot start a handshake thread");
        }
    }
}

/// Counts a peer the lane refused (`peer_unknown` / `peer_auth_failed`).
fn count_refusal<P: FabricProvider>(inner: &Inner<P>, e: &AuthError) {
    let c = match e.counter() {
        PEER_UNKNOWN => &inner.errors.peer_unknown,
        _ => &inner.errors.peer_auth_failed,
    };
    c.fetch_add(1, Ordering::Relaxed);
}

fn write_msg(sock: &mut TcpStream, v: &impl Serialize) -> io::Result<()> {
    let body = serde_json::to_vec(v).map_err(io::Error::other)?;
    let mut msg = (body.len() as u32).to_le_bytes().to_vec();
    msg.extend_from_slice(&body);
    sock.write_all(&msg)
}

fn read_msg<T: for<'de> Deserialize<'de>>(sock: &mut TcpStream) -> io::Result<T> {
    let mut len = [0u8; 4];
    sock.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_HELLO {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "handshake message too large",
        ));
    }
    let mut body = vec![0u8; len];
    sock.read_exact(&mut body)?;
    serde_json::from_slice(&body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Exchanges hellos, joins the fabric halves, and waits until both sides
/// are ready to receive before any message may flow.
fn handshake<P: FabricProvider>(
    inner: &Inner<P>,
    mut sock: TcpStream,
    initiator: bool,
) -> io::Result<(SocketAddr, Arc<Link>)> {
    sock.set_read_timeout(Some(inner.opts.connect_timeout.max(Duration::from_secs(5))))?;
    sock.set_nodelay(true)?;
    let geometry = inner.opts.geometry();
    let (half, desc) = inner.provider.prepare(geometry)?;
    // Announce where we listen; an unspecified bind address is announced as
    // the address this connection uses.
    let mut lane = inner.local;
    if lane.ip().is_unspecified() {
        lane.set_ip(sock.local_addr()?.ip());
    }
    write_msg(
        &mut sock,
        &Hello {
            protocol: PROTOCOL,
            lane,
            geometry,
            window: inner.opts.stream_window,
            fabric: desc,
        },
    )?;
    let peer: Hello = read_msg(&mut sock)?;
    // A node announces its own lane, not another node's: the link is filed
    // under that address and carries our streams to that node's pods.
    let source = sock.peer_addr()?.ip().to_canonical();
    if !initiator && peer.lane.ip().to_canonical() != source {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the peer at {source} announces the lane {} of another address",
                peer.lane
            ),
        ));
    }
    if peer.protocol != PROTOCOL {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "peer speaks lane protocol {}, we speak {PROTOCOL}",
                peer.protocol
            ),
        ));
    }
    if peer.geometry != geometry {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "peer ring {:?} differs from ours {:?}",
                peer.geometry, geometry
            ),
        ));
    }
    let fabric = inner.provider.connect(half, &peer.fabric)?;
    sock.write_all(b"R")?;
    let mut ready = [0u8; 1];
    sock.read_exact(&mut ready)?;
    if &ready != b"R" {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "bad ready byte"));
    }
    sock.set_read_timeout(None)?;
    let cfg = LinkConfig {
        geometry,
        recv_window: inner.opts.stream_window,
        send_window: peer.window,
        checksums: inner.opts.checksums,
        keepalive: inner.opts.keepalive,
        dead_after: inner.opts.dead_after,
        idle_credit: Duration::from_millis(20),
        odd_ids: initiator,
        errors: Arc::clone(&inner.errors),
    };
    let key = if initiator {
        sock.peer_addr()?
    } else {
        peer.lane
    };
    let link = Link::start(key, fabric, cfg, inner.accept_tx.clone(), sock)?;
    tracing::info!(peer = %key, initiator, "RDMA lane link up");
    Ok((peer.lane, link))
}
