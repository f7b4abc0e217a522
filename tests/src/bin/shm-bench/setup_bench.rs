//! `shm-bench bench --setup`: what opening connections costs, with the
//! library against plain TCP in the same run (issue 12): connections per
//! second (connect + 1-byte request/response + close) pod to pod and pod
//! to a host outside every pod network, request/responses per second on
//! one connection (64 B, 1 KiB), the 64 KiB stream, and connect + first
//! byte on the fallback path. Every figure is the median of rounds that
//! alternate the variants, so a burst of other load hits all of them.
//!
//! The outside host is a network namespace joined to the client pod by a
//! veth pair of its own (10.238.x.0/30): no pod network, no node route,
//! nothing the daemon lists.

use std::time::Duration;

use flowlane_e2e::outside::OutsideHost;
use flowlane_e2e::shm::{wait_listening, Bg, Node};

use super::{figures_of, median};

const T: Duration = Duration::from_secs(300);

pub fn run(quick: bool) {
    let node = Node::new("ptsb", 2);
    let (c, s) = (&node.pods[0], &node.pods[1]);
    let me = std::env::current_exe().unwrap();
    let me = me.to_str().unwrap().to_string();
    let out = OutsideHost::new(c, "ptsb");
    // Plain servers, a server with the library (the lane), outside
    // servers. Each connection-rate run has a destination port of its
    // own: the client closes first, so every connection leaves a
    // TIME_WAIT socket for a minute, and tens of thousands of them towards
    // one destination make the kernel's search for a free source port the
    // cost of every connect, for whichever variant runs then.
    let mut servers = Vec::new();
    let lanes = [(false, 7100), (true, 7101), (false, 7102), (false, 7103)];
    let latencies = [(false, 7104), (true, 7105), (false, 7106), (true, 7107)];
    for (lib, port) in lanes.into_iter().chain(latencies) {
        servers.push(Bg::spawn(node.cmd(
            s,
            lib,
            &[&me, "serve", &port.to_string()],
        )));
        wait_listening(s, port);
    }
    for port in 7200..7204 {
        servers.push(Bg::spawn(out.cmd(&[&me, "serve", &port.to_string()])));
        out.wait_listening(port);
    }
    let pod = |port: u16| format!("{}:{port}", s.ip);
    let outside = |port: u16| format!("{}:{port}", out.ip);
    let run = |lib: bool, args: &[&str]| -> Vec<f64> {
        let mut argv = vec![me.as_str()];
        argv.extend_from_slice(args);
        figures_of(node.cmd(c, lib, &argv), T, &format!("shm-bench {args:?}"))
    };
    let rounds = if quick { 3 } else { 5 };
    let conns = if quick { "500" } else { "2000" };
    let iters = if quick { "20000" } else { "100000" };
    let total = if quick { "536870912" } else { "2147483648" };
    // (name, with the library: (lib, addr), plain TCP: addr, figure index)
    struct Figure {
        name: &'static str,
        lib_addr: String,
        args: Vec<String>,
        index: usize,
    }
    let connrate = |addr: &str| vec!["connrate".to_string(), addr.to_string(), conns.into()];
    let pingpong = |addr: &str, size: &str| {
        vec![
            "pingpong".into(),
            addr.to_string(),
            size.into(),
            iters.into(),
        ]
    };
    let figures = [
        Figure {
            name: "connections/s, pod to pod (lane)",
            lib_addr: pod(7101),
            args: connrate(&pod(7100)),
            index: 0,
        },
        // The lane's tail: a connection that waits for the daemon shows
        // here first.
        Figure {
            name: "connect+1st byte p50 us, pod to pod",
            lib_addr: pod(7105),
            args: connrate(&pod(7104)),
            index: 1,
        },
        Figure {
            name: "connect+1st byte p90 us, pod to pod",
            lib_addr: pod(7107),
            args: connrate(&pod(7106)),
            index: 3,
        },
        Figure {
            name: "connections/s, pod to outside host",
            lib_addr: outside(7201),
            args: connrate(&outside(7200)),
            index: 0,
        },
        Figure {
            name: "connect+1st byte p50 us, outside host",
            lib_addr: outside(7203),
            args: connrate(&outside(7202)),
            index: 1,
        },
        Figure {
            name: "connect+1st byte p50 us, peer no lib",
            lib_addr: pod(7103),
            args: connrate(&pod(7102)),
            index: 1,
        },
        Figure {
            name: "request/response/s, 64 B, one conn",
            lib_addr: pod(7101),
            args: pingpong(&pod(7100), "64"),
            index: 2,
        },
        Figure {
            name: "request/response/s, 1 KiB, one conn",
            lib_addr: pod(7101),
            args: pingpong(&pod(7100), "1024"),
            index: 2,
        },
        Figure {
            name: "stream GB/s, 64 KiB messages",
            lib_addr: pod(7101),
            args: vec!["stream".into(), pod(7100), "65536".into(), total.into()],
            index: 0,
        },
    ];
    let opened_before = node.shm_opened();
    let mut lib = vec![Vec::new(); figures.len()];
    let mut tcp = vec![Vec::new(); figures.len()];
    for _ in 0..rounds {
        for (i, f) in figures.iter().enumerate() {
            // Two connect+1st byte rows reuse the connection-rate runs
            // of the same destination: measured separately all the same,
            // one run per figure keeps the alternation simple.
            let plain: Vec<&str> = f.args.iter().map(String::as_str).collect();
            let mut with = plain.clone();
            with[1] = &f.lib_addr;
            tcp[i].push(run(false, &plain)[f.index]);
            lib[i].push(run(true, &with)[f.index]);
        }
    }
    let opened = node.shm_opened() - opened_before;
    println!("flowlane connection set-up benchmark (same run; median of {rounds} rounds alternating library and plain TCP)");
    println!("pod wiring: {}; outside host: a namespace on a veth pair of its own, outside every pod network", node.wiring);
    println!();
    println!(
        "{:<40} {:>14} {:>14} {:>9}",
        "figure", "with library", "plain TCP", "lib/tcp"
    );
    for (i, f) in figures.iter().enumerate() {
        let (l, t) = (median(lib[i].clone()), median(tcp[i].clone()));
        let ratio = if f.name.contains(" us") { t / l } else { l / t };
        println!("{:<40} {l:>14.2} {t:>14.2} {ratio:>8.3}x", f.name);
    }
    println!("(latency rows: ratio is tcp/lib, so above 1 is better for both kinds of row)");
    // Every round's figures, to tell a steady cost from one noisy round.
    if std::env::var_os("FLS_BENCH_ROUNDS").is_some() {
        for (i, f) in figures.iter().enumerate() {
            println!("rounds {:<33} lib {:?} tcp {:?}", f.name, lib[i], tcp[i]);
        }
    }
    println!("daemon: {opened} shm connections opened during the run");
}
