//! `flowlane demo` end to end at a small size: real clusters, the training
//! workloads in pods over both lanes, and a report whose files exist, parse
//! and agree with what the workloads and the daemons measured.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use flowlane_e2e::binaries::workspace_artifact;
use serde_json::Value;

struct Cleanup {
    prefix: String,
    root: PathBuf,
    out: PathBuf,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for n in 1..=2 {
            let _ = Command::new(workspace_artifact("flowlane"))
                .args(["cluster", "down", "--name", &format!("{}{n}", self.prefix)])
                .arg("--run-root")
                .arg(&self.root)
                .output();
        }
        let _ = std::fs::remove_dir_all(&self.root);
        let _ = std::fs::remove_dir_all(&self.out);
    }
}

#[test]
fn small_demo_writes_a_consistent_report() {
    let _turn = crate::turn::take(module_path!());
    let pid = std::process::id();
    let c = Cleanup {
        prefix: format!("r{:05x}", pid & 0xfffff),
        root: PathBuf::from(format!("/run/flc-test-{pid}-demo")),
        out: std::env::temp_dir().join(format!("flc-report-{pid}")),
    };
    let out = Command::new(workspace_artifact("flowlane"))
        .args([
            "demo",
            "--models",
            "googlenet",
            "--workloads",
            "allreduce,ps-sync",
        ])
        .args(["--scale", "1/64", "--steps", "2", "--warmup", "1"])
        .args(["--pod-network", "10.203.0.0", "--cluster-prefix", &c.prefix])
        .arg("--run-root")
        .arg(&c.root)
        .arg("--out")
        .arg(&c.out)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    // It says where the report is, and shows progress while it runs.
    assert!(stdout.contains("report.json"), "{stdout}");
    assert!(stderr.contains("(1/"), "no progress output: {stderr}");

    let report: Value =
        serde_json::from_slice(&std::fs::read(c.out.join("report.json")).unwrap()).unwrap();
    let runs = report["runs"].as_array().unwrap();
    // Per lane, 1x4: ring with 1, 2, 4 workers, one PS with 1..3 workers,
    // two PS with 1..2 workers; 2x2: ring 1, 2, 4 plus a same-node pair,
    // one PS with 1..3 workers.
    assert_eq!(runs.len(), 2 * 8 + 2 * 7, "{report}");
    assert!(report["notes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|n| n.as_str().unwrap().contains("Scaled")));
    for r in runs {
        assert!(r.get("error").is_none(), "failed run: {r}");
        assert!(r["images_per_s"].as_f64().unwrap() > 0.0, "{r}");
        let (step, compute, comm) = (
            r["step_s"].as_f64().unwrap(),
            r["compute_s"].as_f64().unwrap(),
            r["comm_s"].as_f64().unwrap(),
        );
        // The slowest worker's step is at least the mean split.
        assert!(step + 1e-9 >= (compute + comm) * 0.5, "{r}");
        let w = r["workers"].as_u64().unwrap();
        let ev = &r["evidence"];
        let shm = ev["shm_connections"].as_u64().unwrap();
        // Without the preload library nothing can be on shared memory; and
        // a lane is only called shm with counter evidence.
        if r["lane_requested"] == "tcp" || w == 1 && r["workload"] == "allreduce" {
            assert_eq!(shm, 0, "{r}");
        }
        if shm == 0 {
            assert_eq!(r["lane_measured"], "tcp", "{r}");
        } else {
            assert!(ev["counters_read"].as_bool().unwrap(), "{r}");
            assert!(
                r["lane_measured"].as_str().unwrap().starts_with("shm"),
                "{r}"
            );
        }
        // Cross-node connections can never be on shared memory.
        if r["placement"].as_str().unwrap().starts_with("cross node") && shm > 0 {
            assert_eq!(r["lane_measured"], "shm+tcp", "{r}");
        }
        // The job's connections: W for a ring of W >= 2, W x S for PS.
        let servers = r["servers"].as_u64().unwrap();
        let conns = r["connections"].as_u64().unwrap_or(0);
        let same = r["same_node_connections"].as_u64().unwrap_or(0);
        let expected = if servers == 0 {
            if w >= 2 {
                w
            } else {
                0
            }
        } else {
            w * servers
        };
        assert_eq!(conns, expected, "{r}");
        if r["placement"].as_str().unwrap().starts_with("same node") {
            assert_eq!(same, conns, "{r}");
        }
        // The shared-memory lane engaged: a run asked for shm has a channel
        // for every connection between pods of one node (on one node: for
        // every connection of the job), and no more.
        if r["lane_requested"] == "shm" {
            assert!(ev["counters_read"].as_bool().unwrap(), "{r}");
            assert_eq!(shm, same, "same-node connections left on TCP: {r}");
            if same == conns && conns > 0 {
                assert_eq!(r["lane_measured"], "shm", "{r}");
            }
        }
        if r["workload"] == "ps-sync" {
            let (first, last) = (
                r["loss_first"].as_f64().unwrap(),
                r["loss_last"].as_f64().unwrap(),
            );
            assert!(last < first / 10.0, "PS did not train: {r}");
        }
        if r["workload"] == "allreduce" && w > 1 {
            assert!(r["busbw_gbps"].as_f64().unwrap() > 0.0, "{r}");
        }
        if w == 1 && r["cluster"] != "2x2 pairs" {
            assert!(
                (r["scaling_efficiency"].as_f64().unwrap() - 1.0).abs() < 1e-9,
                "{r}"
            );
        }
    }
    let md = std::fs::read_to_string(c.out.join("report.md")).unwrap();
    assert!(md.contains("| allreduce | googlenet |"), "{md}");
    // The report opens with findings computed from the run, the default
    // GPU profile named, images/s at the modelled rate.
    assert!(md.find("## Findings").unwrap() < md.find("## Every run").unwrap());
    assert!(md.contains("### GoogLeNet"), "{md}");
    assert!(md.contains("Recommendation for GoogLeNet"), "{md}");
    assert!(md.contains("images/s (modelled"), "{md}");
    assert!(
        report["gpu"].as_str().unwrap().starts_with("A100"),
        "{report}"
    );
    let findings = report["findings"].as_array().unwrap();
    for topic in [
        "scaling",
        "ps-saturation",
        "second-ps",
        "ring",
        "shm-lane",
        "recommendation",
    ] {
        assert!(
            findings
                .iter()
                .any(|f| f["topic"] == topic && f["model"] == "googlenet"),
            "no {topic} finding: {report}"
        );
    }
    let html = std::fs::read_to_string(c.out.join("report.html")).unwrap();
    assert!(html.contains("<section id=\"findings\">") && html.contains("<svg"));
    let svg = std::fs::read_to_string(c.out.join("scaling.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    // One comparison per panel: per lane, one PS and ring on 1x4.
    assert_eq!(svg.matches("<polyline").count(), 2 * 2, "{svg}");
    assert!(runs.iter().any(|r| r["servers"] == 2), "no sharded PS run");
    // Nothing of the clusters is left.
    let left: Vec<String> = std::fs::read_dir("/var/run/netns")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(&format!("flc{}", c.prefix)))
        .collect();
    assert!(left.is_empty(), "namespaces left: {left:?}");
}
