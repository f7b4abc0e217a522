//! The blocking client side of the daemon protocol, used by the preload
//! library (and by `flowlane status`). Plain `std` + `libc`: it runs inside
//! arbitrary application processes, so it never spawns threads, never panics
//! on bad input and bounds every wait with a timeout.
//!
//! INTERFACE CONTRACT between the daemon (owner of `proto.rs` and this file's
//! bodies) and the preload library (caller). Signatures may grow, but change
//! them only together with the callers.
//!
//! Every socket operation here is a raw system call (`libc::syscall`), not a
//! libc wrapper: inside an application the preload library interposes
//! `connect`, `send*`, `recv*` and `close`, and the daemon connection must
//! neither recurse into those wrappers nor be tracked by them. Sends use
//! `MSG_NOSIGNAL`, so a vanished daemon never raises SIGPIPE in the app.
//!
//! After any I/O failure or malformed answer the connection is marked broken
//! (its byte stream may be out of step) and every later call fails fast;
//! open a new client to retry.

use std::io;
use std::net::SocketAddr;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::proto::{
    self, ChannelGrant, ErrorCode, NoChannelReason, Request, Response, Stats, StockGrant,
};

pub use crate::proto::FallbackReason;

/// A brokered shared-memory channel for one TCP connection.
#[derive(Debug)]
pub struct Channel {
    /// Daemon-wide unique id of the channel (for reports and logs).
    pub id: u64,
    /// The memfd holding the channel's whole region (both ring directions and
    /// their headers), sealed against shrinking. Layout: `crate::ring`.
    pub memfd: OwnedFd,
    /// Length of the region in bytes.
    pub len: usize,
}

/// A stock channel the daemon granted (docs/shm-lane.md, "Pre-created
/// channels").
#[derive(Debug)]
pub struct Granted {
    pub channel: Channel,
    /// The client pod's address it was made for (a server uses it only for
    /// connections from there).
    pub client: std::net::IpAddr,
}

/// The answer to a stock intent or claim: this connection's channel, if
/// any, and the stock granted with it.
#[derive(Debug, Default)]
pub struct WithStock {
    pub channel: Option<Channel>,
    pub stock: Vec<Granted>,
}

/// One connection to the node daemon.
pub struct DaemonClient {
    fd: RawFd,
    timeout: Duration,
    broken: bool,
    /// The failure that broke the connection was a timeout (the daemon is
    /// wedged, not gone: a caller must not retry at once).
    timed_out: bool,
    path_hash: u64,
    /// The daemon answered a stock op as unknown: it predates stock, and
    /// this connection asks it the relayable way from then on.
    no_stock: bool,
}

/// How long a daemon that timed out is skipped by [`DaemonClient::connect`].
pub const BACKOFF: Duration = Duration::from_secs(1);

/// Process-wide memory of the last daemon that timed out: plain atomics
/// (no lock: this runs inside arbitrary applications, across fork).
mod backoff {
    use std::path::Path;
    use std::sync::atomic::{AtomicU64, Ordering};

    static PATH: AtomicU64 = AtomicU64::new(0);
    static UNTIL_MS: AtomicU64 = AtomicU64::new(0);

    /// FNV-1a of the socket path (0 is reserved for "none").
    pub fn hash(path: &Path) -> u64 {
        use std::os::unix::ffi::OsStrExt;
        let h = path
            .as_os_str()
            .as_bytes()
            .iter()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
            });
        h.max(1)
    }

    fn now_ms() -> u64 {
        super::monotonic_ms()
    }

    pub fn active(path: u64) -> bool {
        PATH.load(Ordering::Relaxed) == path && now_ms() < UNTIL_MS.load(Ordering::Relaxed)
    }

    pub fn start(path: u64) {
        UNTIL_MS.store(
            now_ms() + super::BACKOFF.as_millis() as u64,
            Ordering::Relaxed,
        );
        PATH.store(path, Ordering::Relaxed);
    }
}

/// Milliseconds of CLOCK_MONOTONIC (the same clock in every process of
/// the node).
pub(crate) fn monotonic_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into a valid timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).saturating_mul(1000) + ts.tv_nsec as u64 / 1_000_000
}

/// Most fds one response may carry (a channel and a full batch of stock);
/// extra ones are closed.
const MAX_FDS: usize = 1 + proto::MAX_STOCK_GRANTS;

impl DaemonClient {
    /// Connects to the daemon's Unix socket; fails fast when no daemon listens.
    ///
    /// After a daemon at this path failed to answer in time, connects to it
    /// fail at once (`TimedOut`) for [`BACKOFF`]: a wedged daemon must not
    /// add a full timeout to every connection of every application.
    pub fn connect(socket: &Path, timeout: Duration) -> io::Result<Self> {
        Self::connect_at(socket, timeout, None)
    }

    /// [`Self::connect`] with the socket placed at the lowest free fd number
    /// at or above `min_fd` (close-on-exec), for a connection that a
    /// process keeps open: it stays out of the range an application expects
    /// its own fds in. Falls back to any number if none is free there.
    pub fn connect_at(socket: &Path, timeout: Duration, min_fd: Option<RawFd>) -> io::Result<Self> {
        let addr = unix_addr(socket)?;
        let path_hash = backoff::hash(socket);
        if backoff::active(path_hash) {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "flowlaned timed out moments ago; not asking it for a moment",
            ));
        }
        // Zero means "forever" to SO_*TIMEO: never allow that.
        let timeout = timeout.max(Duration::from_millis(1));
        let fd = sys::socket_unix_stream()?;
        let mut client = DaemonClient {
            fd,
            timeout,
            broken: false,
            timed_out: false,
            path_hash,
            no_stock: false,
        };
        // Dropping `client` on error closes the fd.
        sys::set_timeouts(fd, timeout)?;
        sys::connect(fd, &addr).inspect_err(|e| {
            if e.kind() == io::ErrorKind::TimedOut {
                backoff::start(path_hash);
            }
        })?;
        if let Some(min) = min_fd {
            // Only once connected: a failed connect (no daemon) costs no
            // extra system calls.
            client.fd = sys::move_up(fd, min);
        }
        Ok(client)
    }

    /// The per-call timeout this client was created with.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// True after a failure left the connection unusable.
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// True if the failure that broke the connection was a timeout.
    pub fn timed_out(&self) -> bool {
        self.timed_out
    }

    /// The connection's socket (for a caller that keeps the client and
    /// watches its fd).
    pub fn raw_fd(&self) -> RawFd {
        self.fd
    }

    /// For a connection kept between requests: true if the daemon closed
    /// its end (idle timeout, restart) or something unasked-for is waiting
    /// to be read; either way the connection must not be used again.
    pub fn looks_closed(&self) -> bool {
        sys::readable_now(self.fd)
    }

    /// Gives the socket up without closing it: the fd number no longer
    /// belongs to this client (the application closed or replaced it, or
    /// this is a forked child whose copy was already closed).
    pub fn forget(self) {
        std::mem::forget(self);
    }

    /// The calling process's pod listens on `addr` (0.0.0.0/:: = all its IPs).
    pub fn register_listener(&mut self, addr: SocketAddr) -> io::Result<()> {
        self.expect_ok(&Request::RegisterListener { addr })
    }

    /// The listener on `addr` closed.
    pub fn unregister_listener(&mut self, addr: SocketAddr) -> io::Result<()> {
        self.expect_ok(&Request::UnregisterListener { addr })
    }

    /// Called by a client BEFORE its TCP connect, with its bound source
    /// address: `Some(channel)` when `dst` is a co-located pod with a
    /// flowlane listener (the connection then uses the ring from its first
    /// byte), `None` to stay on TCP. `region_len` is the requested size.
    ///
    /// `src` may have an unspecified IP (socket bound to 0.0.0.0:port): the
    /// daemon then uses the calling pod's address facing `dst`. When the
    /// answer is `None` the daemon has already counted the fallback; do not
    /// also `report_fallback` it.
    pub fn connect_intent(
        &mut self,
        src: SocketAddr,
        dst: SocketAddr,
        region_len: usize,
    ) -> io::Result<Option<Channel>> {
        let req = Request::ConnectIntent {
            src,
            dst,
            region_len: region_len as u64,
        };
        self.expect_channel(&req)
    }

    /// The client's connect failed after `connect_intent`: drop the channel.
    pub fn cancel_intent(&mut self, channel_id: u64) -> io::Result<()> {
        self.expect_ok(&Request::CancelIntent { channel_id })
    }

    /// Called by a server right after `accept`: the channel the client
    /// `peer` announced for its connection to our `local` address, if any.
    pub fn claim_accepted(
        &mut self,
        local: SocketAddr,
        peer: SocketAddr,
    ) -> io::Result<Option<Channel>> {
        self.expect_channel(&Request::ClaimAccepted { local, peer })
    }

    /// [`Self::connect_intent`] naming the caller's socket (its fd number in
    /// this process), so that a daemon with a cross-node lane can carry the
    /// connection to a pod on another node. A daemon that predates the op
    /// answers `bad-request`; then the classic intent is sent instead.
    pub fn connect_intent_relayable(
        &mut self,
        src: SocketAddr,
        dst: SocketAddr,
        region_len: usize,
        socket_fd: i32,
    ) -> io::Result<Option<Channel>> {
        let req = Request::RelayableIntent {
            src,
            dst,
            region_len: region_len as u64,
            socket_fd,
        };
        match self.call(&req)? {
            (Response::Error { code, message }, _) if is_unknown_op(code, &message) => {
                self.connect_intent(src, dst, region_len)
            }
            answer => self.channel_from(answer),
        }
    }

    /// [`Self::claim_accepted`] naming the accepted socket's fd number (see
    /// [`Self::connect_intent_relayable`]).
    pub fn claim_accepted_relayable(
        &mut self,
        local: SocketAddr,
        peer: SocketAddr,
        socket_fd: i32,
    ) -> io::Result<Option<Channel>> {
        let req = Request::RelayableClaim {
            local,
            peer,
            socket_fd,
        };
        match self.call(&req)? {
            (Response::Error { code, message }, _) if is_unknown_op(code, &message) => {
                self.claim_accepted(local, peer)
            }
            answer => self.channel_from(answer),
        }
    }

    /// [`Self::connect_intent_relayable`] that also asks for up to `want`
    /// stock channels for later connections to `dst`
    /// ([`Request::StockIntent`]). A daemon that predates the op gets the
    /// relayable intent instead (no stock).
    pub fn stock_intent(
        &mut self,
        src: SocketAddr,
        dst: SocketAddr,
        region_len: usize,
        socket_fd: i32,
        want: u32,
    ) -> io::Result<WithStock> {
        if self.no_stock {
            return Ok(WithStock {
                channel: self.connect_intent_relayable(src, dst, region_len, socket_fd)?,
                stock: Vec::new(),
            });
        }
        let req = Request::StockIntent {
            src,
            dst,
            region_len: region_len as u64,
            socket_fd,
            want: want.min(proto::MAX_STOCK_GRANTS as u32),
        };
        match self.call(&req)? {
            (Response::Error { code, message }, _) if is_unknown_op(code, &message) => {
                self.no_stock = true;
                Ok(WithStock {
                    channel: self.connect_intent_relayable(src, dst, region_len, socket_fd)?,
                    stock: Vec::new(),
                })
            }
            answer => self.stocked_from(answer),
        }
    }

    /// [`Self::claim_accepted_relayable`] from a server that takes stock
    /// ([`Request::StockClaim`]). A daemon that predates the op gets the
    /// relayable claim instead.
    pub fn stock_claim(
        &mut self,
        local: SocketAddr,
        peer: SocketAddr,
        socket_fd: i32,
    ) -> io::Result<WithStock> {
        if self.no_stock {
            return Ok(WithStock {
                channel: self.claim_accepted_relayable(local, peer, socket_fd)?,
                stock: Vec::new(),
            });
        }
        let req = Request::StockClaim {
            local,
            peer,
            socket_fd,
        };
        match self.call(&req)? {
            (Response::Error { code, message }, _) if is_unknown_op(code, &message) => {
                self.no_stock = true;
                Ok(WithStock {
                    channel: self.claim_accepted_relayable(local, peer, socket_fd)?,
                    stock: Vec::new(),
                })
            }
            answer => self.stocked_from(answer),
        }
    }

    /// One way: this server attached stock channel `channel_id` to the
    /// connection it accepted on `local` from `peer`.
    pub fn stock_taken(
        &mut self,
        channel_id: u64,
        local: SocketAddr,
        peer: SocketAddr,
    ) -> io::Result<()> {
        self.send_one_way(&Request::StockTaken {
            channel_id,
            local,
            peer,
        })
    }

    /// Sends [`Request::StockRefill`] without reading its answer: read it
    /// with [`Self::recv_stock_ahead`] before any other request on this
    /// connection. Not sent to a daemon known to predate stock.
    pub fn send_stock_refill(&mut self, dst: SocketAddr, want: u32) -> io::Result<()> {
        let want = want.min(proto::MAX_STOCK_GRANTS as u32);
        self.send_ahead(&Request::StockRefill { dst, want })
    }

    /// Sends [`Request::StockFetch`] without reading its answer (as
    /// [`Self::send_stock_refill`]).
    pub fn send_stock_fetch(&mut self, local: SocketAddr) -> io::Result<()> {
        self.send_ahead(&Request::StockFetch { local })
    }

    fn send_ahead(&mut self, req: &Request) -> io::Result<()> {
        if self.no_stock {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "the daemon predates stock",
            ));
        }
        self.guarded(|c| c.send_frame(req, Instant::now() + c.timeout))
    }

    /// True when the answer to a request sent ahead can be read without
    /// waiting (or the daemon closed the connection).
    pub fn answer_waiting(&self) -> bool {
        sys::readable_now(self.fd)
    }

    /// Reads the answer to [`Self::send_stock_refill`] or
    /// [`Self::send_stock_fetch`] (waiting for it up to the timeout): the
    /// stock it grants, each fd checked like a channel's. A refusal or an
    /// older daemon's `bad-request` grants none (and no more is sent
    /// ahead to an older daemon).
    pub fn recv_stock_ahead(&mut self) -> io::Result<Vec<Granted>> {
        let answer = self.guarded(|c| {
            let deadline = Instant::now() + c.timeout;
            c.recv_answer(deadline)
        })?;
        match answer {
            (Response::Error { code, message }, _) => {
                if is_unknown_op(code, &message) {
                    self.no_stock = true;
                }
                Ok(Vec::new())
            }
            (Response::Stocked { channel: None, .. }, _) => Ok(self.stocked_from(answer)?.stock),
            (other, _) => Err(self.unexpected_kind(other)),
        }
    }

    /// [`Self::connect_intent`] for a Service IP `dst` (the peer table's
    /// Service ranges): a channel when the Service may have a lane behind
    /// it; after connect, [`Self::resolve_service`] says whether it does.
    pub fn service_intent(
        &mut self,
        src: SocketAddr,
        dst: SocketAddr,
        region_len: usize,
    ) -> io::Result<Option<Channel>> {
        self.expect_channel(&Request::ServiceIntent {
            src,
            dst,
            region_len: region_len as u64,
        })
    }

    /// After the connect of service channel `channel_id` on socket
    /// `socket_fd`: true when its backend is a local pod with a flowlane
    /// listener or a relayed pod of another node (wait for the attach),
    /// false to stay on TCP now (the daemon dropped the channel and
    /// counted why).
    pub fn resolve_service(&mut self, channel_id: u64, socket_fd: i32) -> io::Result<bool> {
        let req = Request::ResolveService {
            channel_id,
            socket_fd: Some(socket_fd),
        };
        let answer = match self.call(&req)? {
            // A daemon that predates `socket_fd` refuses the field (its
            // requests deny unknown fields): ask again as it knows the op;
            // it then resolves local backends only.
            (Response::Error { code, message }, _) if is_unknown_field(code, &message) => self
                .call(&Request::ResolveService {
                    channel_id,
                    socket_fd: None,
                })?,
            answer => answer,
        };
        match answer {
            (Response::Ok, _) => Ok(true),
            (Response::NoChannel { .. }, _) => Ok(false),
            (other, _) => Err(self.unexpected(other)),
        }
    }

    /// A channel ended; `sent`/`received` are the application bytes moved.
    pub fn report_closed(&mut self, channel_id: u64, sent: u64, received: u64) -> io::Result<()> {
        self.expect_ok(&Request::ReportClosed {
            channel_id,
            sent,
            received,
        })
    }

    /// [`Self::report_closed`] without waiting: the report is written to
    /// the socket and the daemon sends no answer
    /// ([`Request::ReportClosedOneWay`]).
    pub fn report_closed_one_way(
        &mut self,
        channel_id: u64,
        sent: u64,
        received: u64,
    ) -> io::Result<()> {
        self.send_one_way(&Request::ReportClosedOneWay {
            channel_id,
            sent,
            received,
        })
    }

    /// Writes a one-way request (no answer is read: none comes).
    pub fn send_one_way(&mut self, req: &Request) -> io::Result<()> {
        if !req.is_one_way() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the daemon answers this request: use `call`",
            ));
        }
        self.guarded(|c| c.send_frame(req, Instant::now() + c.timeout))
    }

    /// A connection stayed on TCP for `reason`.
    pub fn report_fallback(&mut self, reason: FallbackReason) -> io::Result<()> {
        self.expect_ok(&Request::ReportFallback { reason })
    }

    /// Asks the daemon to reread the pod registry.
    pub fn registry_changed(&mut self) -> io::Result<()> {
        self.expect_ok(&Request::RegistryChanged)
    }

    /// The daemon's counters, connections and listeners (allowed from the
    /// node, refused to pods).
    pub fn stats(&mut self) -> io::Result<Stats> {
        match self.call(&Request::Stats)? {
            (Response::Stats { stats }, _) => Ok(*stats),
            (other, _) => Err(self.unexpected(other)),
        }
    }

    /// Sends one request and reads its answer (and any fds that came with
    /// it). Public for tests and tools; the typed methods are the API.
    pub fn call(&mut self, req: &Request) -> io::Result<(Response, Vec<OwnedFd>)> {
        self.guarded(|c| c.call_inner(req))
    }

    /// Runs one exchange on a connection that is not broken; a failure
    /// breaks it (and a timeout starts the process-wide backoff).
    fn guarded<R>(&mut self, f: impl FnOnce(&mut Self) -> io::Result<R>) -> io::Result<R> {
        if self.broken {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "daemon connection is broken",
            ));
        }
        let result = f(self);
        if let Err(e) = &result {
            self.broken = true;
            if e.kind() == io::ErrorKind::TimedOut {
                self.timed_out = true;
                backoff::start(self.path_hash);
            }
        }
        result
    }

    fn call_inner(&mut self, req: &Request) -> io::Result<(Response, Vec<OwnedFd>)> {
        let deadline = Instant::now() + self.timeout;
        self.send_frame(req, deadline)?;
        self.recv_answer(deadline)
    }

    /// Writes `req`'s frame (the caller reads the answer, if any).
    fn send_frame(&mut self, req: &Request, deadline: Instant) -> io::Result<()> {
        let frame = proto::encode_frame(req, proto::MAX_REQUEST_FRAME).map_err(invalid_data)?;
        sys::send_all(self.fd, &frame, deadline)
    }

    fn recv_answer(&mut self, deadline: Instant) -> io::Result<(Response, Vec<OwnedFd>)> {
        let mut fds = Vec::new();
        let mut header = [0u8; proto::HEADER_LEN];
        sys::recv_exact(self.fd, &mut header, &mut fds, deadline)?;
        let len = proto::frame_len(header, proto::MAX_RESPONSE_FRAME).map_err(invalid_data)?;
        let mut body = vec![0u8; len];
        sys::recv_exact(self.fd, &mut body, &mut fds, deadline)?;
        let resp = proto::decode_response(&body).map_err(invalid_data)?;
        Ok((resp, fds))
    }

    fn expect_ok(&mut self, req: &Request) -> io::Result<()> {
        match self.call(req)? {
            (Response::Ok, _) => Ok(()),
            (other, _) => Err(self.unexpected(other)),
        }
    }

    fn expect_channel(&mut self, req: &Request) -> io::Result<Option<Channel>> {
        let answer = self.call(req)?;
        self.channel_from(answer)
    }

    fn channel_from(&mut self, answer: (Response, Vec<OwnedFd>)) -> io::Result<Option<Channel>> {
        match answer {
            (Response::Channel { id, len }, mut fds) => {
                let len = usize::try_from(len).map_err(|_| {
                    self.broken = true;
                    invalid_data("channel length does not fit in memory")
                })?;
                if fds.len() != 1 {
                    self.broken = true;
                    return Err(invalid_data(format!(
                        "channel answer carried {} fds instead of 1",
                        fds.len()
                    )));
                }
                let memfd = fds.remove(0);
                if let Err(e) = sys::check_sealed_region(&memfd, len) {
                    self.broken = true;
                    return Err(e);
                }
                Ok(Some(Channel { id, memfd, len }))
            }
            (Response::NoChannel { reason }, _) => {
                let _: NoChannelReason = reason;
                Ok(None)
            }
            (other, _) => Err(self.unexpected(other)),
        }
    }

    /// A stock answer (or any answer of a relayable intent or claim),
    /// every fd checked like a channel's.
    fn stocked_from(&mut self, answer: (Response, Vec<OwnedFd>)) -> io::Result<WithStock> {
        let (channel, stock, fds) = match answer {
            (Response::Stocked { channel, stock }, fds) => (channel, stock, fds),
            other => {
                return Ok(WithStock {
                    channel: self.channel_from(other)?,
                    stock: Vec::new(),
                })
            }
        };
        let want = usize::from(channel.is_some()) + stock.len();
        if stock.len() > proto::MAX_STOCK_GRANTS || fds.len() != want {
            self.broken = true;
            return Err(invalid_data(format!(
                "stock answer carried {} fds for {want} channels",
                fds.len()
            )));
        }
        let mut fds = fds.into_iter();
        let mut take = |c: &mut Self, id: u64, len: u64| -> io::Result<Channel> {
            let memfd = fds.next().ok_or_else(|| invalid_data("missing fd"))?;
            let len = usize::try_from(len)
                .map_err(|_| invalid_data("channel length does not fit in memory"))?;
            sys::check_sealed_region(&memfd, len).inspect_err(|_| c.broken = true)?;
            Ok(Channel { id, memfd, len })
        };
        let channel = match channel {
            Some(ChannelGrant { id, len }) => Some(take(self, id, len)?),
            None => None,
        };
        let mut granted = Vec::with_capacity(stock.len());
        for StockGrant { id, len, client } in stock {
            granted.push(Granted {
                channel: take(self, id, len)?,
                client,
            });
        }
        Ok(WithStock {
            channel,
            stock: granted,
        })
    }

    /// An answer of the wrong kind: the stream is out of step.
    fn unexpected_kind(&mut self, resp: Response) -> io::Error {
        self.broken = true;
        invalid_data(format!("unexpected daemon answer {resp:?}"))
    }

    /// Turns an error answer (or an answer of the wrong kind) into io::Error.
    fn unexpected(&mut self, resp: Response) -> io::Error {
        match resp {
            Response::Error { code, message } => {
                let kind = match code {
                    ErrorCode::UnknownPod | ErrorCode::Forbidden => io::ErrorKind::PermissionDenied,
                    ErrorCode::TooLarge | ErrorCode::BadRequest => io::ErrorKind::InvalidInput,
                    ErrorCode::Internal => io::ErrorKind::Other,
                };
                io::Error::new(kind, format!("flowlaned: {message}"))
            }
            other => {
                self.broken = true;
                invalid_data(format!("unexpected daemon answer {other:?}"))
            }
        }
    }
}

impl Drop for DaemonClient {
    fn drop(&mut self) {
        sys::close(self.fd);
    }
}

/// An older daemon's answer to an op it does not know (serde names the
/// unknown variant in its decoding error).
fn is_unknown_op(code: ErrorCode, message: &str) -> bool {
    code == ErrorCode::BadRequest && message.contains("unknown variant")
}

/// An older daemon's refusal of a portless intent (source port 0 with the
/// socket named, `flowlaned`'s broker/channels.rs): the caller binds its
/// socket and asks again.
pub fn is_portless_refused(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::InvalidInput && e.to_string().contains("port 0 in an intent")
}

/// An older daemon's answer to a field added to an op it knows.
fn is_unknown_field(code: ErrorCode, message: &str) -> bool {
    code == ErrorCode::BadRequest && message.contains("unknown field")
}

fn invalid_data(e: impl ToString) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}

fn unix_addr(path: &Path) -> io::Result<libc::sockaddr_un> {
    // SAFETY: sockaddr_un is plain old data; all-zero is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    // Leave room for the terminating NUL.
    if bytes.is_empty() || bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "daemon socket path is empty, too long or contains NUL",
        ));
    }
    for (dst, src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    Ok(addr)
}

/// Raw system calls on the daemon socket (see the module comment for why).
mod sys {
    use super::*;

    fn check(ret: libc::c_long) -> io::Result<libc::c_long> {
        if ret < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(ret)
        }
    }

    pub fn socket_unix_stream() -> io::Result<RawFd> {
        // SAFETY: socket(2) with constant arguments; no memory is passed.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_socket,
                libc::AF_UNIX,
                libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
                0,
            )
        };
        Ok(check(ret)? as RawFd)
    }

    /// `fd` duplicated to the lowest free number >= `min` (close-on-exec)
    /// and the original closed; `fd` itself if that is not possible.
    pub fn move_up(fd: RawFd, min: RawFd) -> RawFd {
        if fd >= min {
            return fd;
        }
        // SAFETY: fcntl(F_DUPFD_CLOEXEC) on an fd we own; no memory is passed.
        let high = unsafe { libc::syscall(libc::SYS_fcntl, fd, libc::F_DUPFD_CLOEXEC, min) };
        if high < 0 {
            return fd;
        }
        close(fd);
        high as RawFd
    }

    /// Whether `fd` is readable (or hung up) right now, without waiting.
    pub fn readable_now(fd: RawFd) -> bool {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN | libc::POLLRDHUP,
            revents: 0,
        };
        let ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `p` and `ts` are valid for the call; no signal mask.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_ppoll,
                &mut p as *mut libc::pollfd,
                1,
                &ts as *const libc::timespec,
                std::ptr::null::<libc::sigset_t>(),
                0,
            )
        };
        ret != 0
    }

    pub fn set_timeouts(fd: RawFd, timeout: Duration) -> io::Result<()> {
        let tv = libc::timeval {
            tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
            tv_usec: timeout.subsec_micros() as libc::suseconds_t,
        };
        for opt in [libc::SO_SNDTIMEO, libc::SO_RCVTIMEO] {
            // SAFETY: `tv` is a valid timeval that outlives the call and its
            // exact size is passed.
            let ret = unsafe {
                libc::syscall(
                    libc::SYS_setsockopt,
                    fd,
                    libc::SOL_SOCKET,
                    opt,
                    &tv as *const libc::timeval,
                    std::mem::size_of::<libc::timeval>() as libc::socklen_t,
                )
            };
            check(ret)?;
        }
        Ok(())
    }

    pub fn connect(fd: RawFd, addr: &libc::sockaddr_un) -> io::Result<()> {
        let mut retried = false;
        loop {
            // SAFETY: `addr` is a valid sockaddr_un and its size is passed.
            let ret = unsafe {
                libc::syscall(
                    libc::SYS_connect,
                    fd,
                    addr as *const libc::sockaddr_un,
                    std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
                )
            };
            match check(ret) {
                Ok(_) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => retried = true,
                // A retried connect that meanwhile completed.
                Err(e) if retried && e.raw_os_error() == Some(libc::EISCONN) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "flowlaned is not accepting connections",
                    ))
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn timed_out() -> io::Error {
        io::Error::new(io::ErrorKind::TimedOut, "flowlaned did not answer in time")
    }

    fn past(deadline: Instant) -> io::Result<()> {
        if Instant::now() >= deadline {
            Err(timed_out())
        } else {
            Ok(())
        }
    }

    fn is_timeout(e: &io::Error) -> bool {
        matches!(e.raw_os_error(), Some(libc::EAGAIN))
    }

    pub fn send_all(fd: RawFd, mut buf: &[u8], deadline: Instant) -> io::Result<()> {
        while !buf.is_empty() {
            // SAFETY: `buf` is a valid readable slice of the given length.
            let ret = unsafe {
                libc::syscall(
                    libc::SYS_sendto,
                    fd,
                    buf.as_ptr(),
                    buf.len(),
                    libc::MSG_NOSIGNAL,
                    std::ptr::null::<libc::sockaddr>(),
                    0,
                )
            };
            match check(ret) {
                Ok(n) => buf = buf.get(n as usize..).unwrap_or(&[]),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) if is_timeout(&e) => return Err(timed_out()),
                Err(e) => return Err(e),
            }
            if !buf.is_empty() {
                past(deadline)?;
            }
        }
        Ok(())
    }

    /// Fills `buf` completely, collecting fds from SCM_RIGHTS data.
    pub fn recv_exact(
        fd: RawFd,
        buf: &mut [u8],
        fds: &mut Vec<OwnedFd>,
        deadline: Instant,
    ) -> io::Result<()> {
        let mut filled = 0;
        while filled < buf.len() {
            let rest = &mut buf[filled..];
            match recv_some(fd, rest, fds) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "flowlaned closed the connection",
                    ))
                }
                Ok(n) => filled += n,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) if is_timeout(&e) => return Err(timed_out()),
                Err(e) => return Err(e),
            }
            if filled < buf.len() {
                past(deadline)?;
            }
        }
        Ok(())
    }

    /// One recvmsg(2); received fds are owned (and closed when dropped).
    fn recv_some(fd: RawFd, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
        // Aligned space for one SCM_RIGHTS message with up to MAX_FDS fds.
        let mut cmsg_space = [0u64; 16];
        let cmsg_bytes = std::mem::size_of_val(&cmsg_space);
        // SAFETY: CMSG_SPACE is a pure size computation.
        let needed =
            unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) } as usize;
        debug_assert!(needed <= cmsg_bytes);
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: msghdr is plain old data; all-zero is valid.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cmsg_space.as_mut_ptr().cast();
        msg.msg_controllen = needed.min(cmsg_bytes) as _;
        // SAFETY: `msg` points at a valid iovec over `buf` and at a control
        // buffer of `msg_controllen` bytes; both outlive the call.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_recvmsg,
                fd,
                &mut msg as *mut libc::msghdr,
                libc::MSG_CMSG_CLOEXEC,
            )
        };
        let n = check(ret)? as usize;
        // SAFETY: the kernel filled `msg`'s control area; the CMSG_* macros
        // walk it within `msg_controllen`, and every SCM_RIGHTS payload is an
        // array of fds that now belong to this process.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(cmsg) as *const RawFd;
                    let payload =
                        ((*cmsg).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize);
                    let count = payload / std::mem::size_of::<RawFd>();
                    for i in 0..count {
                        let raw = std::ptr::read_unaligned(data.add(i));
                        fds.push(OwnedFd::from_raw_fd(raw));
                    }
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(invalid_data("daemon sent more fds than expected"));
        }
        Ok(n)
    }

    /// The daemon's fd must be a sealed memfd of at least `len` bytes: a
    /// region that one end could shrink would SIGBUS the other's mapping.
    pub fn check_sealed_region(fd: &OwnedFd, len: usize) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let fd = fd.as_raw_fd();
        // SAFETY: fcntl(F_GET_SEALS) on an fd we own; no memory is passed.
        let seals = unsafe { libc::syscall(libc::SYS_fcntl, fd, libc::F_GET_SEALS) };
        if seals < 0 {
            return Err(invalid_data("the channel fd is not a sealable memfd"));
        }
        let needed = (libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL) as libc::c_long;
        if seals & needed != needed {
            return Err(invalid_data(
                "the channel memfd is not sealed against shrinking",
            ));
        }
        // SAFETY: lseek on an fd we own (the offset is irrelevant: the
        // region is only ever mapped, never read through the fd).
        let size = unsafe { libc::syscall(libc::SYS_lseek, fd, 0 as libc::off_t, libc::SEEK_END) };
        if size < 0 || (size as u64) < len as u64 {
            return Err(invalid_data("the channel memfd is smaller than announced"));
        }
        Ok(())
    }

    pub fn close(fd: RawFd) {
        // SAFETY: `fd` is owned by the DaemonClient being dropped; the return
        // value is irrelevant (the fd is gone either way on Linux).
        unsafe {
            libc::syscall(libc::SYS_close, fd);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::net::UnixListener;

    fn temp_socket(name: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("fl-client-{}-{name}.sock", std::process::id()));
        let _ = std::fs::remove_file(&p);
        p
    }

    #[test]
    fn no_daemon_fails_fast() {
        let p = temp_socket("none");
        let t = Instant::now();
        let err = DaemonClient::connect(&p, Duration::from_secs(5))
            .err()
            .expect("no daemon");
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        assert!(t.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn silent_daemon_times_out_and_breaks_the_client() {
        let p = temp_socket("silent");
        let listener = UnixListener::bind(&p).unwrap();
        let mut c = DaemonClient::connect(&p, Duration::from_millis(100)).unwrap();
        let (_conn, _) = listener.accept().unwrap();
        let err = c
            .register_listener("10.0.0.1:80".parse().unwrap())
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(c.is_broken());
        assert_eq!(
            c.report_fallback(FallbackReason::Unsupported)
                .unwrap_err()
                .kind(),
            io::ErrorKind::NotConnected
        );
        // The wedged daemon is skipped for a moment: no second wait.
        let err = DaemonClient::connect(&p, Duration::from_secs(5))
            .err()
            .unwrap();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(err.to_string().contains("moments ago"), "{err}");
        std::thread::sleep(BACKOFF);
        assert!(DaemonClient::connect(&p, Duration::from_secs(5)).is_ok());
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn garbage_answer_is_an_error_not_a_panic() {
        let p = temp_socket("garbage");
        let listener = UnixListener::bind(&p).unwrap();
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut req = [0u8; 64];
            let _ = conn.read(&mut req);
            conn.write_all(&[5, 0, 0, 0, b'x', b'y']).unwrap();
            conn.write_all(b"zzz").unwrap();
        });
        let mut c = DaemonClient::connect(&p, Duration::from_secs(5)).unwrap();
        let err = c.stats().unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
        server.join().unwrap();
        let _ = std::fs::remove_file(&p);
    }

    /// sendmsg(2) of `buf` with one fd in SCM_RIGHTS (test side).
    fn send_with_fd(sock: RawFd, buf: &[u8], fd: RawFd) {
        let mut space = [0u64; 8];
        let mut iov = libc::iovec {
            iov_base: buf.as_ptr() as *mut libc::c_void,
            iov_len: buf.len(),
        };
        // SAFETY: building a msghdr over live local buffers; the CMSG
        // macros stay within `space`, which holds one SCM_RIGHTS message.
        unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = space.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) as _;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(cmsg) as *mut RawFd, fd);
            assert_eq!(libc::sendmsg(sock, &msg, 0), buf.len() as isize);
        }
    }

    /// A fake daemon that answers one request with a channel carrying `fd`.
    fn fake_channel_daemon(name: &str, fd: OwnedFd, len: u64) -> std::path::PathBuf {
        use std::os::fd::AsRawFd;
        let p = temp_socket(name);
        let listener = UnixListener::bind(&p).unwrap();
        std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut hdr = [0u8; 4];
            conn.read_exact(&mut hdr).unwrap();
            let mut body = vec![0u8; u32::from_le_bytes(hdr) as usize];
            conn.read_exact(&mut body).unwrap();
            let frame =
                proto::encode_frame(&Response::Channel { id: 1, len }, proto::MAX_RESPONSE_FRAME)
                    .unwrap();
            send_with_fd(conn.as_raw_fd(), &frame, fd.as_raw_fd());
        });
        p
    }

    /// A daemon of the protocol before `resolve-service` carried
    /// `socket_fd` refuses the field; the client asks again without it.
    #[test]
    fn resolve_service_asks_an_older_daemon_without_the_socket_fd() {
        #[derive(serde::Deserialize)]
        #[serde(tag = "op", rename_all = "kebab-case", deny_unknown_fields)]
        enum OldRequest {
            ResolveService { channel_id: u64 },
        }
        let p = temp_socket("old-resolve");
        let listener = UnixListener::bind(&p).unwrap();
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut seen = Vec::new();
            for _ in 0..2 {
                let mut hdr = [0u8; 4];
                conn.read_exact(&mut hdr).unwrap();
                let mut body = vec![0u8; u32::from_le_bytes(hdr) as usize];
                conn.read_exact(&mut body).unwrap();
                let answer = match serde_json::from_slice::<OldRequest>(&body) {
                    Ok(OldRequest::ResolveService { channel_id }) => {
                        seen.push(channel_id);
                        Response::Ok
                    }
                    // As flowlaned answers a request it cannot decode.
                    Err(e) => Response::error(ErrorCode::BadRequest, e.to_string()),
                };
                let frame = proto::encode_frame(&answer, proto::MAX_RESPONSE_FRAME).unwrap();
                conn.write_all(&frame).unwrap();
            }
            seen
        });
        let mut c = DaemonClient::connect(&p, Duration::from_secs(5)).unwrap();
        assert!(c.resolve_service(7, 3).unwrap());
        assert!(!c.is_broken());
        assert_eq!(server.join().unwrap(), vec![7]);
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn channels_must_be_sealed_memfds_of_the_announced_size() {
        let claim = |p: &Path| {
            DaemonClient::connect(p, Duration::from_secs(5))
                .unwrap()
                .claim_accepted(
                    "10.0.0.1:80".parse().unwrap(),
                    "10.0.0.2:4000".parse().unwrap(),
                )
        };
        // A plain file: not a memfd.
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        let p = fake_channel_daemon("notmemfd", file.into(), 4096);
        let e = claim(&p).unwrap_err();
        assert!(e.to_string().contains("not a sealable memfd"), "{e}");
        // An unsealed memfd.
        let name = c"fl-test";
        // SAFETY: memfd_create with a valid name.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        // SAFETY: a fresh fd we own.
        let unsealed = unsafe { OwnedFd::from_raw_fd(raw) };
        let f = std::fs::File::from(unsealed.try_clone().unwrap());
        f.set_len(8192).unwrap();
        let p2 = fake_channel_daemon("unsealed", unsealed, 8192);
        let e = claim(&p2).unwrap_err();
        assert!(e.to_string().contains("not sealed"), "{e}");
        // Sealed but smaller than announced.
        // SAFETY: fcntl on an fd we own.
        unsafe {
            libc::fcntl(
                std::os::fd::AsRawFd::as_raw_fd(&f),
                libc::F_ADD_SEALS,
                libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL,
            )
        };
        let p3 = fake_channel_daemon("small", OwnedFd::from(f), 1 << 20);
        let e = claim(&p3).unwrap_err();
        assert!(e.to_string().contains("smaller"), "{e}");
        for p in [p, p2, p3] {
            let _ = std::fs::remove_file(p);
        }
    }

    /// A daemon that reads each request and answers it with the next of
    /// `answers`; returns the requests it read.
    fn scripted_daemon(
        name: &str,
        answers: Vec<Response>,
    ) -> (std::path::PathBuf, std::thread::JoinHandle<Vec<Request>>) {
        let p = temp_socket(name);
        let listener = UnixListener::bind(&p).unwrap();
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut seen = Vec::new();
            for answer in answers {
                let mut hdr = [0u8; 4];
                conn.read_exact(&mut hdr).unwrap();
                let mut body = vec![0u8; u32::from_le_bytes(hdr) as usize];
                conn.read_exact(&mut body).unwrap();
                seen.push(proto::decode_request(&body).unwrap());
                let frame = proto::encode_frame(&answer, proto::MAX_RESPONSE_FRAME).unwrap();
                conn.write_all(&frame).unwrap();
            }
            seen
        });
        (p, server)
    }

    fn wait_for_answer(c: &DaemonClient) {
        let t = Instant::now();
        while !c.answer_waiting() {
            assert!(t.elapsed() < Duration::from_secs(5), "no answer");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn stock_asked_ahead_is_read_later_and_an_older_daemon_is_not_asked_again() {
        let dst: SocketAddr = "10.0.0.2:80".parse().unwrap();
        let none = Response::Stocked {
            channel: None,
            stock: Vec::new(),
        };
        let unknown = Response::error(
            ErrorCode::BadRequest,
            "unknown variant `stock-fetch`, expected one of ...",
        );
        let (p, server) = scripted_daemon("ahead", vec![none, unknown]);
        let mut c = DaemonClient::connect(&p, Duration::from_secs(5)).unwrap();
        c.send_stock_refill(dst, 99).unwrap();
        wait_for_answer(&c);
        assert!(c.recv_stock_ahead().unwrap().is_empty());
        // An older daemon: no stock, not broken, and nothing more ahead.
        c.send_stock_fetch(dst).unwrap();
        wait_for_answer(&c);
        assert!(c.recv_stock_ahead().unwrap().is_empty());
        assert!(!c.is_broken());
        let e = c.send_stock_refill(dst, 1).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::Unsupported);
        assert_eq!(
            server.join().unwrap(),
            vec![
                // `want` is clamped to what one answer may grant.
                Request::StockRefill {
                    dst,
                    want: proto::MAX_STOCK_GRANTS as u32
                },
                Request::StockFetch { local: dst },
            ]
        );
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn an_answer_ahead_of_the_wrong_kind_breaks_the_connection() {
        let dst: SocketAddr = "10.0.0.2:80".parse().unwrap();
        for (name, wrong) in [
            ("ahead-channel", Response::Channel { id: 1, len: 4096 }),
            (
                "ahead-claim",
                Response::Stocked {
                    channel: Some(ChannelGrant { id: 1, len: 4096 }),
                    stock: Vec::new(),
                },
            ),
        ] {
            let (p, server) = scripted_daemon(name, vec![wrong]);
            let mut c = DaemonClient::connect(&p, Duration::from_secs(5)).unwrap();
            c.send_stock_fetch(dst).unwrap();
            assert!(c.recv_stock_ahead().is_err());
            assert!(c.is_broken());
            server.join().unwrap();
            let _ = std::fs::remove_file(&p);
        }
    }

    #[test]
    fn error_answers_map_to_permission_denied() {
        let p = temp_socket("denied");
        let listener = UnixListener::bind(&p).unwrap();
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut hdr = [0u8; 4];
            conn.read_exact(&mut hdr).unwrap();
            let mut body = vec![0u8; u32::from_le_bytes(hdr) as usize];
            conn.read_exact(&mut body).unwrap();
            assert!(matches!(
                proto::decode_request(&body).unwrap(),
                Request::ClaimAccepted { .. }
            ));
            let resp = Response::error(ErrorCode::UnknownPod, "who are you");
            conn.write_all(&proto::encode_frame(&resp, proto::MAX_RESPONSE_FRAME).unwrap())
                .unwrap();
        });
        let mut c = DaemonClient::connect(&p, Duration::from_secs(5)).unwrap();
        let err = c
            .claim_accepted(
                "10.0.0.1:80".parse().unwrap(),
                "10.0.0.2:4000".parse().unwrap(),
            )
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
        assert!(!c.is_broken(), "an error answer keeps the stream in step");
        server.join().unwrap();
        let _ = std::fs::remove_file(&p);
    }
}
