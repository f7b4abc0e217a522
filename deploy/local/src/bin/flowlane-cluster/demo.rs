//! `flowlane demo`: the training-traffic demo and its report. The work is
//! done by `flowlane_cluster::demo` (`deploy/local/`); this module reads the
//! command line and prints where the report went.

use std::time::Instant;

use flowlane_cluster::demo::{self, DemoConfig, Lane, Workload};
use flowlane_cluster::Binaries;
use flowlane_workloads::models::Gpu;

use crate::args::{DemoArgs, Only};

fn model(m: &str) -> Result<flowlane_workloads::models::ModelProfile, String> {
    flowlane_workloads::models::by_name(m).ok_or_else(|| format!("unknown model {m:?}"))
}

fn list<T>(v: &[String], f: impl Fn(&str) -> Result<T, String>) -> Result<Vec<T>, String> {
    v.iter()
        .filter(|s| !s.is_empty())
        .map(|s| f(s.trim()))
        .collect()
}

/// The demo's configuration from its command line.
fn config(a: DemoArgs) -> Result<DemoConfig, String> {
    let mut cfg = DemoConfig::default_for(a.out);
    if let Some(v) = a.scale {
        cfg.scale = v;
    }
    if let Some(v) = a.steps {
        cfg.steps = v;
    }
    if let Some(v) = a.warmup {
        cfg.warmup = v;
    }
    if let Some(v) = &a.models {
        cfg.models = list(v, model)?;
    }
    if let Some(v) = &a.gpu {
        cfg.gpu =
            Gpu::parse(v).ok_or_else(|| format!("unknown GPU {v:?} (K80, V100, A100, H100)"))?;
    }
    if let Some(v) = &a.workloads {
        cfg.workloads = list(v, Workload::parse)?;
    }
    if let Some(v) = &a.lanes {
        cfg.lanes = list(v, |l| match l {
            "tcp" => Ok(Lane::Tcp),
            "shm" => Ok(Lane::Shm),
            o => Err(format!("unknown lane {o:?} (tcp, shm)")),
        })?;
    }
    cfg.rdma = a.rdma;
    match a.only {
        Some(Only::Single) => cfg.two_nodes = false,
        Some(Only::Two) => cfg.single_node = false,
        Some(Only::Rdma) => {
            cfg.single_node = false;
            cfg.two_nodes = false;
            cfg.rdma = true;
        }
        None => {}
    }
    if let Some(v) = a.plugin {
        cfg.plugin = v;
    }
    cfg.rdma_rows = a.rdma_rows;
    if let Some(v) = &a.rdma_models {
        cfg.rdma_models = list(v, model)?;
    }
    if let Some(v) = a.run_root {
        cfg.run_root = v;
    }
    if let Some(v) = a.cluster_prefix {
        cfg.cluster_prefix = v;
    }
    if let Some(ip) = a.pod_network {
        let o = ip.octets();
        cfg.pod_network = [o[0], o[1]];
    }
    if cfg.steps == 0 || cfg.models.is_empty() || cfg.workloads.is_empty() || cfg.lanes.is_empty() {
        return Err("steps, models, workloads and lanes must not be empty".into());
    }
    Ok(cfg)
}

pub fn main(args: DemoArgs) -> i32 {
    let cfg = match config(args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("flowlane demo: {e} (flowlane demo --help)");
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
