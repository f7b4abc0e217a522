//! `flowlaned` restarts: graceful stop removes the socket, a crash leaves a
//! stale one that the next start replaces, the state (pods, listeners of
//! live processes) is rebuilt, clients fall back while it is down, and a
//! second daemon refuses to steal a live socket.

use super::common as daemon_common;

use std::process::Command;
use std::time::Duration;

use daemon_common::Node;
use flowlane_e2e::binaries::workspace_artifact;

#[test]
fn restart_rebuilds_state_and_clients_fall_back_while_it_is_down() {
    let _turn = crate::turn::take(module_path!());
    let mut node = Node::start("rst", &[]);
    let a = node.add_pod("a", "10.202.7.2");
    let b = node.add_pod("b", "10.202.7.3");
    let (mut pa, mut pb) = (a.agent(), b.agent());
    assert_eq!(pb.cmd("listen 0.0.0.0:7100"), "ok");
    let old = pa.expect_channel("intent 0.0.0.0:45000 10.202.7.3:7100 65536");
    assert_eq!(
        pb.expect_channel("claim 10.202.7.3:7100 10.202.7.2:45000"),
        old
    );
    assert_eq!(pa.cmd("write 0 survives-restart"), "ok");

    // Graceful stop: clean exit, socket removed.
    assert!(node.stop_daemon(), "flowlaned exits 0 on SIGTERM");
    assert!(!node.socket.exists(), "socket removed on shutdown");
    assert!(node.log_text().contains("shutting down"));
    // While it is down: clients get an error (and stay on TCP); the
    // channel they already hold is untouched.
    assert!(pa
        .cmd("intent 0.0.0.0:45001 10.202.7.3:7100 65536")
        .starts_with("err NotFound"));
    assert_eq!(pb.cmd("read 0 16"), "data survives-restart");

    node.start_daemon();
    let st = node.stats();
    assert_eq!(st.daemon.pods, 2, "pods rebuilt from the registry");
    assert_eq!(st.listeners.len(), 1, "the live listener was restored");
    let new = pa.expect_channel("intent 0.0.0.0:45002 10.202.7.3:7100 65536");
    assert_ne!(new, old, "channel ids stay unique across restarts");
    assert_eq!(
        pb.expect_channel("claim 10.202.7.3:7100 10.202.7.2:45002"),
        new
    );
    // The old connection's reports still count.
    assert_eq!(pa.cmd(&format!("closed {old} 300 0")), "ok");
    assert_eq!(node.stats().lanes["shm"].bytes, 300);

    // Crash: the socket file stays; the next daemon replaces it.
    node.kill_daemon();
    assert!(node.socket.exists(), "a crashed daemon leaves its socket");
    node.start_daemon();
    assert!(node.log_text().contains("removed stale socket"));
    assert_eq!(node.stats().listeners.len(), 1);
    pa.expect_channel("intent 0.0.0.0:45003 10.202.7.3:7100 65536");

    // The listening process exits: its listener goes.
    drop(pb);
    let gone = flowlane_e2e::wait::until(Duration::from_secs(20), || {
        node.stats().listeners.is_empty()
    });
    assert!(gone, "listener of a dead process is dropped");
    assert_eq!(pa.cmd("intent 0.0.0.0:45004 10.202.7.3:7100 65536"), "none");
}

#[test]
fn a_second_daemon_does_not_steal_a_live_socket() {
    let _turn = crate::turn::take(module_path!());
    let mut node = Node::start("two", &[]);
    let out = Command::new(workspace_artifact("flowlaned"))
        .arg("--state-dir")
        .arg(node.state_dir())
        .arg("--socket")
        .arg(&node.socket)
        .output()
        .expect("run second flowlaned");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("already serving"), "{err}");
    assert!(node.daemon_alive());
    node.stats();
    // The socket's directory is created, and the socket is open to every uid.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&node.socket)
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o666);

    // SIGHUP rereads the registry; SIGINT stops as gracefully as SIGTERM.
    let _pod = node.add_pod("a", "10.202.7.9");
    let pid = nix::unistd::Pid::from_raw(node.daemon_pid() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
    let reread =
        flowlane_e2e::wait::until(Duration::from_secs(20), || node.stats().daemon.pods == 1);
    assert!(reread, "SIGHUP rereads the registry");
    let mut d = node.daemon.take().unwrap();
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    let mut status = None;
    flowlane_e2e::wait::until(Duration::from_secs(30), || {
        status = d.child.try_wait().ok().flatten();
        status.is_some()
    });
    assert!(
        status.is_some_and(|s| s.success()),
        "exit 0 on SIGINT: {status:?}"
    );
    assert!(!node.socket.exists(), "socket removed on SIGINT");
}
