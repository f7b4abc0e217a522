//! The event-loop conformance suite: the same checks (checksummed bytes
//! both ways, half-close, sequential and concurrent connections on one
//! long-lived server, lane and non-lane clients in turn, a peer killed
//! mid-stream) through real event loops, on the lane and across mixed
//! pairs (the library on one side only, both directions). The daemon's
//! counters prove exactly which connections took the lane. The checks are
//! in `flowlane_e2e::conformance`, the programs in
//! `flowlane_e2e::loop_scripts`; each test prints its runtime's row of the
//! results table (`--nocapture`).
//!
//! Names: tag `ev`; pods in 10.246.x.0/24.

use flowlane_e2e::conformance::{report, run, Runtime};
use flowlane_e2e::shm::Node;

const NET: u8 = 246;

fn conformance(rt: Runtime) {
    let node = Node::new_in("ev", 2, NET);
    let row = run(rt, &node);
    report(rt, &row);
}

/// Node.js `net` (libuv). Also the regression test of issue 16's first
/// item: libuv closes sockets with `syscall(SYS_close)`, so the library
/// never saw a lane connection's close; the next accepted socket got the
/// same fd number and inherited its stale ring state: the server read a
/// closed ring's end of stream and closed the plain client's connection
/// unread (the check "lane and plain clients in turn, one server").
#[test]
fn ev_node_net() {
    let _turn = crate::turn::take(module_path!());
    conformance(Runtime::Node);
}

/// Python asyncio with its default loop (selectors, epoll level-triggered).
#[test]
fn ev_python_asyncio() {
    let _turn = crate::turn::take(module_path!());
    conformance(Runtime::Asyncio);
}

/// Python asyncio on uvloop (libuv; Debian's python3-uvloop).
#[test]
fn ev_python_uvloop() {
    let _turn = crate::turn::take(module_path!());
    conformance(Runtime::Uvloop);
}

/// Rust tokio (mio, epoll edge-triggered; `loop-echo-tokio`).
#[test]
fn ev_rust_tokio() {
    let _turn = crate::turn::take(module_path!());
    conformance(Runtime::Tokio);
}

/// Standalone asio (Debian's libasio-dev). Regression test of issue 16's
/// second item: asio's epoll reactor registers every socket when it opens
/// it, before `connect` (`EPOLLET|EPOLLIN|EPOLLPRI|EPOLLERR|EPOLLHUP`, a
/// pointer as the data word), and the library kept such sockets on TCP;
/// now the registration moves into the library's epoll emulation.
#[test]
fn ev_asio() {
    let _turn = crate::turn::take(module_path!());
    conformance(Runtime::Asio);
}

/// TLS on top of the lane: OpenSSL (Python's `ssl`) over asyncio, with a
/// self-signed certificate.
#[test]
fn ev_tls_openssl() {
    let _turn = crate::turn::take(module_path!());
    conformance(Runtime::Tls);
}

/// Epoll registrations made before `connect` (issue 16, asio's pattern in
/// detail, through Python's `select.epoll`): edge-triggered, in two sets,
/// modified and removed before connect, `EPOLLONESHOT` already fired by
/// the unconnected socket, and registered before a `fork` (stays on TCP).
/// The script's expectations are the kernel's: it passes without the
/// library too (checked first).
#[test]
fn ev_epoll_registrations_made_before_connect() {
    let _turn = crate::turn::take(module_path!());
    use flowlane_e2e::loop_scripts::{EPOLL_BEFORE_CONNECT, PY_LOOP};
    use flowlane_e2e::shm::{run_ok, wait_listening, Bg};
    use flowlane_e2e::shm_scripts::PYTHON;
    use std::time::Duration;
    let t = Duration::from_secs(60);
    let node = Node::new_in("evr", 2, NET);
    let (client, server) = (&node.pods[0], &node.pods[1]);
    for (port, lib, lane) in [(7411u16, false, 0u64), (7412, true, 2)] {
        let srv = Bg::spawn(node.cmd(
            server,
            lib,
            &[PYTHON, "-c", PY_LOOP, "server", &port.to_string(), "3"],
        ));
        wait_listening(server, port);
        let before = node.shm_opened();
        let out = run_ok(
            node.cmd(
                client,
                lib,
                &[
                    PYTHON,
                    "-c",
                    EPOLL_BEFORE_CONNECT,
                    &server.ip.to_string(),
                    &port.to_string(),
                ],
            ),
            t,
            &format!("registrations before connect (library: {lib})"),
        );
        assert!(out.trim_end().ends_with("ok"), "{out}");
        let (st, out, err) = srv.finish(t);
        assert!(st.is_some_and(|s| s.success()), "server: {out} {err}");
        assert_eq!(
            node.shm_opened() - before,
            lane,
            "library: {lib}: lane connections (two-sets and oneshot on the lane, forked on TCP)"
        );
    }
}
