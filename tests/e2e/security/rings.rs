//! Hostile peers on the shared-memory lane (issue 11): two pods of one node
//! wired by the plugin, both with the preload library. One end is an
//! attacker that gets a real channel, then writes every shared word of the
//! region in turn (extreme, zero, one back, a MiB ahead, random) in its own
//! mapping; the other end is an honest Python program reading, peeking,
//! polling, epolling, splicing and sendfiling through the library. The
//! victim must survive, see a clean error (ECONNRESET) on the attacked
//! connection when it reads a bad word, hand the attacker no byte it was
//! not given, and serve the next connection; the daemon counts each reset
//! as `ring-violation`.

use flowlane_e2e::attack_scripts::{victim_client, victim_server, HOSTILE};
use flowlane_e2e::shm::{wait_listening, Bg, Node};
use flowlane_e2e::shm_scripts::PYTHON;
use std::time::Duration;

const T: Duration = Duration::from_secs(300);

/// Words x modes the attacker tries (19 words, 5 modes).
const ATTACKS: usize = 19 * 5;

/// The attacker's lines `attack WORD MODE OUTCOME`.
fn outcomes(out: &str) -> Vec<(String, String, String)> {
    out.lines()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w.len() == 4 && w[0] == "attack").then(|| (w[1].into(), w[2].into(), w[3].into()))
        })
        .collect()
}

/// The attack's number in the attacker's (fixed) order.
fn attack_index(all: &[(String, String, String)], word: &str, mode: &str) -> usize {
    all.iter()
        .position(|(w, m, _)| w == word && m == mode)
        .unwrap_or_else(|| panic!("no attack {word} {mode}"))
}

/// The victim's own account of its connection `conn`: it ended with
/// ECONNRESET. (The attacker's `reset` is only what it saw within its
/// wait; the victim's line does not depend on timing.)
fn victim_reset(victim_out: &str, conn: usize) -> bool {
    let (start, end) = (
        format!("conn {conn} "),
        format!(" reset {}", libc::ECONNRESET),
    );
    victim_out
        .lines()
        .any(|l| l.starts_with(&start) && l.ends_with(&end))
}

/// The victim's library found a bad word and reset the connection: the
/// warning it logs (FLOWLANE_LOG=warn) once per connection.
fn victim_violations(stderr: &str) -> u64 {
    stderr
        .lines()
        .filter(|l| l.contains("broke the ring protocol"))
        .count() as u64
}

/// The victim's library found at least `at_least` bad words (its stderr),
/// each ended its connection with ECONNRESET (its stdout), and each reached
/// the daemon's counters.
fn assert_violations(node: &Node, out: &str, err: &str, at_least: u64) {
    let found = victim_violations(err);
    assert!(found >= at_least, "{err}");
    let econnreset = out
        .lines()
        .filter(|l| l.ends_with(&format!(" reset {}", libc::ECONNRESET)))
        .count() as u64;
    assert!(
        econnreset >= found,
        "each violation is an ECONNRESET:\n{out}\n{err}"
    );
    assert_counted(node, found);
}

/// The victim's violations reached the daemon's counters (the attacker's
/// own library may add its own: it also checks what it reads).
fn assert_counted(node: &Node, victim: u64) {
    let counted = node
        .stats()
        .fallbacks
        .get("ring-violation")
        .copied()
        .unwrap_or(0);
    assert!(
        counted >= victim,
        "daemon counted {counted} ring violations, the victim found {victim}"
    );
}

/// Common checks of one run: every attack rode the lane, nothing leaked,
/// the victim served every honest connection after an attack.
fn check_attacker(out: &str) -> Vec<(String, String, String)> {
    assert!(
        !out.contains("\ntcp ") && !out.starts_with("tcp "),
        "the lane did not engage:\n{out}"
    );
    assert!(
        !out.contains("leak"),
        "the victim wrote bytes it was not given:\n{out}"
    );
    assert!(out.contains(&format!("done {ATTACKS}")), "{out}");
    let all = outcomes(out);
    assert_eq!(all.len(), ATTACKS, "{out}");
    // One line per word: what the attacker saw for each kind of value.
    let mut words: Vec<&str> = all.iter().map(|(w, _, _)| w.as_str()).collect();
    words.dedup();
    for w in words {
        let seen: Vec<String> = all
            .iter()
            .filter(|(x, _, _)| x == w)
            .map(|(_, m, o)| format!("{m}={o}"))
            .collect();
        eprintln!("  {w:<22} {}", seen.join(" "));
    }
    eprintln!(
        "{} of {ATTACKS} attacks ended the connection; the rest touched words the victim \
         never needed (futex words, writer_need, its own flags) or values it allows",
        all.iter().filter(|(_, _, o)| o == "reset").count()
    );
    all
}

/// The attack and its relatives against a victim server: a
/// client→server `tail` a MiB ahead crashed a Python echo server before.
#[test]
fn a_hostile_client_cannot_crash_or_read_a_server() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new("hclnt", 2);
    let (attacker, victim) = (&node.pods[0], &node.pods[1]);
    let mut vc = node.cmd(victim, true, &[PYTHON, "-c", &victim_server(), "7601"]);
    vc.env("FLOWLANE_LOG", "warn");
    let srv = Bg::spawn(vc);
    wait_listening(victim, 7601);
    let ip = victim.ip.to_string();
    let mut cmd = node.cmd(
        attacker,
        true,
        &[PYTHON, "-c", HOSTILE, "client", &ip, "7601"],
    );
    cmd.env("FLOWLANE_RING_SIZE", "4096");
    let (ast, out, aerr) = Bg::spawn(cmd).finish(T);
    let attacker_ok = ast.is_some_and(|s| s.success());
    // A failed attacker sent no QUIT: then the victim is ended at once.
    let (st, sout, serr) = srv.finish(if attacker_ok { T } else { Duration::ZERO });
    assert!(
        attacker_ok,
        "attacker: {out}\n{aerr}\nvictim:\n{sout}\n{serr}"
    );
    assert!(
        st.is_some_and(|s| s.success()),
        "the victim server died: {st:?}\n{sout}\n{serr}\nattacker:\n{out}\n{aerr}"
    );
    let all = check_attacker(&out);
    assert_eq!(
        out.lines().filter(|l| *l == "honest ok").count(),
        ATTACKS,
        "the victim must serve an honest connection after every attack:\n{out}"
    );
    for (word, mode) in [
        ("c2s.tail", "ahead"),
        ("c2s.tail", "max"),
        ("c2s.tail", "back"),
        ("c2s.head", "back"),
        ("c2s.producer_closed", "max"),
    ] {
        // The server counts connections from 1; attack k is its 2k+1st.
        let conn = 2 * attack_index(&all, word, mode) + 1;
        assert!(
            victim_reset(&sout, conn),
            "{word} {mode} (conn {conn}):\n{sout}"
        );
    }
    // ECONNRESET for a violation; EPIPE where the attacker's word said
    // "closed" (a value the protocol allows: as a peer's shutdown over TCP).
    let clean = [libc::ECONNRESET, libc::EPIPE].map(|e| format!(" {e}"));
    assert!(
        sout.lines()
            .filter(|l| l.contains(" reset "))
            .all(|l| clean.iter().any(|e| l.ends_with(e.as_str()))),
        "every failed connection must end with ECONNRESET or EPIPE:\n{sout}"
    );
    assert_violations(&node, &sout, &serr, 5);
}

/// The mirror image: the attacker is the server, the victim a client.
#[test]
fn a_hostile_server_cannot_crash_or_read_a_client() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new("hsrv", 2);
    let (victim, attacker) = (&node.pods[0], &node.pods[1]);
    let srv = Bg::spawn(node.cmd(attacker, true, &[PYTHON, "-c", HOSTILE, "server", "7602"]));
    wait_listening(attacker, 7602);
    let ip = attacker.ip.to_string();
    let n = ATTACKS.to_string();
    let mut vc = node.cmd(
        victim,
        true,
        &[PYTHON, "-c", &victim_client(), &ip, "7602", &n],
    );
    // The client sizes the region: 4 KiB rings, as in the attack.
    vc.env("FLOWLANE_LOG", "warn")
        .env("FLOWLANE_RING_SIZE", "4096");
    let cli = Bg::spawn(vc);
    let (vst, vout, verr) = cli.finish(T);
    let (st, out, err) = srv.finish(T);
    assert!(
        vst.is_some_and(|s| s.success()) && vout.contains(&format!("done {ATTACKS}")),
        "the victim client died ({vst:?}):\n{vout}\n{verr}\nattacker:\n{out}\n{err}"
    );
    assert!(!vout.contains("got-foreign"), "{vout}");
    assert_eq!(
        vout.lines().filter(|l| *l == "honest ok").count(),
        ATTACKS,
        "the victim must be served after every attack:\n{vout}"
    );
    assert!(st.is_some_and(|s| s.success()), "attacker: {out}\n{err}");
    let all = check_attacker(&out);
    for (word, mode) in [
        ("s2c.tail", "ahead"),
        ("s2c.tail", "max"),
        ("s2c.head", "back"),
    ] {
        let conn = attack_index(&all, word, mode);
        assert!(
            victim_reset(&vout, conn),
            "{word} {mode} (conn {conn}):\n{vout}"
        );
    }
    assert_violations(&node, &vout, &verr, 3);
}
