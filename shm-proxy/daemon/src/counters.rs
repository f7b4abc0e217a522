//! The daemon's counters. Plain monotonically increasing numbers kept under
//! the broker's lock; gauges (active connections, pending channels) are
//! derived from the broker's tables when a snapshot is taken. `samples()`
//! flattens a snapshot into named, labelled values, which is all a
//! Prometheus text endpoint (`--metrics-addr`, later) needs.

use std::collections::BTreeMap;

use flowlane_lane::proto::{LatencyHistogram, Stats};

/// Counters of one lane.
#[derive(Debug, Default, Clone)]
pub struct LaneCounters {
    pub opened: u64,
    pub closed: u64,
    pub bytes: u64,
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

/// One flattened value: metric name, labels, value. `family` is the name
/// HELP/TYPE describe: the metric name itself, or for a histogram's
/// `_bucket`/`_sum`/`_count` series their common base name.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub family: &'static str,
    pub name: &'static str,
    pub help: &'static str,
    pub kind: &'static str,
    pub labels: Vec<(&'static str, String)>,
    pub value: f64,
}

/// A metric family that is described but has no samples yet.
pub struct EmptyFamily {
    pub name: &'static str,
    pub help: &'static str,
    pub kind: &'static str,
}

/// Families exposed with HELP/TYPE only, because nothing feeds them yet.
/// Inventing a `0` sample would claim the daemon checked and found none.
pub const EMPTY_FAMILIES: &[EmptyFamily] = &[EmptyFamily {
    name: RDMA_ERRORS,
    help: RDMA_ERRORS_HELP,
    kind: "counter",
}];

/// Fed by the RDMA transport's link counters; a daemon without the RDMA
/// lane describes the family with no samples.
const RDMA_ERRORS: &str = "flowlane_rdma_errors_total";
const RDMA_ERRORS_HELP: &str = "RDMA lane errors by kind: link_failed (an RDMA link to a peer daemon failed: error completion, protocol violation, keep-alive silence, peer gone), link_setup_failed (connecting or handshaking with a peer daemon failed), peer_unknown (a connection to the lane port from an address not in the node table), peer_auth_failed (a peer that did not prove the lane key), stream_foreign_client (a stream whose client is no pod of the node that opened it), stream_duplicate (a stream with the key of a live one). No samples on a node without the RDMA lane.";

/// The Prometheus series of one latency histogram (seconds).
fn histogram_samples(
    out: &mut Vec<Sample>,
    family: &'static str,
    names: [&'static str; 3],
    help: &'static str,
    h: &LatencyHistogram,
) {
    let [bucket, sum, count] = names;
    for (bound, n) in h.cumulative() {
        let le = match bound {
            Some(ns) => format!("{}", ns as f64 / 1e9),
            None => "+Inf".to_string(),
        };
        out.push(Sample {
            family,
            name: bucket,
            help,
            kind: "histogram",
            labels: vec![("le", le)],
            value: n as f64,
        });
    }
    out.push(Sample {
        family,
        name: sum,
        help,
        kind: "histogram",
        labels: vec![],
        value: h.sum_ns as f64 / 1e9,
    });
    out.push(Sample {
        family,
        name: count,
        help,
        kind: "histogram",
        labels: vec![],
        value: h.count as f64,
    });
}

/// Every counter, gauge and histogram of a stats snapshot as flat samples.
pub fn samples(stats: &Stats) -> Vec<Sample> {
    let mut out = Vec::new();
    let mut push = |name, help, kind, labels: Vec<(&'static str, String)>, value: u64| {
        out.push(Sample {
            family: name,
            name,
            help,
            kind,
            labels,
            value: value as f64,
        })
    };
    for (lane, l) in &stats.lanes {
        let lbl = || vec![("lane", lane.clone())];
        push(
            "flowlane_connections_opened_total",
            "Connections that started on the lane.",
            "counter",
            lbl(),
            l.connections_opened,
        );
        push(
            "flowlane_connections_closed_total",
            "Connections on the lane that ended.",
            "counter",
            lbl(),
            l.connections_closed,
        );
        push(
            "flowlane_connections_active",
            "Connections currently on the lane.",
            "gauge",
            lbl(),
            l.connections_active,
        );
        push(
            "flowlane_bytes_total",
            "Application bytes moved by ended connections.",
            "counter",
            lbl(),
            l.bytes,
        );
        push(
            "flowlane_channels_pending",
            "Channels announced and not yet claimed.",
            "gauge",
            lbl(),
            l.channels_pending,
        );
    }
    if let Some(errors) = stats.lane_errors.get("rdma") {
        for (kind, n) in errors {
            push(
                RDMA_ERRORS,
                RDMA_ERRORS_HELP,
                "counter",
                vec![("kind", kind.clone())],
                *n,
            );
        }
    }
    for (reason, n) in &stats.fallbacks {
        push(
            "flowlane_fallbacks_total",
            "Connections left on TCP, by reason.",
            "counter",
            vec![("reason", reason.clone())],
            *n,
        );
    }
    push(
        "flowlane_auth_failures_total",
        "Requests refused for the caller's identity.",
        "counter",
        vec![],
        stats.auth_failures,
    );
    push(
        "flowlane_bad_requests_total",
        "Undecodable frames.",
        "counter",
        vec![],
        stats.bad_requests,
    );
    push(
        "flowlane_connections_refused_total",
        "Daemon client connections closed at once (connection budget exhausted).",
        "counter",
        vec![],
        stats.connections_refused,
    );
    for (op, n) in &stats.requests {
        push(
            "flowlane_requests_total",
            "Requests served, by operation.",
            "counter",
            vec![("op", op.clone())],
            *n,
        );
    }
    push(
        "flowlane_pods",
        "Pods known from the registry.",
        "gauge",
        vec![],
        stats.daemon.pods,
    );
    histogram_samples(
        &mut out,
        "flowlane_channel_setup_seconds",
        [
            "flowlane_channel_setup_seconds_bucket",
            "flowlane_channel_setup_seconds_sum",
            "flowlane_channel_setup_seconds_count",
        ],
        "Per claimed channel: time from the client's intent reaching the daemon to the server's claim reaching it.",
        &stats.channel_setup,
    );
    histogram_samples(
        &mut out,
        "flowlane_request_handling_seconds",
        [
            "flowlane_request_handling_seconds_bucket",
            "flowlane_request_handling_seconds_sum",
            "flowlane_request_handling_seconds_count",
        ],
        "Per request: time the daemon spent handling it (decoded request to answer, socket I/O excluded).",
        &stats.request_handling,
    );
    out
}
