//! Ring all-reduce as Horovod (over Gloo or NCCL's socket transport) runs it:
//! `W` workers in a ring, the tensor cut into `W` chunks; `W-1` steps of
//! reduce-scatter (each worker sends one chunk to its successor and adds the
//! chunk it receives from its predecessor) leave every worker owning one
//! fully reduced chunk; `W-1` steps of all-gather pass the reduced chunks
//! around. Every worker sends and receives `2(W-1)/W` of the tensor, whatever
//! `W` is — which is why ring all-reduce scales predictably.

use std::io::{self, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::time::{Duration, Instant};

use crate::ps::shard_range;
use crate::stats::{compute_until, StepClock, WorkerResult};
use crate::wire::{self, Kind};

/// One all-reduce worker.
#[derive(Debug, Clone)]
pub struct RingConfig {
    pub rank: u32,
    pub workers: u32,
    /// The successor's listening address (unused when `workers == 1`).
    pub next: Option<SocketAddr>,
    /// f32 values in the tensor.
    pub elements: usize,
    pub steps: u32,
    pub warmup: u32,
    pub compute: Duration,
    pub connect_deadline: Duration,
}

/// The two TCP connections of a ring member.
pub struct Ring {
    rank: u32,
    workers: u32,
    to_next: Option<TcpStream>,
    from_prev: Option<TcpStream>,
}

impl Ring {
    /// Joins the ring: connects to the successor and accepts the
    /// predecessor on `listener` (in parallel, since everyone does both).
    pub fn join(cfg: &RingConfig, listener: Option<TcpListener>) -> io::Result<Ring> {
        if cfg.workers <= 1 {
            return Ok(Ring {
                rank: cfg.rank,
                workers: 1,
                to_next: None,
                from_prev: None,
            });
        }
        let listener = listener
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "ring needs a listener"))?;
        let next = cfg
            .next
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "ring needs a successor"))?;
        let deadline = cfg.connect_deadline;
        let (to_next, from_prev) = std::thread::scope(|scope| {
            let out = scope.spawn(move || wire::connect_retry(next, deadline));
            let inc = listener.accept().map(|(s, _)| s);
            let out = out
                .join()
                .map_err(|_| io::Error::other("connect thread panicked"))?;
            Ok::<_, io::Error>((out?, inc?))
        })?;
        from_prev.set_nodelay(true)?;
        Ok(Ring {
            rank: cfg.rank,
            workers: cfg.workers,
            to_next: Some(to_next),
            from_prev: Some(from_prev),
        })
    }

    /// Sums `buf` across the ring in place; returns the bytes this member
    /// sent (equal to the bytes it received).
    pub fn allreduce(&mut self, buf: &mut [f32], scratch: &mut Vec<f32>) -> io::Result<u64> {
        let w = self.workers;
        let (Some(to_next), Some(from_prev)) = (self.to_next.as_mut(), self.from_prev.as_mut())
        else {
            return Ok(0);
        };
        let r = self.rank;
        let n = buf.len();
        let chunk = |i: u32| shard_range(i % w, w, n);
        let mut sent = 0u64;
        // Reduce-scatter.
        for k in 0..w - 1 {
            let s = chunk(r + w - k);
            let t = chunk(r + 2 * w - k - 1);
            scratch.resize(t.len(), 0.0);
            let (out, into) = disjoint(buf, s, t);
            send_recv(to_next, out, from_prev, scratch, k)?;
            for (a, b) in into.iter_mut().zip(scratch.iter()) {
                *a += b;
            }
            sent += 16 + 4 * out.len() as u64;
        }
        // All-gather.
        for k in 0..w - 1 {
            let s = chunk(r + 1 + w - k);
            let t = chunk(r + w - k);
            let (out, into) = disjoint(buf, s, t);
            send_recv(to_next, out, from_prev, into, w + k)?;
            sent += 16 + 4 * out.len() as u64;
        }
        Ok(sent)
    }
}

/// A shared view of `s` and an exclusive view of `t` (two different chunks).
fn disjoint(buf: &mut [f32], s: Range<usize>, t: Range<usize>) -> (&[f32], &mut [f32]) {
    assert!(s.end <= t.start || t.end <= s.start, "chunks overlap");
    if s.start < t.start {
        let (a, b) = buf.split_at_mut(t.start);
        (&a[s], &mut b[..t.len()])
    } else {
        let (a, b) = buf.split_at_mut(s.start);
        (&b[..s.len()], &mut a[t])
    }
}

/// Sends `out` to the successor while receiving `into` from the predecessor:
/// concurrently, or a ring of large chunks would deadlock with every member
/// blocked in `write`.
fn send_recv(
    to_next: &mut TcpStream,
    out: &[f32],
    from_prev: &mut TcpStream,
    into: &mut [f32],
    tag: u32,
) -> io::Result<()> {
    std::thread::scope(|scope| {
        let sender = scope.spawn(|| wire::write_frame(to_next, Kind::Chunk, tag, out));
        let got = wire::expect_header(from_prev, Kind::Chunk, into.len())
            .and_then(|_| from_prev.read_exact(wire::as_bytes_mut(into)));
        let sent = sender
            .join()
            .map_err(|_| io::Error::other("sender thread panicked"))?;
        got.and(sent)
    })
}

/// The value rank `rank` contributes at coordinate `i` in `step`: small
/// integers, so sums are exact in f32 and checkable bit for bit.
pub fn contribution(rank: u32, step: u32, i: usize) -> f32 {
    ((rank as usize + 1) * ((i + step as usize) % 7 + 1)) as f32
}

/// The exact sum over `workers` ranks at coordinate `i` in `step`.
pub fn expected_sum(workers: u32, step: u32, i: usize) -> f32 {
    let w = workers as usize;
    (w * (w + 1) / 2 * ((i + step as usize) % 7 + 1)) as f32
}

/// Runs the worker: each step "computes" a gradient (fills its
/// contribution), all-reduces it and checks every summed value.
pub fn run_worker(cfg: &RingConfig, listener: Option<TcpListener>) -> io::Result<WorkerResult> {
    let mut ring = Ring::join(cfg, listener)?;
    let mut buf = vec![0f32; cfg.elements];
    let mut scratch = Vec::new();
    let mut clock = StepClock::new(cfg.warmup);
    for step in 0..cfg.warmup + cfg.steps {
        // The gradient itself (a GPU's output) is made before the step's
        // clock starts: on fast GPU profiles producing it on this CPU would
        // take longer than the modelled compute.
        for (i, x) in buf.iter_mut().enumerate() {
            *x = contribution(cfg.rank, step, i);
        }
        let t0 = Instant::now();
        compute_until(t0, cfg.compute);
        let t1 = Instant::now();
        let sent = ring.allreduce(&mut buf, &mut scratch)?;
        let t2 = Instant::now();
        if let Some(i) = (0..buf.len()).find(|&i| buf[i] != expected_sum(cfg.workers, step, i)) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "rank {} step {step}: sum at {i} is {}, expected {}",
                    cfg.rank,
                    buf[i],
                    expected_sum(cfg.workers, step, i)
                ),
            ));
        }
        clock.step(t1 - t0, t2 - t1, sent, sent);
    }
    let mut r = clock.into_result("allreduce-worker", cfg.rank, cfg.workers);
    r.tensor_bytes = 4 * cfg.elements as u64;
    r.sums_checked = Some(true);
    Ok(r)
}
