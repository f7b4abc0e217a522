//! Setting a connection up: the daemon round trips at listen, connect and
//! accept (see docs/shm-lane.md: the client announces BEFORE its TCP
//! connect, the server claims AFTER accept), and everything that decides
//! whether a socket is one the library may touch at all.

use crate::conn::{errno, set_errno, Conn};
use crate::log::log_at;
use crate::{config, daemon_conn, real, state, stock};
use flowlane_lane::client::{Channel, DaemonClient, FallbackReason};
use flowlane_lane::peer_table::Verdict;
use flowlane_lane::ring::{self, Side};
use libc::{c_int, sockaddr, socklen_t};
use std::cell::Cell;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::sync::Arc;
use std::time::Duration;

/// How long one daemon request may take before the connection stays on TCP.
const DAEMON_TIMEOUT: Duration = Duration::from_millis(500);

thread_local! {
    /// Set while the library itself talks to the daemon: its own socket
    /// calls go straight to libc.
    static IN_LIB: Cell<bool> = const { Cell::new(false) };
}

/// True while the library's own code runs on this thread.
pub fn in_lib() -> bool {
    IN_LIB.with(|c| c.get())
}

/// Runs `f` on the process's daemon connection (`daemon_conn`: kept open
/// between requests; `f` may run twice if a kept connection broke under
/// it), marking the thread as inside the library. `None` when no daemon
/// answers.
fn with_daemon<R>(f: impl FnMut(&mut DaemonClient) -> R) -> Option<R> {
    as_library(|| daemon_conn::with(&config::get().socket, DAEMON_TIMEOUT, f))
}

/// Runs `f` marked as the library's own work, the caller's errno kept.
fn as_library<R>(f: impl FnOnce() -> R) -> R {
    IN_LIB.with(|c| c.set(true));
    let saved = errno();
    let r = f();
    set_errno(saved);
    IN_LIB.with(|c| c.set(false));
    r
}

fn send_ahead(ahead: daemon_conn::Ahead) {
    as_library(|| daemon_conn::send_ahead(ahead));
}

fn collect_ahead(wait: bool) -> bool {
    as_library(|| daemon_conn::collect_ahead(wait))
}

/// Tells the daemon (if any) why a connection stays on TCP (or, for
/// `RingViolation`, why it was reset).
pub fn report_fallback(reason: FallbackReason) {
    with_daemon(|d| d.report_fallback(reason));
}

fn socket_family(fd: c_int) -> c_int {
    let mut v: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: getsockopt into a local int.
    unsafe {
        real::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_DOMAIN,
            (&mut v as *mut c_int).cast(),
            &mut len,
        )
    };
    v
}

/// Whether the library handles this fd at all: an IPv4/IPv6 TCP socket.
pub fn is_tcp(fd: c_int) -> bool {
    let get = |opt| {
        let mut v: c_int = 0;
        let mut len = std::mem::size_of::<c_int>() as socklen_t;
        // SAFETY: getsockopt into a local int.
        let r = unsafe {
            real::getsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&mut v as *mut c_int).cast(),
                &mut len,
            )
        };
        (r == 0).then_some(v)
    };
    matches!(get(libc::SO_DOMAIN), Some(libc::AF_INET | libc::AF_INET6))
        && get(libc::SO_TYPE) == Some(libc::SOCK_STREAM)
        && get(libc::SO_PROTOCOL) == Some(libc::IPPROTO_TCP)
}

/// Decodes a sockaddr (IPv4/IPv6 only).
///
/// # Safety
/// `addr` must point to `len` readable bytes (or be null).
pub unsafe fn decode(addr: *const sockaddr, len: socklen_t) -> Option<SocketAddr> {
    if addr.is_null() || (len as usize) < std::mem::size_of::<libc::sa_family_t>() {
        return None;
    }
    // SAFETY: at least the family field is readable (checked above).
    let family = unsafe { (*addr).sa_family } as c_int;
    match family {
        libc::AF_INET if len as usize >= std::mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: length checked; read unaligned to be safe with any buffer.
            let a: libc::sockaddr_in = unsafe { std::ptr::read_unaligned(addr.cast()) };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                u16::from_be(a.sin_port),
            )))
        }
        libc::AF_INET6 if len as usize >= std::mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: as above.
            let a: libc::sockaddr_in6 = unsafe { std::ptr::read_unaligned(addr.cast()) };
            let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
            if let Some(v4) = ip.to_ipv4_mapped() {
                // Dual-stack sockets name IPv4 peers as ::ffff:a.b.c.d.
                return Some(SocketAddr::V4(SocketAddrV4::new(
                    v4,
                    u16::from_be(a.sin6_port),
                )));
            }
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(a.sin6_addr.s6_addr),
                u16::from_be(a.sin6_port),
                a.sin6_flowinfo,
                a.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

fn encode(a: &SocketAddr) -> (libc::sockaddr_storage, socklen_t) {
    encode_for(
        a,
        if a.is_ipv4() {
            libc::AF_INET
        } else {
            libc::AF_INET6
        },
    )
}

/// Encodes `a` for a socket of `family` (IPv4 addresses as ::ffff:a.b.c.d
/// on an IPv6 socket).
fn encode_for(a: &SocketAddr, family: c_int) -> (libc::sockaddr_storage, socklen_t) {
    let a = &match (a, family) {
        (SocketAddr::V4(v4), libc::AF_INET6) => {
            SocketAddr::V6(SocketAddrV6::new(v4.ip().to_ipv6_mapped(), v4.port(), 0, 0))
        }
        _ => *a,
    };
    // SAFETY: sockaddr_storage is plain old data.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*v4.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: as above, for sockaddr_in6.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as socklen_t)
}

fn name_of(fd: c_int, peer: bool) -> Option<SocketAddr> {
    // SAFETY: sockaddr_storage is plain old data.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
    let p = (&mut ss as *mut libc::sockaddr_storage).cast();
    // SAFETY: the buffer and its length are valid.
    let r = unsafe {
        if peer {
            libc::getpeername(fd, p, &mut len)
        } else {
            libc::getsockname(fd, p, &mut len)
        }
    };
    // SAFETY: the kernel filled `len` bytes.
    (r == 0).then(|| unsafe { decode(p, len) }).flatten()
}

/// Destinations the library never touches.
fn leave_alone(ip: IpAddr) -> bool {
    ip.is_loopback()
        || ip.is_unspecified()
        || ip.is_multicast()
        || matches!(ip, IpAddr::V4(v4) if v4.is_broadcast())
}

/// The source address the kernel would pick for `dst` (UDP connect: a route
/// lookup that sends nothing).
fn route_source(dst: &SocketAddr) -> Option<IpAddr> {
    let family = if dst.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain socket call.
    let s = unsafe { libc::socket(family, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if s < 0 {
        return None;
    }
    let (ss, len) = encode(dst);
    // SAFETY: valid sockaddr of `len` bytes.
    let ok = unsafe { real::connect(s, (&ss as *const libc::sockaddr_storage).cast(), len) } == 0;
    let src = if ok {
        name_of(s, false).map(|a| a.ip())
    } else {
        None
    };
    // SAFETY: closing the socket we opened.
    unsafe { real::close(s) };
    src
}

/// Pending client-side state between the intent and the real connect.
pub enum Intent {
    /// A channel the daemon answered for this connection.
    Asked {
        channel: Channel,
        /// A connection to a Service IP: its backend is asked for after
        /// connect (`client_finish`).
        service: bool,
    },
    /// A stock channel (`stock.rs`): no daemon round trip; the source port
    /// goes into its offer word once `connect` has picked it.
    Stock {
        taken: stock::Taken,
        /// The socket was bound already: the offer names its port.
        offered: bool,
        /// Few channels left for this destination: ask for more ahead
        /// once connected.
        refill: Option<SocketAddr>,
    },
}

/// Before a client's connect: unless the peer table rules `dst` out, bind
/// the socket to its route's source IP (port 0) if unbound, and ask the
/// daemon for a channel. `None` keeps the connection on TCP.
pub fn client_intent(fd: c_int, dst: SocketAddr) -> Option<Intent> {
    let cfg = config::get();
    if cfg.disabled
        || leave_alone(dst.ip())
        || fd as usize >= state::MAX_FD
        || state::CONN_FDS.get(fd)
    {
        return None;
    }
    // A destination that cannot be a lane peer costs a lookup in the
    // daemon's table and nothing else: no system call, no round trip, no
    // bind (docs/shm-lane.md, "The peer table").
    let verdict = crate::peer_table::lookup(dst.ip());
    if verdict == Verdict::NotPeer {
        return None;
    }
    let service = verdict == Verdict::Service;
    // A socket the library saw made as TCP (`socket()`, not connected
    // since) needs no check.
    if !state::UNCONNECTED.get(fd) && !is_tcp(fd) {
        return None;
    }
    // Registrations made before connect (asio's reactor adds every socket
    // when it opens it) follow the socket onto the ring (`wait.rs`); only
    // ones that cannot keep it on TCP.
    if !crate::wait::registrations_movable(fd) {
        log_at!(
            2,
            "fd {fd}: an epoll registration made before connect cannot move, staying on TCP"
        );
        report_fallback(FallbackReason::Unsupported);
        return None;
    }
    let region_len = ring::region_len_for(cfg.ring_size);
    let mut src = name_of(fd, false)?;
    // A channel made ahead for this destination: no round trip.
    if !service {
        // Stock asked for ahead may have arrived; if none is left, the
        // answer still owed is waited for (the daemon made it while this
        // process used the rest) rather than asked for again.
        collect_ahead(false);
        let taken = stock::take_for(dst)
            .or_else(|| collect_ahead(true).then(|| stock::take_for(dst)).flatten());
        if let Some(taken) = taken {
            let offered = src.port() != 0;
            if offered {
                taken.region.offer_port(src.port());
            }
            let refill = (stock::REFILL_AHEAD && taken.left <= stock::ASK_AHEAD_AT).then_some(dst);
            return Some(Intent::Stock {
                taken,
                offered,
                refill,
            });
        }
    }
    // The socket's fd number lets the daemon read the connection's
    // addresses from the socket itself (a portless intent) and lets a
    // daemon with a cross-node lane take its own reference to it
    // (doorbells, liveness); see docs/rdma.md. A lane intent also asks
    // for stock, kept for the next connections to `dst`.
    let want = if service { 0 } else { stock::want_for(dst) };
    let ask = |src: SocketAddr| {
        with_daemon(|d| {
            if service {
                d.service_intent(src, dst, region_len)
            } else {
                d.stock_intent(src, dst, region_len, fd, want)
                    .map(|answer| {
                        stock::add_client(dst, answer.stock);
                        answer.channel
                    })
            }
        })
    };
    if src.port() == 0 && !service {
        // Not bound: ask with port 0 and leave the port to `connect`, as
        // without the library. A `bind(ip, 0)` first would reserve the
        // port against every destination (the kernel's connect reuses a
        // port towards other peers) and scans the port space while many
        // earlier connections sit in TIME_WAIT. A daemon that predates
        // portless intents refuses port 0: bind and ask again.
        let unbound = SocketAddr::new(
            match dst {
                SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            },
            0,
        );
        match ask(unbound) {
            Some(Err(e)) if flowlane_lane::client::is_portless_refused(&e) => {}
            answer => return intent_from(answer, unbound, dst, service),
        }
    }
    if src.port() == 0 {
        let ip = route_source(&dst)?;
        if leave_alone(ip) {
            return None;
        }
        let (ss, len) = encode_for(&SocketAddr::new(ip, 0), socket_family(fd));
        // SAFETY: valid sockaddr of `len` bytes.
        if unsafe { libc::bind(fd, (&ss as *const libc::sockaddr_storage).cast(), len) } != 0 {
            log_at!(
                3,
                "fd {fd}: bind to {ip} failed (errno {}), staying on TCP",
                errno()
            );
            return None;
        }
        src = name_of(fd, false)?;
    }
    intent_from(ask(src), src, dst, service)
}

/// The daemon's answer to an intent for `src` -> `dst`, as the connect
/// path uses it.
fn intent_from(
    answer: Option<std::io::Result<Option<Channel>>>,
    src: SocketAddr,
    dst: SocketAddr,
    service: bool,
) -> Option<Intent> {
    match answer {
        None => {
            log_at!(4, "{src} -> {dst}: no daemon, TCP");
            None
        }
        Some(Err(e)) => {
            log_at!(2, "{src} -> {dst}: daemon error {e}, TCP");
            report_fallback(FallbackReason::InternalError);
            None
        }
        Some(Ok(None)) => {
            log_at!(4, "{src} -> {dst}: not a flowlane peer, TCP");
            None
        }
        Some(Ok(Some(channel))) => Some(Intent::Asked { channel, service }),
    }
}

/// After the real connect returned `rc` (errno `err`): install the ring on
/// success or in-progress, cancel the intent otherwise.
pub fn client_finish(fd: c_int, intent: Intent, rc: c_int, err: c_int) {
    let in_progress = rc != 0 && (err == libc::EINPROGRESS || err == libc::EINTR);
    let (channel, service) = match intent {
        Intent::Asked { channel, service } => (channel, service),
        Intent::Stock {
            taken,
            offered,
            refill,
        } => {
            let connected = rc == 0 || in_progress;
            stock_finish(fd, taken, offered, connected, in_progress);
            if let Some(dst) = refill.filter(|_| connected) {
                let want = stock::want_for(dst);
                send_ahead(daemon_conn::Ahead::Refill { dst, want });
            }
            return;
        }
    };
    let id = channel.id;
    if rc != 0 && !in_progress {
        with_daemon(|d| d.cancel_intent(id));
        return;
    }
    // A Service connection has been DNATed by now (the SYN went through
    // the node): the daemon reads its backend from conntrack. When it is
    // not a lane peer the connection stays on TCP at once, without waiting
    // for an attach that cannot come. An error keeps the channel: the
    // attach handshake still decides (a server may have attached).
    if service && matches!(with_daemon(|d| d.resolve_service(id, fd)), Some(Ok(false))) {
        log_at!(
            4,
            "fd {fd}: channel {id}: the Service's backend is no lane peer, TCP"
        );
        return;
    }
    let nonblock = nonblocking(fd);
    let ring_size = ring::ring_size_for(channel.len).unwrap_or(0);
    match Conn::new(
        id,
        channel.memfd,
        channel.len,
        Side::Client,
        nonblock,
        in_progress,
    ) {
        Ok(conn) => install_client(fd, conn, ring_size),
        Err(e) => {
            // The daemon now has a claim nobody will use; the server side
            // claims it and would wait on an empty ring: a broken pair. The
            // safest answer is to break the TCP connection visibly.
            log_at!(
                1,
                "fd {fd}: mapping channel {id} failed: {e}; resetting the connection"
            );
            reset(fd);
            report_fallback(FallbackReason::InternalError);
        }
    }
}

/// A client connection on the ring, installed on `fd`.
fn install_client(fd: c_int, conn: Conn, ring_size: usize) {
    log_at!(
        3,
        "fd {fd}: channel {} (client, {ring_size} bytes per direction)",
        conn.id
    );
    conn.take_tcp_options(
        fd,
        state::UNCONNECTED.get(fd) && state::DEFAULT_OPTIONS.get(fd),
    );
    let conn = Arc::new(conn);
    drop(state::install(fd, conn.clone()));
    crate::wait::adopt_plain(fd, &conn);
}

/// After the connect of a stock channel: the offer names the connection's
/// source port and the client waits for the attach as for any channel. A
/// connect that failed gives the channel up (not back into stock: the
/// listener may be gone, and the daemon may have revoked the channel
/// while it was taken).
fn stock_finish(fd: c_int, taken: stock::Taken, offered: bool, connected: bool, in_progress: bool) {
    if !connected {
        taken.region.offer_abandon();
        return;
    }
    if !offered {
        match name_of(fd, false) {
            Some(src) if src.port() != 0 => taken.region.offer_port(src.port()),
            _ => {
                // No port to offer: no server can find the channel.
                taken.region.offer_abandon();
                return;
            }
        }
    }
    let mut conn = Conn::from_region(
        taken.id,
        taken.region.clone(),
        Side::Client,
        nonblocking(fd),
        in_progress,
    );
    let ring_size = taken.region.ring_size();
    conn.stock_offer = Some(taken.region);
    conn.stock = true;
    install_client(fd, conn, ring_size);
}

/// Turns the TCP connection into a visible reset (SO_LINGER 0 + shutdown).
pub fn reset(fd: c_int) {
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt with a local linger struct; shutdown on the fd.
    unsafe {
        real::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as socklen_t,
        );
        real::shutdown(fd, libc::SHUT_RDWR);
    }
}

fn nonblocking(fd: c_int) -> bool {
    // SAFETY: F_GETFL has no argument.
    let fl = unsafe { real::fcntl(fd, libc::F_GETFL, 0) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

/// Around listen(): register the bound listening socket with the daemon.
pub fn listener(fd: c_int) {
    let cfg = config::get();
    if cfg.disabled || state::LISTEN_FDS.get(fd) || fd as usize >= state::MAX_FD || !is_tcp(fd) {
        return;
    }
    let Some(addr) = name_of(fd, false) else {
        return;
    };
    // Port 0: not bound yet (called before listen() auto-binds it).
    if addr.ip().is_loopback() || addr.port() == 0 {
        return;
    }
    match with_daemon(|d| d.register_listener(addr)) {
        Some(Ok(())) => {
            log_at!(3, "fd {fd}: listener {addr} registered");
            state::add_listener(fd, addr);
        }
        Some(Err(e)) => log_at!(2, "listener {addr}: daemon refused: {e}"),
        None => log_at!(4, "listener {addr}: no daemon"),
    }
}

/// A registered listener's fd is closing.
pub fn listener_closed(fd: c_int) {
    if let Some(l) = state::remove_listener(fd) {
        // After a fork, other processes may still accept on it.
        if l.fork_gen == state::FORK_GEN.load(std::sync::atomic::Ordering::Relaxed) {
            with_daemon(|d| d.unregister_listener(l.addr));
        }
    }
}

/// After accept on a registered listener returned `fd`: claim the channel
/// the client announced, if any.
pub fn accepted(listen_fd: c_int, fd: c_int, flags: c_int) {
    if !state::LISTEN_FDS.get(listen_fd) || fd as usize >= state::MAX_FD || config::get().disabled {
        return;
    }
    let (Some(local), Some(peer)) = (name_of(fd, false), name_of(fd, true)) else {
        return;
    };
    let nonblock = flags & libc::SOCK_NONBLOCK != 0;
    // Linux copies the listener's options to the accepted socket.
    let defaults = state::UNCONNECTED.get(listen_fd) && state::DEFAULT_OPTIONS.get(listen_fd);
    // A channel the client took from stock: no round trip. Stock fetched
    // ahead may have arrived, or be on its way with this connection's.
    if stock::holds_for(local) {
        collect_ahead(false);
        let taken = stock::take_offer(local, peer).or_else(|| {
            collect_ahead(true)
                .then(|| stock::take_offer(local, peer))
                .flatten()
        });
        if let Some(taken) = taken {
            let fetch = stock::REFILL_AHEAD && taken.left <= stock::ASK_AHEAD_AT;
            attach_stock(fd, nonblock, taken, peer, defaults);
            if fetch {
                send_ahead(daemon_conn::Ahead::Fetch { local });
            }
            return;
        }
    }
    let answer = with_daemon(|d| {
        d.stock_claim(local, peer, fd).map(|answer| {
            stock::add_held(local, answer.stock);
            answer.channel
        })
    });
    match answer {
        Some(Ok(Some(ch))) => {
            let id = ch.id;
            match Conn::new(id, ch.memfd, ch.len, Side::Server, nonblock, false) {
                Ok(conn) => {
                    attach_server(fd, conn, peer, defaults);
                }
                Err(e) => {
                    log_at!(
                        1,
                        "fd {fd}: mapping channel {id} failed: {e}; resetting the connection"
                    );
                    reset(fd);
                    report_fallback(FallbackReason::InternalError);
                }
            }
        }
        // The claim's answer may have brought the stock the client used.
        Some(Ok(None)) => match stock::take_offer(local, peer) {
            Some(taken) => attach_stock(fd, nonblock, taken, peer, defaults),
            None => log_at!(4, "fd {fd}: {peer} is plain TCP"),
        },
        Some(Err(e)) => log_at!(2, "fd {fd}: claim failed: {e}; TCP"),
        None => log_at!(4, "fd {fd}: no daemon; TCP"),
    }
}

/// Server: attaches `conn` (true) or finds that the client gave up on it
/// (false: the connection stays on TCP).
fn attach_server(fd: c_int, conn: Conn, peer: SocketAddr, defaults: bool) -> bool {
    let id = conn.id;
    if conn.probe.server_attach() {
        conn.take_tcp_options(fd, defaults);
        log_at!(3, "fd {fd}: channel {id} (server) for {peer}");
        let wake = conn.probe.server_attach_wake();
        let conn = Arc::new(conn);
        drop(state::install(fd, conn.clone()));
        // Wake a client waiting for the attach, only the way it says it
        // waits: a bell nobody waits for is a TCP segment each way and a
        // read for the client; a futex wake is one system call here.
        if wake.futex {
            conn.probe.wake_attach_sleeper();
        }
        if wake.bell {
            conn.ring_bell(fd);
        }
        true
    } else {
        log_at!(2, "fd {fd}: client {peer} gave up on channel {id}; TCP");
        report_fallback(FallbackReason::InternalError);
        false
    }
}

/// Server: attaches a stock channel the client offered for this
/// connection. No message to the daemon: it reads "taken" in the offer
/// word (docs/shm-lane.md, "Pre-created channels").
fn attach_stock(fd: c_int, nonblock: bool, taken: stock::Taken, peer: SocketAddr, defaults: bool) {
    let mut conn = Conn::from_region(taken.id, taken.region, Side::Server, nonblock, false);
    conn.stock = true;
    attach_server(fd, conn, peer, defaults);
}

/// A client connection whose server never attached becomes plain TCP: all
/// its fds are forgotten, epoll registrations get the application's own
/// events and data back, and the daemon drops the channel.
pub fn to_tcp(conn: &Arc<Conn>) {
    // A stock channel's offer must not match a later connection that
    // reuses the port.
    if let Some(region) = &conn.stock_offer {
        region.offer_abandon();
    }
    for fd in state::fds_of(conn) {
        let (_c, regs) = state::remove(fd);
        for (epfd, reg) in regs {
            let mut ev = libc::epoll_event {
                events: reg.events,
                u64: reg.data,
            };
            // SAFETY: re-registering the fd with a valid local event.
            unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_MOD, fd, &mut ev) };
        }
    }
    log_at!(
        2,
        "channel {}: the server did not attach; connection stays on TCP",
        conn.id
    );
    with_daemon(|d| {
        let _ = d.cancel_intent(conn.id);
        d.report_fallback(FallbackReason::NoPeerLibrary)
    });
}

/// The connection's last fd in this process closed: tell the daemon, one
/// way (the close does not wait for an answer; the daemon counts the side
/// once, docs/shm-lane.md "Closing"). A stock channel's close is read from
/// its rings by the daemon: nothing is sent.
pub fn closed(conn: &Conn) {
    if conn.stock {
        return;
    }
    let (sent, received) = (
        conn.sent.load(std::sync::atomic::Ordering::Relaxed),
        conn.received.load(std::sync::atomic::Ordering::Relaxed),
    );
    with_daemon(|d| d.report_closed_one_way(conn.id, sent, received));
}
