//! Optional Prometheus text endpoint (`--metrics-addr`): every request on
//! the TCP port gets the current counters in the text exposition format.

use std::fmt::Write as _;
use std::net::SocketAddr;

use flowlane_lane::proto::Stats;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::counters::{samples, EMPTY_FAMILIES};
use crate::server::Shared;

/// The Prometheus text exposition of a stats snapshot.
pub fn prometheus_text(stats: &Stats) -> String {
    let mut out = String::new();
    let mut described = std::collections::BTreeSet::new();
    for s in samples(stats) {
        if described.insert(s.family) {
            let _ = writeln!(out, "# HELP {} {}", s.family, s.help);
            let _ = writeln!(out, "# TYPE {} {}", s.family, s.kind);
        }
        let labels: Vec<String> = s
            .labels
            .iter()
            .map(|(k, v)| format!("{k}=\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\"")))
            .collect();
        if labels.is_empty() {
            let _ = writeln!(out, "{} {}", s.name, s.value);
        } else {
            let _ = writeln!(out, "{}{{{}}} {}", s.name, labels.join(","), s.value);
        }
    }
    for f in EMPTY_FAMILIES {
        if described.insert(f.name) {
            let _ = writeln!(out, "# HELP {} {}", f.name, f.help);
            let _ = writeln!(out, "# TYPE {} {}", f.name, f.kind);
        }
    }
    out
}

/// Serves the metrics on `addr` forever.
pub async fn serve(addr: SocketAddr, shared: Shared) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    tracing::info!(%addr, "metrics endpoint listening");
    loop {
        let (mut conn, _) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(error = %e, "metrics accept failed");
                continue;
            }
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            // Read (and ignore) the request head; any path gets the metrics.
            let mut buf = [0u8; 2048];
            let _ =
                tokio::time::timeout(std::time::Duration::from_secs(2), conn.read(&mut buf)).await;
            let body = prometheus_text(&shared.lock().stats());
            let head = format!(
                "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
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

    #[test]
    fn text_format_has_help_type_and_labels() {
        let mut st = Stats::default();
        st.lanes.insert(
            "shm".into(),
            LaneStats {
                connections_opened: 3,
                bytes: 42,
                ..LaneStats::default()
            },
        );
        st.fallbacks.insert("no-listener".into(), 2);
        let t = prometheus_text(&st);
        assert!(t.contains("# TYPE flowlane_connections_opened_total counter"));
        assert!(t.contains("flowlane_connections_opened_total{lane=\"shm\"} 3"));
        assert!(t.contains("flowlane_bytes_total{lane=\"shm\"} 42"));
        assert!(t.contains("flowlane_fallbacks_total{reason=\"no-listener\"} 2"));
        assert!(t.contains("flowlane_auth_failures_total 0"));
        assert_eq!(t.matches("# HELP flowlane_fallbacks_total").count(), 1);
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
            t.matches("# TYPE flowlane_channel_setup_seconds histogram")
                .count(),
            1,
            "{t}"
        );
        assert!(!t.contains("# TYPE flowlane_channel_setup_seconds_bucket"));
        assert!(t.contains("flowlane_channel_setup_seconds_bucket{le=\"0.00005\"} 1\n"));
        assert!(t.contains("flowlane_channel_setup_seconds_bucket{le=\"0.0005\"} 1\n"));
        assert!(t.contains("flowlane_channel_setup_seconds_bucket{le=\"0.001\"} 2\n"));
        assert!(t.contains("flowlane_channel_setup_seconds_bucket{le=\"1\"} 2\n"));
        assert!(t.contains("flowlane_channel_setup_seconds_bucket{le=\"+Inf\"} 3\n"));
        assert!(
            t.contains("flowlane_channel_setup_seconds_sum 3.00073\n"),
            "{t}"
        );
        assert!(t.contains("flowlane_channel_setup_seconds_count 3\n"));
        // An old daemon's stats (no histogram bounds) still render validly.
        let t = prometheus_text(&Stats::default());
        assert!(t.contains("flowlane_request_handling_seconds_bucket{le=\"+Inf\"} 0\n"));
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
            t.matches("# TYPE flowlane_rdma_errors_total counter")
                .count(),
            1,
            "{t}"
        );
        assert!(
            t.contains("flowlane_rdma_errors_total{kind=\"link_failed\"} 2\n"),
            "{t}"
        );
        assert!(
            t.contains("flowlane_rdma_errors_total{kind=\"link_setup_failed\"} 0\n"),
            "{t}"
        );
        assert!(!t.contains(" 5\n"), "{t}");
    }

    #[test]
    fn rdma_errors_family_is_described_without_invented_samples() {
        let t = prometheus_text(&Stats::default());
        assert!(t.contains("# TYPE flowlane_rdma_errors_total counter"));
        assert!(t.contains("# HELP flowlane_rdma_errors_total RDMA lane errors"));
        assert!(
            !t.lines()
                .any(|l| !l.starts_with('#') && l.starts_with("flowlane_rdma_errors_total")),
            "{t}"
        );
    }
}
