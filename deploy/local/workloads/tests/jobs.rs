//! Whole jobs on loopback: the all-reduce sums and the parameter server's
//! convergence (the numbers a training job depends on).

use std::time::Duration;

use flowlane_workloads::local::{run_ps, run_ring, PsJob, RingJob};
use flowlane_workloads::ps::Mode;

#[test]
fn ring_allreduce_sums_are_exact_for_every_ring_size() {
    // Odd sizes leave chunks of unequal length; 3 elements over 4 workers
    // leaves one chunk empty.
    for (workers, elements) in [(1, 10), (2, 1001), (3, 100_003), (4, 3), (5, 65_536)] {
        let results = run_ring(&RingJob {
            workers,
            elements,
            steps: 3,
            warmup: 1,
            compute: Duration::ZERO,
        })
        .unwrap_or_else(|e| panic!("ring of {workers}: {e}"));
        assert_eq!(results.len(), workers as usize);
        for r in &results {
            assert_eq!(r.sums_checked, Some(true));
            assert_eq!(r.steps, 3);
            if workers > 1 {
                // Each member sends 2(W-1)/W of the tensor per step, plus headers.
                let payload = 4 * elements as u64 * 2 * (workers as u64 - 1) / workers as u64;
                let headers = 16 * 2 * (workers as u64 - 1);
                let per_step = r.bytes_sent / 3;
                assert!(
                    per_step.abs_diff(payload + headers) <= 8 * workers as u64,
                    "ring of {workers}: {per_step} bytes/step, expected ~{}",
                    payload + headers
                );
            }
        }
    }
}

fn ps_job(mode: Mode, servers: u32, workers: u32) -> PsJob {
    PsJob {
        servers,
        workers,
        params: 10_007,
        steps: 20,
        warmup: 0,
        compute: Duration::ZERO,
        mode,
        lr: 0.5,
    }
}

#[test]
fn synchronous_parameter_servers_converge() {
    let results = run_ps(&ps_job(Mode::Sync, 3, 4)).unwrap();
    assert_eq!(results.len(), 4);
    for r in &results {
        let (first, last) = (r.loss_first.unwrap(), r.loss_last.unwrap());
        // Each synchronous step halves the distance (lr 0.5 on the averaged
        // gradient): 20 steps -> factor 4^-20 on the loss. A server that
        // missed any worker's push would settle at a biased point instead
        // (each worker's own target is 0.125+ away from the optimum).
        assert!(first > 0.01, "initial loss {first}");
        assert!(
            last < first * 1e-9,
            "worker {}: loss {first} -> {last}",
            r.rank
        );
    }
    // Every worker ends with the same parameters in synchronous mode.
    let l0 = results[0].loss_last.unwrap();
    assert!(results.iter().all(|r| r.loss_last.unwrap() == l0));
}

#[test]
fn asynchronous_parameter_servers_converge() {
    let results = run_ps(&ps_job(Mode::Async, 2, 3)).unwrap();
    assert_eq!(results.len(), 3);
    // Each push moves the server's shard halfway toward the pushing
    // worker's own target (optimum ± 0.25 per coordinate for 3 workers), so
    // the parameters end inside the hull of the targets, where exactly
    // depends on the order the pushes arrived in: if the scheduler ran one
    // worker's last steps alone, they sit at its target, whose loss is
    // 0.5 * 0.25^2 = 0.03125. A server that lost or misapplied pushes
    // leaves that hull. So: every worker's loss drops, and never ends above
    // the worst single target's loss.
    let worst_target_loss = 0.5 * 0.25f64 * 0.25;
    for r in &results {
        let (first, last) = (r.loss_first.unwrap(), r.loss_last.unwrap());
        assert!(first > worst_target_loss, "initial loss {first}");
        assert!(
            last < first && last <= worst_target_loss * 1.01,
            "worker {}: loss {first} -> {last}",
            r.rank
        );
    }
}
