//! The shared-memory lane end to end: pods on one node wired by the real
//! `flowlane` plugin, the real `flowlaned`, unmodified programs run with
//! `LD_PRELOAD=libflowlane_preload.so`, and the daemon's counters proving
//! which lane carried the bytes. Needs root.

use flowlane_e2e::shm::{self, run_ok, wait_listening, Bg, Node};
use flowlane_e2e::shm_scripts::{ECHO_CLIENT, ECHO_SERVER, PYTHON};
use std::time::Duration;

const T: Duration = Duration::from_secs(120);

/// Python blocking sockets, both directions at once, half-close: the bytes
/// arrive intact and the daemon counted a shared-memory connection.
#[test]
fn python_echo_uses_shared_memory() {
    let node = Node::new("echo", 2);
    eprintln!("pods wired by: {}", node.wiring);
    let (client, server) = (&node.pods[0], &node.pods[1]);
    let srv = Bg::spawn(node.cmd(server, true, &[PYTHON, "-c", ECHO_SERVER, "7001"]));
    wait_listening(server, 7001);
    let ip = server.ip.to_string();
    let out = run_ok(
        node.cmd(
            client,
            true,
            &[PYTHON, "-c", ECHO_CLIENT, &ip, "7001", "50000000", "1"],
        ),
        T,
        "echo client",
    );
    assert!(out.starts_with("ok 50000000"), "{out}");
    let (st, _, err) = srv.finish(T);
    assert!(st.is_some_and(|s| s.success()), "server: {err}");
    assert_eq!(
        node.shm_opened(),
        1,
        "the connection must have used the shm lane; daemon log:\n{}",
        node.daemon_log()
    );
    let _ = shm::heavy;
}
