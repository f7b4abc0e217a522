//! Connections to Service IPs (`service.rs`), against a conntrack double
//! (the real table: tests/e2e/shm/service_ips.rs).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::tests::{node, pod, sa};
use super::*;
use crate::conntrack::{Conntrack, Mapping};
use flowlane_lane::peer_table::Entry;
use flowlane_lane::proto::NoChannelReason;

/// Entries by original (src, dst); shared with the test.
#[derive(Clone, Default)]
struct Table(Arc<Mutex<HashMap<(SocketAddr, SocketAddr), Mapping>>>);

impl Table {
    /// kube-proxy sent `client` → `service` to `backend` (no SNAT).
    fn dnat(&self, client: &str, service: &str, backend: &str) {
        let m = Mapping {
            reply_src: sa(backend),
            reply_dst: sa(client),
        };
        self.0.lock().unwrap().insert((sa(client), sa(service)), m);
    }
}

impl Conntrack for Table {
    fn lookup(&mut self, src: SocketAddr, dst: SocketAddr) -> std::io::Result<Option<Mapping>> {
        Ok(self.0.lock().unwrap().get(&(src, dst)).copied())
    }

    fn original_of(
        &mut self,
        reply_src: SocketAddr,
        reply_dst: SocketAddr,
    ) -> std::io::Result<Option<(SocketAddr, SocketAddr)>> {
        let t = self.0.lock().unwrap();
        Ok(t.iter()
            .find(|(_, m)| (m.reply_src, m.reply_dst) == (reply_src, reply_dst))
            .map(|(orig, _)| *orig))
    }
}

const SVC: &str = "10.96.212.10:80";
const CLIENT: &str = "10.202.9.1:40000";

/// A broker serving 10.96.212.0/24, pod 2 listening on 8080.
fn service_node(name: &str) -> (super::tests::Node, Table) {
    let mut n = node(name, Limits::default());
    let table = Table::default();
    n.broker
        .set_services(vec![Entry::new(sa(SVC).ip(), 24)], Box::new(table.clone()));
    let r = n.broker.handle(
        &pod(2),
        Request::RegisterListener {
            addr: sa("0.0.0.0:8080"),
        },
    );
    assert_eq!(r.response, Response::Ok);
    (n, table)
}

fn intent(b: &mut Broker, who: u64, src: &str, dst: &str) -> Answer {
    b.handle(
        &pod(who),
        Request::ServiceIntent {
            src: sa(src),
            dst: sa(dst),
            region_len: 8192,
        },
    )
}

fn channel(a: &Answer) -> u64 {
    match a.response {
        Response::Channel { id, .. } => id,
        ref other => panic!("{other:?}"),
    }
}

fn resolve(b: &mut Broker, who: u64, id: u64) -> Response {
    b.handle(
        &pod(who),
        Request::ResolveService {
            channel_id: id,
            socket_fd: None,
        },
    )
    .response
}

fn claim(b: &mut Broker, who: u64, local: &str, peer: &str) -> Answer {
    b.handle(
        &pod(who),
        Request::ClaimAccepted {
            local: sa(local),
            peer: sa(peer),
        },
    )
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

fn no_channel(r: &Response, why: NoChannelReason) -> bool {
    *r == Response::NoChannel { reason: why }
}

fn same_file(a: &OwnedFd, b: &OwnedFd) -> bool {
    use std::os::unix::fs::MetadataExt;
    let ino = |fd: &OwnedFd| {
        let m = std::fs::File::from(fd.try_clone().unwrap())
            .metadata()
            .unwrap();
        (m.dev(), m.ino())
    };
    ino(a) == ino(b)
}

#[test]
fn a_service_connection_pairs_with_the_backend_conntrack_names() {
    let (mut n, ct) = service_node("svc-pair");
    let b = &mut n.broker;
    let a = intent(b, 1, CLIENT, SVC);
    let id = channel(&a);
    ct.dnat(CLIENT, SVC, "10.202.9.2:8080");
    assert_eq!(resolve(b, 1, id), Response::Ok);
    // Another pod cannot resolve (or learn about) the client's channel.
    assert!(forbidden(&resolve(b, 3, id)));
    // Pod 3, which the connection did not reach, cannot claim it, even
    // naming the right peer on its own address.
    assert!(forbidden(&claim(b, 3, "10.202.9.3:8080", CLIENT).response));
    // Nor can pod 2 on another port than conntrack's.
    assert!(forbidden(&claim(b, 2, "10.202.9.2:8081", CLIENT).response));
    let s = claim(b, 2, "10.202.9.2:8080", CLIENT);
    assert_eq!(channel(&s), id);
    assert!(same_file(a.fds.first().unwrap(), s.fds.first().unwrap()));
    let st = b.stats();
    assert_eq!(st.lanes["shm"].connections_opened, 1);
    assert_eq!(st.connections[0].server.addr, sa("10.202.9.2:8080"));
    // Resolving a claimed channel still says "lane".
    assert_eq!(resolve(b, 1, id), Response::Ok);
}

#[test]
fn the_backends_claim_may_come_before_the_clients_resolve() {
    let (mut n, ct) = service_node("svc-early");
    let b = &mut n.broker;
    let id = channel(&intent(b, 1, CLIENT, SVC));
    ct.dnat(CLIENT, SVC, "10.202.9.2:8080");
    assert_eq!(channel(&claim(b, 2, "10.202.9.2:8080", CLIENT)), id);
    assert_eq!(resolve(b, 1, id), Response::Ok);
}

#[test]
fn anything_but_a_local_lane_backend_is_tcp_at_once() {
    let (mut n, ct) = service_node("svc-tcp");
    let b = &mut n.broker;
    let cases = [
        // Backend pod without a flowlane listener on that port.
        (
            "10.202.9.1:40001",
            Some("10.202.9.3:8080"),
            NoChannelReason::NoListener,
            "no-listener",
        ),
        // Backend on another node.
        (
            "10.202.9.1:40002",
            Some("10.212.77.5:8080"),
            NoChannelReason::NotLocalPod,
            "not-local-pod",
        ),
        // No conntrack entry (yet).
        (
            "10.202.9.1:40003",
            None,
            NoChannelReason::Unresolved,
            "service-unresolved",
        ),
    ];
    for (client, backend, why, counter) in cases {
        let before = b.stats().fallbacks.get(counter).copied().unwrap_or(0);
        let id = channel(&intent(b, 1, client, SVC));
        if let Some(backend) = backend {
            ct.dnat(client, SVC, backend);
        }
        assert!(no_channel(&resolve(b, 1, id), why), "{client}");
        assert_eq!(b.stats().fallbacks[counter], before + 1, "{client}");
        // The channel is gone: a later claim finds nothing.
        if let Some(backend) = backend {
            let local = backend;
            let r = claim(b, 3, local, client).response;
            assert!(
                no_channel(&r, NoChannelReason::NoIntent) || forbidden(&r),
                "{r:?}"
            );
        }
    }
    assert_eq!(b.stats().lanes["shm"].channels_pending, 0);
    // Source-NATed too (a pod reaching itself through its Service): the
    // backend would see another peer.
    let client = "10.202.9.2:40004";
    let id = channel(&intent(b, 2, client, SVC));
    ct.0.lock().unwrap().insert(
        (sa(client), sa(SVC)),
        Mapping {
            reply_src: sa("10.202.9.2:8080"),
            reply_dst: sa("10.202.9.254:61000"),
        },
    );
    assert!(no_channel(&resolve(b, 2, id), NoChannelReason::Unresolved));
}

#[test]
fn service_intents_only_for_service_ips_from_their_own_address() {
    let (mut n, _ct) = service_node("svc-admit");
    let b = &mut n.broker;
    // Not a Service IP.
    assert!(no_channel(
        &intent(b, 1, CLIENT, "10.97.0.1:80").response,
        NoChannelReason::NotLocalPod
    ));
    // Another pod's source address: a pod cannot place (or replace) a
    // channel under another pod's key.
    let id = channel(&intent(b, 1, CLIENT, SVC));
    assert!(forbidden(&intent(b, 3, CLIENT, SVC).response));
    // Nor cancel it.
    let r = b
        .handle(&pod(3), Request::CancelIntent { channel_id: id })
        .response;
    assert!(forbidden(&r));
    assert_eq!(b.stats().lanes["shm"].channels_pending, 1);
    // A direct intent's resolve is a bad request.
    let r = b.handle(
        &pod(1),
        Request::ConnectIntent {
            src: sa("10.202.9.1:40009"),
            dst: sa("10.202.9.2:8080"),
            region_len: 8192,
        },
    );
    let direct = channel(&r);
    assert!(matches!(
        resolve(b, 1, direct),
        Response::Error {
            code: ErrorCode::BadRequest,
            ..
        }
    ));
}

#[test]
fn without_any_flowlane_listener_no_channel_is_made() {
    let mut n = node("svc-none", Limits::default());
    n.broker.set_services(
        vec![Entry::new(sa(SVC).ip(), 24)],
        Box::new(Table::default()),
    );
    assert!(no_channel(
        &intent(&mut n.broker, 1, CLIENT, SVC).response,
        NoChannelReason::NoListener
    ));
}

#[test]
fn a_source_port_remapped_by_nat_still_pairs_with_its_own_backend_only() {
    let (mut n, ct) = service_node("svc-remap");
    let b = &mut n.broker;
    // A Service connection from CLIENT whose source port the node's NAT
    // remapped to 40100 (an earlier entry held the plain reply tuple).
    let id = channel(&intent(b, 1, CLIENT, SVC));
    ct.0.lock().unwrap().insert(
        (sa(CLIENT), sa(SVC)),
        Mapping {
            reply_src: sa("10.202.9.2:8080"),
            reply_dst: sa("10.202.9.1:40100"),
        },
    );
    assert_eq!(resolve(b, 1, id), Response::Ok);
    // Another pod cannot claim it under the remapped port either.
    assert!(!matches!(
        claim(b, 3, "10.202.9.3:8080", "10.202.9.1:40100").response,
        Response::Channel { .. }
    ));
    assert_eq!(
        channel(&claim(b, 2, "10.202.9.2:8080", "10.202.9.1:40100")),
        id
    );
    // A direct connection remapped the same way.
    let direct = "10.202.9.1:40001";
    let r = b.handle(
        &pod(1),
        Request::ConnectIntent {
            src: sa(direct),
            dst: sa("10.202.9.2:8080"),
            region_len: 8192,
        },
    );
    let id = channel(&r);
    ct.0.lock().unwrap().insert(
        (sa(direct), sa("10.202.9.2:8080")),
        Mapping {
            reply_src: sa("10.202.9.2:8080"),
            reply_dst: sa("10.202.9.1:40101"),
        },
    );
    assert_eq!(
        channel(&claim(b, 2, "10.202.9.2:8080", "10.202.9.1:40101")),
        id
    );
    assert_eq!(b.stats().lanes["shm"].connections_opened, 2);
}

#[test]
fn a_backend_on_a_node_the_relay_reaches_goes_to_the_relay() {
    let (mut n, ct) = service_node("svc-remote");
    let b = &mut n.broker;
    let far = "10.212.77.5:8080";
    let remote = |ip: std::net::IpAddr| ip == sa(far).ip();
    assert!(!b.has_pending_service_from(sa(CLIENT)));
    let a = intent(b, 1, CLIENT, SVC);
    let id = channel(&a);
    // A peer daemon asking about this client is told a stream may come.
    assert!(b.has_pending_service_from(sa(CLIENT)));
    assert!(!b.has_pending_service_from(sa("10.202.9.1:40001")));
    ct.dnat(CLIENT, SVC, far);
    // Only the announcing pod may resolve it, relay or not.
    assert!(matches!(
        b.resolve_service_with(&pod(3), id, &remote),
        Resolved::Answer(Answer { ref response, .. }) if forbidden(response)
    ));
    let Resolved::Remote(r) = b.resolve_service_with(&pod(1), id, &remote) else {
        panic!("not handed to the relay");
    };
    assert_eq!(
        (r.id, r.src, r.backend, r.client_pod),
        (id, sa(CLIENT), sa(far), 1)
    );
    assert_eq!(r.len, 8192);
    assert_eq!(r.memfd_name, format!("flowlane-ch-{id}"));
    assert!(same_file(a.fds.first().unwrap(), &r.memfd));
    // Out of the broker, no fallback counted (the relay counts its own).
    let st = b.stats();
    assert_eq!(st.lanes["shm"].channels_pending, 0);
    assert!(st.fallbacks.values().all(|&v| v == 0), "{:?}", st.fallbacks);
    assert!(!b.is_pending_service(id));
    // From here the relay answers for it (`relay/service.rs`).
    assert!(!b.has_pending_service_from(sa(CLIENT)));
    // A backend on a node the relay does not reach: TCP at once.
    let client = "10.202.9.1:40005";
    let id = channel(&intent(b, 1, client, SVC));
    assert!(b.is_pending_service(id));
    ct.dnat(client, SVC, "10.212.78.5:8080");
    assert!(matches!(
        b.resolve_service_with(&pod(1), id, &remote),
        Resolved::Answer(Answer { ref response, .. })
            if no_channel(response, NoChannelReason::NotLocalPod)
    ));
    assert!(!b.has_pending_service_from(sa(client)));
}

#[test]
fn with_the_relay_a_service_intent_needs_no_local_listener() {
    let mut n = node("svc-relay-none", Limits::default());
    n.broker.set_services(
        vec![Entry::new(sa(SVC).ip(), 24)],
        Box::new(Table::default()),
    );
    n.broker.set_remote_service_backends();
    let id = channel(&intent(&mut n.broker, 1, CLIENT, SVC));
    assert!(n.broker.is_pending_service(id));
    assert!(n.broker.serves_services());
}
