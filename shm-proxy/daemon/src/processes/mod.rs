//! Which of the node's pod processes can use the lane, and why the others
//! cannot: statically linked and Go programs and io_uring users bypass the
//! library's interposition, and a program started without the library (or
//! with the probe's no-op object) has none. A thread of its own walks
//! `/proc` every `--process-scan-interval` seconds (`scan.rs`; the pieces:
//! `procfs.rs` reads a process, `exe.rs` its executable); a stats answer
//! (`flowlane status`, `/metrics`) carries the last scan and asks for a
//! new one when it is more than [`FRESH`] old, so two status calls a
//! second apart see the processes as they are.
//!
//! What this finds is for display: a pod can make a process look like
//! anything (a file named like the library, a renamed executable); it
//! decides nothing about connections.

mod exe;
mod procfs;
mod scan;

use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use flowlane_lane::proto::ProcessScan;

pub use scan::Bounds;

/// A scan older than this is redone when a stats answer asks.
pub const FRESH: Duration = Duration::from_secs(1);

#[derive(Default)]
struct State {
    last: Option<(Instant, ProcessScan)>,
    wanted: bool,
}

/// The scanner thread's handle.
pub struct Processes {
    state: Mutex<State>,
    wake: Condvar,
}

impl Processes {
    /// Starts the scanner thread: a scan now, then every `interval`, and
    /// when a stats answer finds the last one stale.
    pub fn start(state_dir: PathBuf, interval: Duration, bounds: Bounds) -> Arc<Processes> {
        let me = Arc::new(Processes {
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
        });
        let handle = me.clone();
        let spawned = std::thread::Builder::new()
            .name("process-scan".into())
            .spawn(move || {
                let mut scanner = scan::Scanner::new(state_dir, bounds);
                loop {
                    let scan = scanner.scan();
                    if !scan.complete {
                        tracing::warn!(
                            ms = scan.duration_ms,
                            "process scan cut short by its bounds; pods may have more processes"
                        );
                    }
                    let mut s = handle.lock();
                    s.last = Some((Instant::now(), scan));
                    s.wanted = false;
                    let (s, _) = handle
                        .wake
                        .wait_timeout_while(s, interval, |s| !s.wanted)
                        .unwrap_or_else(|e| e.into_inner());
                    drop(s);
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start the process scan");
        }
        me
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The last scan with its age (`None` before the first one ends); asks
    /// for a new one when it is stale.
    pub fn report(&self) -> Option<ProcessScan> {
        let mut s = self.lock();
        let (at, scan) = s.last.as_ref()?;
        let age = at.elapsed();
        let mut out = scan.clone();
        out.age_ms = age.as_millis() as u64;
        if age > FRESH && !s.wanted {
            s.wanted = true;
            self.wake.notify_one();
        }
        Some(out)
    }
}
