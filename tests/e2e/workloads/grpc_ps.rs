//! A real third-party stack over the shared-memory lane: a parameter server
//! written with Python grpcio (TensorFlow's parameter servers speak gRPC),
//! between pods of a local cluster wired by the flowlane plugin, with the
//! preload library injected. It must train correctly, and the node daemon's
//! counters must show that its connections used shared memory (and, without
//! the library, that they did not).

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use flowlane_e2e::binaries::workspace_artifact;
use serde_json::Value;

const PARAMS: usize = 20_000;
const STEPS: usize = 8;
const WORKERS: usize = 2;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/local/workloads/python/grpc_ps.py")
}

struct Cluster {
    name: String,
    root: PathBuf,
    state: Value,
}

impl Cluster {
    fn up() -> Cluster {
        let pid = std::process::id();
        let name = format!("g{:05x}", pid & 0xfffff);
        let root = PathBuf::from(format!("/run/flc-test-{pid}-grpc"));
        let out = Command::new(workspace_artifact("flowlane"))
            .args([
                "cluster", "up", "--name", &name, "--nodes", "1", "--pods", "3",
            ])
            .args(["--pod-network", "10.203.0.0", "--json", "--run-root"])
            .arg(&root)
            .output()
            .unwrap();
        let c = Cluster {
            name,
            root,
            state: serde_json::from_slice(&out.stdout).unwrap_or(Value::Null),
        };
        assert!(
            out.status.success(),
            "cluster up: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        c
    }

    fn socket(&self) -> &str {
        self.state["nodes"][0]["daemon_socket"].as_str().unwrap()
    }

    fn pod(&self, i: usize) -> (&str, &str) {
        let p = &self.state["pods"][i];
        (p["netns"].as_str().unwrap(), p["ip"].as_str().unwrap())
    }

    /// The daemon's shared-memory counters and fallbacks.
    fn counters(&self) -> (u64, u64, u64) {
        let out = Command::new(workspace_artifact("flowlane"))
            .args(["status", "--json", "--socket", self.socket()])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "flowlane status: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let shm = &v["lanes"]["shm"];
        let fallbacks = v["fallbacks"]
            .as_object()
            .map(|m| m.values().filter_map(Value::as_u64).sum())
            .unwrap_or(0);
        (
            shm["connections_opened"].as_u64().unwrap_or(0),
            shm["bytes"].as_u64().unwrap_or(0),
            fallbacks,
        )
    }

    fn python(&self, pod: usize, preload: bool, args: &[String]) -> Child {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", self.pod(pod).0, "env"]);
        if preload {
            cmd.arg(format!(
                "LD_PRELOAD={}",
                workspace_artifact("libflowlane_preload.so").display()
            ));
            cmd.arg(format!("FLOWLANE_SOCKET={}", self.socket()));
        }
        cmd.arg("/usr/bin/python3")
            .arg(script())
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// One training job; returns the workers' results.
    fn train(&self, preload: bool, port: u16) -> Vec<Value> {
        let addr = format!("{}:{port}", self.pod(0).1);
        let n = |v: usize| v.to_string();
        let mut server = self.python(
            0,
            preload,
            &[
                "server".into(),
                "--listen".into(),
                addr.clone(),
                "--params".into(),
                n(PARAMS),
                "--workers".into(),
                n(WORKERS),
            ],
        );
        // Workers start once the server listens: a connect before that is
        // refused, and the daemon counts it as a fallback (no listener).
        let mut server_out = BufReader::new(server.stdout.take().unwrap());
        let mut line = String::new();
        server_out.read_line(&mut line).unwrap();
        if !line.contains("listening") {
            let out = server.wait_with_output().unwrap();
            panic!(
                "grpc server did not start: {line} {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let workers: Vec<Child> = (0..WORKERS)
            .map(|rank| {
                self.python(
                    rank + 1,
                    preload,
                    &[
                        "worker".into(),
                        "--server".into(),
                        addr.clone(),
                        "--rank".into(),
                        n(rank),
                        "--workers".into(),
                        n(WORKERS),
                        "--params".into(),
                        n(PARAMS),
                        "--steps".into(),
                        n(STEPS),
                    ],
                )
            })
            .collect();
        let mut results = Vec::new();
        for w in workers {
            let out = w.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "grpc worker: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            results.push(serde_json::from_slice(&out.stdout).expect("worker JSON"));
        }
        let out = server.wait_with_output().unwrap();
        let mut rest = String::new();
        server_out.read_to_string(&mut rest).unwrap();
        assert!(
            out.status.success(),
            "grpc server: {rest} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        results
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(workspace_artifact("flowlane"))
            .args(["cluster", "down", "--name", &self.name, "--run-root"])
            .arg(&self.root)
            .output();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn assert_trained(results: &[Value]) {
    assert_eq!(results.len(), WORKERS);
    for r in results {
        let first = r["loss_first"].as_f64().unwrap();
        let last = r["loss_last"].as_f64().unwrap();
        // 8 synchronous steps at lr 0.5 on the averaged gradient: 4^-8.
        assert!(last < first * 1e-4, "did not train: {r}");
    }
}

#[test]
fn grpcio_parameter_server_trains_over_the_shared_memory_lane() {
    let _turn = crate::turn::take(module_path!());
    let c = Cluster::up();

    // With the preload library: every worker's channel is on shared memory.
    let (opened0, bytes0, fallbacks0) = c.counters();
    let results = c.train(true, 7400);
    assert_trained(&results);
    let (opened1, bytes1, fallbacks1) = c.counters();
    assert!(
        opened1 - opened0 >= WORKERS as u64,
        "expected >= {WORKERS} shared-memory connections, the daemon counted {}",
        opened1 - opened0
    );
    assert_eq!(fallbacks1, fallbacks0, "some connection stayed on TCP");
    // Every step pushes a gradient and pulls the parameters (float32 each).
    let payload = (WORKERS * STEPS * PARAMS * 4 * 2) as u64;
    assert!(
        bytes1 - bytes0 >= payload,
        "shared memory carried {} bytes, the tensors alone are {payload}",
        bytes1 - bytes0
    );

    // Control: without the library the same job trains the same way and
    // nothing moves through shared memory.
    let results_tcp = c.train(false, 7401);
    assert_trained(&results_tcp);
    assert_eq!(
        results_tcp[0]["loss_last"], results[0]["loss_last"],
        "the lanes must not change the arithmetic"
    );
    let (opened2, bytes2, _) = c.counters();
    assert_eq!((opened2, bytes2), (opened1, bytes1));
}
