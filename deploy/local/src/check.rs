//! `flowlane cluster check`: the cluster-level connectivity check (in the
//! spirit of `cilium connectivity test`). It starts a same-node and a
//! cross-node pod pair, moves bytes between them through the preload library
//! as injected pods do, verifies every byte came back counted and hashed, and
//! says from the node daemons' own counters which lane carried them.
//!
//! The pods' programs are this very binary (`flowlane cluster probe`, see
//! [`crate::probe`]), so the check needs nothing installed in the pods.

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};

use serde::Serialize;

use crate::exec::in_pod;
use crate::lanes::{self, Counters};
use crate::spec::Binaries;
use crate::status::{ClusterState, PodState};

/// Bytes each pair moves: enough to cross a 1 MiB ring several times.
pub const CHECK_BYTES: u64 = 8 << 20;
const FIRST_PORT: u16 = 18_570;

/// What one pair showed.
#[derive(Debug, Clone, Serialize)]
pub struct PairResult {
    /// `same-node` or `cross-node`.
    pub kind: &'static str,
    pub client: String,
    pub server: String,
    /// Every byte arrived and the server's count and hash match the client's.
    pub bytes_ok: bool,
    pub bytes: u64,
    /// `shm`, `relay` or `tcp`, from the daemons' counters; `unknown` when a
    /// daemon did not answer.
    pub lane: String,
    /// Why the connection stayed on TCP, as the daemons counted it.
    pub tcp_reasons: Vec<String>,
    /// What went wrong, if anything.
    pub error: Option<String>,
}

/// The pairs the check runs: the first two pods of node 0 (same node), and
/// the first pods of nodes 0 and 1 (cross-node), where the cluster has them.
pub fn pairs(state: &ClusterState) -> Vec<(&'static str, &PodState, &PodState)> {
    let on = |n: u32| state.pods.iter().filter(move |p| p.node == n);
    let mut out = Vec::new();
    let mut n0 = on(0);
    if let (Some(a), Some(b)) = (n0.next(), n0.next()) {
        out.push(("same-node", a, b));
    }
    if let (Some(a), Some(b)) = (on(0).next(), on(1).next()) {
        out.push(("cross-node", a, b));
    }
    out
}

/// Runs every pair, one after the other (so each pair's counter deltas are
/// its own).
pub fn run(state: &ClusterState, bins: &Binaries) -> Vec<PairResult> {
    pairs(state)
        .into_iter()
        .enumerate()
        .map(|(i, (kind, client, server))| {
            let port = FIRST_PORT + i as u16;
            run_pair(state, bins, kind, client, server, port)
        })
        .collect()
}

fn read_all(state: &ClusterState, bins: &Binaries) -> Vec<Option<Counters>> {
    state
        .nodes
        .iter()
        .map(|n| lanes::read(bins, &n.daemon_socket))
        .collect()
}

fn run_pair(
    state: &ClusterState,
    bins: &Binaries,
    kind: &'static str,
    client: &PodState,
    server: &PodState,
    port: u16,
) -> PairResult {
    let mut res = PairResult {
        kind,
        client: client.name.clone(),
        server: server.name.clone(),
        bytes_ok: false,
        bytes: CHECK_BYTES,
        lane: "unknown".into(),
        tcp_reasons: Vec::new(),
        error: None,
    };
    let before = read_all(state, bins);
    match move_bytes(state, bins, client, server, port) {
        Ok(()) => res.bytes_ok = true,
        Err(e) => res.error = Some(e),
    }
    let after = read_all(state, bins);
    let d = lanes::evidence_by_lane(&before, &after);
    if d.counters_read {
        res.lane = if d.opened.get("shm").copied().unwrap_or(0) > 0 {
            "shm".into()
        } else if d.opened.iter().any(|(l, n)| l != "shm" && *n > 0) {
            "relay".into()
        } else {
            "tcp".into()
        };
        res.tcp_reasons = d.fallback_reasons.keys().cloned().collect();
    }
    res
}

/// A child process killed and reaped on drop.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn move_bytes(
    state: &ClusterState,
    bins: &Binaries,
    client: &PodState,
    server: &PodState,
    port: u16,
) -> Result<(), String> {
    let mut serve = in_pod(bins, state, server, true);
    serve
        .arg(bins.flowlane())
        .args(["cluster", "probe", "serve", &port.to_string()])
        .env_remove("CNI_COMMAND")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = Reaped(serve.spawn().map_err(|e| format!("start server: {e}"))?);
    // The server prints one line once it listens.
    // Kept open until the client is done: the server prints the peer it
    // accepted, and a closed pipe would kill it mid-transfer.
    let mut ready = String::new();
    let mut out = BufReader::new(child.0.stdout.take().ok_or("server has no stdout")?);
    out.read_line(&mut ready)
        .map_err(|e| format!("server: {e}"))?;
    if ready.trim() != "listening" {
        return Err(format!("server in {} did not start", server.name));
    }
    let mut send = in_pod(bins, state, client, true);
    send.arg(bins.flowlane())
        .args(["cluster", "probe", "send"])
        .arg(format!("{}:{port}", server.ip))
        .arg(CHECK_BYTES.to_string())
        .env_remove("CNI_COMMAND");
    crate::sh::run(&mut send).map_err(|e| format!("client in {}: {}", client.name, e.reason))?;
    Ok(())
}

/// The report a person reads.
pub fn render(results: &[PairResult]) -> String {
    let mut s = String::new();
    for r in results {
        let verdict = match (&r.error, r.bytes_ok) {
            (None, true) => "ok",
            _ => "FAILED",
        };
        s.push_str(&format!(
            "{:<10} {} -> {}: {verdict}, {} MiB, lane {}",
            r.kind,
            r.client,
            r.server,
            r.bytes >> 20,
            r.lane
        ));
        if !r.tcp_reasons.is_empty() {
            s.push_str(&format!(" (stayed on TCP: {})", r.tcp_reasons.join(", ")));
        }
        if let Some(e) = &r.error {
            s.push_str(&format!("\n           {e}"));
        }
        s.push('\n');
    }
    s
}
