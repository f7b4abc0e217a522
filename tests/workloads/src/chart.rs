//! The scaling chart, hand-written SVG: one panel per model, speed-up
//! against worker count, one curve per workload/lane/cluster series, and the
//! ideal (linear) scaling as a dashed diagonal.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use crate::report::{Report, RunRecord};

const PANEL_W: f64 = 420.0;
const PANEL_H: f64 = 300.0;
const MARGIN: f64 = 50.0;
const COLUMNS: usize = 2;
const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// The RDMA lane's own colour: its series (and the rig's plain-TCP baseline,
/// dashed) stand out from the local clusters' palette.
const RDMA_COLOR: &str = "#000000";

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A series' colour (one per workload and cluster, so the two lanes of the
/// same job share it) and dash pattern (solid: preload library asked,
/// dashed: plain TCP asked).
fn style(series: &[String], k: usize, runs: &[&RunRecord]) -> (&'static str, &'static str) {
    let of = |name: &str| runs.iter().find(|r| r.series() == name).copied();
    let Some(me) = of(&series[k]) else {
        return (COLORS[k % COLORS.len()], "none");
    };
    let mut jobs: Vec<(String, String)> = Vec::new();
    for name in series {
        if let Some(r) = of(name) {
            let job = (r.workload.clone(), r.cluster.clone());
            if !jobs.contains(&job) {
                jobs.push(job);
            }
        }
    }
    let idx = jobs
        .iter()
        .position(|j| j.0 == me.workload && j.1 == me.cluster)
        .unwrap_or(k);
    let dash = if me.lane_requested == "tcp" {
        "7,4"
    } else {
        "none"
    };
    // A job measured over RDMA (the Soft-RoCE rig) has the RDMA colour for
    // both its lanes, like any job's two lanes share one colour.
    let rdma_job = runs.iter().any(|r| {
        r.lane_requested == "rdma" && r.workload == me.workload && r.cluster == me.cluster
    });
    if rdma_job {
        return (RDMA_COLOR, dash);
    }
    (COLORS[idx % COLORS.len()], dash)
}

/// The lanes the counters showed for a series' multi-worker runs.
fn measured_lanes(runs: &[&RunRecord], series: &str) -> String {
    let set: BTreeSet<&str> = runs
        .iter()
        .filter(|r| r.series() == series && r.workers > 1)
        .map(|r| r.lane_measured.as_str())
        .collect();
    if set.is_empty() {
        "-".into()
    } else {
        set.into_iter().collect::<Vec<_>>().join(", ")
    }
}

/// Renders the report's scaling curves.
pub fn scaling_svg(report: &Report) -> String {
    let ok: Vec<&RunRecord> = report
        .runs
        .iter()
        .filter(|r| r.error.is_none() && r.speedup.is_some())
        .collect();
    let mut models: Vec<String> = Vec::new();
    for r in &ok {
        if !models.contains(&r.model) {
            models.push(r.model.clone());
        }
    }
    let series: Vec<String> = ok
        .iter()
        .map(|r| r.series())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let max_w = ok.iter().map(|r| r.workers).max().unwrap_or(1).max(2) as f64;
    let rows = models.len().div_ceil(COLUMNS).max(1);
    let legend_h = 22.0 * series.len() as f64 + 20.0;
    let width = COLUMNS as f64 * PANEL_W;
    let height = 40.0 + rows as f64 * PANEL_H + legend_h;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="24" font-size="16" text-anchor="middle">{}</text>"#,
        width / 2.0,
        esc("Speed-up vs one worker. Grey: linear. Solid: preload library, dashed: plain TCP. Black: RDMA rig")
    );
    for (i, model) in models.iter().enumerate() {
        let ox = (i % COLUMNS) as f64 * PANEL_W;
        let oy = 40.0 + (i / COLUMNS) as f64 * PANEL_H;
        let (x0, y0) = (ox + MARGIN, oy + PANEL_H - MARGIN);
        let (pw, ph) = (PANEL_W - 1.6 * MARGIN, PANEL_H - 1.6 * MARGIN);
        let px = |w: f64| x0 + (w - 1.0) / (max_w - 1.0) * pw;
        let py = |v: f64| y0 - (v / max_w).min(1.05) * ph;
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" font-size="14" text-anchor="middle">{}</text>"#,
            ox + PANEL_W / 2.0,
            oy + 16.0,
            esc(model)
        );
        let _ = writeln!(
            s,
            r##"<line x1="{x0}" y1="{y0}" x2="{}" y2="{y0}" stroke="#333"/><line x1="{x0}" y1="{y0}" x2="{x0}" y2="{}" stroke="#333"/>"##,
            x0 + pw,
            y0 - ph
        );
        for w in 1..=max_w as u32 {
            let x = px(w as f64);
            let _ = writeln!(
                s,
                r#"<text x="{x}" y="{}" text-anchor="middle">{w}</text>"#,
                y0 + 16.0
            );
            let y = py(w as f64);
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}" text-anchor="end">{w}x</text>"#,
                x0 - 6.0,
                y + 4.0
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">workers</text>"#,
            x0 + pw / 2.0,
            y0 + 32.0
        );
        let _ = writeln!(
            s,
            r##"<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#bbb" stroke-width="1" stroke-dasharray="2,3"/>"##,
            px(1.0),
            py(1.0),
            px(max_w),
            py(max_w)
        );
        for (k, name) in series.iter().enumerate() {
            let (color, dash) = style(&series, k, &ok);
            let mut pts: Vec<(f64, f64)> = ok
                .iter()
                .filter(|r| &r.model == model && &r.series() == name)
                .map(|r| (r.workers as f64, r.speedup.unwrap_or(0.0)))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            if pts.is_empty() {
                continue;
            }
            let path: Vec<String> = pts
                .iter()
                .map(|(w, v)| format!("{:.1},{:.1}", px(*w), py(*v)))
                .collect();
            let _ = writeln!(
                s,
                r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2" stroke-dasharray="{dash}"/>"#,
                path.join(" ")
            );
            for (w, v) in &pts {
                let _ = writeln!(
                    s,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"><title>{}: {} workers, {:.2}x</title></circle>"#,
                    px(*w),
                    py(*v),
                    esc(name),
                    w,
                    v
                );
            }
        }
    }
    let ly = 40.0 + rows as f64 * PANEL_H;
    for (k, name) in series.iter().enumerate() {
        let (color, dash) = style(&series, k, &ok);
        let y = ly + 22.0 * k as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{MARGIN}" y1="{y}" x2="{}" y2="{y}" stroke="{color}" stroke-width="3" stroke-dasharray="{dash}"/><text x="{}" y="{}">{}</text>"#,
            MARGIN + 30.0,
            MARGIN + 38.0,
            y + 4.0,
            esc(&format!(
                "{name} (workload / lane asked / cluster; lane measured: {})",
                measured_lanes(&ok, name)
            ))
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chart_has_a_curve_per_series() {
        let run = |w: u32, lane: &str, speedup: f64| RunRecord {
            workload: "allreduce".into(),
            model: "vgg16<&>".into(),
            cluster: "1x4".into(),
            lane_requested: lane.into(),
            lane_measured: lane.into(),
            workers: w,
            speedup: Some(speedup),
            ..Default::default()
        };
        let rep = Report {
            runs: vec![
                run(1, "tcp", 1.0),
                run(2, "tcp", 1.5),
                run(1, "shm", 1.0),
                run(2, "shm", 1.9),
            ],
            ..Default::default()
        };
        let svg = scaling_svg(&rep);
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("vgg16&lt;&amp;&gt;"));
        assert!(svg.trim_end().ends_with("</svg>"));
    }

    #[test]
    fn rdma_series_has_its_own_colour() {
        let run = |w: u32, lane: &str, cluster: &str, speedup: f64| RunRecord {
            workload: "allreduce".into(),
            model: "googlenet".into(),
            cluster: cluster.into(),
            lane_requested: lane.into(),
            lane_measured: lane.into(),
            workers: w,
            speedup: Some(speedup),
            ..Default::default()
        };
        let rep = Report {
            runs: vec![
                run(1, "shm", "2x2", 1.0),
                run(2, "shm", "2x2", 1.8),
                run(1, "rdma", "rig 2x1", 1.0),
                run(2, "rdma", "rig 2x1", 1.7),
                run(1, "tcp", "rig 2x1", 1.0),
                run(2, "tcp", "rig 2x1", 1.5),
            ],
            ..Default::default()
        };
        let svg = scaling_svg(&rep);
        let lines: Vec<&str> = svg.lines().filter(|l| l.contains("<polyline")).collect();
        assert_eq!(lines.len(), 3);
        let black = format!("stroke=\"{RDMA_COLOR}\"");
        assert_eq!(lines.iter().filter(|l| l.contains(&black)).count(), 2);
        assert!(svg.contains("allreduce / rdma / rig 2x1"));
    }
}
