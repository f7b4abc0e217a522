//! Waiting for conditions with generous deadlines (the machine may be
//! loaded; tests assert liveness, never speed).

use std::time::{Duration, Instant};

/// The default liveness deadline.
pub const LIVENESS: Duration = Duration::from_secs(30);

/// Polls `cond` until it returns true or `timeout` elapses; returns whether
/// it became true.
pub fn until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(5);
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

/// Polls `f` until it yields `Some`, or `None` after `timeout`.
pub fn for_some<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let mut out = None;
    until(timeout, || {
        out = f();
        out.is_some()
    });
    out
}
