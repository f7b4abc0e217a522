//! The findings a report opens with, computed from its runs (never canned
//! text): which models scale, where a single parameter server saturates,
//! what a second server or ring all-reduce buys, what the shared-memory lane
//! buys, and a PS:worker ratio per model. When the runs do not show a thing,
//! the finding says what they do show.
//!
//! Definitions (also printed in the report):
//! - a model **scales** when its one-PS series keeps at least
//!   [`SCALES_EFFICIENCY`] scaling efficiency at the largest worker count,
//!   **scales partly** above [`NO_SCALING_SPEEDUP`] speed-up, **does not
//!   scale** below that, and **gets slower** when its speed-up is below 1;
//! - a single PS **saturates** at `k` workers when adding worker `k + 1`
//!   raises the job's images/s by less than [`SATURATION_PCT`] percent.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::report::{Report, RunRecord};

/// An added worker that raises throughput by less than this (percent) is not
/// worth having: the parameter server has saturated.
pub const SATURATION_PCT: f64 = 10.0;
/// Scaling efficiency at the largest worker count from which a model "scales".
pub const SCALES_EFFICIENCY: f64 = 0.75;
/// Speed-up at the largest worker count below which a model "does not scale".
pub const NO_SCALING_SPEEDUP: f64 = 1.1;
/// A second PS or ring all-reduce "buys" something when it beats one PS by
/// more than this (percent); below, the difference is within what a shared
/// machine's noise can make.
pub const WORTH_PCT: f64 = SATURATION_PCT;

/// One finding, in plain words.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Finding {
    /// The model it is about (`None`: about the whole run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// `scaling`, `ps-saturation`, `second-ps`, `ring`, `shm-lane`,
    /// `recommendation`, `lanes`, `definitions`.
    pub topic: String,
    pub text: String,
}

/// How a model scales (its one-PS series, else its ring, at the largest
/// worker count).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Scales,
    ScalesPartly,
    DoesNotScale,
    GetsSlower,
}

impl Verdict {
    pub fn from(speedup: f64, efficiency: f64) -> Verdict {
        if efficiency >= SCALES_EFFICIENCY {
            Verdict::Scales
        } else if speedup < 1.0 {
            Verdict::GetsSlower
        } else if speedup < NO_SCALING_SPEEDUP {
            Verdict::DoesNotScale
        } else {
            Verdict::ScalesPartly
        }
    }

    pub fn words(self) -> &'static str {
        match self {
            Verdict::Scales => "scales almost linearly",
            Verdict::ScalesPartly => "scales only partly",
            Verdict::DoesNotScale => "does not scale",
            Verdict::GetsSlower => "gets slower with more workers",
        }
    }
}

/// Where one PS stops paying for added workers.
#[derive(Debug, Clone, PartialEq)]
pub struct Saturation {
    /// The last worker count whose added worker still raised images/s by at
    /// least [`SATURATION_PCT`] (1 when the second worker already did not).
    pub workers: u32,
    /// Whether a measured added worker fell below the threshold (false: the
    /// PS did not saturate within the worker counts run).
    pub saturated: bool,
    /// Largest worker count run.
    pub tested: u32,
    /// Gain of each added worker: (workers, percent over one worker fewer).
    pub gains: Vec<(u32, f64)>,
}

/// The PS:worker ratio recommended for a model on one lane.
#[derive(Debug, Clone, PartialEq)]
pub struct Ratio {
    /// Workers per parameter server.
    pub workers_per_ps: u32,
    /// `workers_per_ps` is a lower bound (one PS never saturated).
    pub at_least: bool,
    /// Why, in words.
    pub why: String,
}

impl Ratio {
    fn words(&self) -> String {
        match (self.workers_per_ps, self.at_least) {
            (1, false) => "1 PS per worker (1:1)".into(),
            (k, false) => format!("1 PS per {k} workers (1:{k})"),
            (k, true) => format!("1 PS per {k} or more workers (1:{k}+)"),
        }
    }
}

/// The report's model name, as people write it.
pub fn display(model: &str) -> String {
    match model {
        "googlenet" => "GoogLeNet".into(),
        "inception3" => "Inception v3".into(),
        "resnet50" => "ResNet-50".into(),
        "vgg16" => "VGG16".into(),
        o => o.into(),
    }
}

fn lane_words(lane: &str) -> &'static str {
    match lane {
        "tcp" => "on TCP",
        "shm" => "on the shm lane",
        "rdma" => "on the RDMA lane",
        _ => "on this lane",
    }
}

fn pct(v: f64) -> String {
    format!("{:+.0}%", v)
}

/// The single-node cluster the findings are about: `1x4` when the report has
/// it, else the cluster of the first successful run.
pub fn primary_cluster(rep: &Report) -> Option<String> {
    let ok = || rep.runs.iter().filter(|r| ok(r));
    if ok().any(|r| r.cluster == "1x4") {
        return Some("1x4".into());
    }
    ok().map(|r| r.cluster.clone()).next()
}

fn ok(r: &RunRecord) -> bool {
    r.error.is_none() && r.steps_per_s > 0.0
}

fn row<'a>(
    rep: &'a Report,
    model: &str,
    workload: &str,
    cluster: &str,
    lane: &str,
    workers: u32,
) -> Option<&'a RunRecord> {
    rep.runs.iter().find(|r| {
        ok(r)
            && r.model == model
            && r.workload == workload
            && r.cluster == cluster
            && r.lane_requested == lane
            && r.workers == workers
    })
}

/// The largest worker count of a series, with its row.
fn largest<'a>(
    rep: &'a Report,
    model: &str,
    workload: &str,
    cluster: &str,
    lane: &str,
) -> Option<&'a RunRecord> {
    rep.runs
        .iter()
        .filter(|r| {
            ok(r)
                && r.model == model
                && r.workload == workload
                && r.cluster == cluster
                && r.lane_requested == lane
                && r.speedup.is_some()
        })
        .max_by_key(|r| r.workers)
}

/// The lanes asked for in the report, TCP first.
fn lanes(rep: &Report, cluster: &str) -> Vec<String> {
    let mut l: Vec<String> = Vec::new();
    for r in rep.runs.iter().filter(|r| r.cluster == cluster) {
        if !l.contains(&r.lane_requested) {
            l.push(r.lane_requested.clone());
        }
    }
    l.sort_by_key(|x| (x != "tcp", x.clone()));
    l
}

/// The workload that judges scaling: the talk's synchronous PS when run,
/// else ring all-reduce, else whatever was run.
fn judging_workload(rep: &Report, model: &str, cluster: &str) -> Option<String> {
    for w in ["ps-sync", "allreduce", "ps-async"] {
        if rep
            .runs
            .iter()
            .any(|r| ok(r) && r.model == model && r.cluster == cluster && r.workload == w)
        {
            return Some(w.into());
        }
    }
    None
}

/// How `model` scales on `lane` (its judging series at the largest worker
/// count > 1), with that row.
pub fn verdict<'a>(rep: &'a Report, model: &str, lane: &str) -> Option<(Verdict, &'a RunRecord)> {
    let cluster = primary_cluster(rep)?;
    let w = judging_workload(rep, model, &cluster)?;
    let r = largest(rep, model, &w, &cluster, lane).filter(|r| r.workers > 1)?;
    Some((
        Verdict::from(r.speedup?, r.scaling_efficiency.unwrap_or(0.0)),
        r,
    ))
}

/// Where one synchronous PS saturates for `model` on `lane`.
pub fn ps_saturation(rep: &Report, model: &str, lane: &str) -> Option<Saturation> {
    let cluster = primary_cluster(rep)?;
    let mut series: Vec<&RunRecord> = rep
        .runs
        .iter()
        .filter(|r| {
            ok(r)
                && r.model == model
                && r.workload == "ps-sync"
                && r.cluster == cluster
                && r.lane_requested == lane
        })
        .collect();
    series.sort_by_key(|r| r.workers);
    if series.len() < 2 || series[0].workers != 1 {
        return None;
    }
    let mut gains = Vec::new();
    let mut sat = None;
    for pair in series.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        if b.workers != a.workers + 1 || a.images_per_s <= 0.0 {
            break;
        }
        let g = (b.images_per_s / a.images_per_s - 1.0) * 100.0;
        gains.push((b.workers, g));
        if sat.is_none() && g < SATURATION_PCT {
            sat = Some(a.workers);
        }
    }
    let tested = gains.last().map(|g| g.0)?;
    Some(Saturation {
        workers: sat.unwrap_or(tested),
        saturated: sat.is_some(),
        tested,
        gains,
    })
}

/// What `other` (a second PS, or ring all-reduce) buys over one PS at the
/// same worker count on `lane`: (workers, percent images/s).
fn gain_over_one_ps(
    rep: &Report,
    model: &str,
    lane: &str,
    other_workload: &str,
    other_cluster: &str,
) -> Option<(u32, f64)> {
    let cluster = primary_cluster(rep)?;
    let mut best = None;
    for r in rep.runs.iter().filter(|r| {
        ok(r)
            && r.model == model
            && r.workload == other_workload
            && r.cluster == other_cluster
            && r.lane_requested == lane
            && r.workers > 1
    }) {
        if let Some(ps) = row(rep, model, "ps-sync", &cluster, lane, r.workers) {
            if ps.images_per_s > 0.0 && best.is_none_or(|(w, _)| r.workers > w) {
                best = Some((r.workers, (r.images_per_s / ps.images_per_s - 1.0) * 100.0));
            }
        }
    }
    best
}

/// What a second PS buys at the largest worker count both layouts ran.
pub fn second_ps_gain(rep: &Report, model: &str, lane: &str) -> Option<(u32, f64)> {
    let cluster = primary_cluster(rep)?;
    gain_over_one_ps(rep, model, lane, "ps-sync", &format!("{cluster} 2PS"))
}

/// What ring all-reduce buys over one PS at the largest common worker count.
pub fn ring_gain(rep: &Report, model: &str, lane: &str) -> Option<(u32, f64)> {
    let cluster = primary_cluster(rep)?;
    gain_over_one_ps(rep, model, lane, "allreduce", &cluster)
}

/// The PS:worker ratio for `model` on `lane`, from where one PS saturates
/// and what a second one buys.
pub fn recommendation(rep: &Report, model: &str, lane: &str) -> Option<Ratio> {
    let sat = ps_saturation(rep, model, lane);
    let second = second_ps_gain(rep, model, lane);
    if let Some((w, g)) = second.filter(|(_, g)| *g > WORTH_PCT) {
        return Some(Ratio {
            workers_per_ps: 1,
            at_least: false,
            why: format!("a second PS bought {} at {w} workers", pct(g)),
        });
    }
    let sat = sat?;
    let second_words = match second {
        Some((w, g)) => format!("; a second PS gave {} at {w} workers", pct(g)),
        None => String::new(),
    };
    if sat.saturated {
        let next = sat.workers + 1;
        let g = sat
            .gains
            .iter()
            .find(|(w, _)| *w == next)
            .map(|g| g.1)
            .unwrap_or(0.0);
        Some(Ratio {
            workers_per_ps: sat.workers,
            at_least: false,
            why: format!(
                "one PS saturates at {} worker{}: worker {next} gave {}{second_words}",
                sat.workers,
                if sat.workers == 1 { "" } else { "s" },
                pct(g)
            ),
        })
    } else {
        Some(Ratio {
            workers_per_ps: sat.tested,
            at_least: true,
            why: format!(
                "one PS did not saturate up to {} workers (each added worker: {}){second_words}",
                sat.tested,
                sat.gains
                    .iter()
                    .map(|(_, g)| pct(*g))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        })
    }
}

fn measured_note(r: &RunRecord) -> String {
    if r.lane_requested == "shm" && r.lane_measured != "shm" {
        format!(" (counters: {})", r.lane_measured)
    } else {
        String::new()
    }
}

/// Every finding of a report, in the order the report shows them.
pub fn compute(rep: &Report) -> Vec<Finding> {
    let mut out = Vec::new();
    let Some(cluster) = primary_cluster(rep) else {
        out.push(Finding {
            model: None,
            topic: "scaling".into(),
            text: "No run succeeded: there is nothing to conclude.".into(),
        });
        return out;
    };
    let lanes = lanes(rep, &cluster);
    let mut models: Vec<String> = Vec::new();
    for r in rep.runs.iter().filter(|r| ok(r) && r.cluster == cluster) {
        if !models.contains(&r.model) {
            models.push(r.model.clone());
        }
    }
    let push = |out: &mut Vec<Finding>, model: &str, topic: &str, text: String| {
        out.push(Finding {
            model: Some(model.to_string()),
            topic: topic.into(),
            text,
        })
    };
    for m in &models {
        let name = display(m);
        // Scaling.
        let per_lane: Vec<(String, Verdict, &RunRecord)> = lanes
            .iter()
            .filter_map(|l| verdict(rep, m, l).map(|(v, r)| (l.clone(), v, r)))
            .collect();
        if per_lane.is_empty() {
            push(
                &mut out,
                m,
                "scaling",
                format!("{name}: no multi-worker run succeeded on {cluster}, so its scaling is not shown."),
            );
        } else {
            let same = per_lane.iter().all(|x| x.1 == per_lane[0].1);
            let how = |(l, _, r): &(String, Verdict, &RunRecord)| {
                format!(
                    "{:.2}x one worker's images/s with {} workers {} ({:.0}% efficiency){}",
                    r.speedup.unwrap_or(0.0),
                    r.workers,
                    lane_words(l),
                    r.scaling_efficiency.unwrap_or(0.0) * 100.0,
                    measured_note(r)
                )
            };
            let what = if per_lane[0].2.workload == "ps-sync" {
                "with one parameter server"
            } else {
                "with ring all-reduce"
            };
            let text = if same {
                format!(
                    "{name} {} {what}: {}.",
                    per_lane[0].1.words(),
                    per_lane.iter().map(how).collect::<Vec<_>>().join("; ")
                )
            } else {
                format!(
                    "{name} {what}: {}.",
                    per_lane
                        .iter()
                        .map(|x| format!("{} it {} ({})", lane_words(&x.0), x.1.words(), how(x)))
                        .collect::<Vec<_>>()
                        .join("; ")
                )
            };
            push(&mut out, m, "scaling", text);
        }
        // One PS's saturation.
        let sats: Vec<String> = lanes
            .iter()
            .filter_map(|l| {
                let s = ps_saturation(rep, m, l)?;
                let gains = s
                    .gains
                    .iter()
                    .map(|(w, g)| format!("worker {w}: {}", pct(*g)))
                    .collect::<Vec<_>>()
                    .join(", ");
                // A later worker that gained again after the saturation
                // point says the series is noisy, not that the PS recovered.
                let later = s
                    .gains
                    .iter()
                    .filter(|(w, g)| *w > s.workers + 1 && *g >= SATURATION_PCT)
                    .count();
                let noisy = if later > 0 {
                    "; a later worker gained again, so this series is noisy"
                } else {
                    ""
                };
                Some(if s.saturated {
                    format!(
                        "{} it saturates at {} worker{} ({gains}{noisy})",
                        lane_words(l),
                        s.workers,
                        if s.workers == 1 { "" } else { "s" }
                    )
                } else {
                    format!(
                        "{} it did not saturate up to {} workers ({gains})",
                        lane_words(l),
                        s.tested
                    )
                })
            })
            .collect();
        if !sats.is_empty() {
            push(
                &mut out,
                m,
                "ps-saturation",
                format!("{name}, one parameter server: {}.", sats.join("; ")),
            );
        }
        // A second PS; ring all-reduce.
        for (topic, what, f) in [
            (
                "second-ps",
                "a second parameter server (parameters sharded over two)",
                second_ps_gain as fn(&Report, &str, &str) -> Option<(u32, f64)>,
            ),
            (
                "ring",
                "ring all-reduce instead of one parameter server",
                ring_gain,
            ),
        ] {
            let g: Vec<String> = lanes
                .iter()
                .filter_map(|l| {
                    let (w, g) = f(rep, m, l)?;
                    Some(format!(
                        "{} images/s at {w} workers {}{}",
                        pct(g),
                        lane_words(l),
                        if g.abs() <= WORTH_PCT {
                            " (within noise: buys nothing)"
                        } else {
                            ""
                        }
                    ))
                })
                .collect();
            if !g.is_empty() {
                push(
                    &mut out,
                    m,
                    topic,
                    format!("{name}: {what}: {}.", g.join("; ")),
                );
            }
        }
        // What the shm lane buys: comm share TCP vs shm at the largest
        // worker count, per workload of the single-node cluster.
        if lanes.iter().any(|l| l == "tcp") && lanes.iter().any(|l| l == "shm") {
            let mut parts = Vec::new();
            for wl in ["allreduce", "ps-sync", "ps-async"] {
                let (Some(t), Some(s)) = (
                    largest(rep, m, wl, &cluster, "tcp"),
                    largest(rep, m, wl, &cluster, "shm"),
                ) else {
                    continue;
                };
                if t.workers != s.workers || t.workers < 2 || t.images_per_s <= 0.0 {
                    continue;
                }
                let what = match wl {
                    "allreduce" => "ring all-reduce",
                    "ps-sync" => "one synchronous PS",
                    _ => "one asynchronous PS",
                };
                parts.push(format!(
                    "with {what} at {} workers, {:.0}% of each step is communication on TCP and {:.0}% on the shm lane{}, {} images/s",
                    t.workers,
                    t.comm_share() * 100.0,
                    s.comm_share() * 100.0,
                    measured_note(s),
                    pct((s.images_per_s / t.images_per_s - 1.0) * 100.0)
                ));
            }
            if !parts.is_empty() {
                push(
                    &mut out,
                    m,
                    "shm-lane",
                    format!("{name}: {}.", parts.join("; ")),
                );
            }
        }
        // The PS:worker ratio.
        let recs: Vec<(String, Ratio)> = lanes
            .iter()
            .filter_map(|l| recommendation(rep, m, l).map(|r| (l.clone(), r)))
            .collect();
        if !recs.is_empty() {
            let same = recs.iter().all(|(_, r)| {
                (r.workers_per_ps, r.at_least) == (recs[0].1.workers_per_ps, recs[0].1.at_least)
            });
            let text = if same {
                format!(
                    "Recommendation for {name} on this cluster: {} on {} ({}).",
                    recs[0].1.words(),
                    if recs.len() > 1 {
                        "both lanes"
                    } else {
                        lane_words(&recs[0].0).trim_start_matches("on ")
                    },
                    recs.iter()
                        .map(|(l, r)| format!("{}: {}", lane_words(l), r.why))
                        .collect::<Vec<_>>()
                        .join("; ")
                )
            } else {
                format!(
                    "Recommendation for {name} on this cluster: {}.",
                    recs.iter()
                        .map(|(l, r)| format!("{} {} ({})", lane_words(l), r.words(), r.why))
                        .collect::<Vec<_>>()
                        .join("; ")
                )
            };
            push(&mut out, m, "recommendation", text);
        }
    }
    out.push(lane_finding(rep));
    out.push(Finding {
        model: None,
        topic: "definitions".into(),
        text: format!(
            "How these are computed: one node ({cluster}); a model scales when its one-PS series (else its ring) keeps {:.0}% efficiency at the largest worker count, does not scale below {NO_SCALING_SPEEDUP:.1}x speed-up, gets slower below 1x; one PS saturates at k workers when worker k+1 adds less than {SATURATION_PCT:.0}% images/s; a second PS or ring all-reduce buys something when it beats one PS by more than {WORTH_PCT:.0}% (smaller differences are within this shared machine's noise); the recommended ratio is 1:1 when a second PS bought more than that, else one PS per saturation point.",
            SCALES_EFFICIENCY * 100.0
        ),
    });
    out
}

/// Whether every connection asked for shm got it, from the per-run lane
/// evidence.
fn lane_finding(rep: &Report) -> Finding {
    let asked: Vec<&RunRecord> = rep
        .runs
        .iter()
        .filter(|r| r.error.is_none() && r.lane_requested == "shm" && r.connections > 0)
        .collect();
    let mut text = String::new();
    if asked.is_empty() {
        text.push_str("No run asked for the shm lane with connections to carry.");
    } else {
        let total: u64 = asked.iter().map(|r| r.connections).sum();
        let same: u64 = asked.iter().map(|r| r.same_node_connections).sum();
        let on_shm: u64 = asked.iter().map(|r| r.evidence.shm_connections).sum();
        let short: Vec<&&RunRecord> = asked
            .iter()
            .filter(|r| r.evidence.shm_connections < r.same_node_connections)
            .collect();
        let _ = write!(
            text,
            "Lane evidence: {} runs asked for the shm lane with {total} connections, {same} of them between pods of one node; the daemons counted {on_shm} shared-memory channels.",
            asked.len()
        );
        if short.is_empty() {
            text.push_str(" Every same-node connection got a channel");
        } else {
            let _ = write!(
                text,
                " {} run(s) left same-node connections on TCP (see their rows' lane evidence)",
                short.len()
            );
        }
        if total > same {
            let _ = write!(
                text,
                "; the {} cross-node connection(s) stayed on TCP (no relay lane in this cluster)",
                total - same
            );
        }
        text.push('.');
    }
    Finding {
        model: None,
        topic: "lanes".into(),
        text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run as `finish` would leave it, from images/s and the step split.
    fn run(
        model: &str,
        workload: &str,
        cluster: &str,
        lane: &str,
        workers: u32,
        ips: f64,
        comm_share: f64,
    ) -> RunRecord {
        RunRecord {
            workload: workload.into(),
            model: model.into(),
            cluster: cluster.into(),
            lane_requested: lane.into(),
            lane_measured: if lane == "shm" && workers > 1 {
                "shm"
            } else {
                "tcp"
            }
            .into(),
            workers,
            servers: u32::from(workload != "allreduce"),
            batch: 32,
            steps: 5,
            steps_per_s: ips / 32.0 / workers as f64,
            images_per_s: ips,
            compute_s: 1.0 - comm_share,
            comm_s: comm_share,
            ..Default::default()
        }
    }

    fn synthetic() -> Report {
        let mut runs = Vec::new();
        for lane in ["tcp", "shm"] {
            // "small": linear with one PS on both lanes.
            for w in 1..=3 {
                runs.push(run(
                    "small",
                    "ps-sync",
                    "1x4",
                    lane,
                    w,
                    100.0 * w as f64,
                    0.05,
                ));
            }
            // "big": one PS saturates after 2 workers on TCP (+50%, +3%),
            // not on shm (+60%, +30%); a second PS buys +40% on TCP.
            let big_tcp = [100.0, 150.0, 154.5];
            let big_shm = [100.0, 160.0, 208.0];
            let big = if lane == "tcp" { big_tcp } else { big_shm };
            for (i, ips) in big.iter().enumerate() {
                let share = if lane == "tcp" { 0.61 } else { 0.38 };
                runs.push(run(
                    "big",
                    "ps-sync",
                    "1x4",
                    lane,
                    i as u32 + 1,
                    *ips,
                    share,
                ));
            }
            let two = if lane == "tcp" {
                [100.0, 210.0]
            } else {
                [100.0, 165.0]
            };
            for (i, ips) in two.iter().enumerate() {
                runs.push(run(
                    "big",
                    "ps-sync",
                    "1x4 2PS",
                    lane,
                    i as u32 + 1,
                    *ips,
                    0.5,
                ));
            }
            // "huge": slower with more workers on both lanes.
            for (i, ips) in [100.0, 80.0, 60.0].iter().enumerate() {
                runs.push(run("huge", "ps-sync", "1x4", lane, i as u32 + 1, *ips, 0.8));
            }
        }
        let mut rep = Report {
            scale: 1.0,
            runs,
            ..Default::default()
        };
        rep.finish();
        rep
    }

    #[test]
    fn which_model_scales() {
        let rep = synthetic();
        assert_eq!(verdict(&rep, "small", "tcp").unwrap().0, Verdict::Scales);
        assert_eq!(
            verdict(&rep, "big", "tcp").unwrap().0,
            Verdict::ScalesPartly
        );
        assert_eq!(verdict(&rep, "huge", "shm").unwrap().0, Verdict::GetsSlower);
        assert_eq!(Verdict::from(1.05, 0.35), Verdict::DoesNotScale);
        let f = compute(&rep);
        let scaling: Vec<&str> = f
            .iter()
            .filter(|f| f.topic == "scaling")
            .map(|f| f.text.as_str())
            .collect();
        assert!(scaling[0].starts_with("small scales almost linearly with one parameter server"));
        assert!(scaling[0]
            .contains("3.00x one worker's images/s with 3 workers on TCP (100% efficiency)"));
        assert!(
            scaling[2].contains("huge gets slower with more workers"),
            "{scaling:?}"
        );
        // Lanes that disagree are named each with its verdict.
        let mut rep = Report {
            scale: 1.0,
            ..Default::default()
        };
        for (lane, ips) in [
            ("tcp", [100.0, 140.0, 144.0]),
            ("shm", [100.0, 200.0, 300.0]),
        ] {
            for (i, v) in ips.iter().enumerate() {
                rep.runs
                    .push(run("m", "ps-sync", "1x4", lane, i as u32 + 1, *v, 0.5));
            }
        }
        rep.finish();
        let f = compute(&rep);
        assert_eq!(
            f[0].text,
            "m with one parameter server: on TCP it scales only partly (1.44x one worker's images/s with 3 workers on TCP (48% efficiency)); on the shm lane it scales almost linearly (3.00x one worker's images/s with 3 workers on the shm lane (100% efficiency))."
        );
    }

    #[test]
    fn where_one_ps_saturates() {
        let rep = synthetic();
        let tcp = ps_saturation(&rep, "big", "tcp").unwrap();
        assert!(tcp.saturated);
        assert_eq!(tcp.workers, 2, "{tcp:?}");
        assert!((tcp.gains[1].1 - 3.0).abs() < 1e-9);
        let shm = ps_saturation(&rep, "big", "shm").unwrap();
        assert!(!shm.saturated);
        assert_eq!((shm.workers, shm.tested), (3, 3));
        // Slower with the 2nd worker: saturated at 1.
        let huge = ps_saturation(&rep, "huge", "tcp").unwrap();
        assert_eq!((huge.workers, huge.saturated), (1, true));
        let f = compute(&rep);
        let sat = f
            .iter()
            .find(|f| f.topic == "ps-saturation" && f.model.as_deref() == Some("big"))
            .unwrap();
        assert!(
            sat.text
                .contains("on TCP it saturates at 2 workers (worker 2: +50%, worker 3: +3%)"),
            "{}",
            sat.text
        );
        assert!(
            sat.text
                .contains("on the shm lane it did not saturate up to 3 workers"),
            "{}",
            sat.text
        );
    }

    #[test]
    fn ratio_per_model() {
        let rep = synthetic();
        // A second PS bought +40% on TCP: one PS per worker.
        let r = recommendation(&rep, "big", "tcp").unwrap();
        assert_eq!((r.workers_per_ps, r.at_least), (1, false));
        assert!(r.why.contains("+40%"), "{}", r.why);
        // On shm it bought +3%, and one PS never saturated: 1:3 or more.
        let r = recommendation(&rep, "big", "shm").unwrap();
        assert_eq!((r.workers_per_ps, r.at_least), (3, true), "{r:?}");
        // No 2-PS runs, linear: at least 3 per PS on both lanes.
        let r = recommendation(&rep, "small", "shm").unwrap();
        assert_eq!((r.workers_per_ps, r.at_least), (3, true));
        // Saturated at one worker, no second-PS data: 1:1.
        let r = recommendation(&rep, "huge", "tcp").unwrap();
        assert_eq!((r.workers_per_ps, r.at_least), (1, false));
        let f = compute(&rep);
        let text = |m: &str| {
            f.iter()
                .find(|f| f.topic == "recommendation" && f.model.as_deref() == Some(m))
                .unwrap()
                .text
                .clone()
        };
        assert!(
            text("big").contains("on TCP 1 PS per worker (1:1)"),
            "{}",
            text("big")
        );
        assert!(text("big").contains("on the shm lane 1 PS per 3 or more workers (1:3+)"));
        assert!(text("small").contains("1 PS per 3 or more workers (1:3+) on both lanes"));
    }

    #[test]
    fn shm_lane_and_second_ps_in_words() {
        let rep = synthetic();
        let f = compute(&rep);
        let shm = f
            .iter()
            .find(|f| f.topic == "shm-lane" && f.model.as_deref() == Some("big"))
            .unwrap();
        assert!(
            shm.text.contains("with one synchronous PS at 3 workers, 61% of each step is communication on TCP and 38% on the shm lane, +35% images/s"),
            "{}",
            shm.text
        );
        let second = f.iter().find(|f| f.topic == "second-ps").unwrap();
        assert!(
            second.text.contains("+40% images/s at 2 workers on TCP;"),
            "{}",
            second.text
        );
        assert!(second
            .text
            .contains("+3% images/s at 2 workers on the shm lane (within noise"));
        // No ring runs: no ring finding, rather than a made-up one.
        assert!(!f.iter().any(|f| f.topic == "ring"));
    }

    #[test]
    fn nothing_to_conclude_is_said() {
        let rep = Report::default();
        let f = compute(&rep);
        assert_eq!(f.len(), 1);
        assert!(f[0].text.contains("nothing to conclude"));
    }
}
