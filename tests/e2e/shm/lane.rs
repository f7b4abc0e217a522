//! The shared-memory lane end to end: pods on one node wired by the real
//! `flowlane` plugin, the real `flowlaned`, unmodified programs run with
//! `LD_PRELOAD=libflowlane_preload.so`, and the daemon's counters proving
//! which lane carried the bytes. Needs root.

use flowlane_e2e::shm::{self, Node};

/// Python blocking sockets, both directions at once, half-close: the bytes
/// arrive intact and the daemon counted a shared-memory connection.
#[test]
fn python_echo_uses_shared_memory() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new("echo", 2);
    eprintln!("pods wired by: {}", node.wiring);
    let (client, server) = (&node.pods[0], &node.pods[1]);
    node.python_echo(client, server, 7001, 50_000_000);
    assert_eq!(
        node.shm_opened(),
        1,
        "the connection must have used the shm lane; daemon log:\n{}",
        node.daemon_log()
    );
    let _ = shm::heavy;
}
