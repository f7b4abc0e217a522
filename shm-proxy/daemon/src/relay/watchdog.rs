//! Deadlines of the relay's set-up waits (`recv_byte_within`): a stream's
//! blocking `recv` has no timeout of its own, so a wait that runs out
//! resets the stream. One thread keeps every deadline of the daemon; a
//! thread per wait (each sleeping out its whole wait, 250 ms and more,
//! even after its answer came) made two or three thread spawns per relayed
//! connection and kept dozens of sleeping threads under a connection-rate
//! load.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use flowlane_rdma::LaneStream;

use super::lock;

/// What the watchdog does when a deadline passes.
pub trait Expire: Send + Sync {
    fn expire(&self);
}

impl Expire for Arc<dyn LaneStream> {
    fn expire(&self) {
        self.reset();
    }
}

#[derive(Default)]
struct Deadlines {
    /// (deadline, id), soonest first; an id no longer in `armed` was
    /// disarmed and is skipped.
    queue: BinaryHeap<Reverse<(Instant, u64)>>,
    armed: HashMap<u64, Box<dyn Expire>>,
    next_id: u64,
    /// The thread that expires deadlines runs.
    running: bool,
}

/// Keeps deadlines; one thread expires them.
pub struct Watchdog {
    state: Mutex<Deadlines>,
    changed: Condvar,
}

/// A deadline armed with [`Watchdog::arm`]; [`Armed::disarm`] says
/// whether it passed first.
#[must_use = "disarm it once the wait ended"]
pub struct Armed {
    id: u64,
    dog: &'static Watchdog,
}

impl Armed {
    /// Ends the deadline: true if it had already passed (the watchdog
    /// expired its target), false if this came first.
    pub fn disarm(self) -> bool {
        lock(&self.dog.state).armed.remove(&self.id).is_none()
    }
}

impl Watchdog {
    fn new() -> Self {
        Watchdog {
            state: Mutex::new(Deadlines::default()),
            changed: Condvar::new(),
        }
    }

    /// The daemon's watchdog.
    pub fn get() -> &'static Watchdog {
        static DOG: OnceLock<Watchdog> = OnceLock::new();
        DOG.get_or_init(Watchdog::new)
    }

    /// Expires `target` after `wait` unless disarmed first. If the
    /// watchdog's thread cannot be started, expires it at once (the wait
    /// then fails rather than blocks without a bound).
    pub fn arm(&'static self, wait: Duration, target: Box<dyn Expire>) -> Armed {
        let mut s = lock(&self.state);
        let id = s.next_id;
        s.next_id += 1;
        if !s.running {
            let spawned = std::thread::Builder::new()
                .name("relay-deadlines".into())
                .spawn(move || self.run());
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "relay: cannot start the deadline thread");
                drop(s);
                target.expire();
                return Armed { id, dog: self };
            }
            s.running = true;
        }
        let deadline = Instant::now() + wait;
        s.armed.insert(id, target);
        s.queue.push(Reverse((deadline, id)));
        drop(s);
        self.changed.notify_one();
        Armed { id, dog: self }
    }

    fn run(&self) {
        let mut s = lock(&self.state);
        loop {
            let now = Instant::now();
            let mut due = Vec::new();
            while let Some(Reverse((at, id))) = s.queue.peek().copied() {
                if !s.armed.contains_key(&id) {
                    s.queue.pop();
                } else if at <= now {
                    s.queue.pop();
                    due.extend(s.armed.remove(&id));
                } else {
                    break;
                }
            }
            if !due.is_empty() {
                // Outside the lock: a reset may take the stream's locks.
                drop(s);
                for target in due {
                    target.expire();
                }
                s = lock(&self.state);
                continue;
            }
            let sleep = match s.queue.peek() {
                Some(Reverse((at, _))) => at.saturating_duration_since(now),
                None => Duration::from_secs(3600),
            };
            s = self
                .changed
                .wait_timeout(s, sleep)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Count(Arc<AtomicUsize>);

    impl Expire for Count {
        fn expire(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn counter() -> (Arc<AtomicUsize>, Box<dyn Expire>) {
        let n = Arc::new(AtomicUsize::new(0));
        (n.clone(), Box::new(Count(n)))
    }

    /// Waits (10 s at most) until `count`'s target has expired.
    fn wait_for_expiry(count: &AtomicUsize) {
        let t = Instant::now();
        while count.load(Ordering::SeqCst) == 0 {
            assert!(t.elapsed() < Duration::from_secs(10), "never expired");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_deadline_expires_its_target_once_unless_disarmed_first() {
        let dog = Watchdog::get();
        let (late, target) = counter();
        let armed = dog.arm(Duration::from_millis(20), target);
        let (early, target) = counter();
        let quick = dog.arm(Duration::from_secs(60), target);
        // Disarmed first: never expired, and it says so.
        assert!(!quick.disarm());
        wait_for_expiry(&late);
        // Passed first: the disarm says so, and nothing expires twice.
        assert!(armed.disarm());
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(late.load(Ordering::SeqCst), 1);
        assert_eq!(early.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_sooner_deadline_armed_later_is_not_held_up_by_a_later_one() {
        let dog = Watchdog::get();
        let (far, target) = counter();
        let long = dog.arm(Duration::from_secs(3600), target);
        let (near, target) = counter();
        let short = dog.arm(Duration::from_millis(5), target);
        wait_for_expiry(&near);
        assert!(short.disarm());
        assert!(!long.disarm());
        assert_eq!(far.load(Ordering::SeqCst), 0);
    }
}
