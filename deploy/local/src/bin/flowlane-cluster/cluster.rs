//! `flowlane cluster up|down|status`: a local training cluster on this
//! machine (nodes and pods as network namespaces, pods wired by this very
//! binary as their CNI plugin). The work is done by `flowlane-cluster`
//! (`deploy/local/`); this module runs the commands `args.rs` parsed.

use flowlane_cluster::{Binaries, ClusterSpec};

use crate::args::{CheckArgs, ClusterCommand, ExecArgs, ProbeCommand, UpArgs, Which};

struct Opts {
    spec: ClusterSpec,
    json: bool,
}

impl Opts {
    fn of(which: &Which, json: bool) -> Opts {
        let mut spec = ClusterSpec::new(&which.name, 2, 2);
        spec.run_root = which.run_root.clone();
        Opts { spec, json }
    }

    fn up(a: &UpArgs) -> Opts {
        let mut o = Opts::of(&a.which, a.json);
        o.spec.nodes = a.nodes;
        o.spec.pods_per_node = a.pods;
        o.spec.pod_network = a.pod_network;
        o.spec.plugin = a.plugin;
        o
    }
}

pub fn main(cmd: ClusterCommand) -> i32 {
    let opts = match &cmd {
        ClusterCommand::Exec(e) => return exec(e),
        ClusterCommand::Probe(p) => return probe(p),
        ClusterCommand::Check(c) if c.kubernetes => return check_kubernetes(c),
        ClusterCommand::Up(a) => Opts::up(a),
        ClusterCommand::Down(w) | ClusterCommand::Status(w) => Opts::of(&w.which, w.json),
        ClusterCommand::Check(c) => Opts::of(&c.which, c.json),
    };
    let bins = match Binaries::beside_current_exe() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("flowlane cluster: cannot locate binaries: {e}");
            return 1;
        }
    };
    match cmd {
        ClusterCommand::Up(_) => up(&opts, &bins),
        ClusterCommand::Down(_) => down(&opts, &bins),
        ClusterCommand::Status(_) => status(&opts),
        _ => check(&opts, &bins),
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
fn check_kubernetes(a: &CheckArgs) -> i32 {
    use flowlane_cluster::kube_check::{self, KubeCheckOpts};
    let mut opts = KubeCheckOpts {
        kubeconfig: a.kubeconfig.clone(),
        node_a: a.node_a.clone(),
        node_b: a.node_b.clone(),
        image: a.image.clone(),
        ..KubeCheckOpts::default()
    };
    if let Some(ns) = &a.namespace {
        opts.namespace = ns.clone();
    }
    if let Some(ns) = &a.flowlane_namespace {
        opts.flowlane_namespace = ns.clone();
    }
    if let Some(b) = a.bytes {
        opts.bytes = b;
    }
    if let Some(t) = a.timeout {
        opts.timeout = std::time::Duration::from_secs(t);
    }
    let json = a.json;
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
fn probe(p: &ProbeCommand) -> i32 {
    use flowlane_cluster::probe;
    let done = match *p {
        ProbeCommand::Serve { port } => probe::serve(port),
        ProbeCommand::Send { addr, bytes } => probe::send(addr, bytes),
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
fn exec(e: &ExecArgs) -> i32 {
    let opts = Opts::of(&e.which, false);
    let (pod_name, program, preload) = (&e.pod, &e.program, e.preload);
    let state = match flowlane_cluster::ClusterState::load(&opts.spec.run_root, &opts.spec.name) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("flowlane cluster exec: {e}");
            return 1;
        }
    };
    let Some(pod) = flowlane_cluster::exec::find_pod(&state, pod_name) else {
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
