//! Prints the cost of the daemon round trips a connection pays at setup
//! (fresh client connection per call, as the preload library does), between
//! two real pods: the fallback answer (`no-channel`, the whole extra cost a
//! connection to a peer without flowlane pays), an announced channel (memfd
//! created, sealed, passed), a claim, and full setups per second. Figures
//! only; no timing assertions.

use super::common as daemon_common;

use daemon_common::Node;

const N: u64 = 2000;

struct Figure {
    p50_us: f64,
    p99_us: f64,
    per_sec: f64,
    total_s: f64,
    channels: u64,
}

fn parse(answer: &str) -> Figure {
    let v: Vec<&str> = answer.split_whitespace().collect();
    assert_eq!(v.first(), Some(&"bench"), "{answer}");
    let n = |i: usize| v[i].parse::<f64>().expect("number");
    Figure {
        p50_us: n(1) / 1e3,
        p99_us: n(2) / 1e3,
        per_sec: N as f64 / (n(3) / 1e9),
        total_s: n(3) / 1e9,
        channels: n(4) as u64,
    }
}

#[test]
fn daemon_setup_round_trips() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::start("bch", &["--log-level", "info"]);
    let a = node.add_pod("a", "10.202.10.2");
    let b = node.add_pod("b", "10.202.10.3");
    let (mut pa, mut pb) = (a.agent(), b.agent());
    assert_eq!(pb.cmd("listen 0.0.0.0:80"), "ok");
    let region = 4096 + 2 * (1 << 20);

    let none = parse(&pa.cmd(&format!("bench-intent {N} 20000 10.202.10.3:81 {region}")));
    assert_eq!(none.channels, 0);
    let intent = parse(&pa.cmd(&format!("bench-intent {N} 30000 10.202.10.3:80 {region}")));
    assert_eq!(
        intent.channels, N,
        "every intent to a listener gets a channel"
    );
    let reuse = parse(&pa.cmd(&format!(
        "bench-intent-reuse {N} 40000 10.202.10.3:81 {region}"
    )));
    assert_eq!(reuse.channels, 0);
    let claim = parse(&pb.cmd(&format!("bench-claim {N} 10.202.10.3:80 10.202.10.2 30000")));
    assert_eq!(claim.channels, N, "every announced channel is claimed");
    let st = node.stats();
    assert_eq!(st.lanes["shm"].connections_opened, N);

    println!("\nflowlaned setup round trips ({N} calls each, fresh daemon connection per call, 2 MiB regions)");
    println!(
        "{:<34} {:>8} {:>8} {:>10}",
        "call", "p50 µs", "p99 µs", "calls/s"
    );
    for (name, f) in [
        ("connect-intent -> no-channel", &none),
        ("  same, one reused connection", &reuse),
        ("connect-intent -> channel + memfd", &intent),
        ("claim-accepted -> channel + memfd", &claim),
    ] {
        println!(
            "{name:<34} {:>8.1} {:>8.1} {:>10.0}",
            f.p50_us, f.p99_us, f.per_sec
        );
    }
    println!(
        "full shared-memory setups (intent + claim): {:.0}/s",
        N as f64 / (intent.total_s + claim.total_s)
    );
}
