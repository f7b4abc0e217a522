//! `flowlane demo`: brings up local clusters, runs the training-traffic
//! workloads in their pods over each lane, and writes the report.
//!
//! Default plan (a few minutes on a 2-core machine):
//! 1. 1 node x 4 pods: for every model, ring all-reduce with 1, 2 and 4
//!    workers and synchronous parameter servers (1 server and 1 to 3
//!    workers; 2 servers and 1 to 2 workers),
//!    each over plain TCP and with the preload library (shared memory);
//! 2. 2 nodes x 2 pods: the same jobs spread over both nodes, and
//!    all-reduce between a same-node pair and a cross-node pair.
//!
//! The lane of every run is read from the node daemons' counters, never
//! assumed from what was asked.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use flowlane_workloads::models::{Gpu, ModelProfile};
use flowlane_workloads::report::{self, Report, RunRecord};
use flowlane_workloads::stats::WorkerResult;

use crate::lanes;
use crate::spec::{Binaries, ClusterSpec, Plugin};
use crate::status::{ClusterState, PodState};

/// The demo's clusters use this /16 for their pods (node i: 10.210.i.0/24).
pub const DEMO_POD_NETWORK: [u8; 2] = [10, 210];
/// The start of the note that stands in for RDMA rows until some are merged.
const RDMA_NOT_MEASURED: &str = "RDMA lane: not measured here:";
/// Longest a single run may take before its processes are killed.
const RUN_TIMEOUT: Duration = Duration::from_secs(180);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    AllReduce,
    PsSync,
    PsAsync,
}

impl Workload {
    pub fn name(self) -> &'static str {
        match self {
            Workload::AllReduce => "allreduce",
            Workload::PsSync => "ps-sync",
            Workload::PsAsync => "ps-async",
        }
    }

    pub fn parse(s: &str) -> Result<Workload, String> {
        match s {
            "allreduce" => Ok(Workload::AllReduce),
            "ps-sync" | "ps" => Ok(Workload::PsSync),
            "ps-async" => Ok(Workload::PsAsync),
            o => Err(format!(
                "unknown workload {o:?} (allreduce, ps-sync, ps-async)"
            )),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Plain TCP: the programs run without the preload library.
    Tcp,
    /// The programs run with the preload library: co-located pods may get
    /// shared memory (the counters tell whether they did).
    Shm,
}

impl Lane {
    pub fn name(self) -> &'static str {
        match self {
            Lane::Tcp => "tcp",
            Lane::Shm => "shm",
        }
    }
}

/// What the demo runs.
#[derive(Debug, Clone)]
pub struct DemoConfig {
    pub out: PathBuf,
    /// Fraction of the real models' size (tensors and compute time).
    pub scale: f64,
    pub steps: u32,
    pub warmup: u32,
    /// The models with their K80 compute times (the talk's); the run puts
    /// them on `gpu`.
    pub models: Vec<ModelProfile>,
    /// The GPU generation whose compute times the run models.
    pub gpu: Gpu,
    pub workloads: Vec<Workload>,
    pub lanes: Vec<Lane>,
    /// Run the 1 node x 4 pods phase.
    pub single_node: bool,
    /// Run the 2 nodes x 2 pods phase.
    pub two_nodes: bool,
    pub run_root: PathBuf,
    pub plugin: Plugin,
    /// Prefix of the demo's cluster names (`<prefix>1`, `<prefix>2`).
    pub cluster_prefix: String,
    /// The pods' /16 (`a.b.0.0`).
    pub pod_network: [u8; 2],
    /// RDMA-lane rows recorded by `rdma-demo` (a report JSON, or a bare
    /// array of rows) to merge into the report.
    pub rdma_rows: Option<PathBuf>,
    /// Run `rdma-demo` (the Soft-RoCE rig: QEMU guests, minutes) and merge
    /// its rows; off by default.
    pub rdma: bool,
    /// The models the rig runs (under emulation the rig moves a few MB/s,
    /// so the default leaves out the largest models).
    pub rdma_models: Vec<ModelProfile>,
}

impl DemoConfig {
    pub fn default_for(out: PathBuf) -> Self {
        DemoConfig {
            out,
            scale: 1.0 / 12.0,
            steps: 5,
            warmup: 1,
            models: flowlane_workloads::models::talk_models(),
            // What a shared training cluster most likely has today (docs/demo.md).
            gpu: Gpu::A100,
            workloads: vec![Workload::AllReduce, Workload::PsSync],
            lanes: vec![Lane::Tcp, Lane::Shm],
            single_node: true,
            two_nodes: true,
            run_root: PathBuf::from(crate::spec::DEFAULT_RUN_ROOT),
            plugin: Plugin::Flowlane,
            cluster_prefix: "demo".into(),
            pod_network: DEMO_POD_NETWORK,
            rdma_rows: None,
            rdma: false,
            rdma_models: ["googlenet", "resnet50"]
                .iter()
                .filter_map(|m| flowlane_workloads::models::by_name(m))
                .collect(),
        }
    }
}

/// One job: which pods run which role.
struct Job<'a> {
    workload: Workload,
    model: &'a ModelProfile,
    lane: Lane,
    workers: Vec<&'a PodState>,
    /// The parameter servers' pods (PS workloads), one shard each.
    servers: Vec<&'a PodState>,
    cluster: String,
    placement: String,
}

/// Runs the demo; `progress` gets a line per step. Clusters are always
/// torn down, also when a run fails.
pub fn run(cfg: &DemoConfig, bins: &Binaries, progress: &dyn Fn(&str)) -> Result<Report, String> {
    for exe in [bins.flowlane(), bins.train()] {
        if !exe.is_file() {
            return Err(format!(
                "{} is missing: build first (cargo build --release --workspace)",
                exe.display()
            ));
        }
    }
    if !(cfg.scale > 0.0 && cfg.scale <= 1.0) {
        return Err("scale must be in (0, 1]".into());
    }
    let models: Vec<ModelProfile> = cfg
        .models
        .iter()
        .map(|m| m.on(cfg.gpu).scaled(cfg.scale))
        .collect();
    let mut rep = Report::new(
        format!(
            "flowlane demo: distributed-training traffic over each lane ({} {})",
            cfg.gpu.name(),
            cfg.gpu.precision()
        ),
        cfg.gpu.label(),
        cfg.scale,
        notes(cfg, &models),
    );
    let start_load = load_average();
    let mut phases: Vec<(u32, u32)> = Vec::new();
    if cfg.single_node {
        phases.push((1, 4));
    }
    if cfg.two_nodes {
        phases.push((2, 2));
    }
    for (i, (nodes, pods)) in phases.into_iter().enumerate() {
        let mut spec = ClusterSpec::new(&format!("{}{}", cfg.cluster_prefix, i + 1), nodes, pods);
        spec.pod_network = std::net::Ipv4Addr::new(cfg.pod_network[0], cfg.pod_network[1], 0, 0);
        spec.plugin = cfg.plugin;
        spec.run_root = cfg.run_root.clone();
        // A cluster left by an interrupted earlier demo goes first.
        let _ = crate::down(&spec.run_root, &spec.name, bins);
        progress(&format!(
            "cluster {}: {nodes} node(s) x {pods} pod(s), pods wired by the {:?} CNI plugin",
            spec.name, spec.plugin
        ));
        let state = match crate::up(&spec, bins, &|s| progress(&format!("  {s}"))) {
            Ok(s) => s,
            Err(e) => {
                let _ = crate::down(&spec.run_root, &spec.name, bins);
                return Err(format!("cluster {}: {e}", spec.name));
            }
        };
        let jobs = plan(cfg, &models, &state);
        let total = jobs.len();
        for (k, job) in jobs.iter().enumerate() {
            let rec = run_job(cfg, bins, &state, job, 20000 + (k as u16 % 1000) * 10);
            progress(&describe(k + 1, total, &rec, cfg.scale));
            rep.runs.push(rec);
        }
        let d = crate::down(&spec.run_root, &spec.name, bins);
        if !d.errors.is_empty() {
            progress(&format!(
                "cluster {} teardown problems: {}",
                spec.name,
                d.errors.join("; ")
            ));
        }
    }
    if cfg.rdma {
        let rows = cfg.out.join("rdma-rows.json");
        run_rdma_demo(cfg, bins, &rows, progress)?;
        merge_rdma_rows(&mut rep, &rows)?;
    }
    if let Some(rows) = &cfg.rdma_rows {
        merge_rdma_rows(&mut rep, rows)?;
        progress(&format!("merged RDMA-lane rows from {}", rows.display()));
    }
    if let (Some(before), Some(after)) = (start_load, load_average()) {
        rep.notes.push(format!(
            "Machine load while the demo ran: load average {before:.1} at the start, {after:.1} at the end, on {} CPU(s); on a loaded machine single runs are noisy (a finding that changes direction from one worker count to the next says so).",
            rep.host_cpus
        ));
    }
    rep.finish();
    Ok(rep)
}

/// The 1-minute load average (`/proc/loadavg`), to say how busy the machine
/// was.
fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Runs `rdma-demo` (built with the workspace, beside `flowlane`), which
/// boots the Soft-RoCE rig and writes its rows to `rows`.
fn run_rdma_demo(
    cfg: &DemoConfig,
    bins: &Binaries,
    rows: &Path,
    progress: &dyn Fn(&str),
) -> Result<(), String> {
    let exe = bins.dir.join("rdma-demo");
    if !exe.is_file() {
        return Err(format!(
            "{} is missing: build first (cargo build --release --workspace)",
            exe.display()
        ));
    }
    std::fs::create_dir_all(&cfg.out).map_err(|e| format!("{}: {e}", cfg.out.display()))?;
    let models: Vec<&str> = cfg.rdma_models.iter().map(|m| m.name.as_str()).collect();
    progress("RDMA lane: rdma-demo boots the Soft-RoCE rig (two QEMU guests; minutes)");
    let status = Command::new(&exe)
        .arg("--out")
        .arg(rows)
        .args(["--scale", &cfg.scale.to_string()])
        .args(["--steps", &cfg.steps.to_string()])
        .args(["--warmup", &cfg.warmup.to_string()])
        .args(["--models", &models.join(",")])
        .stdin(Stdio::null())
        // Its table goes to the demo's progress stream, not the report's.
        .stdout(Stdio::null())
        .status()
        .map_err(|e| format!("{}: {e}", exe.display()))?;
    if !rows.is_file() {
        return Err(format!("rdma-demo ({status}) wrote no rows"));
    }
    if !status.success() {
        progress(&format!(
            "rdma-demo: {status} (failed rows are marked in the report)"
        ));
    }
    Ok(())
}

/// Adds recorded RDMA-lane rows (`rdma-demo`'s report JSON, or a bare array
/// of rows) to `rep`, with their notes in place of the "not measured" note.
pub fn merge_rdma_rows(rep: &mut Report, path: &Path) -> Result<(), String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("RDMA rows {}: {e}", path.display()))?;
    let (notes, rows) = match serde_json::from_str::<Report>(&text) {
        // Rows that model another GPU's compute would sit beside this
        // report's as if comparable: refuse them.
        Ok(r) if !r.gpu.is_empty() && r.gpu != rep.gpu => {
            return Err(format!(
                "RDMA rows {}: measured with {} compute times, this report models {}: run rdma-demo --gpu {}",
                path.display(),
                r.gpu,
                rep.gpu,
                rep.gpu.split(' ').next().unwrap_or_default()
            ))
        }
        Ok(r) => (r.notes, r.runs),
        Err(_) => (
            Vec::new(),
            serde_json::from_str::<Vec<RunRecord>>(&text).map_err(|e| {
                format!(
                    "RDMA rows {}: neither a report nor a list of rows: {e}",
                    path.display()
                )
            })?,
        ),
    };
    if rows.is_empty() {
        return Err(format!("RDMA rows {}: no rows", path.display()));
    }
    if let Some(bad) = rows
        .iter()
        .find(|r| !matches!(r.lane_requested.as_str(), "tcp" | "rdma"))
    {
        return Err(format!(
            "RDMA rows {}: a row asks for lane {:?} (tcp or rdma expected)",
            path.display(),
            bad.lane_requested
        ));
    }
    rep.notes.retain(|n| !n.starts_with(RDMA_NOT_MEASURED));
    rep.notes.extend(notes);
    rep.runs.extend(rows);
    Ok(())
}

fn notes(cfg: &DemoConfig, scaled: &[ModelProfile]) -> Vec<String> {
    let gpu = cfg.gpu;
    let real: Vec<ModelProfile> = cfg.models.iter().map(|m| m.on(gpu)).collect();
    let mut n = vec![
        format!(
            "Compute per step is modelled on {} ({}), batch 32 per worker: {}.",
            gpu.name(),
            gpu.precision(),
            real.iter()
                .map(|m| format!(
                    "{} {:.1} ms ({:.0} images/s)",
                    m.name,
                    m.compute_s * 1e3,
                    m.batch as f64 / m.compute_s
                ))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        format!("Source ({}): {}.", gpu.name(), gpu.source()),
    ];
    if gpu != Gpu::K80 {
        n.push(format!(
            "Assumptions: only ResNet-50 has a matched published figure on {0}; the other models' compute times are their K80 times (tf_cnn_benchmarks, K80, batch 32) divided by ResNet-50's speed-up over the K80 on {0} ({1:.1}x). Mixed precision because that is what people train with on V100/A100/H100 today. The published throughput is at larger batches; a batch-32 step is modelled as 32 / images/s, which if anything makes compute a little short and the communication share a little high.",
            gpu.name(),
            gpu.speedup_over_k80()
        ));
    } else {
        n.push(format!("K80 figures: {}.", Gpu::K80.source()));
    }
    if !gpu.measured() {
        n.push(format!(
            "{} is NOT measured: its compute time is an assumption (see the source note); read its rows as a what-if.",
            gpu.name()
        ));
    }
    n.extend([
        format!(
            "Scaled: every model's tensors AND compute time are {:.4} of the real model's (1/{:.0}), so a run is short while each model keeps its compute-to-communication ratio; the batch is not scaled, so images/s is reported at the modelled (real-size) rate: measured steps/s x {:.4} x batch x workers. Real sizes: {}.",
            cfg.scale,
            1.0 / cfg.scale,
            cfg.scale,
            real
                .iter()
                .map(|m| format!("{} {:.1}M params ({:.0} MB gradient)", m.name, m.params as f64 / 1e6, m.tensor_bytes() as f64 / 1e6))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        format!(
            "As run: {}.",
            scaled
                .iter()
                .map(|m| format!("{} {:.2} MB gradient, {:.2} ms compute", m.name, m.tensor_bytes() as f64 / 1e6, m.compute_s * 1e3))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        "Compute is emulated by sleeping (the talk's compute ran on GPUs, leaving host CPUs to the network).".into(),
        format!("Each run: {} warm-up step(s), then {} measured steps; a run's step time is its slowest worker's median step (robust against hiccups of a shared machine), split into the workers' median compute and communication; efficiency = speed-up / workers against the 1-worker run of the same series.", cfg.warmup, cfg.steps),
        "Lane 'asked' = tcp (no preload library) or shm (LD_PRELOAD=libflowlane_preload.so). Lane 'measured' comes from the node daemons' counters before and after each run: shm = every connection got a shared-memory channel, shm+tcp = some did (e.g. cross-node ones stay on TCP), tcp = none did. 'Lane evidence' sets the channels counted against the job's connections (W for a ring of W, W x S for S parameter servers) and names the daemons' reasons for those left on TCP.".into(),
        format!("{RDMA_NOT_MEASURED} this machine has no RDMA NIC; `flowlane demo --rdma` (or `--rdma-rows FILE` from `rdma-demo`) adds rows measured on the Soft-RoCE rig."),
    ]);
    if let Ok(cpus) = std::thread::available_parallelism() {
        n.push(format!(
            "All pods share this machine's {cpus} CPU core(s): with more workers the network stack competes for the same cores, which a real cluster does not have."
        ));
    }
    n
}

/// The TCP connections a job opens, and how many of them join two pods of
/// one node: a ring of W >= 2 opens W (each member connects to its
/// successor), parameter servers W x S (each worker to each server).
fn connections(job: &Job) -> (u64, u64) {
    let mut pairs: Vec<(u32, u32)> = Vec::new();
    if job.servers.is_empty() {
        let w = job.workers.len();
        if w >= 2 {
            for (i, p) in job.workers.iter().enumerate() {
                pairs.push((p.node, job.workers[(i + 1) % w].node));
            }
        }
    } else {
        for wk in &job.workers {
            for sv in &job.servers {
                pairs.push((wk.node, sv.node));
            }
        }
    }
    let same = pairs.iter().filter(|(a, b)| a == b).count() as u64;
    (pairs.len() as u64, same)
}

/// The jobs of one cluster.
fn plan<'a>(cfg: &DemoConfig, models: &'a [ModelProfile], st: &'a ClusterState) -> Vec<Job<'a>> {
    let nodes = st.spec.nodes;
    let pods = &st.pods;
    let cluster = format!("{}x{}", nodes, st.spec.pods_per_node);
    let mut jobs = Vec::new();
    // Worker order: alternate nodes, so 2 workers on 2 nodes are cross-node.
    let mut spread: Vec<&PodState> = Vec::new();
    for p in 0..st.spec.pods_per_node {
        for n in 0..nodes {
            spread.push(&pods[(n * st.spec.pods_per_node + p) as usize]);
        }
    }
    for model in models {
        for &workload in &cfg.workloads {
            for &lane in &cfg.lanes {
                match workload {
                    Workload::AllReduce => {
                        for w in [1usize, 2, 4].into_iter().filter(|&w| w <= spread.len()) {
                            // Two workers: spread (cross-node on two nodes).
                            // All pods: in node order, so the ring crosses
                            // between nodes as few times as possible (as
                            // NCCL and Gloo order their rings).
                            let ring: Vec<&PodState> = if w == pods.len() {
                                pods.iter().collect()
                            } else {
                                spread[..w].to_vec()
                            };
                            jobs.push(Job {
                                workload,
                                model,
                                lane,
                                placement: placement(&ring, &[]),
                                workers: ring,
                                servers: Vec::new(),
                                cluster: cluster.clone(),
                            });
                        }
                        if nodes > 1 && st.spec.pods_per_node > 1 {
                            // The same-node pair, against the cross-node pair
                            // (spread[..2]) of the series above.
                            let same = vec![&pods[0], &pods[1]];
                            jobs.push(Job {
                                workload,
                                model,
                                lane,
                                placement: placement(&same, &[]),
                                workers: same,
                                servers: Vec::new(),
                                cluster: format!("{cluster} pairs"),
                            });
                        }
                    }
                    Workload::PsSync | Workload::PsAsync => {
                        // One server in the last pod, workers in the others;
                        // on one node with 4 pods also two servers (the parameters sharded
                        // across the last two pods) for 1 and 2 workers:
                        // the PS:worker ratio the talk found hard to guess.
                        let mut layouts = vec![1usize];
                        if spread.len() >= 4 && nodes == 1 {
                            layouts.push(2);
                        }
                        for ps in layouts {
                            let servers: Vec<&PodState> = spread[spread.len() - ps..].to_vec();
                            let others: Vec<&PodState> = spread[..spread.len() - ps].to_vec();
                            let label = if ps == 1 {
                                cluster.clone()
                            } else {
                                format!("{cluster} {ps}PS")
                            };
                            for w in 1..=others.len() {
                                jobs.push(Job {
                                    workload,
                                    model,
                                    lane,
                                    workers: others[..w].to_vec(),
                                    placement: placement(&others[..w], &servers),
                                    servers: servers.clone(),
                                    cluster: label.clone(),
                                });
                            }
                        }
                    }
                }
            }
        }
    }
    jobs
}

/// "same node" / "cross node" / "1 node" description of who talks to whom.
fn placement(workers: &[&PodState], servers: &[&PodState]) -> String {
    let mut all: Vec<u32> = workers.iter().map(|p| p.node).collect();
    all.extend(servers.iter().map(|s| s.node));
    let first = all[0];
    let peers = all.len();
    if peers < 2 {
        return "1 pod".into();
    }
    let kind = if all.iter().all(|&n| n == first) {
        "same node"
    } else {
        "cross node"
    };
    let names: Vec<&str> = workers.iter().map(|p| p.name.as_str()).collect();
    let names = names.join(",");
    if servers.is_empty() {
        format!("{kind} {names}")
    } else {
        let ps: Vec<&str> = servers.iter().map(|p| p.name.as_str()).collect();
        format!("{kind} {names}>{}", ps.join(","))
    }
}

/// One progress line; images/s at the modelled rate (as in the report).
fn describe(k: usize, total: usize, r: &RunRecord, scale: f64) -> String {
    match &r.error {
        Some(e) => format!(
            "({k}/{total}) {} {} W={} lane {}: FAILED: {e}",
            r.workload, r.model, r.workers, r.lane_requested
        ),
        None => format!(
            "({k}/{total}) {:<9} {:<10} {} W={} {:<30} asked {} measured {:<7} {:>7.1} images/s (modelled)  step {:>6.1} ms = compute {:>6.1} + comm {:>6.1}{}",
            r.workload,
            r.model,
            r.cluster,
            r.workers,
            r.placement,
            r.lane_requested,
            r.lane_measured,
            r.steps_per_s * scale * r.batch as f64 * r.workers as f64,
            r.step_s * 1e3,
            r.compute_s * 1e3,
            r.comm_s * 1e3,
            r.busbw_gbps.map(|b| format!("  busbw {b:.2} GB/s")).unwrap_or_default()
        ),
    }
}

/// A process of a run, in its pod (with the preload library for the shm lane).
fn pod_command(bins: &Binaries, st: &ClusterState, pod: &PodState, lane: Lane) -> Command {
    let mut cmd = crate::exec::in_pod(bins, st, pod, lane == Lane::Shm);
    cmd.arg(bins.train());
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    crate::procs::die_with_parent(&mut cmd);
    cmd
}

fn run_job(
    cfg: &DemoConfig,
    bins: &Binaries,
    st: &ClusterState,
    job: &Job,
    port: u16,
) -> RunRecord {
    let mut rec = RunRecord {
        workload: job.workload.name().into(),
        model: job.model.name.clone(),
        cluster: job.cluster.clone(),
        placement: job.placement.clone(),
        lane_requested: job.lane.name().into(),
        workers: job.workers.len() as u32,
        servers: job.servers.len() as u32,
        batch: job.model.batch,
        ..Default::default()
    };
    (rec.connections, rec.same_node_connections) = connections(job);
    let sockets: Vec<PathBuf> = st.nodes.iter().map(|n| n.daemon_socket.clone()).collect();
    let read_all = |s: &[PathBuf]| -> Vec<Option<lanes::Counters>> {
        s.iter().map(|p| lanes::read(bins, p)).collect()
    };
    let before = read_all(&sockets);
    let outcome = spawn_and_collect(cfg, bins, st, job, port);
    let after = read_all(&sockets);
    rec.evidence = lanes::evidence(&before, &after);
    rec.lane_measured = report::measured_lane(&rec.evidence);
    match outcome {
        Ok(results) => rec.absorb(&results),
        Err(e) => rec.error = Some(e),
    }
    rec
}

fn steps_args(cfg: &DemoConfig, model: &ModelProfile) -> Vec<String> {
    vec![
        "--steps".into(),
        cfg.steps.to_string(),
        "--warmup".into(),
        cfg.warmup.to_string(),
        "--compute-ms".into(),
        format!("{:.3}", model.compute_s * 1e3),
        "--connect-timeout".into(),
        "30".into(),
        // Lets every process of the job reach listen() before anyone
        // connects: a connection racing a listener's start may stay on TCP.
        "--start-delay-ms".into(),
        "300".into(),
    ]
}

fn spawn_and_collect(
    cfg: &DemoConfig,
    bins: &Binaries,
    st: &ClusterState,
    job: &Job,
    port: u16,
) -> Result<Vec<WorkerResult>, String> {
    let w = job.workers.len();
    let params = job.model.params.to_string();
    let mut servers: Vec<Child> = Vec::new();
    let mut workers: Vec<Child> = Vec::new();
    let spawn = |mut c: Command| c.spawn().map_err(|e| format!("spawn: {e}"));
    let result = (|| {
        match job.workload {
            Workload::AllReduce => {
                for (rank, pod) in job.workers.iter().enumerate() {
                    let next = job.workers[(rank + 1) % w];
                    let mut c = pod_command(bins, st, pod, job.lane);
                    c.args(["allreduce-worker", "--rank", &rank.to_string()])
                        .args(["--workers", &w.to_string(), "--elements", &params])
                        .args(["--listen", &format!("{}:{}", pod.ip, port + rank as u16)])
                        .args([
                            "--next",
                            &format!("{}:{}", next.ip, port + ((rank + 1) % w) as u16),
                        ])
                        .args(steps_args(cfg, job.model));
                    workers.push(spawn(c)?);
                }
            }
            Workload::PsSync | Workload::PsAsync => {
                if job.servers.is_empty() {
                    return Err("PS job without a server pod".to_string());
                }
                let mode = if job.workload == Workload::PsSync {
                    "sync"
                } else {
                    "async"
                };
                let shards = job.servers.len();
                let addrs: Vec<String> = job
                    .servers
                    .iter()
                    .enumerate()
                    .map(|(i, p)| format!("{}:{}", p.ip, port + i as u16))
                    .collect();
                for (i, server) in job.servers.iter().enumerate() {
                    let mut c = pod_command(bins, st, server, job.lane);
                    c.args(["ps-server", "--listen", &addrs[i], "--params", &params])
                        .args(["--shard", &i.to_string(), "--shards", &shards.to_string()])
                        .args(["--workers", &w.to_string(), "--mode", mode]);
                    servers.push(spawn(c)?);
                }
                let addr = addrs.join(",");
                for (rank, pod) in job.workers.iter().enumerate() {
                    let mut c = pod_command(bins, st, pod, job.lane);
                    c.args(["ps-worker", "--servers", &addr, "--rank", &rank.to_string()])
                        .args(["--workers", &w.to_string(), "--params", &params])
                        .args(steps_args(cfg, job.model));
                    workers.push(spawn(c)?);
                }
            }
        }
        let n_workers = workers.len();
        let mut all: Vec<&mut Child> = workers.iter_mut().chain(servers.iter_mut()).collect();
        let outputs = wait_all(&mut all, Instant::now() + RUN_TIMEOUT)?;
        let mut results = Vec::new();
        for out in outputs.iter().take(n_workers) {
            if let Some(line) = out.lines().find(|l| l.starts_with('{')) {
                let r: WorkerResult = serde_json::from_str(line)
                    .map_err(|e| format!("bad worker output ({e}): {line}"))?;
                results.push(r);
            }
        }
        if results.len() != w {
            return Err(format!("{} of {w} workers reported", results.len()));
        }
        Ok(results)
    })();
    // Whatever happened, no process of this run outlives it.
    for c in workers.iter_mut().chain(servers.iter_mut()) {
        let _ = c.kill();
        let _ = c.wait();
    }
    result
}

fn last_line(s: &str) -> String {
    s.lines()
        .rev()
        .find(|l| !l.trim().is_empty() && !l.starts_with(' '))
        .unwrap_or("(no output)")
        .to_string()
}

fn drain(r: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(mut r) = r {
            let _ = r.read_to_string(&mut s);
        }
        s
    })
}

/// Waits for every process of a run; returns their stdouts. The first
/// failure (or the deadline) ends the run: the others would only wait for
/// a peer that is gone.
fn wait_all(children: &mut [&mut Child], deadline: Instant) -> Result<Vec<String>, String> {
    let readers: Vec<_> = children
        .iter_mut()
        .map(|c| (drain(c.stdout.take()), drain(c.stderr.take())))
        .collect();
    let mut done = vec![false; children.len()];
    let mut failure = None;
    while failure.is_none() && done.iter().any(|d| !d) {
        for (i, c) in children.iter_mut().enumerate() {
            if done[i] {
                continue;
            }
            match c.try_wait() {
                Ok(Some(s)) => {
                    done[i] = true;
                    if !s.success() {
                        failure = Some(i);
                    }
                }
                Ok(None) => {}
                Err(e) => return Err(format!("wait: {e}")),
            }
        }
        if Instant::now() > deadline {
            for c in children.iter_mut() {
                let _ = c.kill();
            }
            return Err(format!("run timed out after {RUN_TIMEOUT:?}"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    if failure.is_some() {
        for c in children.iter_mut() {
            let _ = c.kill();
        }
    }
    let mut outs = Vec::new();
    let mut errs = Vec::new();
    for (o, e) in readers {
        outs.push(o.join().unwrap_or_default());
        errs.push(e.join().unwrap_or_default());
    }
    if let Some(i) = failure {
        return Err(format!("a process failed: {}", last_line(&errs[i])));
    }
    Ok(outs)
}

/// Writes the report files into `out` and returns their paths.
pub fn write_report(rep: &Report, out: &Path) -> std::io::Result<Vec<PathBuf>> {
    rep.write(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows recorded by a real `rdma-demo` run on the Soft-RoCE rig.
    const RECORDED: &str = include_str!("../testdata/rdma-rows.json");

    struct TempDir(PathBuf);
    impl TempDir {
        fn new(tag: &str) -> Self {
            let d = std::env::temp_dir().join(format!("flowlane-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).unwrap();
            TempDir(d)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A report as `run` builds it, with one local shm series.
    fn local_report() -> Report {
        let cfg = DemoConfig::default_for(PathBuf::from("unused"));
        let row = |w: u32, ips: f64| RunRecord {
            workload: "allreduce".into(),
            model: "googlenet".into(),
            cluster: "2x2".into(),
            placement: "cross node".into(),
            lane_requested: "shm".into(),
            lane_measured: "shm+tcp".into(),
            workers: w,
            batch: 32,
            steps: 5,
            steps_per_s: ips / 32.0 / w as f64,
            ..Default::default()
        };
        Report {
            title: "t".into(),
            gpu: cfg.gpu.label(),
            scale: cfg.scale,
            notes: notes(&cfg, &cfg.models),
            runs: vec![row(1, 100.0), row(2, 150.0)],
            ..Default::default()
        }
    }

    #[test]
    fn merged_rdma_rows_reach_report_json_table_and_chart() {
        let dir = TempDir::new("rdma-merge");
        let rows = dir.0.join("rdma-rows.json");
        std::fs::write(&rows, RECORDED).unwrap();
        let mut rep = local_report();
        assert!(rep.notes.iter().any(|n| n.starts_with(RDMA_NOT_MEASURED)));
        merge_rdma_rows(&mut rep, &rows).unwrap();
        rep.finish();
        let files = rep.write(&dir.0.join("out")).unwrap();

        // report.json parses back and holds the local rows and the rig's.
        let text = std::fs::read_to_string(&files[0]).unwrap();
        let back: Report = serde_json::from_str(&text).unwrap();
        // (Floats may differ in the last digit after a JSON round trip.)
        assert_eq!(back.runs.len(), rep.runs.len());
        assert_eq!(back.notes, rep.notes);
        assert!(back.runs.iter().any(|r| r.lane_requested == "shm"));
        assert!(!back.notes.iter().any(|n| n.starts_with(RDMA_NOT_MEASURED)));
        assert!(back.notes.iter().any(|n| n.contains("Soft-RoCE")));
        let rdma: Vec<&RunRecord> = back
            .runs
            .iter()
            .filter(|r| r.lane_requested == "rdma")
            .collect();
        assert!(!rdma.is_empty(), "no rdma rows in {text}");
        // Every cross-node row that asked for RDMA was measured on it, with
        // counter evidence, and has its scaling figures.
        let cross: Vec<&&RunRecord> = rdma
            .iter()
            .filter(|r| r.placement.starts_with("cross node") && r.error.is_none())
            .collect();
        assert!(!cross.is_empty());
        for r in &cross {
            assert_eq!(r.lane_measured, "rdma", "{r:?}");
            assert!(r.evidence.counters_read && r.evidence.rdma_connections > 0);
            assert!(r.evidence.rdma_bytes >= r.tensor_bytes, "{r:?}");
            assert!(r.steps_per_s > 0.0 && r.scaling_efficiency.is_some());
        }
        // Their plain-TCP twins of the same run are there to compare with.
        for r in &cross {
            assert!(back.runs.iter().any(|t| t.lane_requested == "tcp"
                && t.cluster == r.cluster
                && t.workload == r.workload
                && t.model == r.model
                && t.workers == r.workers
                && t.lane_measured == "tcp"));
        }
        assert!(rep.table().contains("rdma"));
        let md = std::fs::read_to_string(&files[1]).unwrap();
        assert!(md.contains("| rdma | rdma |"));
        let svg = std::fs::read_to_string(&files[3]).unwrap();
        assert!(svg.contains("allreduce / rdma / rig 2x1"));
        assert!(svg.contains("allreduce / shm / 2x2"));
    }

    #[test]
    fn bad_rdma_rows_are_refused_with_a_reason() {
        let dir = TempDir::new("rdma-bad");
        let mut rep = local_report();
        let before = rep.clone();
        let missing = dir.0.join("none.json");
        assert!(merge_rdma_rows(&mut rep, &missing)
            .unwrap_err()
            .contains("none.json"));
        let garbage = dir.0.join("garbage.json");
        std::fs::write(&garbage, "{\"runs\": 3}").unwrap();
        assert!(merge_rdma_rows(&mut rep, &garbage)
            .unwrap_err()
            .contains("neither a report nor a list of rows"));
        let empty = dir.0.join("empty.json");
        std::fs::write(&empty, "[]").unwrap();
        assert!(merge_rdma_rows(&mut rep, &empty)
            .unwrap_err()
            .contains("no rows"));
        let shm = dir.0.join("shm.json");
        let row = RunRecord {
            lane_requested: "shm".into(),
            ..Default::default()
        };
        std::fs::write(&shm, serde_json::to_string(&vec![row]).unwrap()).unwrap();
        assert!(merge_rdma_rows(&mut rep, &shm)
            .unwrap_err()
            .contains("\"shm\""));
        // Rows that model another GPU than the report's.
        let k80 = dir.0.join("k80.json");
        let mut other: Report = serde_json::from_str(RECORDED).unwrap();
        other.gpu = Gpu::K80.label();
        std::fs::write(&k80, serde_json::to_string(&other).unwrap()).unwrap();
        let e = merge_rdma_rows(&mut rep, &k80).unwrap_err();
        assert!(e.contains("K80 (FP32)") && e.contains("--gpu A100"), "{e}");
        assert_eq!(rep, before, "a refused file changes nothing");
    }
}
