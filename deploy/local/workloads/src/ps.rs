//! TensorFlow-style parameter servers: `P` servers each own a contiguous
//! shard of the parameters; each step every worker pushes its gradient shard
//! to every server and pulls the updated shard back.
//!
//! - **Synchronous**: a server applies the average of all `W` workers'
//!   gradients for a step, then answers all of them (a barrier per step).
//! - **Asynchronous**: a server applies each push as it arrives and answers
//!   that worker at once (stale gradients, no barrier), with the learning
//!   rate divided by `W` so that `W` pushes move as far as one synchronous step.

use std::io::{self, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::{Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::stats::{compute_until, StepClock, WorkerResult};
use crate::toy;
use crate::wire::{self, Kind};

/// How long a server waits for the slowest worker of a step before giving up.
const BARRIER_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Sync,
    Async,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sync" => Ok(Mode::Sync),
            "async" => Ok(Mode::Async),
            other => Err(format!("mode must be sync or async, not {other:?}")),
        }
    }
}

/// The coordinates server `shard` of `shards` owns out of `params`.
pub fn shard_range(shard: u32, shards: u32, params: usize) -> Range<usize> {
    let shards = shards.max(1) as usize;
    let shard = shard as usize;
    let base = params / shards;
    let extra = params % shards;
    let start = shard * base + shard.min(extra);
    let len = base + usize::from(shard < extra);
    start..start + len
}

/// One parameter server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub shard: u32,
    pub shards: u32,
    pub params: usize,
    pub workers: u32,
    pub mode: Mode,
    /// Learning rate of plain SGD.
    pub lr: f32,
}

/// What a server did, for logs and tests.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServerSummary {
    pub updates: u64,
    pub bytes_received: u64,
}

struct Aggregate {
    sum: Vec<f32>,
    count: u32,
    generation: u64,
}

struct Shard {
    cfg: ServerConfig,
    params: RwLock<Vec<f32>>,
    agg: Mutex<Aggregate>,
    barrier: Condvar,
    updates: Mutex<u64>,
}

/// Serves `cfg.workers` workers on `listener` until every one has said bye
/// (or hung up). Parameters start at zero.
pub fn serve(listener: TcpListener, cfg: ServerConfig) -> io::Result<ServerSummary> {
    let len = shard_range(cfg.shard, cfg.shards, cfg.params).len();
    let shard = Shard {
        params: RwLock::new(vec![0.0; len]),
        agg: Mutex::new(Aggregate {
            sum: vec![0.0; len],
            count: 0,
            generation: 0,
        }),
        barrier: Condvar::new(),
        updates: Mutex::new(0),
        cfg,
    };
    let mut conns = Vec::new();
    for _ in 0..shard.cfg.workers {
        let (s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        conns.push(s);
    }
    let received = std::thread::scope(|scope| {
        let handles: Vec<_> = conns
            .into_iter()
            .map(|s| scope.spawn(|| serve_worker(&shard, s, len)))
            .collect();
        let mut total = 0u64;
        let mut first_err = None;
        for h in handles {
            match h.join() {
                Ok(Ok(n)) => total += n,
                Ok(Err(e)) => {
                    // A failed worker would leave the others waiting at
                    // the barrier: wake them so they fail too.
                    shard.barrier.notify_all();
                    first_err.get_or_insert(e);
                }
                Err(_) => {
                    first_err.get_or_insert(io::Error::other("server thread panicked"));
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(total),
        }
    })?;
    let updates = *shard.updates.lock().unwrap_or_else(|e| e.into_inner());
    Ok(ServerSummary {
        updates,
        bytes_received: received,
    })
}

fn serve_worker(shard: &Shard, mut s: TcpStream, len: usize) -> io::Result<u64> {
    wire::expect_header(&mut s, Kind::Hello, 0)?;
    let mut grad = vec![0f32; len];
    let mut received = 0u64;
    loop {
        let h = match wire::read_header(&mut s) {
            Ok(h) => h,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(received),
            Err(e) => return Err(e),
        };
        match h.kind {
            Kind::Bye => return Ok(received),
            Kind::Push if h.count as usize == len => {}
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "server expected a push of {len} values, got {other:?} x{}",
                        h.count
                    ),
                ))
            }
        }
        s.read_exact(wire::as_bytes_mut(&mut grad))?;
        received += 16 + 4 * len as u64;
        match shard.cfg.mode {
            Mode::Sync => apply_sync(shard, &grad)?,
            Mode::Async => {
                let mut p = shard.params.write().unwrap_or_else(|e| e.into_inner());
                // One push is one worker's share of an averaged step.
                let lr = shard.cfg.lr / shard.cfg.workers as f32;
                for (x, g) in p.iter_mut().zip(&grad) {
                    *x -= lr * g;
                }
                *shard.updates.lock().unwrap_or_else(|e| e.into_inner()) += 1;
            }
        }
        let p = shard.params.read().unwrap_or_else(|e| e.into_inner());
        wire::write_frame(&mut s, Kind::Params, h.step, &p)?;
    }
}

/// Adds `grad` to the step's aggregate; the last worker of the step applies
/// the average, everyone else waits for that.
fn apply_sync(shard: &Shard, grad: &[f32]) -> io::Result<()> {
    let mut agg = shard.agg.lock().unwrap_or_else(|e| e.into_inner());
    for (a, g) in agg.sum.iter_mut().zip(grad) {
        *a += g;
    }
    agg.count += 1;
    if agg.count == shard.cfg.workers {
        let scale = shard.cfg.lr / shard.cfg.workers as f32;
        {
            let mut p = shard.params.write().unwrap_or_else(|e| e.into_inner());
            for (x, a) in p.iter_mut().zip(agg.sum.iter_mut()) {
                *x -= scale * *a;
                *a = 0.0;
            }
        }
        agg.count = 0;
        agg.generation += 1;
        *shard.updates.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        shard.barrier.notify_all();
        return Ok(());
    }
    let generation = agg.generation;
    let deadline = Instant::now() + BARRIER_TIMEOUT;
    while agg.generation == generation {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "a worker never pushed its gradient for this step",
            ));
        }
        agg = shard
            .barrier
            .wait_timeout(agg, left.min(Duration::from_secs(1)))
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
    Ok(())
}

/// One worker.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub rank: u32,
    pub workers: u32,
    /// One address per parameter server, in shard order.
    pub servers: Vec<SocketAddr>,
    pub params: usize,
    /// Measured steps.
    pub steps: u32,
    /// Steps run before measuring (connection set-up, page faults).
    pub warmup: u32,
    /// Emulated compute time per step.
    pub compute: Duration,
    /// How long to retry connecting to servers that are not up yet.
    pub connect_deadline: Duration,
}

/// Runs the worker's steps against the servers; returns its measurements,
/// with the toy objective's value before and after.
pub fn run_worker(cfg: &WorkerConfig) -> io::Result<WorkerResult> {
    let shards = cfg.servers.len() as u32;
    if shards == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "no parameter servers",
        ));
    }
    let mut conns = Vec::new();
    for addr in &cfg.servers {
        let mut s = wire::connect_retry(*addr, cfg.connect_deadline)?;
        wire::write_header(&mut s, Kind::Hello, cfg.rank, 0)?;
        conns.push(s);
    }
    let ranges: Vec<Range<usize>> = (0..shards)
        .map(|p| shard_range(p, shards, cfg.params))
        .collect();
    let mut w = vec![0f32; cfg.params];
    let mut grad = vec![0f32; cfg.params];
    let loss_first = toy::loss(&w);
    let mut clock = StepClock::new(cfg.warmup);
    let bytes_per_step: u64 = ranges.iter().map(|r| 16 + 4 * r.len() as u64).sum();
    for step in 0..cfg.warmup + cfg.steps {
        // The gradient (a GPU's output) is made before the step's clock
        // starts: on fast GPU profiles producing it on this CPU would take
        // longer than the modelled compute.
        toy::gradient(cfg.rank, cfg.workers, 0, &w, &mut grad);
        let t0 = Instant::now();
        compute_until(t0, cfg.compute);
        let t1 = Instant::now();
        exchange(&mut conns, &ranges, step, &grad, &mut w)?;
        let t2 = Instant::now();
        clock.step(t1 - t0, t2 - t1, bytes_per_step, bytes_per_step);
    }
    for s in &mut conns {
        let _ = wire::write_header(s, Kind::Bye, 0, 0);
    }
    let mut r = clock.into_result("ps-worker", cfg.rank, cfg.workers);
    r.tensor_bytes = 4 * cfg.params as u64;
    r.loss_first = Some(loss_first);
    r.loss_last = Some(toy::loss(&w));
    Ok(r)
}

/// Pushes every shard of `grad` and pulls every shard of `w`, all servers in
/// parallel (as TensorFlow's send/recv ops run concurrently).
fn exchange(
    conns: &mut [TcpStream],
    ranges: &[Range<usize>],
    step: u32,
    grad: &[f32],
    w: &mut [f32],
) -> io::Result<()> {
    let mut w_rest = w;
    let mut jobs = Vec::new();
    for (conn, r) in conns.iter_mut().zip(ranges) {
        let (mine, rest) = w_rest.split_at_mut(r.len());
        w_rest = rest;
        jobs.push((conn, &grad[r.clone()], mine));
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .into_iter()
            .map(|(conn, g, mine)| {
                scope.spawn(move || -> io::Result<()> {
                    wire::write_frame(conn, Kind::Push, step, g)?;
                    wire::expect_header(conn, Kind::Params, mine.len())?;
                    conn.read_exact(wire::as_bytes_mut(mine))
                })
            })
            .collect();
        for h in handles {
            h.join()
                .map_err(|_| io::Error::other("exchange thread panicked"))??;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_everything_once() {
        for n in [0usize, 1, 7, 100, 101] {
            for p in 1..5 {
                let mut next = 0;
                for s in 0..p {
                    let r = shard_range(s, p, n);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }
}
