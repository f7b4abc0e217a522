//! The broker's unit tests, on the fake kernel (`fake_kernel.rs`): no
//! sockets, ports, processes, `/proc` reads or files on disk (channel
//! regions are memfds). The real-netns checks are in tests/e2e/daemon/*.rs;
//! the real kernel's, next to its code (`kernel.rs`).

use std::net::Ipv4Addr;

use flowlane_lane::proto::NoChannelReason;

use super::connections::plausible_bytes;
use super::fake_kernel::{FakeKernel, NODE_NETNS};
use super::listeners::LISTENER_GRACE;
use super::*;
use flowlane_registry::Attachment;

pub(super) struct Node {
    pub(super) kernel: FakeKernel,
    pub(super) broker: Broker,
}

/// The process every pod's caller and the node's are (as the test process
/// was all of them).
const ME: ProcessId = ProcessId {
    pid: 4242,
    start: 1,
};

/// A registry entry `id` with namespace `netns` (inode `inode`) and `ip`/24.
fn entry(id: &str, netns: String, inode: u64, ip: &str) -> Attachment {
    Attachment {
        network: "n".into(),
        container_id: id.into(),
        ifname: "eth0".into(),
        netns,
        netns_inode: inode,
        ips: vec![format!("{ip}/24")],
        mac: String::new(),
        pod_namespace: Some("default".into()),
        pod_name: Some(id.into()),
        pod_uid: None,
        created_unix: 0,
    }
}

/// A broker on `kernel`'s node (what the daemon's `main` makes).
fn broker_on(kernel: &FakeKernel, name: &str, limits: Limits) -> Broker {
    let dir = PathBuf::from(format!("/fake/state-{name}"));
    let facts = DaemonFacts {
        socket: dir.join("s.sock"),
        state_dir: dir,
    };
    Broker::new(facts, limits, Box::new(kernel.clone()))
}

/// Pods 1 (10.202.9.1), 2 (10.202.9.2), 3 (10.202.9.3), their namespaces
/// pinned with inodes 1, 2, 3 (the real-netns checks are in
/// tests/e2e/daemon/*.rs).
pub(super) fn node(name: &str, limits: Limits) -> Node {
    let kernel = FakeKernel::default();
    kernel.run(ME);
    for i in 1..=3u64 {
        let netns = format!("/var/run/netns/pod{i}");
        kernel.pin_netns(&netns, i);
        kernel.put(Attachment {
            pod_name: Some(format!("pod{i}")),
            ..entry(&format!("c{i}"), netns, i, &format!("10.202.9.{i}"))
        });
    }
    let broker = broker_on(&kernel, name, limits);
    Node { kernel, broker }
}

/// A root process of pod `i` (pods run as any uid, root included).
pub(super) fn pod(i: u64) -> Caller {
    Caller {
        netns: Some(i),
        process: Some(ME),
        uid: Some(0),
        gid: Some(0),
    }
}

/// A process of uid/gid in the daemon's own network namespace.
pub(super) fn on_node(uid: u32, gid: u32) -> Caller {
    Caller {
        netns: Some(NODE_NETNS),
        process: Some(ME),
        uid: Some(uid),
        gid: Some(gid),
    }
}

pub(super) fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

#[test]
fn intent_then_claim_hands_the_same_memfd_to_both() {
    let mut n = node("pair", Limits::default());
    let b = &mut n.broker;
    let r = b.handle(
        &pod(2),
        Request::RegisterListener {
            addr: sa("0.0.0.0:80"),
        },
    );
    assert_eq!(r.response, Response::Ok);
    let a = b.handle(
        &pod(1),
        Request::ConnectIntent {
            src: sa("0.0.0.0:40000"),
            dst: sa("10.202.9.2:80"),
            region_len: 8192,
        },
    );
    let Response::Channel { id, len: 8192 } = a.response else {
        panic!("{:?}", a.response)
    };
    let client_fd = a.fds.into_iter().next().unwrap();
    // A third pod cannot claim it, even naming the right peer.
    let third = b.handle(
        &pod(3),
        Request::ClaimAccepted {
            local: sa("10.202.9.2:80"),
            peer: sa("10.202.9.1:40000"),
        },
    );
    assert!(matches!(
        third.response,
        Response::Error {
            code: ErrorCode::Forbidden,
            ..
        }
    ));
    let third = b.handle(
        &pod(3),
        Request::ClaimAccepted {
            local: sa("10.202.9.3:80"),
            peer: sa("10.202.9.1:40000"),
        },
    );
    assert!(matches!(
        third.response,
        Response::Error {
            code: ErrorCode::Forbidden,
            ..
        }
    ));
    assert!(third.fds.is_empty());
    let s = b.handle(
        &pod(2),
        Request::ClaimAccepted {
            local: sa("10.202.9.2:80"),
            peer: sa("10.202.9.1:40000"),
        },
    );
    assert_eq!(s.response, Response::Channel { id, len: 8192 });
    let server_fd = s.fds.into_iter().next().unwrap();
    // Same memfd: same inode.
    use std::os::unix::fs::MetadataExt;
    let ino = |fd: OwnedFd| std::fs::File::from(fd).metadata().unwrap().ino();
    assert_eq!(ino(client_fd), ino(server_fd));
    let st = b.stats();
    assert_eq!(st.lanes[SHM_LANE].connections_active, 1);
    assert_eq!(st.connections[0].client.pod, "default/pod1");
    assert_eq!(st.connections[0].client.addr, sa("10.202.9.1:40000"));
    // Second claim finds nothing.
    let again = b.handle(
        &pod(2),
        Request::ClaimAccepted {
            local: sa("10.202.9.2:80"),
            peer: sa("10.202.9.1:40000"),
        },
    );
    assert!(matches!(again.response, Response::NoChannel { .. }));
    // Both sides report; bytes add up once per direction.
    for (who, sent, recv) in [(1, 100, 7), (2, 7, 100)] {
        let r = b.handle(
            &pod(who),
            Request::ReportClosed {
                channel_id: id,
                sent,
                received: recv,
            },
        );
        assert_eq!(r.response, Response::Ok);
    }
    let st = b.stats();
    assert_eq!(st.lanes[SHM_LANE].connections_closed, 1);
    assert_eq!(st.lanes[SHM_LANE].connections_active, 0);
    assert_eq!(st.lanes[SHM_LANE].bytes, 107);
    // Reports for ids this daemon never issued do not inflate counters.
    b.handle(
        &pod(1),
        Request::ReportClosed {
            channel_id: u64::MAX,
            sent: 1 << 40,
            received: 0,
        },
    );
    assert_eq!(b.stats().lanes[SHM_LANE].bytes, 107);
}

#[test]
fn foreign_addresses_and_unknown_pods_are_refused() {
    let mut n = node("auth", Limits::default());
    let b = &mut n.broker;
    let r = b.handle(
        &pod(1),
        Request::RegisterListener {
            addr: sa("10.202.9.2:80"),
        },
    );
    assert!(matches!(
        r.response,
        Response::Error {
            code: ErrorCode::Forbidden,
            ..
        }
    ));
    let r = b.handle(
        &pod(99),
        Request::RegisterListener {
            addr: sa("0.0.0.0:80"),
        },
    );
    assert!(matches!(
        r.response,
        Response::Error {
            code: ErrorCode::UnknownPod,
            ..
        }
    ));
    let r = b.handle(
        &pod(1),
        Request::ConnectIntent {
            src: sa("10.202.9.3:4000"),
            dst: sa("10.202.9.2:80"),
            region_len: 8192,
        },
    );
    assert!(matches!(
        r.response,
        Response::Error {
            code: ErrorCode::Forbidden,
            ..
        }
    ));
    let r = b.handle(&pod(1), Request::Stats);
    assert!(matches!(
        r.response,
        Response::Error {
            code: ErrorCode::Forbidden,
            ..
        }
    ));
    let Response::Stats { stats } = b.handle(&on_node(0, 0), Request::Stats).response else {
        panic!()
    };
    assert_eq!(stats.auth_failures, 4);
}

#[test]
fn no_listener_not_local_too_large_and_expiry() {
    let limits = Limits {
        intent_ttl: Duration::from_millis(0),
        ..Limits::default()
    };
    let mut n = node("misc", limits);
    let b = &mut n.broker;
    let intent = |b: &mut Broker, dst: &str, len: u64| {
        b.handle(
            &pod(1),
            Request::ConnectIntent {
                src: sa("0.0.0.0:4000"),
                dst: sa(dst),
                region_len: len,
            },
        )
        .response
    };
    assert_eq!(
        intent(b, "10.202.9.2:80", 8192),
        Response::NoChannel {
            reason: NoChannelReason::NoListener
        }
    );
    assert_eq!(
        intent(b, "10.9.9.9:80", 8192),
        Response::NoChannel {
            reason: NoChannelReason::NotLocalPod
        }
    );
    b.handle(
        &pod(2),
        Request::RegisterListener {
            addr: sa("10.202.9.2:80"),
        },
    );
    assert!(matches!(
        intent(b, "10.202.9.2:80", 65 << 20),
        Response::Error {
            code: ErrorCode::TooLarge,
            ..
        }
    ));
    assert!(matches!(
        intent(b, "10.202.9.2:80", 8192),
        Response::Channel { .. }
    ));
    b.tick(Instant::now());
    let r = b.handle(
        &pod(2),
        Request::ClaimAccepted {
            local: sa("10.202.9.2:80"),
            peer: sa("10.202.9.1:4000"),
        },
    );
    assert!(matches!(r.response, Response::NoChannel { .. }));
    b.handle(
        &pod(1),
        Request::ReportFallback {
            reason: FallbackReason::Unsupported,
        },
    );
    let st = b.stats();
    assert_eq!(st.fallbacks["no-listener"], 1);
    assert_eq!(st.fallbacks["not-local-pod"], 1);
    assert_eq!(st.fallbacks["intent-expired"], 1);
    assert_eq!(st.fallbacks["region-too-large"], 1);
    assert_eq!(st.fallbacks["claim-without-intent"], 1);
    assert_eq!(st.fallbacks["unsupported"], 1);
    assert_eq!(st.lanes[SHM_LANE].channels_pending, 0);
}

/// What one intent left behind: the answer and the counters it moved.
#[derive(Debug, PartialEq)]
struct Outcome {
    response: Response,
    fallbacks: BTreeMap<String, u64>,
    auth_failures: u64,
}

fn outcome(b: &mut Broker, run: impl FnOnce(&mut Broker) -> Response) -> Outcome {
    let before = b.stats();
    let response = run(b);
    let after = b.stats();
    let mut fallbacks = after.fallbacks;
    for (k, v) in before.fallbacks {
        *fallbacks.get_mut(&k).unwrap() -= v;
    }
    fallbacks.retain(|_, v| *v > 0);
    Outcome {
        response,
        fallbacks,
        auth_failures: after.auth_failures - before.auth_failures,
    }
}

#[test]
fn same_node_intents_and_the_relay_are_admitted_alike() {
    let mut n = node("admission", Limits::default());
    let b = &mut n.broker;
    let stranger = Caller {
        netns: Some(99),
        ..pod(1)
    };
    // (caller, src, dst, region, answer, counted as, auth failure)
    let cases: [(Caller, &str, &str, u64, &str, &str, u64); 6] = [
        (
            stranger,
            "0.0.0.0:4000",
            "10.202.9.2:80",
            8192,
            "unknown-pod",
            "auth-failed",
            1,
        ),
        (
            pod(1),
            "0.0.0.0:4000",
            "10.202.9.2:0",
            8192,
            "bad-request",
            "",
            0,
        ),
        (
            pod(1),
            "0.0.0.0:4000",
            "10.202.9.2:80",
            1024,
            "bad-request",
            "region-too-small",
            0,
        ),
        (
            pod(1),
            "0.0.0.0:4000",
            "10.202.9.2:80",
            65 << 20,
            "too-large",
            "region-too-large",
            0,
        ),
        (
            pod(1),
            "10.202.9.3:4000",
            "10.202.9.2:80",
            8192,
            "forbidden",
            "auth-failed",
            1,
        ),
        (
            pod(1),
            "0.0.0.0:4000",
            "[fd00::9]:80",
            8192,
            "no-channel",
            "no-source-address",
            0,
        ),
    ];
    for (caller, src, dst, region_len, answer, counted, auth_failures) in cases {
        let (src, dst) = (sa(src), sa(dst));
        let same_node = outcome(b, |b| {
            b.handle(
                &caller,
                Request::ConnectIntent {
                    src,
                    dst,
                    region_len,
                },
            )
            .response
        });
        let relayable = outcome(b, |b| {
            let req = Request::RelayableIntent {
                src,
                dst,
                region_len,
                socket_fd: 3,
            };
            b.handle(&caller, req).response
        });
        // The relay's entry (relay/mod.rs `intent`) answers the refusal as is.
        let relay = outcome(b, |b| {
            match b.admit_intent(&caller, src, dst, region_len, true) {
                Ok(a) => panic!("{src} -> {dst} ({region_len}) admitted: {a:?}"),
                Err(refused) => refused.response,
            }
        });
        // The request counter moves only on dispatch: not part of the answer.
        assert_eq!(same_node, relayable, "{src} -> {dst} ({region_len})");
        assert_eq!(same_node, relay, "{src} -> {dst} ({region_len})");
        let name = match &same_node.response {
            Response::Error { code, .. } => serde_json::to_value(code).unwrap(),
            Response::NoChannel { .. } => serde_json::json!("no-channel"),
            other => panic!("{src} -> {dst}: {other:?}"),
        };
        assert_eq!(name, answer, "{src} -> {dst} ({region_len})");
        let expected: BTreeMap<String, u64> = [(counted.to_string(), 1)]
            .into_iter()
            .filter(|(k, _)| !k.is_empty())
            .collect();
        assert_eq!(
            same_node.fallbacks, expected,
            "{src} -> {dst} ({region_len})"
        );
        assert_eq!(same_node.auth_failures, auth_failures, "{src} -> {dst}");
    }
}

#[test]
fn same_node_claims_and_the_relay_are_admitted_alike() {
    let mut n = node("claims", Limits::default());
    let b = &mut n.broker;
    let stranger = Caller {
        netns: Some(99),
        ..pod(2)
    };
    // (caller, local, answer)
    for (caller, local, answer) in [
        (stranger, "10.202.9.2:80", ErrorCode::UnknownPod),
        (pod(2), "10.202.9.3:80", ErrorCode::Forbidden),
    ] {
        let (local, peer) = (sa(local), sa("10.202.9.1:4000"));
        let same_node = outcome(b, |b| {
            b.handle(&caller, Request::ClaimAccepted { local, peer })
                .response
        });
        let relay = outcome(b, |b| match b.admit_claim(&caller, local) {
            Ok(pod) => panic!("{local} claimed by pod {pod}"),
            Err(refused) => refused.response,
        });
        assert_eq!(same_node, relay, "{local}");
        assert!(
            matches!(same_node.response, Response::Error { code, .. } if code == answer),
            "{local}: {:?}",
            same_node.response
        );
        assert_eq!(same_node.fallbacks, [("auth-failed".to_string(), 1)].into());
        assert_eq!(same_node.auth_failures, 1);
    }
}

#[test]
fn too_many_pending_channels_are_not_counted_as_a_large_region() {
    let limits = Limits {
        max_pending_per_pod: 1,
        ..Limits::default()
    };
    let mut n = node("pending", limits);
    let b = &mut n.broker;
    b.handle(
        &pod(2),
        Request::RegisterListener {
            addr: sa("10.202.9.2:80"),
        },
    );
    let intent = |b: &mut Broker, port: u16| {
        b.handle(
            &pod(1),
            Request::ConnectIntent {
                src: SocketAddr::new(sa("0.0.0.0:1").ip(), port),
                dst: sa("10.202.9.2:80"),
                region_len: 8192,
            },
        )
        .response
    };
    assert!(matches!(intent(b, 4000), Response::Channel { .. }));
    assert!(matches!(
        intent(b, 4001),
        Response::Error {
            code: ErrorCode::TooLarge,
            ..
        }
    ));
    let st = b.stats();
    assert_eq!(st.fallbacks["too-many-pending"], 1);
    assert_eq!(st.fallbacks.get("region-too-large"), None);
}

#[test]
fn live_bytes_come_from_the_rings_and_closed_rings_close_the_connection() {
    use flowlane_lane::ring::{self, Side};
    use std::os::fd::AsFd;
    let mut n = node("live", Limits::default());
    let b = &mut n.broker;
    b.handle(
        &pod(2),
        Request::RegisterListener {
            addr: sa("0.0.0.0:91"),
        },
    );
    let len = ring::region_len_for(8192);
    let a = b.handle(
        &pod(1),
        Request::ConnectIntent {
            src: sa("10.202.9.1:6000"),
            dst: sa("10.202.9.2:91"),
            region_len: len as u64,
        },
    );
    let Response::Channel { id, .. } = a.response else {
        panic!()
    };
    let s = b.handle(
        &pod(2),
        Request::ClaimAccepted {
            local: sa("10.202.9.2:91"),
            peer: sa("10.202.9.1:6000"),
        },
    );
    let fd = s.fds.into_iter().next().unwrap();
    let region = flowlane_lane::region::Region::map_memfd(fd.as_fd(), len).unwrap();
    let (mut ctx, _) = region.endpoints(Side::Client);
    let (mut stx, _) = region.endpoints(Side::Server);
    ctx.write(&[1u8; 5000]);
    stx.write(&[2u8; 70]);
    let st = b.stats();
    assert_eq!(st.connections[0].bytes_client_to_server, 5000);
    assert_eq!(st.connections[0].bytes_server_to_client, 70);
    assert_eq!(st.lanes[SHM_LANE].bytes, 5070);
    // A pod writing an absurd position into its ring moves no counter,
    // and one moving its position back makes none dip.
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::from(fd.try_clone().unwrap());
        f.write_all_at(&(1u64 << 61).to_ne_bytes(), 512).unwrap();
        assert_eq!(b.stats().connections[0].bytes_client_to_server, 5000);
        assert_eq!(b.stats().lanes[SHM_LANE].bytes, 5070);
        f.write_all_at(&10u64.to_ne_bytes(), 512).unwrap();
        let st = b.stats();
        assert_eq!(st.lanes[SHM_LANE].bytes, 5070);
        assert_eq!(st.lanes[SHM_LANE].bytes_client_to_server, 5000);
        assert_eq!(st.lanes[SHM_LANE].bytes_server_to_client, 70);
        f.write_all_at(&5000u64.to_ne_bytes(), 512).unwrap();
    }
    ctx.close();
    stx.close();
    b.tick(Instant::now());
    let st = b.stats();
    assert_eq!(st.lanes[SHM_LANE].connections_closed, 1);
    assert_eq!(st.lanes[SHM_LANE].bytes, 5070);
    // Late reports of the closed connection change nothing.
    b.handle(
        &pod(1),
        Request::ReportClosed {
            channel_id: id,
            sent: 5000,
            received: 70,
        },
    );
    assert_eq!(b.stats().lanes[SHM_LANE].bytes, 5070);
}

#[test]
fn dual_stack_sockets_with_ipv4_mapped_addresses_match() {
    let mut n = node("mapped", Limits::default());
    let b = &mut n.broker;
    let r = b.handle(
        &pod(2),
        Request::RegisterListener {
            addr: sa("[::]:93"),
        },
    );
    assert_eq!(r.response, Response::Ok);
    let a = b.handle(
        &pod(1),
        Request::ConnectIntent {
            src: sa("[::ffff:10.202.9.1]:7000"),
            dst: sa("[::ffff:10.202.9.2]:93"),
            region_len: 8192,
        },
    );
    let Response::Channel { id, .. } = a.response else {
        panic!("{:?}", a.response)
    };
    let s = b.handle(
        &pod(2),
        Request::ClaimAccepted {
            local: sa("[::ffff:10.202.9.2]:93"),
            peer: sa("10.202.9.1:7000"),
        },
    );
    assert_eq!(s.response, Response::Channel { id, len: 8192 });
}

#[test]
fn a_claiming_process_keeps_the_listener_after_the_listening_one_exits() {
    let mut n = node("prefork", Limits::default());
    let b = &mut n.broker;
    // Registrations are checked against the listening sockets of the
    // pod's namespace.
    let port = 30080;
    n.kernel.listen(port);
    let listen_addr = SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port);
    let server_addr = SocketAddr::new("10.202.9.2".parse().unwrap(), port);
    let parent = n.kernel.start_process();
    let as_parent = Caller {
        process: Some(parent),
        ..pod(2)
    };
    let r = b.handle(&as_parent, Request::RegisterListener { addr: listen_addr });
    assert_eq!(r.response, Response::Ok);
    let intent = |b: &mut Broker, src_port: u16| {
        b.handle(
            &pod(1),
            Request::ConnectIntent {
                src: sa(&format!("10.202.9.1:{src_port}")),
                dst: server_addr,
                region_len: 8192,
            },
        )
        .response
    };
    assert!(matches!(intent(b, 5000), Response::Channel { .. }));
    // A forked worker (another process of the pod) accepts and claims.
    let r = b.handle(
        &pod(2),
        Request::ClaimAccepted {
            local: server_addr,
            peer: sa("10.202.9.1:5000"),
        },
    );
    assert!(matches!(r.response, Response::Channel { .. }));
    n.kernel.exit(parent);
    b.tick(Instant::now());
    assert_eq!(b.stats().listeners.len(), 1);
    assert!(matches!(intent(b, 5001), Response::Channel { .. }));
    // The listening socket closes without an unregister: the next sweep
    // drops the registration.
    n.kernel.close_listener(port);
    b.tick(Instant::now() + Duration::from_secs(10));
    assert!(b.stats().listeners.is_empty());
    assert!(matches!(intent(b, 5002), Response::NoChannel { .. }));
}

#[test]
fn a_listener_registered_just_before_listen_survives_the_sweep() {
    let mut n = node("grace", Limits::default());
    let b = &mut n.broker;
    // The library registers before its real listen(): its socket is
    // bound, not listening (nothing listens on the port).
    let port = 30081;
    let addr = SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port);
    // Taken before the registration, so the registration is at most
    // 3 s old at `t0 + 3 s` however long the registering call took.
    let t0 = Instant::now();
    let r = b.handle(&pod(2), Request::RegisterListener { addr });
    assert_eq!(r.response, Response::Ok);
    let registered_by = Instant::now();
    b.tick(t0);
    b.tick(t0 + Duration::from_secs(3));
    assert_eq!(b.stats().listeners.len(), 1, "dropped within its grace");
    // Still not listening after the grace: gone.
    b.tick(registered_by + LISTENER_GRACE + Duration::from_secs(1));
    assert!(b.stats().listeners.is_empty());
}

#[test]
fn listeners_survive_a_restart_and_leave_with_their_pod() {
    let mut n = node("restart", Limits::default());
    n.broker.handle(
        &pod(2),
        Request::RegisterListener {
            addr: sa("10.202.9.2:81"),
        },
    );
    let facts = n.broker.facts.clone();
    let mut again = Broker::new(facts, Limits::default(), Box::new(n.kernel.clone()));
    assert_eq!(again.stats().listeners.len(), 1);
    n.kernel.remove("c2");
    again.handle(&on_node(0, 0), Request::RegistryChanged);
    assert_eq!(again.stats().listeners.len(), 0);
    assert_eq!(again.pod_count(), 2);
    // The peer table lists the pods that are left.
    let mut published = n.kernel.published().unwrap();
    published.sort();
    assert_eq!(
        published,
        [sa("10.202.9.1:0").ip(), sa("10.202.9.3:0").ip()]
    );
}

fn forbidden(r: &Response) -> bool {
    matches!(
        r,
        Response::Error {
            code: ErrorCode::Forbidden,
            ..
        }
    )
}

#[test]
fn node_requests_only_from_the_nodes_administrators() {
    let mut n = node("admin", Limits::default());
    let b = &mut n.broker;
    let ask = |b: &mut Broker, c: &Caller| {
        let st = b.handle(c, Request::Stats).response;
        let poke = b.handle(c, Request::RegistryChanged).response;
        assert_eq!(
            matches!(st, Response::Stats { .. }),
            poke == Response::Ok,
            "{st:?} / {poke:?}"
        );
        assert!(
            matches!(st, Response::Stats { .. }) || forbidden(&st),
            "{st:?}"
        );
        matches!(st, Response::Stats { .. })
    };
    // Root in the daemon's own (or the initial) network namespace.
    assert!(ask(b, &on_node(0, 0)));
    let init = Caller {
        netns: Some(crate::identity::INIT_NETNS_INODE),
        ..on_node(0, 0)
    };
    assert!(ask(b, &init));
    // Another uid of the node, unless in the admin group.
    assert!(!ask(b, &on_node(65534, 65534)));
    b.set_admin_gid(Some(4242));
    assert!(ask(b, &on_node(65534, 4242)));
    assert!(!ask(b, &on_node(65534, 65534)));
    // A supplementary group of the calling process counts too.
    n.kernel.set_groups(ME.pid, vec![24, 27]);
    if let Some(g) = n.kernel.groups_of(ME.pid).unwrap().first() {
        b.set_admin_gid(Some(*g));
        assert!(ask(b, &on_node(65534, u32::MAX - 1)));
    }
    b.set_admin_gid(Some(4242));
    // Root in a namespace of its own making (`unshare -n`): nothing.
    let unshared = Caller {
        netns: Some(777_777),
        ..on_node(0, 0)
    };
    assert!(!ask(b, &unshared));
    let unshared_admin_group = Caller {
        netns: Some(777_777),
        ..on_node(65534, 4242)
    };
    assert!(!ask(b, &unshared_admin_group));
    // A pod, even as root; an unidentified caller.
    assert!(!ask(b, &pod(1)));
    assert!(!ask(b, &Caller::default()));
    let Response::Stats { stats } = b.handle(&on_node(0, 0), Request::Stats).response else {
        panic!()
    };
    // Two refusals (stats, poke) for each of the five refused callers
    // and the one refused twice.
    assert_eq!(stats.auth_failures, 12);
}

/// Channel pod 1 -> pod 2, claimed; returns its id.
fn open_channel(b: &mut Broker, port: u16) -> u64 {
    let listen = sa(&format!("0.0.0.0:{port}"));
    assert_eq!(
        b.handle(&pod(2), Request::RegisterListener { addr: listen })
            .response,
        Response::Ok
    );
    let dst = sa(&format!("10.202.9.2:{port}"));
    let a = b.handle(
        &pod(1),
        Request::ConnectIntent {
            src: sa("10.202.9.1:41000"),
            dst,
            region_len: 8192,
        },
    );
    let Response::Channel { id, .. } = a.response else {
        panic!("{:?}", a.response)
    };
    let c = b.handle(
        &pod(2),
        Request::ClaimAccepted {
            local: dst,
            peer: sa("10.202.9.1:41000"),
        },
    );
    assert!(matches!(c.response, Response::Channel { .. }));
    id
}

fn closed(b: &mut Broker, who: u64, id: u64, sent: u64, received: u64) -> Response {
    b.handle(
        &pod(who),
        Request::ReportClosed {
            channel_id: id,
            sent,
            received,
        },
    )
    .response
}

#[test]
fn close_reports_count_only_from_the_channels_pods_and_within_reason() {
    let mut n = node("report", Limits::default());
    let b = &mut n.broker;
    let id = open_channel(b, 95);
    let bytes = |b: &Broker| b.stats().lanes[SHM_LANE].bytes;
    let before = b.stats();
    // A third pod: refused, nothing recorded.
    assert!(forbidden(&closed(b, 3, id, 1 << 40, 1 << 40)));
    assert_eq!(b.stats().auth_failures, before.auth_failures + 1);
    // The channel's own pod with absurd counts: a bad request.
    for (sent, received) in [(u64::MAX, 0), (0, u64::MAX), (1 << 40, 0)] {
        let r = closed(b, 1, id, sent, received);
        assert!(
            matches!(
                r,
                Response::Error {
                    code: ErrorCode::BadRequest,
                    ..
                }
            ),
            "{r:?}"
        );
    }
    assert_eq!(b.stats().bad_requests, before.bad_requests + 3);
    assert_eq!(bytes(b), 0);
    assert_eq!(b.stats().lanes[SHM_LANE].connections_active, 1);
    // Sane reports from both ends close it.
    assert_eq!(closed(b, 1, id, 1000, 10), Response::Ok);
    assert_eq!(closed(b, 2, id, 10, 1000), Response::Ok);
    assert_eq!(bytes(b), 1010);
    assert_eq!(b.stats().lanes[SHM_LANE].connections_closed, 1);
    assert!(plausible_bytes(100 << 30, Duration::ZERO));
    assert!(!plausible_bytes(1 << 40, Duration::ZERO));
}

#[test]
fn a_successor_counts_a_handed_over_connection_once_per_side_from_its_pods() {
    let mut n = node("inherit", Limits::default());
    let id = open_channel(&mut n.broker, 96);
    // A second connection, the client's end already reported.
    let other = {
        let b = &mut n.broker;
        let a = b.handle(
            &pod(1),
            Request::ConnectIntent {
                src: sa("10.202.9.1:41001"),
                dst: sa("10.202.9.2:96"),
                region_len: 8192,
            },
        );
        let Response::Channel { id, .. } = a.response else {
            panic!()
        };
        b.handle(
            &pod(2),
            Request::ClaimAccepted {
                local: sa("10.202.9.2:96"),
                peer: sa("10.202.9.1:41001"),
            },
        );
        assert_eq!(closed(b, 1, id, 5, 0), Response::Ok);
        id
    };
    n.broker.save_connections();
    // Ids are time-based: the successor's start after this one's ids.
    std::thread::sleep(Duration::from_millis(5));
    let facts = n.broker.facts.clone();
    let kernel = || -> Box<dyn Kernel> { Box::new(n.kernel.clone()) };
    let mut b = Broker::new(facts.clone(), Limits::default(), kernel());
    let bytes = |b: &Broker| b.stats().lanes[SHM_LANE].bytes;
    assert!(forbidden(&closed(&mut b, 3, id, 1 << 30, 0)));
    assert!(matches!(
        closed(&mut b, 1, id, u64::MAX, 0),
        Response::Error {
            code: ErrorCode::BadRequest,
            ..
        }
    ));
    assert_eq!(closed(&mut b, 1, id, 100, 7), Response::Ok);
    assert_eq!(bytes(&b), 100);
    // The same side again: counted once.
    assert_eq!(closed(&mut b, 1, id, 100, 7), Response::Ok);
    assert_eq!(bytes(&b), 100);
    assert_eq!(closed(&mut b, 2, id, 7, 100), Response::Ok);
    assert_eq!(bytes(&b), 107);
    assert_eq!(closed(&mut b, 2, id, 7, 100), Response::Ok);
    assert_eq!(bytes(&b), 107);
    // The other connection's client end reported to the predecessor.
    assert_eq!(closed(&mut b, 1, other, 5, 0), Response::Ok);
    assert_eq!(bytes(&b), 107);
    assert_eq!(closed(&mut b, 2, other, 3, 5), Response::Ok);
    assert_eq!(bytes(&b), 110);
    // Ids nobody handed over (a crashed predecessor's, made up): nothing.
    assert_eq!(closed(&mut b, 1, id - 1000, 1 << 30, 0), Response::Ok);
    assert_eq!(closed(&mut b, 1, 1, 1 << 30, 0), Response::Ok);
    assert_eq!(bytes(&b), 110);
    // The hand-over is taken by one successor only.
    let c = Broker::new(facts, Limits::default(), kernel());
    assert!(c.inherited.is_empty());
}

/// One live pod, its namespace pinned; the others' entries name a
/// namespace that is gone, or none.
#[test]
fn stale_registry_entries_lend_no_identity() {
    let kernel = FakeKernel::default();
    kernel.run(ME);
    let own = NODE_NETNS;
    let live = "/var/run/netns/cni-live".to_string();
    kernel.pin_netns(&live, own);
    kernel.put(entry("live", live.clone(), own, "10.202.8.1"));
    // A crashed runtime's pod: its pinned namespace is gone.
    kernel.put(entry(
        "gone",
        "/var/run/netns/fld-no-such-ns".into(),
        4242,
        "10.202.8.2",
    ));
    // No path recorded: cannot be checked, not trusted.
    kernel.put(entry("nopath", String::new(), 4343, "10.202.8.3"));
    let mut b = broker_on(&kernel, "stale", Limits::default());
    assert_eq!(b.pod_count(), 1, "only the live entry is a pod");
    let as_ns = |netns| Caller {
        netns: Some(netns),
        ..pod(0)
    };
    let listen = |b: &mut Broker, c: &Caller| {
        b.handle(
            c,
            Request::RegisterListener {
                addr: sa("0.0.0.0:97"),
            },
        )
        .response
    };
    let unknown = |r: &Response| {
        matches!(
            r,
            Response::Error {
                code: ErrorCode::UnknownPod,
                ..
            }
        )
    };
    assert!(unknown(&listen(&mut b, &as_ns(4242))));
    assert!(unknown(&listen(&mut b, &as_ns(4343))));
    assert_eq!(listen(&mut b, &as_ns(own)), Response::Ok);
    // The pod dies (its sandbox process; the path goes) and nothing
    // rereads the registry: a namespace with its inode is no one.
    kernel.unpin_netns(&live);
    assert!(unknown(&listen(&mut b, &as_ns(own))));
    let intent = b.handle(
        &as_ns(own),
        Request::ConnectIntent {
            src: sa("10.202.8.1:5000"),
            dst: sa("10.202.8.1:97"),
            region_len: 8192,
        },
    );
    assert!(unknown(&intent.response) && intent.fds.is_empty());
}

#[test]
fn injection_verdicts_are_recorded_for_the_calling_pod_only() {
    let mut n = node("inject", Limits::default());
    let b = &mut n.broker;
    let report = |verdict, containers: &[&str]| Request::ReportInjection {
        verdict,
        libc: "musl".into(),
        reason: "musl cannot load a glibc library".into(),
        containers: containers.iter().map(|c| c.to_string()).collect(),
    };
    // a pod reports about itself; the pod is the caller's, never the request's
    let r = b.handle(
        &pod(2),
        report(flowlane_lane::proto::InjectionVerdict::Tcp, &["tool"]),
    );
    assert!(matches!(r.response, Response::Ok), "{:?}", r.response);
    // not from the node, not from an unknown namespace
    for caller in [on_node(0, 0), pod(99), Caller::default()] {
        let r = b.handle(
            &caller,
            report(flowlane_lane::proto::InjectionVerdict::Lane, &["x"]),
        );
        assert!(
            matches!(
                r.response,
                Response::Error {
                    code: ErrorCode::UnknownPod,
                    ..
                }
            ),
            "{caller:?}: {:?}",
            r.response
        );
    }
    let Response::Stats { stats } = b.handle(&on_node(0, 0), Request::Stats).response else {
        panic!()
    };
    assert_eq!(
        stats.injections,
        vec![flowlane_lane::proto::InjectionInfo {
            pod: "default/pod2".into(),
            containers: vec!["tool".into()],
            verdict: flowlane_lane::proto::InjectionVerdict::Tcp,
            libc: "musl".into(),
            reason: "musl cannot load a glibc library".into(),
        }]
    );
    assert_eq!(stats.requests["report-injection"], 4);
}

/// A relayable intent from pod 1 with source port 0 naming socket `fd`.
fn portless_intent(b: &mut Broker, fd: i32, dst: &str) -> Response {
    b.handle(
        &pod(1),
        Request::RelayableIntent {
            src: sa("0.0.0.0:0"),
            dst: sa(dst),
            region_len: 8192,
            socket_fd: fd,
        },
    )
    .response
}

fn claim(b: &mut Broker, local: &str, peer: &str) -> Response {
    b.handle(
        &pod(2),
        Request::ClaimAccepted {
            local: sa(local),
            peer: sa(peer),
        },
    )
    .response
}

#[test]
fn portless_intents_are_found_by_the_clients_own_socket() {
    let mut n = node("portless", Limits::default());
    let (b, kernel) = (&mut n.broker, &n.kernel);
    let listen = b.handle(
        &pod(2),
        Request::RegisterListener {
            addr: sa("0.0.0.0:80"),
        },
    );
    assert_eq!(listen.response, Response::Ok);
    // Two connections of pod 1 announced before their connects picked
    // their ports, and a third whose socket ends up connected elsewhere.
    let ids: Vec<u64> = [7, 8, 9]
        .into_iter()
        .map(|fd| match portless_intent(b, fd, "10.202.9.2:80") {
            Response::Channel { id, .. } => id,
            other => panic!("{other:?}"),
        })
        .collect();
    kernel.connect_socket(ME, 7, sa("10.202.9.1:40001"), sa("10.202.9.2:80"));
    kernel.connect_socket(ME, 8, sa("10.202.9.1:40002"), sa("10.202.9.2:80"));
    kernel.connect_socket(ME, 9, sa("10.202.9.1:40003"), sa("10.202.9.3:80"));
    // Claimed in another order than announced: each by its own socket.
    let second = claim(b, "10.202.9.2:80", "10.202.9.1:40002");
    assert_eq!(
        second,
        Response::Channel {
            id: ids[1],
            len: 8192
        }
    );
    let first = claim(b, "10.202.9.2:80", "10.202.9.1:40001");
    assert_eq!(
        first,
        Response::Channel {
            id: ids[0],
            len: 8192
        }
    );
    // Each socket was read once: the first claim learned both ports, and
    // the second found its intent under its port without reading any.
    assert_eq!(kernel.socket_reads(ME, 7), 1);
    assert_eq!(kernel.socket_reads(ME, 8), 1);
    assert_eq!(kernel.socket_reads(ME, 9), 1);
    // The connection's client address is its socket's, not port 0.
    let clients: Vec<SocketAddr> = b
        .stats()
        .connections
        .iter()
        .map(|c| c.client.addr)
        .collect();
    assert!(clients.contains(&sa("10.202.9.1:40001")), "{clients:?}");
    assert!(clients.contains(&sa("10.202.9.1:40002")), "{clients:?}");
    // No socket of pod 1 is bound to this port: nothing to claim.
    assert!(matches!(
        claim(b, "10.202.9.2:80", "10.202.9.1:40009"),
        Response::NoChannel { .. }
    ));
    // The socket bound to :40003 is connected to another server: its
    // intent is not this connection's.
    assert!(matches!(
        claim(b, "10.202.9.2:80", "10.202.9.1:40003"),
        Response::NoChannel { .. }
    ));
    assert_eq!(b.stats().lanes[SHM_LANE].connections_active, 2);
    // Without a socket, port 0 stays a bad request.
    let classic = b.handle(
        &pod(1),
        Request::ConnectIntent {
            src: sa("0.0.0.0:0"),
            dst: sa("10.202.9.2:80"),
            region_len: 8192,
        },
    );
    assert!(matches!(
        classic.response,
        Response::Error {
            code: ErrorCode::BadRequest,
            ..
        }
    ));
}

#[test]
fn a_portless_intent_is_not_claimed_from_another_pods_address() {
    let mut n = node("portless-foreign", Limits::default());
    let (b, kernel) = (&mut n.broker, &n.kernel);
    b.handle(
        &pod(2),
        Request::RegisterListener {
            addr: sa("0.0.0.0:80"),
        },
    );
    let Response::Channel { .. } = portless_intent(b, 7, "10.202.9.2:80") else {
        panic!("no channel")
    };
    // Pod 1's socket claims pod 3's address (it cannot in a real kernel;
    // the broker must not rely on that): a connection from pod 3 does not
    // get pod 1's channel.
    kernel.connect_socket(ME, 7, sa("10.202.9.3:40001"), sa("10.202.9.2:80"));
    assert!(matches!(
        claim(b, "10.202.9.2:80", "10.202.9.3:40001"),
        Response::NoChannel { .. }
    ));
}

#[test]
fn a_portless_intent_naming_no_socket_is_dropped_at_its_first_read() {
    let mut n = node("portless-bogus", Limits::default());
    let (b, kernel) = (&mut n.broker, &n.kernel);
    b.handle(
        &pod(2),
        Request::RegisterListener {
            addr: sa("0.0.0.0:80"),
        },
    );
    // fd 99 is no socket of the client (the fake kernel answers EBADF).
    let Response::Channel { .. } = portless_intent(b, 99, "10.202.9.2:80") else {
        panic!("no channel")
    };
    for _ in 0..3 {
        assert!(matches!(
            claim(b, "10.202.9.2:80", "10.202.9.1:40001"),
            Response::NoChannel { .. }
        ));
    }
    assert_eq!(kernel.socket_reads(ME, 99), 1, "read again after it failed");
    assert_eq!(b.stats().lanes[SHM_LANE].channels_pending, 0);
}
