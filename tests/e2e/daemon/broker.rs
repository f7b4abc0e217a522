//! `flowlaned` brokering channels between real pods (network namespaces):
//! the same shared memory reaches both ends, only the right pods get it,
//! unclaimed channels expire, and nothing leaks in the daemon.

use super::common as daemon_common;

use std::time::Duration;

use daemon_common::Node;

#[test]
fn channel_memory_is_shared_between_client_and_server_pods() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::start("shr", &[]);
    let server_pod = node.add_pod("srv", "10.202.1.3");
    let client_pod = node.add_pod("cli", "10.202.1.2");
    let mut server = server_pod.agent();
    let mut client = client_pod.agent();

    assert_eq!(server.cmd("listen 0.0.0.0:5000"), "ok");
    // Unspecified source IP: the daemon fills in the pod's address.
    let id = client.expect_channel("intent 0.0.0.0:41000 10.202.1.3:5000 65536");
    assert_eq!(client.cmd("write 0 hello-from-client"), "ok");

    let st = node.stats();
    assert_eq!(st.lanes["shm"].channels_pending, 1);
    assert_eq!(st.listeners.len(), 1);
    assert_eq!(st.listeners[0].pod, server_pod.name);

    let claimed = server.expect_channel("claim 10.202.1.3:5000 10.202.1.2:41000");
    assert_eq!(
        claimed, id,
        "the server gets the channel the client announced"
    );
    assert_eq!(server.cmd("read 0 17"), "data hello-from-client");
    assert_eq!(server.cmd("write 4096 reply-from-server"), "ok");
    assert_eq!(client.cmd("read 4096 17"), "data reply-from-server");
    // The region is sealed: neither end can shrink it under the other.
    assert!(
        server.cmd("shrink").starts_with("err"),
        "memfd must be sealed"
    );

    let st = node.stats();
    let shm = &st.lanes["shm"];
    assert_eq!(
        (
            shm.connections_opened,
            shm.connections_active,
            shm.channels_pending
        ),
        (1, 1, 0)
    );
    let conn = &st.connections[0];
    assert_eq!(conn.id, id);
    assert_eq!(conn.client.pod, client_pod.name);
    assert_eq!(conn.client.addr, client_pod.addr(41000));
    assert_eq!(conn.server.pod, server_pod.name);
    assert_eq!(conn.server.addr, server_pod.addr(5000));
    assert_eq!(conn.region_len, 65536);

    // A second claim of the same connection finds nothing.
    assert_eq!(server.cmd("claim 10.202.1.3:5000 10.202.1.2:41000"), "none");

    assert_eq!(client.cmd(&format!("closed {id} 1000 24")), "ok");
    assert_eq!(
        node.stats().lanes["shm"].connections_active,
        1,
        "half reported"
    );
    assert_eq!(server.cmd(&format!("closed {id} 24 1000")), "ok");
    let st = node.stats();
    let shm = &st.lanes["shm"];
    assert_eq!(
        (shm.connections_active, shm.connections_closed, shm.bytes),
        (0, 1, 1024)
    );
    assert!(st.connections.is_empty());
}

#[test]
fn a_third_pod_can_never_obtain_another_pairs_channel() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::start("sec", &[]);
    let a = node.add_pod("a", "10.202.2.2");
    let b = node.add_pod("b", "10.202.2.3");
    let c = node.add_pod("c", "10.202.2.4");
    let (mut pa, mut pb, mut pc) = (a.agent(), b.agent(), c.agent());

    assert_eq!(pb.cmd("listen 10.202.2.3:6000"), "ok");
    // C cannot register a listener on B's address, nor announce from A's.
    assert!(pc
        .cmd("listen 10.202.2.3:6000")
        .starts_with("err PermissionDenied"));
    assert!(pc
        .cmd("intent 10.202.2.2:41000 10.202.2.3:6000 65536")
        .starts_with("err PermissionDenied"));

    let id = pa.expect_channel("intent 10.202.2.2:41000 10.202.2.3:6000 65536");
    assert_eq!(pa.cmd("write 0 secret-of-a-and-b"), "ok");

    // C tries every way to reach the pending channel.
    assert!(pc
        .cmd("claim 10.202.2.3:6000 10.202.2.2:41000")
        .starts_with("err PermissionDenied"));
    assert!(pc
        .cmd("claim 10.202.2.4:6000 10.202.2.2:41000")
        .starts_with("err PermissionDenied"));
    assert!(pc
        .cmd(&format!("cancel {id}"))
        .starts_with("err PermissionDenied"));
    assert!(
        pc.cmd("stats").starts_with("err PermissionDenied"),
        "pods cannot read node stats"
    );
    assert!(pc
        .cmd("registry-changed")
        .starts_with("err PermissionDenied"));
    // A claim B's listener never made also gets nothing for C: no channel.
    assert_eq!(pc.cmd("claim 10.202.2.4:6000 10.202.2.2:41001"), "none");

    // The channel is still there for its real server.
    assert_eq!(
        pb.expect_channel("claim 10.202.2.3:6000 10.202.2.2:41000"),
        id
    );
    assert_eq!(pb.cmd("read 0 17"), "data secret-of-a-and-b");
    // …and after the claim C cannot report on it either.
    assert!(pc
        .cmd(&format!("closed {id} 1 1"))
        .starts_with("err PermissionDenied"));

    // A process in a namespace that is no pod of this node is unknown.
    let stranger = flowlane_e2e::netns::Netns::named(&daemon_common::unique_name("x"));
    let mut px = daemon_common::Agent::spawn(&stranger, &node.socket);
    assert!(px
        .cmd("listen 0.0.0.0:6000")
        .starts_with("err PermissionDenied"));
    assert!(px
        .cmd("claim 10.202.2.3:6000 10.202.2.2:41000")
        .starts_with("err PermissionDenied"));

    let st = node.stats();
    assert!(
        st.auth_failures >= 10,
        "auth failures counted: {}",
        st.auth_failures
    );
    assert!(st.fallbacks.get("auth-failed").copied().unwrap_or(0) >= 4);
    assert_eq!(st.lanes["shm"].connections_opened, 1);
}

#[test]
fn unclaimed_channels_expire_and_the_daemon_keeps_no_fd() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::start("exp", &["--intent-timeout", "1"]);
    let a = node.add_pod("a", "10.202.3.2");
    let b = node.add_pod("b", "10.202.3.3");
    let (mut pa, mut pb) = (a.agent(), b.agent());
    assert_eq!(pb.cmd("listen 0.0.0.0:7000"), "ok");
    let fds_before = node.daemon_fds();

    for port in 42000..42010 {
        pa.expect_channel(&format!("intent 0.0.0.0:{port} 10.202.3.3:7000 65536"));
    }
    assert_eq!(node.stats().lanes["shm"].channels_pending, 10);
    assert!(
        node.daemon_fds() >= fds_before + 10,
        "the daemon holds pending memfds"
    );
    let expired = flowlane_e2e::wait::until(Duration::from_secs(20), || {
        node.stats().lanes["shm"].channels_pending == 0
    });
    assert!(expired, "pending channels expire");
    assert_eq!(pb.cmd("claim 10.202.3.3:7000 10.202.3.2:42000"), "none");
    let st = node.stats();
    assert_eq!(st.fallbacks["intent-expired"], 10);
    assert_eq!(st.fallbacks["claim-without-intent"], 1);

    // A cancelled intent goes as well.
    let id = pa.expect_channel("intent 0.0.0.0:42100 10.202.3.3:7000 65536");
    assert_eq!(pa.cmd(&format!("cancel {id}")), "ok");
    assert_eq!(node.stats().fallbacks["intent-cancelled"], 1);

    // Claimed channels: the daemon keeps one fd per live connection (for
    // its live byte counters) and lets go of it when both ends closed.
    let mut ids = Vec::new();
    for port in 42200..42210 {
        ids.push(pa.expect_channel(&format!("intent 0.0.0.0:{port} 10.202.3.3:7000 65536")));
        pb.expect_channel(&format!("claim 10.202.3.3:7000 10.202.3.2:{port}"));
    }
    assert_eq!(node.stats().lanes["shm"].connections_active, 10);
    for id in ids {
        assert_eq!(pa.cmd(&format!("closed {id} 10 0")), "ok");
        assert_eq!(pb.cmd(&format!("closed {id} 0 10")), "ok");
    }
    let st = node.stats();
    assert_eq!(
        (st.lanes["shm"].connections_closed, st.lanes["shm"].bytes),
        (10, 100)
    );
    let settled =
        flowlane_e2e::wait::until(Duration::from_secs(10), || node.daemon_fds() <= fds_before);
    assert!(
        settled,
        "daemon fds {} > {fds_before} before",
        node.daemon_fds()
    );
}

#[test]
fn intents_without_listener_oversized_or_off_node_stay_on_tcp() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::start("tcp", &["--max-region", "1048576"]);
    let a = node.add_pod("a", "10.202.4.2");
    let b = node.add_pod("b", "10.202.4.3");
    let (mut pa, mut pb) = (a.agent(), b.agent());
    assert_eq!(pa.cmd("intent 0.0.0.0:43000 10.202.4.3:8000 65536"), "none");
    assert_eq!(pa.cmd("intent 0.0.0.0:43000 10.99.0.1:8000 65536"), "none");
    assert_eq!(pb.cmd("listen 10.202.4.3:8000"), "ok");
    assert!(pa
        .cmd("intent 0.0.0.0:43000 10.202.4.3:8000 2097152")
        .starts_with("err InvalidInput"));
    // Another port of the listening pod has no listener.
    assert_eq!(pa.cmd("intent 0.0.0.0:43000 10.202.4.3:8001 65536"), "none");
    assert_eq!(pb.cmd("unlisten 10.202.4.3:8000"), "ok");
    assert_eq!(pa.cmd("intent 0.0.0.0:43000 10.202.4.3:8000 65536"), "none");
    assert_eq!(pa.cmd("fallback"), "ok");
    let st = node.stats();
    assert_eq!(st.fallbacks["no-listener"], 3);
    assert_eq!(st.fallbacks["not-local-pod"], 1);
    assert_eq!(st.fallbacks["region-too-large"], 1);
    assert_eq!(st.fallbacks["unsupported"], 1);
    assert_eq!(st.lanes["shm"].channels_pending, 0);
}

#[test]
fn pods_added_later_are_found_lazily_and_by_the_plugins_poke() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::start("lzy", &[]);
    assert_eq!(node.stats().daemon.pods, 0);
    // Registered after the daemon read the registry: found on first contact.
    let a = node.add_pod("a", "10.202.5.2");
    let mut pa = a.agent();
    assert_eq!(pa.cmd("listen 0.0.0.0:9000"), "ok");
    assert_eq!(node.stats().daemon.pods, 1);
    // The CNI plugin's poke makes the daemon reread at once.
    let b = node.add_pod("b", "10.202.5.3");
    flowlane_lane::notify::notify_registry_changed(&node.socket, Duration::from_secs(10))
        .expect("poke");
    assert_eq!(node.stats().daemon.pods, 2);
    // A destination pod added a moment ago is found too.
    let c = node.add_pod("c", "10.202.5.4");
    let mut pc = c.agent();
    assert_eq!(pc.cmd("listen 0.0.0.0:9000"), "ok");
    let mut pb = b.agent();
    pb.expect_channel("intent 0.0.0.0:44000 10.202.5.4:9000 65536");
    // A pod removed by CNI DEL loses its listener and its identity.
    node.remove_pod(&c);
    flowlane_lane::notify::notify_registry_changed(&node.socket, Duration::from_secs(10))
        .expect("poke");
    assert!(pc
        .cmd("listen 0.0.0.0:9001")
        .starts_with("err PermissionDenied"));
    let st = node.stats();
    assert_eq!(st.daemon.pods, 2);
    assert!(st.listeners.iter().all(|l| l.pod != c.name));
    assert_eq!(
        st.lanes["shm"].channels_pending, 0,
        "its pending channel went with it"
    );
}

#[test]
fn concurrent_clients_and_servers_all_get_their_own_channels() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::start("con", &["--log-level", "info"]);
    let a = node.add_pod("a", "10.202.11.2");
    let b = node.add_pod("b", "10.202.11.3");
    let mut listener = b.agent();
    assert_eq!(listener.cmd("listen 0.0.0.0:80"), "ok");
    const PER_AGENT: u64 = 500;
    // Four client processes announce at once, on disjoint source ports…
    let clients: Vec<_> = (0..4u64)
        .map(|i| {
            let mut agent = a.agent();
            std::thread::spawn(move || {
                let base = 50000 + i * PER_AGENT;
                agent.cmd(&format!(
                    "bench-intent {PER_AGENT} {base} 10.202.11.3:80 65536"
                ))
            })
        })
        .collect();
    for c in clients {
        let answer = c.join().unwrap();
        assert!(
            answer.starts_with("bench ") && answer.ends_with(&format!(" {PER_AGENT}")),
            "{answer}"
        );
    }
    assert_eq!(node.stats().lanes["shm"].channels_pending, 4 * PER_AGENT);
    // …then four server processes claim at once, each its own share.
    let servers: Vec<_> = (0..4u64)
        .map(|i| {
            let mut agent = b.agent();
            std::thread::spawn(move || {
                let base = 50000 + i * PER_AGENT;
                agent.cmd(&format!(
                    "bench-claim {PER_AGENT} 10.202.11.3:80 10.202.11.2 {base}"
                ))
            })
        })
        .collect();
    for s in servers {
        let answer = s.join().unwrap();
        assert!(answer.ends_with(&format!(" {PER_AGENT}")), "{answer}");
    }
    let st = node.stats();
    assert_eq!(st.lanes["shm"].channels_pending, 0);
    assert_eq!(st.lanes["shm"].connections_opened, 4 * PER_AGENT);
    // The agents exited: every connection is closed within a sweep or two.
    let closed = flowlane_e2e::wait::until(Duration::from_secs(30), || {
        node.stats().lanes["shm"].connections_active == 0
    });
    assert!(closed, "connections of exited processes are closed");
}

#[test]
fn one_pod_cannot_take_every_daemon_connection() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::start("cap", &["--log-level", "info"]);
    let a = node.add_pod("a", "10.202.12.2");
    let b = node.add_pod("b", "10.202.12.3");
    let fds_before = node.daemon_fds();
    let mut hog = a.agent();
    assert_eq!(hog.cmd("hold 1024"), "held 1024");
    let accepted = flowlane_e2e::wait::until(Duration::from_secs(30), || {
        node.daemon_fds() >= fds_before + 1024
    });
    assert!(accepted, "the daemon accepted the idle connections");
    // The pod's next connection is closed at once (its connects stay on TCP)…
    let mut pa = a.agent();
    let refused = pa.cmd("fallback");
    assert!(refused.starts_with("err"), "{refused}");
    assert!(node.stats().connections_refused >= 1);
    // …while other pods are still served.
    let mut pb = b.agent();
    assert_eq!(pb.cmd("listen 0.0.0.0:80"), "ok");
    assert_eq!(pb.cmd("fallback"), "ok");
    // Released connections give the pod its budget back.
    assert_eq!(hog.cmd("release"), "ok");
    let back = flowlane_e2e::wait::until(Duration::from_secs(30), || pa.cmd("fallback") == "ok");
    assert!(back, "the pod is served again");
}
