//! The daemon's counters. Plain monotonically increasing numbers kept under
//! the broker's lock; gauges (active connections, pending channels) are
//! derived from the broker's tables when a snapshot is taken; `metrics.rs`
//! exposes a snapshot in the OpenMetrics text format.

use std::collections::BTreeMap;

use flowlane_lane::proto::{FallbackReason, LatencyHistogram};

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
    pub fallbacks: BTreeMap<FallbackReason, u64>,
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
    pub fn fallback(&mut self, reason: FallbackReason) {
        *self.fallbacks.entry(reason).or_default() += 1;
    }

    /// Takes back a fallback this very request counted (under the same
    /// lock, so no snapshot saw it) when it turned out not to be one.
    pub fn fallback_retracted(&mut self, reason: FallbackReason) {
        if let Some(n) = self.fallbacks.get_mut(&reason) {
            *n = n.saturating_sub(1);
        }
    }

    pub fn request(&mut self, op: &'static str) {
        *self.requests.entry(op).or_default() += 1;
    }
}
