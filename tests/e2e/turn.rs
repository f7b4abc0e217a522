//! One suite at a time. The suites used to be separate test binaries that
//! cargo ran one after another, so each was written knowing that no other
//! suite's nodes, bridges, subnets, ports, nft tables or heavy load were live
//! beside it. In one binary libtest runs the tests in name order on
//! `--test-threads` threads, so the end of one suite would overlap the start
//! of the next. Every test therefore takes its suite's turn first: tests of
//! one suite still run side by side (as they did in their own binary), and a
//! test of another suite waits until the running suite's tests have ended.
//! Tests of a suite are adjacent in name order, so no suite waits long.

use std::io::Write;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

struct State {
    /// The suite whose tests are running (`module_path!()` of the suite).
    suite: Option<&'static str>,
    /// How many of its tests are running.
    running: usize,
    /// The suite that ran last (its tests may all have ended).
    last: Option<&'static str>,
    /// When the last suite's first test took its turn.
    last_started: Option<Instant>,
}

static STATE: Mutex<State> = Mutex::new(State {
    suite: None,
    running: 0,
    last: None,
    last_started: None,
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
    if s.suite.is_none() && s.last != Some(suite) {
        // Another suite starts: what the previous one left running for its
        // later tests goes now, as when each suite was a process that
        // exited. The Soft-RoCE rig's two idle QEMU guests keep both cores
        // busy, which would slow (and perturb) every suite after a rig
        // suite.
        flowlane_cluster::rdma_rig::shutdown_shared();
        if let (Some(last), Some(t0)) = (s.last, s.last_started) {
            report_duration(last, t0);
        }
        s.last_started = Some(Instant::now());
    }
    s.suite = Some(suite);
    s.last = Some(suite);
    s.running += 1;
    Turn
}

/// Where CI's time goes: one line per suite on the real stderr (libtest
/// captures only the print macros), from its first test's turn to the next
/// suite's (the last suite of a run is not reported).
fn report_duration(suite: &str, started: Instant) {
    let suite = suite.strip_prefix("e2e::").unwrap_or(suite);
    // One write: libtest's own lines go out meanwhile.
    let line = format!(
        "e2e: suite {suite} took {:.0} s\n",
        started.elapsed().as_secs_f64()
    );
    let _ = std::io::stderr().write_all(line.as_bytes());
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

/// Every test of a suite takes its turn first: a test written without it
/// (a new test, or one merged from a branch older than the one binary)
/// would run beside another suite's tests.
#[test]
fn every_suite_test_takes_its_turn_first() {
    const TURN: &str = "    let _turn = crate::turn::take(module_path!());";
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("e2e");
    let mut missing = Vec::new();
    let mut tests = 0;
    for area in std::fs::read_dir(&root).expect("tests/e2e") {
        let area = area.expect("tests/e2e entry").path();
        if !area.is_dir() {
            continue;
        }
        for suite in std::fs::read_dir(&area).expect("an area folder") {
            let suite = suite.expect("an area entry").path();
            // daemon::common holds no suite test, only the agents' entry.
            if suite.extension().is_none_or(|e| e != "rs") || suite.ends_with("daemon/common.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&suite).expect("a suite file");
            let lines: Vec<&str> = text.lines().collect();
            for (i, line) in lines.iter().enumerate() {
                if line.trim() != "#[test]" {
                    continue;
                }
                tests += 1;
                let Some(f) = (i + 1..lines.len()).find(|&j| lines[j].starts_with("fn ")) else {
                    missing.push(format!("{}:{}", suite.display(), i + 1));
                    continue;
                };
                if lines.get(f + 1) != Some(&TURN) {
                    missing.push(format!("{}:{}", suite.display(), f + 1));
                }
            }
        }
    }
    assert!(
        tests > 100,
        "found only {tests} tests under {}",
        root.display()
    );
    assert!(
        missing.is_empty(),
        "tests without `{}` first: {missing:#?}",
        TURN.trim()
    );
}
