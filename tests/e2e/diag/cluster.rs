//! `flowlane diag` against a live local cluster (`flowlane cluster up`:
//! nodes and pods as network namespaces, pods wired by the real plugin, one
//! real `flowlaned` per node), run inside a node's namespace as an operator
//! would. Node `n0` must come out healthy; node `n1`, after the accidents
//! of real nodes (daemon killed, pod lost without CNI DEL, a stray lease),
//! must be reported broken with each problem named; then a half-written
//! conflist on `n0`.
//!
//! Names: cluster `dg<pid>` (netns `flcdg<pid>-*`, all bridges and routes
//! inside its namespaces), pod network 10.204.0.0/16.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use flowlane_e2e::binaries;
use flowlane_e2e::fsutil::TempDir;
use flowlane_e2e::process;
use serde_json::Value;

/// A cluster brought up for the test, torn down on drop.
struct Cluster {
    name: String,
    root: TempDir,
}

impl Cluster {
    fn up() -> Cluster {
        let name = format!("dg{:x}", std::process::id() % 0xfffff);
        let root = TempDir::new("dgc");
        let c = Cluster { name, root };
        let out = c.run(&[
            "up",
            "--nodes",
            "2",
            "--pods",
            "2",
            "--pod-network",
            "10.204.0.0",
        ]);
        assert!(out.success(), "cluster up: {}\n{}", out.stdout, out.stderr);
        c
    }

    fn run(&self, args: &[&str]) -> process::Output {
        let mut cmd = Command::new(binaries::flowlane());
        cmd.arg("cluster")
            .args(&args[..1])
            .args(["--name", &self.name, "--run-root"])
            .arg(self.root.path())
            .args(&args[1..])
            .env_remove("CNI_COMMAND");
        process::run(&mut cmd, Duration::from_secs(300)).expect("run flowlane cluster")
    }

    fn status(&self) -> Value {
        let out = self.run(&["status", "--json"]);
        serde_json::from_str(&out.stdout).expect("cluster status --json")
    }

    fn dir(&self) -> PathBuf {
        self.root.join(&self.name)
    }

    fn node_dir(&self, node: &str) -> PathBuf {
        self.dir().join("nodes").join(node)
    }

    /// `flowlane diag --json` inside node `node`'s namespace, given the
    /// cluster's node table.
    fn diag(&self, node: &str) -> (i32, Value) {
        self.diag_with_table(node, true)
    }

    /// As `diag`; without the table diag falls back to the daemon's view.
    fn diag_with_table(&self, node: &str, table: bool) -> (i32, Value) {
        let no_rdma = self.root.join("sys-without-rdma");
        std::fs::create_dir_all(&no_rdma).unwrap();
        let netns = format!("flc{}-{node}", self.name);
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &netns])
            .arg(binaries::flowlane())
            .args(["diag", "--json", "--cni-conf-dir"])
            .arg(self.node_dir(node))
            .arg("--cni-bin-dir")
            .arg(binaries::build_dir())
            .arg("--sysfs")
            .arg(&no_rdma)
            .env_remove("CNI_COMMAND");
        if table {
            cmd.arg("--nodes").arg(self.dir().join("nodes.json"));
        }
        let out = process::run(&mut cmd, Duration::from_secs(60)).expect("run diag");
        let report = serde_json::from_str(&out.stdout)
            .unwrap_or_else(|e| panic!("no JSON ({e}): {}\n{}", out.stdout, out.stderr));
        (out.status.code().unwrap_or(-1), report)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.run(&["down"]);
    }
}

fn problem_ids(report: &Value) -> Vec<String> {
    report["problems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            format!(
                "{}:{}",
                p["severity"].as_str().unwrap(),
                p["id"].as_str().unwrap()
            )
        })
        .collect()
}

fn finding_ids(report: &Value) -> Vec<String> {
    report["sections"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["findings"].as_array().unwrap().iter())
        .map(|f| f["id"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn diag_on_a_live_local_cluster() {
    let _turn = crate::turn::take(module_path!());
    let cluster = Cluster::up();

    // A node as `cluster up` leaves it: healthy, and its peer reachable.
    let (code, report) = cluster.diag("n0");
    assert_eq!(problem_ids(&report), Vec::<String>::new(), "{report:#}");
    assert_eq!(code, 0);
    let found = finding_ids(&report);
    for id in [
        "cni.config_ok",
        "bridge.gateway_ok",
        "daemon.up",
        "pods.live",
        "nodes.self",
        "nodes.route_ok",
    ] {
        assert!(found.contains(&id.to_string()), "{id} missing: {report:#}");
    }
    // Without a table, diag checks against the daemon's own view.
    let (code, report) = cluster.diag_with_table("n0", false);
    assert_eq!(problem_ids(&report), Vec::<String>::new(), "{report:#}");
    assert_eq!(code, 0);
    let found = finding_ids(&report);
    for id in ["nodes.self", "nodes.route_ok"] {
        assert!(found.contains(&id.to_string()), "{id} missing: {report:#}");
    }
    let nodes_section = report["sections"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "nodes")
        .expect("nodes section");
    assert!(
        nodes_section["title"]
            .as_str()
            .is_some_and(|t| t.contains("flowlaned's view")),
        "{nodes_section:#}"
    );

    // The connectivity check on the healthy cluster: bytes move on both
    // pairs, the same-node pair on shared memory (the local cluster runs no
    // relay, so the cross-node pair is on TCP, with the daemons' reason).
    let out = cluster.run(&["check", "--json"]);
    assert!(
        out.success(),
        "cluster check: {}\n{}",
        out.stdout,
        out.stderr
    );
    let pairs: Value = serde_json::from_str(&out.stdout).expect("check --json");
    let pair = |kind: &str| {
        pairs
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["kind"] == kind)
            .unwrap_or_else(|| panic!("no {kind} pair: {pairs:#}"))
            .clone()
    };
    let same = pair("same-node");
    assert_eq!(
        (&same["bytes_ok"], &same["lane"]),
        (&Value::Bool(true), &Value::from("shm")),
        "{same:#}"
    );
    let cross = pair("cross-node");
    assert_eq!(
        (&cross["bytes_ok"], &cross["lane"]),
        (&Value::Bool(true), &Value::from("tcp")),
        "{cross:#}"
    );
    assert!(
        !cross["tcp_reasons"].as_array().unwrap().is_empty(),
        "{cross:#}"
    );

    // Node n1 after accidents: its daemon killed, a pod's netns removed
    // without CNI DEL, a lease written for a container nobody knows.
    let status = cluster.status();
    let n1_pid = status["state"]["nodes"][1]["daemon_pid"]
        .as_u64()
        .expect("n1 daemon pid") as i32;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(n1_pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill n1's flowlaned");
    // kill(2) returns before the process is gone; until then its socket
    // still accepts. Wait for the kernel to have torn it down.
    let gone = flowlane_e2e::wait::until(Duration::from_secs(30), || {
        match std::fs::read_to_string(format!("/proc/{n1_pid}/stat")) {
            Err(_) => true,
            // A zombie has closed its sockets.
            Ok(stat) => stat
                .rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('Z')),
        }
    });
    assert!(gone, "n1's flowlaned did not die");
    let lost = status["state"]["pods"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["node"] == 1)
        .unwrap()
        .clone();
    process::sh(&["ip", "netns", "del", lost["netns"].as_str().unwrap()]).expect_ok("netns del");
    let lease_dir = cluster.node_dir("n1").join("ipam/flowlane-cluster");
    assert!(lease_dir.is_dir(), "lease dir {}", lease_dir.display());
    std::fs::write(lease_dir.join("10.204.1.200"), "c0ffee0000000001\r\neth0").unwrap();

    let (code, report) = cluster.diag("n1");
    let problems = problem_ids(&report);
    assert_ne!(code, 0);
    for id in [
        "error:daemon.down",
        "error:pods.netns_missing",
        "error:ipam.leaked_lease",
    ] {
        assert!(
            problems.contains(&id.to_string()),
            "{id} missing: {problems:?}"
        );
    }
    let leaked: Vec<&Value> = report["problems"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["id"] == "ipam.leaked_lease")
        .collect();
    assert_eq!(
        leaked.len(),
        2,
        "the lost pod's lease and the stray one: {leaked:?}"
    );
    let lost_id = lost["container_id"].as_str().unwrap();
    assert!(
        report["problems"].as_array().unwrap().iter().any(
            |p| p["id"] == "pods.netns_missing" && p["fix"].as_str().unwrap().contains(lost_id)
        ),
        "{report:#}"
    );
    // n0 is untouched by n1's trouble.
    assert_eq!(cluster.diag("n0").0, 0);

    // A half-written conflist on n0 (a non-atomic installer).
    let conflist = cluster.node_dir("n0").join("net.conflist");
    let text = std::fs::read_to_string(&conflist).unwrap();
    std::fs::write(&conflist, &text[..text.len() / 3]).unwrap();
    let (code, report) = cluster.diag("n0");
    assert!(
        problem_ids(&report).contains(&"error:cni.invalid_json".to_string()),
        "{report:#}"
    );
    assert_ne!(code, 0);
    assert!(Path::new(&conflist).exists());
}
