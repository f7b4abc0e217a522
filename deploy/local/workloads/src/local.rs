//! Whole jobs inside one process, every role a thread on loopback: for
//! tests and for trying a configuration without a cluster.

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use crate::allreduce::{self, RingConfig};
use crate::ps::{self, Mode, ServerConfig, WorkerConfig};
use crate::stats::WorkerResult;

fn bind() -> io::Result<(TcpListener, SocketAddr)> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let a = l.local_addr()?;
    Ok((l, a))
}

/// A parameter-server job: `servers` shards, `workers` workers.
#[derive(Debug, Clone)]
pub struct PsJob {
    pub servers: u32,
    pub workers: u32,
    pub params: usize,
    pub steps: u32,
    pub warmup: u32,
    pub compute: Duration,
    pub mode: Mode,
    pub lr: f32,
}

/// Runs a PS job; returns the workers' results in rank order.
pub fn run_ps(job: &PsJob) -> io::Result<Vec<WorkerResult>> {
    let mut listeners = Vec::new();
    let mut addrs = Vec::new();
    for _ in 0..job.servers {
        let (l, a) = bind()?;
        listeners.push(l);
        addrs.push(a);
    }
    std::thread::scope(|scope| {
        let servers: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(i, l)| {
                let cfg = ServerConfig {
                    shard: i as u32,
                    shards: job.servers,
                    params: job.params,
                    workers: job.workers,
                    mode: job.mode,
                    lr: job.lr,
                };
                scope.spawn(move || ps::serve(l, cfg))
            })
            .collect();
        let workers: Vec<_> = (0..job.workers)
            .map(|rank| {
                let cfg = WorkerConfig {
                    rank,
                    workers: job.workers,
                    servers: addrs.clone(),
                    params: job.params,
                    steps: job.steps,
                    warmup: job.warmup,
                    compute: job.compute,
                    connect_deadline: Duration::from_secs(10),
                };
                scope.spawn(move || ps::run_worker(&cfg))
            })
            .collect();
        let mut results = Vec::new();
        for w in workers {
            results.push(
                w.join()
                    .map_err(|_| io::Error::other("worker panicked"))??,
            );
        }
        for s in servers {
            s.join()
                .map_err(|_| io::Error::other("server panicked"))??;
        }
        Ok(results)
    })
}

/// A ring all-reduce job.
#[derive(Debug, Clone)]
pub struct RingJob {
    pub workers: u32,
    pub elements: usize,
    pub steps: u32,
    pub warmup: u32,
    pub compute: Duration,
}

/// Runs a ring job; returns the workers' results in rank order.
pub fn run_ring(job: &RingJob) -> io::Result<Vec<WorkerResult>> {
    let mut listeners = Vec::new();
    let mut addrs = Vec::new();
    for _ in 0..job.workers {
        let (l, a) = bind()?;
        listeners.push(l);
        addrs.push(a);
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(rank, l)| {
                let cfg = RingConfig {
                    rank: rank as u32,
                    workers: job.workers,
                    next: Some(addrs[(rank + 1) % addrs.len()]),
                    elements: job.elements,
                    steps: job.steps,
                    warmup: job.warmup,
                    compute: job.compute,
                    connect_deadline: Duration::from_secs(10),
                };
                scope.spawn(move || allreduce::run_worker(&cfg, Some(l)))
            })
            .collect();
        let mut results = Vec::new();
        for h in handles {
            results.push(
                h.join()
                    .map_err(|_| io::Error::other("worker panicked"))??,
            );
        }
        Ok(results)
    })
}
