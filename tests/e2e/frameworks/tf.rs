//! TensorFlow 2 parameter-server training through the lanes
//! (`tests/frameworks/tf_ps.py`, tensorflow-cpu from the venv of
//! `.ci/install-deps`): `ParameterServerStrategy` with a coordinator (the
//! "chief" task), PS and worker tasks each a `tf.distribute.Server` in its
//! own pod, the cluster given to every task by `TF_CONFIG` as a TFJob does.
//! TF2's PS training needs the coordinator: the workers run no loop of their
//! own, they execute the functions the coordinator schedules on them, and
//! read and update the variables on the PS tasks over gRPC.
//!
//! Each configuration runs on plain TCP (no library) and then with the
//! preload library (shared-memory lane on one node, the relay across two),
//! in the same run. Checks: after a round-robin phase (step s on worker
//! s mod W, one at a time) the parameters are bit-identical on both lanes,
//! whatever the placement; the asynchronous phase that follows (the
//! ClusterCoordinator as users run it) trains without diverging, and with
//! one worker also ends bit-identical; every TCP connection between the job's pods is a
//! channel of its lane while the job holds them, no connection fell back to
//! TCP, and without the library no connection is brokered. Figures: steps/s
//! per configuration, lane vs TCP.

use std::path::PathBuf;
use std::time::Duration;

use flowlane_e2e::frameworks::{
    assert_job_on_lanes, assert_job_on_tcp, require_python_module, script, sockets_of, Counters,
    Evidence, RelayPair, Site, Task, ML_VENV_PYTHON,
};
use flowlane_e2e::shm::{heavy, Node};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(300);

fn require_tf() {
    require_python_module(
        ML_VENV_PYTHON,
        "tensorflow",
        "tensorflow-cpu in /opt/flowlane-ml: run .ci/install-deps",
    );
}

/// A job's placement: the coordinator, the PS tasks, the workers.
struct Placement {
    chief: Site,
    ps: Vec<Site>,
    workers: Vec<Site>,
}

impl Placement {
    fn sites(&self) -> Vec<Site> {
        let mut v = vec![self.chief.clone()];
        v.extend(self.ps.iter().cloned());
        v.extend(self.workers.iter().cloned());
        v
    }

    fn name(&self) -> String {
        format!("{} PS, {} worker(s)", self.ps.len(), self.workers.len())
    }
}

/// One training job; the chief's result, the lane evidence taken while it
/// held every channel, and what the daemons counted meanwhile.
fn ps_job(p: &Placement, preload: bool, port: u16) -> (Value, Evidence, Counters) {
    let sites = p.sites();
    let sockets: Vec<PathBuf> = sockets_of(&sites);
    let before = Counters::read(&sockets);
    let addr = |s: &Site| format!("{}:{port}", s.ip);
    let cluster = json!({
        "chief": [addr(&p.chief)],
        "ps": p.ps.iter().map(addr).collect::<Vec<_>>(),
        "worker": p.workers.iter().map(addr).collect::<Vec<_>>(),
    });
    let script = script("tf_ps.py");
    let task = |site: &Site, kind: &str, index: usize| {
        let tf_config = json!({"cluster": cluster, "task": {"type": kind, "index": index}});
        let env = [("TF_CONFIG", tf_config.to_string())];
        let argv = [ML_VENV_PYTHON, script.to_str().unwrap()];
        Task::spawn(site.cmd(preload, &env, &argv), &format!("{kind} {index}"))
    };
    // Every task imports TensorFlow at once (slow); the chief waits for the
    // go until every server listens.
    let mut servers: Vec<Task> =
        p.ps.iter()
            .enumerate()
            .map(|(i, s)| task(s, "ps", i))
            .collect();
    servers.extend(
        p.workers
            .iter()
            .enumerate()
            .map(|(i, s)| task(s, "worker", i)),
    );
    let mut chief = task(&p.chief, "chief", 0);
    for s in &mut servers {
        s.until("SERVING", T);
    }
    chief.until("READY", T);
    chief.release();
    let result = chief.result_held(T);
    let evidence = Evidence::take(&sites, &sockets);
    // Counted while the job holds its connections: at teardown, a close
    // report from a process already exiting is refused (`auth-failed`),
    // which says nothing about the lane the job's connections rode.
    let counted = Counters::read(&sockets).since(&before);
    chief.release();
    chief.finish(Duration::from_secs(60));
    drop(servers);
    (result, evidence, counted)
}

fn f(v: &Value, k: &str) -> f64 {
    v[k].as_f64()
        .unwrap_or_else(|| panic!("{k} in {v} (null: the training diverged)"))
}

/// Runs `p` on plain TCP, then with the library; checks; prints figures.
fn both_lanes(p: &Placement, port: u16, where_: &str) {
    let what = format!("{where_}, {}", p.name());
    let (tcp, ev_tcp, c_tcp) = ps_job(p, false, port);
    assert_job_on_tcp(&ev_tcp, &c_tcp, &format!("{what} tcp"));
    let (lane, ev, counted) = ps_job(p, true, port + 1);

    assert_eq!(
        f(&tcp, "eval_loss_first"),
        f(&lane, "eval_loss_first"),
        "{what}: the initial parameters differ"
    );
    // Round-robin phase: deterministic for any number of workers, so any
    // byte a channel changed shows as different parameters.
    assert_eq!(
        tcp["params_sha256_sync"], lane["params_sha256_sync"],
        "{what}: after the round-robin steps the parameters differ: the lane changed a byte"
    );
    for (r, l) in [(&tcp, "tcp"), (&lane, "lane")] {
        let first = f(r, "eval_loss_first");
        let (sync, last) = (f(r, "eval_loss_sync"), f(r, "eval_loss_last"));
        assert!(
            sync < 0.8 * first,
            "{what} {l}: the round-robin steps did not train: {r}"
        );
        // Asynchronous phase: its result depends on timing (which stale
        // parameters each update lands on), on any lane; it must not
        // diverge (`f` fails on null) nor undo the training.
        assert!(
            last < first,
            "{what} {l}: the asynchronous steps diverged: {r}"
        );
    }
    if p.workers.len() == 1 {
        assert_eq!(
            tcp["params_sha256"], lane["params_sha256"],
            "{what}: one worker is deterministic, the lane changed the arithmetic"
        );
    }

    let summary = assert_job_on_lanes(&ev, &counted, &p.sites(), &what);
    eprintln!("{summary} (tcp run: {} connections)", ev_tcp.job.len());
    let (s_tcp, s_lane) = (f(&tcp, "steps_per_s"), f(&lane, "steps_per_s"));
    println!(
        "figure tf-ps {what}: {s_lane:.1} steps/s on the lane, {s_tcp:.1} on tcp ({:.2}x); \
         final eval loss lane {:.4}, tcp {:.4}",
        s_lane / s_tcp,
        f(&lane, "eval_loss_last"),
        f(&tcp, "eval_loss_last"),
    );
}

/// The placement on `node`: the coordinator in pod 0, `ps` PS tasks from
/// pod 1, `workers` workers from pod 3, every task in its own pod.
fn same_node_job(node: &Node, ps: usize, workers: usize) {
    let s: Vec<Site> = node
        .pods
        .iter()
        .map(|p| Site::of(p, &node.socket()))
        .collect();
    let p = Placement {
        chief: s[0].clone(),
        ps: s[1..1 + ps].to_vec(),
        workers: s[3..3 + workers].to_vec(),
    };
    both_lanes(&p, 2300 + 10 * (ps * 4 + workers) as u16, "same node");
}

/// A node with pods for the coordinator, 2 PS tasks and `workers` workers.
fn tf_node(workers: usize) -> Node {
    let node = Node::new_in("tfps", 3 + workers, 245);
    assert_eq!(node.wiring, "cni", "pods must be wired by the real plugin");
    node
}

/// One node, 1 PS and 1 worker: deterministic in both phases.
#[test]
fn tf_parameter_server_same_node_one_ps_one_worker() {
    let _turn = crate::turn::take(module_path!());
    require_tf();
    let _g = heavy();
    same_node_job(&tf_node(1), 1, 1);
}

/// One node, 2 PS and 3 workers, the largest point of the matrix.
#[test]
fn tf_parameter_server_same_node_two_ps_three_workers() {
    let _turn = crate::turn::take(module_path!());
    require_tf();
    let _g = heavy();
    same_node_job(&tf_node(3), 2, 3);
}

/// The rest of the matrix (1 and 2 PS, 1 to 3 workers) on one node, one
/// job after another on the same pods.
#[test]
fn tf_parameter_server_same_node_rest_of_the_matrix() {
    let _turn = crate::turn::take(module_path!());
    require_tf();
    let _g = heavy();
    let node = tf_node(3);
    for (ps, workers) in [(1, 2), (1, 3), (2, 1), (2, 2)] {
        same_node_job(&node, ps, workers);
    }
}

/// Two nodes: the coordinator and the PS on node 0, the two workers on
/// node 1, so every worker-PS channel crosses the relay.
#[test]
fn tf_parameter_server_cross_node_over_the_relay_and_tcp() {
    let _turn = crate::turn::take(module_path!());
    require_tf();
    let _g = heavy();
    let pair = RelayPair::new(2);
    let (a, b) = (pair.nodes[0].sites(), pair.nodes[1].sites());
    let p = Placement {
        chief: a[0].clone(),
        ps: vec![a[1].clone()],
        workers: b.clone(),
    };
    both_lanes(&p, 2330, "cross node");
}
