//! Optional Prometheus text endpoint (`--metrics-addr`): every request on
//! the TCP port gets the current counters in the text exposition format.

use std::fmt::Write as _;
use std::net::SocketAddr;

use flowlane_lane::proto::Stats;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::counters::samples;
use crate::server::Shared;

/// The Prometheus text exposition of a stats snapshot.
pub fn prometheus_text(stats: &Stats) -> String {
    let mut out = String::new();
    let mut described = std::collections::BTreeSet::new();
    for s in samples(stats) {
        if described.insert(s.name) {
            let _ = writeln!(out, "# HELP {} {}", s.name, s.help);
            let _ = writeln!(out, "# TYPE {} {}", s.name, s.kind);
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
    use flowlane_lane::proto::LaneStats;

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
}
