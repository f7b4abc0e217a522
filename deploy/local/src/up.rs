//! `up`: creates a cluster, journaling every object before creating it.

use std::fs::File;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::cni::{self, PodRef};
use crate::journal::{Journal, Record};
use crate::procs;
use crate::sh;
use crate::spec::{Binaries, ClusterSpec, UNDERLAY_BRIDGE};
use crate::status::{ClusterState, NodeState, PodState, NODES_FILE, SPEC_FILE};

/// How long a node daemon may take to open its socket.
const DAEMON_START_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `up` waits for the daemons' pod routes.
const ROUTE_WAIT: Duration = Duration::from_secs(10);

/// Why `up` failed. The cluster is then partly built: run `down`.
#[derive(Debug, thiserror::Error)]
pub enum UpError {
    #[error("invalid cluster: {0}")]
    Spec(String),
    #[error("cluster {0:?} already exists (run `flowlane cluster down --name {0}` first)")]
    Exists(String),
    #[error("missing binary {0} (build the workspace: cargo build --release --workspace)")]
    MissingBinary(PathBuf),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Command(#[from] sh::CommandError),
    #[error("pod {pod}: {reason}")]
    Pod { pod: String, reason: String },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> UpError {
    let what = what.into();
    move |source| UpError::Io { what, source }
}

/// Creates the cluster `spec` describes; `progress` gets one line per step.
pub fn up(
    spec: &ClusterSpec,
    bins: &Binaries,
    progress: &dyn Fn(&str),
) -> Result<ClusterState, UpError> {
    spec.validate().map_err(UpError::Spec)?;
    if !bins.flowlane().is_file() && spec.plugin == crate::Plugin::Flowlane {
        return Err(UpError::MissingBinary(bins.flowlane()));
    }
    let run_dir = spec.run_dir();
    if run_dir.join(crate::journal::FILE_NAME).exists() {
        return Err(UpError::Exists(spec.name.clone()));
    }
    std::fs::create_dir_all(&run_dir).map_err(io(format!("create {}", run_dir.display())))?;
    std::fs::write(
        run_dir.join(SPEC_FILE),
        serde_json::to_vec_pretty(spec).expect("spec serialises"),
    )
    .map_err(io("write cluster.json"))?;
    let mut journal = Journal::open(&run_dir).map_err(io("open journal"))?;

    progress(&format!("underlay {}", spec.underlay_netns()));
    let underlay = spec.underlay_netns();
    new_netns(&mut journal, &underlay)?;
    sh::ip_in(
        &underlay,
        &["link", "add", UNDERLAY_BRIDGE, "type", "bridge"],
    )?;
    sh::ip_in(&underlay, &["link", "set", UNDERLAY_BRIDGE, "up"])?;

    let mut nodes = Vec::new();
    for n in 0..spec.nodes {
        nodes.push(make_node(spec, &mut journal, n, progress)?);
    }
    write_node_table(spec)?;

    for node in &mut nodes {
        start_daemon(spec, bins, &mut journal, node, progress)?;
    }
    await_routes(spec, &nodes, progress)?;

    let mut state = ClusterState {
        spec: spec.clone(),
        nodes,
        pods: Vec::new(),
    };
    for n in 0..spec.nodes {
        for p in 0..spec.pods_per_node {
            let pod = make_pod(spec, bins, &mut journal, n, p)?;
            progress(&format!(
                "pod {} on node {} ip {} ({} ADD)",
                pod.name,
                spec.node_name(n),
                pod.ip,
                match spec.plugin {
                    crate::Plugin::Flowlane => "flowlane",
                    crate::Plugin::Bridge => "reference bridge",
                }
            ));
            state.pods.push(pod);
        }
    }
    state.save().map_err(io("write state.json"))?;
    Ok(state)
}

fn new_netns(journal: &mut Journal, name: &str) -> Result<(), UpError> {
    journal
        .record(&Record::Netns {
            name: name.to_string(),
        })
        .map_err(io("journal"))?;
    sh::ip(&["netns", "add", name])?;
    sh::ip_in(name, &["link", "set", "lo", "up"])?;
    Ok(())
}

/// A node: its namespace, its link to the underlay (created from the
/// underlay side, the node end born inside the node namespace as `eth0`),
/// its underlay address and forwarding.
fn make_node(
    spec: &ClusterSpec,
    journal: &mut Journal,
    n: u32,
    progress: &dyn Fn(&str),
) -> Result<NodeState, UpError> {
    let netns = spec.node_netns(n);
    let underlay = spec.underlay_netns();
    let link = spec.underlay_link(n);
    let ip = spec.node_ip(n);
    progress(&format!(
        "node {} netns {netns} underlay {ip} pod CIDR {}",
        spec.node_name(n),
        spec.pod_cidr(n)
    ));
    new_netns(journal, &netns)?;
    // The veth lives and dies with the namespaces at its ends: deleting
    // either namespace deletes the pair, so it needs no journal record.
    sh::ip_in(
        &underlay,
        &[
            "link", "add", &link, "type", "veth", "peer", "name", "eth0", "netns", &netns,
        ],
    )?;
    sh::ip_in(
        &underlay,
        &["link", "set", &link, "master", UNDERLAY_BRIDGE, "up"],
    )?;
    sh::ip_in(&netns, &["addr", "add", &format!("{ip}/24"), "dev", "eth0"])?;
    sh::ip_in(&netns, &["link", "set", "eth0", "up"])?;
    sh::sysctl_in(&netns, "net.ipv4.ip_forward", "1")?;
    let dir = spec.node_dir(n);
    for sub in ["state", "ipam", "results"] {
        std::fs::create_dir_all(dir.join(sub)).map_err(io(format!("create {}", dir.display())))?;
    }
    std::fs::write(dir.join("net.conflist"), cni::render_conflist(spec, n))
        .map_err(io("write conflist"))?;
    Ok(NodeState {
        index: n,
        name: spec.node_name(n),
        netns,
        underlay_ip: ip.to_string(),
        pod_cidr: spec.pod_cidr(n),
        daemon_socket: spec.daemon_socket(n),
        daemon_pid: None,
        daemon_problem: None,
    })
}

/// The routes between the nodes' pod CIDRs are made by each node's
/// flowlaned (`--pod-routes`, default auto: host-gw on this shared
/// underlay; docs/daemon.md "Pod routes"). A node whose daemon is not
/// running, or has not routed a peer within [`ROUTE_WAIT`], gets the
/// host-gw route from here instead, so that its pods are reachable anyway.
fn await_routes(
    spec: &ClusterSpec,
    nodes: &[NodeState],
    progress: &dyn Fn(&str),
) -> Result<(), UpError> {
    let deadline = Instant::now() + ROUTE_WAIT;
    for (n, node) in (0..spec.nodes).zip(nodes) {
        let daemon = node.daemon_problem.is_none() && node.daemon_pid.is_some();
        let netns = spec.node_netns(n);
        for m in (0..spec.nodes).filter(|&m| m != n) {
            let cidr = spec.pod_cidr(m);
            let routed = || {
                sh::ip_in(&netns, &["route", "show", &cidr])
                    .is_ok_and(|o| !o.stdout.iter().all(u8::is_ascii_whitespace))
            };
            while daemon && !routed() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if !routed() {
                progress(&format!(
                    "node {}: no route to {cidr} from its flowlaned; adding it",
                    node.name
                ));
                sh::ip_in(
                    &netns,
                    &["route", "add", &cidr, "via", &spec.node_ip(m).to_string()],
                )?;
            }
        }
    }
    Ok(())
}

fn write_node_table(spec: &ClusterSpec) -> Result<(), UpError> {
    let nodes: Vec<_> = (0..spec.nodes)
        .map(|n| {
            json!({
                "name": spec.node_name(n),
                "podCIDRs": [spec.pod_cidr(n)],
                "underlay": spec.node_ip(n).to_string(),
            })
        })
        .collect();
    let body = serde_json::to_vec_pretty(&json!({ "nodes": nodes })).expect("json");
    std::fs::write(spec.run_dir().join(NODES_FILE), body).map_err(io("write nodes.json"))
}

/// Starts the node's flowlaned inside the node namespace. A daemon that is
/// missing or does not come up is recorded, not fatal: pods still get
/// wired (the plugin works without it) and their traffic stays on TCP.
fn start_daemon(
    spec: &ClusterSpec,
    bins: &Binaries,
    journal: &mut Journal,
    node: &mut NodeState,
    progress: &dyn Fn(&str),
) -> Result<(), UpError> {
    let exe = bins.flowlaned();
    if !exe.is_file() {
        node.daemon_problem = Some(format!("{} not built", exe.display()));
        progress(&format!(
            "node {}: no flowlaned ({})",
            node.name,
            exe.display()
        ));
        return Ok(());
    }
    let dir = spec.node_dir(node.index);
    let log = File::create(dir.join("flowlaned.log")).map_err(io("daemon log"))?;
    let log2 = log.try_clone().map_err(io("daemon log"))?;
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &node.netns])
        .arg(&exe)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--socket")
        .arg(&node.daemon_socket)
        // The cross-node view: the cluster's node table, and which entry is this node.
        .arg("--nodes-file")
        .arg(spec.run_dir().join(NODES_FILE))
        .arg("--node-name")
        .arg(&node.name)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2);
    procs::detach(&mut cmd);
    let child = cmd
        .spawn()
        .map_err(io(format!("start {}", exe.display())))?;
    let pid = child.id() as i32;
    // `ip netns exec` execs the daemon in place: this pid is the daemon.
    let ticks = procs::start_ticks(pid).unwrap_or(0);
    journal
        .record(&Record::Process {
            what: format!("flowlaned {}", node.name),
            pid,
            start_ticks: ticks,
        })
        .map_err(io("journal"))?;
    let mut child = child;
    let deadline = Instant::now() + DAEMON_START_TIMEOUT;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            node.daemon_problem = Some(format!(
                "flowlaned exited at start ({status}); see {}",
                dir.join("flowlaned.log").display()
            ));
            break;
        }
        if std::os::unix::net::UnixStream::connect(&node.daemon_socket).is_ok() {
            node.daemon_pid = Some(pid);
            break;
        }
        if Instant::now() > deadline {
            node.daemon_problem = Some(format!(
                "flowlaned did not open {} within {DAEMON_START_TIMEOUT:?}",
                node.daemon_socket.display()
            ));
            node.daemon_pid = Some(pid);
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    progress(&format!(
        "node {}: flowlaned {}",
        node.name,
        match (&node.daemon_problem, node.daemon_pid) {
            (None, Some(pid)) => format!("pid {pid} on {}", node.daemon_socket.display()),
            (Some(p), _) => format!("NOT running: {p}"),
            _ => "state unknown".into(),
        }
    ));
    // The daemon outlives `up`; it is reaped by init once `up` exits.
    drop(child);
    Ok(())
}

fn make_pod(
    spec: &ClusterSpec,
    bins: &Binaries,
    journal: &mut Journal,
    n: u32,
    p: u32,
) -> Result<PodState, UpError> {
    let name = spec.pod_name(n, p);
    let netns = spec.pod_netns(n, p);
    let container_id = spec.container_id(n, p);
    journal
        .record(&Record::Pod {
            node: n,
            pod: p,
            netns: netns.clone(),
            container_id: container_id.clone(),
        })
        .map_err(io("journal"))?;
    new_netns(journal, &netns)?;
    let pod_ref = PodRef {
        node: n,
        pod_name: &name,
        netns: &netns,
        container_id: &container_id,
    };
    let result = cni::add(spec, bins, &pod_ref).map_err(|reason| UpError::Pod {
        pod: name.clone(),
        reason,
    })?;
    let ip = cni::first_ipv4(&result).ok_or_else(|| UpError::Pod {
        pod: name.clone(),
        reason: format!("CNI result has no IPv4 address: {result}"),
    })?;
    Ok(PodState {
        node: n,
        index: p,
        name,
        netns,
        container_id,
        ip,
    })
}
