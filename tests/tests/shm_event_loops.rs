//! The event-loop conformance suite: the same checks (checksummed bytes
//! both ways, half-close, sequential connections on one long-lived server,
//! lane and non-lane clients in turn) through real event loops, on the
//! lane and across mixed pairs (the library on one side only). The daemon's
//! counters prove which connections took the lane.
//!
//! Names: tag `ev`; pods in 10.239.x.0/24.

use flowlane_e2e::loop_scripts::NODE_LOOP;
use flowlane_e2e::shm::{run_ok, wait_listening, Bg, Node, Pod};
use std::time::Duration;

const T: Duration = Duration::from_secs(120);
const NODE: &str = "/usr/bin/node";

/// One Node.js client run: `bytes` through the echo-and-trailer protocol.
fn node_client(
    node: &Node,
    client: &Pod,
    server: &Pod,
    port: u16,
    lib: bool,
    bytes: u64,
    seed: u32,
) {
    let (ip, port, n, seed) = (
        server.ip.to_string(),
        port.to_string(),
        bytes.to_string(),
        seed.to_string(),
    );
    let out = run_ok(
        node.cmd(
            client,
            lib,
            &[NODE, "-e", NODE_LOOP, "client", &ip, &port, &n, &seed],
        ),
        T,
        &format!("node client (library: {lib})"),
    );
    assert!(out.starts_with(&format!("ok {n} ")), "{out}");
}

/// Regression (issue 16): a Node.js `net` server under the library serves
/// a lane client, then a client without the library, and so on in turn.
/// libuv closes sockets with `syscall(SYS_close)`, so the library never saw
/// the lane connection's close; the next accepted socket got the same fd
/// number and inherited its stale ring state: the server read a closed
/// ring's end of stream and closed the plain client's connection unread.
#[test]
fn ev_node_server_serves_lane_and_plain_clients_in_turn() {
    let node = Node::new_in("ev", 2, 239);
    let (client, server) = (&node.pods[0], &node.pods[1]);
    let port = 7301;
    let turns = [true, false, true, true, false, false, true];
    let srv = Bg::spawn(node.cmd(
        server,
        true,
        &[
            NODE,
            "-e",
            NODE_LOOP,
            "server",
            &port.to_string(),
            &turns.len().to_string(),
        ],
    ));
    wait_listening(server, port);
    let mut lane = 0;
    for (i, lib) in turns.into_iter().enumerate() {
        let before = node.shm_opened();
        node_client(&node, client, server, port, lib, 4 << 20, i as u32 + 1);
        let opened = node.shm_opened() - before;
        assert_eq!(
            opened, lib as u64,
            "turn {i} (client library: {lib}): {opened} lane connections"
        );
        lane += opened;
    }
    let (st, out, err) = srv.finish(T);
    assert!(st.is_some_and(|s| s.success()), "node server: {out} {err}");
    assert_eq!(lane, 4);
}
