//! The node's stats answer (`flowlane status`, `/metrics`), built by asking
//! each part of the daemon for its own: the broker answers for the
//! same-node lane, the pods, listeners and counters; the relay for its lane
//! and the connections it carries; the cross-node view for the nodes; the
//! process scan for the pods' processes (`processes/`). The
//! broker knows nothing of the relay: the dependency runs one way (the
//! relay asks the broker to admit its intents, `broker/admission.rs`).

use std::sync::Arc;

use flowlane_lane::proto::{ConnectionInfo, LaneStats, RelayMemory, Response, Stats};

use crate::broker::{Answer, Broker};
use crate::nodes::Nodes;
use crate::processes::Processes;
use crate::relay::Relay;

/// What the relay reports for a stats answer.
#[derive(Debug, Clone)]
pub struct RelayReport {
    /// Lane name: "relay" (test transport) or "rdma".
    pub lane: String,
    pub stats: LaneStats,
    /// Carried connections, their pod fields empty (see [`Lanes::complete`]).
    pub connections: Vec<ConnectionInfo>,
    /// The transport's and the relay's error counts, by kind.
    pub errors: Vec<(&'static str, u64)>,
    pub memory: RelayMemory,
}

/// The parts besides the broker that a stats answer asks, when they run.
#[derive(Clone, Default)]
pub struct Lanes {
    pub relay: Option<Arc<Relay>>,
    pub nodes: Option<Arc<Nodes>>,
    /// The pods' processes (`processes/`), unless `--process-scan-interval 0`.
    pub processes: Option<Arc<Processes>>,
}

impl Lanes {
    /// The whole snapshot: the broker's, completed by the other parts.
    pub fn snapshot(&self, broker: &Broker) -> Stats {
        let mut stats = broker.stats();
        self.add_to(&mut stats, broker);
        stats
    }

    /// Completes a stats answer of the broker (any other answer passes).
    pub fn complete(&self, answer: &mut Answer, broker: &Broker) {
        if let Response::Stats { stats } = &mut answer.response {
            self.add_to(stats, broker);
        }
    }

    fn add_to(&self, stats: &mut Stats, broker: &Broker) {
        if let Some(relay) = &self.relay {
            let report = relay.lane_stats();
            stats.relay_memory = Some(report.memory);
            if !report.errors.is_empty() {
                stats.lane_errors.insert(
                    report.lane.clone(),
                    report
                        .errors
                        .into_iter()
                        .map(|(k, v)| (k.to_string(), v))
                        .collect(),
                );
            }
            stats.lanes.insert(report.lane, report.stats);
            // The local pod by name, the other node's as `remote`.
            stats
                .connections
                .extend(report.connections.into_iter().map(|mut c| {
                    for e in [&mut c.client, &mut c.server] {
                        e.pod = broker
                            .pod_name_at(e.addr.ip())
                            .unwrap_or_else(|| "remote".to_string());
                    }
                    c
                }));
        }
        if let Some(nodes) = &self.nodes {
            stats.nodes = Some(nodes.view_json());
        }
        if let Some(p) = &self.processes {
            stats.processes = p.report();
        }
    }
}
