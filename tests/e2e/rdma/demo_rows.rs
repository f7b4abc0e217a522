//! The demo report's RDMA-lane rows, end to end on the Soft-RoCE rig:
//! `rdma-demo` (its own rig, one small model, few steps) writes rows that
//! `flowlane demo` can merge, and every cross-node row that asked for the
//! RDMA lane was carried by it (daemon counters). Figures are printed, never
//! asserted. `FLOWLANE_RDMA_RIG=skip` skips it (as every rig test).

use std::process::Command;

use flowlane_e2e::binaries::workspace_artifact;
use flowlane_workloads::report::Report;

struct RemoveOnDrop(std::path::PathBuf);
impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn rdma_demo_writes_rows_measured_on_the_rdma_lane() {
    let _turn = crate::turn::take(module_path!());
    if std::env::var("FLOWLANE_RDMA_RIG").as_deref() == Ok("skip") {
        eprintln!("SKIP: FLOWLANE_RDMA_RIG=skip, the Soft-RoCE rig is not booted");
        return;
    }
    // Not under /tmp: nothing the guests need, but keep it beside the build.
    let out = RemoveOnDrop(
        workspace_artifact("rdma-demo")
            .with_file_name(format!("rdma-rows-test-{}.json", std::process::id())),
    );
    let run = Command::new(workspace_artifact("rdma-demo"))
        .arg("--out")
        .arg(&out.0)
        .args(["--models", "googlenet", "--scale", "1/24"])
        .args(["--steps", "2", "--warmup", "1"])
        .output()
        .expect("rdma-demo runs");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    eprintln!("{stderr}\n{stdout}");
    assert!(run.status.success(), "rdma-demo failed: {stderr}\n{stdout}");

    let rep: Report = serde_json::from_slice(&std::fs::read(&out.0).expect("rows file"))
        .expect("the rows file is a report");
    // all-reduce W=1, W=2 and PS, each over tcp and rdma.
    assert_eq!(rep.runs.len(), 6, "{stdout}");
    // The default GPU, as `flowlane demo`'s (whose merge refuses another).
    assert_eq!(rep.gpu, "A100 (mixed precision)");
    for r in &rep.runs {
        assert!(r.error.is_none(), "{r:?}");
        assert!(r.images_per_s > 0.0 && r.evidence.counters_read, "{r:?}");
        let cross = r.placement.starts_with("cross node");
        match (r.lane_requested.as_str(), cross) {
            ("rdma", true) => {
                assert_eq!(r.lane_measured, "rdma", "{r:?}");
                assert!(r.evidence.rdma_bytes >= r.tensor_bytes, "{r:?}");
                // Every connection of the job (2 for the ring of 2, 1 for
                // the PS) was an RDMA channel.
                assert!(r.connections > 0, "{r:?}");
                assert_eq!(r.evidence.rdma_connections, r.connections, "{r:?}");
            }
            _ => {
                assert_eq!(r.lane_measured, "tcp", "{r:?}");
                assert_eq!(r.evidence.rdma_connections, 0, "{r:?}");
            }
        }
    }
    assert!(rep.table().contains("rig 2x1"));
}
