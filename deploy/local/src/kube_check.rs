//! `flowlane cluster check --kubernetes`: the connectivity check of
//! [`crate::check`] on a real cluster, through its API server.
//!
//! It picks two nodes (a pair whose Node objects both publish the RDMA lane
//! annotation when there is one), creates probe pods pinned to them with
//! `spec.nodeName` and opted in to injection with the pod annotation
//! `flowlane.io/inject: "true"` (what the shipped webhook honours in every
//! namespace it serves), runs the probe programs the image ships
//! (`flowlane-cluster cluster probe serve|send`), reads the result from the
//! pods' logs, and says from the node daemons' own counters, read before and
//! after through the pod proxy subresource of each node's flowlane pod
//! (`/api/v1/namespaces/NS/pods/POD:PORT/proxy/metrics`), which lane carried
//! the bytes. Everything it created is deleted, also after a failure, a
//! timeout or Ctrl-C.
//!
//! What a pair should get:
//! - same node, both pods injected: `shm`;
//! - two nodes that both publish an RDMA lane with a lane port (and the same
//!   link layer), both pods injected: `relay`;
//! - anything else: `tcp` is expected, and is not a failure.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, LogParams, PostParams};
use kube::Client;
use serde::Serialize;
use serde_json::json;

/// The probe program in the flowlane image (deploy/kubernetes/image).
pub const IMAGE_PROBE: &str = "/usr/local/lib/flowlane/flowlane-cluster";
const INJECT_ANNOTATION: &str = "flowlane.io/inject";
const INJECTED_ANNOTATION: &str = "flowlane.io/injected";
const CHECK_LABEL: &str = "app.kubernetes.io/name";
const CHECK_LABEL_VALUE: &str = "flowlane-check";
const PORT: u16 = 18_570;

/// The command line's choices.
#[derive(Debug, Clone)]
pub struct KubeCheckOpts {
    /// A kubeconfig file; else `KUBECONFIG`, `~/.kube/config`, in-cluster.
    pub kubeconfig: Option<PathBuf>,
    /// Where the probe pods go (created when missing, deleted again then).
    pub namespace: String,
    /// Where the flowlane DaemonSet runs.
    pub flowlane_namespace: String,
    /// The label selector of the DaemonSet's pods.
    pub daemon_selector: String,
    pub node_a: Option<String>,
    pub node_b: Option<String>,
    /// The probe image; default: the image the flowlaned container of node
    /// A's flowlane pod runs.
    pub image: Option<String>,
    pub bytes: u64,
    /// Bound of each wait (a pod starting, a transfer, a pod going away).
    pub timeout: Duration,
}

impl Default for KubeCheckOpts {
    fn default() -> Self {
        KubeCheckOpts {
            kubeconfig: None,
            namespace: "flowlane-check".into(),
            flowlane_namespace: "flowlane-system".into(),
            daemon_selector: "app.kubernetes.io/name=flowlane-node".into(),
            node_a: None,
            node_b: None,
            image: None,
            bytes: crate::check::CHECK_BYTES,
            timeout: Duration::from_secs(120),
        }
    }
}

/// What one pair showed.
#[derive(Debug, Clone, Serialize, Default)]
pub struct KubePair {
    /// `same-node` or `cross-node`.
    pub kind: String,
    pub client_pod: String,
    pub client_node: String,
    pub server_pod: String,
    pub server_node: String,
    /// The client pod's IP, and the address the server saw it connect from.
    pub client_ip: String,
    pub peer_seen: Option<String>,
    /// Every byte arrived, counted and hashed (the client checked the
    /// server's answer).
    pub bytes_ok: bool,
    pub bytes: u64,
    /// `shm`, `relay` or `tcp`, from the counters; `unknown` when a daemon's
    /// counters could not be read.
    pub lane: String,
    /// The daemon's lane label when the relay carried it (`relay`, `rdma`).
    pub relay_transport: Option<String>,
    /// Application bytes the lane counted on the pair's nodes (client to
    /// server, the largest per node).
    pub lane_bytes: u64,
    /// What the pair should get, and why.
    pub expected: String,
    pub expected_because: String,
    /// Fallback reasons the pair's daemons counted meanwhile.
    pub tcp_reasons: BTreeMap<String, u64>,
    pub ok: bool,
    pub error: Option<String>,
}

/// The whole run.
#[derive(Debug, Clone, Serialize, Default)]
pub struct KubeReport {
    pub namespace: String,
    pub node_a: String,
    pub node_b: Option<String>,
    pub image: String,
    pub pairs: Vec<KubePair>,
    /// Why there is no cross-node pair, when there is none.
    pub skipped: Vec<String>,
    /// Pods (and the namespace) it created and deleted; what it could not.
    pub deleted: Vec<String>,
    pub cleanup_errors: Vec<String>,
    pub ok: bool,
}

/// The counters of one daemon that tell lanes apart (a scrape's samples).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scrape {
    pub opened: BTreeMap<String, f64>,
    /// `flowlane_bytes_total{direction="client_to_server"}` by lane.
    pub bytes_c2s: BTreeMap<String, f64>,
    pub fallbacks: BTreeMap<String, f64>,
}

/// One sample line of the OpenMetrics text: name, labels, value.
fn sample(line: &str) -> Option<(&str, BTreeMap<String, String>, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (name, rest) = match line.find('{') {
        Some(i) => (&line[..i], &line[i..]),
        None => {
            let (n, v) = line.split_once(' ')?;
            return Some((
                n,
                BTreeMap::new(),
                v.split_whitespace().next()?.parse().ok()?,
            ));
        }
    };
    // Labels: name="value" pairs, values with \" \\ \n escapes.
    let mut labels = BTreeMap::new();
    let mut chars = rest[1..].char_indices().peekable();
    let body = &rest[1..];
    let end;
    loop {
        while chars.peek().is_some_and(|(_, c)| *c == ',' || *c == ' ') {
            chars.next();
        }
        match chars.peek() {
            Some((i, '}')) => {
                end = *i;
                break;
            }
            None => return None,
            _ => {}
        }
        let start = chars.peek()?.0;
        let mut eq = None;
        for (i, c) in chars.by_ref() {
            if c == '=' {
                eq = Some(i);
                break;
            }
        }
        let key = body[start..eq?].trim().to_string();
        if chars.next()?.1 != '"' {
            return None;
        }
        let mut value = String::new();
        loop {
            match chars.next()?.1 {
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                '"' => break,
                c => value.push(c),
            }
        }
        labels.insert(key, value);
    }
    let value = body[end + 1..].split_whitespace().next()?.parse().ok()?;
    Some((name, labels, value))
}

/// The lane counters of a daemon's `/metrics` (docs/daemon.md, "Metrics").
pub fn parse_metrics(text: &str) -> Option<Scrape> {
    let mut s = Scrape::default();
    let mut seen_build_info = false;
    for (name, labels, value) in text.lines().filter_map(sample) {
        let label = |k: &str| labels.get(k).cloned().unwrap_or_default();
        match name {
            "flowlane_build_info" => seen_build_info = true,
            "flowlane_connections_opened_total" => {
                *s.opened.entry(label("lane")).or_default() += value;
            }
            "flowlane_bytes_total" if label("direction") == "client_to_server" => {
                *s.bytes_c2s.entry(label("lane")).or_default() += value;
            }
            "flowlane_fallbacks_total" => {
                *s.fallbacks.entry(label("reason")).or_default() += value;
            }
            _ => {}
        }
    }
    seen_build_info.then_some(s)
}

fn delta(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(k, a)| (k.clone(), a - before.get(k).copied().unwrap_or(0.0)))
        .filter(|(_, d)| *d > 0.0)
        .collect()
}

/// The lane the counters show for a pair moving `bytes`: a lane counts
/// when, on one of the pair's nodes, it opened a connection and counted at
/// least the probe's bytes from client to server meanwhile (so another
/// connection on a busy node cannot pass for the probe's). Returns the lane,
/// the daemon's lane label, the bytes it counted and the fallback reasons.
pub fn lane_from_counters(
    before: &[Scrape],
    after: &[Scrape],
    bytes: u64,
) -> (String, Option<String>, u64, BTreeMap<String, u64>) {
    let mut best: Option<(String, u64)> = None;
    let mut reasons = BTreeMap::new();
    for (b, a) in before.iter().zip(after) {
        let opened = delta(&b.opened, &a.opened);
        let moved = delta(&b.bytes_c2s, &a.bytes_c2s);
        for (lane, n) in &moved {
            let n = *n as u64;
            if opened.contains_key(lane) && n >= bytes {
                // shm first: a same-node pair is never relayed.
                let better = match &best {
                    None => true,
                    Some((l, m)) => (lane == "shm" && l != "shm") || (l == lane && n > *m),
                };
                if better {
                    best = Some((lane.clone(), n));
                }
            }
        }
        for (reason, n) in delta(&b.fallbacks, &a.fallbacks) {
            *reasons.entry(reason).or_default() += n as u64;
        }
    }
    match best {
        Some((l, n)) if l == "shm" => ("shm".into(), None, n, reasons),
        Some((l, n)) => ("relay".into(), Some(l), n, reasons),
        None => ("tcp".into(), None, 0, reasons),
    }
}

/// A node of the check: its flowlane pod and what its Node publishes.
#[derive(Debug, Clone)]
struct CheckNode {
    name: String,
    daemon_pod: String,
    metrics_port: u16,
    image: Option<String>,
}

fn api_error(what: &str, e: kube::Error) -> String {
    match e {
        kube::Error::Api(r) => format!("{what}: {} ({} {})", r.message, r.code, r.reason),
        other => format!("{what}: {other}"),
    }
}

async fn client(opts: &KubeCheckOpts) -> Result<Client, String> {
    let config = match &opts.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| format!("kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| format!("kubeconfig {}: {e}", path.display()))?
        }
        None => kube::Config::infer().await.map_err(|e| {
            format!("no kubeconfig (--kubeconfig, KUBECONFIG, ~/.kube/config, in-cluster): {e}")
        })?,
    };
    Client::try_from(config).map_err(|e| format!("Kubernetes client: {e}"))
}

/// The Ready nodes that run a flowlane pod, by name.
async fn check_nodes(
    client: &Client,
    opts: &KubeCheckOpts,
) -> Result<(BTreeMap<String, CheckNode>, flowlane_nodes::ClusterView), String> {
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(|e| api_error("list nodes", e))?;
    let list = serde_json::to_value(&nodes).map_err(|e| e.to_string())?;
    let view = flowlane_nodes::node_object::cluster_view(&list).map_err(|e| e.to_string())?;
    let ready: Vec<String> = nodes
        .items
        .iter()
        .filter(|n| {
            n.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
        .filter_map(|n| n.metadata.name.clone())
        .collect();
    let daemons = Api::<Pod>::namespaced(client.clone(), &opts.flowlane_namespace)
        .list(&ListParams::default().labels(&opts.daemon_selector))
        .await
        .map_err(|e| api_error("list the flowlane pods", e))?;
    let mut out = BTreeMap::new();
    for p in daemons.items {
        let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        let (Some(name), Some(spec)) = (p.metadata.name.clone(), p.spec.as_ref()) else {
            continue;
        };
        let Some(node) = spec.node_name.clone() else {
            continue;
        };
        if !running || !ready.contains(&node) {
            continue;
        }
        let metrics = spec.containers.iter().find_map(|c| {
            c.ports
                .as_ref()?
                .iter()
                .find(|p| p.name.as_deref() == Some("metrics"))
                .map(|p| (c, p.container_port))
        });
        let Some((container, port)) = metrics else {
            continue;
        };
        out.insert(
            node.clone(),
            CheckNode {
                name: node,
                daemon_pod: name,
                metrics_port: u16::try_from(port).unwrap_or(0),
                image: container.image.clone(),
            },
        );
    }
    Ok((out, view))
}

fn lane_published(view: &flowlane_nodes::ClusterView, node: &str) -> bool {
    view.node(node)
        .is_some_and(|n| n.rdma.is_some() && n.lane_port.is_some())
}

/// Node A and (when there is another one) node B.
fn pick(
    nodes: &BTreeMap<String, CheckNode>,
    view: &flowlane_nodes::ClusterView,
    opts: &KubeCheckOpts,
) -> Result<(String, Option<String>), String> {
    let known = |n: &String| -> Result<String, String> {
        if nodes.contains_key(n) {
            Ok(n.clone())
        } else {
            Err(format!(
                "node {n:?} is not Ready or runs no Running flowlane pod (candidates: {})",
                nodes.keys().cloned().collect::<Vec<_>>().join(", ")
            ))
        }
    };
    let lane_nodes: Vec<&String> = nodes.keys().filter(|n| lane_published(view, n)).collect();
    let a = match &opts.node_a {
        Some(a) => known(a)?,
        None => match (lane_nodes.len() >= 2, &opts.node_b) {
            (true, None) => lane_nodes[0].clone(),
            _ => nodes
                .keys()
                .find(|n| Some(*n) != opts.node_b.as_ref())
                .cloned()
                .ok_or("no Ready node runs a Running flowlane pod")?,
        },
    };
    let b = match &opts.node_b {
        Some(b) if *b == a => return Err("--node-a and --node-b name the same node".into()),
        Some(b) => Some(known(b)?),
        None => {
            let others = || nodes.keys().filter(|n| **n != a);
            others()
                .find(|n| {
                    lane_published(view, &a) && view.rdma_between(&a, n) && lane_published(view, n)
                })
                .or_else(|| others().next())
                .cloned()
        }
    };
    Ok((a, b))
}

/// A node daemon's counters; a failed read is tried twice more (a proxied
/// request can fail once without the daemon being gone).
async fn scrape(client: &Client, ns: &str, node: &CheckNode) -> Result<Scrape, String> {
    let mut last = String::new();
    for _ in 0..3 {
        match scrape_once(client, ns, node).await {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    Err(last)
}

async fn scrape_once(client: &Client, ns: &str, node: &CheckNode) -> Result<Scrape, String> {
    let path = format!(
        "/api/v1/namespaces/{ns}/pods/{}:{}/proxy/metrics",
        node.daemon_pod, node.metrics_port
    );
    let req = http::Request::get(&path)
        .body(Vec::new())
        .map_err(|e| e.to_string())?;
    let text = client.request_text(req).await.map_err(|e| {
        api_error(
            &format!("metrics of {} on {}", node.daemon_pod, node.name),
            e,
        )
    })?;
    parse_metrics(&text).ok_or_else(|| {
        format!(
            "metrics of {} on {}: no flowlane_build_info (not flowlaned's metrics?)",
            node.daemon_pod, node.name
        )
    })
}

/// The pods this run created, deleted on every way out.
struct Created {
    pods: Api<Pod>,
    names: Vec<String>,
}

fn probe_pod(
    name: &str,
    node: &str,
    image: &str,
    role: &str,
    args: &[String],
) -> Result<Pod, String> {
    let mut command = vec![IMAGE_PROBE.to_string(), "cluster".into(), "probe".into()];
    command.extend(args.iter().cloned());
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {CHECK_LABEL: CHECK_LABEL_VALUE, "flowlane.io/check-role": role},
            // The shipped webhook injects a pod with this annotation in every
            // namespace it serves (docs/deploy.md, "Injection").
            "annotations": {INJECT_ANNOTATION: "true"}
        },
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "automountServiceAccountToken": false,
            "tolerations": [{"operator": "Exists"}],
            "containers": [{
                "name": "probe",
                "image": image,
                "command": command,
                "securityContext": {"allowPrivilegeEscalation": false}
            }]
        }
    }))
    .map_err(|e| format!("probe pod: {e}"))
}

fn phase(p: &Pod) -> &str {
    p.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

fn injected(p: &Pod) -> bool {
    p.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(INJECTED_ANNOTATION))
        .map(String::as_str)
        == Some("true")
}

/// Why a pod is still not running, from its container status.
fn waiting_reason(p: &Pod) -> String {
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.waiting.as_ref())
        .map(|w| {
            format!(
                "{}{}",
                w.reason.clone().unwrap_or_default(),
                w.message
                    .as_ref()
                    .map(|m| format!(": {m}"))
                    .unwrap_or_default()
            )
        })
        .unwrap_or_else(|| format!("phase {}", phase(p)))
}

impl Created {
    async fn create(&mut self, pod: &Pod) -> Result<Pod, String> {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let made = self
            .pods
            .create(&PostParams::default(), pod)
            .await
            .map_err(|e| api_error(&format!("create pod {name}"), e))?;
        self.names.push(name);
        Ok(made)
    }

    async fn get(&self, name: &str) -> Result<Pod, String> {
        self.pods
            .get(name)
            .await
            .map_err(|e| api_error(&format!("get pod {name}"), e))
    }

    /// Waits until `done` holds for the pod (or it ended), bounded.
    async fn wait(
        &self,
        name: &str,
        timeout: Duration,
        what: &str,
        done: impl Fn(&Pod) -> bool,
    ) -> Result<Pod, String> {
        let deadline = Instant::now() + timeout;
        loop {
            let p = self.get(name).await?;
            if done(&p) {
                return Ok(p);
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "pod {name} not {what} after {}s ({})",
                    timeout.as_secs(),
                    waiting_reason(&p)
                ));
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    async fn logs(&self, name: &str) -> String {
        self.pods
            .logs(name, &LogParams::default())
            .await
            .unwrap_or_else(|e| api_error("logs", e))
    }

    /// Deletes every pod it made and waits (bounded) until they are gone.
    async fn delete_all(&mut self, timeout: Duration, report: &mut KubeReport) {
        let dp = DeleteParams {
            grace_period_seconds: Some(1),
            ..DeleteParams::default()
        };
        for name in &self.names {
            match self.pods.delete(name, &dp).await {
                Ok(_) => {}
                Err(kube::Error::Api(r)) if r.code == 404 => {}
                Err(e) => report
                    .cleanup_errors
                    .push(api_error(&format!("delete pod {name}"), e)),
            }
        }
        let deadline = Instant::now() + timeout;
        for name in std::mem::take(&mut self.names) {
            loop {
                match self.pods.get_opt(&name).await {
                    Ok(None) => {
                        report.deleted.push(format!("pod {name}"));
                        break;
                    }
                    Ok(Some(_)) if Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(300)).await;
                    }
                    Ok(Some(_)) => {
                        report.cleanup_errors.push(format!(
                            "pod {name} still there after {}s",
                            timeout.as_secs()
                        ));
                        break;
                    }
                    Err(e) => {
                        report
                            .cleanup_errors
                            .push(api_error(&format!("get pod {name}"), e));
                        break;
                    }
                }
            }
        }
    }
}

struct Ctx<'a> {
    client: &'a Client,
    opts: &'a KubeCheckOpts,
    nodes: &'a BTreeMap<String, CheckNode>,
    view: &'a flowlane_nodes::ClusterView,
    image: String,
    run_id: String,
}

async fn scrape_all(ctx: &Ctx<'_>, nodes: &[&CheckNode]) -> Result<Vec<Scrape>, String> {
    let mut out = Vec::new();
    for n in nodes {
        out.push(scrape(ctx.client, &ctx.opts.flowlane_namespace, n).await?);
    }
    Ok(out)
}

async fn run_pair(
    ctx: &Ctx<'_>,
    created: &mut Created,
    kind: &str,
    client_node: &str,
    server_node: &str,
    port: u16,
) -> KubePair {
    let mut pair = KubePair {
        kind: kind.into(),
        client_node: client_node.into(),
        server_node: server_node.into(),
        client_pod: format!("flowlane-check-{}-{kind}-client", ctx.run_id),
        server_pod: format!("flowlane-check-{}-{kind}-server", ctx.run_id),
        bytes: ctx.opts.bytes,
        lane: "unknown".into(),
        ..KubePair::default()
    };
    if let Err(e) = pair_inner(ctx, created, &mut pair, port).await {
        pair.error = Some(e);
    }
    pair.ok = pair.error.is_none()
        && pair.bytes_ok
        && pair.lane != "unknown"
        && (pair.expected == "tcp" || pair.lane == pair.expected);
    pair
}

async fn pair_inner(
    ctx: &Ctx<'_>,
    created: &mut Created,
    pair: &mut KubePair,
    port: u16,
) -> Result<(), String> {
    let t = ctx.opts.timeout;
    let mut nodes = vec![&ctx.nodes[&pair.client_node]];
    if pair.server_node != pair.client_node {
        nodes.push(&ctx.nodes[&pair.server_node]);
    }
    let server = probe_pod(
        &pair.server_pod,
        &pair.server_node,
        &ctx.image,
        "server",
        &["serve".into(), port.to_string()],
    )?;
    let server = created.create(&server).await?;
    let server_name = pair.server_pod.clone();
    let started = created
        .wait(&server_name, t, "running", |p| {
            phase(p) != "Pending" && p.status.as_ref().and_then(|s| s.pod_ip.as_ref()).is_some()
        })
        .await?;
    if phase(&started) != "Running" {
        return Err(format!(
            "server pod {server_name} is {}: {}",
            phase(&started),
            created.logs(&server_name).await.trim()
        ));
    }
    let server_ip = started
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .unwrap_or_default();
    // The server prints `listening` once it accepts connections.
    let deadline = Instant::now() + t;
    loop {
        let log = created.logs(&server_name).await;
        if log.lines().any(|l| l == "listening") {
            break;
        }
        let p = created.get(&server_name).await?;
        if phase(&p) != "Running" || Instant::now() > deadline {
            return Err(format!(
                "server pod {server_name} ({}) never listened: {}",
                phase(&p),
                log.trim()
            ));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let before = scrape_all(ctx, &nodes).await?;
    let client = probe_pod(
        &pair.client_pod,
        &pair.client_node,
        &ctx.image,
        "client",
        &[
            "send".into(),
            format!("{server_ip}:{port}"),
            ctx.opts.bytes.to_string(),
        ],
    )?;
    let client = created.create(&client).await?;
    let both_injected = injected(&server) && injected(&client);
    let (expected, because) = if !both_injected {
        let not: Vec<&str> = [(&server, &pair.server_pod), (&client, &pair.client_pod)]
            .into_iter()
            .filter(|(p, _)| !injected(p))
            .map(|(_, n)| n.as_str())
            .collect();
        (
            "tcp",
            format!(
                "the webhook did not inject {} (no flowlane.io/injected)",
                not.join(", ")
            ),
        )
    } else if pair.client_node == pair.server_node {
        ("shm", "same node, both pods injected".to_string())
    } else {
        let (a, b) = (&pair.client_node, &pair.server_node);
        match (lane_published(ctx.view, a), lane_published(ctx.view, b)) {
            (true, true) if ctx.view.rdma_between(a, b) => {
                ("relay", format!("{a} and {b} both publish an RDMA lane"))
            }
            (true, true) => (
                "tcp",
                format!("{a} and {b} publish lanes of different link layers"),
            ),
            (false, _) => ("tcp", format!("{a} publishes no RDMA lane")),
            (_, false) => ("tcp", format!("{b} publishes no RDMA lane")),
        }
    };
    pair.expected = expected.into();
    pair.expected_because = because;
    pair.client_ip = client
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .unwrap_or_default();
    let client_name = pair.client_pod.clone();
    let ended = created
        .wait(&client_name, t, "finished", |p| {
            matches!(phase(p), "Succeeded" | "Failed")
        })
        .await?;
    pair.client_ip = ended
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .unwrap_or_default();
    let client_log = created.logs(&client_name).await;
    pair.bytes_ok = phase(&ended) == "Succeeded";
    if !pair.bytes_ok {
        pair.error = Some(format!(
            "client pod {client_name} {}: {}",
            phase(&ended),
            client_log.trim()
        ));
    }
    // The server answers and exits; its log names the peer it accepted.
    let _ = created
        .wait(
            &server_name,
            Duration::from_secs(10).min(t),
            "finished",
            |p| matches!(phase(p), "Succeeded" | "Failed"),
        )
        .await;
    pair.peer_seen = created
        .logs(&server_name)
        .await
        .lines()
        .find_map(|l| l.strip_prefix("peer "))
        .and_then(|p| p.rsplit_once(':'))
        .map(|(ip, _)| ip.trim_matches(['[', ']']).to_string());
    // The counters: the daemons count a connection's bytes when it ends
    // (and live, by ring positions); read again for a few seconds until the
    // lane the pair should have shows.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let after = scrape_all(ctx, &nodes).await?;
        let (lane, transport, lane_bytes, reasons) =
            lane_from_counters(&before, &after, ctx.opts.bytes);
        let settled = lane == pair.expected || pair.expected == "tcp";
        pair.lane = lane;
        pair.relay_transport = transport;
        pair.lane_bytes = lane_bytes;
        pair.tcp_reasons = reasons;
        if settled || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(())
}

/// Runs the check; the report says what happened, also when it could not
/// start (then `Err` with the reason, after cleaning up).
pub async fn run(opts: &KubeCheckOpts) -> Result<KubeReport, String> {
    let client = client(opts).await?;
    let (nodes, view) = check_nodes(&client, opts).await?;
    let (a, b) = pick(&nodes, &view, opts)?;
    let image = match &opts.image {
        Some(i) => i.clone(),
        None => nodes[&a]
            .image
            .clone()
            .ok_or_else(|| format!("the flowlane pod on {a} names no image: pass --image"))?,
    };
    let mut report = KubeReport {
        namespace: opts.namespace.clone(),
        node_a: a.clone(),
        node_b: b.clone(),
        image: image.clone(),
        ..KubeReport::default()
    };
    if b.is_none() {
        report
            .skipped
            .push("cross-node: only one Ready node runs a flowlane pod".into());
    }
    let namespaces = Api::<Namespace>::all(client.clone());
    let made_namespace = match namespaces.get_opt(&opts.namespace).await {
        Ok(Some(_)) => false,
        Ok(None) => {
            let ns: Namespace = serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": opts.namespace, "labels": {CHECK_LABEL: CHECK_LABEL_VALUE}}
            }))
            .map_err(|e| e.to_string())?;
            namespaces
                .create(&PostParams::default(), &ns)
                .await
                .map_err(|e| api_error(&format!("create namespace {}", opts.namespace), e))?;
            true
        }
        Err(e) => return Err(api_error(&format!("get namespace {}", opts.namespace), e)),
    };
    let run_id = format!(
        "{:x}",
        (std::process::id() as u64) << 16
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0)
                & 0xff_ffff
    );
    let mut created = Created {
        pods: Api::namespaced(client.clone(), &opts.namespace),
        names: Vec::new(),
    };
    let ctx = Ctx {
        client: &client,
        opts,
        nodes: &nodes,
        view: &view,
        image,
        run_id,
    };
    let pairs = async {
        let mut out = Vec::new();
        out.push(run_pair(&ctx, &mut created, "same-node", &a, &a, PORT).await);
        if let Some(b) = &b {
            out.push(run_pair(&ctx, &mut created, "cross-node", &a, b, PORT + 1).await);
        }
        out
    };
    let interrupted = tokio::select! {
        p = pairs => { report.pairs = p; false }
        _ = tokio::signal::ctrl_c() => true,
    };
    created.delete_all(opts.timeout, &mut report).await;
    if made_namespace {
        match namespaces
            .delete(&opts.namespace, &DeleteParams::default())
            .await
        {
            Ok(_) => report.deleted.push(format!("namespace {}", opts.namespace)),
            Err(e) => report.cleanup_errors.push(api_error(
                &format!("delete namespace {}", opts.namespace),
                e,
            )),
        }
    }
    if interrupted {
        return Err("interrupted (the probe pods were deleted)".into());
    }
    report.ok = !report.pairs.is_empty()
        && report.pairs.iter().all(|p| p.ok)
        && report.cleanup_errors.is_empty();
    Ok(report)
}

/// The table a person reads.
pub fn render(r: &KubeReport) -> String {
    let mut s = format!(
        "flowlane connectivity check: namespace {}, image {}\n{:<11} {:<32} {:<32} {:>8} {:<6} {:<9} {}\n",
        r.namespace, r.image, "PAIR", "CLIENT (NODE)", "SERVER (NODE)", "MiB", "LANE", "EXPECTED", "RESULT"
    );
    for p in &r.pairs {
        let lane = match &p.relay_transport {
            Some(t) if t != "relay" => format!("relay/{t}"),
            _ => p.lane.clone(),
        };
        s.push_str(&format!(
            "{:<11} {:<32} {:<32} {:>8} {:<6} {:<9} {}\n",
            p.kind,
            format!("{} ({})", p.client_pod, p.client_node),
            format!("{} ({})", p.server_pod, p.server_node),
            p.bytes >> 20,
            lane,
            p.expected,
            if p.ok { "ok" } else { "FAILED" }
        ));
        s.push_str(&format!(
            "            expected {}: {}\n",
            p.expected, p.expected_because
        ));
        if p.lane == "tcp" {
            let reasons: Vec<String> = p
                .tcp_reasons
                .iter()
                .map(|(k, n)| format!("{k} x{n}"))
                .collect();
            s.push_str(&format!(
                "            stayed on TCP; fallbacks counted: {}\n",
                if reasons.is_empty() {
                    "none".into()
                } else {
                    reasons.join(", ")
                }
            ));
        }
        if let (Some(seen), false) = (&p.peer_seen, p.client_ip.is_empty()) {
            if *seen != p.client_ip {
                s.push_str(&format!(
                    "            the server saw {seen}, not the client pod's {} (NAT between pods)\n",
                    p.client_ip
                ));
            }
        }
        if let Some(e) = &p.error {
            s.push_str(&format!("            {e}\n"));
        }
    }
    for k in &r.skipped {
        s.push_str(&format!("skipped: {k}\n"));
    }
    for e in &r.cleanup_errors {
        s.push_str(&format!("cleanup: {e}\n"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRAPE: &str = r#"# HELP flowlane_build_info Build.
# TYPE flowlane_build_info gauge
flowlane_build_info{version="0.1.0",protocol="3"} 1
# TYPE flowlane_connections_opened counter
flowlane_connections_opened_total{lane="shm"} 4
flowlane_connections_opened_total{lane="relay"} 2
# TYPE flowlane_bytes counter
flowlane_bytes_total{lane="shm",direction="client_to_server"} 9000000
flowlane_bytes_total{lane="shm",direction="server_to_client"} 17
flowlane_bytes_total{lane="relay",direction="client_to_server"} 100
# TYPE flowlane_fallbacks counter
flowlane_fallbacks_total{reason="no-listener"} 3
flowlane_fallbacks_total{reason="a \"quoted\", odd"} 1
# EOF
"#;

    #[test]
    fn parses_the_daemon_scrape() {
        let s = parse_metrics(SCRAPE).unwrap();
        assert_eq!(s.opened.get("shm"), Some(&4.0));
        assert_eq!(s.bytes_c2s.get("shm"), Some(&9_000_000.0));
        assert_eq!(s.bytes_c2s.get("relay"), Some(&100.0));
        assert_eq!(s.fallbacks.get("a \"quoted\", odd"), Some(&1.0));
        assert!(parse_metrics("up 1\n").is_none(), "not flowlaned's");
    }

    #[test]
    fn the_lane_is_the_one_that_counted_the_bytes() {
        let before = parse_metrics(SCRAPE).unwrap();
        let mut after = before.clone();
        *after.opened.get_mut("relay").unwrap() += 1.0;
        *after.bytes_c2s.get_mut("relay").unwrap() += 8.0 * 1048576.0;
        // another pod's shm connection meanwhile: opened, but few bytes
        *after.opened.get_mut("shm").unwrap() += 1.0;
        *after.bytes_c2s.get_mut("shm").unwrap() += 10.0;
        let (lane, t, n, _) = lane_from_counters(std::slice::from_ref(&before), &[after], 8 << 20);
        assert_eq!(
            (lane.as_str(), t.as_deref(), n),
            ("relay", Some("relay"), 8 << 20)
        );

        let mut after = before.clone();
        *after.fallbacks.entry("not-local-pod".into()).or_default() += 1.0;
        let (lane, _, _, reasons) = lane_from_counters(&[before], &[after], 8 << 20);
        assert_eq!(lane, "tcp");
        assert_eq!(reasons.get("not-local-pod"), Some(&1));
    }
}
