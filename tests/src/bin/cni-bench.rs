//! `cni-bench`: ADD and DEL latency of flowlane (built-in IPAM) against
//! Debian's reference `bridge` + `host-local`, in the same run, each on its
//! own bridge and subnet, sequentially and with many pods at once.
//!
//! Run as root: `cargo run --release -p flowlane-e2e --bin cni-bench [-- --pods 100 --concurrency 64 --rounds 2]`.
//! Every call is the real binary exec'd with environment + stdin, exactly as
//! a runtime does; network namespaces are created beforehand and not timed.
//! Sequential calls interleave the two plugins pod by pod; concurrent batches
//! alternate which plugin goes first each round.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use serde_json::Value;

use flowlane_e2e::binaries::PluginUnderTest;
use flowlane_e2e::cni::{Pod, TestNet};

const VERSION: &str = "1.0.0";

struct Args {
    pods: usize,
    concurrency: usize,
    rounds: usize,
}

fn parse_args() -> Args {
    let mut a = Args {
        pods: 100,
        concurrency: 64,
        rounds: 2,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let val = || -> usize {
            argv.get(i + 1)
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{} needs a number", argv[i]))
        };
        match argv[i].as_str() {
            "--pods" => a.pods = val(),
            "--concurrency" => a.concurrency = val(),
            "--rounds" => a.rounds = val(),
            "-h" | "--help" => {
                println!("cni-bench [--pods N] [--concurrency N] [--rounds N]");
                std::process::exit(0);
            }
            other => panic!("unknown argument {other}"),
        }
        i += 2;
    }
    assert!(a.pods <= 200 && a.concurrency <= 200, "the subnets are /24");
    a
}

/// Latency samples of one (plugin, phase, op).
#[derive(Default, Clone)]
struct Samples(Vec<Duration>);

impl Samples {
    fn pct(&self, p: f64) -> Duration {
        let mut v = self.0.clone();
        v.sort();
        if v.is_empty() {
            return Duration::ZERO;
        }
        let idx = ((p / 100.0) * (v.len() as f64 - 1.0)).round() as usize;
        v[idx.min(v.len() - 1)]
    }
}

#[derive(Default)]
struct Stats {
    seq_add: Samples,
    seq_del: Samples,
    par_add: Samples,
    par_del: Samples,
    /// Wall time of each concurrent batch of ADDs / DELs.
    par_add_wall: Samples,
    par_del_wall: Samples,
}

fn timed_add(net: &TestNet, pod: &Pod) -> (Duration, Value) {
    let inv = net.pod_call("ADD", pod, &net.conf(VERSION));
    let t = Instant::now();
    let out = inv.run();
    let d = t.elapsed();
    (d, out.expect_json())
}

fn timed_del(net: &TestNet, pod: &Pod, prev: &Value) -> Duration {
    let inv = net.pod_call("DEL", pod, &net.conf_with_prev(VERSION, prev));
    let t = Instant::now();
    let out = inv.run();
    let d = t.elapsed();
    out.expect_ok();
    d
}

/// One pod at a time, the two plugins interleaved pod by pod (alternating
/// which goes first), so both see the same machine conditions.
// `i` indexes the two plugins' pod lists in lock step.
#[allow(clippy::needless_range_loop)]
fn sequential(nets: &[Arc<TestNet>], pods: &[Vec<Arc<Pod>>], n: usize, stats: &mut [Stats]) {
    let order = |i: usize| -> [usize; 2] {
        if i % 2 == 0 {
            [0, 1]
        } else {
            [1, 0]
        }
    };
    let mut results: Vec<Vec<Value>> = vec![Vec::with_capacity(n), Vec::with_capacity(n)];
    for i in 0..n {
        for s in order(i) {
            let (d, r) = timed_add(&nets[s], &pods[s][i]);
            stats[s].seq_add.0.push(d);
            results[s].push(r);
        }
    }
    for i in 0..n {
        for s in order(i) {
            let d = timed_del(&nets[s], &pods[s][i], &results[s][i]);
            stats[s].seq_del.0.push(d);
        }
    }
}

fn concurrent(net: &Arc<TestNet>, pods: &[Arc<Pod>], st: &mut Stats) {
    let n = pods.len();
    let barrier = Arc::new(Barrier::new(n + 1));
    let handles: Vec<_> = pods
        .iter()
        .map(|p| {
            let (net, p, b) = (net.clone(), p.clone(), barrier.clone());
            std::thread::spawn(move || {
                b.wait();
                timed_add(&net, &p)
            })
        })
        .collect();
    barrier.wait();
    let t = Instant::now();
    let results: Vec<(Duration, Value)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    st.par_add_wall.0.push(t.elapsed());
    st.par_add.0.extend(results.iter().map(|r| r.0));

    let barrier = Arc::new(Barrier::new(n + 1));
    let handles: Vec<_> = pods
        .iter()
        .zip(results)
        .map(|(p, (_, r))| {
            let (net, p, b) = (net.clone(), p.clone(), barrier.clone());
            std::thread::spawn(move || {
                b.wait();
                timed_del(&net, &p, &r)
            })
        })
        .collect();
    barrier.wait();
    let t = Instant::now();
    let ds: Vec<Duration> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    st.par_del_wall.0.push(t.elapsed());
    st.par_del.0.extend(ds);
}

fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1000.0)
}

fn ratio(a: Duration, b: Duration) -> String {
    if b.is_zero() {
        return "-".into();
    }
    format!("{:.2}", a.as_secs_f64() / b.as_secs_f64())
}

fn main() {
    let args = parse_args();
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("cni-bench needs root (network namespaces, links)");
        std::process::exit(1);
    }
    let subjects = [
        (PluginUnderTest::Flowlane, "10.201.100.0/24", "bfl"),
        (PluginUnderTest::Reference, "10.201.101.0/24", "bref"),
    ];
    let nets: Vec<Arc<TestNet>> = subjects
        .iter()
        .map(|(p, subnet, tag)| Arc::new(TestNet::with_plugin(tag, &[subnet], *p)))
        .collect();
    let npods = args.pods.max(args.concurrency);
    eprintln!("creating {} network namespaces per plugin...", npods);
    let pods: Vec<Vec<Arc<Pod>>> = subjects
        .iter()
        .map(|(_, _, tag)| (0..npods).map(|_| Arc::new(Pod::new(tag))).collect())
        .collect();
    // Warm-up (bridge creation, page cache) outside the measurements.
    for (net, pods) in nets.iter().zip(&pods) {
        let (_, r) = timed_add(net, &pods[0]);
        timed_del(net, &pods[0], &r);
    }
    let mut stats: Vec<Stats> = subjects.iter().map(|_| Stats::default()).collect();
    for round in 0..args.rounds {
        eprintln!("round {}/{}", round + 1, args.rounds);
        // Alternate which plugin goes first so drift hits both equally.
        let order: Vec<usize> = if round % 2 == 0 {
            vec![0, 1]
        } else {
            vec![1, 0]
        };
        sequential(&nets, &pods, args.pods, &mut stats);
        for &i in &order {
            concurrent(&nets[i], &pods[i][..args.concurrency], &mut stats[i]);
        }
    }
    for net in &nets {
        let ids: Vec<&str> = Vec::new();
        net.assert_clean(&ids);
    }

    let (fl, rf) = (&stats[0], &stats[1]);
    println!();
    println!(
        "CNI ADD/DEL latency, ms ({} sequential pods, {} concurrent pods, {} rounds; {} cores)",
        args.pods,
        args.concurrency,
        args.rounds,
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );
    println!("flowlane: built-in IPAM; reference: Debian bridge + host-local (containernetworking-plugins)");
    println!(
        "{:<22} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8}",
        "phase / op", "fl p50", "fl p99", "ref p50", "ref p99", "p50 x", "p99 x"
    );
    let rows: [(&str, &Samples, &Samples); 6] = [
        ("sequential ADD", &fl.seq_add, &rf.seq_add),
        ("sequential DEL", &fl.seq_del, &rf.seq_del),
        ("concurrent ADD", &fl.par_add, &rf.par_add),
        ("concurrent DEL", &fl.par_del, &rf.par_del),
        ("concurrent ADD batch", &fl.par_add_wall, &rf.par_add_wall),
        ("concurrent DEL batch", &fl.par_del_wall, &rf.par_del_wall),
    ];
    for (label, a, b) in rows {
        println!(
            "{:<22} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8}",
            label,
            ms(a.pct(50.0)),
            ms(a.pct(99.0)),
            ms(b.pct(50.0)),
            ms(b.pct(99.0)),
            ratio(a.pct(50.0), b.pct(50.0)),
            ratio(a.pct(99.0), b.pct(99.0)),
        );
    }
    println!("(x = flowlane / reference; below 1 means flowlane is faster; batch = wall time of one whole concurrent batch)");
}
