//! `shm-bench bench --relay-setup`: what opening a connection between pods
//! of two nodes costs through the relay (docs/relay.md) against plain TCP,
//! in the same run (issue 12: "the cross-node relay's set-up gets the
//! same treatment"; this is its figure before that treatment). Two node
//! namespaces joined by an underlay, each with its own daemon, the lane
//! over `tcp-test` (the transport double of the relay e2e tests: one TCP
//! connection per stream on the underlay, `flowlane_e2e::frameworks::
//! RelayPair`); every other part of the path is the real one. Figures are
//! medians of rounds that alternate the variants; each connection-rate run
//! has a destination port of its own (see `setup_bench`).

use std::time::Duration;

use flowlane_e2e::frameworks::RelayPair;
use flowlane_e2e::shm::Bg;

use super::{figures_of, median};

const T: Duration = Duration::from_secs(600);

pub fn run(quick: bool) {
    let c = RelayPair::new(1);
    let (client_node, server_node, client, server) = c.first_pods();
    let me = std::env::current_exe().unwrap();
    let me = me.to_str().unwrap().to_string();
    // Plain servers and servers with the library on the server node.
    let mut servers: Vec<Bg> = Vec::new();
    for (lib, port) in [(false, 7300u16), (true, 7301), (false, 7302), (true, 7303)] {
        let p = port.to_string();
        servers.push(server_node.serve(server, lib, port, &[&me, "serve", &p]));
    }
    let addr = |port: u16| format!("{}:{port}", server.ip);
    let run = |lib: bool, args: &[String]| -> Vec<f64> {
        let mut argv = vec![me.as_str()];
        argv.extend(args.iter().map(String::as_str));
        figures_of(
            client_node.cmd(client, lib, &argv),
            T,
            &format!("shm-bench {args:?}"),
        )
    };
    let rounds = if quick { 3 } else { 5 };
    let conns = if quick { "300" } else { "1000" };
    let iters = if quick { "5000" } else { "20000" };
    let connrate = |port: u16| vec!["connrate".to_string(), addr(port), conns.into()];
    // (name, with the library, plain TCP, figure index)
    let figures: [(&str, Vec<String>, Vec<String>, usize); 3] = [
        (
            "connections/s, across nodes (relay)",
            connrate(7301),
            connrate(7300),
            0,
        ),
        (
            "connect+1st byte p50 us, across nodes",
            connrate(7303),
            connrate(7302),
            1,
        ),
        (
            "request/response/s, 64 B, one conn",
            vec!["pingpong".into(), addr(7301), "64".into(), iters.into()],
            vec!["pingpong".into(), addr(7300), "64".into(), iters.into()],
            2,
        ),
    ];
    let (opened_before, _, _) = client_node.relay();
    let mut lib = vec![Vec::new(); figures.len()];
    let mut tcp = vec![Vec::new(); figures.len()];
    for _ in 0..rounds {
        for (i, (_, with, plain, index)) in figures.iter().enumerate() {
            tcp[i].push(run(false, plain)[*index]);
            lib[i].push(run(true, with)[*index]);
        }
    }
    let (opened, _, _) = client_node.relay();
    println!(
        "flowlane relay set-up benchmark (same run; median of {rounds} rounds alternating library and plain TCP)"
    );
    println!("two nodes joined by an underlay veth; relay lane over tcp-test (one TCP stream per connection on the underlay)");
    println!();
    println!(
        "{:<40} {:>14} {:>14} {:>9}",
        "figure", "with library", "plain TCP", "lib/tcp"
    );
    for (i, (name, ..)) in figures.iter().enumerate() {
        let (l, t) = (median(lib[i].clone()), median(tcp[i].clone()));
        let ratio = if name.contains(" us") { t / l } else { l / t };
        println!("{name:<40} {l:>14.2} {t:>14.2} {ratio:>8.3}x");
    }
    println!("(latency rows: ratio is tcp/lib, so above 1 is better for both kinds of row)");
    if std::env::var_os("FLS_BENCH_ROUNDS").is_some() {
        for (i, (name, ..)) in figures.iter().enumerate() {
            println!("rounds {name:<33} lib {:?} tcp {:?}", lib[i], tcp[i]);
        }
    }
    println!(
        "client node's daemon: {} relay connections opened during the run",
        opened - opened_before
    );
    drop(servers);
}
