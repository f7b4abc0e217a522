//! `flowlane status` against a real `flowlaned`: the JSON parses into the
//! daemon's stats, the table shows lanes, fallbacks and connections, a
//! missing daemon is a clear error; the Prometheus endpoint serves the
//! same counters.

mod daemon_common;

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

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn status_prints_json_and_a_table_and_metrics_match() {
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
    let mut conn = std::net::TcpStream::connect(&metrics).expect("metrics endpoint");
    conn.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut text = String::new();
    conn.read_to_string(&mut text).unwrap();
    assert!(text.starts_with("HTTP/1.0 200 OK"), "{text}");
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
