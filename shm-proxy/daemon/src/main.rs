//! `flowlaned`: the node daemon of flowlane.
//!
//! It knows the node's pods (from the pod registry the CNI plugin writes),
//! authenticates every client by its network namespace, and brokers
//! shared-memory channels between co-located pods: one sealed memfd per TCP
//! connection, handed to both ends with SCM_RIGHTS. The bytes then flow ring
//! to ring without the daemon; it only keeps counters.

mod broker;
mod channel_store;
mod conntrack;
mod counters;
mod identity;
mod injections;
mod listener_store;
mod memfd;
mod metrics;
mod nodes;
mod peer_table;
mod pod_routes;
mod pods;
mod processes;
mod rdma_lane;
mod relay;
mod ring_watch;
mod server;
mod sockets;
mod stats;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;

use broker::{Broker, DaemonFacts, Limits};

#[derive(Debug, Parser)]
#[command(
    name = "flowlaned",
    version,
    about = "flowlane node daemon: pod registry, shared-memory channel broker"
)]
struct Args {
    /// Node state directory (holds the pod registry).
    #[arg(long, default_value = flowlane_defaults::STATE_DIR)]
    state_dir: PathBuf,
    /// Unix socket clients connect to.
    #[arg(long, default_value = flowlane_defaults::DAEMON_SOCKET)]
    socket: PathBuf,
    /// Log filter (e.g. info, debug, flowlaned=trace); else env FLOWLANE_LOG; else info.
    #[arg(long)]
    log_level: Option<String>,
    /// Seconds an announced channel waits for the server's claim.
    #[arg(long, default_value_t = 30.0)]
    intent_timeout: f64,
    /// Serve Prometheus metrics over HTTP on this address (e.g. 127.0.0.1:9464).
    #[arg(long)]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Largest channel region (bytes) a client may request.
    #[arg(long, default_value_t = (64 << 20) + 4096)]
    max_region: u64,
    /// Carry connections to pods on other nodes over a lane between the
    /// daemons, accepting peer daemons' streams on this address (this
    /// node's underlay IP and the lane port). Without it nothing changes.
    #[arg(long)]
    lane_listen: Option<std::net::SocketAddr>,
    /// The lane's transport: `rdma` (the default), `tcp-test` (one TCP
    /// connection per stream: a test double for hosts without RDMA, never
    /// a default), or `off` (no relay even with --lane-listen: a
    /// cluster-wide opt-out that keeps the flags as they are).
    #[arg(long, default_value = "rdma")]
    lane_transport: String,
    /// The cluster's shared lane key (a file of at least 32 bytes, mode
    /// 0400/0600, e.g. a mounted Kubernetes Secret): only daemons that prove
    /// it (and connect from a node of the node table) may open lane
    /// streams. Required with --lane-listen (docs/security.md).
    #[arg(long)]
    lane_key_file: Option<PathBuf>,
    /// The cluster's node table (JSON: nodes with podCIDRs, underlay,
    /// lanePort, rdma); says which node owns a pod IP.
    #[arg(long)]
    nodes_file: Option<PathBuf>,
    /// The cross-node view (`nodes.rs`): --node-name, --kubernetes, --sysfs-root, --nodes-refresh.
    #[command(flatten)]
    nodes: nodes::Flags,
    /// Members of this group (primary or supplementary), in the node's
    /// network namespace, may ask for node-wide answers (`flowlane status`,
    /// diag, the registry poke) without being root.
    #[arg(long)]
    admin_gid: Option<u32>,
    /// Cross-node pod routes and masquerade exemptions from the node table:
    /// `auto` (per peer: host-gw on a shared link, else vxlan), `host-gw`,
    /// `vxlan`, or `off` (no routes; the exemptions stay). Needs
    /// CAP_NET_ADMIN. See docs/daemon.md "Pod routes".
    #[arg(long, default_value = "auto")]
    pod_routes: pod_routes::Mode,
    /// Remove this node's pod routes, the VXLAN device and the masquerade
    /// exemptions flowlaned made, then exit (uninstall).
    #[arg(long)]
    remove_pod_routes: bool,
    /// Most bytes the relay may hold for relayed connections at once (about
    /// 8 MiB each with zero copy); beyond it connections stay on TCP
    /// (`relay-budget`). Default: the container's memory limit less 128 MiB.
    #[arg(long)]
    relay_memory_budget: Option<u64>,
    /// Seconds between two scans of the pods' processes (which run the
    /// preload library, which cannot use the lane and why: `flowlane
    /// status`); a status request also asks for a scan when the last is
    /// more than a second old. 0: no scan.
    #[arg(long, default_value_t = 10.0)]
    process_scan_interval: f64,
    /// The cluster's Service CIDR (repeatable, e.g. 10.96.0.0/12):
    /// connections to a Service IP get the lane of the backend kube-proxy
    /// sent them to, read from the node's conntrack table (needs
    /// CAP_NET_ADMIN in the node's network namespace). Without it Service
    /// connections stay on TCP. See docs/daemon.md "Service IPs".
    #[arg(long, value_parser = parse_cidr, value_delimiter = ',')]
    service_cidr: Vec<flowlane_lane::peer_table::Entry>,
    /// Check the flags (as the daemon would at start) and exit: 0 and a
    /// summary on stdout when they are valid, else 2 and the reason.
    #[arg(long)]
    check_config: bool,
}

/// `ADDRESS/PREFIX`, IPv4 or IPv6, with no host bits set.
fn parse_cidr(s: &str) -> Result<flowlane_lane::peer_table::Entry, String> {
    let (ip, prefix) = s
        .split_once('/')
        .ok_or_else(|| format!("{s}: not ADDRESS/PREFIX"))?;
    let ip: std::net::IpAddr = ip.parse().map_err(|e| format!("{s}: {e}"))?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    let prefix: u8 = prefix
        .parse()
        .ok()
        .filter(|p| *p <= max)
        .ok_or_else(|| format!("{s}: prefix must be 0..={max}"))?;
    let entry = flowlane_lane::peer_table::Entry::new(ip, prefix);
    if entry.addr != flowlane_lane::peer_table::Entry::host(ip).addr {
        return Err(format!("{s}: host bits set"));
    }
    Ok(entry)
}

/// The transports `--lane-transport` accepts (`tcp-test` only in a build
/// with the `test-transport` feature).
#[cfg(feature = "test-transport")]
const LANE_TRANSPORTS: [&str; 3] = ["tcp-test", "rdma", "off"];
#[cfg(not(feature = "test-transport"))]
const LANE_TRANSPORTS: [&str; 2] = ["rdma", "off"];

impl Args {
    /// Where the relay listens, when it is on.
    fn relay_listen(&self) -> Option<std::net::SocketAddr> {
        self.lane_listen.filter(|_| self.lane_transport != "off")
    }

    /// Everything that can be checked without starting anything.
    fn check(&self) -> anyhow::Result<()> {
        if !(self.intent_timeout.is_finite() && self.intent_timeout > 0.0) {
            anyhow::bail!("--intent-timeout must be a positive number of seconds");
        }
        if cfg!(not(feature = "test-transport")) && self.lane_transport == "tcp-test" {
            anyhow::bail!(
                "--lane-transport tcp-test: this flowlaned was built without the test transport \
                 (cargo feature `test-transport`; tests/run builds with it, the image does not)"
            );
        }
        if !LANE_TRANSPORTS.contains(&self.lane_transport.as_str()) {
            anyhow::bail!(
                "--lane-transport {}: unknown ({})",
                self.lane_transport,
                LANE_TRANSPORTS.join(", ")
            );
        }
        if !(self.process_scan_interval.is_finite() && self.process_scan_interval >= 0.0) {
            anyhow::bail!("--process-scan-interval must be a number of seconds, 0 for no scan");
        }
        self.nodes.check(self.nodes_file.as_deref())?;
        if self.relay_listen().is_some() && self.nodes_file.is_none() && !self.nodes.kubernetes {
            anyhow::bail!("--lane-listen needs the cross-node view (--nodes-file or --kubernetes, and --node-name)");
        }
        if self.relay_listen().is_some() && self.lane_key_file.is_none() {
            anyhow::bail!("--lane-listen needs --lane-key-file: the cluster's shared lane key, without which any host reaching the lane port could pose as a node (see docs/security.md; in Kubernetes the Secret flowlane-lane-key, deploy/kubernetes/lane-key.sh)");
        }
        Ok(())
    }

    /// The lane key, when the relay is on (checked: see `LaneKey::from_file`).
    fn lane_key(&self) -> anyhow::Result<Option<flowlane_rdma::LaneKey>> {
        match (&self.lane_key_file, self.relay_listen()) {
            (Some(p), Some(_)) => Ok(Some(flowlane_rdma::LaneKey::from_file(p)?)),
            _ => Ok(None),
        }
    }
}

fn init_logging(level: Option<&str>) {
    let filter = level
        .map(str::to_string)
        .or_else(|| std::env::var("FLOWLANE_LOG").ok())
        .unwrap_or_else(|| "info".to_string());
    let filter = tracing_subscriber::EnvFilter::try_new(&filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

/// Lets the daemon serve many clients: raise the soft fd limit to the hard one.
fn raise_fd_limit() {
    // SAFETY: getrlimit/setrlimit with a valid, initialised struct.
    unsafe {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

async fn shutdown_signal() -> anyhow::Result<&'static str> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    })
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.remove_pod_routes {
        init_logging(args.log_level.as_deref());
        let r = pod_routes::remove_all()?;
        println!(
            "flowlaned: removed {} pod routes, {} VXLAN device, {} masquerade exemptions",
            r.routes,
            u8::from(r.vxlan),
            r.exemptions
        );
        return Ok(());
    }
    if args.check_config {
        if let Err(e) = args.check() {
            eprintln!("flowlaned: {e:#}");
            std::process::exit(2);
        }
        // The key is read only where it exists: --check-config also runs
        // away from the node (the manifests' tests), where the Secret is not.
        let key = match &args.lane_key_file {
            Some(p) if args.relay_listen().is_some() && p.exists() => match args.lane_key() {
                Ok(_) => format!(", lane key {} ok", p.display()),
                Err(e) => {
                    eprintln!("flowlaned: {e:#}");
                    std::process::exit(2);
                }
            },
            Some(p) if args.relay_listen().is_some() => {
                format!(", lane key {} (not here; read at start)", p.display())
            }
            _ => String::new(),
        };
        println!(
            "flowlaned: configuration ok (relay: {}, node table: {}{key})",
            args.relay_listen()
                .map(|a| format!("{} on {a}", args.lane_transport))
                .unwrap_or_else(|| "off".into()),
            match (&args.nodes_file, args.nodes.kubernetes) {
                (Some(p), _) => format!("file {}", p.display()),
                (None, true) => "kubernetes".into(),
                (None, false) => "none".into(),
            }
        );
        return Ok(());
    }
    init_logging(args.log_level.as_deref());
    raise_fd_limit();
    args.check()?;
    // A bad key file stops the daemon before it serves anything.
    args.lane_key()?;
    let limits = Limits {
        intent_ttl: Duration::from_secs_f64(args.intent_timeout),
        max_region: args.max_region,
        ..Limits::default()
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    rt.block_on(run(args, limits))
}

/// The cross-node relay, when `--lane-listen` asks for it.
fn start_relay(
    args: &Args,
    shared: &server::Shared,
    nodes: Option<std::sync::Arc<nodes::Nodes>>,
) -> anyhow::Result<Option<std::sync::Arc<relay::Relay>>> {
    use std::sync::Arc;
    let Some(listen) = args.relay_listen() else {
        if args.lane_listen.is_some() {
            tracing::info!(
                "--lane-transport off: no cross-node relay; cross-node connections stay on TCP"
            );
        }
        return Ok(None);
    };
    let Some(nodes) = nodes else {
        anyhow::bail!("--lane-listen needs the cross-node view (--nodes-file or --kubernetes, and --node-name)");
    };
    // No key, no relay: the daemon does not start (a lane port that any
    // host could pose as a node on is worse than none).
    let key = args
        .lane_key()?
        .context("--lane-listen needs --lane-key-file")?;
    let auth = {
        let nodes = nodes.clone();
        flowlane_rdma::LaneAuth::new(
            key,
            Arc::new(move |ip: std::net::IpAddr| nodes.is_node_address(ip)),
        )
    };
    let transport: Arc<dyn flowlane_rdma::LaneTransport> = match args.lane_transport.as_str() {
        #[cfg(feature = "test-transport")]
        "tcp-test" => {
            tracing::warn!("--lane-transport tcp-test: the test transport (one TCP connection per stream), not for production");
            Arc::new(
                relay::tcp_test::TcpTestTransport::bind(listen, auth)
                    .with_context(|| format!("listening for lane streams on {listen}"))?,
            )
        }
        // Follows this node's lane (rdma_lane.rs): a node without a usable
        // RDMA port keeps its daemon (the shm lane, counters, diag), its
        // pods' cross-node connections stay on TCP (the reason is logged),
        // and the lane opens when a port comes up; a port that goes down or
        // a device being removed closes it.
        "rdma" => rdma_lane::SupervisedRdma::start(nodes.clone(), listen, auth).0,
        other => anyhow::bail!(
            "--lane-transport {other}: unknown ({})",
            LANE_TRANSPORTS.join(", ")
        ),
    };
    let router = relay::route::Router::new(nodes, transport.name() == "rdma");
    let name = transport.name();
    let budget = args
        .relay_memory_budget
        .unwrap_or_else(relay::budget::default_budget);
    let relay = relay::Relay::start(transport, router, shared.clone(), budget);
    // A Service's backend may now be a pod of another node.
    shared.lock().set_remote_service_backends();
    tracing::info!(%listen, transport = name, "cross-node relay enabled");
    Ok(Some(relay))
}

/// Connections to Service IPs, when `--service-cidr` names them: the
/// broker resolves them through the kernel's conntrack table. The ranges
/// the peer table lists (none when conntrack cannot be opened: Service
/// connections then stay on TCP without asking).
fn start_services(args: &Args, shared: &server::Shared) -> Vec<flowlane_lane::peer_table::Entry> {
    if args.service_cidr.is_empty() {
        return Vec::new();
    }
    match conntrack::Kernel::open() {
        Ok(ct) => {
            shared
                .lock()
                .set_services(args.service_cidr.clone(), Box::new(ct));
            tracing::info!(ranges = ?args.service_cidr, "Service IPs resolved through conntrack");
            args.service_cidr.clone()
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot open the conntrack table (ctnetlink); Service connections stay on TCP");
            Vec::new()
        }
    }
}

async fn run(args: Args, limits: Limits) -> anyhow::Result<()> {
    let facts = DaemonFacts {
        state_dir: args.state_dir.clone(),
        socket: args.socket.clone(),
    };
    let kernel = Box::new(broker::RealKernel::new(&facts.state_dir));
    let shared = server::Shared::new(Broker::new(facts, limits, kernel));
    shared.lock().set_admin_gid(args.admin_gid);
    // Signals first, so a SIGTERM right after start is handled gracefully.
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        match shutdown_signal().await {
            Ok(sig) => tracing::info!(signal = sig, "shutting down"),
            Err(e) => tracing::error!(error = %e, "cannot watch signals"),
        }
        let _ = stop_tx.send(());
    });
    // The cross-node view: which node owns a pod IP (and, in Kubernetes,
    // publishing this node's RDMA lane).
    let nodes = nodes::start(
        &args.nodes,
        args.nodes_file.as_deref(),
        &args.state_dir,
        args.relay_listen().map(|a| a.port()),
    )
    .await?;
    match (&nodes, args.pod_routes) {
        (_, pod_routes::Mode::Off) => {
            tracing::info!("--pod-routes off: no pod routes, no masquerade exemptions")
        }
        (Some(n), mode) => pod_routes::start(n.clone(), mode),
        (None, _) => {}
    }
    let relay = start_relay(&args, &shared, nodes.clone())?;
    if let (Some(n), None) = (&nodes, &relay) {
        // No relay (off, or its transport could not start): offer no lane
        // port, or peers would keep trying a lane nobody serves.
        n.set_lane_port(None);
    }
    let services = start_services(&args, &shared);
    peer_table::start(
        &args.socket,
        shared.clone(),
        nodes.clone(),
        relay.is_some(),
        services,
    );
    let processes = (args.process_scan_interval > 0.0).then(|| {
        processes::Processes::start(
            args.state_dir.clone(),
            Duration::from_secs_f64(args.process_scan_interval),
            processes::Bounds::default(),
        )
    });
    let lanes = stats::Lanes {
        relay,
        nodes: nodes.clone(),
        processes,
    };
    let listener = server::bind(&args.socket)?;
    tracing::info!(
        socket = %args.socket.display(),
        state_dir = %args.state_dir.display(),
        pods = shared.lock().pod_count(),
        "flowlaned serving"
    );
    if let Some(addr) = args.metrics_addr {
        let (shared, lanes) = (shared.clone(), lanes.clone());
        let ready = metrics::Readiness {
            socket: args.socket.clone(),
            nodes: nodes.clone(),
        };
        tokio::spawn(async move {
            if let Err(e) = metrics::serve(addr, shared, lanes, ready).await {
                tracing::error!(%addr, error = %e, "metrics endpoint failed");
            }
        });
    }
    let ticker = {
        let shared = shared.clone();
        let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .context("watching SIGHUP")?;
        tokio::spawn(async move {
            let mut iv = tokio::time::interval(Duration::from_millis(500));
            loop {
                tokio::select! {
                    _ = iv.tick() => shared.lock().tick(std::time::Instant::now()),
                    // SIGHUP: reread the pod registry (as the CNI poke does).
                    _ = hup.recv() => {
                        let mut b = shared.lock();
                        b.reload_registry();
                        tracing::info!(pods = b.pod_count(), "SIGHUP: pod registry reread");
                    }
                }
            }
        })
    };
    server::serve(
        listener,
        args.socket.clone(),
        shared.clone(),
        lanes,
        async {
            let _ = stop_rx.await;
        },
    )
    .await;
    ticker.abort();
    // Their ends report the close to the next daemon.
    shared.lock().save_connections();
    tracing::info!("flowlaned stopped");
    Ok(())
}
