//! Threads of this process asleep in a kernel wait (poll/select/epoll) on a
//! shared-memory connection, and how every one of them gets woken.
//!
//! The peer wakes such sleepers with one doorbell byte on the TCP socket.
//! The kernel wakes every thread asleep on that socket, but the library
//! consumes doorbells (it drains the socket before computing readiness):
//! the first thread to run takes the byte, and a second one, still inside
//! the kernel, re-checks the socket, finds it empty and sleeps on with data
//! in the ring. A thread that drains doorbells in a non-blocking read does
//! the same to a sleeping poller. So:
//!
//! - every sleeper also watches an eventfd of its own thread (its *bell*,
//!   made on first use) and registers it in the connection while it sleeps;
//!   whoever drains doorbell bytes (or sees the TCP end) rings the bells
//!   still registered: each registered thread wakes and re-evaluates the
//!   rings itself (a bell is an eventfd, so a ring is never lost between
//!   registering and sleeping);
//! - the ring's shared "a reader/writer waits for a doorbell" flag is set by
//!   every sleeper and withdrawn only by the last local sleeper to leave
//!   (one thread's withdrawal used to cancel the other's request).
//!
//! Bells are placed at high fd numbers, close-on-exec, tracked so that an
//! application closing one is noticed, and closed in a forked child (see
//! `state::private`), where the threads that owned them do not exist.

use crate::real;
use crate::state;
use flowlane_lane::ring::Probe;
use libc::c_int;
use std::cell::{RefCell, UnsafeCell};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// One thread's wake-up eventfd.
pub struct Bell {
    pub fd: c_int,
    /// The fd is no longer ours (the application closed it, or this is a
    /// forked child): never touch it again.
    gone: Arc<AtomicBool>,
    /// Rung since the owner last reset it.
    rung: AtomicBool,
}

impl Bell {
    fn new() -> Option<Arc<Bell>> {
        // SAFETY: plain eventfd creation.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return None;
        }
        let fd = state::park_high(fd);
        if fd as usize >= state::MAX_FD {
            // SAFETY: closing the eventfd made above.
            unsafe { real::close(fd) };
            return None;
        }
        let gone = Arc::new(AtomicBool::new(false));
        state::track_private(fd, gone.clone());
        Some(Arc::new(Bell {
            fd,
            gone,
            rung: AtomicBool::new(false),
        }))
    }

    fn usable(&self) -> bool {
        !self.gone.load(Ordering::Acquire)
    }

    /// Wakes the owner (or makes its next sleep return at once).
    pub fn ring(&self) {
        if !self.usable() {
            return;
        }
        let one: u64 = 1;
        // SAFETY: an 8-byte write from a local to our eventfd.
        unsafe { real::write(self.fd, (&one as *const u64).cast(), 8) };
        // After the write: an owner that resets between the two finds the
        // flag on its next reset (one extra wake-up at most); the other
        // order could leave the eventfd signalled with the flag cleared,
        // and the owner's every sleep would return at once.
        self.rung.store(true, Ordering::Release);
    }

    /// Clears a ring that came in after the owner's last wait (called by
    /// the owner before it registers for its next sleep).
    pub fn reset(&self) {
        if self.rung.swap(false, Ordering::AcqRel) && self.usable() {
            let mut v = 0u64;
            // SAFETY: an 8-byte read into a local from our non-blocking eventfd.
            unsafe { real::read(self.fd, (&mut v as *mut u64).cast(), 8) };
        }
    }
}

impl Drop for Bell {
    fn drop(&mut self) {
        if self.usable() && state::untrack_private(self.fd) {
            // SAFETY: closing our own eventfd, still ours (tracked until now).
            unsafe { real::close(self.fd) };
        }
    }
}

thread_local! {
    static MINE: RefCell<Option<Arc<Bell>>> = const { RefCell::new(None) };
}

/// The calling thread's bell, made on first use (`None` if no eventfd can
/// be had: the wait then relies on its periodic re-check).
pub fn thread_bell() -> Option<Arc<Bell>> {
    MINE.try_with(|m| {
        let mut m = m.try_borrow_mut().ok()?;
        if let Some(b) = m.as_ref().filter(|b| b.usable()) {
            return Some(b.clone());
        }
        let b = Bell::new()?;
        *m = Some(b.clone());
        Some(b)
    })
    .ok()
    .flatten()
}

/// The sleepers of one connection in this process.
pub struct Sleepers {
    busy: AtomicBool,
    inner: UnsafeCell<Inner>,
    /// Bells registered right now (lets `wake_others` skip the lock).
    bells: AtomicUsize,
}

#[derive(Default)]
struct Inner {
    readers: u32,
    writers: u32,
    bells: Vec<Arc<Bell>>,
}

// SAFETY: `inner` is only reached while `busy` is held (see `locked`).
unsafe impl Sync for Sleepers {}

impl Sleepers {
    pub fn new() -> Sleepers {
        Sleepers {
            busy: AtomicBool::new(false),
            inner: UnsafeCell::new(Inner::default()),
            bells: AtomicUsize::new(0),
        }
    }

    /// Runs `f` under the lock (a spin lock held for a few instructions,
    /// never across a syscall).
    fn locked<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        while self
            .busy
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::hint::spin_loop();
        }
        // SAFETY: we hold the lock, so this is the only reference.
        let r = f(unsafe { &mut *self.inner.get() });
        self.busy.store(false, Ordering::Release);
        r
    }

    /// A thread is about to sleep waiting for data (`read`) and/or room
    /// (`write`): ask the peer for doorbells and register its bell. The
    /// caller re-checks the rings afterwards (the flag's SeqCst fence
    /// orders that check after the request; see `ring`).
    pub fn enter(&self, probe: &Probe, read: bool, write: bool, bell: Option<&Arc<Bell>>) {
        self.locked(|i| {
            if read {
                i.readers += 1;
                probe.prepare_read_wait();
            }
            if write {
                i.writers += 1;
                probe.prepare_write_wait();
            }
            if let Some(b) = bell {
                i.bells.push(b.clone());
                self.bells.fetch_add(1, Ordering::SeqCst);
            }
        });
    }

    /// The thread woke (undoes its `enter` with the same arguments). The
    /// shared requests are withdrawn only when no local sleeper is left; a
    /// request left standing costs the peer at most one doorbell.
    pub fn leave(&self, probe: &Probe, read: bool, write: bool, bell: Option<&Arc<Bell>>) {
        let mine = self.locked(|i| {
            if read {
                i.readers = i.readers.saturating_sub(1);
            }
            if write {
                i.writers = i.writers.saturating_sub(1);
            }
            if (read || write) && i.readers == 0 && i.writers == 0 {
                probe.cancel_waits();
            }
            let pos = bell.and_then(|b| i.bells.iter().position(|x| Arc::ptr_eq(x, b)))?;
            self.bells.fetch_sub(1, Ordering::SeqCst);
            Some(i.bells.swap_remove(pos))
        });
        drop(mine); // outside the lock: never the last reference (the caller holds one)
    }

    /// Doorbell bytes were consumed (or the TCP connection ended): every
    /// thread still registered must look at the rings itself.
    pub fn wake_others(&self) {
        // SeqCst: pairs with `enter`'s increment; a thread that registers
        // after this load re-checks the rings after the drain, and sees
        // what the consumed doorbell announced.
        if self.bells.load(Ordering::SeqCst) == 0 {
            return;
        }
        let bells: Vec<Arc<Bell>> = self.locked(|i| i.bells.clone());
        for b in &bells {
            b.ring();
        }
    }

    /// In a forked child: the sleeping threads do not exist there.
    pub fn reset_after_fork(&self) {
        self.busy.store(false, Ordering::Relaxed);
        // SAFETY: the forked child has one thread, which holds no reference.
        let i = unsafe { &mut *self.inner.get() };
        i.readers = 0;
        i.writers = 0;
        // The bells' fds were already closed and marked gone by `state` in
        // the child, so dropping them touches nothing.
        i.bells.clear();
        self.bells.store(0, Ordering::Relaxed);
    }
}
