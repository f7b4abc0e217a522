//! The report: one record per run (workload, model, lane, cluster shape,
//! worker count), derived figures (throughput, scaling efficiency, step time
//! split), as JSON, a text table and a Markdown file.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::findings::{self, Finding};
use crate::stats::WorkerResult;

/// Which lane the daemon counters say a run's connections really used.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LaneEvidence {
    /// Whether the node daemons' counters could be read before and after.
    pub counters_read: bool,
    /// Shared-memory channels opened during the run (all nodes).
    pub shm_connections: u64,
    /// Application bytes carried by shared-memory channels during the run.
    pub shm_bytes: u64,
    /// Connections the preload library left on TCP during the run.
    pub tcp_fallbacks: u64,
    /// The daemons' reasons for those, with counts.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub fallback_reasons: std::collections::BTreeMap<String, u64>,
    /// Connections the RDMA relay lane carried during the run, counted once
    /// each (by the first node's daemon: in the two-node Soft-RoCE rig every
    /// connection of a run passes through both daemons). Zero outside the rig.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rdma_connections: u64,
    /// Bytes the first node's daemon moved over the RDMA lane during the run.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rdma_bytes: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// One measured run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// `ps-sync`, `ps-async` or `allreduce`.
    pub workload: String,
    pub model: String,
    /// Cluster shape and placement, e.g. `1 node x 4 pods`.
    pub cluster: String,
    /// Free-text placement of the workers (`same node`, `cross node`, ...).
    pub placement: String,
    /// The lane asked for: `tcp` (no preload library), `shm` (preload), or
    /// `rdma` (preload, between the Soft-RoCE rig's nodes, whose daemons
    /// relay cross-node connections over RDMA).
    pub lane_requested: String,
    /// The lane the daemon counters show was used: `tcp`, `shm`, `rdma`, or
    /// `shm+tcp` / `rdma+tcp` (some connections on each); `tcp` whenever
    /// there is no evidence of shared memory or RDMA.
    pub lane_measured: String,
    pub evidence: LaneEvidence,
    pub workers: u32,
    /// Parameter servers (0 for all-reduce).
    pub servers: u32,
    pub batch: u32,
    /// Measured steps per worker.
    pub steps: u32,
    /// Bytes of one gradient tensor as exchanged (after scaling).
    pub tensor_bytes: u64,
    /// Mean time of one step, and its split.
    pub step_s: f64,
    pub compute_s: f64,
    pub comm_s: f64,
    pub steps_per_s: f64,
    /// All workers together, at the modelled (real-size) rate once
    /// [`Report::finish`] ran: measured steps/s x scale x batch x workers
    /// (compute and tensors are scaled by `scale`, the batch is not).
    pub images_per_s: f64,
    /// Speed-up against the same series with one worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speedup: Option<f64>,
    /// `speedup / workers`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scaling_efficiency: Option<f64>,
    /// All-reduce: tensor bytes / communication time, and the bus bandwidth
    /// `algbw * 2(W-1)/W` (NCCL's convention), in GB/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algbw_gbps: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub busbw_gbps: Option<f64>,
    /// Parameter server: toy objective before and after (worker 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_first: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_last: Option<f64>,
    /// Set when the run failed; the figures are then zero.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// TCP connections the job opens: W for a ring of W >= 2 (each member
    /// connects to its successor), W x S for parameter servers (each worker
    /// to each server), 0 for a lone ring member. 0 in rows recorded before
    /// this was counted.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub connections: u64,
    /// Those of them between two pods of one node (the ones the shm lane
    /// can carry).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub same_node_connections: u64,
}

impl RunRecord {
    /// The series a run belongs to (its scaling curve): the same workload,
    /// lane asked for and cluster at different worker counts. Each run's
    /// measured lane is reported with it (a 1-worker all-reduce has no
    /// connection, so it is never "measured shm").
    pub fn series(&self) -> String {
        format!(
            "{} / {} / {}",
            self.workload, self.lane_requested, self.cluster
        )
    }

    /// The lane evidence of this run in words: the channels the daemons
    /// counted against the job's connections, and which connections stayed
    /// on TCP and why.
    pub fn lane_check(&self) -> String {
        let n = self.connections;
        let e = &self.evidence;
        if n == 0 {
            return if self.workers <= 1 && self.servers == 0 {
                "no connection".into()
            } else {
                "connections not counted".into()
            };
        }
        if !e.counters_read {
            return format!("{n} conn, counters unreadable: no lane claimed");
        }
        let reasons = || {
            if e.fallback_reasons.is_empty() {
                "no reason counted".to_string()
            } else {
                e.fallback_reasons
                    .iter()
                    .map(|(k, v)| format!("{k} x{v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        };
        if self.lane_requested == "tcp" {
            return if e.shm_connections == 0 && e.rdma_connections == 0 {
                format!("{n}/{n} on TCP (no preload)")
            } else {
                format!(
                    "{n} conn: {} on shm without the preload library?",
                    e.shm_connections
                )
            };
        }
        if self.lane_requested == "rdma" {
            return format!("{}/{n} on rdma", e.rdma_connections.min(n));
        }
        let shm = e.shm_connections;
        if shm == n {
            return format!("{n}/{n} on shm");
        }
        let cross = n - self.same_node_connections;
        let same_left = self.same_node_connections.saturating_sub(shm);
        let mut parts = vec![format!("{}/{n} on shm", shm.min(n))];
        if cross > 0 {
            parts.push(format!("{cross} cross-node on TCP"));
        }
        if same_left > 0 {
            parts.push(format!("{same_left} same-node on TCP"));
        }
        if shm > n {
            parts.push(format!("{} more channels than connections", shm - n));
        }
        format!("{} ({})", parts.join(", "), reasons())
    }

    /// The share of a step spent communicating (0 when nothing was timed).
    pub fn comm_share(&self) -> f64 {
        let t = self.compute_s + self.comm_s;
        if t > 0.0 {
            self.comm_s / t
        } else {
            0.0
        }
    }

    /// Whether every same-node connection of a run that asked for shm got a
    /// shared-memory channel (true for runs that did not ask for shm).
    pub fn shm_complete(&self) -> bool {
        self.lane_requested != "shm"
            || (self.evidence.counters_read
                && self.evidence.shm_connections == self.same_node_connections)
    }

    /// Fills the figures from the workers' own measurements.
    pub fn absorb(&mut self, results: &[WorkerResult]) {
        if results.is_empty() {
            return;
        }
        let n = results.len() as f64;
        let medians: Vec<(f64, f64, f64)> = results.iter().map(WorkerResult::median_step).collect();
        self.steps = results.iter().map(|r| r.steps).min().unwrap_or(0);
        self.tensor_bytes = results[0].tensor_bytes;
        self.compute_s = medians.iter().map(|m| m.1).sum::<f64>() / n;
        self.comm_s = medians.iter().map(|m| m.2).sum::<f64>() / n;
        // The job goes as fast as its slowest worker; each worker's step is
        // its median step (robust against a hiccup of a shared machine).
        let slowest = medians.iter().map(|m| m.0).fold(0.0, f64::max);
        self.step_s = slowest;
        self.steps_per_s = if slowest > 0.0 { 1.0 / slowest } else { 0.0 };
        self.images_per_s = self.steps_per_s * self.batch as f64 * self.workers as f64;
        if self.workload == "allreduce" && self.workers > 1 && self.comm_s > 0.0 {
            let alg = self.tensor_bytes as f64 / self.comm_s / 1e9;
            let w = self.workers as f64;
            self.algbw_gbps = Some(alg);
            self.busbw_gbps = Some(alg * 2.0 * (w - 1.0) / w);
        }
        if let Some(r0) = results.iter().find(|r| r.rank == 0) {
            self.loss_first = r0.loss_first;
            self.loss_last = r0.loss_last;
        }
    }
}

/// Names the lane from the counters: shared memory or RDMA only with
/// evidence.
pub fn measured_lane(e: &LaneEvidence) -> String {
    if e.counters_read && e.rdma_connections > 0 {
        if e.tcp_fallbacks > 0 {
            "rdma+tcp".to_string()
        } else {
            "rdma".to_string()
        }
    } else if !e.counters_read || e.shm_connections == 0 {
        "tcp".to_string()
    } else if e.tcp_fallbacks > 0 {
        "shm+tcp".to_string()
    } else {
        "shm".to_string()
    }
}

/// The whole report.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub title: String,
    /// The GPU generation the compute times model (`K80`, `A100`, ...).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub gpu: String,
    pub generated_unix: u64,
    pub host_cpus: usize,
    /// Fraction of the real model size every tensor and compute time was
    /// multiplied by.
    pub scale: f64,
    /// What was scaled or assumed, and what the lanes were, in words.
    pub notes: Vec<String>,
    /// What the runs show, in words, computed by [`Report::finish`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub findings: Vec<Finding>,
    pub runs: Vec<RunRecord>,
}

impl Report {
    /// An empty report made now on this machine (its time and CPU count),
    /// for the demo and `rdma-demo` to add runs to.
    pub fn new(title: String, gpu: String, scale: f64, notes: Vec<String>) -> Report {
        Report {
            title,
            gpu,
            generated_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            host_cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(0),
            scale,
            notes,
            findings: Vec::new(),
            runs: Vec::new(),
        }
    }

    /// Puts images/s at the modelled rate (the measured steps/s times the
    /// scale: compute and tensors are scaled, the batch is not), computes
    /// speed-up and scaling efficiency of every run against the one-worker
    /// run of its series and model, and the findings.
    pub fn finish(&mut self) {
        let scale = if self.scale > 0.0 { self.scale } else { 1.0 };
        for r in &mut self.runs {
            r.images_per_s = r.steps_per_s * scale * r.batch as f64 * r.workers as f64;
        }
        let base: Vec<(String, String, f64)> = self
            .runs
            .iter()
            .filter(|r| r.workers == 1 && r.error.is_none() && r.images_per_s > 0.0)
            .map(|r| (r.series(), r.model.clone(), r.images_per_s))
            .collect();
        for r in &mut self.runs {
            let one = base
                .iter()
                .find(|(s, m, _)| *s == r.series() && *m == r.model)
                .map(|b| b.2);
            if let (Some(one), true) = (one, r.images_per_s > 0.0) {
                let speedup = r.images_per_s / one;
                r.speedup = Some(speedup);
                r.scaling_efficiency = Some(speedup / r.workers as f64);
            }
        }
        self.findings = crate::findings::compute(self);
    }

    /// The table a person reads in the terminal.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<9} {:<10} {:<9} {:<30} {:<4} {:<8} {:>2} {:>7} {:>8} {:>5} {:>9} {:>9} {:>9}  lane evidence",
            "workload",
            "model",
            "cluster",
            "placement (workers>server)",
            "ask",
            "measured",
            "W",
            "steps/s",
            "img/s*",
            "eff",
            "compute",
            "comm",
            "busbw"
        );
        for r in &self.runs {
            if let Some(e) = &r.error {
                let _ = writeln!(
                    out,
                    "{:<9} {:<10} {:<9} {:<30} {:<4} {:<8} {:>2}  FAILED: {e}",
                    r.workload,
                    r.model,
                    r.cluster,
                    r.placement,
                    r.lane_requested,
                    r.lane_measured,
                    r.workers
                );
                continue;
            }
            let eff = r
                .scaling_efficiency
                .map(|e| format!("{:.0}%", e * 100.0))
                .unwrap_or_else(|| "-".into());
            let bus = r
                .busbw_gbps
                .map(|b| format!("{b:.2}GB/s"))
                .unwrap_or_else(|| "-".into());
            let _ = writeln!(
                out,
                "{:<9} {:<10} {:<9} {:<30} {:<4} {:<8} {:>2} {:>7.2} {:>8.1} {:>5} {:>7.1}ms {:>7.1}ms {:>9}  {}",
                r.workload,
                r.model,
                r.cluster,
                r.placement,
                r.lane_requested,
                r.lane_measured,
                r.workers,
                r.steps_per_s,
                r.images_per_s,
                eff,
                r.compute_s * 1e3,
                r.comm_s * 1e3,
                bus,
                r.lane_check()
            );
        }
        let _ = writeln!(
            out,
            "* img/s at the modelled (real-size) rate: measured steps/s x scale x batch x workers"
        );
        out
    }

    /// Findings grouped by model (in report order), then the run-wide ones.
    fn findings_by_model(&self) -> Vec<(Option<String>, Vec<&Finding>)> {
        let mut groups: Vec<(Option<String>, Vec<&Finding>)> = Vec::new();
        for f in &self.findings {
            match groups.iter_mut().find(|g| g.0 == f.model) {
                Some(g) => g.1.push(f),
                None => groups.push((f.model.clone(), vec![f])),
            }
        }
        groups.sort_by_key(|g| g.0.is_none());
        groups
    }

    /// The header of the images/s column: what the number is.
    fn images_header(&self) -> String {
        format!(
            "images/s (modelled: measured steps/s x scale {:.4} x batch x W)",
            if self.scale > 0.0 { self.scale } else { 1.0 }
        )
    }

    /// The report as Markdown: findings, notes, then the table.
    pub fn markdown(&self) -> String {
        let mut out = format!("# {}\n\n", self.title);
        out.push_str("## Findings\n\n");
        for (model, fs) in self.findings_by_model() {
            let head = model
                .as_deref()
                .map(findings::display)
                .unwrap_or_else(|| "The whole run".into());
            let _ = writeln!(out, "### {head}\n");
            for f in fs {
                let _ = writeln!(out, "- {}", f.text);
            }
            out.push('\n');
        }
        out.push_str("## What was run\n\n");
        for n in &self.notes {
            let _ = writeln!(out, "- {n}");
        }
        out.push_str("\n## Every run\n\n");
        let _ = writeln!(
            out,
            "| workload | model | cluster | placement | lane (measured) | lane (asked) | W | steps/s (measured, scaled run) | {} | speed-up | efficiency | compute/step | comm/step | comm share | busbw | lane evidence (channels / connections) |",
            self.images_header()
        );
        out.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
        for r in &self.runs {
            let opt =
                |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map(f).unwrap_or_else(|| "-".into());
            if let Some(e) = &r.error {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {} | {} | {} | failed: {} |||||||||",
                    r.workload,
                    r.model,
                    r.cluster,
                    r.placement,
                    r.lane_measured,
                    r.lane_requested,
                    r.workers,
                    e.replace('|', "/")
                );
                continue;
            }
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {:.2} | {:.1} | {} | {} | {:.1} ms | {:.1} ms | {:.0}% | {} | {} |",
                r.workload,
                r.model,
                r.cluster,
                r.placement,
                r.lane_measured,
                r.lane_requested,
                r.workers,
                r.steps_per_s,
                r.images_per_s,
                opt(r.speedup, &|v| format!("{v:.2}x")),
                opt(r.scaling_efficiency, &|v| format!("{:.0}%", v * 100.0)),
                r.compute_s * 1e3,
                r.comm_s * 1e3,
                r.comm_share() * 100.0,
                opt(r.busbw_gbps, &|v| format!("{v:.2} GB/s")),
                r.lane_check(),
            );
        }
        out
    }

    /// The report as one self-contained HTML page (the chart inline, no
    /// external resource): findings first, then what was run, the chart and
    /// the table.
    pub fn html(&self) -> String {
        let mut out = String::new();
        let _ = write!(
            out,
            "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title>\n<style>\nbody{{font-family:sans-serif;max-width:1200px;margin:1em auto;padding:0 1em;color:#222}}\nsection#findings li{{margin:.3em 0}}\ntable{{border-collapse:collapse;font-size:12px}}\nth,td{{border:1px solid #ccc;padding:2px 5px;text-align:right}}\ntd.t,th.t{{text-align:left}}\ntr.failed td{{background:#fdd}}\n</style></head><body>\n<h1>{}</h1>\n",
            esc(&self.title),
            esc(&self.title)
        );
        out.push_str("<section id=\"findings\"><h2>Findings</h2>\n");
        for (model, fs) in self.findings_by_model() {
            let (head, key) = match &model {
                Some(m) => (findings::display(m), m.clone()),
                None => ("The whole run".to_string(), String::new()),
            };
            let _ = writeln!(
                out,
                "<div class=\"model\" data-model=\"{}\"><h3>{}</h3><ul>",
                esc(&key),
                esc(&head)
            );
            for f in fs {
                let _ = writeln!(
                    out,
                    "<li class=\"finding\" data-model=\"{}\" data-topic=\"{}\">{}</li>",
                    esc(&key),
                    esc(&f.topic),
                    esc(&f.text)
                );
            }
            out.push_str("</ul></div>\n");
        }
        out.push_str("</section>\n<section id=\"chart\"><h2>Chart</h2>\n");
        out.push_str(&crate::chart::scaling_svg(self));
        out.push_str("</section>\n<section id=\"notes\"><h2>What was run</h2><ul>\n");
        for n in &self.notes {
            let _ = writeln!(out, "<li>{}</li>", esc(n));
        }
        out.push_str("</ul></section>\n<section id=\"runs\"><h2>Every run</h2>\n<table>\n<tr>");
        let head = [
            "workload",
            "model",
            "cluster",
            "placement",
            "lane (measured)",
            "lane (asked)",
            "W",
            "steps/s (measured, scaled run)",
            &self.images_header(),
            "speed-up",
            "efficiency",
            "compute/step",
            "comm/step",
            "comm share",
            "busbw",
            "lane evidence (channels / connections)",
        ];
        for (i, h) in head.iter().enumerate() {
            let class = if i < 6 || i == 15 { " class=\"t\"" } else { "" };
            let _ = write!(out, "<th{class}>{}</th>", esc(h));
        }
        out.push_str("</tr>\n");
        for r in &self.runs {
            let t = |v: &str| format!("<td class=\"t\">{}</td>", esc(v));
            let n = |v: String| format!("<td>{}</td>", esc(&v));
            let lead = [
                t(&r.workload),
                t(&r.model),
                t(&r.cluster),
                t(&r.placement),
                t(&r.lane_measured),
                t(&r.lane_requested),
                n(r.workers.to_string()),
            ]
            .concat();
            if let Some(e) = &r.error {
                let _ = writeln!(
                    out,
                    "<tr class=\"failed\">{lead}<td class=\"t\" colspan=\"9\">failed: {}</td></tr>",
                    esc(e)
                );
                continue;
            }
            let opt =
                |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map(f).unwrap_or_else(|| "-".into());
            let _ = writeln!(
                out,
                "<tr>{lead}{}{}{}{}{}{}{}{}{}</tr>",
                n(format!("{:.2}", r.steps_per_s)),
                n(format!("{:.1}", r.images_per_s)),
                n(opt(r.speedup, &|v| format!("{v:.2}x"))),
                n(opt(r.scaling_efficiency, &|v| format!("{:.0}%", v * 100.0))),
                n(format!("{:.1} ms", r.compute_s * 1e3)),
                n(format!("{:.1} ms", r.comm_s * 1e3)),
                n(format!("{:.0}%", r.comm_share() * 100.0)),
                n(opt(r.busbw_gbps, &|v| format!("{v:.2} GB/s"))),
                t(&r.lane_check()),
            );
        }
        out.push_str("</table></section>\n</body></html>\n");
        out
    }

    /// Writes `report.json`, `report.md`, `report.html` and `scaling.svg`
    /// into `dir`; returns their paths (in that order).
    pub fn write(&self, dir: &Path) -> std::io::Result<Vec<PathBuf>> {
        std::fs::create_dir_all(dir)?;
        let json = dir.join("report.json");
        let md = dir.join("report.md");
        let html = dir.join("report.html");
        let svg = dir.join("scaling.svg");
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        write_atomic(&json, text.as_bytes())?;
        write_atomic(&md, self.markdown().as_bytes())?;
        write_atomic(&html, self.html().as_bytes())?;
        write_atomic(&svg, crate::chart::scaling_svg(self).as_bytes())?;
        Ok(vec![json, md, html, svg])
    }
}

/// Escapes text for HTML and SVG.
pub fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn write_atomic(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, data)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(rank: u32, wall: f64, compute: f64) -> WorkerResult {
        WorkerResult {
            role: "ps-worker".into(),
            rank,
            workers: 2,
            tensor_bytes: 400,
            steps: 10,
            wall_s: wall,
            compute_s: compute,
            comm_s: wall - compute,
            ..Default::default()
        }
    }

    #[test]
    fn lane_needs_evidence() {
        let mut e = LaneEvidence::default();
        assert_eq!(measured_lane(&e), "tcp");
        e.shm_connections = 3;
        assert_eq!(measured_lane(&e), "tcp", "unread counters are no evidence");
        e.counters_read = true;
        assert_eq!(measured_lane(&e), "shm");
        e.tcp_fallbacks = 1;
        assert_eq!(measured_lane(&e), "shm+tcp");
        let mut r = LaneEvidence {
            rdma_connections: 2,
            ..Default::default()
        };
        assert_eq!(measured_lane(&r), "tcp", "unread counters are no evidence");
        r.counters_read = true;
        assert_eq!(measured_lane(&r), "rdma");
        r.tcp_fallbacks = 1;
        assert_eq!(measured_lane(&r), "rdma+tcp");
    }

    #[test]
    fn shm_only_evidence_keeps_its_json_shape() {
        let e = LaneEvidence {
            counters_read: true,
            shm_connections: 1,
            ..Default::default()
        };
        let v = serde_json::to_value(&e).unwrap();
        assert!(v.get("rdma_connections").is_none());
        let back: LaneEvidence = serde_json::from_value(v).unwrap();
        assert_eq!(back, e);
    }

    #[test]
    fn efficiency_against_one_worker() {
        let mut one = RunRecord {
            workload: "ps-sync".into(),
            model: "m".into(),
            lane_measured: "tcp".into(),
            workers: 1,
            batch: 32,
            ..Default::default()
        };
        one.absorb(&[worker(0, 1.0, 0.5)]);
        let mut two = RunRecord {
            workers: 2,
            ..one.clone()
        };
        two.absorb(&[worker(0, 1.0, 0.5), worker(1, 2.0, 0.5)]);
        let mut rep = Report {
            runs: vec![one, two],
            ..Default::default()
        };
        rep.finish();
        let two = &rep.runs[1];
        // Slowest worker: 0.2 s/step -> 5 steps/s x 32 x 2 = 320 images/s,
        // against 320 images/s for one worker: speed-up 1, efficiency 50%.
        assert!((two.images_per_s - 320.0).abs() < 1e-9);
        assert!((two.speedup.unwrap() - 1.0).abs() < 1e-9);
        assert!((two.scaling_efficiency.unwrap() - 0.5).abs() < 1e-9);
        assert!(rep.table().contains("ps-sync"));
    }
}
