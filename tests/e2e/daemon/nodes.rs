//! `flowlaned`'s cross-node view, end to end with the real daemon binary:
//!
//! - with `--nodes-file` (the local cluster's static table): the daemon's
//!   view (`<state-dir>/daemon/nodes.json`) lists the table, finds this
//!   node by `--node-name`, shows RDMA discovery on a fake sysfs tree, and
//!   follows edits of the file (also a broken one, and its repair);
//! - with `--kubernetes` against a local fake API server (HTTPS on
//!   127.0.0.1 with a throwaway CA named in the kubeconfig, as a real
//!   cluster's; the only fake: Kubernetes cannot run here) that answers
//!   with responses in the API server's format and applies merge patches to
//!   its Node objects: the daemon lists the Nodes, publishes its RDMA lane
//!   (GID, device, lane port) by a JSON merge patch of the
//!   `flowlane.io/rdma-lane` annotation, removes a stale one on a node
//!   without RDMA, patches only on change, and rides out API errors (500)
//!   by logging and retrying.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use flowlane_e2e::binaries::workspace_artifact;
use flowlane_e2e::daemon;
use flowlane_e2e::fake_api::{node_object, FakeApi, ANNOTATION};
use flowlane_e2e::fsutil::TempDir;
use flowlane_e2e::process::ChildGuard;
use flowlane_e2e::wait;
use serde_json::{json, Value};

const LIVENESS: Duration = Duration::from_secs(60);

fn fixture_tree(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../rdma/tests/fixtures")
        .join(name)
}

/// A running `flowlaned` with its own state dir, socket and log.
struct Daemon {
    dir: TempDir,
    child: Option<ChildGuard>,
}

impl Daemon {
    fn spawn(tag: &str, args: &[String], env: &[(&str, String)]) -> (TempDir, ChildGuard) {
        let dir = TempDir::new(tag);
        let mut cmd = daemon::command(None, &dir.join("state"), &dir.join("flowlaned.sock"));
        cmd.args(["--log-level", "info,flowlaned=debug"])
            // In the host's namespace: no pod routes (tests/e2e/daemon/pod_routes.rs has them).
            .args(["--pod-routes", "off"])
            .args(args);
        // Nothing from the test's own environment may steer the client.
        for var in [
            "NODE_NAME",
            "KUBECONFIG",
            "KUBERNETES_SERVICE_HOST",
            "KUBERNETES_SERVICE_PORT",
            "HTTP_PROXY",
            "HTTPS_PROXY",
            "http_proxy",
            "https_proxy",
            "ALL_PROXY",
            "all_proxy",
        ] {
            cmd.env_remove(var);
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = daemon::spawn(cmd, &dir.join("flowlaned.log"));
        (dir, child)
    }

    /// Starts the daemon and waits until it answers on its socket.
    fn start(tag: &str, args: &[String], env: &[(&str, String)]) -> Daemon {
        let (dir, mut child) = Daemon::spawn(tag, args, env);
        let (socket, log) = (dir.join("flowlaned.sock"), dir.join("flowlaned.log"));
        daemon::wait_up(&mut child, &socket, &log, LIVENESS);
        Daemon {
            dir,
            child: Some(child),
        }
    }

    fn alive(&mut self) -> bool {
        matches!(
            self.child.as_mut().map(|c| c.child.try_wait()),
            Some(Ok(None))
        )
    }

    /// `flowlane status --json` against this daemon.
    fn status_json(&self) -> Value {
        let out = Command::new(workspace_artifact("flowlane"))
            .args(["status", "--json", "--socket"])
            .arg(self.dir.join("flowlaned.sock"))
            .output()
            .expect("run flowlane status");
        assert!(out.status.success(), "{out:?}");
        serde_json::from_slice(&out.stdout).expect("status --json")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("flowlaned.log")).unwrap_or_default()
    }

    /// The daemon's node view, once it has written one.
    fn view(&self) -> Option<Value> {
        let text = std::fs::read(self.dir.join("state/daemon/nodes.json")).ok()?;
        serde_json::from_slice(&text).ok()
    }

    /// Waits until the view satisfies `ok`; panics with the view and log otherwise.
    fn wait_view(&self, what: &str, mut ok: impl FnMut(&Value) -> bool) -> Value {
        let mut last = None;
        let got = wait::for_some(LIVENESS, || {
            let v = self.view()?;
            let hit = ok(&v);
            last = Some(v.clone());
            hit.then_some(v)
        });
        got.unwrap_or_else(|| {
            panic!(
                "{what}: not seen; last view: {}\nlog:\n{}",
                last.map(|v| v.to_string()).unwrap_or("none".into()),
                self.log()
            )
        })
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.terminate(Duration::from_secs(10));
        }
    }
}

/// The entries of a view, by node name.
fn nodes_of(view: &Value) -> BTreeMap<String, Value> {
    view["nodes"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|n| (n["name"].as_str().unwrap_or("").to_string(), n.clone()))
                .collect()
        })
        .unwrap_or_default()
}

fn rxe_lane(ip: &str) -> Value {
    json!({"device": "rxe0", "port": 1, "gidIndex": 1, "gid": format!("::ffff:{ip}"),
           "linkLayer": "Ethernet", "activeMtu": 1024})
}

#[test]
fn nodes_file_view_follows_the_file() {
    let _turn = crate::turn::take(module_path!());
    let tmp = TempDir::new("kbnf");
    let table = tmp.join("nodes.json");
    std::fs::write(
        &table,
        serde_json::to_vec_pretty(&json!({"nodes": [
            {"name": "kb-n1", "podCIDRs": ["10.172.1.0/24"], "underlay": "192.0.2.1",
             "rdma": rxe_lane("192.0.2.1"), "lanePort": 7401},
            {"name": "kb-n2", "podCIDRs": ["10.172.2.0/24"], "underlay": "10.172.0.2"}
        ]}))
        .unwrap(),
    )
    .unwrap();
    let args: Vec<String> = [
        "--nodes-file",
        table.to_str().unwrap(),
        "--sysfs-root",
        fixture_tree("rxe").to_str().unwrap(),
        "--nodes-refresh",
        "0.2",
    ]
    .map(String::from)
    .to_vec();
    // The node name from the environment, as the downward API gives it.
    let d = Daemon::start("kbnf1", &args, &[("NODE_NAME", "kb-n1".into())]);

    let v = d.wait_view("the table's two nodes", |v| nodes_of(v).len() == 2);
    assert_eq!(v["node"], "kb-n1");
    assert_eq!(v["listed"], true);
    assert!(v["source"].as_str().unwrap().starts_with("file "), "{v}");
    assert_eq!(v["lanePort"], 7401, "this node's lane port from the table");
    assert_eq!(v["error"], Value::Null);
    assert_eq!(
        v["publish"],
        Value::Null,
        "nothing is published from a file"
    );
    let n = nodes_of(&v);
    assert_eq!(n["kb-n2"]["podCIDRs"], json!(["10.172.2.0/24"]));
    assert_eq!(n["kb-n2"]["underlay"], "10.172.0.2");
    assert_eq!(n["kb-n1"]["rdma"]["device"], "rxe0");
    // Discovery on the fake rxe tree: rxe0 holds this node's address as a
    // RoCE v2 GID.
    assert_eq!(v["rdma"]["devices"], json!(["rxe0"]));
    assert_eq!(v["rdma"]["lane"], rxe_lane("192.0.2.1"), "{v}");
    assert_eq!(v["rdma"]["noLane"], Value::Null);
    // The same view through the daemon's socket.
    let st = d.status_json();
    assert_eq!(st["nodes"]["node"], "kb-n1", "{st}");
    assert_eq!(nodes_of(&st["nodes"]), nodes_of(&v));
    assert_eq!(st["nodes"]["rdma"], v["rdma"]);

    // A node joins and another gets a lane port: the daemon follows.
    std::fs::write(
        &table,
        serde_json::to_vec_pretty(&json!({"nodes": [
            {"name": "kb-n1", "podCIDRs": ["10.172.1.0/24"], "underlay": "192.0.2.1",
             "rdma": rxe_lane("192.0.2.1"), "lanePort": 7401},
            {"name": "kb-n2", "podCIDRs": ["10.172.2.0/24"], "underlay": "10.172.0.2",
             "lanePort": 7402},
            {"name": "kb-n3", "podCIDRs": ["10.172.3.0/24", "fd00:172:3::/64"],
             "underlay": "10.172.0.3"}
        ]}))
        .unwrap(),
    )
    .unwrap();
    let v = d.wait_view("the joined node", |v| nodes_of(v).len() == 3);
    assert!(
        wait::until(LIVENESS, || nodes_of(&d.status_json()["nodes"]).len() == 3),
        "status follows the file"
    );
    let n = nodes_of(&v);
    assert_eq!(n["kb-n2"]["lanePort"], 7402);
    assert_eq!(
        n["kb-n3"]["podCIDRs"],
        json!(["10.172.3.0/24", "fd00:172:3::/64"])
    );

    // A broken table is reported, the daemon keeps running, a fixed one is used again.
    std::fs::write(&table, "{\"nodes\": [ {\"name\": ").unwrap();
    let v = d.wait_view("the parse error", |v| v["error"].is_string());
    assert!(
        v["error"].as_str().unwrap().contains("nodes.json"),
        "the error names the file: {v}"
    );
    assert!(d.log().contains("node table unreadable"), "{}", d.log());
    std::fs::write(
        &table,
        serde_json::to_vec(&json!({"nodes": [
            {"name": "kb-n1", "podCIDRs": ["10.172.1.0/24"], "underlay": "198.51.100.1"}
        ]}))
        .unwrap(),
    )
    .unwrap();
    let v = d.wait_view("the repaired table", |v| {
        v["error"].is_null() && nodes_of(v).len() == 1
    });
    // This node's address moved off the rxe GID table: no lane, and why.
    assert_eq!(v["rdma"]["lane"], Value::Null);
    let why = v["rdma"]["noLane"].as_str().unwrap_or_default();
    assert!(why.contains("198.51.100.1"), "{v}");
    assert_eq!(v["lanePort"], Value::Null);
}

#[test]
fn a_view_needs_this_nodes_name() {
    let _turn = crate::turn::take(module_path!());
    let tmp = TempDir::new("kbnn");
    let table = tmp.join("nodes.json");
    std::fs::write(&table, r#"{"nodes": []}"#).unwrap();
    let (dir, mut child) = Daemon::spawn(
        "kbnn1",
        &["--nodes-file".into(), table.display().to_string()],
        &[],
    );
    let exited = wait::for_some(LIVENESS, || child.child.try_wait().ok().flatten())
        .expect("flowlaned without a node name must stop");
    assert!(!exited.success());
    let log = std::fs::read_to_string(dir.join("flowlaned.log")).unwrap();
    assert!(
        log.contains("--node-name") && log.contains("NODE_NAME"),
        "says what is missing: {log}"
    );
}

/// The relay never runs without the cluster's lane key: with
/// `--lane-listen`, a missing flag, a missing, empty or too short key file
/// or one readable by others stops the daemon (and `--check-config`) with
/// the reason; `--lane-transport` defaults to `rdma`, never the test
/// transport.
#[test]
fn the_relay_needs_a_good_lane_key() {
    let _turn = crate::turn::take(module_path!());
    use std::os::unix::fs::PermissionsExt;
    let tmp = TempDir::new("kblk");
    let table = tmp.join("nodes.json");
    std::fs::write(
        &table,
        r#"{"nodes": [{"name": "kblk-a", "podCIDRs": ["10.172.61.0/24"], "underlay": "127.0.0.1", "lanePort": 7471}]}"#,
    )
    .unwrap();
    let base = |extra: &[String]| -> Vec<String> {
        let mut a: Vec<String> = vec![
            "--nodes-file".into(),
            table.display().to_string(),
            "--node-name".into(),
            "kblk-a".into(),
            "--lane-listen".into(),
            format!("127.0.0.1:{}", free_port()),
        ];
        a.extend_from_slice(extra);
        a
    };
    let key_file = |name: &str, body: &str, mode: u32| -> String {
        let p = tmp.join(name);
        std::fs::write(&p, body).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p.display().to_string()
    };
    let flag = |p: String| vec!["--lane-key-file".to_string(), p];
    // A missing file passes --check-config (which also runs away from the
    // node, where the Secret is not mounted) but stops the daemon.
    let missing = base(&flag(tmp.join("absent").display().to_string()));
    let check = Command::new(workspace_artifact("flowlaned"))
        .arg("--check-config")
        .args(&missing)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&check.stdout);
    assert!(
        check.status.success() && out.contains("not here; read at start"),
        "{check:?}"
    );
    let (dir, mut child) = Daemon::spawn("kblk0", &missing, &[]);
    let exited = wait::for_some(LIVENESS, || child.child.try_wait().ok().flatten())
        .expect("flowlaned without its key file must not start");
    assert!(!exited.success());
    let log = std::fs::read_to_string(dir.join("flowlaned.log")).unwrap();
    assert!(log.contains("No such file"), "says why: {log}");
    let cases: Vec<(&str, Vec<String>, &str)> = vec![
        ("no flag", base(&[]), "--lane-key-file"),
        (
            "empty",
            base(&flag(key_file("empty.key", "\n", 0o600))),
            "is empty",
        ),
        (
            "too short",
            base(&flag(key_file("short.key", "hunter2", 0o600))),
            "too short",
        ),
        (
            "readable by others",
            base(&flag(key_file("open.key", &"k".repeat(40), 0o644))),
            "group or others",
        ),
    ];
    for (what, args, says) in cases {
        let check = Command::new(workspace_artifact("flowlaned"))
            .arg("--check-config")
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&check.stderr);
        assert_eq!(
            check.status.code(),
            Some(2),
            "{what}: --check-config: {err}"
        );
        assert!(err.contains(says), "{what}: --check-config says why: {err}");
        let (dir, mut child) = Daemon::spawn("kblk1", &args, &[]);
        let exited = wait::for_some(LIVENESS, || child.child.try_wait().ok().flatten())
            .unwrap_or_else(|| panic!("{what}: flowlaned must not start"));
        assert!(!exited.success(), "{what}");
        let log = std::fs::read_to_string(dir.join("flowlaned.log")).unwrap();
        assert!(log.contains(says), "{what}: the daemon says why: {log}");
    }
    // The default transport is RDMA, and a good key passes the check.
    let good = base(&flag(key_file("good.key", &"k".repeat(40), 0o400)));
    let check = Command::new(workspace_artifact("flowlaned"))
        .arg("--check-config")
        .args(&good)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success(), "{check:?}");
    assert!(
        out.contains("relay: rdma on") && out.contains("lane key"),
        "{out}"
    );
}

/// The DaemonSet gives every node the same flags: a node without RDMA
/// (no devices in sysfs) asked for the RDMA lane keeps serving (shm lane,
/// status) and says why its cross-node connections stay on TCP.
#[test]
fn rdma_lane_asked_on_a_node_without_rdma_keeps_the_daemon_serving() {
    let _turn = crate::turn::take(module_path!());
    let tmp = TempDir::new("kbnr");
    let no_rdma = tmp.join("sys");
    std::fs::create_dir_all(&no_rdma).unwrap();
    let table = tmp.join("nodes.json");
    std::fs::write(
        &table,
        r#"{"nodes": [{"name": "kbnr-a", "podCIDRs": ["10.172.60.0/24"], "underlay": "127.0.0.1", "lanePort": 7471}]}"#,
    )
    .unwrap();
    let port = free_port();
    let d = Daemon::start(
        "kbnr1",
        &[
            "--nodes-file".into(),
            table.display().to_string(),
            "--node-name".into(),
            "kbnr-a".into(),
            "--sysfs-root".into(),
            no_rdma.display().to_string(),
            "--lane-listen".into(),
            format!("127.0.0.1:{port}"),
            "--lane-transport".into(),
            "rdma".into(),
            "--lane-key-file".into(),
            lane_key(tmp.path()),
        ],
        &[],
    );
    let status = d.status_json();
    assert!(status.is_object(), "{status}");
    let log = d.log();
    assert!(
        log.contains("RDMA lane unavailable on this node"),
        "the log says why: {log}"
    );
}

// ---------------------------------------------------------------------
/// A lane key file (`--lane-key-file`) in `dir`, mode 0600.
fn lane_key(dir: &Path) -> String {
    let key = b"daemon_nodes: a lane key of 32 bytes or more\n";
    let p = daemon::write_lane_key(dir.join("lane.key"), key);
    p.display().to_string()
}

/// A free TCP port on 127.0.0.1 for a daemon's lane listener.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn kubernetes_view_publishes_lanes_and_survives_api_errors() {
    let _turn = crate::turn::take(module_path!());
    let mut stale = rxe_lane("10.172.0.2");
    stale["device"] = "mlx5_0".into();
    stale["lanePort"] = 7402.into();
    let mut c_lane = rxe_lane("10.172.0.3");
    c_lane["lanePort"] = 7403.into();
    let api = FakeApi::start(vec![
        // kb-a: this test's RDMA node (the rxe fixture holds 192.0.2.1).
        node_object("kb-a", &["10.172.1.0/24"], "192.0.2.1", None),
        // kb-b: had a lane once; its daemon now finds no RDMA.
        node_object("kb-b", &["10.172.2.0/24"], "10.172.0.2", Some(stale)),
        // kb-c: another node with a lane (no daemon here).
        node_object(
            "kb-c",
            &["10.172.3.0/24", "fd00:172:3::/64"],
            "10.172.0.3",
            Some(c_lane.clone()),
        ),
        // kb-new: no pod CIDR allocated yet.
        node_object("kb-new", &[], "10.172.0.4", None),
    ]);
    // The first patch fails: it must be retried.
    api.state.lock().unwrap().fail_patches = 1;
    let tmp = TempDir::new("kbkube");
    let kubeconfig = api.kubeconfig(tmp.path());
    let no_rdma = tmp.join("empty-sysfs");
    std::fs::create_dir_all(&no_rdma).unwrap();
    let env = [("KUBECONFIG", kubeconfig.display().to_string())];
    let lane_port = free_port();
    let args = |node: &str, sysfs: &Path, lane: Option<u16>| -> Vec<String> {
        let mut a: Vec<String> = [
            "--kubernetes",
            "--node-name",
            node,
            "--sysfs-root",
            sysfs.to_str().unwrap(),
            "--nodes-refresh",
            "0.3",
        ]
        .map(String::from)
        .to_vec();
        if let Some(p) = lane {
            a.extend([
                "--lane-listen".to_string(),
                format!("127.0.0.1:{p}"),
                "--lane-key-file".to_string(),
                lane_key(tmp.path()),
                // The test transport, said explicitly: it listens without an
                // RDMA device, so the lane port is published (the fake
                // sysfs has an rxe0 but no device to open).
                "--lane-transport".to_string(),
                "tcp-test".to_string(),
            ]);
        }
        a
    };
    let a = Daemon::start(
        "kbka",
        &args("kb-a", &fixture_tree("rxe"), Some(lane_port)),
        &env,
    );
    let b = Daemon::start("kbkb", &args("kb-b", &no_rdma, None), &env);

    // kb-a publishes its lane (the first patch of the two daemons failed).
    let patches_a = wait::for_some(LIVENESS, || {
        let p = api.patches_of("kb-a");
        (!p.is_empty()).then_some(p)
    })
    .unwrap_or_else(|| panic!("no PATCH of kb-a; seen {:?}\nlog:\n{}", api.seen(), a.log()));
    assert_eq!(patches_a.len(), 1, "{patches_a:?}");
    let patch = patches_a.last().unwrap();
    assert_eq!(
        patch.headers.get("content-type").map(String::as_str),
        Some("application/merge-patch+json")
    );
    assert!(
        patch.query.contains("fieldManager=flowlaned"),
        "{}",
        patch.query
    );
    assert_eq!(
        patch.headers.get("authorization").map(String::as_str),
        Some("Bearer kb-test-token"),
        "the kubeconfig's credentials are used"
    );
    assert_eq!(
        patch.body.as_object().unwrap().keys().collect::<Vec<_>>(),
        vec!["metadata"],
        "only metadata is patched: {}",
        patch.body
    );
    let annotations = patch.body["metadata"]["annotations"].as_object().unwrap();
    assert_eq!(annotations.len(), 1, "only our annotation: {}", patch.body);
    let published: Value =
        serde_json::from_str(annotations[ANNOTATION].as_str().expect("a JSON string")).unwrap();
    let mut want = rxe_lane("192.0.2.1");
    want["lanePort"] = lane_port.into();
    assert_eq!(published, want, "GID, device and lane port of kb-a");

    // kb-b has no RDMA: its stale annotation is removed (null in a merge patch).
    let patches_b = wait::for_some(LIVENESS, || {
        let p = api.patches_of("kb-b");
        (!p.is_empty()).then_some(p)
    })
    .unwrap_or_else(|| panic!("no PATCH of kb-b; log:\n{}", b.log()));
    let last_b = patches_b.last().unwrap();
    assert!(
        last_b.body["metadata"]["annotations"][ANNOTATION].is_null()
            && last_b.body["metadata"]["annotations"]
                .as_object()
                .unwrap()
                .contains_key(ANNOTATION),
        "{}",
        last_b.body
    );
    assert!(b.log().contains("no usable GID"), "{}", b.log());
    // One of the two first patches failed with 500, was logged and retried.
    let failures = a.log().matches("publishing the RDMA lane failed").count()
        + b.log().matches("publishing the RDMA lane failed").count();
    assert_eq!(failures, 1, "a:\n{}\nb:\n{}", a.log(), b.log());
    assert!(a.log().contains("leader changed") || b.log().contains("leader changed"));

    // Each daemon's view: every node with a pod CIDR, with CIDRs and lanes as
    // published (kb-a's own lane read back from the API).
    let v = a.wait_view("kb-a's lane read back", |v| {
        nodes_of(v)
            .get("kb-a")
            .is_some_and(|n| n["lanePort"] == lane_port)
    });
    let n = nodes_of(&v);
    assert_eq!(
        n.keys().map(String::as_str).collect::<Vec<_>>(),
        vec!["kb-a", "kb-b", "kb-c"],
        "kb-new has no pod CIDR yet: {v}"
    );
    assert_eq!(
        n["kb-c"]["podCIDRs"],
        json!(["10.172.3.0/24", "fd00:172:3::/64"])
    );
    assert_eq!(n["kb-c"]["underlay"], "10.172.0.3");
    assert_eq!(n["kb-c"]["lanePort"], 7403);
    assert_eq!(n["kb-c"]["rdma"]["gid"], "::ffff:10.172.0.3");
    assert_eq!(v["source"], "kubernetes");
    assert_eq!(v["rdma"]["lane"], rxe_lane("192.0.2.1"));
    let vb = b.wait_view("kb-b without a lane", |v| {
        nodes_of(v)
            .get("kb-b")
            .is_some_and(|n| n.get("rdma").is_none())
    });
    assert!(vb["rdma"]["noLane"].is_string(), "{vb}");

    // Patches only on change: more rounds, no more patches.
    let (pa, pb) = (api.patches_of("kb-a").len(), api.patches_of("kb-b").len());
    let lists = api.lists();
    assert!(wait::until(LIVENESS, || api.lists() >= lists + 6));
    assert_eq!(api.patches_of("kb-a").len(), pa, "unchanged lane, no patch");
    assert_eq!(api.patches_of("kb-b").len(), pb);
    let v = a.view().unwrap();
    assert_eq!(v["publish"], "unchanged", "{v}");

    // The API server fails lists for a while: logged and retried, the last
    // table kept, both daemons keep running and recover.
    api.state.lock().unwrap().fail_lists = 4;
    assert!(wait::until(LIVENESS, || api
        .state
        .lock()
        .unwrap()
        .fail_lists
        == 0));
    let logs = || format!("{}\n{}", a.log(), b.log());
    assert!(
        wait::until(LIVENESS, || logs().contains("node table refresh failed")
            && logs().contains("etcdserver: request timed out")),
        "{}",
        logs()
    );
    for v in [a.view().unwrap(), b.view().unwrap()] {
        assert_eq!(nodes_of(&v).len(), 3, "the last good table is kept: {v}");
    }
    a.wait_view("recovery", |v| {
        v["error"].is_null() && nodes_of(v).len() == 3
    });
    b.wait_view("recovery", |v| {
        v["error"].is_null() && nodes_of(v).len() == 3
    });
    let (mut a, mut b) = (a, b);
    assert!(a.alive() && b.alive());

    // Every list asked the watch cache (resourceVersion=0).
    for s in api.seen().iter().filter(|s| s.method == "GET") {
        assert_eq!(s.path, "/api/v1/nodes", "{s:?}");
        assert!(s.query.contains("resourceVersion=0"), "{s:?}");
    }
}

// ---------------------------------------------------------------------
// The local cluster launcher gives every node's daemon the node table.

/// Runs `flowlane cluster down` and removes the run root on drop.
struct LocalCluster {
    name: String,
    root: PathBuf,
}

impl LocalCluster {
    fn flowlane(args: &[&str]) -> std::process::Output {
        Command::new(workspace_artifact("flowlane"))
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run flowlane")
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        let out = LocalCluster::flowlane(&[
            "cluster",
            "down",
            "--name",
            &self.name,
            "--run-root",
            self.root.to_str().unwrap(),
        ]);
        if !out.status.success() {
            eprintln!("cluster down: {}", String::from_utf8_lossy(&out.stderr));
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

#[test]
fn cluster_up_gives_each_daemon_the_node_table_and_its_name() {
    let _turn = crate::turn::take(module_path!());
    let cluster = LocalCluster {
        name: format!("kb{:05x}", std::process::id() & 0xfffff),
        root: PathBuf::from(format!("/run/flc-kb-{}", std::process::id())),
    };
    std::fs::create_dir_all(&cluster.root).unwrap();
    let out = LocalCluster::flowlane(&[
        "cluster",
        "up",
        "--name",
        &cluster.name,
        "--nodes",
        "2",
        "--pods",
        "1",
        "--pod-network",
        "10.172.0.0",
        "--run-root",
        cluster.root.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "cluster up: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let run = cluster.root.join(&cluster.name);
    for (me, other) in [("n0", "n1"), ("n1", "n0")] {
        let file = run.join("nodes").join(me).join("state/daemon/nodes.json");
        let view: Value = wait::for_some(LIVENESS, || {
            serde_json::from_slice(&std::fs::read(&file).ok()?).ok()
        })
        .unwrap_or_else(|| {
            panic!(
                "{} not written; log:\n{}",
                file.display(),
                std::fs::read_to_string(run.join("nodes").join(me).join("flowlaned.log"))
                    .unwrap_or_default()
            )
        });
        assert_eq!(view["node"], me, "{view}");
        assert_eq!(view["listed"], true, "{view}");
        assert_eq!(view["error"], Value::Null, "{view}");
        assert_eq!(
            view["source"],
            format!("file {}", run.join("nodes.json").display())
        );
        let n = nodes_of(&view);
        assert_eq!(n.len(), 2, "{view}");
        let i = &other[1..];
        assert_eq!(n[other]["podCIDRs"], json!([format!("10.172.{i}.0/24")]));
        assert!(n[other]["underlay"].is_string());
        // No RDMA here: the node has no lane, and says why.
        assert_eq!(view["rdma"]["lane"], Value::Null);
        assert!(view["rdma"]["noLane"].is_string(), "{view}");
    }
}

#[test]
fn an_api_server_with_another_ca_is_refused_and_the_daemon_keeps_serving() {
    let _turn = crate::turn::take(module_path!());
    let api = FakeApi::start(vec![node_object(
        "kb-x",
        &["10.172.9.0/24"],
        "192.0.2.1",
        None,
    )]);
    let tmp = TempDir::new("kbca");
    let kubeconfig = api.kubeconfig(tmp.path());
    // The kubeconfig names a CA that did not sign the server's certificate.
    let (_, other_ca) = flowlane_e2e::fake_api::tls_config("127.0.0.1");
    std::fs::write(tmp.join("ca.pem"), other_ca).unwrap();
    let args: Vec<String> = [
        "--kubernetes",
        "--node-name",
        "kb-x",
        "--sysfs-root",
        fixture_tree("rxe").to_str().unwrap(),
        "--nodes-refresh",
        "0.3",
    ]
    .map(String::from)
    .to_vec();
    let mut d = Daemon::start(
        "kbca1",
        &args,
        &[("KUBECONFIG", kubeconfig.display().to_string())],
    );
    let v = d.wait_view("the refused list", |v| v["error"].is_string());
    assert!(nodes_of(&v).is_empty(), "{v}");
    assert!(
        v["rdma"]["noLane"]
            .as_str()
            .unwrap_or("")
            .contains("not in the node table"),
        "rxe0 is there, but without the table its address is unknown: {v}"
    );
    assert!(
        v["publish"].as_str().unwrap_or("").starts_with("skipped"),
        "{v}"
    );
    assert!(d.log().contains("node table refresh failed"), "{}", d.log());
    assert!(
        d.log().contains("invalid peer certificate"),
        "the log says why the connection failed: {}",
        d.log()
    );
    assert!(d.alive());
    assert!(
        api.seen().is_empty(),
        "no request got through TLS: {:?}",
        api.seen()
    );
}
