//! A hostile client against stock channels (docs/shm-lane.md, "Pre-created
//! channels"; docs/security.md): before an attach, the words a server and
//! the daemon read in a stock region are the client's to write. Real pods
//! (the plugin), the real daemon, the real library; the server is
//! `shm-bench serve` (Rust), the honest client and the attacker are Python
//! through the library.
//!
//! While the attacker scribbles its stock (`STOCK_HOSTILE`) and keeps
//! connecting, an honest pod's connections to the same server must each
//! carry their bytes intact, the server must serve to the end, and the
//! attacker's own connections must each either carry their bytes intact
//! or fail with an error: never wrong bytes.

use std::time::Duration;

use flowlane_e2e::attack_scripts::STOCK_HOSTILE;
use flowlane_e2e::shm::{self, run_ok, wait_listening, Bg, Node};
use flowlane_e2e::shm_scripts::{PYTHON, THREADED_CLIENT};

const T: Duration = Duration::from_secs(300);

#[test]
fn a_hostile_stock_client_hurts_only_its_own_connections() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new("hstk", 3);
    let (attacker, honest, server) = (&node.pods[0], &node.pods[1], &node.pods[2]);
    let bench = shm::build_dir().join("shm-bench").display().to_string();
    let srv = Bg::spawn(node.cmd(server, true, &[&bench, "serve", "7611"]));
    wait_listening(server, 7611);
    let ip = server.ip.to_string();
    let before = node.shm_opened();
    // `n` checked echoes from the honest pod, one after another.
    let honest_echoes = |n: usize, what: &str| {
        let n = n.to_string();
        let argv = [PYTHON, "-c", THREADED_CLIENT, &ip, "7611", "1", &n];
        let out = run_ok(node.cmd(honest, true, &argv), T, what);
        assert!(out.contains(&format!("ok {n}")), "{out}");
    };
    let atk = Bg::spawn(node.cmd(
        attacker,
        true,
        &[PYTHON, "-c", STOCK_HOSTILE, &ip, "7611", "4"],
    ));
    honest_echoes(120, "honest client");
    let (st, aout, aerr) = atk.finish(T);
    assert!(
        st.is_some_and(|s| s.success()) && aout.contains("done"),
        "the attacker did not finish ({st:?}):\n{aout}\n{aerr}"
    );
    let scribbled: usize = aout
        .lines()
        .filter_map(|l| {
            l.strip_prefix("round ")?
                .split(" scribbled ")
                .nth(1)?
                .parse::<usize>()
                .ok()
        })
        .sum();
    assert!(
        scribbled >= 8,
        "the attacker held too little stock:\n{aout}"
    );
    assert!(
        !aout.lines().any(|l| l == "own bad"),
        "a connection carried wrong bytes without an error:\n{aout}"
    );
    let own_ok = aout.lines().filter(|l| *l == "own ok").count();
    eprintln!(
        "attacker: {scribbled} stock regions scribbled; {own_ok} of 40 own connections intact, \
         the rest failed with an error"
    );
    // The server served to the end, the lane still carries new pods'
    // connections, and the daemon answers.
    honest_echoes(10, "honest client after the attack");
    assert!(
        node.shm_opened() - before >= 130,
        "the honest connections rode the lane"
    );
    let (sst, sout, serr) = srv.finish(Duration::ZERO);
    assert!(
        sst.is_none(),
        "the server exited ({sst:?}):\n{sout}\n{serr}"
    );
}
