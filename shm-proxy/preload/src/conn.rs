//! One TCP connection whose bytes travel through a shared-memory region.
//!
//! The application's fd stays the TCP socket; it carries no application
//! bytes, only one-byte doorbells ("peer: look at the rings") and, at the
//! end, the FIN/RST that is the ground truth for the peer's death. Reads and
//! writes copy between the application's buffers and the rings; a side that
//! cannot proceed spins for `FLOWLANE_SPIN_US`, then announces itself in the
//! ring's waiting flag and sleeps in `poll` on the TCP socket until a
//! doorbell, a FIN or an RST arrives (see `flowlane_lane::ring` for why no
//! wake-up is lost).

use crate::endlock::EndLock;
use crate::real;
use flowlane_lane::proto::FallbackReason;
use flowlane_lane::region::Region;
use flowlane_lane::ring::{Attach, Consumer, Probe, Producer, ReadState, Side};
use libc::c_int;
use std::io::IoSlice;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A blocked read/write sleeps on the region's futex in slices this long;
/// between slices it checks the TCP socket for the peer's death (FIN/RST),
/// which no futex wake announces.
const FUTEX_SLICE_MS: u32 = 100;

/// Most bytes one write puts into a stock channel's ring ahead of the
/// attach (`Conn::send_before_attach`): a request, which the socket's send
/// buffer takes whole should it have to go on TCP instead.
const PREWRITE_MAX: usize = 16 << 10;

/// How long sending the bytes written ahead on TCP may wait for room in
/// the socket (the server never attached) before the connection is reset.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a client waits for the server to attach to the region before
/// both ends stay on TCP (the server is not accepting, accepted without a
/// claim, or its claim failed). Until then its first read/write waits.
pub const ATTACH_TIMEOUT: Duration = Duration::from_secs(2);

/// Longest a client blocked on the attach sleeps between looks at its
/// socket (bytes or EOF there: the server runs on TCP) and at its age
/// (`ATTACH_TIMEOUT`).
const ATTACH_LOOK_MS: u32 = 1;

/// Where a client connection stands on the attach handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    /// Use the rings.
    Ring,
    /// The connection is plain TCP: forget the ring, call the real function.
    Tcp,
    /// Still undecided (non-blocking caller): not ready yet.
    Pending,
}

pub fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

pub fn set_errno(e: c_int) {
    // SAFETY: errno is a valid thread-local int.
    unsafe { *libc::__errno_location() = e };
}

/// A shared-memory connection (shared by all fds that alias its socket).
pub struct Conn {
    pub id: u64,
    tx: EndLock<Producer>,
    rx: EndLock<Consumer>,
    pub probe: Probe,
    /// O_NONBLOCK of the open file description (kept in step by fcntl/ioctl).
    pub nonblock: AtomicBool,
    /// The TCP socket delivered EOF: the peer's process closed it (or died).
    pub tcp_eof: AtomicBool,
    /// The TCP socket was reset.
    pub tcp_reset: AtomicBool,
    pub shut_rd: AtomicBool,
    pub shut_wr: AtomicBool,
    /// Non-blocking connect still in progress.
    pub connecting: AtomicBool,
    /// Client only: the server has not attached yet (see `settle`).
    pub pending: AtomicBool,
    created: Instant,
    pub sent: AtomicU64,
    pub received: AtomicU64,
    /// Fds of this process that refer to the connection (dup/dup2/fcntl).
    pub aliases: AtomicUsize,
    /// `state::FORK_GEN` when created: if it changed, another process may
    /// share the socket, and only the kernel knows when the last one closes.
    pub fork_gen: u64,
    /// The application's view of TCP_NODELAY / TCP_CORK: the real socket
    /// always has NODELAY on and CORK off, or Nagle would hold doorbells
    /// back for a delayed ACK (40 ms per wake-up).
    pub app_nodelay: std::sync::atomic::AtomicI32,
    pub app_cork: std::sync::atomic::AtomicI32,
    spinner: crate::spin::Spinner,
    /// Hand-off counters (logged at close with FLOWLANE_LOG=debug).
    pub counts: Counts,
    /// SO_RCVTIMEO / SO_SNDTIMEO of the socket in microseconds (0 = none):
    /// a blocking read/write gives up with EAGAIN (or a short count) then.
    pub rcv_timeout_us: AtomicU64,
    pub snd_timeout_us: AtomicU64,
    /// Threads of this process asleep in poll/select/epoll on the
    /// connection (see `sleepers`: every one of them must wake).
    pub sleepers: crate::sleepers::Sleepers,
    /// A ring violation was reported (see `reset_for_violation`).
    violation_seen: AtomicBool,
    /// Client of a stock channel: its region, whose offer word is given
    /// up if the server never attaches (`setup::to_tcp`).
    pub stock_offer: Option<Arc<Region>>,
    /// Either end of a stock channel: the daemon maps the region and reads
    /// its opening and closing there, so no close report is sent.
    pub stock: bool,
    /// The real socket's TCP_NODELAY is on (`nodelay_for_bells`).
    nodelay_on: AtomicBool,
    /// Client of a stock channel: bytes went into the ring before the
    /// server attached (`send_before_attach`).
    prewritten: AtomicBool,
    /// Those bytes were sent on TCP instead, the server never having
    /// attached (`replay_on_tcp`).
    replayed: AtomicBool,
}

/// Sends all of `bytes` on the real socket, waiting for room (also on a
/// non-blocking socket) until `deadline`; false on an error or timeout.
/// Keeps errno unchanged.
fn send_all_on_tcp(fd: c_int, mut bytes: &[u8], deadline: Instant) -> bool {
    let saved = errno();
    let ok = loop {
        if bytes.is_empty() {
            break true;
        }
        // SAFETY: sends from a live slice of `bytes.len()` bytes.
        let r = unsafe {
            real::send(
                fd,
                bytes.as_ptr().cast(),
                bytes.len(),
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        if r > 0 {
            bytes = &bytes[r as usize..];
            continue;
        }
        let e = errno();
        if r < 0 && (e == libc::EAGAIN || e == libc::EINTR) && Instant::now() < deadline {
            let mut p = libc::pollfd {
                fd,
                events: libc::POLLOUT,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            unsafe { real::poll(&mut p, 1, 100) };
            continue;
        }
        break false;
    };
    set_errno(saved);
    ok
}

/// Sets an int TCP option on the real socket (errno unchanged).
fn set_tcp_int(fd: c_int, opt: c_int, v: c_int) {
    let saved = errno();
    // SAFETY: setsockopt with a local int.
    unsafe {
        real::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            opt,
            (&v as *const c_int).cast(),
            std::mem::size_of::<c_int>() as libc::socklen_t,
        )
    };
    set_errno(saved);
}

/// How often the two ends handed off through the kernel: the cost the
/// lane tries to keep per megabyte, not per message.
#[derive(Default)]
pub struct Counts {
    pub read_sleeps: AtomicU64,
    pub write_sleeps: AtomicU64,
    pub spins_won: AtomicU64,
    pub spins_lost: AtomicU64,
    pub bells: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// SO_RCVTIMEO / SO_SNDTIMEO values (Linux: `_OLD` with a native
/// timeval, `_NEW` with a 64-bit one; the same layout on 64-bit targets).
pub const SO_RCVTIMEO_NEW: c_int = 66;
pub const SO_SNDTIMEO_NEW: c_int = 67;

/// A socket timeout option's value as microseconds (0 = none).
pub fn timeval_us(tv: &libc::timeval) -> u64 {
    (tv.tv_sec.max(0) as u64)
        .saturating_mul(1_000_000)
        .saturating_add(tv.tv_usec.clamp(0, 999_999) as u64)
}

/// How long the next futex sleep may be: a slice, cut at the deadline.
/// `None`: the deadline has passed.
fn slice_until(deadline: Option<Instant>) -> Option<u32> {
    match deadline {
        None => Some(FUTEX_SLICE_MS),
        Some(d) => {
            let left = d.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            Some((left.as_micros().div_ceil(1000) as u32).clamp(1, FUTEX_SLICE_MS))
        }
    }
}

impl Conn {
    /// Maps the channel's memfd and builds the connection for `side`.
    pub fn new(
        id: u64,
        memfd: OwnedFd,
        len: usize,
        side: Side,
        nonblock: bool,
        connecting: bool,
    ) -> std::io::Result<Conn> {
        // Checks the seals and the size before mapping (see `Region`).
        let region = Region::map_memfd(memfd.as_fd(), len)?;
        drop(memfd); // the mapping keeps the memory alive
        Ok(Conn::from_region(id, region, side, nonblock, connecting))
    }

    /// The connection for `side` of a region already mapped (a stock
    /// channel, `stock.rs`).
    pub fn from_region(
        id: u64,
        region: Arc<Region>,
        side: Side,
        nonblock: bool,
        connecting: bool,
    ) -> Conn {
        let (mut tx, rx) = region.endpoints(side);
        // The sending ring starts small and grows with the traffic (no
        // effect on a relay's region, whose capacity is fixed).
        tx.start_small(crate::config::get().ring_initial);
        let probe = region.probe(side);
        if side == Side::Client {
            probe.client_says_when_it_waits();
        }
        Conn {
            id,
            tx: EndLock::new(tx),
            rx: EndLock::new(rx),
            probe,
            nonblock: AtomicBool::new(nonblock),
            tcp_eof: AtomicBool::new(false),
            tcp_reset: AtomicBool::new(false),
            shut_rd: AtomicBool::new(false),
            shut_wr: AtomicBool::new(false),
            connecting: AtomicBool::new(connecting),
            pending: AtomicBool::new(side == Side::Client),
            created: Instant::now(),
            sent: AtomicU64::new(0),
            received: AtomicU64::new(0),
            aliases: AtomicUsize::new(1),
            fork_gen: crate::state::FORK_GEN.load(Ordering::Relaxed),
            app_nodelay: std::sync::atomic::AtomicI32::new(0),
            app_cork: std::sync::atomic::AtomicI32::new(0),
            spinner: crate::spin::Spinner::for_connection(),
            counts: Counts::default(),
            rcv_timeout_us: AtomicU64::new(0),
            snd_timeout_us: AtomicU64::new(0),
            sleepers: crate::sleepers::Sleepers::new(),
            violation_seen: AtomicBool::new(false),
            stock_offer: None,
            stock: false,
            nodelay_on: AtomicBool::new(false),
            prewritten: AtomicBool::new(false),
            replayed: AtomicBool::new(false),
        }
    }

    /// The peer wrote a ring word out of protocol: the connection is reset
    /// for the application (ECONNRESET from now on, the TCP socket shut
    /// down so the peer sees the end too), reported to the daemon once.
    fn reset_for_violation(&self, fd: c_int) -> c_int {
        if !self.violation_seen.swap(true, Ordering::AcqRel) {
            crate::log::log_at!(
                2,
                "channel {}: the peer broke the ring protocol; connection reset",
                self.id
            );
            self.tcp_reset.store(true, Ordering::Release);
            // SAFETY: shutdown of the connection's own socket; no memory.
            unsafe { real::shutdown(fd, libc::SHUT_RDWR) };
            crate::setup::report_fallback(FallbackReason::RingViolation);
        }
        libc::ECONNRESET
    }

    /// Takes over the socket's Nagle settings (see `app_nodelay`), keeping
    /// what the application had set for getsockopt. `defaults`: the socket
    /// is known to hold the kernel's defaults (`state::DEFAULT_OPTIONS`):
    /// nothing to read, nothing to undo. TCP_NODELAY goes on at the first
    /// doorbell (`ring_bell`), the only bytes the socket carries.
    pub fn take_tcp_options(&self, fd: c_int, defaults: bool) {
        if defaults {
            return;
        }
        // Timeouts set before the connection existed (or inherited from the
        // listener, as Linux does for accepted sockets).
        for (opt, keep) in [
            (libc::SO_RCVTIMEO, &self.rcv_timeout_us),
            (libc::SO_SNDTIMEO, &self.snd_timeout_us),
        ] {
            let mut tv = libc::timeval {
                tv_sec: 0,
                tv_usec: 0,
            };
            let mut len = std::mem::size_of::<libc::timeval>() as libc::socklen_t;
            // SAFETY: getsockopt into a local timeval.
            if unsafe {
                real::getsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    opt,
                    (&mut tv as *mut libc::timeval).cast(),
                    &mut len,
                )
            } == 0
            {
                keep.store(timeval_us(&tv), Ordering::Relaxed);
            }
        }
        for (opt, keep) in [
            (libc::TCP_NODELAY, &self.app_nodelay),
            (libc::TCP_CORK, &self.app_cork),
        ] {
            let mut v: c_int = 0;
            let mut len = std::mem::size_of::<c_int>() as libc::socklen_t;
            // SAFETY: getsockopt into a local int.
            if unsafe {
                real::getsockopt(
                    fd,
                    libc::IPPROTO_TCP,
                    opt,
                    (&mut v as *mut c_int).cast(),
                    &mut len,
                )
            } == 0
            {
                keep.store(v, Ordering::Relaxed);
            }
        }
        if self.app_cork.load(Ordering::Relaxed) != 0 {
            set_tcp_int(fd, libc::TCP_CORK, 0);
        }
    }

    /// The real socket's TCP_NODELAY, before its first doorbell: Nagle
    /// would hold a doorbell back for a delayed ACK (40 ms per wake-up).
    fn nodelay_for_bells(&self, fd: c_int) {
        if !self.nodelay_on.load(Ordering::Relaxed)
            && !self.nodelay_on.swap(true, Ordering::Relaxed)
        {
            set_tcp_int(fd, libc::TCP_NODELAY, 1);
        }
    }

    /// Sends one doorbell byte on the TCP socket. Keeps errno unchanged.
    ///
    /// A send on a socket the peer reset takes the pending `ECONNRESET`
    /// (the kernel reports a socket error once); a later `recv` then reads
    /// 0, a clean end-of-stream. So the reset is noted here, where the
    /// error is consumed: a relayed connection whose own daemon died
    /// learns of its failure only from the peer's RST (docs/relay.md,
    /// "Failures").
    pub fn ring_bell(&self, fd: c_int) {
        bump(&self.counts.bells);
        let b = 0u8;
        let saved = errno();
        self.nodelay_for_bells(fd);
        // SAFETY: one byte from a local.
        let r = unsafe {
            real::send(
                fd,
                (&b as *const u8).cast(),
                1,
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if r < 0 && errno() == libc::ECONNRESET && !self.tcp_reset.swap(true, Ordering::AcqRel) {
            // Threads asleep on the ring or the socket re-evaluate.
            self.sleepers.wake_others();
        }
        set_errno(saved);
    }

    /// Consumes pending doorbells and notes EOF/RST of the TCP socket.
    /// Keeps errno unchanged.
    pub fn drain(&self, fd: c_int) {
        if self.connecting.load(Ordering::Relaxed)
            || self.tcp_eof.load(Ordering::Relaxed)
            || self.tcp_reset.load(Ordering::Relaxed)
        {
            return;
        }
        let saved = errno();
        let mut buf = [0u8; 256];
        let mut took = false;
        loop {
            // SAFETY: reading into a local buffer of its length.
            let r =
                unsafe { real::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
            if r > 0 {
                took = true;
                if (r as usize) < buf.len() {
                    break;
                }
                continue;
            }
            if r == 0 {
                self.tcp_eof.store(true, Ordering::Release);
                took = true;
                break;
            }
            match errno() {
                libc::EINTR => continue,
                libc::EAGAIN => break,
                _ => {
                    self.tcp_reset.store(true, Ordering::Release);
                    took = true;
                    break;
                }
            }
        }
        if took {
            // Other threads asleep on this socket may have been woken for
            // these doorbells and now find the socket empty.
            self.sleepers.wake_others();
        }
        set_errno(saved);
    }

    /// After a futex wait that brought nothing: did the TCP connection end
    /// (FIN or RST)? Checked without consuming doorbells unless it did.
    fn check_tcp(&self, fd: c_int) {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no wait.
        let r = unsafe { real::poll(&mut p, 1, 0) };
        if r > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
            self.drain(fd);
        }
    }

    /// Spins up to the configured budget until `ready()`; true if it became ready.
    fn spin(&self, ready: impl FnMut() -> bool) -> bool {
        let won = self.spinner.spin(ready);
        bump(if won {
            &self.counts.spins_won
        } else {
            &self.counts.spins_lost
        });
        won
    }

    /// The deadline of a blocking call that starts waiting now, from a
    /// SO_RCVTIMEO/SO_SNDTIMEO value.
    fn deadline(timeout_us: &AtomicU64) -> Option<Instant> {
        match timeout_us.load(Ordering::Relaxed) {
            0 => None,
            us => Some(Instant::now() + Duration::from_micros(us)),
        }
    }

    /// In a forked child: no thread holds the ring-end locks any more
    /// (see `endlock`).
    pub fn reset_locks_after_fork(&self) {
        self.tx.reset_after_fork();
        self.rx.reset_after_fork();
        self.sleepers.reset_after_fork();
    }

    fn peer_closed(&self) -> bool {
        self.tcp_eof.load(Ordering::Acquire) || self.tcp_reset.load(Ordering::Acquire)
    }

    /// Client: resolves whether the server attached. Blocking callers wait
    /// (bounded by ATTACH_TIMEOUT); the answer is final once not Pending.
    pub fn settle(&self, fd: c_int, block: bool) -> Settle {
        if !self.pending.load(Ordering::Acquire) {
            return Settle::Ring;
        }
        loop {
            match self.probe.attach_state() {
                Attach::ServerAttached => {
                    self.pending.store(false, Ordering::Release);
                    return Settle::Ring;
                }
                Attach::ClientGaveUp => {
                    self.replay_on_tcp(fd);
                    return Settle::Tcp;
                }
                Attach::Undecided => {}
            }
            if !self.connecting.load(Ordering::Acquire) || self.finish_connect(fd, false).is_ok() {
                // Bytes (or EOF) on TCP before an attach: the server runs on
                // TCP. (A ring server attaches before its first doorbell.)
                let mut b = 0u8;
                let saved = errno();
                // SAFETY: peeking one byte into a local.
                let r = unsafe {
                    real::recv(
                        fd,
                        (&mut b as *mut u8).cast(),
                        1,
                        libc::MSG_PEEK | libc::MSG_DONTWAIT,
                    )
                };
                let e = errno();
                set_errno(saved);
                let tcp_moved = r >= 0 || (e != libc::EAGAIN && e != libc::EINTR);
                if tcp_moved && self.probe.attach_state() == Attach::Undecided {
                    return self.give_up(fd);
                }
            } else if self.tcp_reset.load(Ordering::Acquire) {
                return self.give_up(fd);
            }
            if self.created.elapsed() >= ATTACH_TIMEOUT {
                return self.give_up(fd);
            }
            // A blocking call sleeps on the ring's data futex, which the
            // attach bumps (the server's library, or the relay's daemon,
            // which cannot ring this socket's doorbell itself): no bell
            // byte on TCP and no read of it. The daemon made the channel
            // for a listener a library registered, so bytes on TCP instead
            // are rare (a server that gave the lane up or exec'd away its
            // socket): seen at the next look.
            if block {
                let seq = self.probe.client_sleeps_for_attach();
                if self.probe.attach_state() == Attach::Undecided {
                    self.probe.sleep_until_attach(seq, ATTACH_LOOK_MS);
                }
                continue;
            }
            // The caller is about to sleep in poll/epoll on the socket: the
            // server rings the attach bell only for a client that says so.
            self.probe.client_waits_for_attach();
            if self.probe.attach_state() != Attach::Undecided {
                continue;
            }
            return Settle::Pending;
        }
    }

    fn give_up(&self, fd: c_int) -> Settle {
        if self.probe.client_give_up() {
            self.replay_on_tcp(fd);
            Settle::Tcp
        } else {
            self.pending.store(false, Ordering::Release);
            Settle::Ring
        }
    }

    /// Client of a stock channel whose server has not attached yet: writes
    /// `bufs` (at most `PREWRITE_MAX`) into the ring at once when they fit
    /// whole, instead of
    /// waiting for the attach. The server attaches in its `accept` and
    /// finds them there, so the first request costs no extra hand-off
    /// between the two processes. Should the server never attach, they are
    /// sent on TCP before anything else (`replay_on_tcp`). `None`: not
    /// such a connection, or the bytes do not fit: the caller settles
    /// (waits for the attach) as for any pending connection.
    pub fn send_before_attach(
        &self,
        bufs: &[IoSlice<'_>],
        flags: c_int,
    ) -> Option<Result<usize, c_int>> {
        if !self.stock
            || !self.pending.load(Ordering::Acquire)
            || self.connecting.load(Ordering::Acquire)
            || self.shut_wr.load(Ordering::Relaxed)
            || flags & libc::MSG_OOB != 0
        {
            return None;
        }
        let want: usize = bufs.iter().map(|b| b.len()).sum();
        if want == 0 || want > PREWRITE_MAX {
            return None;
        }
        let mut tx = self.tx.lock();
        // Under the lock: a client that gave up replays under it too, so
        // no byte can land in the ring after its replay.
        if self.probe.attach_state() != Attach::Undecided || tx.is_broken() || tx.free() < want {
            return None;
        }
        self.prewritten.store(true, Ordering::Release);
        let n = tx.write_vectored(bufs);
        self.sent.fetch_add(n as u64, Ordering::Relaxed);
        Some(Ok(n))
    }

    /// The server never attached and the client wrote into the ring
    /// before it knew (`send_before_attach`): those bytes go on TCP now,
    /// once, ahead of anything the connection sends next. Every thread
    /// that finds the connection on TCP passes here first, and the replay
    /// runs under the sending end's lock, so none sends before it ends.
    fn replay_on_tcp(&self, fd: c_int) {
        if !self.prewritten.load(Ordering::Acquire) {
            return;
        }
        let _tx = self.tx.lock();
        if self.replayed.swap(true, Ordering::AcqRel) {
            return;
        }
        let Some(region) = &self.stock_offer else {
            return;
        };
        // The server never attached (the attach word says so), so nobody
        // consumed the client→server ring: read it back as its consumer.
        let (_, mut c2s) = region.endpoints(Side::Server);
        let mut buf = vec![0u8; PREWRITE_MAX];
        let deadline = Instant::now() + REPLAY_TIMEOUT;
        loop {
            let n = c2s.read(&mut buf);
            if n == 0 {
                break;
            }
            if !send_all_on_tcp(fd, &buf[..n], deadline) {
                // Bytes the application was told were sent cannot be
                // delivered: the connection ends visibly, never silently
                // short.
                crate::log::log_at!(
                    1,
                    "channel {}: bytes written ahead could not be sent on TCP; connection reset",
                    self.id
                );
                crate::setup::reset(fd);
                return;
            }
        }
        crate::log::log_at!(
            2,
            "channel {}: the server never attached; bytes written ahead sent on TCP",
            self.id
        );
    }

    /// Waits for a non-blocking connect to finish (or reports EAGAIN).
    pub fn finish_connect(&self, fd: c_int, block: bool) -> Result<(), c_int> {
        if !self.connecting.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLOUT,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let r = unsafe { real::poll(&mut p, 1, if block { -1 } else { 0 }) };
        if r <= 0 {
            return Err(libc::EAGAIN);
        }
        let mut err: c_int = 0;
        let mut len = std::mem::size_of::<c_int>() as libc::socklen_t;
        // SAFETY: SO_ERROR into a local int.
        unsafe {
            real::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_ERROR,
                (&mut err as *mut c_int).cast(),
                &mut len,
            )
        };
        if err != 0 {
            self.tcp_reset.store(true, Ordering::Release);
            return Err(err);
        }
        self.connecting.store(false, Ordering::Release);
        Ok(())
    }

    fn nonblocking(&self, flags: c_int) -> bool {
        flags & libc::MSG_DONTWAIT != 0 || self.nonblock.load(Ordering::Relaxed)
    }

    /// recv/read/readv/recvmsg on the ring. `Err` carries an errno.
    pub fn recv(&self, fd: c_int, bufs: &mut [&mut [u8]], flags: c_int) -> Result<usize, c_int> {
        if flags & libc::MSG_OOB != 0 {
            // No urgent data ever travels on the ring (see `send`): TCP's
            // answer when none is pending. Never a read of in-band bytes.
            return Err(libc::EINVAL);
        }
        let want: usize = bufs.iter().map(|b| b.len()).sum();
        if want == 0 {
            return Ok(0);
        }
        if self.shut_rd.load(Ordering::Relaxed) {
            return Ok(0);
        }
        let dontwait = self.nonblocking(flags);
        self.finish_connect(fd, !dontwait)?;
        if self.pending.load(Ordering::Acquire) {
            return Err(libc::EAGAIN);
        }
        let peek = flags & libc::MSG_PEEK != 0;
        let waitall = flags & libc::MSG_WAITALL != 0 && !peek && !dontwait;
        let mut rx = self.rx.lock();
        let mut got = 0usize;
        let mut drained = false;
        let mut deadline: Option<Option<Instant>> = None;
        loop {
            match rx.state() {
                ReadState::Broken => return Err(self.reset_for_violation(fd)),
                ReadState::Data(_) => {
                    if peek {
                        return Ok(rx.peek(first_nonempty(bufs)));
                    }
                    let n = read_into(&mut rx, bufs, got);
                    got += n;
                    self.received.fetch_add(n as u64, Ordering::Relaxed);
                    if rx.take_writer_wakeup() {
                        self.ring_bell(fd);
                    }
                    if !waitall || got == want {
                        return Ok(got);
                    }
                }
                ReadState::Eof => return Ok(got),
                ReadState::Empty => {
                    if self.peer_closed() {
                        // The FIN/RST came after the peer's last write: one
                        // more look at the ring sees everything it wrote.
                        if let ReadState::Data(_) = rx.state() {
                            continue;
                        }
                        if self.tcp_reset.load(Ordering::Acquire)
                            && !rx.producer_closed()
                            && got == 0
                        {
                            return Err(libc::ECONNRESET);
                        }
                        return Ok(got);
                    }
                    if dontwait {
                        if !drained {
                            drained = true;
                            self.drain(fd);
                            continue;
                        }
                        return if got > 0 { Ok(got) } else { Err(libc::EAGAIN) };
                    }
                    let d = *deadline.get_or_insert_with(|| Self::deadline(&self.rcv_timeout_us));
                    let Some(slice) = slice_until(d) else {
                        // SO_RCVTIMEO expired: as TCP, a short count or EAGAIN.
                        return if got > 0 { Ok(got) } else { Err(libc::EAGAIN) };
                    };
                    let probe = &self.probe;
                    if self.spin(|| probe.rx_state() != ReadState::Empty) {
                        continue;
                    }
                    bump(&self.counts.read_sleeps);
                    rx.wait_data(slice);
                    if rx.state() == ReadState::Empty {
                        self.check_tcp(fd);
                    }
                }
            }
        }
    }

    /// send/write/writev/sendmsg into the ring. `Err` carries an errno.
    pub fn send(&self, fd: c_int, bufs: &[IoSlice<'_>], flags: c_int) -> Result<usize, c_int> {
        if flags & libc::MSG_OOB != 0 {
            // TCP urgent data has no place in the ring: sending it in band
            // would hand the peer a byte its TCP stack would have pulled
            // out of the stream. Refused visibly, nothing is written.
            return Err(libc::EOPNOTSUPP);
        }
        let want: usize = bufs.iter().map(|b| b.len()).sum();
        if self.shut_wr.load(Ordering::Relaxed) {
            return Err(libc::EPIPE);
        }
        let dontwait = self.nonblocking(flags);
        self.finish_connect(fd, !dontwait)?;
        if self.pending.load(Ordering::Acquire) {
            return Err(libc::EAGAIN);
        }
        if want == 0 {
            return Ok(0);
        }
        let mut tx = self.tx.lock();
        let (mut idx, mut off, mut done) = (0usize, 0usize, 0usize);
        let mut drained = false;
        let mut deadline: Option<Option<Instant>> = None;
        loop {
            if tx.is_broken() {
                return Err(self.reset_for_violation(fd));
            }
            if tx.peer_gone() || self.peer_closed() {
                if done > 0 {
                    return Ok(done);
                }
                return Err(if self.tcp_reset.load(Ordering::Acquire) {
                    libc::ECONNRESET
                } else {
                    libc::EPIPE
                });
            }
            let mut wrote = 0;
            while idx < bufs.len() {
                let n = tx.write(&bufs[idx][off..]);
                wrote += n;
                off += n;
                if off == bufs[idx].len() {
                    idx += 1;
                    off = 0;
                } else {
                    break;
                }
            }
            if wrote > 0 {
                done += wrote;
                self.sent.fetch_add(wrote as u64, Ordering::Relaxed);
                if tx.take_reader_wakeup() {
                    self.ring_bell(fd);
                }
            }
            if done == want {
                return Ok(done);
            }
            if dontwait {
                if done > 0 {
                    return Ok(done);
                }
                if !drained {
                    drained = true;
                    self.drain(fd);
                    continue;
                }
                return Err(libc::EAGAIN);
            }
            let d = *deadline.get_or_insert_with(|| Self::deadline(&self.snd_timeout_us));
            let Some(slice) = slice_until(d) else {
                // SO_SNDTIMEO expired: as TCP, a short count or EAGAIN.
                return if done > 0 {
                    Ok(done)
                } else {
                    Err(libc::EAGAIN)
                };
            };
            let probe = &self.probe;
            // A ring that wants to grow waits (briefly) for it to empty
            // instead of refilling the room the reader frees.
            if !tx.wants_to_grow() && self.spin(|| probe.tx_free() > 0 || probe.tx_peer_gone()) {
                continue;
            }
            bump(&self.counts.write_sleeps);
            tx.wait_room(slice);
            if tx.free() == 0 {
                self.check_tcp(fd);
            }
        }
    }

    /// sendfile from `in_fd` (at `*offset` when given, else its file position).
    pub fn sendfile(
        &self,
        fd: c_int,
        in_fd: c_int,
        offset: Option<&mut libc::off_t>,
        count: usize,
    ) -> Result<usize, c_int> {
        if self.shut_wr.load(Ordering::Relaxed) {
            return Err(libc::EPIPE);
        }
        let dontwait = self.nonblock.load(Ordering::Relaxed);
        self.finish_connect(fd, !dontwait)?;
        if self.pending.load(Ordering::Acquire) {
            return Err(libc::EAGAIN);
        }
        let mut tx = self.tx.lock();
        let mut pos = offset.as_ref().map(|o| **o);
        let mut done = 0usize;
        let mut read_err = 0;
        let mut eof = false;
        while done < count && !eof {
            if tx.is_broken() {
                return Err(self.reset_for_violation(fd));
            }
            if tx.peer_gone() || self.peer_closed() {
                if done > 0 {
                    break;
                }
                // As the kernel: an input at its end sends nothing and
                // never reaches the socket, so a gone peer is no error yet.
                if input_at_eof(in_fd, pos) {
                    return Ok(0);
                }
                return Err(libc::EPIPE);
            }
            let n = tx.write_with(count - done, |dst| {
                // SAFETY: reading into a ring slice we own until published.
                let r = unsafe {
                    match pos {
                        Some(p) => real::pread(in_fd, dst.as_mut_ptr().cast(), dst.len(), p),
                        None => real::read(in_fd, dst.as_mut_ptr().cast(), dst.len()),
                    }
                };
                if r < 0 {
                    read_err = errno();
                    0
                } else {
                    if r == 0 {
                        eof = true;
                    }
                    r as usize
                }
            });
            if read_err != 0 {
                break;
            }
            if n > 0 {
                done += n;
                if let Some(p) = pos.as_mut() {
                    *p += n as libc::off_t;
                }
                self.sent.fetch_add(n as u64, Ordering::Relaxed);
                if tx.take_reader_wakeup() {
                    self.ring_bell(fd);
                }
                continue;
            }
            if eof {
                break;
            }
            // Ring full.
            if dontwait {
                break;
            }
            let probe = &self.probe;
            if !tx.wants_to_grow() && self.spin(|| probe.tx_free() > 0) {
                continue;
            }
            tx.wait_room(FUTEX_SLICE_MS);
            if tx.free() == 0 {
                self.check_tcp(fd);
            }
        }
        if let (Some(o), Some(p)) = (offset, pos) {
            *o = p;
        }
        if done == 0 {
            if read_err != 0 {
                return Err(read_err);
            }
            if !eof && count > 0 {
                return Err(libc::EAGAIN);
            }
        }
        Ok(done)
    }

    /// Bytes readable now (FIONREAD).
    pub fn readable_bytes(&self) -> usize {
        match self.probe.rx_state() {
            ReadState::Data(n) => n,
            _ => 0,
        }
    }

    /// poll-style readiness of the connection now (POLLIN/OUT/RDHUP/HUP/ERR).
    pub fn readiness(&self) -> i16 {
        if self.pending.load(Ordering::Acquire) {
            if self.probe.attach_state() != Attach::ServerAttached {
                return 0; // the wait loops settle it (doorbell or timeout)
            }
            self.pending.store(false, Ordering::Release);
        }
        if self.probe.is_broken() {
            // Readable and writable: the next call reports the reset.
            return libc::POLLIN | libc::POLLOUT | libc::POLLERR | libc::POLLHUP;
        }
        let mut ev = 0i16;
        let eof = self.tcp_eof.load(Ordering::Acquire);
        let reset = self.tcp_reset.load(Ordering::Acquire);
        match self.probe.rx_state() {
            ReadState::Data(_) => ev |= libc::POLLIN,
            ReadState::Eof => ev |= libc::POLLIN | libc::POLLRDHUP,
            ReadState::Broken => ev |= libc::POLLIN | libc::POLLERR | libc::POLLHUP,
            ReadState::Empty => {}
        }
        if eof || self.shut_rd.load(Ordering::Relaxed) {
            ev |= libc::POLLIN | libc::POLLRDHUP;
        }
        if reset {
            ev |= libc::POLLIN | libc::POLLERR | libc::POLLHUP;
        }
        let shut_wr = self.shut_wr.load(Ordering::Relaxed);
        if shut_wr || self.probe.tx_free() > 0 || self.probe.tx_peer_gone() || eof || reset {
            ev |= libc::POLLOUT;
        }
        if shut_wr && ev & libc::POLLRDHUP != 0 {
            ev |= libc::POLLHUP;
        }
        ev
    }

    /// shutdown(): rings only, the TCP socket stays open for doorbells.
    pub fn shutdown(&self, fd: c_int, how: c_int) {
        if how == libc::SHUT_WR || how == libc::SHUT_RDWR {
            self.shut_wr.store(true, Ordering::Relaxed);
            self.probe.close_tx();
            // Always ring: a reader of the peer may sleep in a wait that did
            // not set the flag (e.g. it only polls for POLLRDHUP).
            self.ring_bell(fd);
        }
        if how == libc::SHUT_RD || how == libc::SHUT_RDWR {
            self.shut_rd.store(true, Ordering::Relaxed);
        }
    }

    /// The last fd of this process referring to the connection is closing
    /// (before the real close). If no fork shared the socket, tell the peer
    /// precisely (write side closed, read side gone) and drain doorbells so
    /// the kernel closes with FIN rather than RST.
    ///
    /// `fd` is `None` when the socket is already gone (closed behind the
    /// library's back, its number now someone else's): then only the rings
    /// are marked, the kernel told the peer when it closed the socket.
    pub fn finish(&self, fd: Option<c_int>) {
        // Bytes written ahead of the attach are delivered whichever way the
        // attach goes: wait for it (it comes with the server's accept).
        if let Some(fd) = fd {
            if self.prewritten.load(Ordering::Acquire) && self.pending.load(Ordering::Acquire) {
                let _ = self.settle(fd, true);
            }
        }
        let c = &self.counts;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        crate::log::log_at!(
            4,
            "channel {}: sent {} received {}; sleeps read {} write {}; spins won {} lost {}; doorbells {}",
            self.id,
            n(&self.sent),
            n(&self.received),
            n(&c.read_sleeps),
            n(&c.write_sleeps),
            n(&c.spins_won),
            n(&c.spins_lost),
            n(&c.bells)
        );
        if self.fork_gen != crate::state::FORK_GEN.load(Ordering::Relaxed) {
            return; // other processes may still use the socket: the kernel decides
        }
        // Lock-free: another thread may still be blocked in read or write.
        let closed_now = self.probe.close_tx() | self.probe.close_rx();
        let Some(fd) = fd else {
            return;
        };
        if closed_now {
            self.ring_bell(fd);
        }
        self.drain(fd);
    }
}

/// True when `in_fd` has no byte left at `pos` (its file position when
/// `None`), judged from its size: sendfile's input is a regular file.
fn input_at_eof(in_fd: c_int, pos: Option<libc::off_t>) -> bool {
    // SAFETY: lseek with SEEK_CUR moves nothing; no memory is passed.
    let at = pos.unwrap_or_else(|| unsafe { libc::lseek(in_fd, 0, libc::SEEK_CUR) });
    // SAFETY: libc::stat is plain data, all-zero is a valid value; fstat
    // writes into that local.
    let size = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(in_fd, &mut st) != 0 || st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return false;
        }
        st.st_size
    };
    at >= 0 && at >= size
}

fn first_nonempty<'a>(bufs: &'a mut [&mut [u8]]) -> &'a mut [u8] {
    match bufs.iter_mut().find(|b| !b.is_empty()) {
        Some(b) => b,
        None => &mut [],
    }
}

/// Reads into `bufs`, skipping the first `skip` bytes of them (already filled).
fn read_into(rx: &mut Consumer, bufs: &mut [&mut [u8]], mut skip: usize) -> usize {
    let mut total = 0;
    for b in bufs.iter_mut() {
        if skip >= b.len() {
            skip -= b.len();
            continue;
        }
        let dst = &mut b[skip..];
        skip = 0;
        let n = rx.read(dst);
        total += n;
        if n < dst.len() {
            break;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;

    /// A server-side connection over a fresh region, as after a claim.
    fn server_conn() -> Conn {
        let len = flowlane_lane::ring::region_len_for(64 << 10);
        let memfd = flowlane_lane::region::sealed_memfd(len).expect("sealed memfd");
        Conn::new(7, memfd, len, Side::Server, false, false).expect("map the region")
    }

    /// A loopback TCP pair (the library leaves loopback alone).
    fn tcp_pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (c, s)
    }

    /// Waits (2 s at most) until the peer's end (FIN or RST) reached `fd`.
    fn wait_peer_end(fd: c_int) {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let r = unsafe { real::poll(&mut p, 1, 2000) };
        assert!(r == 1, "the peer's end did not arrive within 2 s");
    }

    #[test]
    fn a_doorbell_that_takes_the_peers_reset_resets_the_connection() {
        let conn = server_conn();
        let (client, server) = tcp_pair();
        // The peer resets the connection: SO_LINGER 0, then close.
        let l = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        // SAFETY: setsockopt with a local linger struct.
        let r = unsafe {
            libc::setsockopt(
                client.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&l as *const libc::linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            )
        };
        assert_eq!(r, 0);
        drop(client);
        wait_peer_end(server.as_raw_fd());
        set_errno(libc::EINTR);
        conn.ring_bell(server.as_raw_fd());
        assert_eq!(errno(), libc::EINTR, "ring_bell changed errno");
        assert!(
            conn.tcp_reset.load(Ordering::Acquire),
            "the doorbell took the reset but the connection did not note it"
        );
        // Why it must be noted there: the kernel reported the error once,
        // and the socket now reads as a clean end-of-stream.
        let mut b = [0u8; 1];
        // SAFETY: reading into a local buffer of its length.
        let n = unsafe { real::recv(server.as_raw_fd(), b.as_mut_ptr().cast(), 1, 0) };
        assert_eq!(n, 0);
        // The application reads the reset, not an end-of-stream.
        let mut buf = [0u8; 16];
        let mut bufs = [&mut buf[..]];
        assert_eq!(
            conn.recv(server.as_raw_fd(), &mut bufs, 0),
            Err(libc::ECONNRESET)
        );
    }

    #[test]
    fn a_doorbell_to_a_peer_that_closed_cleanly_is_no_reset() {
        let conn = server_conn();
        let (client, server) = tcp_pair();
        drop(client);
        wait_peer_end(server.as_raw_fd());
        conn.ring_bell(server.as_raw_fd());
        assert!(!conn.tcp_reset.load(Ordering::Acquire));
    }
}
