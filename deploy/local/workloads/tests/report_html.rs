//! `report.html` as a browser sees it: headless Chromium loads the file and
//! dumps the rendered DOM, which must hold the findings section with a
//! finding per model and the inline chart. Fails (does not skip) when
//! Chromium is missing: `.ci/install-deps` installs Debian's `chromium`.

use std::path::PathBuf;
use std::process::Command;

use flowlane_workloads::report::{Report, RunRecord};

/// Directories this test made, removed when it ends (also on a failure).
struct Scratch(Vec<PathBuf>);

impl Scratch {
    fn dir(&mut self, tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("flowlane-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        self.0.push(d.clone());
        d
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for d in &self.0 {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// A report of two models on one node over both lanes, as `finish` leaves it.
fn report() -> Report {
    let mut runs = Vec::new();
    for (model, ips) in [
        ("googlenet", [100.0, 195.0, 290.0]),
        ("vgg16", [100.0, 90.0, 85.0]),
    ] {
        for lane in ["tcp", "shm"] {
            for workload in ["ps-sync", "allreduce"] {
                for (i, v) in ips.iter().enumerate() {
                    let w = i as u32 + 1;
                    let boost = if lane == "shm" { 1.2 } else { 1.0 };
                    runs.push(RunRecord {
                        workload: workload.into(),
                        model: model.into(),
                        cluster: "1x4".into(),
                        placement: "same node".into(),
                        lane_requested: lane.into(),
                        lane_measured: if lane == "shm" && w > 1 { "shm" } else { "tcp" }.into(),
                        workers: w,
                        servers: u32::from(workload == "ps-sync"),
                        batch: 32,
                        steps: 5,
                        steps_per_s: v * boost / 32.0 / w as f64,
                        compute_s: 0.01,
                        comm_s: 0.01 * w as f64,
                        connections: u64::from(w),
                        same_node_connections: u64::from(w),
                        ..Default::default()
                    });
                }
            }
        }
    }
    let mut rep = Report {
        title: "html <test> & report".into(),
        gpu: "A100 (mixed precision)".into(),
        scale: 1.0,
        notes: vec!["a note".into()],
        runs,
        ..Default::default()
    };
    rep.finish();
    rep
}

#[test]
fn report_html_shows_its_findings_in_chromium() {
    let mut scratch = Scratch(Vec::new());
    let dir = scratch.dir("report-html");
    let profile = scratch.dir("chromium-profile");
    let rep = report();
    let files = rep.write(&dir).unwrap();
    let html_path = files
        .iter()
        .find(|p| p.extension().is_some_and(|e| e == "html"))
        .expect("write() makes report.html")
        .clone();
    let html = std::fs::read_to_string(&html_path).unwrap();
    // Self-contained: no script, stylesheet, image or font from elsewhere
    // (the only URL is the SVG namespace).
    for bad in ["<script", "<link", "<img", "@import", "src=", "url("] {
        assert!(!html.contains(bad), "{bad} in report.html");
    }
    assert_eq!(
        html.matches("http").count(),
        html.matches("http://www.w3.org/2000/svg").count(),
        "a URL other than the SVG namespace"
    );

    let out = Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg("--dump-dom")
        .arg(format!("file://{}", html_path.display()))
        .output()
        .expect("chromium must be installed (.ci/install-deps: Debian package chromium)");
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "chromium failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    // The findings come first, with a finding per model, rendered.
    let findings = dom
        .find("<section id=\"findings\">")
        .unwrap_or_else(|| panic!("no findings section in the DOM:\n{dom}"));
    let table = dom.find("<table>").expect("no table in the DOM");
    assert!(findings < table, "findings are not before the table");
    for model in ["googlenet", "vgg16"] {
        let li = format!("<li class=\"finding\" data-model=\"{model}\" data-topic=\"scaling\">");
        let at = dom
            .find(&li)
            .unwrap_or_else(|| panic!("no scaling finding for {model} in the DOM"));
        assert!(at < table);
    }
    // What the findings say is what the runs show.
    assert!(dom.contains("GoogLeNet scales almost linearly"), "{dom}");
    assert!(dom.contains("VGG16 gets slower with more workers"), "{dom}");
    assert!(dom.contains("data-topic=\"recommendation\""));
    // The chart is inline and was parsed as SVG, and the title's
    // special characters survived escaping.
    assert!(dom.contains("<svg"), "no inline chart");
    assert!(dom.contains("<polyline"));
    assert!(dom.contains("html &lt;test&gt; &amp; report"));
}
