//! The RDMA transport, kept in step with this node's RDMA lane.
//!
//! The node view (`nodes.rs`) re-reads the RDMA port states and verbs nodes
//! every `--rdma-poll` seconds, so [`Nodes::local_rdma`] follows a port that
//! goes down, a device being removed (`rdma link delete`, a driver unbind)
//! and a device added back. [`SupervisedRdma`] is the relay's
//! [`LaneTransport`] and follows it:
//!
//! - lane gone (or changed: another device, port or GID): the running
//!   [`RdmaTransport`] is shut down (its links fail, so every carried
//!   connection ends visibly for both pods) and dropped, which closes the
//!   device. A driver that cannot revoke open contexts (rxe, siw) finishes
//!   a device's removal only then;
//! - while there is none: `open` fails at once (the relay keeps the
//!   connection on TCP and counts `relay-lane-unreachable`), the lane port
//!   is closed and not published, so peers' connections stay on TCP too;
//! - lane back: a new transport on the new lane, the lane port published
//!   again.

use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Duration;

use flowlane_rdma::topology::RdmaLane;
use flowlane_rdma::{LaneAuth, LaneStream, LaneTransport, RdmaOptions, RdmaTransport, StreamKey};

use crate::nodes::Nodes;

/// How often the supervisor compares the running transport with the lane.
const CHECK_EVERY: Duration = Duration::from_millis(500);

struct Running {
    lane: RdmaLane,
    transport: Arc<RdmaTransport>,
}

#[derive(Default)]
struct State {
    running: Option<Running>,
    /// Why there is no transport (for `open`'s error and the log).
    down_reason: String,
    /// Error counts of transports already dropped.
    retired: Vec<(&'static str, u64)>,
}

pub struct SupervisedRdma {
    nodes: Arc<Nodes>,
    listen: SocketAddr,
    /// Every transport it opens admits only the cluster's daemons.
    auth: LaneAuth,
    state: Mutex<State>,
    changed: Condvar,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl SupervisedRdma {
    /// Opens the transport on this node's lane now if it has one (else
    /// returns the reason with the supervisor, which keeps trying), and
    /// starts following the lane.
    pub fn start(
        nodes: Arc<Nodes>,
        listen: SocketAddr,
        auth: LaneAuth,
    ) -> (Arc<Self>, Option<String>) {
        let sup = Arc::new(SupervisedRdma {
            nodes,
            listen,
            auth,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        });
        let first = sup.reconcile();
        let weak = Arc::downgrade(&sup);
        std::thread::Builder::new()
            .name("rdma-lane-watch".into())
            .spawn(move || watch(weak))
            .expect("spawning the RDMA lane watcher");
        (sup, first)
    }

    /// The lane discovery offers now.
    fn wanted(&self) -> Option<RdmaLane> {
        self.nodes.local_rdma()
    }

    /// Brings the transport in line with the lane; returns why there is
    /// none when there is none.
    fn reconcile(&self) -> Option<String> {
        let wanted = self.wanted();
        let mut st = lock(&self.state);
        if let Some(r) = &st.running {
            if Some(&r.lane) == wanted.as_ref() {
                return None;
            }
            let r = st.running.take().expect("checked");
            let why = match &wanted {
                None => "this node's RDMA lane is gone".to_string(),
                Some(l) => format!(
                    "this node's RDMA lane changed to {} port {} gid[{}]",
                    l.device, l.port, l.gid_index
                ),
            };
            tracing::warn!(device = %r.lane.device, reason = %why, "closing the RDMA lane: its connections end, new ones stay on TCP");
            self.retire(&mut st, r);
            self.nodes.set_lane_port(None);
        }
        let Some(lane) = wanted else {
            let why = self
                .nodes
                .local_rdma_reason()
                .unwrap_or_else(|| "this node has no RDMA lane".into());
            return Some(set_down(&mut st, why));
        };
        match open(&lane, self.listen, &self.auth) {
            Ok(t) => {
                tracing::info!(device = %lane.device, port = lane.port, gid_index = lane.gid_index, listen = %self.listen, "RDMA lane open");
                st.running = Some(Running {
                    lane,
                    transport: Arc::new(t),
                });
                st.down_reason.clear();
                drop(st);
                self.nodes.set_lane_port(Some(self.listen.port()));
                self.changed.notify_all();
                None
            }
            Err(e) => {
                let why = set_down(&mut st, format!("{e:#}"));
                drop(st);
                self.nodes.set_lane_port(None);
                Some(why)
            }
        }
    }

    /// Shuts a transport down (its links fail: carried connections end)
    /// and keeps its error counts. The transport itself goes when the last
    /// user lets go of it (an `accept` in progress returns within 250 ms).
    fn retire(&self, st: &mut State, r: Running) {
        r.transport.shutdown();
        for (kind, n) in r.transport.error_counts() {
            match st.retired.iter_mut().find(|(k, _)| *k == kind) {
                Some((_, total)) => *total += n,
                None => st.retired.push((kind, n)),
            }
        }
        self.changed.notify_all();
    }

    fn current(&self) -> Option<Arc<RdmaTransport>> {
        lock(&self.state)
            .running
            .as_ref()
            .map(|r| r.transport.clone())
    }
}

/// Records why there is no transport, logging it when it changed.
fn set_down(st: &mut State, why: String) -> String {
    if st.down_reason != why {
        tracing::warn!(error = %why, "RDMA lane unavailable on this node; cross-node connections stay on TCP");
        st.down_reason = why;
    }
    st.down_reason.clone()
}

fn open(lane: &RdmaLane, listen: SocketAddr, auth: &LaneAuth) -> anyhow::Result<RdmaTransport> {
    use anyhow::Context;
    let provider = flowlane_rdma::transport::VerbsProvider::from_lane(lane)
        .with_context(|| format!("opening RDMA device {} port {}", lane.device, lane.port))?;
    RdmaTransport::start(provider, listen, RdmaOptions::default(), auth.clone())
        .with_context(|| format!("starting the RDMA lane on {listen}"))
}

fn watch(sup: Weak<SupervisedRdma>) {
    loop {
        std::thread::sleep(CHECK_EVERY);
        let Some(sup) = sup.upgrade() else { return };
        sup.reconcile();
    }
}

impl LaneTransport for SupervisedRdma {
    fn name(&self) -> &'static str {
        "rdma"
    }

    fn open(&self, peer: SocketAddr, key: StreamKey) -> std::io::Result<Box<dyn LaneStream>> {
        match self.current() {
            Some(t) => t.open(peer, key),
            None => Err(std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                format!(
                    "no RDMA lane on this node: {}",
                    lock(&self.state).down_reason
                ),
            )),
        }
    }

    fn accept(&self) -> std::io::Result<(StreamKey, Box<dyn LaneStream>)> {
        loop {
            let Some(t) = self.current() else {
                let st = lock(&self.state);
                let _ = self
                    .changed
                    .wait_timeout(st, Duration::from_secs(1))
                    .unwrap_or_else(|e| e.into_inner());
                continue;
            };
            match t.accept() {
                Ok(s) => return Ok(s),
                // That transport was shut down: wait for the next one.
                Err(_) if self.current().is_none_or(|c| !Arc::ptr_eq(&c, &t)) => continue,
                Err(e) => return Err(e),
            }
        }
    }

    fn error_counts(&self) -> Vec<(&'static str, u64)> {
        let st = lock(&self.state);
        let mut counts = st.retired.clone();
        if let Some(r) = &st.running {
            for (kind, n) in r.transport.error_counts() {
                match counts.iter_mut().find(|(k, _)| *k == kind) {
                    Some((_, total)) => *total += n,
                    None => counts.push((kind, n)),
                }
            }
        }
        counts
    }
}
