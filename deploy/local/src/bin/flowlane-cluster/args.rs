//! The command line of `flowlane cluster ...` and `flowlane demo ...`.
//! Parsing only: the values are checked and turned into the library's
//! types (`ClusterSpec`, `DemoConfig`, `KubeCheckOpts`) by the command
//! modules.

use std::net::Ipv4Addr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use flowlane_cluster::spec::DEFAULT_RUN_ROOT;
use flowlane_cluster::Plugin;

/// flowlane's local training cluster and demo (run by `flowlane cluster`
/// and `flowlane demo`).
#[derive(Parser)]
#[command(
    name = "flowlane",
    bin_name = "flowlane",
    version,
    args_override_self = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

// Parsed once per process: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub enum Command {
    /// A local training cluster on this machine: nodes and pods as network
    /// namespaces, pods wired by flowlane as their CNI plugin.
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// Run the training-traffic demo and write its report.
    Demo(DemoArgs),
    /// Print a shell completion script for `flowlane cluster|demo`.
    Completions { shell: clap_complete::Shell },
}

/// Which cluster: every cluster command takes these.
#[derive(Args, Clone)]
pub struct Which {
    /// The cluster's name (nodes are namespaces flc<NAME>-n<i>).
    #[arg(long, default_value = "local")]
    pub name: String,
    /// Where cluster state lives.
    #[arg(long, default_value = DEFAULT_RUN_ROOT)]
    pub run_root: PathBuf,
}

#[derive(Subcommand)]
pub enum ClusterCommand {
    /// Bring a cluster up (node i gets A.B.i.0/24 of --pod-network).
    Up(UpArgs),
    /// Remove everything of a cluster, also after an interrupted `up`.
    Down(WhichJson),
    /// The cluster's nodes, pods and daemons; exit 1 when it has problems.
    Status(WhichJson),
    /// Run a program in pod POD (e.g. n0p1).
    Exec(ExecArgs),
    /// Move 8 MiB between a same-node and a cross-node pod pair and say
    /// from the daemons' counters which lane carried them (exit 1 if a pair
    /// failed or the same-node pair did not get shared memory).
    Check(CheckArgs),
    /// The programs `check` runs in the pods.
    #[command(subcommand, hide = true)]
    Probe(ProbeCommand),
}

#[derive(Args)]
pub struct WhichJson {
    #[command(flatten)]
    pub which: Which,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct UpArgs {
    #[command(flatten)]
    pub which: Which,
    /// Nodes of the cluster.
    #[arg(long, default_value_t = 2)]
    pub nodes: u32,
    /// Pods per node.
    #[arg(long, default_value_t = 2)]
    pub pods: u32,
    /// The pods' /16 (A.B.0.0 or A.B.0.0/16).
    #[arg(long, default_value = "10.210.0.0", value_parser = parse_slash16)]
    pub pod_network: Ipv4Addr,
    /// The CNI plugin wiring the pods: flowlane or bridge.
    #[arg(long, default_value = "flowlane")]
    pub plugin: Plugin,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct ExecArgs {
    #[command(flatten)]
    pub which: Which,
    /// Inject libflowlane_preload.so and the node daemon's socket, as the
    /// deploy layer does for pods.
    #[arg(long)]
    pub preload: bool,
    /// The pod, e.g. n0p1.
    pub pod: String,
    /// The program and its arguments, after `--`.
    #[arg(last = true, required = true)]
    pub program: Vec<String>,
}

#[derive(Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub which: Which,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// Check a real cluster through its API server instead: probe pods
    /// pinned to two nodes, opted in to injection; expected same node ->
    /// shm, two nodes that both publish a lane -> relay, else tcp.
    #[arg(long)]
    pub kubernetes: bool,
    /// kubeconfig (else KUBECONFIG, ~/.kube/config, in-cluster).
    #[arg(long, requires = "kubernetes")]
    pub kubeconfig: Option<PathBuf>,
    /// Namespace of the probe pods (created and deleted when missing;
    /// default flowlane-check).
    #[arg(long, short = 'n', requires = "kubernetes")]
    pub namespace: Option<String>,
    /// Namespace of the flowlane DaemonSet (default flowlane-system).
    #[arg(long, requires = "kubernetes")]
    pub flowlane_namespace: Option<String>,
    /// First node (default: a pair of nodes that both publish a lane).
    #[arg(long, requires = "kubernetes")]
    pub node_a: Option<String>,
    /// Second node.
    #[arg(long, requires = "kubernetes")]
    pub node_b: Option<String>,
    /// The probe image (default: the image of node A's flowlaned).
    #[arg(long, requires = "kubernetes")]
    pub image: Option<String>,
    /// Bytes each pair moves.
    #[arg(long, requires = "kubernetes")]
    pub bytes: Option<u64>,
    /// Bound of each wait, in seconds.
    #[arg(long, requires = "kubernetes")]
    pub timeout: Option<u64>,
}

#[derive(Subcommand)]
pub enum ProbeCommand {
    /// Accept one connection on PORT, hash what arrives, reply.
    Serve { port: u16 },
    /// Send BYTES to ADDR and check the reply.
    Send {
        addr: std::net::SocketAddr,
        bytes: u64,
    },
}

/// Which clusters of the demo run.
#[derive(Clone, Copy, ValueEnum)]
pub enum Only {
    /// Only the 1 node x 4 pods cluster.
    Single,
    /// Only the 2 nodes x 2 pods cluster.
    Two,
    /// Only the Soft-RoCE rig (implies --rdma).
    Rdma,
}

/// Brings up local clusters (1 node x 4 pods, then 2 nodes x 2 pods), runs
/// ring all-reduce and parameter-server training traffic for GoogLeNet,
/// Inception v3, ResNet-50 and VGG16 over plain TCP and over flowlane's
/// shared-memory lane, and writes report.json, report.md, report.html
/// (findings first, the chart inline) and scaling.svg.
#[derive(Args)]
pub struct DemoArgs {
    /// Where the report goes.
    #[arg(long, default_value = "flowlane-report")]
    pub out: PathBuf,
    /// Fraction of real model size, tensors and compute (F or N/D).
    #[arg(long, value_parser = parse_fraction)]
    pub scale: Option<f64>,
    /// Measured steps per run (default 5).
    #[arg(long)]
    pub steps: Option<u32>,
    /// Unmeasured first steps (default 1).
    #[arg(long)]
    pub warmup: Option<u32>,
    /// googlenet,inception3,resnet50,vgg16 (default all).
    #[arg(long, value_delimiter = ',')]
    pub models: Option<Vec<String>>,
    /// K80, V100, A100 or H100: whose compute times per step (default A100,
    /// mixed precision; H100 is an assumption).
    #[arg(long)]
    pub gpu: Option<String>,
    /// allreduce,ps-sync,ps-async (default allreduce,ps-sync).
    #[arg(long, value_delimiter = ',')]
    pub workloads: Option<Vec<String>>,
    /// tcp,shm (default both).
    #[arg(long, value_delimiter = ',')]
    pub lanes: Option<Vec<String>>,
    /// Only one of the clusters.
    #[arg(long, value_enum)]
    pub only: Option<Only>,
    /// The CNI plugin wiring the pods: flowlane or bridge.
    #[arg(long)]
    pub plugin: Option<Plugin>,
    /// Cluster state (default /run/flowlane-cluster).
    #[arg(long)]
    pub run_root: Option<PathBuf>,
    /// Cluster names NAME1, NAME2 (default demo).
    #[arg(long)]
    pub cluster_prefix: Option<String>,
    /// The pods' /16 (default 10.210.0.0).
    #[arg(long, value_parser = parse_slash16)]
    pub pod_network: Option<Ipv4Addr>,
    /// Also measure the RDMA lane between the two guests of the Soft-RoCE
    /// rig (runs rdma-demo: needs qemu, takes minutes).
    #[arg(long)]
    pub rdma: bool,
    /// The models the rig runs (default googlenet,resnet50).
    #[arg(long, value_delimiter = ',')]
    pub rdma_models: Option<Vec<String>>,
    /// Merge RDMA-lane rows recorded earlier by rdma-demo.
    #[arg(long)]
    pub rdma_rows: Option<PathBuf>,
}

/// `A.B.0.0` or `A.B.0.0/16`.
fn parse_slash16(v: &str) -> Result<Ipv4Addr, String> {
    v.strip_suffix("/16")
        .unwrap_or(v)
        .parse()
        .map_err(|e| format!("{e}"))
}

/// `0.25` or `1/12`.
fn parse_fraction(v: &str) -> Result<f64, String> {
    let num = |s: &str| s.parse::<f64>().map_err(|_| format!("not a number: {v:?}"));
    match v.split_once('/') {
        Some((n, d)) => Ok(num(n)? / num(d)?),
        None => num(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("flowlane").chain(args.iter().copied()))
    }

    #[test]
    fn the_command_line_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn both_flag_forms_and_later_values_win() {
        let Command::Demo(d) = parse(&["demo", "--out", "a", "--out=b", "--scale=1/12"])
            .unwrap()
            .command
        else {
            panic!("not demo")
        };
        assert_eq!(d.out, PathBuf::from("b"));
        assert!((d.scale.unwrap() - 1.0 / 12.0).abs() < 1e-12);
    }

    #[test]
    fn exec_takes_the_program_after_the_separator() {
        let Command::Cluster(ClusterCommand::Exec(e)) = parse(&[
            "cluster",
            "exec",
            "--name",
            "x",
            "--preload",
            "n0p1",
            "--",
            "ip",
            "-br",
            "a",
        ])
        .unwrap()
        .command
        else {
            panic!("not exec")
        };
        assert_eq!(
            (e.which.name.as_str(), e.preload, e.pod.as_str()),
            ("x", true, "n0p1")
        );
        assert_eq!(e.program, ["ip", "-br", "a"]);
        assert!(parse(&["cluster", "exec", "n0p1"]).is_err(), "no program");
    }

    #[test]
    fn kubernetes_options_need_kubernetes_and_bad_values_are_refused() {
        assert!(parse(&["cluster", "check", "--node-a", "a"]).is_err());
        assert!(parse(&[
            "cluster",
            "check",
            "--kubernetes",
            "--node-a",
            "a",
            "--timeout=60"
        ])
        .is_ok());
        assert!(parse(&["cluster", "up", "--pod-network", "10.1.2"]).is_err());
        assert!(parse(&["cluster", "up", "--plugin", "calico"]).is_err());
        assert!(parse(&["cluster", "up", "--nodes", "x"]).is_err());
        assert!(parse(&["demo", "--scale", "1/x"]).is_err());
        assert!(parse(&["demo", "--only", "three"]).is_err());
        let Command::Cluster(ClusterCommand::Up(u)) =
            parse(&["cluster", "up", "--pod-network=10.7.0.0/16"])
                .unwrap()
                .command
        else {
            panic!("not up")
        };
        assert_eq!(u.pod_network, Ipv4Addr::new(10, 7, 0, 0));
        assert_eq!((u.nodes, u.pods, u.which.name.as_str()), (2, 2, "local"));
    }
}
