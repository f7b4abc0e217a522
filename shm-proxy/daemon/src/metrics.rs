//! Optional metrics endpoint (`--metrics-addr`): `/metrics` (and any other
//! path but the two below) answers the current counters in the OpenMetrics
//! text format, encoded by the `prometheus-client` crate from one stats
//! snapshot (so every family's samples are contiguous and consistent);
//! `/healthz` answers 200 while the process serves, `/readyz` 200 once the
//! daemon is ready (see [`Readiness`]) and 503 before.

use std::net::SocketAddr;
use std::sync::Arc;

use flowlane_lane::proto::{LatencyHistogram, Stats};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::server::Shared;
use crate::stats::Lanes;

/// Labels of one sample.
type Labels = Vec<(&'static str, String)>;

/// One family of samples, every one with its own labels.
struct Family {
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    samples: Vec<(Labels, u64)>,
}

/// Fed by the RDMA transport's link counters; a daemon without the RDMA
/// lane describes the family with no samples (a `0` would claim it
/// measured).
const RDMA_ERRORS_HELP: &str = "RDMA lane errors by kind: link_failed (an RDMA link to a peer daemon failed: error completion, protocol violation, keep-alive silence, peer gone), link_setup_failed (connecting or handshaking with a peer daemon failed), peer_unknown (a connection to the lane port from an address not in the node table), peer_auth_failed (a peer that did not prove the lane key), stream_foreign_client (a stream whose client is no pod of the node that opened it), stream_duplicate (a stream with the key of a live one). No samples on a node without the RDMA lane.";

/// A latency histogram (seconds) for the encoder.
#[derive(Debug)]
struct Seconds<'a>(&'a LatencyHistogram);

impl EncodeMetric for Seconds<'_> {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let h = self.0;
        // Per-bucket counts (the encoder accumulates); `f64::MAX` is +Inf.
        let mut buckets: Vec<(f64, u64)> = h
            .counts
            .iter()
            .enumerate()
            .map(|(i, n)| (h.bounds_ns.get(i).map_or(f64::MAX, |b| *b as f64 / 1e9), *n))
            .collect();
        if buckets.is_empty() {
            buckets.push((f64::MAX, h.count));
        }
        encoder.encode_histogram::<NoLabelSet>(h.sum_ns as f64 / 1e9, h.count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// The families of one stats snapshot, in exposition order.
fn families(stats: &Stats) -> Vec<Family> {
    let per_lane = |f: &dyn Fn(&flowlane_lane::proto::LaneStats) -> u64| -> Vec<(Labels, u64)> {
        stats
            .lanes
            .iter()
            .map(|(lane, l)| (vec![("lane", lane.clone())], f(l)))
            .collect()
    };
    let by =
        |key: &'static str, m: &std::collections::BTreeMap<String, u64>| -> Vec<(Labels, u64)> {
            m.iter()
                .map(|(k, n)| (vec![(key, k.clone())], *n))
                .collect()
        };
    let one = |v: u64| vec![(Labels::new(), v)];
    let counter = |name, help, samples| Family {
        name,
        help,
        kind: MetricType::Counter,
        samples,
    };
    let gauge = |name, help, samples| Family {
        name,
        help,
        kind: MetricType::Gauge,
        samples,
    };
    let bytes = stats
        .lanes
        .iter()
        .flat_map(|(lane, l)| {
            [
                ("client_to_server", l.bytes_client_to_server),
                ("server_to_client", l.bytes_server_to_client),
            ]
            .map(|(dir, n)| {
                (
                    vec![("lane", lane.clone()), ("direction", dir.to_string())],
                    n,
                )
            })
        })
        .collect();
    let mut out =
        vec![
        gauge(
            "flowlane_build_info",
            "The daemon's version and wire protocol; always 1.",
            vec![(
                vec![
                    ("version", stats.daemon.version.clone()),
                    ("protocol", stats.daemon.protocol.to_string()),
                ],
                1,
            )],
        ),
        counter(
            "flowlane_connections_opened",
            "Connections that started on the lane.",
            per_lane(&|l| l.connections_opened),
        ),
        counter(
            "flowlane_connections_closed",
            "Connections on the lane that ended.",
            per_lane(&|l| l.connections_closed),
        ),
        gauge(
            "flowlane_connections_active",
            "Connections currently on the lane.",
            per_lane(&|l| l.connections_active),
        ),
        counter(
            "flowlane_bytes",
            "Application bytes moved through the lane, live connections included, by direction.",
            bytes,
        ),
        gauge(
            "flowlane_channels_pending",
            "Channels announced and not yet claimed.",
            per_lane(&|l| l.channels_pending),
        ),
        gauge(
            "flowlane_channels_stocked",
            "Channels made ahead for later connections and not taken yet.",
            per_lane(&|l| l.channels_stocked),
        ),
        counter(
            "flowlane_fallbacks",
            "Connections left on TCP, by reason.",
            by("reason", &stats.fallbacks),
        ),
        counter(
            "flowlane_auth_failures",
            "Requests refused for the caller's identity.",
            one(stats.auth_failures),
        ),
        counter("flowlane_bad_requests", "Undecodable frames.", one(stats.bad_requests)),
        counter(
            "flowlane_connections_refused",
            "Daemon client connections closed at once (connection budget exhausted).",
            one(stats.connections_refused),
        ),
        counter(
            "flowlane_requests",
            "Requests served, by operation.",
            by("op", &stats.requests),
        ),
        gauge("flowlane_pods", "Pods known from the registry.", one(stats.daemon.pods)),
        counter(
            "flowlane_registry_reloads",
            "Times the pod registry was read.",
            one(stats.daemon.registry_reloads),
        ),
        counter(
            "flowlane_rdma_errors",
            RDMA_ERRORS_HELP,
            stats.lane_errors.get("rdma").map(|e| by("kind", e)).unwrap_or_default(),
        ),
    ];
    if let Some(p) = &stats.processes {
        // Node-wide: a label per pod would grow with the pods.
        let (mut lane, mut tcp, mut idle) = (0, 0, 0);
        let mut reasons = std::collections::BTreeMap::<String, u64>::new();
        for pod in &p.pods {
            lane += u64::from(pod.lane);
            tcp += u64::from(pod.tcp);
            idle += u64::from(pod.idle);
            for (r, n) in &pod.reasons {
                *reasons.entry(r.name().to_string()).or_default() += u64::from(*n);
            }
        }
        out.push(gauge(
            "flowlane_pod_processes",
            "The pods' processes at the last scan: lane (runs the preload library, nothing bypasses it), tcp (holds TCP sockets and cannot use the lane), idle (cannot use the lane, holds no TCP socket), unreadable (the daemon may not read it).",
            [
                ("lane", lane),
                ("tcp", tcp),
                ("idle", idle),
                ("unreadable", u64::from(p.unreadable)),
            ]
                .into_iter()
                .map(|(k, v)| (vec![("state", k.to_string())], v))
                .collect(),
        ));
        out.push(gauge(
            "flowlane_pod_processes_off_lane",
            "The pods' processes that cannot use the lane at the last scan, by reason (no-library, noop-library, static, go, io-uring, unknown-exe; a process may count under several).",
            by("reason", &reasons),
        ));
    }
    if let Some(m) = stats.relay_memory {
        out.push(gauge(
            "flowlane_relay_memory_budget_bytes",
            "Most memory the relay may hold for its connections (--relay-memory-budget).",
            one(m.budget_bytes),
        ));
        out.push(gauge(
            "flowlane_relay_memory_used_bytes",
            "Memory the relay holds now for live relayed connections and their set-ups.",
            one(m.used_bytes),
        ));
    }
    out
}

fn encode_value(m: &mut MetricEncoder, kind: MetricType, v: &u64) -> std::fmt::Result {
    match kind {
        MetricType::Counter => m.encode_counter::<NoLabelSet, _, u64>(v, None),
        _ => m.encode_gauge(v),
    }
}

/// One scrape's snapshot, as a collector of the crate's registry.
#[derive(Debug)]
struct Snapshot(Stats);

impl Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for f in families(&self.0) {
            let mut m = encoder.encode_descriptor(f.name, f.help, None, f.kind)?;
            for (labels, v) in &f.samples {
                if labels.is_empty() {
                    encode_value(&mut m, f.kind, v)?;
                } else {
                    encode_value(&mut m.encode_family(labels)?, f.kind, v)?;
                }
            }
        }
        for (name, help, h) in [
            (
                "flowlane_channel_setup_seconds",
                "Per claimed channel: time from the client's intent reaching the daemon to the server's claim reaching it.",
                &self.0.channel_setup,
            ),
            (
                "flowlane_request_handling_seconds",
                "Per request: time the daemon spent handling it (decoded request to answer, socket I/O excluded).",
                &self.0.request_handling,
            ),
        ] {
            let h = Seconds(h);
            h.encode(encoder.encode_descriptor(name, help, None, h.metric_type())?)?;
        }
        Ok(())
    }
}

/// The OpenMetrics text of a stats snapshot (ends with `# EOF`).
pub fn prometheus_text(stats: &Stats) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Snapshot(stats.clone())));
    let mut out = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &registry) {
        tracing::warn!(error = %e, "encoding the metrics failed");
    }
    out
}

/// What `/readyz` checks. The daemon starts the endpoint only after its
/// socket is bound and the pod registry was read (both before the first
/// client is served); then ready means: the socket file is still there and,
/// when a cross-node view is configured, it has loaded a node table.
#[derive(Clone)]
pub struct Readiness {
    pub socket: std::path::PathBuf,
    pub nodes: Option<Arc<crate::nodes::Nodes>>,
}

impl Readiness {
    /// `None` when ready, else why not.
    fn not_ready(&self) -> Option<String> {
        use std::os::unix::fs::FileTypeExt;
        match std::fs::symlink_metadata(&self.socket) {
            Ok(m) if m.file_type().is_socket() => {}
            _ => return Some(format!("socket {} is gone", self.socket.display())),
        }
        if let Some(n) = &self.nodes {
            if !n.view_loaded() {
                return Some("the node table is not loaded yet".into());
            }
        }
        None
    }
}

/// The answer to one request head: status line, content type, body.
fn answer(
    head: &[u8],
    shared: &Shared,
    lanes: &Lanes,
    ready: &Readiness,
) -> (&'static str, &'static str, String) {
    let path = std::str::from_utf8(head)
        .ok()
        .and_then(|h| h.split_whitespace().nth(1))
        .unwrap_or("/metrics");
    let path = path.split('?').next().unwrap_or(path);
    const TEXT: &str = "text/plain; charset=utf-8";
    match path {
        "/healthz" => ("200 OK", TEXT, "ok\n".into()),
        "/readyz" => match ready.not_ready() {
            None => ("200 OK", TEXT, "ready\n".into()),
            Some(why) => (
                "503 Service Unavailable",
                TEXT,
                format!("not ready: {why}\n"),
            ),
        },
        _ => (
            "200 OK",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            prometheus_text(&{
                let mut broker = shared.lock();
                broker.refresh_connections();
                lanes.snapshot(&broker)
            }),
        ),
    }
}

/// Serves the metrics and health endpoints on `addr` forever.
pub async fn serve(
    addr: SocketAddr,
    shared: Shared,
    lanes: Lanes,
    ready: Readiness,
) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    tracing::info!(%addr, "metrics endpoint listening (/metrics, /healthz, /readyz)");
    loop {
        let (mut conn, _) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(error = %e, "metrics accept failed");
                continue;
            }
        };
        let (shared, lanes, ready) = (shared.clone(), lanes.clone(), ready.clone());
        tokio::spawn(async move {
            // The request line is all we need.
            let mut buf = [0u8; 2048];
            let n = tokio::time::timeout(std::time::Duration::from_secs(2), conn.read(&mut buf))
                .await
                .ok()
                .and_then(Result::ok)
                .unwrap_or(0);
            let (status, kind, body) = answer(&buf[..n], &shared, &lanes, &ready);
            let head = format!(
                "HTTP/1.0 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = conn.write_all(head.as_bytes()).await;
            let _ = conn.write_all(body.as_bytes()).await;
        });
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use flowlane_lane::proto::{LaneStats, LatencyHistogram};
    use std::time::Duration;

    /// Family names in the order their TYPE lines appear.
    fn types(t: &str) -> Vec<&str> {
        t.lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .collect()
    }

    #[test]
    fn text_format_has_help_type_labels_and_directions() {
        let mut st = Stats::default();
        for lane in ["shm", "relay"] {
            st.lanes.insert(
                lane.into(),
                LaneStats {
                    connections_opened: 3,
                    bytes: 42,
                    bytes_client_to_server: 40,
                    bytes_server_to_client: 2,
                    channels_stocked: 5,
                    ..LaneStats::default()
                },
            );
        }
        st.daemon.version = "9.8.7".into();
        st.fallbacks.insert("no-listener".into(), 2);
        let t = prometheus_text(&st);
        assert!(
            t.contains("# TYPE flowlane_connections_opened counter\n"),
            "{t}"
        );
        assert!(
            t.contains("flowlane_connections_opened_total{lane=\"shm\"} 3\n"),
            "{t}"
        );
        assert!(
            t.contains("flowlane_bytes_total{lane=\"shm\",direction=\"client_to_server\"} 40\n")
        );
        assert!(
            t.contains("flowlane_bytes_total{lane=\"relay\",direction=\"server_to_client\"} 2\n")
        );
        assert!(t.contains("flowlane_fallbacks_total{reason=\"no-listener\"} 2\n"));
        assert!(
            t.contains("flowlane_channels_stocked{lane=\"shm\"} 5\n"),
            "{t}"
        );
        assert!(t.contains("flowlane_auth_failures_total 0\n"));
        assert!(
            t.contains("flowlane_build_info{version=\"9.8.7\",protocol=\"0\"} 1\n"),
            "{t}"
        );
        assert!(t.ends_with("# EOF\n"));
        // Every family once, its samples right after its TYPE line.
        let names = types(&t);
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "{t}");
        let mut current = "";
        for l in t.lines() {
            if let Some(f) = l.strip_prefix("# TYPE ") {
                current = f.split(' ').next().unwrap();
            } else if !l.starts_with('#') {
                assert!(l.starts_with(current), "{l} outside {current}");
            }
        }
    }

    #[test]
    fn the_process_scan_is_summed_over_pods() {
        use flowlane_lane::proto::{OffLaneReason, PodProcesses, ProcessScan};
        let pod = |lane, tcp, reasons: &[(OffLaneReason, u32)]| PodProcesses {
            lane,
            tcp,
            reasons: reasons.iter().copied().collect(),
            ..PodProcesses::default()
        };
        let st = Stats {
            processes: Some(ProcessScan {
                pods: vec![
                    pod(2, 1, &[(OffLaneReason::Go, 1)]),
                    pod(1, 2, &[(OffLaneReason::Go, 1), (OffLaneReason::Static, 2)]),
                ],
                ..ProcessScan::default()
            }),
            ..Stats::default()
        };
        let t = prometheus_text(&st);
        assert!(
            t.contains("flowlane_pod_processes{state=\"lane\"} 3\n"),
            "{t}"
        );
        assert!(
            t.contains("flowlane_pod_processes{state=\"tcp\"} 3\n"),
            "{t}"
        );
        assert!(
            t.contains("flowlane_pod_processes{state=\"unreadable\"} 0\n"),
            "{t}"
        );
        assert!(
            t.contains("flowlane_pod_processes_off_lane{reason=\"go\"} 2\n"),
            "{t}"
        );
        assert!(
            t.contains("flowlane_pod_processes_off_lane{reason=\"static\"} 2\n"),
            "{t}"
        );
        assert!(!prometheus_text(&Stats::default()).contains("flowlane_pod_processes"));
    }

    #[test]
    fn histogram_is_exposed_cumulative_with_sum_and_count() {
        let mut st = Stats {
            channel_setup: LatencyHistogram::latency(),
            ..Stats::default()
        };
        st.channel_setup.observe(Duration::from_micros(30));
        st.channel_setup.observe(Duration::from_micros(700));
        st.channel_setup.observe(Duration::from_secs(3));
        let t = prometheus_text(&st);
        assert_eq!(
            t.matches("# TYPE flowlane_channel_setup_seconds histogram\n")
                .count(),
            1,
            "{t}"
        );
        assert!(
            t.contains("flowlane_channel_setup_seconds_bucket{le=\"0.00005\"} 1\n"),
            "{t}"
        );
        assert!(t.contains("flowlane_channel_setup_seconds_bucket{le=\"0.0005\"} 1\n"));
        assert!(t.contains("flowlane_channel_setup_seconds_bucket{le=\"0.001\"} 2\n"));
        assert!(t.contains("flowlane_channel_setup_seconds_bucket{le=\"1.0\"} 2\n"));
        assert!(t.contains("flowlane_channel_setup_seconds_bucket{le=\"+Inf\"} 3\n"));
        assert!(
            t.contains("flowlane_channel_setup_seconds_sum 3.00073\n"),
            "{t}"
        );
        assert!(t.contains("flowlane_channel_setup_seconds_count 3\n"));
        // An old daemon's stats (no histogram bounds) still render validly.
        let t = prometheus_text(&Stats::default());
        assert!(
            t.contains("flowlane_request_handling_seconds_bucket{le=\"+Inf\"} 0\n"),
            "{t}"
        );
    }

    #[test]
    fn rdma_errors_are_exposed_by_kind_when_the_rdma_lane_runs() {
        let mut st = Stats::default();
        st.lane_errors.insert(
            "rdma".into(),
            [
                ("link_failed".to_string(), 2),
                ("link_setup_failed".to_string(), 0),
            ]
            .into_iter()
            .collect(),
        );
        // The test transport's lane is not RDMA.
        st.lane_errors.insert(
            "relay".into(),
            [("link_failed".to_string(), 5)].into_iter().collect(),
        );
        let t = prometheus_text(&st);
        assert_eq!(
            t.matches("# TYPE flowlane_rdma_errors counter\n").count(),
            1,
            "{t}"
        );
        assert!(
            t.contains("flowlane_rdma_errors_total{kind=\"link_failed\"} 2\n"),
            "{t}"
        );
        assert!(t.contains("flowlane_rdma_errors_total{kind=\"link_setup_failed\"} 0\n"));
        assert!(!t.contains(" 5\n"), "{t}");
    }

    #[test]
    fn rdma_errors_family_is_described_without_invented_samples() {
        let t = prometheus_text(&Stats::default());
        assert!(t.contains("# TYPE flowlane_rdma_errors counter"));
        assert!(t.contains("# HELP flowlane_rdma_errors RDMA lane errors"));
        assert!(
            !t.lines()
                .any(|l| l.starts_with("flowlane_rdma_errors_total")),
            "{t}"
        );
        assert!(!t.contains("flowlane_relay_memory"), "{t}");
    }

    #[test]
    fn health_paths_answer_without_metrics() {
        let dir = std::env::temp_dir().join(format!("mx-readyz-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("s.sock");
        let shared = Shared::new(crate::broker::Broker::new(
            crate::broker::DaemonFacts {
                state_dir: dir.clone(),
                socket: socket.clone(),
            },
            crate::broker::Limits::default(),
            Box::new(crate::broker::RealKernel::new(&dir)),
        ));
        let ready = Readiness {
            socket: socket.clone(),
            nodes: None,
        };
        let get = |p: &str| {
            answer(
                format!("GET {p} HTTP/1.1\r\n\r\n").as_bytes(),
                &shared,
                &crate::stats::Lanes::default(),
                &ready,
            )
        };
        assert_eq!(get("/healthz").0, "200 OK");
        assert_eq!(get("/readyz").0, "503 Service Unavailable");
        let _l = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        assert_eq!(get("/readyz").0, "200 OK");
        let (status, kind, body) = get("/metrics");
        assert_eq!(status, "200 OK");
        assert!(kind.starts_with("application/openmetrics-text"));
        assert!(body.contains("flowlane_build_info{"), "{body}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
