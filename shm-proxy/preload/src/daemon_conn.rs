//! The process's connection to flowlaned, kept open between requests.
//!
//! A fresh Unix connection per request cost a connect plus the daemon's
//! authentication (peer credentials, `/proc/PID/ns/net`) every time: a
//! lane connection made four of them (intent, claim, and a close report
//! from each end). One connection per process, kept open:
//!
//! - **one request at a time:** a try-lock; a thread that finds it busy
//!   (another thread's request, or a signal handler interrupting one) uses
//!   a connection of its own for that request, as before;
//! - **never shared across fork:** the child's copy is closed by the fork
//!   handler (`state`), and a process id change is checked as well;
//! - **out of the application's way:** close-on-exec, at a high fd number,
//!   tracked so that an application closing it (close, close_range, dup2
//!   onto it) is noticed and the number is never used again by the library;
//! - **bound to its network namespace:** the daemon identifies a client by
//!   the namespace its process was in when it connected, so a thread that
//!   entered another namespace (setns) makes its own connection;
//! - **daemon restarts:** a connection the daemon closed (idle timeout,
//!   restart) is noticed before use; one that fails during a request is
//!   replaced once and the request repeated, then the connection stays on
//!   TCP as before;
//! - **stock asked for ahead** (`send_ahead`): one request at most whose
//!   answer is read later, at the next connect or accept that finds it
//!   waiting, or before the next request on the connection. No connection
//!   waits for the daemon to make stock. While an answer is owed, a
//!   request that finds the connection busy waits a little for it rather
//!   than using a connection of its own: the daemon counts what it granted
//!   ahead as held by this process, and a server's claim that went around
//!   the owed answer would not be granted the channel its client used.

use crate::{state, stock};
use flowlane_lane::client::DaemonClient;
use std::cell::{Cell, UnsafeCell};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Held {
    client: DaemonClient,
    pid: u32,
    /// Network namespace (inode) of the thread that connected.
    netns: Option<u64>,
    /// Set when the fd is no longer ours (see `state::track_private`).
    gone: Arc<AtomicBool>,
    /// The socket's (device, inode): a program that closed the fd behind
    /// the library's back (a raw close_range, glibc's closefrom) may have
    /// reused the number; then it is not ours to use or to close.
    id: (u64, u64),
    /// A request sent ahead whose answer is still to be read.
    ahead: Option<Ahead>,
}

/// A stock request sent ahead (`send_ahead`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ahead {
    /// A client's `stock-refill` for this destination.
    Refill { dst: SocketAddr, want: u32 },
    /// A server's `stock-fetch` for this listener address.
    Fetch { local: SocketAddr },
}

/// (device, inode) of what `fd` refers to now.
fn file_id(fd: libc::c_int) -> Option<(u64, u64)> {
    // SAFETY: libc::stat is plain old data; all-zero is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat into a local struct.
    let r = unsafe { libc::fstat(fd, &mut st) };
    (r == 0).then_some((st.st_dev, st.st_ino))
}

impl Held {
    /// A new kept connection, bound to the calling thread's namespace
    /// (read after the connect: no daemon costs no /proc lookup).
    fn connect(socket: &Path, timeout: Duration, pid: u32) -> Option<Held> {
        let client = DaemonClient::connect_at(socket, timeout, Some(state::high_fd_base())).ok()?;
        let netns = thread_netns();
        let id = file_id(client.raw_fd())?;
        let gone = Arc::new(AtomicBool::new(false));
        state::track_private(client.raw_fd(), gone.clone());
        Some(Held {
            client,
            pid,
            netns,
            gone,
            id,
            ahead: None,
        })
    }

    /// Reads the answer to the request sent ahead, if one is outstanding,
    /// and keeps the stock it grants. A failure breaks the connection (the
    /// caller discards it).
    fn finish_ahead(&mut self) {
        let Some(ahead) = self.ahead.take() else {
            return;
        };
        if let Ok(granted) = self.client.recv_stock_ahead() {
            match ahead {
                Ahead::Refill { dst, .. } => stock::add_client(dst, granted),
                Ahead::Fetch { local } => stock::add_held(local, granted),
            }
        }
        // Only once the stock is in the tables: a thread that found the
        // slot busy meanwhile waited for it (`lock_for_request`).
        AHEAD_OWED.store(false, Ordering::Release);
    }

    /// True when the answer can be read now (in this process: a forked
    /// child's copy is not its to read).
    fn ahead_ready(&self, pid: u32) -> bool {
        // The poll first: while the daemon is still at it, one system call.
        self.ahead.is_some()
            && self.pid == pid
            && (self.client.is_broken() || self.client.answer_waiting())
            && self.still_ours()
    }

    fn still_ours(&self) -> bool {
        !self.gone.load(Ordering::Acquire) && file_id(self.client.raw_fd()) == Some(self.id)
    }

    fn usable(&self, pid: u32) -> bool {
        self.pid == pid
            && self.still_ours()
            && !self.client.is_broken()
            && !self.client.looks_closed()
    }

    /// Closes the connection if the fd is still ours (and forgets the
    /// number either way).
    fn discard(self) {
        if self.ahead.is_some() {
            AHEAD_OWED.store(false, Ordering::Release);
        }
        let ours = self.still_ours();
        if state::untrack_private(self.client.raw_fd()) && ours {
            drop(self.client);
        } else {
            self.client.forget();
        }
    }
}

struct Slot {
    busy: AtomicBool,
    held: UnsafeCell<Option<Held>>,
}

// SAFETY: `held` is only reached by the thread that set `busy`.
unsafe impl Sync for Slot {}

static SLOT: Slot = Slot {
    busy: AtomicBool::new(false),
    held: UnsafeCell::new(None),
};

struct Unlock;

impl Drop for Unlock {
    fn drop(&mut self) {
        SLOT.busy.store(false, Ordering::Release);
    }
}

thread_local! {
    /// The thread's network namespace as last read (`None`: read it).
    /// A path lookup in /proc per daemon request was the largest cost of
    /// a lane connection's messages; a thread changes namespace only with
    /// `setns` or `unshare`, which the library interposes to clear this.
    static NETNS: Cell<Option<Option<u64>>> = const { Cell::new(None) };
}

/// The calling thread's network namespace (inode), if /proc tells.
fn thread_netns() -> Option<u64> {
    if let Some(known) = NETNS.with(Cell::get) {
        return known;
    }
    // SAFETY: libc::stat is plain old data; all-zero is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: stat of a NUL-terminated path into a local struct.
    let r = unsafe { libc::stat(c"/proc/thread-self/ns/net".as_ptr(), &mut st) };
    let netns = (r == 0).then_some(st.st_ino);
    NETNS.with(|c| c.set(Some(netns)));
    netns
}

/// The calling thread may be in another network namespace now (after
/// `setns`, `unshare`): its next request reads it again.
pub fn netns_may_have_changed() {
    NETNS.with(|c| c.set(None));
}

/// One request on a connection of its own (closed afterwards).
fn one_shot<R>(
    socket: &Path,
    timeout: Duration,
    f: &mut impl FnMut(&mut DaemonClient) -> R,
) -> Option<R> {
    DaemonClient::connect(socket, timeout)
        .ok()
        .map(|mut d| f(&mut d))
}

/// Runs `f` on the process's daemon connection (made or remade as needed);
/// `None` when no daemon answers.
pub fn with<R>(
    socket: &Path,
    timeout: Duration,
    mut f: impl FnMut(&mut DaemonClient) -> R,
) -> Option<R> {
    let Some(_unlock) = lock_for_request() else {
        return one_shot(socket, timeout, &mut f);
    };
    // SAFETY: we hold `busy`: no other thread reaches the slot.
    let slot = unsafe { &mut *SLOT.held.get() };
    let pid = std::process::id();
    let mut reused = false;
    if let Some(mut h) = slot.take() {
        // An answer still owed reads as unasked-for bytes: read it first.
        if h.ahead.is_some() && h.pid == pid && h.still_ours() {
            h.finish_ahead();
        }
        if h.usable(pid) {
            if h.netns != thread_netns() {
                // A thread in another namespace: the kept connection speaks
                // for the namespace it was made in.
                *slot = Some(h);
                return one_shot(socket, timeout, &mut f);
            }
            *slot = Some(h);
            reused = true;
        } else {
            h.discard();
        }
    }
    if slot.is_none() {
        *slot = Some(Held::connect(socket, timeout, pid)?);
    }
    let h = slot.as_mut()?;
    let r = f(&mut h.client);
    if !h.client.is_broken() {
        return Some(r);
    }
    let timed_out = h.client.timed_out();
    if let Some(h) = slot.take() {
        h.discard();
    }
    if !reused || timed_out {
        return Some(r);
    }
    // The kept connection broke mid-request (the daemon restarted since
    // its last use): once more on a fresh one.
    *slot = Some(Held::connect(socket, timeout, pid)?);
    let h = slot.as_mut()?;
    let r = f(&mut h.client);
    if h.client.is_broken() {
        if let Some(h) = slot.take() {
            h.discard();
        }
    }
    Some(r)
}

/// Sends `ahead` on the process's kept connection without waiting for
/// its answer. Skipped (it is only ever an optimisation) when the
/// connection is busy, not made yet, in another network namespace, or
/// still owes the answer to an earlier request sent ahead.
pub fn send_ahead(ahead: Ahead) {
    let Some(_unlock) = try_lock() else {
        return;
    };
    // SAFETY: we hold `busy`: no other thread reaches the slot.
    let slot = unsafe { &mut *SLOT.held.get() };
    let pid = std::process::id();
    let Some(h) = slot.as_mut() else {
        return;
    };
    if h.ahead_ready(pid) {
        h.finish_ahead();
    }
    if h.ahead.is_some() || !h.usable(pid) || h.netns != thread_netns() {
        return;
    }
    let sent = match ahead {
        Ahead::Refill { dst, want } => h.client.send_stock_refill(dst, want),
        Ahead::Fetch { local } => h.client.send_stock_fetch(local),
    };
    if sent.is_ok() {
        h.ahead = Some(ahead);
        AHEAD_OWED.store(true, Ordering::Release);
    } else if h.client.is_broken() {
        if let Some(h) = slot.take() {
            h.discard();
        }
    }
}

/// Reads the answer to a request sent ahead and keeps its stock: only if
/// it has arrived, or (`wait`) waiting for it. True when one was read.
pub fn collect_ahead(wait: bool) -> bool {
    let locked = if wait { lock_for_request() } else { try_lock() };
    let Some(_unlock) = locked else {
        return false;
    };
    // SAFETY: we hold `busy`: no other thread reaches the slot.
    let slot = unsafe { &mut *SLOT.held.get() };
    // Nothing owed (most connects and accepts): no system call at all.
    let Some(h) = slot.as_mut().filter(|h| h.ahead.is_some()) else {
        return false;
    };
    let pid = std::process::id();
    let ready = if wait {
        h.pid == pid && h.still_ours()
    } else {
        h.ahead_ready(pid)
    };
    if !ready {
        return false;
    }
    h.finish_ahead();
    if h.client.is_broken() {
        if let Some(h) = slot.take() {
            h.discard();
        }
    }
    true
}

/// Set while the kept connection owes the answer to a request sent ahead.
static AHEAD_OWED: AtomicBool = AtomicBool::new(false);

/// How long a request waits for a busy slot while an answer is owed (a
/// request on the kept connection is a round trip to a local daemon; a
/// signal handler that interrupted this thread's own request waits this
/// long, then uses a connection of its own).
const OWED_LOCK_WAIT: Duration = Duration::from_millis(20);

/// The slot for a request: at once if free; while an answer sent ahead is
/// owed, after waiting (`OWED_LOCK_WAIT` at most) for the thread using it.
fn lock_for_request() -> Option<Unlock> {
    if let Some(unlock) = try_lock() {
        return Some(unlock);
    }
    if !AHEAD_OWED.load(Ordering::Acquire) {
        return None;
    }
    let end = Instant::now() + OWED_LOCK_WAIT;
    while Instant::now() < end {
        std::thread::yield_now();
        if let Some(unlock) = try_lock() {
            return Some(unlock);
        }
    }
    None
}

/// The slot, if no other thread (or an interrupted request on this one)
/// holds it.
fn try_lock() -> Option<Unlock> {
    SLOT.busy
        .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
        .ok()
        .map(|_| Unlock)
}

/// In a forked child (from the fork handler, one thread left): the fd was
/// closed and marked gone by `state`; a parent thread that was inside a
/// request left the slot locked, and its contents may be half-made.
pub fn after_fork_child() {
    // The parent's answer is the parent's to read.
    AHEAD_OWED.store(false, Ordering::Relaxed);
    if SLOT.busy.load(Ordering::Relaxed) {
        // SAFETY: the forked child has one thread (this one), which is not
        // inside `with`.
        let held = unsafe { &mut *SLOT.held.get() };
        std::mem::forget(held.take());
        SLOT.busy.store(false, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flowlane_lane::proto::{self, Request, Response};
    use std::io::{Read, Write};
    use std::os::unix::net::UnixListener;
    use std::sync::mpsc;

    /// A daemon answering each connection's requests in order: `Ok` to
    /// anything but `stock-fetch`, whose answer (no stock) comes after
    /// `fetch_delay`. It tells the test each request and the number of the
    /// connection it came on (in the order they were accepted).
    fn fake_daemon(path: &Path, fetch_delay: Duration) -> mpsc::Receiver<(usize, Request)> {
        let listener = UnixListener::bind(path).unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for (n, conn) in listener.incoming().enumerate() {
                let Ok(mut conn) = conn else { return };
                let tx = tx.clone();
                std::thread::spawn(move || loop {
                    let mut hdr = [0u8; proto::HEADER_LEN];
                    if conn.read_exact(&mut hdr).is_err() {
                        return;
                    }
                    let Ok(len) = proto::frame_len(hdr, proto::MAX_REQUEST_FRAME) else {
                        return;
                    };
                    let mut body = vec![0u8; len];
                    if conn.read_exact(&mut body).is_err() {
                        return;
                    }
                    let req = proto::decode_request(&body).unwrap();
                    let answer = if matches!(req, Request::StockFetch { .. }) {
                        std::thread::sleep(fetch_delay);
                        Response::Stocked {
                            channel: None,
                            stock: Vec::new(),
                        }
                    } else {
                        Response::Ok
                    };
                    let _ = tx.send((n, req));
                    let frame = proto::encode_frame(&answer, proto::MAX_RESPONSE_FRAME).unwrap();
                    if conn.write_all(&frame).is_err() {
                        return;
                    }
                });
            }
        });
        rx
    }

    // One test: the kept connection is process-wide.
    #[test]
    fn a_request_while_an_answer_is_owed_waits_for_the_kept_connection() {
        let path = std::env::temp_dir().join(format!("fl-owed-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let seen = fake_daemon(&path, Duration::from_millis(5));
        let timeout = Duration::from_secs(5);
        let local: SocketAddr = "10.0.0.2:80".parse().unwrap();
        let register = move |d: &mut DaemonClient| d.register_listener(local).is_ok();
        // The kept connection (the daemon's connection 0), and a fetch
        // sent ahead on it, its answer owed.
        assert_eq!(with(&path, timeout, register), Some(true));
        send_ahead(Ahead::Fetch { local });
        assert!(AHEAD_OWED.load(Ordering::Acquire));
        // One thread takes the connection and reads the owed answer first
        // (the daemon takes 5 ms); another asks meanwhile. It waits for
        // the kept connection instead of going around the answer on a
        // connection of its own.
        let p = path.clone();
        let first = std::thread::spawn(move || with(&p, timeout, register));
        std::thread::sleep(Duration::from_millis(1));
        assert_eq!(with(&path, timeout, register), Some(true));
        assert_eq!(first.join().unwrap(), Some(true));
        assert!(!AHEAD_OWED.load(Ordering::Acquire));
        let got: Vec<(usize, Request)> = seen.try_iter().collect();
        assert_eq!(got.len(), 4, "{got:?}");
        assert!(
            got.iter().all(|(n, _)| *n == 0),
            "a request went around the owed answer: {got:?}"
        );
        assert!(matches!(got[1].1, Request::StockFetch { .. }), "{got:?}");
        let _ = std::fs::remove_file(&path);
    }
}
