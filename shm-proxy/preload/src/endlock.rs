//! The lock around one end (producer or consumer) of a connection's rings.
//!
//! A plain futex mutex (Drepper's three-state design) with one extra: a
//! forked child can reset it. `fork` copies the memory of every lock but
//! only the calling thread; a lock that another thread of the parent held
//! (a thread blocked in `read` on the connection, say) would stay locked in
//! the child forever, and the child's first `read` or `write` on that
//! connection would hang. The fork handler (`state`) resets every lock in
//! the child, where no other thread exists that could hold one.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU32, Ordering};

const FREE: u32 = 0;
const LOCKED: u32 = 1;
/// Locked, and some thread may sleep on the futex.
const CONTENDED: u32 = 2;

pub struct EndLock<T> {
    state: AtomicU32,
    value: UnsafeCell<T>,
}

// SAFETY: the value is only reached through a guard, which exists for one
// thread at a time (the lock's state word serialises them).
unsafe impl<T: Send> Sync for EndLock<T> {}

pub struct EndGuard<'a, T> {
    lock: &'a EndLock<T>,
}

impl<T> EndLock<T> {
    pub fn new(value: T) -> Self {
        EndLock {
            state: AtomicU32::new(FREE),
            value: UnsafeCell::new(value),
        }
    }

    pub fn lock(&self) -> EndGuard<'_, T> {
        if self
            .state
            .compare_exchange(FREE, LOCKED, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.lock_contended();
        }
        EndGuard { lock: self }
    }

    #[cold]
    fn lock_contended(&self) {
        for _ in 0..100 {
            if self.state.load(Ordering::Relaxed) == FREE
                && self
                    .state
                    .compare_exchange(FREE, LOCKED, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                return;
            }
            std::hint::spin_loop();
        }
        while self.state.swap(CONTENDED, Ordering::Acquire) != FREE {
            futex(
                &self.state,
                libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                CONTENDED,
            );
        }
    }

    fn unlock(&self) {
        if self.state.swap(FREE, Ordering::Release) == CONTENDED {
            futex(&self.state, libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, 1);
        }
    }

    /// Forgets any holder. Only for a forked child, whose other threads
    /// (the only possible holders) did not survive the fork.
    pub fn reset_after_fork(&self) {
        self.state.store(FREE, Ordering::Relaxed);
    }
}

fn futex(word: &AtomicU32, op: libc::c_int, val: u32) {
    // SAFETY: a futex operation on a valid, aligned u32 of this process;
    // FUTEX_WAIT without a timeout returns on a wake, a signal, or when the
    // word no longer holds `val`.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            op,
            val,
            std::ptr::null::<libc::timespec>(),
        )
    };
}

impl<T> Deref for EndGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard holds the lock: no other reference exists.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for EndGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as above, and the guard is borrowed mutably.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for EndGuard<'_, T> {
    fn drop(&mut self) {
        self.lock.unlock();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn threads_take_turns() {
        let l = Arc::new(EndLock::new(0u64));
        let hs: Vec<_> = (0..4)
            .map(|_| {
                let l = l.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        *l.lock() += 1;
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(*l.lock(), 80_000);
    }

    #[test]
    fn a_lock_left_held_can_be_reset() {
        let l = EndLock::new(5u32);
        std::mem::forget(l.lock()); // a holder that never comes back
        l.reset_after_fork();
        assert_eq!(*l.lock(), 5);
    }
}
