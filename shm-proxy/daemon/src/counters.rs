//! The daemon's counters. Plain monotonically increasing numbers kept under
//! the broker's lock; gauges (active connections, pending channels) are
//! derived from the broker's tables when a snapshot is taken; `metrics.rs`
//! exposes a snapshot in the OpenMetrics text format.

use std::collections::BTreeMap;

use flowlane_lane::proto::LatencyHistogram;

/// Counters of one lane.
#[derive(Debug, Default, Clone)]
pub struct LaneCounters {
    pub opened: u64,
    pub closed: u64,
    /// Bytes of ended connections: client to server, server to client.
    pub bytes: [u64; 2],
}

#[derive(Debug, Clone)]
pub struct Counters {
    pub shm: LaneCounters,
    /// Connections left on TCP, by reason (daemon-decided and reported).
    pub fallbacks: BTreeMap<&'static str, u64>,
    pub auth_failures: u64,
    pub bad_requests: u64,
    pub connections_refused: u64,
    pub requests: BTreeMap<&'static str, u64>,
    pub registry_reloads: u64,
    /// Intent-to-claim time of every claimed channel.
    pub channel_setup: LatencyHistogram,
    /// Time spent in the broker per request.
    pub request_handling: LatencyHistogram,
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            shm: LaneCounters::default(),
            fallbacks: BTreeMap::new(),
            auth_failures: 0,
            bad_requests: 0,
            connections_refused: 0,
            requests: BTreeMap::new(),
            registry_reloads: 0,
            channel_setup: LatencyHistogram::latency(),
            request_handling: LatencyHistogram::latency(),
        }
    }
}

impl Counters {
    pub fn fallback(&mut self, reason: &'static str) {
        *self.fallbacks.entry(reason).or_default() += 1;
    }

    pub fn request(&mut self, op: &'static str) {
        *self.requests.entry(op).or_default() += 1;
    }
}

/// Daemon-decided fallback reasons (client-reported ones use
/// `FallbackReason::as_str`).
pub mod reason {
    /// The intent's destination is not a pod on this node.
    pub const NOT_LOCAL_POD: &str = "not-local-pod";
    /// The destination pod has no flowlane listener on that port.
    pub const NO_LISTENER: &str = "no-listener";
    /// A server accepted a connection nobody announced (peer without the
    /// library, another node, or an expired intent).
    pub const CLAIM_WITHOUT_INTENT: &str = "claim-without-intent";
    /// The server never claimed the channel in time.
    pub const INTENT_EXPIRED: &str = "intent-expired";
    /// The client's connect failed after the intent.
    pub const INTENT_CANCELLED: &str = "intent-cancelled";
    /// The answer to an intent could not be sent: the client had stopped
    /// waiting for it (see `Broker::intent_undelivered`).
    pub const INTENT_UNDELIVERED: &str = "intent-undelivered";
    /// The caller was not allowed (unknown pod, foreign address).
    pub const AUTH_FAILED: &str = "auth-failed";
    /// The requested region exceeded the daemon's bound.
    pub const REGION_TOO_LARGE: &str = "region-too-large";
    /// The daemon failed to create the channel.
    pub const DAEMON_ERROR: &str = "daemon-error";
}
