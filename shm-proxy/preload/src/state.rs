//! Process-wide bookkeeping: which fds carry a shared-memory connection,
//! which are registered listeners, which epoll sets watch such fds.
//!
//! Every libc wrapper first tests a bit in a lock-free bitmap, so calls on
//! ordinary fds cost one atomic load. Only fds with state take the lock, a
//! tiny spin lock held for a few instructions (never across a syscall or a
//! free). `fork` is safe: a `pthread_atfork` handler holds the lock across
//! the fork and releases it on both sides, so the child never inherits it
//! locked, and bumps a fork generation so a connection knows it may now be
//! shared with another process.

use crate::conn::Conn;
use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// Fds at or above this stay on TCP (bitmap bound).
pub const MAX_FD: usize = 1 << 16;

/// One bit per fd.
pub struct FdBits([AtomicU64; MAX_FD / 64]);

impl FdBits {
    const fn new() -> Self {
        FdBits([const { AtomicU64::new(0) }; MAX_FD / 64])
    }
    /// Whether `fd` is marked (false for out-of-range fds).
    #[inline]
    pub fn get(&self, fd: i32) -> bool {
        let fd = fd as usize; // negative fds wrap to huge values and fail the bound
        fd < MAX_FD && self.0[fd / 64].load(Ordering::Relaxed) & (1 << (fd % 64)) != 0
    }
    /// Clears every bit (atomic stores only: safe in a fork handler).
    pub fn clear_all(&self) {
        for w in &self.0 {
            w.store(0, Ordering::Relaxed);
        }
    }
    pub fn set(&self, fd: i32, on: bool) {
        let fd = fd as usize;
        if fd < MAX_FD {
            if on {
                self.0[fd / 64].fetch_or(1 << (fd % 64), Ordering::Relaxed);
            } else {
                self.0[fd / 64].fetch_and(!(1 << (fd % 64)), Ordering::Relaxed);
            }
        }
    }
}

/// Fds with a shared-memory connection.
pub static CONN_FDS: FdBits = FdBits::new();
/// Registered flowlane listeners.
pub static LISTEN_FDS: FdBits = FdBits::new();
/// Epoll sets that watch at least one connection fd.
pub static EPOLL_FDS: FdBits = FdBits::new();
/// Fds the application added to some epoll set while they were plain
/// sockets: such a socket must not switch to the ring later (its epoll
/// registration would no longer see the data).
pub static EPOLL_SEEN: FdBits = FdBits::new();
/// TCP sockets the application made (`socket`) that have not connected
/// yet: their epoll registrations are recorded in `Tables::plain`, so that
/// they can move into the library's emulation if the connection goes onto
/// the ring (see `wait::adopt_plain`).
pub static UNCONNECTED: FdBits = FdBits::new();
/// TCP sockets whose options the ring takes over (SO_RCVTIMEO,
/// SO_SNDTIMEO, TCP_NODELAY, TCP_CORK) hold the kernel's defaults as far
/// as this process can know: made by `socket()` here, none of the four set
/// since, and no fork since (another process may share the socket and set
/// them). Meaningful only with `UNCONNECTED` (both are set by the same
/// `socket()`, and `UNCONNECTED` is cleared whenever the fd leaves that
/// state): a connection set up on such a socket, or accepted from such a
/// listener (Linux copies the listener's options), reads none of them.
pub static DEFAULT_OPTIONS: FdBits = FdBits::new();
/// Epoll fds of the application (`epoll_create*`, and their duplicates).
pub static EPOLL_INSTANCES: FdBits = FdBits::new();
/// Epoll fds that duplicate another one (`dup`, `fcntl(F_DUPFD*)`: mio's
/// `Registry::try_clone`, so every tokio program): the library keeps the
/// set under one number, its key (`epoll_key`).
pub static EPOLL_DUPS: FdBits = FdBits::new();
/// Fds the library made for itself: eventfds it added to epoll sets to
/// wake their sleepers (see `wait::kick`), threads' bells (`sleepers`) and
/// the daemon connection (`setup`). An application close of one (close,
/// close_range, dup2 onto it) is noticed, and the library forgets the fd.
pub static WAKE_FDS: FdBits = FdBits::new();
/// Live connection objects in this process (fast "nothing to do" test).
pub static LIVE: AtomicUsize = AtomicUsize::new(0);
/// Incremented on both sides of every fork.
pub static FORK_GEN: AtomicU64 = AtomicU64::new(0);

/// An application's epoll registration of a connection fd.
pub struct Reg {
    pub fd: i32,
    pub conn: Arc<Conn>,
    /// The events the application asked for (EPOLLIN, EPOLLET, ...).
    pub events: u32,
    /// The application's epoll_data.
    pub data: u64,
    /// Edge-trigger emulation: what was last reported, and ring positions then.
    pub last_events: u32,
    pub last_rx_tail: u64,
    pub last_tx_head: u64,
    /// EPOLLONESHOT: reported once, disarmed until EPOLL_CTL_MOD.
    pub armed: bool,
}

/// An application's epoll registration of a TCP socket made before its
/// `connect` (the kernel holds it with the application's own data word).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlainReg {
    pub epfd: i32,
    pub events: u32,
    pub data: u64,
    /// `FORK_GEN` when it was made: the socket (and the set) may be shared
    /// with another process after a fork.
    pub fork_gen: u64,
}

/// A registered listener.
pub struct Listener {
    pub addr: SocketAddr,
    pub fork_gen: u64,
}

#[derive(Default)]
pub struct Tables {
    pub conns: HashMap<i32, Arc<Conn>>,
    pub listeners: HashMap<i32, Listener>,
    pub epolls: HashMap<i32, Vec<Reg>>,
    /// Per epoll set: the eventfd that wakes its sleepers.
    pub wakers: HashMap<i32, i32>,
    /// The library's other private fds (see `track_private`), each with
    /// the flag that tells its owner the fd is no longer its own.
    pub private: HashMap<i32, Arc<AtomicBool>>,
    /// Per not-yet-connected TCP socket (`UNCONNECTED`): its epoll
    /// registrations, in every set it was added to.
    pub plain: HashMap<i32, Vec<PlainReg>>,
    /// Duplicated epoll fds (`EPOLL_DUPS`) -> the number the set is kept
    /// under (a live fd of the same epoll instance).
    pub epoll_alias: HashMap<i32, i32>,
    /// Stock channels, as a client and as a server (`stock.rs`).
    pub stock: crate::stock::Stock,
}

struct Locked {
    busy: AtomicBool,
    tables: UnsafeCell<Option<Tables>>,
}

// SAFETY: `tables` is only accessed while `busy` is held (see `with`).
unsafe impl Sync for Locked {}

static STATE: Locked = Locked {
    busy: AtomicBool::new(false),
    tables: UnsafeCell::new(None),
};

fn lock() {
    let mut spins = 0u32;
    while STATE
        .busy
        .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

fn unlock() {
    STATE.busy.store(false, Ordering::Release);
}

/// Runs `f` with the tables locked. `f` must be short: no syscalls, and it
/// must hand out (not drop) connection objects, so no unmapping happens
/// under the lock.
pub fn with<R>(f: impl FnOnce(&mut Tables) -> R) -> R {
    lock();
    struct Unlock;
    impl Drop for Unlock {
        fn drop(&mut self) {
            unlock();
        }
    }
    let _u = Unlock;
    // SAFETY: we hold the lock, so this is the only reference.
    let t = unsafe { &mut *STATE.tables.get() };
    f(t.get_or_insert_with(Tables::default))
}

/// The connection on `fd`, if any.
#[inline]
pub fn conn(fd: i32) -> Option<Arc<Conn>> {
    if !CONN_FDS.get(fd) {
        return None;
    }
    with(|t| t.conns.get(&fd).cloned())
}

/// Puts `conn` on `fd`; returns what was there before (to be dropped by the
/// caller outside the lock).
pub fn install(fd: i32, conn: Arc<Conn>) -> Option<Arc<Conn>> {
    let old = with(|t| {
        CONN_FDS.set(fd, true);
        t.conns.insert(fd, conn)
    });
    if old.is_none() {
        LIVE.fetch_add(1, Ordering::Relaxed);
    }
    old
}

/// Removes the connection on `fd` and every epoll registration of `fd`.
/// Returns the connection and the removed registrations with their epoll
/// fds (drop them outside the lock).
pub fn remove(fd: i32) -> (Option<Arc<Conn>>, Vec<(i32, Reg)>) {
    let (c, regs) = with(|t| {
        CONN_FDS.set(fd, false);
        let c = t.conns.remove(&fd);
        let mut regs = Vec::new();
        if c.is_some() {
            for (epfd, list) in t.epolls.iter_mut() {
                let mut i = 0;
                while i < list.len() {
                    if list[i].fd == fd {
                        regs.push((*epfd, list.swap_remove(i)));
                    } else {
                        i += 1;
                    }
                }
            }
        }
        (c, regs)
    });
    if c.is_some() {
        LIVE.fetch_sub(1, Ordering::Relaxed);
    }
    (c, regs)
}

/// Every fd of this process that refers to `conn`.
pub fn fds_of(conn: &Arc<Conn>) -> Vec<i32> {
    with(|t| {
        t.conns
            .iter()
            .filter(|(_, c)| Arc::ptr_eq(c, conn))
            .map(|(fd, _)| *fd)
            .collect()
    })
}

/// Marks `fd` as a registered listener.
pub fn add_listener(fd: i32, addr: SocketAddr) {
    let gen = FORK_GEN.load(Ordering::Relaxed);
    with(|t| {
        LISTEN_FDS.set(fd, true);
        t.listeners.insert(
            fd,
            Listener {
                addr,
                fork_gen: gen,
            },
        );
    });
}

/// Forgets the listener on `fd`.
pub fn remove_listener(fd: i32) -> Option<Listener> {
    if !LISTEN_FDS.get(fd) {
        return None;
    }
    with(|t| {
        LISTEN_FDS.set(fd, false);
        t.listeners.remove(&fd)
    })
}

/// The number under which the library keeps the epoll set of `epfd`
/// (itself unless it duplicates another epoll fd).
#[inline]
pub fn epoll_key(epfd: i32) -> i32 {
    if !EPOLL_DUPS.get(epfd) {
        return epfd;
    }
    with(|t| t.epoll_alias.get(&epfd).copied().unwrap_or(epfd))
}

/// `new` now refers to the same epoll instance as `old`.
pub fn epoll_dup(old: i32, new: i32) {
    with(|t| {
        let key = t.epoll_alias.get(&old).copied().unwrap_or(old);
        EPOLL_INSTANCES.set(new, true);
        if new != key {
            t.epoll_alias.insert(new, key);
            EPOLL_DUPS.set(new, true);
        }
    })
}

/// Forgets everything about an epoll fd being closed: for the last fd of
/// its set, its registrations and its wake eventfd (for the caller to
/// close); a set that other fds still refer to moves under one of them.
pub fn remove_epoll(epfd: i32) -> (Option<Vec<Reg>>, Option<i32>) {
    if !EPOLL_FDS.get(epfd) && !EPOLL_INSTANCES.get(epfd) {
        return (None, None);
    }
    with(|t| {
        EPOLL_INSTANCES.set(epfd, false);
        if EPOLL_DUPS.get(epfd) {
            EPOLL_DUPS.set(epfd, false);
            t.epoll_alias.remove(&epfd);
            return (None, None);
        }
        let mut dups: Vec<i32> = t
            .epoll_alias
            .iter()
            .filter(|(_, k)| **k == epfd)
            .map(|(f, _)| *f)
            .collect();
        dups.sort_unstable();
        if let Some(&heir) = dups.first() {
            t.epoll_alias.remove(&heir);
            EPOLL_DUPS.set(heir, false);
            for f in &dups[1..] {
                t.epoll_alias.insert(*f, heir);
            }
            if let Some(list) = t.epolls.remove(&epfd) {
                t.epolls.insert(heir, list);
            }
            if let Some(w) = t.wakers.remove(&epfd) {
                t.wakers.insert(heir, w);
            }
            if EPOLL_FDS.get(epfd) {
                EPOLL_FDS.set(heir, true);
            }
            EPOLL_FDS.set(epfd, false);
            return (None, None);
        }
        if !EPOLL_FDS.get(epfd) {
            return (None, None);
        }
        EPOLL_FDS.set(epfd, false);
        let waker = t.wakers.remove(&epfd);
        if let Some(w) = waker {
            WAKE_FDS.set(w, false);
        }
        (t.epolls.remove(&epfd), waker)
    })
}

/// The wake eventfd of `epfd`, if it has one.
pub fn waker(epfd: i32) -> Option<i32> {
    with(|t| t.wakers.get(&epfd).copied())
}

/// Records `efd` as the wake eventfd of `epfd` unless another thread was
/// first; returns the one in use.
pub fn set_waker(epfd: i32, efd: i32) -> i32 {
    with(|t| {
        let w = *t.wakers.entry(epfd).or_insert(efd);
        WAKE_FDS.set(w, true);
        w
    })
}

/// The application closed a wake eventfd: no epoll set uses it any more
/// (the kernel dropped it from the set), so a new one is made on demand.
/// Also for the library's other private fds: their owner is told (`gone`)
/// and makes a new one when it needs one.
pub fn forget_waker(efd: i32) {
    if !WAKE_FDS.get(efd) {
        return;
    }
    with(|t| {
        WAKE_FDS.set(efd, false);
        t.wakers.retain(|_, w| *w != efd);
        if let Some(gone) = t.private.remove(&efd) {
            gone.store(true, Ordering::Release);
        }
    })
}

/// Tracks a private fd of the library (a thread's bell, the daemon
/// connection): `gone` is set when the application closes it, or in a
/// forked child (where the fd is closed at once: its owner lives in the
/// parent).
pub fn track_private(fd: i32, gone: Arc<AtomicBool>) {
    with(|t| {
        WAKE_FDS.set(fd, true);
        t.private.insert(fd, gone);
    })
}

/// The owner closes its private fd; false if the fd was no longer its own
/// (then it must not close it).
pub fn untrack_private(fd: i32) -> bool {
    if !WAKE_FDS.get(fd) {
        return false;
    }
    with(|t| {
        let mine = t.private.remove(&fd).is_some();
        if mine {
            WAKE_FDS.set(fd, false);
        }
        mine
    })
}

/// Moves a private fd of the library up to a high number (close-on-exec),
/// out of the range applications expect their own fds in; returns the fd
/// to use (the original one if no high slot is free).
pub fn park_high(fd: i32) -> i32 {
    let base = high_fd_base();
    if fd >= base {
        return fd;
    }
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) on an fd the caller owns.
    let high = unsafe { crate::real::fcntl(fd, libc::F_DUPFD_CLOEXEC, base as libc::c_ulong) };
    if high < 0 {
        return fd;
    }
    // SAFETY: closing the caller's original, now duplicated, fd.
    unsafe { crate::real::close(fd) };
    high
}

/// Where the library's private fds go: three quarters up the process's
/// fd limit (at most the tracked range).
pub fn high_fd_base() -> i32 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit into a local struct.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur.min(MAX_FD as libc::rlim_t) as i32
    } else {
        1024
    };
    soft - soft / 4
}

/// Adds or replaces the registration of `reg.fd` in `epfd`.
pub fn epoll_put(epfd: i32, reg: Reg) -> Option<Reg> {
    with(|t| {
        EPOLL_FDS.set(epfd, true);
        let list = t.epolls.entry(epfd).or_default();
        match list.iter_mut().find(|r| r.fd == reg.fd) {
            Some(r) => Some(std::mem::replace(r, reg)),
            None => {
                list.push(reg);
                None
            }
        }
    })
}

/// Removes the registration of `fd` in `epfd`.
pub fn epoll_del(epfd: i32, fd: i32) -> Option<Reg> {
    if !EPOLL_FDS.get(epfd) {
        return None;
    }
    with(|t| {
        let list = t.epolls.get_mut(&epfd)?;
        let i = list.iter().position(|r| r.fd == fd)?;
        Some(list.swap_remove(i))
    })
}

extern "C" fn before_fork() {
    lock();
}

extern "C" fn after_fork() {
    FORK_GEN.fetch_add(1, Ordering::Relaxed);
    DEFAULT_OPTIONS.clear_all();
    unlock();
}

/// In the child: the forking thread is the only one left, so no lock of a
/// connection can have a live holder; reset them all (a thread of the
/// parent blocked in `read` left its connection's read lock taken).
extern "C" fn after_fork_child() {
    FORK_GEN.fetch_add(1, Ordering::Relaxed);
    DEFAULT_OPTIONS.clear_all();
    // SAFETY: `before_fork` took the table lock in this very thread, so
    // nothing else can reach the tables.
    if let Some(t) = unsafe { &mut *STATE.tables.get() } {
        // The library's private fds belong to the parent's threads (bells)
        // or to the parent (its daemon connection): close the child's
        // copies so that the two processes never share them.
        for (fd, gone) in t.private.drain() {
            gone.store(true, Ordering::Release);
            WAKE_FDS.set(fd, false);
            // SAFETY: closing the child's copy of a library-private fd.
            unsafe { crate::real::close(fd) };
        }
        for c in t.conns.values() {
            c.reset_locks_after_fork();
        }
        t.stock.forget_after_fork();
        crate::daemon_conn::after_fork_child();
    }
    unlock();
}

/// Registers the fork handlers (called once from the constructor).
pub fn install_fork_handlers() {
    // SAFETY: three valid `extern "C" fn()` handlers that never unwind.
    unsafe { libc::pthread_atfork(Some(before_fork), Some(after_fork), Some(after_fork_child)) };
}
