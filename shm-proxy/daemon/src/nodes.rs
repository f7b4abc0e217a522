//! The cross-node view inside `flowlaned`: which node owns a pod IP, where
//! that node's daemon is reached, and whether it offers an RDMA lane.
//!
//! - The node table comes from `flowlane_rdma::topology`: the local
//!   cluster's static file (`--nodes-file`, [`StaticNodeFile`]) or the
//!   Kubernetes API (`--kubernetes`, [`KubeNodeDirectory`]: `Node.spec.podCIDRs`
//!   plus the `flowlane.io/rdma-lane` annotation each daemon publishes).
//! - This node is the table's entry named `--node-name` (env `NODE_NAME`,
//!   which the DaemonSet fills from the downward API's `spec.nodeName`).
//! - A refresher task, at start and every `--nodes-refresh` seconds, re-lists
//!   the Nodes (Kubernetes), runs RDMA discovery on `--sysfs-root` and selects
//!   the GID for this node's address, publishes this node's lane on its Node
//!   when it differs from what the API shows (Kubernetes), and writes what it
//!   sees to `<state-dir>/daemon/nodes.json` for people and tools. Between
//!   rounds it re-reads the RDMA devices' port states and verbs nodes every
//!   `--rdma-poll` seconds (a few small sysfs files) and runs a round at once
//!   when they change: a port that goes down, a device being removed or
//!   re-added changes this node's lane within seconds, not at the next round.
//! - [`Nodes::route_for`] is the query the daemon makes per connection: it
//!   reads an in-memory snapshot and never waits on the network. A failed
//!   refresh keeps the last good table (a flaky API server must not make every
//!   peer look unknown) and is retried at the next tick.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;

use flowlane_rdma::topology::kubernetes::{self, KubeNodeDirectory};
use flowlane_rdma::topology::{
    ClusterView, LocalRdma, NodeDirectory, NodeEntry, NodeViewFile, RdmaLane, StaticNodeFile,
};
use flowlane_rdma::{discover, select_gid, NodeAddress, Sysfs};

/// The daemon's flags for the cross-node view.
#[derive(Debug, clap::Args)]
pub struct Flags {
    /// This node's name in the node table; default: env NODE_NAME (in
    /// Kubernetes, `spec.nodeName` from the downward API).
    #[arg(long)]
    pub node_name: Option<String>,
    // `--nodes-file` (the local cluster's static table) is declared in
    // main.rs, which the relay shares; `start` takes it as a parameter.
    /// Read the node table from the Kubernetes API (KUBECONFIG, else the
    /// in-cluster service account) and publish this node's RDMA lane on its
    /// Node (annotation flowlane.io/rdma-lane). Excludes --nodes-file.
    #[arg(long, conflicts_with = "nodes_file")]
    pub kubernetes: bool,
    /// Where sysfs is mounted (RDMA discovery reads class/infiniband and class/net).
    #[arg(long, default_value = flowlane_defaults::SYSFS)]
    pub sysfs_root: PathBuf,
    /// Seconds between refreshes of the node table, RDMA discovery and publishing.
    #[arg(long, default_value_t = 30.0)]
    pub nodes_refresh: f64,
    /// Seconds between checks of this node's RDMA port states and verbs
    /// nodes (sysfs); a change runs a refresh at once.
    #[arg(long, default_value_t = 2.0)]
    pub rdma_poll: f64,
}

impl Flags {
    /// Checks the flags without starting anything: a source of the node
    /// table needs this node's name, intervals must be positive.
    pub fn check(&self, nodes_file: Option<&Path>) -> anyhow::Result<()> {
        if nodes_file.is_some() && self.kubernetes {
            anyhow::bail!("--nodes-file and --kubernetes exclude each other");
        }
        if !(self.nodes_refresh.is_finite() && self.nodes_refresh > 0.0) {
            anyhow::bail!("--nodes-refresh must be a positive number of seconds");
        }
        if !(self.rdma_poll.is_finite() && self.rdma_poll > 0.0) {
            anyhow::bail!("--rdma-poll must be a positive number of seconds");
        }
        if (nodes_file.is_some() || self.kubernetes) && self.node_name().is_none() {
            anyhow::bail!("--nodes-file/--kubernetes need this node's name: --node-name NAME or env NODE_NAME (downward API spec.nodeName)");
        }
        Ok(())
    }

    /// `--node-name`, else env `NODE_NAME`; never empty.
    fn node_name(&self) -> Option<String> {
        self.node_name
            .clone()
            .or_else(|| std::env::var("NODE_NAME").ok())
            .filter(|n| !n.is_empty())
    }
}

/// Where the node table comes from.
#[derive(Debug, Clone)]
enum Source {
    File(PathBuf),
    Kubernetes,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::File(p) => write!(f, "file {}", p.display()),
            Source::Kubernetes => f.write_str("kubernetes"),
        }
    }
}

/// Where a connection to a pod IP goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    /// A pod CIDR of this node.
    Local,
    /// A pod CIDR of another node.
    Remote(RemoteNode),
    /// No node owns the IP (a Service IP, outside the cluster, or a node
    /// the table does not list yet): TCP.
    Unknown,
}

/// The node owning a remote pod IP, and how its daemon is reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteNode {
    pub node: String,
    pub underlay: IpAddr,
    /// Where its daemon accepts lane streams; `None`: it offers none.
    pub lane_port: Option<u16>,
    /// Its RDMA lane, `None` when it has none.
    pub rdma: Option<RdmaLane>,
}

impl RemoteNode {
    /// `underlay:lane_port`, when the node offers a lane port.
    pub fn lane_addr(&self) -> Option<SocketAddr> {
        self.lane_port.map(|p| SocketAddr::new(self.underlay, p))
    }
}

/// The cross-node view, shared by the daemon's tasks.
pub struct Nodes {
    node_name: String,
    source: Source,
    directory: Arc<dyn NodeDirectory>,
    local: RwLock<LocalRdma>,
    /// The last round's view, as `<state-dir>/daemon/nodes.json` holds it
    /// (for stats answers: `flowlane status --json`).
    last_view: RwLock<serde_json::Value>,
    /// Where this daemon accepts lane streams (published in Kubernetes
    /// with the lane); 0: nowhere.
    lane_port: AtomicU32,
    /// Runs a round now (instead of at the next tick).
    wake: tokio::sync::Notify,
    /// Each round's table, when it could be read (pod routes follow it).
    views: tokio::sync::watch::Sender<Option<Arc<ClusterView>>>,
}

impl Nodes {
    /// Where a connection to `ip` goes. In-memory only.
    pub fn route_for(&self, ip: IpAddr) -> Destination {
        match self.directory.view() {
            Ok(view) => route_in(&view, &self.node_name, ip),
            Err(e) => {
                tracing::debug!(error = %e, "node table unavailable");
                Destination::Unknown
            }
        }
    }

    /// Whether `ip` is the underlay address of a node of the table (who may
    /// connect to the lane port). In-memory only.
    pub fn is_node_address(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.directory
            .view()
            .is_ok_and(|v| v.nodes().iter().any(|n| n.underlay.to_canonical() == ip))
    }

    /// Whether `pod_ip` belongs to a pod CIDR of another node whose
    /// underlay address is `underlay` (a stream from that node's daemon may
    /// carry that pod's connections, and no other's). In-memory only.
    pub fn is_pod_of_node_at(&self, underlay: IpAddr, pod_ip: IpAddr) -> bool {
        match self.route_for(pod_ip.to_canonical()) {
            Destination::Remote(n) => n.underlay.to_canonical() == underlay.to_canonical(),
            _ => false,
        }
    }

    /// This node's RDMA lane as discovery found it at the last refresh
    /// (the GID selected for this node's address), `None` without one.
    pub fn local_rdma(&self) -> Option<RdmaLane> {
        self.local
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .lane
            .clone()
    }

    /// Sets where this daemon accepts lane streams (`None`: its relay is
    /// off, so it must not offer a lane port) and runs a round at once, so
    /// that Kubernetes sees the change without waiting for the next one.
    pub fn set_lane_port(&self, port: Option<u16>) {
        let old = self
            .lane_port
            .swap(port.map_or(0, u32::from), Ordering::Relaxed);
        if old != port.map_or(0, u32::from) {
            self.wake.notify_one();
        }
    }

    fn lane_port(&self) -> Option<u16> {
        match self.lane_port.load(Ordering::Relaxed) {
            0 => None,
            p => u16::try_from(p).ok(),
        }
    }

    /// Why this node has no RDMA lane (discovery's reason), when it has none.
    pub fn local_rdma_reason(&self) -> Option<String> {
        self.local
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .no_lane
            .clone()
    }

    /// The node table as it is now (`None` when it cannot be read).
    pub fn current_view(&self) -> Option<Arc<ClusterView>> {
        self.directory.view().ok()
    }

    /// This node's name in the table.
    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    /// Each round's table (`None` before the first readable one).
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<Option<Arc<ClusterView>>> {
        self.views.subscribe()
    }

    /// The last round's view (JSON, as in `<state-dir>/daemon/nodes.json`);
    /// `null` before the first round.
    /// Whether a node table was loaded (`/readyz`).
    pub fn view_loaded(&self) -> bool {
        self.directory.view().is_ok()
    }

    pub fn view_json(&self) -> serde_json::Value {
        self.last_view
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// [`Nodes::route_for`] on one snapshot. This node is found by name, not
/// by address: two nodes may share an underlay address in odd setups, a
/// name is unique in the table.
fn route_in(view: &ClusterView, me: &str, ip: IpAddr) -> Destination {
    match view.owner_of(ip.to_canonical()) {
        None => Destination::Unknown,
        Some(n) if n.name == me => Destination::Local,
        Some(n) => Destination::Remote(RemoteNode {
            node: n.name.clone(),
            underlay: n.underlay,
            lane_port: n.lane_port,
            rdma: n.rdma.clone(),
        }),
    }
}

/// How long `start` waits for the first round (list, discovery, publish).
const FIRST_ROUND_LIMIT: Duration = Duration::from_secs(10);

/// Builds the view from the flags and starts its refresher on the current
/// tokio runtime. `None` when neither `--nodes-file` nor `--kubernetes` is
/// given (a node on its own: every other IP is unknown).
/// `lane_port`: where this daemon accepts lane streams (published in
/// Kubernetes; in the local cluster the static file says it).
pub async fn start(
    flags: &Flags,
    nodes_file: Option<&Path>,
    state_dir: &Path,
    lane_port: Option<u16>,
) -> anyhow::Result<Option<Arc<Nodes>>> {
    flags.check(nodes_file)?;
    let source = match (nodes_file, flags.kubernetes) {
        (Some(p), _) => Source::File(p.to_path_buf()),
        (None, true) => Source::Kubernetes,
        (None, false) => return Ok(None),
    };
    let node_name = flags.node_name().context("node name")?;
    let (directory, kube): (Arc<dyn NodeDirectory>, _) = match &source {
        Source::File(p) => (Arc::new(StaticNodeFile::new(p)), None),
        Source::Kubernetes => {
            let client = kubernetes::client_from_environment().await?;
            let dir = KubeNodeDirectory::unlisted(client);
            (dir.clone(), Some(dir))
        }
    };
    let nodes = Arc::new(Nodes {
        node_name,
        source,
        directory,
        local: RwLock::new(LocalRdma::default()),
        last_view: RwLock::new(serde_json::Value::Null),
        lane_port: AtomicU32::new(lane_port.map_or(0, u32::from)),
        wake: tokio::sync::Notify::new(),
        views: tokio::sync::watch::Sender::new(None),
    });
    tracing::info!(
        node = %nodes.node_name,
        source = %nodes.source,
        sysfs = %flags.sysfs_root.display(),
        "cross-node view enabled"
    );
    let mut refresher = Refresher {
        nodes: nodes.clone(),
        kube,
        sysfs_root: flags.sysfs_root.clone(),
        status_file: state_dir.join("daemon").join("nodes.json"),
        last_logged: None,
    };
    // The first round before the daemon serves, so that callers find this
    // node's discovery and (usually) the table at once; bounded, because a
    // hanging API server must not keep the node's pods from their daemon.
    if tokio::time::timeout(FIRST_ROUND_LIMIT, refresher.cycle())
        .await
        .is_err()
    {
        tracing::warn!(
            limit = ?FIRST_ROUND_LIMIT,
            "the first node table round did not finish in time; serving, retrying in the background"
        );
    }
    tokio::spawn(refresher.run(
        Duration::from_secs_f64(flags.nodes_refresh),
        Duration::from_secs_f64(flags.rdma_poll),
    ));
    Ok(Some(nodes))
}

/// The periodic work: node table, discovery, publishing, status file.
struct Refresher {
    nodes: Arc<Nodes>,
    kube: Option<Arc<KubeNodeDirectory>>,
    sysfs_root: PathBuf,
    status_file: PathBuf,
    /// The last discovery outcome logged (log changes, not every tick).
    last_logged: Option<LocalRdma>,
}

impl Refresher {
    async fn run(mut self, every: Duration, poll: Duration) {
        // `start` did the first round; the next one is a period later.
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut poll_tick = tokio::time::interval(poll);
        poll_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut seen = self.fingerprint().await;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = self.nodes.wake.notified() => {}
                _ = poll_tick.tick() => {
                    let now = self.fingerprint().await;
                    if now == seen {
                        continue;
                    }
                    tracing::info!(before = %seen.trim(), now = %now.trim(), "RDMA devices or ports changed; refreshing this node's lane");
                }
            }
            seen = self.fingerprint().await;
            self.cycle().await;
        }
    }

    /// [`flowlane_rdma::discovery::lane_fingerprint`] off the runtime.
    async fn fingerprint(&self) -> String {
        let sysfs = Sysfs::new(&self.sysfs_root);
        tokio::task::spawn_blocking(move || flowlane_rdma::discovery::lane_fingerprint(&sysfs))
            .await
            .unwrap_or_default()
    }

    async fn cycle(&mut self) {
        let mut error = None;
        // 1. The node table. Kubernetes: re-list now; on failure keep the
        // last one (and do not publish against a stale picture).
        let fresh = match &self.kube {
            Some(k) => match k.refresh().await {
                Ok(_) => true,
                Err(e) => {
                    tracing::warn!(error = %e, "node table refresh failed; keeping the last one, retrying in the next round");
                    error = Some(e.to_string());
                    false
                }
            },
            None => true,
        };
        let view = match self.nodes.directory.view() {
            Ok(v) => {
                // Only a table this round read (not Kubernetes' empty one
                // before its first list, nor a stale one): pod routes must
                // not follow an API outage.
                if fresh {
                    self.nodes.views.send_replace(Some(v.clone()));
                }
                v
            }
            Err(e) => {
                tracing::warn!(error = %e, "node table unreadable; peers are unknown until it is fixed");
                error.get_or_insert(e.to_string());
                Arc::new(ClusterView::default())
            }
        };
        let me = view.node(&self.nodes.node_name).cloned();

        // 2. RDMA discovery and GID selection for this node's address.
        let root = self.sysfs_root.clone();
        let address = me.as_ref().map(|m| m.underlay);
        let local = tokio::task::spawn_blocking(move || discover_local(&root, address))
            .await
            .unwrap_or_else(|e| LocalRdma {
                no_lane: Some(format!("discovery failed: {e}")),
                ..LocalRdma::default()
            });
        self.log_discovery(&local, me.as_ref());
        *self.nodes.local.write().unwrap_or_else(|p| p.into_inner()) = local.clone();

        // 3. Kubernetes: publish this node's lane when the API shows another.
        let publish = match (&self.kube, fresh, &me) {
            (None, _, _) => None,
            (Some(_), false, _) => Some("skipped: the node table is stale".to_string()),
            (Some(_), true, None) => Some(format!(
                "skipped: node {} is not in the node table (no pod CIDR or address yet, or a wrong --node-name)",
                self.nodes.node_name
            )),
            (Some(k), true, Some(me)) => Some(self.publish(k, me, &local).await.unwrap_or_else(
                |e| {
                    tracing::warn!(error = %e, "publishing the RDMA lane failed; retrying in the next round");
                    error.get_or_insert(e.to_string());
                    format!("failed: {e}")
                },
            )),
        };

        // 4. The status file.
        let status = NodeViewFile {
            node: self.nodes.node_name.clone(),
            source: self.nodes.source.to_string(),
            updated_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            listed: me.is_some(),
            lane_port: me
                .as_ref()
                .and_then(|m| m.lane_port)
                .or(self.nodes.lane_port()),
            rdma: local,
            publish,
            error,
            nodes: view.nodes().to_vec(),
        };
        let json = serde_json::to_value(&status).unwrap_or_default();
        *self
            .nodes
            .last_view
            .write()
            .unwrap_or_else(|p| p.into_inner()) = json;
        if let Err(e) = status.write(&self.status_file) {
            tracing::debug!(file = %self.status_file.display(), error = %e, "cannot write the node view");
        }
    }

    /// Sends the merge patch when the Node's annotation differs from what
    /// this node offers now. Returns what was done.
    async fn publish(
        &self,
        kube: &KubeNodeDirectory,
        me: &NodeEntry,
        local: &LocalRdma,
    ) -> Result<String, flowlane_rdma::topology::TopologyError> {
        let port = local.lane.as_ref().and(self.nodes.lane_port());
        if me.rdma == local.lane && me.lane_port == port {
            return Ok("unchanged".into());
        }
        kubernetes::publish_rdma_lane(
            kube.client(),
            &self.nodes.node_name,
            local.lane.as_ref(),
            port,
        )
        .await?;
        Ok(match &local.lane {
            Some(l) => {
                tracing::info!(node = %self.nodes.node_name, device = %l.device, gid = %l.gid, lane_port = ?port, "published this node's RDMA lane");
                "lane".into()
            }
            None => {
                tracing::info!(node = %self.nodes.node_name, reason = local.no_lane.as_deref().unwrap_or("-"), "removed this node's RDMA lane annotation (no usable GID)");
                "none".into()
            }
        })
    }

    /// Logs the discovery outcome when it changed since the last log.
    fn log_discovery(&mut self, local: &LocalRdma, me: Option<&NodeEntry>) {
        if self.last_logged.as_ref() == Some(local) {
            return;
        }
        match (&local.lane, &local.no_lane) {
            (Some(l), _) => tracing::info!(
                device = %l.device, port = l.port, gid_index = l.gid_index, gid = %l.gid,
                link_layer = %l.link_layer, "RDMA lane available on this node"
            ),
            (None, reason) => tracing::info!(
                reason = reason.as_deref().unwrap_or("-"),
                "no RDMA lane on this node: cross-node connections stay on TCP"
            ),
        }
        // The static table is written by hand or a script: say when it
        // disagrees with what this node has.
        if self.kube.is_none() {
            if let Some(me) = me {
                if me.rdma != local.lane {
                    tracing::warn!(
                        node = %me.name,
                        "the node table's RDMA lane for this node differs from what discovery finds; peers use the table's"
                    );
                }
            }
        }
        self.last_logged = Some(local.clone());
    }
}

/// Discovery plus GID selection for this node's underlay address.
fn discover_local(sysfs_root: &Path, address: Option<IpAddr>) -> LocalRdma {
    let inventory = match discover(&Sysfs::new(sysfs_root)) {
        Ok(inv) => inv,
        Err(e) => {
            return LocalRdma {
                no_lane: Some(format!("RDMA discovery failed: {e}")),
                ..LocalRdma::default()
            }
        }
    };
    let devices: Vec<String> = inventory.devices.iter().map(|d| d.name.clone()).collect();
    if address.is_none() && !devices.is_empty() {
        return LocalRdma {
            devices,
            lane: None,
            no_lane: Some(
                "this node is not in the node table (no pod CIDR or address yet, or another \
                 --node-name): its address, and so its GID, is unknown"
                    .into(),
            ),
        };
    }
    let addrs: Vec<NodeAddress> = address
        .map(|ip| NodeAddress {
            ip,
            netdev: netdev_holding(ip),
        })
        .into_iter()
        .collect();
    match select_gid(&inventory, &addrs) {
        Ok(g) => LocalRdma {
            devices,
            lane: Some(RdmaLane::from(&g)),
            no_lane: None,
        },
        Err(e) => LocalRdma {
            devices,
            lane: None,
            no_lane: Some(e.to_string()),
        },
    }
}

/// The interface that holds `ip` on this host, if any: then the GID must
/// be on that netdev (a GID on another interface would send from the
/// wrong one).
fn netdev_holding(ip: IpAddr) -> Option<String> {
    let addrs = nix::ifaddrs::getifaddrs().ok()?;
    for a in addrs {
        let Some(sa) = a.address else { continue };
        let got = if let Some(v4) = sa.as_sockaddr_in() {
            IpAddr::V4(v4.ip())
        } else if let Some(v6) = sa.as_sockaddr_in6() {
            IpAddr::V6(v6.ip())
        } else {
            continue;
        };
        if got == ip {
            return Some(a.interface_name);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use flowlane_rdma::LinkLayer;

    fn entry(name: &str, cidr: &str, underlay: &str, port: Option<u16>, rdma: bool) -> NodeEntry {
        NodeEntry {
            name: name.into(),
            pod_cidrs: vec![cidr.parse().unwrap()],
            underlay: underlay.parse().unwrap(),
            rdma: rdma.then(|| RdmaLane {
                device: "rxe0".into(),
                port: 1,
                gid_index: 1,
                gid: format!("::ffff:{underlay}").parse().unwrap(),
                link_layer: LinkLayer::Ethernet,
                active_mtu: Some(1024),
            }),
            lane_port: port,
        }
    }

    #[test]
    fn routes_are_local_remote_or_unknown() {
        let view = ClusterView::new(vec![
            entry("n1", "10.172.1.0/24", "10.172.0.1", Some(7471), true),
            entry("n2", "10.172.2.0/24", "10.172.0.2", Some(7472), true),
            entry("n3", "10.172.3.0/24", "10.172.0.3", None, false),
        ])
        .unwrap();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(route_in(&view, "n1", ip("10.172.1.9")), Destination::Local);
        assert_eq!(
            route_in(&view, "n1", ip("::ffff:10.172.1.9")),
            Destination::Local,
            "IPv4-mapped from a dual-stack socket"
        );
        let Destination::Remote(r) = route_in(&view, "n1", ip("10.172.2.9")) else {
            panic!("n2's pod is remote")
        };
        assert_eq!(r.node, "n2");
        assert_eq!(r.lane_addr(), Some("10.172.0.2:7472".parse().unwrap()));
        assert!(r.rdma.is_some());
        let Destination::Remote(r) = route_in(&view, "n1", ip("10.172.3.9")) else {
            panic!("n3's pod is remote")
        };
        assert_eq!((r.lane_addr(), r.rdma), (None, None));
        assert_eq!(route_in(&view, "n1", ip("10.96.0.1")), Destination::Unknown);
        // Seen from n2, n1's pods are remote.
        assert!(matches!(
            route_in(&view, "n2", ip("10.172.1.9")),
            Destination::Remote(RemoteNode { ref node, .. }) if node == "n1"
        ));
    }

    fn fixture(tree: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../rdma/tests/fixtures")
            .join(tree)
    }

    #[test]
    fn discovery_selects_the_gid_of_the_node_address_or_says_why_not() {
        let got = discover_local(&fixture("rxe"), Some("192.0.2.1".parse().unwrap()));
        assert_eq!(got.devices, vec!["rxe0".to_string()]);
        let lane = got.lane.expect("rxe0 holds ::ffff:192.0.2.1 as RoCE v2");
        assert_eq!((lane.device.as_str(), lane.gid_index), ("rxe0", 1));
        assert_eq!(got.no_lane, None);

        let got = discover_local(&fixture("rxe"), Some("198.51.100.7".parse().unwrap()));
        assert!(got.lane.is_none());
        assert!(got.no_lane.unwrap().contains("198.51.100.7"));

        let got = discover_local(&fixture("rxe"), None);
        assert!(got.lane.is_none());
        assert!(
            got.no_lane.unwrap().contains("not in the node table"),
            "no address: says why"
        );

        let empty = std::env::temp_dir().join(format!("fl-kb-sysfs-{}", std::process::id()));
        std::fs::create_dir_all(&empty).unwrap();
        let got = discover_local(&empty, Some("192.0.2.1".parse().unwrap()));
        assert!(got.devices.is_empty() && got.lane.is_none());
        assert!(got.no_lane.is_some());
        std::fs::remove_dir_all(&empty).unwrap();
    }
}
