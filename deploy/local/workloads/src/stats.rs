//! What one worker measured, printed by `flowlane-train` as one JSON line.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The measurements of one worker over one run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerResult {
    /// `ps-worker` or `allreduce-worker`.
    pub role: String,
    pub rank: u32,
    pub workers: u32,
    /// Bytes of the tensor exchanged per step (parameters or gradient).
    pub tensor_bytes: u64,
    /// Measured steps (warm-up steps excluded).
    pub steps: u32,
    /// Wall time of the measured steps, seconds.
    pub wall_s: f64,
    /// Of which computing (emulated), seconds.
    pub compute_s: f64,
    /// Of which communicating, seconds.
    pub comm_s: f64,
    /// Every measured step's `[compute, comm]` seconds (for medians: a
    /// shared machine has hiccups that a mean would smear over a run).
    #[serde(default)]
    pub step_detail: Vec<[f64; 2]>,
    /// Application bytes this worker sent and received in measured steps.
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Parameter server only: the toy objective before the first and after
    /// the last step (all steps, warm-up included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_first: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_last: Option<f64>,
    /// All-reduce only: every step's sums were checked against the exact
    /// expected values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sums_checked: Option<bool>,
}

/// Accumulates per-step timings, skipping warm-up steps.
#[derive(Debug, Default)]
pub struct StepClock {
    warmup: u32,
    seen: u32,
    pub steps: u32,
    pub compute: Duration,
    pub comm: Duration,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub detail: Vec<[f64; 2]>,
}

impl StepClock {
    pub fn new(warmup: u32) -> Self {
        StepClock {
            warmup,
            ..Default::default()
        }
    }

    /// Records one step.
    pub fn step(&mut self, compute: Duration, comm: Duration, sent: u64, received: u64) {
        self.seen += 1;
        if self.seen <= self.warmup {
            return;
        }
        self.steps += 1;
        self.detail
            .push([compute.as_secs_f64(), comm.as_secs_f64()]);
        self.compute += compute;
        self.comm += comm;
        self.bytes_sent += sent;
        self.bytes_received += received;
    }

    pub fn into_result(self, role: &str, rank: u32, workers: u32) -> WorkerResult {
        WorkerResult {
            role: role.to_string(),
            rank,
            workers,
            steps: self.steps,
            wall_s: (self.compute + self.comm).as_secs_f64(),
            compute_s: self.compute.as_secs_f64(),
            comm_s: self.comm.as_secs_f64(),
            bytes_sent: self.bytes_sent,
            bytes_received: self.bytes_received,
            step_detail: self.detail,
            ..Default::default()
        }
    }
}

/// Emulated compute: sleeps until `budget` has passed since `start`.
///
/// Why sleeping and not busy work: in the talk the compute ran on GPUs,
/// leaving the host CPUs to the network stack. Busy loops would instead
/// compete with the communication for this machine's two cores, so adding
/// workers would slow the network for reasons a real cluster does not have.
pub fn compute_until(start: std::time::Instant, budget: Duration) {
    let spent = start.elapsed();
    if spent < budget {
        std::thread::sleep(budget - spent);
    }
}

/// The median of `v` (0 for an empty slice).
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

impl WorkerResult {
    /// Median step, compute and communication time of this worker's
    /// measured steps; falls back to the means without per-step detail.
    pub fn median_step(&self) -> (f64, f64, f64) {
        if self.step_detail.is_empty() {
            let n = self.steps.max(1) as f64;
            return (self.wall_s / n, self.compute_s / n, self.comm_s / n);
        }
        let total = median(self.step_detail.iter().map(|d| d[0] + d[1]).collect());
        let compute = median(self.step_detail.iter().map(|d| d[0]).collect());
        let comm = median(self.step_detail.iter().map(|d| d[1]).collect());
        (total, compute, comm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_ignore_one_hiccup() {
        assert_eq!(median(vec![]), 0.0);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        let mut clock = StepClock::new(1);
        let ms = std::time::Duration::from_millis;
        clock.step(ms(500), ms(500), 1, 1); // warm-up, ignored
        for comm in [10, 10, 400] {
            clock.step(ms(20), ms(comm), 1, 1);
        }
        let r = clock.into_result("x", 0, 1);
        assert_eq!(r.steps, 3);
        let (step, compute, comm) = r.median_step();
        assert!(
            (step - 0.030).abs() < 1e-9
                && (compute - 0.020).abs() < 1e-9
                && (comm - 0.010).abs() < 1e-9
        );
    }
}
