//! One suite at a time. The suites used to be separate test binaries that
//! cargo ran one after another, so each was written knowing that no other
//! suite's nodes, bridges, subnets, ports, nft tables or heavy load were live
//! beside it. In one binary libtest runs the tests in name order on
//! `--test-threads` threads, so the end of one suite would overlap the start
//! of the next. Every test therefore takes its suite's turn first: tests of
//! one suite still run side by side (as they did in their own binary), and a
//! test of another suite waits until the running suite's tests have ended.
//! Tests of a suite are adjacent in name order, so no suite waits long.

use std::sync::{Condvar, Mutex, MutexGuard};

struct State {
    /// The suite whose tests are running (`module_path!()` of the suite).
    suite: Option<&'static str>,
    /// How many of its tests are running.
    running: usize,
}

static STATE: Mutex<State> = Mutex::new(State {
    suite: None,
    running: 0,
});
static ENDED: Condvar = Condvar::new();

/// Locks the state, ignoring poisoning (a panicking test must not stop the
/// others: the state is consistent between statements).
fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// A test's turn; dropping it (also while unwinding) ends the test's share.
pub struct Turn;

/// Waits until no other suite is running, then counts this test in `suite`.
pub fn take(suite: &'static str) -> Turn {
    let mut s = state();
    while s.suite.is_some_and(|running| running != suite) {
        s = ENDED.wait(s).unwrap_or_else(|e| e.into_inner());
    }
    s.suite = Some(suite);
    s.running += 1;
    Turn
}

impl Drop for Turn {
    fn drop(&mut self) {
        let mut s = state();
        s.running -= 1;
        if s.running == 0 {
            s.suite = None;
            ENDED.notify_all();
        }
    }
}
