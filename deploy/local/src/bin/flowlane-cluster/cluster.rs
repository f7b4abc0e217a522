//! `flowlane cluster up|down|status`: a local training cluster on this
//! machine (nodes and pods as network namespaces, pods wired by this very
//! binary as their CNI plugin). The work is done by `flowlane-cluster`
//! (`deploy/local/`); this module only reads the command line.

use std::net::Ipv4Addr;
use std::path::PathBuf;

use flowlane_cluster::{spec::DEFAULT_RUN_ROOT, Binaries, ClusterSpec, Plugin};

const USAGE: &str = "\
usage: flowlane cluster up     [--name NAME] [--nodes N] [--pods M] [--pod-network A.B.0.0]
                               [--plugin flowlane|bridge] [--run-root DIR]
       flowlane cluster down   [--name NAME] [--run-root DIR]
       flowlane cluster status [--name NAME] [--run-root DIR] [--json]
       flowlane cluster exec   [--name NAME] [--run-root DIR] [--preload] POD -- PROGRAM [ARGS...]
       flowlane cluster check  [--name NAME] [--run-root DIR] [--json]
       flowlane cluster check  --kubernetes [--kubeconfig FILE] [--namespace NS]
                               [--node-a NODE] [--node-b NODE] [--image IMAGE]
                               [--flowlane-namespace NS] [--bytes N] [--timeout SECONDS] [--json]

Defaults: --name local --nodes 2 --pods 2 --pod-network 10.210.0.0 (node i
gets A.B.i.0/24) --plugin flowlane --run-root /run/flowlane-cluster.
Nodes are network namespaces flc<NAME>-n<i> with their own bridge and
flowlaned; pods are flc<NAME>-n<i>p<j>. `down` removes everything, also
after an interrupted `up`. `exec` runs a program in pod POD (e.g. n0p1),
with --preload injecting libflowlane_preload.so and the node's daemon
socket, as the deploy layer does for pods. `check` moves 8 MiB between a
same-node and a cross-node pod pair (with the preload library), verifies
every byte, and says from the daemons' counters which lane carried them
(exit 1 if a pair failed, or the same-node pair did not get shared memory).

`check --kubernetes` does the same on a real cluster through its API server
(kubeconfig: --kubeconfig, else KUBECONFIG, ~/.kube/config, in-cluster):
probe pods pinned to two nodes (by default a pair whose Node objects both
publish the flowlane.io/rdma-lane annotation, when there is one) in
namespace NS (default flowlane-check; created and deleted again when
missing), opted in to injection, running the image's `flowlane-cluster
cluster probe`; the lanes from each node daemon's metrics read through the
pod proxy of its flowlane pod (in --flowlane-namespace, default
flowlane-system). Expected: same node -> shm, two nodes that both publish
a lane -> relay, else tcp (not a failure). Exit 1 when a pair failed or did
not get the lane it should have. Everything created is deleted.
";

struct Opts {
    spec: ClusterSpec,
    json: bool,
}

fn parse(args: &[String]) -> Result<Opts, String> {
    let mut spec = ClusterSpec::new("local", 2, 2);
    spec.run_root = PathBuf::from(DEFAULT_RUN_ROOT);
    let mut json = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |flag: &str| {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match a.as_str() {
            "--name" => spec.name = value(a)?,
            "--nodes" => spec.nodes = value(a)?.parse().map_err(|e| format!("--nodes: {e}"))?,
            "--pods" => {
                spec.pods_per_node = value(a)?.parse().map_err(|e| format!("--pods: {e}"))?
            }
            "--pod-network" => {
                let v = value(a)?;
                let v = v.strip_suffix("/16").unwrap_or(&v);
                spec.pod_network = v
                    .parse::<Ipv4Addr>()
                    .map_err(|e| format!("--pod-network: {e}"))?
            }
            "--plugin" => spec.plugin = value(a)?.parse::<Plugin>()?,
            "--run-root" => spec.run_root = PathBuf::from(value(a)?),
            "--json" => json = true,
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    Ok(Opts { spec, json })
}

pub fn main(args: &[String]) -> i32 {
    let Some(cmd) = args.first() else {
        eprint!("{USAGE}");
        return 2;
    };
    if matches!(cmd.as_str(), "-h" | "--help" | "help") {
        print!("{USAGE}");
        return 0;
    }
    if cmd == "exec" {
        return exec(&args[1..]);
    }
    if cmd == "probe" {
        return probe(&args[1..]);
    }
    if cmd == "check" && args.iter().any(|a| a == "--kubernetes") {
        return check_kubernetes(&args[1..]);
    }
    let opts = match parse(&args[1..]) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("flowlane cluster: {e}\n\n{USAGE}");
            return 2;
        }
    };
    let bins = match Binaries::beside_current_exe() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("flowlane cluster: cannot locate binaries: {e}");
            return 1;
        }
    };
    match cmd.as_str() {
        "up" => up(&opts, &bins),
        "down" => down(&opts, &bins),
        "status" => status(&opts),
        "check" => check(&opts, &bins),
        other => {
            eprintln!("flowlane cluster: unknown command {other:?}\n\n{USAGE}");
            2
        }
    }
}

fn up(opts: &Opts, bins: &Binaries) -> i32 {
    let progress = |s: &str| eprintln!("[cluster {}] {s}", opts.spec.name);
    match flowlane_cluster::up(&opts.spec, bins, &progress) {
        Ok(state) => {
            if opts.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&state).unwrap_or_default()
                );
            } else {
                println!(
                    "cluster {} is up: {} node(s) x {} pod(s); state in {}",
                    opts.spec.name,
                    opts.spec.nodes,
                    opts.spec.pods_per_node,
                    state.run_dir().display()
                );
                for p in &state.pods {
                    println!("  pod {:<6} ip {:<15} netns {}", p.name, p.ip, p.netns);
                }
            }
            0
        }
        Err(e) => {
            eprintln!(
                "flowlane cluster up: {e}\n(the cluster may be partly built: run `flowlane cluster down --name {}`)",
                opts.spec.name
            );
            1
        }
    }
}

fn down(opts: &Opts, bins: &Binaries) -> i32 {
    let rep = flowlane_cluster::down(&opts.spec.run_root, &opts.spec.name, bins);
    for w in &rep.warnings {
        eprintln!("flowlane cluster down: warning: {w}");
    }
    for e in &rep.errors {
        eprintln!("flowlane cluster down: {e}");
    }
    println!(
        "cluster {}: ended {} process(es), deleted {} pod attachment(s) and {} namespace(s){}",
        opts.spec.name,
        rep.processes_ended,
        rep.pods_deleted,
        rep.namespaces_deleted,
        if rep.run_dir_removed {
            ", removed its run directory"
        } else {
            ""
        }
    );
    i32::from(!rep.errors.is_empty())
}

fn status(opts: &Opts) -> i32 {
    let rep = flowlane_cluster::status(&opts.spec.run_root, &opts.spec.name);
    if opts.json {
        println!("{}", serde_json::to_string_pretty(&rep).unwrap_or_default());
    } else if let Some(state) = &rep.state {
        println!("cluster {} ({:?} plugin)", rep.name, state.spec.plugin);
        for n in &state.nodes {
            println!(
                "  node {:<4} netns {:<16} underlay {:<12} pods {:<14} flowlaned {}",
                n.name,
                n.netns,
                n.underlay_ip,
                n.pod_cidr,
                n.daemon_pid
                    .map(|p| format!("pid {p}"))
                    .unwrap_or_else(|| "not running".into())
            );
        }
        for p in &state.pods {
            println!("  pod  {:<4} ip {:<15} netns {}", p.name, p.ip, p.netns);
        }
    }
    for p in &rep.problems {
        println!("  problem: {p}");
    }
    i32::from(!(rep.up && rep.problems.is_empty()))
}

fn check(opts: &Opts, bins: &Binaries) -> i32 {
    let state = match flowlane_cluster::ClusterState::load(&opts.spec.run_root, &opts.spec.name) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("flowlane cluster check: {e}");
            return 1;
        }
    };
    let results = flowlane_cluster::check::run(&state, bins);
    if opts.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&results).unwrap_or_default()
        );
    } else {
        print!("{}", flowlane_cluster::check::render(&results));
    }
    let failed = results.is_empty()
        || results.iter().any(|r| {
            r.error.is_some() || !r.bytes_ok || (r.kind == "same-node" && r.lane != "shm")
        });
    i32::from(failed)
}

/// `check --kubernetes ...`: the check on a real cluster (flowlane_cluster::kube_check).
fn check_kubernetes(args: &[String]) -> i32 {
    use flowlane_cluster::kube_check::{self, KubeCheckOpts};
    let mut opts = KubeCheckOpts::default();
    let mut json = false;
    let mut it = args.iter();
    let parsed: Result<(), String> = (|| {
        while let Some(a) = it.next() {
            let mut value = || {
                it.next()
                    .cloned()
                    .ok_or_else(|| format!("{a} needs a value"))
            };
            match a.as_str() {
                "--kubernetes" => {}
                "--json" => json = true,
                "--kubeconfig" => opts.kubeconfig = Some(PathBuf::from(value()?)),
                "--namespace" | "-n" => opts.namespace = value()?,
                "--flowlane-namespace" => opts.flowlane_namespace = value()?,
                "--node-a" => opts.node_a = Some(value()?),
                "--node-b" => opts.node_b = Some(value()?),
                "--image" => opts.image = Some(value()?),
                "--bytes" => opts.bytes = value()?.parse().map_err(|e| format!("--bytes: {e}"))?,
                "--timeout" => {
                    opts.timeout = std::time::Duration::from_secs(
                        value()?.parse().map_err(|e| format!("--timeout: {e}"))?,
                    )
                }
                other => return Err(format!("unknown option {other:?}")),
            }
        }
        Ok(())
    })();
    if let Err(e) = parsed {
        eprintln!("flowlane cluster check: {e}\n\n{USAGE}");
        return 2;
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("flowlane cluster check: {e}");
            return 1;
        }
    };
    match runtime.block_on(kube_check::run(&opts)) {
        Ok(report) => {
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&report).unwrap_or_default()
                );
            } else {
                print!("{}", kube_check::render(&report));
            }
            i32::from(!report.ok)
        }
        Err(e) => {
            eprintln!("flowlane cluster check --kubernetes: {e}");
            1
        }
    }
}

/// `probe serve PORT | probe send ADDR BYTES`: the programs `check` runs in
/// the pods.
fn probe(args: &[String]) -> i32 {
    use flowlane_cluster::probe;
    let done = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["serve", port] => port
            .parse()
            .map_err(|e| format!("port: {e}"))
            .and_then(probe::serve),
        ["send", addr, bytes] => match (addr.parse(), bytes.parse()) {
            (Ok(a), Ok(b)) => probe::send(a, b),
            _ => Err(format!("bad address {addr:?} or size {bytes:?}")),
        },
        _ => Err("usage: flowlane cluster probe serve PORT | send ADDR BYTES".into()),
    };
    match done {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("flowlane cluster probe: {e}");
            1
        }
    }
}

/// `exec [--name N] [--run-root DIR] [--preload] POD -- PROGRAM ARGS...`
fn exec(args: &[String]) -> i32 {
    let (opts_part, program) = match args.iter().position(|a| a == "--") {
        Some(i) => (&args[..i], &args[i + 1..]),
        None => {
            eprintln!("flowlane cluster exec: missing `-- PROGRAM`\n\n{USAGE}");
            return 2;
        }
    };
    let mut preload = false;
    let mut rest = Vec::new();
    for a in opts_part {
        if a == "--preload" {
            preload = true;
        } else {
            rest.push(a.clone());
        }
    }
    let Some(pod_name) = rest.pop() else {
        eprintln!("flowlane cluster exec: which pod?\n\n{USAGE}");
        return 2;
    };
    if program.is_empty() {
        eprintln!("flowlane cluster exec: no program after --");
        return 2;
    }
    let opts = match parse(&rest) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("flowlane cluster exec: {e}\n\n{USAGE}");
            return 2;
        }
    };
    let state = match flowlane_cluster::ClusterState::load(&opts.spec.run_root, &opts.spec.name) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("flowlane cluster exec: {e}");
            return 1;
        }
    };
    let Some(pod) = flowlane_cluster::exec::find_pod(&state, &pod_name) else {
        eprintln!(
            "flowlane cluster exec: no pod {pod_name:?} in cluster {} (pods: {})",
            opts.spec.name,
            state
                .pods
                .iter()
                .map(|p| p.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
        return 1;
    };
    let bins = match Binaries::beside_current_exe() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("flowlane cluster exec: cannot locate binaries: {e}");
            return 1;
        }
    };
    let mut cmd = flowlane_cluster::exec::in_pod(&bins, &state, pod, preload);
    cmd.args(program);
    match cmd.status() {
        Ok(s) => s.code().unwrap_or(1),
        Err(e) => {
            eprintln!("flowlane cluster exec: {e}");
            1
        }
    }
}
