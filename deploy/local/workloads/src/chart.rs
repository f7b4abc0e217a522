//! The chart, hand-written SVG, made to be read in ten seconds: one column
//! per model, one comparison per panel.
//! - speed-up against workers with one parameter server, and with ring
//!   all-reduce, on one node: plain TCP against the shm lane, with linear
//!   scaling as the grey diagonal (two lines per panel);
//! - the RDMA rig's ring all-reduce, when its rows are in the report: plain
//!   TCP against the RDMA lane;
//! - the share of each step spent communicating at the largest worker
//!   count: TCP against shm bars, per workload.
//!
//! Two-node runs and the two-PS layout are in the table and the findings.

use std::fmt::Write as _;

use crate::findings::{display, primary_cluster};
use crate::report::{esc, Report, RunRecord};

const PANEL_W: f64 = 260.0;
const PANEL_H: f64 = 210.0;
const MARGIN: f64 = 40.0;
const HEADER: f64 = 64.0;
const ROW_TITLE: f64 = 22.0;

/// Colour of a lane asked for.
fn lane_color(lane: &str) -> &'static str {
    match lane {
        "tcp" => "#d62728",
        "shm" => "#1f77b4",
        "rdma" => RDMA_COLOR,
        _ => "#7f7f7f",
    }
}

/// The RDMA lane's own colour.
const RDMA_COLOR: &str = "#000000";

/// One row of speed-up panels: a workload on a cluster, two lanes.
struct CurveRow {
    title: String,
    workload: &'static str,
    cluster: String,
    lanes: [&'static str; 2],
}

fn usable(r: &RunRecord) -> bool {
    r.error.is_none() && r.speedup.is_some()
}

fn rows_present(rep: &Report, cluster: &str) -> Vec<CurveRow> {
    let has = |w: &str, c: &str| {
        rep.runs
            .iter()
            .any(|r| usable(r) && r.workload == w && r.cluster == c && r.workers > 1)
    };
    let mut rows = Vec::new();
    for (workload, title) in [
        ("ps-sync", "One parameter server"),
        ("ps-async", "One asynchronous parameter server"),
        ("allreduce", "Ring all-reduce"),
    ] {
        if has(workload, cluster) {
            rows.push(CurveRow {
                title: format!(
                    "{title}, {cluster} (one node): speed-up vs workers, TCP against shm"
                ),
                workload,
                cluster: cluster.to_string(),
                lanes: ["tcp", "shm"],
            });
        }
    }
    if has("allreduce", "rig 2x1") {
        rows.push(CurveRow {
            title: "Ring all-reduce in the Soft-RoCE rig (2 nodes, emulated): TCP against RDMA"
                .into(),
            workload: "allreduce",
            cluster: "rig 2x1".into(),
            lanes: ["tcp", "rdma"],
        });
    }
    rows
}

/// Renders the report's chart.
pub fn scaling_svg(report: &Report) -> String {
    let ok: Vec<&RunRecord> = report.runs.iter().filter(|r| usable(r)).collect();
    let mut models: Vec<String> = Vec::new();
    for r in &ok {
        if !models.contains(&r.model) {
            models.push(r.model.clone());
        }
    }
    let cluster = primary_cluster(report).unwrap_or_default();
    let rows = rows_present(report, &cluster);
    let bar_row = usize::from(
        ok.iter()
            .any(|r| r.cluster == cluster && r.lane_requested == "shm" && r.workers > 1),
    );
    let cols = models.len().max(1);
    let nrows = rows.len() + bar_row;
    let width = cols as f64 * PANEL_W + 20.0;
    let height = HEADER + nrows.max(1) as f64 * (PANEL_H + ROW_TITLE) + 10.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let gpu = if report.gpu.is_empty() {
        String::new()
    } else {
        format!(", compute modelled on {}", report.gpu)
    };
    let _ = writeln!(
        s,
        r#"<text x="10" y="20" font-size="15">{}</text>"#,
        esc(&format!(
            "Does adding workers pay off? Higher is better; grey diagonal = linear{gpu}"
        ))
    );
    // The legend: one line.
    let mut lx = 10.0;
    for (lane, label) in [
        ("tcp", "plain TCP"),
        ("shm", "flowlane shm lane"),
        ("rdma", "RDMA lane (rig)"),
    ] {
        if lane == "rdma" && !ok.iter().any(|r| r.lane_requested == "rdma") {
            continue;
        }
        let _ = writeln!(
            s,
            r#"<rect x="{lx}" y="32" width="14" height="10" fill="{}"/><text x="{}" y="41">{}</text>"#,
            lane_color(lane),
            lx + 18.0,
            esc(label)
        );
        lx += 150.0;
    }
    let _ = writeln!(
        s,
        r##"<text x="{lx}" y="41" fill="#555">{}</text>"##,
        esc("two-node runs and the 2-PS layout: see the findings and the table")
    );
    for (ri, row) in rows.iter().enumerate() {
        let oy = HEADER + ri as f64 * (PANEL_H + ROW_TITLE);
        let _ = writeln!(
            s,
            r#"<text x="10" y="{}" font-size="13" font-weight="bold">{}</text>"#,
            oy + 14.0,
            esc(&row.title)
        );
        for (ci, model) in models.iter().enumerate() {
            let ox = 10.0 + ci as f64 * PANEL_W;
            curve_panel(&mut s, &ok, row, model, ox, oy + ROW_TITLE);
        }
    }
    if bar_row == 1 {
        let oy = HEADER + rows.len() as f64 * (PANEL_H + ROW_TITLE);
        let _ = writeln!(
            s,
            r#"<text x="10" y="{}" font-size="13" font-weight="bold">{}</text>"#,
            oy + 14.0,
            esc(&format!(
                "Share of each step spent communicating at the most workers, {cluster}: lower is better"
            ))
        );
        for (ci, model) in models.iter().enumerate() {
            let ox = 10.0 + ci as f64 * PANEL_W;
            share_panel(&mut s, &ok, &cluster, model, ox, oy + ROW_TITLE);
        }
    }
    s.push_str("</svg>\n");
    s
}

fn frame(s: &mut String, title: &str, ox: f64, oy: f64) -> (f64, f64, f64, f64) {
    let (x0, y0) = (ox + MARGIN, oy + PANEL_H - MARGIN + 8.0);
    let (pw, ph) = (PANEL_W - MARGIN - 16.0, PANEL_H - MARGIN - 16.0);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" font-size="12" text-anchor="middle">{}</text>"#,
        x0 + pw / 2.0,
        oy + 10.0,
        esc(title)
    );
    let _ = writeln!(
        s,
        r##"<line x1="{x0}" y1="{y0}" x2="{}" y2="{y0}" stroke="#333"/><line x1="{x0}" y1="{y0}" x2="{x0}" y2="{}" stroke="#333"/>"##,
        x0 + pw,
        y0 - ph
    );
    (x0, y0, pw, ph)
}

/// A curve's points: (workers, speed-up, series name).
type Points = Vec<(f64, f64, String)>;

fn curve_panel(s: &mut String, ok: &[&RunRecord], row: &CurveRow, model: &str, ox: f64, oy: f64) {
    let pts_of = |lane: &str| {
        let mut p: Points = ok
            .iter()
            .filter(|r| {
                r.model == model
                    && r.workload == row.workload
                    && r.cluster == row.cluster
                    && r.lane_requested == lane
            })
            .map(|r| (r.workers as f64, r.speedup.unwrap_or(0.0), r.series()))
            .collect();
        p.sort_by(|a, b| a.0.total_cmp(&b.0));
        p
    };
    let series: Vec<(&str, Points)> = row.lanes.iter().map(|l| (*l, pts_of(l))).collect();
    let max_w = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|x| x.0))
        .fold(2.0, f64::max);
    let (x0, y0, pw, ph) = frame(s, &display(model), ox, oy);
    let px = |w: f64| x0 + (w - 1.0) / (max_w - 1.0) * pw;
    let py = |v: f64| y0 - (v / max_w).clamp(0.0, 1.05) * ph;
    for w in 1..=max_w as u32 {
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">{w}</text><text x="{}" y="{}" text-anchor="end">{w}x</text>"#,
            px(w as f64),
            y0 + 13.0,
            x0 - 4.0,
            py(w as f64) + 4.0
        );
    }
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{}" text-anchor="middle" fill="#555">workers</text>"##,
        x0 + pw / 2.0,
        y0 + 26.0
    );
    let _ = writeln!(
        s,
        r##"<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#bbb" stroke-dasharray="3,3"/>"##,
        px(1.0),
        py(1.0),
        px(max_w),
        py(max_w)
    );
    for (lane, pts) in &series {
        if pts.is_empty() {
            continue;
        }
        let color = lane_color(lane);
        let path: Vec<String> = pts
            .iter()
            .map(|(w, v, _)| format!("{:.1},{:.1}", px(*w), py(*v)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2.5"><title>{}</title></polyline>"#,
            path.join(" "),
            esc(&pts[0].2)
        );
        for (w, v, name) in pts {
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
        // The end value, written beside the last point.
        if let Some((w, v, _)) = pts.last() {
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}" fill="{color}" text-anchor="end">{v:.1}x</text>"#,
                px(*w) - 5.0,
                py(*v) + if *lane == "tcp" { 13.0 } else { -6.0 }
            );
        }
    }
}

fn share_panel(s: &mut String, ok: &[&RunRecord], cluster: &str, model: &str, ox: f64, oy: f64) {
    let (x0, y0, pw, ph) = frame(s, &display(model), ox, oy);
    for pct in [0, 50, 100] {
        let y = y0 - pct as f64 / 100.0 * ph;
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{}" text-anchor="end">{pct}%</text><line x1="{x0}" y1="{y}" x2="{}" y2="{y}" stroke="#eee"/>"##,
            x0 - 4.0,
            y + 4.0,
            x0 + pw
        );
    }
    let groups: Vec<(&str, &str)> = [
        ("allreduce", "ring"),
        ("ps-sync", "1 PS"),
        ("ps-async", "1 async PS"),
    ]
    .into_iter()
    .filter(|(w, _)| ok.iter().any(|r| r.workload == *w && r.cluster == cluster))
    .collect();
    let slot = pw / groups.len().max(1) as f64;
    for (gi, (workload, label)) in groups.iter().enumerate() {
        let largest = |lane: &str| {
            ok.iter()
                .filter(|r| {
                    r.model == model
                        && r.workload == *workload
                        && r.cluster == cluster
                        && r.lane_requested == lane
                })
                .max_by_key(|r| r.workers)
                .copied()
        };
        let (Some(t), Some(m)) = (largest("tcp"), largest("shm")) else {
            continue;
        };
        let gx = x0 + gi as f64 * slot;
        let bw = slot * 0.3;
        for (k, r) in [t, m].iter().enumerate() {
            let share = r.comm_share();
            let h = share * ph;
            let x = gx + slot * 0.15 + k as f64 * (bw + 4.0);
            let color = lane_color(&r.lane_requested);
            let _ = writeln!(
                s,
                r#"<rect x="{x:.1}" y="{:.1}" width="{bw:.1}" height="{h:.1}" fill="{color}"><title>{}: {} workers, {:.0}% communicating</title></rect><text x="{:.1}" y="{:.1}" text-anchor="middle">{:.0}%</text>"#,
                y0 - h,
                esc(&r.series()),
                r.workers,
                share * 100.0,
                x + bw / 2.0,
                y0 - h - 3.0,
                share * 100.0
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{} W={}</text>"#,
            gx + slot / 2.0,
            y0 + 13.0,
            esc(label),
            t.workers
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(w: u32, workload: &str, cluster: &str, lane: &str, speedup: f64) -> RunRecord {
        RunRecord {
            workload: workload.into(),
            model: "vgg16<&>".into(),
            cluster: cluster.into(),
            lane_requested: lane.into(),
            lane_measured: lane.into(),
            workers: w,
            steps_per_s: 1.0,
            speedup: Some(speedup),
            compute_s: 0.4,
            comm_s: 0.6,
            ..Default::default()
        }
    }

    #[test]
    fn one_comparison_per_panel() {
        let mut runs = Vec::new();
        for wl in ["allreduce", "ps-sync"] {
            for lane in ["tcp", "shm"] {
                runs.push(run(1, wl, "1x4", lane, 1.0));
                runs.push(run(2, wl, "1x4", lane, 1.5));
                // Other clusters are not drawn.
                runs.push(run(1, wl, "2x2", lane, 1.0));
                runs.push(run(2, wl, "2x2", lane, 1.2));
            }
        }
        let rep = Report {
            runs,
            ..Default::default()
        };
        let svg = scaling_svg(&rep);
        // Two rows of curves (PS, ring) x 1 model x 2 lanes.
        assert_eq!(svg.matches("<polyline").count(), 4, "{svg}");
        // And the comm-share bars: 2 workloads x 2 lanes.
        assert_eq!(svg.matches("% communicating</title></rect>").count(), 4);
        assert!(svg.contains("vgg16&lt;&amp;&gt;"));
        assert!(svg.contains(">60%</text>"));
        assert!(!svg.contains("/ 2x2"));
        assert!(svg.trim_end().ends_with("</svg>"));
    }

    #[test]
    fn rdma_rows_get_their_own_row() {
        let rep = Report {
            runs: vec![
                run(1, "allreduce", "1x4", "shm", 1.0),
                run(2, "allreduce", "1x4", "shm", 1.8),
                run(1, "allreduce", "rig 2x1", "rdma", 1.0),
                run(2, "allreduce", "rig 2x1", "rdma", 1.7),
                run(1, "allreduce", "rig 2x1", "tcp", 1.0),
                run(2, "allreduce", "rig 2x1", "tcp", 1.5),
            ],
            ..Default::default()
        };
        let svg = scaling_svg(&rep);
        let lines: Vec<&str> = svg.lines().filter(|l| l.contains("<polyline")).collect();
        assert_eq!(lines.len(), 3);
        let black = format!("stroke=\"{RDMA_COLOR}\"");
        assert_eq!(lines.iter().filter(|l| l.contains(&black)).count(), 1);
        assert!(svg.contains("allreduce / rdma / rig 2x1"));
        assert!(svg.contains("TCP against RDMA"));
    }
}
