//! rdma-demo: the demo report's RDMA-lane rows, measured on the Soft-RoCE
//! two-guest rig (deploy/local/rdma-rig; this machine's kernel has no RDMA).
//!
//!   cargo build --release --workspace
//!   target/release/rdma-demo --out rdma-rows.json      (root; boots the rig, minutes)
//!   flowlane demo --rdma-rows rdma-rows.json           (merges them into the report)
//!
//! One pod on each guest (node1, node2), wired by the real plugin; both
//! `flowlaned`s run `--lane-transport rdma`. For every model, in the same run
//! on the same pair: the ring all-reduce with 1 and 2 workers and a
//! synchronous parameter server (worker on node1, server on node2), once over
//! plain TCP (no preload library) and once with the preload library, whose
//! cross-node connections the daemons relay over RDMA. Each row's measured
//! lane comes from the daemons' counters before and after the run, as in
//! `flowlane demo`. The rows are written as a report (`report.json`'s format,
//! cluster `rig 2x1`) and printed as the demo's table.
//!
//! Under emulation (QEMU/TCG guests, rxe doing the transport in software)
//! the absolute figures are low: compare the rdma rows with the tcp rows of
//! the same run, never with the host's local clusters.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use flowlane_cluster::rdma_rig::{RdmaRig, RigConfig};
use flowlane_workloads::models::{self, Gpu, ModelProfile};
use flowlane_workloads::report::{self, LaneEvidence, Report, RunRecord};
use flowlane_workloads::stats::WorkerResult;

/// The rows' cluster label: two rig guests, one pod each.
const CLUSTER: &str = "rig 2x1";
const POD1: &str = "rig-n1p0";
const POD2: &str = "rig-n2p0";
const RUN_TIMEOUT: Duration = Duration::from_secs(600);
const USAGE: &str =
    "usage: rdma-demo [--out FILE] [--gpu K80|V100|A100|H100] [--scale F] [--steps N] [--warmup N] [--models a,b] [--no-ps]";

#[derive(Clone)]
struct Args {
    out: PathBuf,
    scale: f64,
    steps: u32,
    warmup: u32,
    models: Vec<ModelProfile>,
    /// Whose compute times per step the rows model: the same default as
    /// `flowlane demo` (the report refuses to merge rows of another GPU).
    gpu: Gpu,
    ps: bool,
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        out: PathBuf::from("rdma-rows.json"),
        scale: 1.0 / 12.0,
        steps: 5,
        warmup: 1,
        models: ["googlenet", "resnet50"]
            .iter()
            .filter_map(|m| models::by_name(m))
            .collect(),
        gpu: Gpu::A100,
        ps: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        if k == "-h" || k == "--help" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        if k == "--no-ps" {
            a.ps = false;
            continue;
        }
        let v = it
            .next()
            .with_context(|| format!("{k} needs a value\n{USAGE}"))?;
        match k.as_str() {
            "--out" => a.out = PathBuf::from(v),
            "--gpu" => {
                a.gpu = Gpu::parse(&v).with_context(|| format!("unknown GPU {v:?}\n{USAGE}"))?
            }
            "--scale" => {
                a.scale = match v.split_once('/') {
                    Some((n, d)) => n.parse::<f64>()? / d.parse::<f64>()?,
                    None => v.parse()?,
                }
            }
            "--steps" => a.steps = v.parse()?,
            "--warmup" => a.warmup = v.parse()?,
            "--models" => {
                a.models = v
                    .split(',')
                    .filter(|m| !m.is_empty())
                    .map(|m| models::by_name(m).with_context(|| format!("unknown model {m:?}")))
                    .collect::<Result<_>>()?
            }
            o => bail!("unknown option {o:?}\n{USAGE}"),
        }
    }
    if !(a.scale > 0.0 && a.scale <= 1.0) || a.steps == 0 || a.models.is_empty() {
        bail!("scale must be in (0, 1], steps > 0, models not empty");
    }
    Ok(a)
}

/// The lane a run asks for: plain TCP, or the preload library (whose
/// cross-node connections the daemons carry over RDMA).
#[derive(Clone, Copy, PartialEq)]
enum Lane {
    Tcp,
    Rdma,
}

impl Lane {
    fn name(self) -> &'static str {
        match self {
            Lane::Tcp => "tcp",
            Lane::Rdma => "rdma",
        }
    }
    fn pod_exec(self, pod: &str) -> String {
        match self {
            Lane::Tcp => format!("pod-exec.sh {pod}"),
            Lane::Rdma => format!("pod-exec.sh --lane {pod}"),
        }
    }
}

/// What one node's daemon counted so far.
struct Counters {
    rdma_opened: u64,
    rdma_bytes: u64,
    fallbacks: std::collections::BTreeMap<String, u64>,
}

fn counters(rig: &RdmaRig, node: u8) -> Option<Counters> {
    let s = rig.daemon_stats(node).ok()?;
    let rdma = s.lanes.get("rdma");
    Some(Counters {
        rdma_opened: rdma.map(|l| l.connections_opened).unwrap_or(0),
        rdma_bytes: rdma.map(|l| l.bytes).unwrap_or(0),
        fallbacks: s.fallbacks,
    })
}

fn evidence(before: &[Option<Counters>], after: &[Option<Counters>]) -> LaneEvidence {
    let mut e = LaneEvidence {
        counters_read: true,
        ..Default::default()
    };
    for (i, (b, a)) in before.iter().zip(after).enumerate() {
        let (Some(b), Some(a)) = (b, a) else {
            e.counters_read = false;
            continue;
        };
        // Every connection of a run between the two guests passes through
        // both daemons: count it once, on node 1.
        if i == 0 {
            e.rdma_connections = a.rdma_opened.saturating_sub(b.rdma_opened);
            e.rdma_bytes = a.rdma_bytes.saturating_sub(b.rdma_bytes);
        }
        for (reason, n) in &a.fallbacks {
            let d = n.saturating_sub(b.fallbacks.get(reason).copied().unwrap_or(0));
            if d > 0 {
                e.tcp_fallbacks += d;
                *e.fallback_reasons.entry(reason.clone()).or_default() += d;
            }
        }
    }
    e
}

/// The daemons' recent warnings and errors: why a failed run failed (a
/// link or stream error shows here, not in the worker's last line).
fn daemon_warnings(rig: &RdmaRig) -> String {
    let mut out = String::new();
    for node in [1u8, 2] {
        let log = rig.node_log(node, "flowlaned.log");
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("WARN") || l.contains("ERROR"))
            .collect();
        out.push_str(&format!("node{node} flowlaned warnings (last 12):\n"));
        for l in &lines[lines.len().saturating_sub(12)..] {
            out.push_str(&format!("  {l}\n"));
        }
    }
    out
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    AllReduce { workers: u32 },
    PsSync,
}

struct Pods {
    ip1: Ipv4Addr,
    ip2: Ipv4Addr,
}

fn steps_args(a: &Args, m: &ModelProfile) -> String {
    // --start-delay-ms: every process of the job listens before anyone
    // connects (a connection racing a listener's start may stay on TCP);
    // the guests are slow, so it is longer than the host demo's.
    format!(
        "--steps {} --warmup {} --compute-ms {:.3} --connect-timeout 60 --start-delay-ms 2000",
        a.steps,
        a.warmup,
        m.compute_s * 1e3
    )
}

fn worker_result(out: &str) -> Result<WorkerResult> {
    let line = out
        .lines()
        .find(|l| l.starts_with('{'))
        .with_context(|| format!("no result line in: {out}"))?;
    serde_json::from_str(line).with_context(|| format!("bad worker output: {line}"))
}

/// Runs one job; returns the workers' results.
fn run_job(
    rig: &RdmaRig,
    a: &Args,
    m: &ModelProfile,
    kind: Kind,
    lane: Lane,
    pods: &Pods,
    port: u16,
) -> Result<Vec<WorkerResult>> {
    let train = "$FLOWLANE_BIN_DIR/flowlane-train";
    let steps = steps_args(a, m);
    let p = m.params;
    let check = |o: flowlane_cluster::rdma_rig::JobOutput| -> Result<String> {
        if !o.success() {
            bail!(
                "node{} exit {}: {}",
                o.node,
                o.status,
                o.stderr.lines().last().unwrap_or("")
            );
        }
        Ok(o.stdout)
    };
    let outs = match kind {
        Kind::AllReduce { workers: 1 } => vec![check(rig.run(
            1,
            &format!(
                "{} {train} allreduce-worker --rank 0 --workers 1 --elements {p} {steps}",
                lane.pod_exec(POD1)
            ),
            RUN_TIMEOUT,
        )?)?],
        Kind::AllReduce { .. } => {
            let (ip1, ip2) = (pods.ip1, pods.ip2);
            let r1 = rig.spawn(
                2,
                &format!(
                    "{} {train} allreduce-worker --rank 1 --workers 2 --elements {p} \
                     --listen {ip2}:{port} --next {ip1}:{port} {steps}",
                    lane.pod_exec(POD2)
                ),
                RUN_TIMEOUT,
            )?;
            let r0 = rig.run(
                1,
                &format!(
                    "{} {train} allreduce-worker --rank 0 --workers 2 --elements {p} \
                     --listen {ip1}:{port} --next {ip2}:{port} {steps}",
                    lane.pod_exec(POD1)
                ),
                RUN_TIMEOUT,
            );
            let r1 = r1.wait();
            vec![check(r0?)?, check(r1?)?]
        }
        Kind::PsSync => {
            let ip2 = pods.ip2;
            let srv = rig.spawn(
                2,
                &format!(
                    "{} {train} ps-server --listen {ip2}:{port} --params {p} --shard 0 --shards 1 \
                     --workers 1 --mode sync",
                    lane.pod_exec(POD2)
                ),
                RUN_TIMEOUT,
            )?;
            let w = rig.run(
                1,
                &format!(
                    "{} {train} ps-worker --servers {ip2}:{port} --rank 0 --workers 1 --params {p} {steps}",
                    lane.pod_exec(POD1)
                ),
                RUN_TIMEOUT,
            );
            let s = srv.wait();
            let w = check(w?)?;
            check(s?)?;
            vec![w]
        }
    };
    outs.iter().map(|o| worker_result(o)).collect()
}

fn record(
    rig: &RdmaRig,
    a: &Args,
    m: &ModelProfile,
    kind: Kind,
    lane: Lane,
    pods: &Pods,
    port: u16,
) -> RunRecord {
    // The job's TCP connections (none joins two pods of one node: one pod
    // per guest): a ring of W >= 2 opens W (each member to its successor),
    // a lone member none, the PS job one (its worker to its server).
    let (workload, workers, servers, placement, connections) = match kind {
        Kind::AllReduce { workers: 1 } => ("allreduce", 1, 0, "1 pod".to_string(), 0),
        Kind::AllReduce { workers } => (
            "allreduce",
            workers,
            0,
            format!("cross node {POD1},{POD2}"),
            u64::from(workers),
        ),
        Kind::PsSync => ("ps-sync", 1, 1, format!("cross node {POD1}>{POD2}"), 1),
    };
    let mut rec = RunRecord {
        workload: workload.into(),
        model: m.name.clone(),
        cluster: CLUSTER.into(),
        placement,
        lane_requested: lane.name().into(),
        workers,
        servers,
        batch: m.batch,
        connections,
        same_node_connections: 0,
        ..Default::default()
    };
    let before: Vec<_> = [1, 2].iter().map(|&n| counters(rig, n)).collect();
    let outcome = run_job(rig, a, m, kind, lane, pods, port);
    let after: Vec<_> = [1, 2].iter().map(|&n| counters(rig, n)).collect();
    rec.evidence = evidence(&before, &after);
    rec.lane_measured = report::measured_lane(&rec.evidence);
    match outcome {
        Ok(results) => rec.absorb(&results),
        Err(e) => rec.error = Some(format!("{e:#}")),
    }
    rec
}

fn notes(a: &Args, scaled: &[ModelProfile], rig: &RdmaRig) -> Vec<String> {
    vec![
        format!(
            "RDMA lane ({CLUSTER} rows): measured on the Soft-RoCE rig, two QEMU/TCG guests (1 vCPU each) with rdma_rxe on their NICs, one pod per guest wired by the real plugin, both flowlaned with --lane-transport rdma; boot took {:.0} s. Lane 'asked' rdma = the preload library, whose cross-node connections the daemons relay over RDMA; measured rdma = the first node's daemon counted them on its rdma lane.",
            rig.boot_time().as_secs_f64()
        ),
        format!(
            "The {CLUSTER} rows come from emulated guests: compare their rdma rows only with their own tcp rows (same run, same pair), never with the local clusters' figures. Scale {:.4}, {} warm-up + {} measured steps; as run: {}.",
            a.scale,
            a.warmup,
            a.steps,
            scaled
                .iter()
                .map(|m| format!("{} {:.2} MB gradient, {:.1} ms compute", m.name, m.tensor_bytes() as f64 / 1e6, m.compute_s * 1e3))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    ]
}

fn main() -> Result<()> {
    let a = parse_args()?;
    let start = Instant::now();
    let progress = |s: &str| eprintln!("[rdma-demo {:>6.1}s] {s}", start.elapsed().as_secs_f64());
    progress("booting the Soft-RoCE rig (two QEMU guests)");
    let rig = RdmaRig::boot(&RigConfig::default()).context("booting the Soft-RoCE rig")?;
    progress(&format!("rig up in {:.0?}", rig.boot_time()));
    rig.nodes_up_with_rdma_lane(&[])?;
    let pods = Pods {
        ip1: rig.add_pod(1, POD1).context("pod on node1")?,
        ip2: rig.add_pod(2, POD2).context("pod on node2")?,
    };
    progress(&format!(
        "pods {POD1} {} (node1), {POD2} {} (node2)",
        pods.ip1, pods.ip2
    ));
    // The first connection towards a peer daemon sets the RDMA link up in
    // the background and stays on TCP (the relay never makes a connection
    // wait for it): a tiny ring in both directions first, so the measured
    // runs find the lane up.
    let tiny = ModelProfile {
        name: "warm-up".into(),
        params: 1024,
        compute_s: 0.0,
        batch: 1,
    };
    let warm = Args {
        steps: 1,
        warmup: 0,
        ..a.clone()
    };
    match run_job(
        &rig,
        &warm,
        &tiny,
        Kind::AllReduce { workers: 2 },
        Lane::Rdma,
        &pods,
        7699,
    ) {
        Ok(_) => progress("warm-up ring over the RDMA lane done"),
        Err(e) => progress(&format!("warm-up ring: {e:#} (continuing)")),
    }
    let scaled: Vec<ModelProfile> = a
        .models
        .iter()
        .map(|m| m.on(a.gpu).scaled(a.scale))
        .collect();
    let mut kinds = vec![
        Kind::AllReduce { workers: 1 },
        Kind::AllReduce { workers: 2 },
    ];
    if a.ps {
        kinds.push(Kind::PsSync);
    }
    let mut rep = Report::new(
        "flowlane demo: RDMA lane rows (Soft-RoCE rig)".into(),
        a.gpu.label(),
        a.scale,
        notes(&a, &scaled, &rig),
    );
    let total = scaled.len() * kinds.len() * 2;
    let mut port = 7700u16;
    for m in &scaled {
        for &kind in &kinds {
            for lane in [Lane::Tcp, Lane::Rdma] {
                port += 1;
                let r = record(&rig, &a, m, kind, lane, &pods, port);
                progress(&format!(
                    "({}/{total}) {} {} W={} {} asked {} measured {}: {}",
                    rep.runs.len() + 1,
                    r.workload,
                    r.model,
                    r.workers,
                    r.placement,
                    r.lane_requested,
                    r.lane_measured,
                    match &r.error {
                        Some(e) => format!("FAILED: {e}"),
                        None => format!(
                            "{:.1} images/s, step {:.1} ms = compute {:.1} + comm {:.1}",
                            r.images_per_s,
                            r.step_s * 1e3,
                            r.compute_s * 1e3,
                            r.comm_s * 1e3
                        ),
                    }
                ));
                if r.error.is_some() {
                    progress(&daemon_warnings(&rig));
                }
                rep.runs.push(r);
            }
        }
    }
    let _ = rig.del_pod(1, POD1);
    let _ = rig.del_pod(2, POD2);
    rig.shutdown();
    rep.finish();
    let text = serde_json::to_string_pretty(&rep)?;
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&a.out, text).with_context(|| format!("writing {}", a.out.display()))?;
    println!("{}", rep.table());
    let failed = rep.runs.iter().filter(|r| r.error.is_some()).count();
    let unproven = rep
        .runs
        .iter()
        .filter(|r| r.lane_requested == "rdma" && r.workers + r.servers > 1)
        .filter(|r| !r.lane_measured.starts_with("rdma"))
        .count();
    println!(
        "{} rows in {:.0} s -> {}{}{}",
        rep.runs.len(),
        start.elapsed().as_secs_f64(),
        a.out.display(),
        if failed > 0 {
            format!(", {failed} FAILED")
        } else {
            String::new()
        },
        if unproven > 0 {
            format!(", {unproven} cross-node rdma row(s) WITHOUT rdma counter evidence")
        } else {
            String::new()
        }
    );
    if failed > 0 || unproven > 0 {
        std::process::exit(1);
    }
    Ok(())
}
