//! `flowlane-train`: the training-traffic generators as processes, one role
//! per process, as they run in the pods of a cluster. Workers print their
//! measurements as one JSON line on stdout; everything else goes to stderr.

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use flowlane_workloads::{allreduce, local, models, ps};

#[derive(Parser)]
#[command(
    name = "flowlane-train",
    about = "training-traffic generators (parameter server, ring all-reduce)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// A parameter server owning one shard of the parameters.
    PsServer {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long, default_value_t = 0)]
        shard: u32,
        #[arg(long, default_value_t = 1)]
        shards: u32,
        #[arg(long)]
        params: usize,
        #[arg(long)]
        workers: u32,
        #[arg(long, default_value = "sync")]
        mode: ps::Mode,
        #[arg(long, default_value_t = 0.5)]
        lr: f32,
    },
    /// A worker pushing gradients to and pulling parameters from every server.
    PsWorker {
        /// Server addresses in shard order, comma-separated.
        #[arg(long, value_delimiter = ',')]
        servers: Vec<SocketAddr>,
        #[arg(long)]
        rank: u32,
        #[arg(long)]
        workers: u32,
        #[arg(long)]
        params: usize,
        #[command(flatten)]
        steps: Steps,
    },
    /// A member of an all-reduce ring.
    AllreduceWorker {
        /// Where this member accepts its predecessor.
        #[arg(long)]
        listen: Option<SocketAddr>,
        /// The successor's listen address.
        #[arg(long)]
        next: Option<SocketAddr>,
        #[arg(long)]
        rank: u32,
        #[arg(long)]
        workers: u32,
        /// f32 values in the all-reduced tensor.
        #[arg(long)]
        elements: usize,
        #[command(flatten)]
        steps: Steps,
    },
    /// A whole job in this process on loopback (threads), printing every
    /// worker's result.
    Local {
        /// ps-sync, ps-async or allreduce.
        #[arg(long)]
        workload: String,
        #[arg(long)]
        workers: u32,
        #[arg(long, default_value_t = 1)]
        servers: u32,
        #[arg(long)]
        params: usize,
        #[command(flatten)]
        steps: Steps,
    },
    /// The model profiles as JSON.
    Models {
        /// Multiply tensors and compute times by this.
        #[arg(long, default_value_t = 1.0)]
        scale: f64,
    },
}

#[derive(clap::Args)]
struct Steps {
    #[arg(long, default_value_t = 5)]
    steps: u32,
    #[arg(long, default_value_t = 1)]
    warmup: u32,
    /// Emulated compute per step, milliseconds.
    #[arg(long, default_value_t = 0.0)]
    compute_ms: f64,
    /// Seconds to keep retrying connections to peers not up yet.
    #[arg(long, default_value_t = 60)]
    connect_timeout: u64,
    /// Milliseconds to wait after starting to listen, before connecting to
    /// peers (so that every peer of the job listens before anyone connects).
    #[arg(long, default_value_t = 0)]
    start_delay_ms: u64,
}

impl Steps {
    fn start_delay(&self) {
        std::thread::sleep(Duration::from_millis(self.start_delay_ms));
    }

    fn compute(&self) -> Duration {
        Duration::from_secs_f64(self.compute_ms.max(0.0) / 1e3)
    }
}

fn print(r: &flowlane_workloads::stats::WorkerResult) -> Result<()> {
    println!("{}", serde_json::to_string(r)?);
    Ok(())
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::PsServer {
            listen,
            shard,
            shards,
            params,
            workers,
            mode,
            lr,
        } => {
            if shard >= shards {
                bail!("--shard {shard} must be below --shards {shards}");
            }
            let l = TcpListener::bind(listen).with_context(|| format!("listen on {listen}"))?;
            let cfg = ps::ServerConfig {
                shard,
                shards,
                params,
                workers,
                mode,
                lr,
            };
            let s = ps::serve(l, cfg).context("parameter server")?;
            eprintln!(
                "ps-server shard {shard}: {} updates, {} bytes received",
                s.updates, s.bytes_received
            );
        }
        Cmd::PsWorker {
            servers,
            rank,
            workers,
            params,
            steps,
        } => {
            steps.start_delay();
            let cfg = ps::WorkerConfig {
                rank,
                workers,
                servers,
                params,
                steps: steps.steps,
                warmup: steps.warmup,
                compute: steps.compute(),
                connect_deadline: Duration::from_secs(steps.connect_timeout),
            };
            print(&ps::run_worker(&cfg).context("parameter-server worker")?)?;
        }
        Cmd::AllreduceWorker {
            listen,
            next,
            rank,
            workers,
            elements,
            steps,
        } => {
            if rank >= workers {
                bail!("--rank {rank} must be below --workers {workers}");
            }
            let listener = match (workers, listen) {
                (1, _) => None,
                (_, Some(a)) => {
                    Some(TcpListener::bind(a).with_context(|| format!("listen on {a}"))?)
                }
                (_, None) => bail!("--listen is required with more than one worker"),
            };
            steps.start_delay();
            let cfg = allreduce::RingConfig {
                rank,
                workers,
                next,
                elements,
                steps: steps.steps,
                warmup: steps.warmup,
                compute: steps.compute(),
                connect_deadline: Duration::from_secs(steps.connect_timeout),
            };
            print(&allreduce::run_worker(&cfg, listener).context("all-reduce worker")?)?;
        }
        Cmd::Local {
            workload,
            workers,
            servers,
            params,
            steps,
        } => {
            let results = match workload.as_str() {
                "allreduce" => local::run_ring(&local::RingJob {
                    workers,
                    elements: params,
                    steps: steps.steps,
                    warmup: steps.warmup,
                    compute: steps.compute(),
                })?,
                "ps-sync" | "ps-async" => local::run_ps(&local::PsJob {
                    servers,
                    workers,
                    params,
                    steps: steps.steps,
                    warmup: steps.warmup,
                    compute: steps.compute(),
                    mode: if workload == "ps-sync" {
                        ps::Mode::Sync
                    } else {
                        ps::Mode::Async
                    },
                    lr: 0.5,
                })?,
                other => bail!("unknown workload {other:?} (ps-sync, ps-async, allreduce)"),
            };
            for r in &results {
                print(r)?;
            }
        }
        Cmd::Models { scale } => {
            if !(scale > 0.0 && scale <= 1.0) {
                bail!("--scale must be in (0, 1]");
            }
            let m: Vec<_> = models::talk_models()
                .iter()
                .map(|m| m.scaled(scale))
                .collect();
            println!("{}", serde_json::to_string_pretty(&m)?);
        }
    }
    Ok(())
}
