//! `flowlane demo`: the training-traffic demo and its report. The work is
//! done by `flowlane_cluster::demo` (`deploy/local/`); this module reads the
//! command line and prints where the report went.

use std::path::PathBuf;
use std::time::Instant;

use flowlane_cluster::demo::{self, DemoConfig, Lane, Workload};
use flowlane_cluster::Binaries;
use flowlane_workloads::models::Gpu;

const USAGE: &str = "\
usage: flowlane demo [--out DIR] [options]

Brings up local clusters (1 node x 4 pods, then 2 nodes x 2 pods), runs
ring all-reduce and parameter-server training traffic for GoogLeNet,
Inception v3, ResNet-50 and VGG16 over plain TCP and over flowlane's
shared-memory lane, and writes report.json, report.md, report.html (findings
first, the chart inline) and scaling.svg.

options:
  --out DIR              where the report goes (default ./flowlane-report)
  --scale F              fraction of real model size, tensors and compute (default 1/12)
  --steps N              measured steps per run (default 5)
  --warmup N             unmeasured first steps (default 1)
  --models a,b           googlenet,inception3,resnet50,vgg16 (default all)
  --gpu NAME             K80, V100, A100 or H100: whose compute times per step
                         (default A100, mixed precision; H100 is an assumption)
  --workloads a,b        allreduce,ps-sync,ps-async (default allreduce,ps-sync)
  --lanes a,b            tcp,shm (default both)
  --only single|two|rdma only the 1x4, only the 2x2 cluster, or only the rig (--rdma)
  --plugin flowlane|bridge   CNI plugin wiring the pods (default flowlane)
  --run-root DIR         cluster state (default /run/flowlane-cluster)
  --cluster-prefix NAME  cluster names NAME1, NAME2 (default demo)
  --pod-network A.B.0.0  the pods' /16 (default 10.210.0.0)
  --rdma                 also measure the RDMA lane between the two guests of the
                         Soft-RoCE rig (runs rdma-demo: needs qemu, takes minutes)
  --rdma-models a,b      the models the rig runs (default googlenet,resnet50)
  --rdma-rows FILE       merge RDMA-lane rows recorded earlier by rdma-demo
";

fn list<T>(v: &str, f: impl Fn(&str) -> Result<T, String>) -> Result<Vec<T>, String> {
    v.split(',')
        .filter(|s| !s.is_empty())
        .map(|s| f(s.trim()))
        .collect()
}

fn parse(args: &[String]) -> Result<DemoConfig, String> {
    let mut cfg = DemoConfig::default_for(PathBuf::from("flowlane-report"));
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "-h" || a == "--help" {
            return Err(String::new());
        }
        if a == "--rdma" {
            cfg.rdma = true;
            continue;
        }
        let v = it.next().ok_or_else(|| format!("{a} needs a value"))?;
        let num = |what: &str| format!("{what}: not a number: {v:?}");
        match a.as_str() {
            "--out" => cfg.out = PathBuf::from(v),
            "--scale" => {
                cfg.scale = match v.split_once('/') {
                    Some((n, d)) => {
                        n.parse::<f64>().map_err(|_| num(a))?
                            / d.parse::<f64>().map_err(|_| num(a))?
                    }
                    None => v.parse().map_err(|_| num(a))?,
                }
            }
            "--steps" => cfg.steps = v.parse().map_err(|_| num(a))?,
            "--warmup" => cfg.warmup = v.parse().map_err(|_| num(a))?,
            "--models" => {
                cfg.models = list(v, |m| {
                    flowlane_workloads::models::by_name(m)
                        .ok_or_else(|| format!("unknown model {m:?}"))
                })?
            }
            "--gpu" => {
                cfg.gpu = Gpu::parse(v)
                    .ok_or_else(|| format!("unknown GPU {v:?} (K80, V100, A100, H100)"))?
            }
            "--workloads" => cfg.workloads = list(v, Workload::parse)?,
            "--lanes" => {
                cfg.lanes = list(v, |l| match l {
                    "tcp" => Ok(Lane::Tcp),
                    "shm" => Ok(Lane::Shm),
                    o => Err(format!("unknown lane {o:?} (tcp, shm)")),
                })?
            }
            "--only" => match v.as_str() {
                "single" => cfg.two_nodes = false,
                "two" => cfg.single_node = false,
                "rdma" => {
                    cfg.single_node = false;
                    cfg.two_nodes = false;
                    cfg.rdma = true;
                }
                o => return Err(format!("--only single, two or rdma, not {o:?}")),
            },
            "--plugin" => cfg.plugin = v.parse()?,
            "--rdma-rows" => cfg.rdma_rows = Some(PathBuf::from(v)),
            "--rdma-models" => {
                cfg.rdma_models = list(v, |m| {
                    flowlane_workloads::models::by_name(m)
                        .ok_or_else(|| format!("unknown model {m:?}"))
                })?
            }
            "--run-root" => cfg.run_root = PathBuf::from(v),
            "--cluster-prefix" => cfg.cluster_prefix = v.clone(),
            "--pod-network" => {
                let ip: std::net::Ipv4Addr = v
                    .strip_suffix("/16")
                    .unwrap_or(v)
                    .parse()
                    .map_err(|e| format!("--pod-network: {e}"))?;
                let o = ip.octets();
                cfg.pod_network = [o[0], o[1]];
            }
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    if cfg.steps == 0 || cfg.models.is_empty() || cfg.workloads.is_empty() || cfg.lanes.is_empty() {
        return Err("steps, models, workloads and lanes must not be empty".into());
    }
    Ok(cfg)
}

pub fn main(args: &[String]) -> i32 {
    let cfg = match parse(args) {
        Ok(c) => c,
        Err(e) if e.is_empty() => {
            print!("{USAGE}");
            return 0;
        }
        Err(e) => {
            eprintln!("flowlane demo: {e}\n\n{USAGE}");
            return 2;
        }
    };
    let bins = match Binaries::beside_current_exe() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("flowlane demo: cannot locate binaries: {e}");
            return 1;
        }
    };
    let start = Instant::now();
    let progress = |s: &str| eprintln!("[demo {:>5.1}s] {s}", start.elapsed().as_secs_f64());
    let rep = match demo::run(&cfg, &bins, &progress) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("flowlane demo: {e}");
            return 1;
        }
    };
    let files = match demo::write_report(&rep, &cfg.out) {
        Ok(f) => f,
        Err(e) => {
            eprintln!(
                "flowlane demo: writing the report into {}: {e}",
                cfg.out.display()
            );
            return 1;
        }
    };
    println!("{}", rep.table());
    println!("Findings:");
    for f in &rep.findings {
        println!("- {}", f.text);
    }
    let failed = rep.runs.iter().filter(|r| r.error.is_some()).count();
    println!(
        "{} runs in {:.0} s{}",
        rep.runs.len(),
        start.elapsed().as_secs_f64(),
        if failed > 0 {
            format!(", {failed} FAILED")
        } else {
            String::new()
        }
    );
    for f in &files {
        let abs = std::fs::canonicalize(f).unwrap_or_else(|_| f.clone());
        println!("report: {}", abs.display());
    }
    i32::from(failed > 0)
}
