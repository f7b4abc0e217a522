//! PyTorch DistributedDataParallel on the gloo backend through the lanes
//! (`tests/frameworks/torch_ddp.py`, Debian's python3-torch): every rank in
//! its own pod (netns wired by the real plugin), rendezvous through rank 0's
//! TCPStore (`init_method="tcp://…"`, as torchrun does), the same job with
//! the preload library (shared-memory lane on one node, the relay across two
//! nodes) and without it (plain TCP), one after the other in the same run.
//!
//! Checks: the state dict after N steps is bit-identical on every rank and
//! on both lanes (gloo's all-reduce is deterministic for a fixed world
//! size); while the job holds its connections, every TCP connection between
//! its pods (`ss` in each pod) is a channel of the lane the daemons list
//! for it, and no connection fell back to TCP; without the library no
//! connection is brokered. Figures: all_reduce algbw/busbw at 1 and 64 MiB,
//! shm (or relay) beside plain TCP.

use std::path::PathBuf;
use std::time::Duration;

use flowlane_e2e::frameworks::{
    expected_lane, require_python_module, script, sockets_of, Counters, Evidence, Site, Task,
    SYSTEM_PYTHON,
};
use flowlane_e2e::shm::{heavy, Node};
use serde_json::Value;

const T: Duration = Duration::from_secs(300);
const STEPS: &str = "20";

fn require_torch() {
    require_python_module(
        SYSTEM_PYTHON,
        "torch.distributed",
        "Debian's python3-torch: run .ci/install-deps",
    );
}

/// One DDP job over `sites` (rank i in sites[i]); the ranks' results, the
/// lane evidence taken while they held their connections, and what the
/// daemons counted meanwhile.
fn ddp_job(sites: &[Site], preload: bool, port: u16) -> (Vec<Value>, Evidence, Counters) {
    let sockets: Vec<PathBuf> = sockets_of(sites);
    let before = Counters::read(&sockets);
    let master = format!("{}:{port}", sites[0].ip);
    let world = sites.len().to_string();
    let script = script("torch_ddp.py");
    let env = [("GLOO_SOCKET_IFNAME", "eth0".to_string())];
    let rank = |rank: usize| {
        let site = &sites[rank];
        let rank_s = rank.to_string();
        let argv = [
            SYSTEM_PYTHON,
            script.to_str().unwrap(),
            "--rank",
            &rank_s,
            "--world",
            &world,
            "--master",
            &master,
            "--steps",
            STEPS,
        ];
        Task::spawn(site.cmd(preload, &env, &argv), &format!("rank {rank}"))
    };
    // Rank 0 hosts the store: the others start once it listens. A connect
    // to a port nobody listens on yet is refused and retried by torch, and
    // the daemon would count the refused attempt as a `no-listener`
    // fallback, which this suite wants to see only for connections that
    // really stayed on TCP.
    let mut ranks = vec![rank(0)];
    sites[0].wait_listening(port, T);
    ranks.extend((1..sites.len()).map(rank));
    let results: Vec<Value> = ranks.iter_mut().map(|r| r.result_held(T)).collect();
    let evidence = Evidence::take(sites, &sockets);
    // Counted while the job holds its connections: at teardown, a close
    // report from a process already exiting is refused (`auth-failed`),
    // which says nothing about the lane the job's connections rode.
    let counted = Counters::read(&sockets).since(&before);
    for r in &mut ranks {
        r.release();
    }
    for r in ranks {
        r.finish(Duration::from_secs(60));
    }
    (results, evidence, counted)
}

/// The state-dict hash every rank agrees on.
fn agreed_hash(results: &[Value], what: &str) -> String {
    let h = results[0]["state_sha256"].as_str().unwrap().to_string();
    for r in results {
        assert_eq!(
            r["state_sha256"].as_str(),
            Some(h.as_str()),
            "{what}: ranks disagree"
        );
        let (first, last) = (
            r["loss_first"].as_f64().unwrap(),
            r["loss_last"].as_f64().unwrap(),
        );
        assert!(last < first, "{what}: rank did not train: {r}");
    }
    h
}

/// Rank 0's all_reduce figures: (bytes, algbw, busbw) per size.
fn bench(results: &[Value]) -> Vec<(u64, f64, f64)> {
    results[0]["all_reduce"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b["bytes"].as_u64().unwrap(),
                b["algbw_gbs"].as_f64().unwrap(),
                b["busbw_gbs"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// Runs the job on plain TCP, then with the library; checks both; prints
/// the figures. Returns the state hash.
fn both_lanes(sites: &[Site], port: u16, what: &str) -> String {
    let (tcp, ev_tcp, c_tcp) = ddp_job(sites, false, port);
    let h_tcp = agreed_hash(&tcp, &format!("{what} tcp"));
    ev_tcp.assert_none_brokered(&format!("{what} tcp"));
    assert_eq!(
        c_tcp,
        Counters::default(),
        "{what} tcp: the daemons saw the job"
    );

    let (lane, ev, counted) = ddp_job(sites, true, port + 1);
    let h_lane = agreed_hash(&lane, &format!("{what} lane"));
    assert_eq!(h_lane, h_tcp, "{what}: the lane changed the arithmetic");
    let lane_of = expected_lane(sites);
    ev.assert_all_on(&lane_of, what);
    assert!(
        counted.fallbacks.is_empty(),
        "{what}: connections stayed on TCP: {counted:?}"
    );
    for l in ["shm", "relay"] {
        let want = ev.job.iter().filter(|k| lane_of(k) == l).count() as u64;
        let got = counted.opened.get(l).copied().unwrap_or(0);
        assert!(
            got >= want,
            "{what}: {want} connections on {l} now, the daemons counted {got} opened"
        );
    }
    let lanes: Vec<&str> = ev.job.iter().map(&lane_of).collect();
    eprintln!(
        "{what}: {} connections between the ranks, all on their lane ({} shm, {} relay); \
         daemons counted {:?} opened, no fallback",
        ev.job.len(),
        lanes.iter().filter(|l| **l == "shm").count(),
        lanes.iter().filter(|l| **l == "relay").count(),
        counted.opened
    );
    for ((bytes, alg_tcp, bus_tcp), (_, alg, bus)) in bench(&tcp).into_iter().zip(bench(&lane)) {
        println!(
            "figure torch-ddp {what} all_reduce {:>2} MiB: busbw lane {bus:.3} GB/s, tcp {bus_tcp:.3} GB/s ({:.2}x); algbw lane {alg:.3}, tcp {alg_tcp:.3} GB/s",
            bytes >> 20,
            bus / bus_tcp
        );
    }
    h_lane
}

/// 2 and 4 ranks on one node: shared-memory lane vs plain TCP.
#[test]
fn ddp_gloo_same_node_bit_identical_on_shm_and_tcp() {
    let _turn = crate::turn::take(module_path!());
    require_torch();
    let _g = heavy();
    let node = Node::new_in("ddp", 4, 245);
    assert_eq!(node.wiring, "cni", "pods must be wired by the real plugin");
    let sites: Vec<Site> = node
        .pods
        .iter()
        .map(|p| Site::of(p, &node.socket()))
        .collect();
    both_lanes(&sites[..2], 29510, "same-node 2 ranks");
    both_lanes(&sites, 29520, "same-node 4 ranks");
}

/// 2 ranks on two nodes (every connection crosses: relay) and 4 ranks
/// alternating between the nodes (some connections on shm, the others on
/// the relay), against plain TCP across the same underlay.
#[test]
fn ddp_gloo_cross_node_bit_identical_over_the_relay_and_tcp() {
    let _turn = crate::turn::take(module_path!());
    require_torch();
    let _g = heavy();
    let pair = flowlane_e2e::frameworks::RelayPair::new(2);
    let (a, b) = (pair.nodes[0].sites(), pair.nodes[1].sites());
    let two = [a[0].clone(), b[0].clone()];
    let four = [a[0].clone(), b[0].clone(), a[1].clone(), b[1].clone()];
    both_lanes(&two, 29530, "cross-node 2 ranks");
    both_lanes(&four, 29540, "cross-node 4 ranks (2 per node)");
}
