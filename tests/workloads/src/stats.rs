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
