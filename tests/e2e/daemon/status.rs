//! `flowlane status` against a real `flowlaned`: the JSON parses into the
//! daemon's stats, the table shows lanes, fallbacks and connections, a
//! missing daemon is a clear error; the Prometheus endpoint serves the
//! same counters.

use super::common as daemon_common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::process::Command;

use daemon_common::Node;
use flowlane_e2e::binaries::workspace_artifact;
use flowlane_lane::proto::Stats;

fn status(args: &[&str]) -> std::process::Output {
    Command::new(workspace_artifact("flowlane"))
        .arg("status")
        .args(args)
        .env_remove("FLOWLANE_SOCKET")
        .output()
        .expect("run flowlane status")
}

/// One parsed sample line of the Prometheus text format.
#[derive(Debug)]
struct Line {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

/// A small parser of the exposition format: every non-comment line is
/// `name{labels} value` or `name value`, the value an f64; every family
/// has one `# TYPE`.
fn parse_prometheus(body: &str) -> (Vec<Line>, BTreeMap<String, String>) {
    let mut types = BTreeMap::new();
    let mut lines = Vec::new();
    for l in body.lines().filter(|l| !l.is_empty()) {
        if let Some(rest) = l.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("TYPE name kind");
            assert!(
                types.insert(name.to_string(), kind.to_string()).is_none(),
                "duplicate TYPE for {name}"
            );
            continue;
        }
        if l.starts_with('#') {
            continue;
        }
        let (series, value) = l
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("no value: {l}"));
        let value: f64 = value
            .parse()
            .unwrap_or_else(|e| panic!("value of {l:?} is not a float: {e}"));
        let (name, labels) = match series.split_once('{') {
            None => (series.to_string(), Vec::new()),
            Some((name, rest)) => {
                let inner = rest
                    .strip_suffix('}')
                    .unwrap_or_else(|| panic!("labels: {l}"));
                let labels = inner
                    .split(',')
                    .map(|kv| {
                        let (k, v) = kv.split_once('=').unwrap_or_else(|| panic!("label: {l}"));
                        let v = v
                            .strip_prefix('"')
                            .and_then(|v| v.strip_suffix('"'))
                            .unwrap_or_else(|| panic!("label quotes: {l}"));
                        (k.to_string(), v.to_string())
                    })
                    .collect();
                (name.to_string(), labels)
            }
        };
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "metric name {name:?}"
        );
        lines.push(Line {
            name,
            labels,
            value,
        });
    }
    (lines, types)
}

/// Checks a histogram's semantics and returns its `_count`.
fn check_histogram(lines: &[Line], types: &BTreeMap<String, String>, family: &str) -> f64 {
    assert_eq!(types.get(family).map(String::as_str), Some("histogram"));
    let bucket = format!("{family}_bucket");
    let buckets: Vec<(f64, f64)> = lines
        .iter()
        .filter(|l| l.name == bucket)
        .map(|l| {
            let le = &l
                .labels
                .iter()
                .find(|(k, _)| k == "le")
                .expect("le label")
                .1;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().expect("le is a float")
            };
            (le, l.value)
        })
        .collect();
    assert!(buckets.len() >= 2, "{family} buckets: {buckets:?}");
    assert!(
        buckets
            .windows(2)
            .all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1),
        "{family} buckets not ascending/cumulative: {buckets:?}"
    );
    assert_eq!(buckets.last().unwrap().0, f64::INFINITY);
    let one = |suffix: &str| {
        let name = format!("{family}{suffix}");
        let v: Vec<&Line> = lines.iter().filter(|l| l.name == name).collect();
        assert_eq!(v.len(), 1, "{name}");
        v[0].value
    };
    let count = one("_count");
    assert_eq!(
        count,
        buckets.last().unwrap().1,
        "{family}: _count != +Inf bucket"
    );
    assert!(one("_sum") >= 0.0);
    count
}

fn get(addr: &str, path: &str) -> String {
    let mut conn = std::net::TcpStream::connect(addr).expect("metrics endpoint");
    conn.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
        .unwrap();
    let mut text = String::new();
    conn.read_to_string(&mut text).unwrap();
    text
}

fn scrape(addr: &str) -> String {
    let text = get(addr, "/metrics");
    assert!(text.starts_with("HTTP/1.0 200 OK"), "{text}");
    let body = text.split_once("\r\n\r\n").expect("HTTP head").1;
    openmetrics_parse(body);
    body.to_string()
}

/// Parses `text` with the Python `prometheus_client` OpenMetrics parser
/// (strict: one block per family, `# EOF`) and returns `name{labels} value`
/// per sample, as the parser saw them.
fn openmetrics_parse(text: &str) -> String {
    let mut child = std::process::Command::new("/usr/bin/python3")
        .args([
            "-c",
            "import sys\nfrom prometheus_client.openmetrics.parser import text_string_to_metric_families as p\nfor f in p(sys.stdin.read()):\n  for s in f.samples: print(s.name, sorted(s.labels.items()), s.value)",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("/usr/bin/python3 (Debian python3-prometheus-client)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the OpenMetrics parser refused the scrape: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn status_prints_json_and_a_table_and_metrics_match() {
    let _turn = crate::turn::take(module_path!());
    let port = free_port();
    let metrics = format!("127.0.0.1:{port}");
    let mut node = Node::start("sta", &["--metrics-addr", &metrics]);
    let a = node.add_pod("a", "10.202.8.2");
    let b = node.add_pod("b", "10.202.8.3");
    let (mut pa, mut pb) = (a.agent(), b.agent());
    assert_eq!(pb.cmd("listen 0.0.0.0:8080"), "ok");
    let id = pa.expect_channel("intent 0.0.0.0:46000 10.202.8.3:8080 65536");
    pb.expect_channel("claim 10.202.8.3:8080 10.202.8.2:46000");
    assert_eq!(pa.cmd("intent 0.0.0.0:46001 10.202.8.3:9999 65536"), "none");
    let socket = node.socket.to_str().unwrap().to_string();

    let out = status(&["--json", "--socket", &socket]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let st: Stats = serde_json::from_slice(&out.stdout).expect("status --json is the stats JSON");
    assert_eq!(st.lanes["shm"].connections_opened, 1);
    assert_eq!(st.lanes["shm"].connections_active, 1);
    assert_eq!(st.fallbacks["no-listener"], 1);
    assert_eq!(st.connections[0].id, id);
    assert_eq!(st.connections[0].client.pod, "default/a");
    assert_eq!(st.connections[0].server.addr.to_string(), "10.202.8.3:8080");
    assert_eq!(st.daemon.pods, 2);
    // Raw JSON keys other tools rely on.
    let raw: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(raw["lanes"]["shm"]["connections_active"], 1);
    assert_eq!(raw["fallbacks"]["no-listener"], 1);
    assert_eq!(st.channel_setup.count, 1);
    assert_eq!(raw["channel_setup"]["count"], 1);

    let out = status(&["--socket", &socket]);
    assert!(out.status.success());
    let table = String::from_utf8_lossy(&out.stdout);
    println!("{table}");
    assert!(table.contains("LANE"), "{table}");
    assert!(table.lines().any(|l| l.starts_with("shm ")), "{table}");
    assert!(table.contains("default/a 10.202.8.2:46000"), "{table}");
    assert!(table.contains("no-listener"), "{table}");
    assert!(table.contains("LISTENERS: 1"), "{table}");

    // Prometheus text over HTTP.
    let text = scrape(&metrics);
    let (lines, types) = parse_prometheus(&text);
    assert_eq!(
        check_histogram(&lines, &types, "flowlane_channel_setup_seconds"),
        1.0
    );
    assert!(
        text.contains("flowlane_connections_opened_total{lane=\"shm\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("flowlane_fallbacks_total{reason=\"no-listener\"} 1"),
        "{text}"
    );

    // No daemon: a clear error and a non-zero exit.
    assert!(node.stop_daemon());
    let out = status(&["--socket", &socket]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no flowlaned answers on"), "{err}");
    let out = status(&["--bogus"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn metrics_scrape_parses_and_histogram_counts_claimed_channels() {
    let _turn = crate::turn::take(module_path!());
    const CHANNELS: u16 = 5;
    let port = free_port();
    let metrics = format!("127.0.0.1:{port}");
    let node = Node::start("met", &["--metrics-addr", &metrics]);
    let a = node.add_pod("a", "10.202.8.12");
    let b = node.add_pod("b", "10.202.8.13");
    let (mut pa, mut pb) = (a.agent(), b.agent());
    assert_eq!(pb.cmd("listen 0.0.0.0:8080"), "ok");
    for i in 0..CHANNELS {
        let src = 47000 + i;
        pa.expect_channel(&format!("intent 0.0.0.0:{src} 10.202.8.13:8080 65536"));
        pb.expect_channel(&format!("claim 10.202.8.13:8080 10.202.8.12:{src}"));
    }
    // An intent nobody claims is not a set-up.
    pa.expect_channel("intent 0.0.0.0:47999 10.202.8.13:8080 65536");

    let text = scrape(&metrics);
    println!("{text}");
    let (lines, types) = parse_prometheus(&text);
    assert_eq!(
        check_histogram(&lines, &types, "flowlane_channel_setup_seconds"),
        f64::from(CHANNELS)
    );
    // Every request the agents made was handled and timed.
    let handled = check_histogram(&lines, &types, "flowlane_request_handling_seconds");
    assert!(handled >= f64::from(2 * CHANNELS + 2), "{handled}");
    let opened = lines
        .iter()
        .find(|l| l.name == "flowlane_connections_opened_total")
        .expect("opened counter");
    assert_eq!(opened.value, f64::from(CHANNELS));
    // Described, but nothing is invented for the transport that does not exist.
    assert_eq!(
        types.get("flowlane_rdma_errors").map(String::as_str),
        Some("counter")
    );
    assert!(!lines.iter().any(|l| l.name == "flowlane_rdma_errors_total"));
    // Every sample belongs to a described family.
    for l in &lines {
        let family = ["_bucket", "_sum", "_count", "_total"]
            .iter()
            .find_map(|s| l.name.strip_suffix(s).filter(|f| types.contains_key(*f)))
            .unwrap_or(&l.name);
        assert!(types.contains_key(family), "no TYPE for {}", l.name);
    }
    // Build info, and the health endpoints on the same listener.
    assert!(
        text.contains(&format!(
            "flowlane_build_info{{version=\"{}\"",
            env!("CARGO_PKG_VERSION")
        )),
        "{text}"
    );
    assert!(get(&metrics, "/healthz").starts_with("HTTP/1.0 200 OK"));
    assert!(get(&metrics, "/readyz").starts_with("HTTP/1.0 200 OK"));
    // The JSON carries the same histogram.
    let st = node.stats();
    assert_eq!(st.channel_setup.count, u64::from(CHANNELS));
    assert_eq!(
        st.channel_setup.counts.iter().sum::<u64>(),
        st.channel_setup.count
    );
}
