//! `flowlane cluster up|down`: a real two-node cluster (namespaces, bridges,
//! veths, host-gw routes, node daemons, pods wired by the flowlane plugin)
//! carries cross-node traffic, and `down` leaves nothing behind, also after
//! `up` was killed with SIGKILL halfway.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use flowlane_e2e::binaries::workspace_artifact;
use serde_json::Value;

/// Cluster tests are heavy (namespaces, daemons): one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// A cluster name unique to this process and test (≤ 8 characters).
fn cluster_name(tag: char) -> String {
    format!("t{:05x}{tag}", std::process::id() & 0xfffff)
}

/// A private run root, removed (after `down`) on drop.
struct Root(PathBuf);

impl Root {
    fn new(tag: char) -> Root {
        let p = PathBuf::from(format!("/run/flc-test-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        Root(p)
    }
    fn arg(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

/// Tears the cluster down on drop, so a failing test leaves nothing.
struct ClusterGuard<'a> {
    name: String,
    root: &'a Root,
}

impl Drop for ClusterGuard<'_> {
    fn drop(&mut self) {
        let _ = flowlane(&[
            "cluster",
            "down",
            "--name",
            &self.name,
            "--run-root",
            self.root.arg(),
        ]);
        let _ = std::fs::remove_dir_all(&self.root.0);
    }
}

fn flowlane(args: &[&str]) -> std::process::Output {
    Command::new(workspace_artifact("flowlane"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run flowlane")
}

fn cluster_netns(name: &str) -> Vec<String> {
    let prefix = format!("flc{name}-");
    std::fs::read_dir("/var/run/netns")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}

/// Processes whose command line mentions `needle` (the cluster's run dir
/// appears in every daemon's arguments).
fn processes_mentioning(needle: &str) -> Vec<i32> {
    let me = std::process::id() as i32;
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid != me)
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let zombie = stat
                .rfind(')')
                .is_some_and(|i| stat[i + 1..].trim_start().starts_with('Z'));
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            !zombie && String::from_utf8_lossy(&cmd).contains(needle)
        })
        .collect()
}

fn assert_nothing_left(name: &str, root: &Root) {
    assert_eq!(
        cluster_netns(name),
        Vec::<String>::new(),
        "namespaces left behind"
    );
    let run_dir = root.0.join(name);
    assert!(!run_dir.exists(), "{} left behind", run_dir.display());
    let procs = processes_mentioning(run_dir.to_str().unwrap());
    assert!(procs.is_empty(), "processes of the cluster left: {procs:?}");
}

fn up(name: &str, root: &Root, nodes: &str, pods: &str) -> Value {
    let out = flowlane(&[
        "cluster",
        "up",
        "--name",
        name,
        "--nodes",
        nodes,
        "--pods",
        pods,
        "--pod-network",
        "10.203.0.0",
        "--run-root",
        root.arg(),
        "--json",
    ]);
    assert!(
        out.status.success(),
        "cluster up failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("cluster up --json")
}

fn pod<'a>(state: &'a Value, name: &str) -> &'a Value {
    state["pods"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("pod {name} in {state}"))
}

/// Runs a 2-member all-reduce ring between two pods and checks its sums.
fn ring_between(a: &Value, b: &Value) {
    let train = workspace_artifact("flowlane-train");
    let spawn = |me: &Value, rank: u32, next: &Value| {
        Command::new("ip")
            .args(["netns", "exec", me["netns"].as_str().unwrap()])
            .arg(&train)
            .args(["allreduce-worker", "--workers", "2", "--elements", "100003"])
            .args(["--rank", &rank.to_string()])
            .args(["--listen", &format!("{}:7300", me["ip"].as_str().unwrap())])
            .args(["--next", &format!("{}:7300", next["ip"].as_str().unwrap())])
            .args(["--steps", "3", "--connect-timeout", "30"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let x = spawn(a, 0, b);
    let y = spawn(b, 1, a);
    for child in [x, y] {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "ring worker: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let r: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(r["sums_checked"], true);
        assert_eq!(r["steps"], 3);
    }
}

#[test]
fn up_wires_two_nodes_and_down_leaves_nothing() {
    let _turn = crate::turn::take(module_path!());
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let name = cluster_name('a');
    let root = Root::new('a');
    let guard = ClusterGuard {
        name: name.clone(),
        root: &root,
    };
    let state = up(&name, &root, "2", "2");

    // Every node has a live daemon with its own socket; pods are in the
    // node's pod CIDR.
    let nodes = state["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 2);
    for (i, n) in nodes.iter().enumerate() {
        assert_eq!(n["pod_cidr"], format!("10.203.{i}.0/24"));
        assert!(n["daemon_pid"].is_i64(), "daemon of node {i}: {n}");
        assert!(Path::new(n["daemon_socket"].as_str().unwrap()).exists());
    }
    assert!(pod(&state, "n1p0")["ip"]
        .as_str()
        .unwrap()
        .starts_with("10.203.1."));
    let status = flowlane(&[
        "cluster",
        "status",
        "--name",
        &name,
        "--run-root",
        root.arg(),
    ]);
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stdout)
    );

    // Real traffic: same-node and cross-node (through both bridges, the
    // underlay and the host-gw routes).
    ring_between(pod(&state, "n0p0"), pod(&state, "n0p1"));
    ring_between(pod(&state, "n0p0"), pod(&state, "n1p1"));

    // A second `up` of the same cluster is refused, and changes nothing.
    let again = flowlane(&["cluster", "up", "--name", &name, "--run-root", root.arg()]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));

    let down = flowlane(&["cluster", "down", "--name", &name, "--run-root", root.arg()]);
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    assert_nothing_left(&name, &root);
    // Idempotent.
    let down = flowlane(&["cluster", "down", "--name", &name, "--run-root", root.arg()]);
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    drop(guard);
}

#[test]
fn down_after_a_killed_up_leaves_nothing() {
    let _turn = crate::turn::take(module_path!());
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let name = cluster_name('k');
    let root = Root::new('k');
    let guard = ClusterGuard {
        name: name.clone(),
        root: &root,
    };
    // Kill `up` at different depths: after the first node, and in the
    // middle of the pods (daemons already running).
    for kill_after in ["\"netns\"", "\"pod\""] {
        let mut child = Command::new(workspace_artifact("flowlane"))
            .args([
                "cluster", "up", "--name", &name, "--nodes", "2", "--pods", "4",
            ])
            .args(["--pod-network", "10.203.0.0", "--run-root", root.arg()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let journal = root.0.join(&name).join("journal");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let text = std::fs::read_to_string(&journal).unwrap_or_default();
            let hits = text.matches(kill_after).count();
            if (kill_after == "\"pod\"" && hits >= 3) || (kill_after == "\"netns\"" && hits >= 2) {
                break;
            }
            if let Ok(Some(s)) = child.try_wait() {
                panic!("up finished ({s}) before it could be killed; journal:\n{text}");
            }
            assert!(
                Instant::now() < deadline,
                "up made no progress; journal:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        assert!(
            !cluster_netns(&name).is_empty(),
            "up was killed before creating anything: the test proves nothing"
        );
        let down = flowlane(&["cluster", "down", "--name", &name, "--run-root", root.arg()]);
        assert!(
            down.status.success(),
            "down after kill at {kill_after}: {}\n{}",
            String::from_utf8_lossy(&down.stdout),
            String::from_utf8_lossy(&down.stderr)
        );
        assert_nothing_left(&name, &root);
    }
    drop(guard);
}

#[test]
fn down_of_an_unknown_cluster_succeeds_and_bad_names_are_refused() {
    let _turn = crate::turn::take(module_path!());
    let root = Root::new('u');
    let name = cluster_name('u');
    let down = flowlane(&["cluster", "down", "--name", &name, "--run-root", root.arg()]);
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    for bad in ["", "UPPER", "much-too-long", "../x"] {
        let out = flowlane(&["cluster", "up", "--name", bad, "--run-root", root.arg()]);
        assert!(!out.status.success(), "name {bad:?} accepted");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("cluster name"),
            "{bad:?}"
        );
    }
    let out = flowlane(&[
        "cluster",
        "up",
        "--name",
        &name,
        "--nodes",
        "0",
        "--run-root",
        root.arg(),
    ]);
    assert!(!out.status.success());
    assert!(
        cluster_netns(&name).is_empty(),
        "a refused spec created namespaces"
    );
    let _ = std::fs::remove_dir_all(&root.0);
}
