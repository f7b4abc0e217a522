//! Stock (`stock.rs`) on the fake kernel: who gets stock and how much, the
//! grants of a claim, `stock-taken`, close reports that overtake it,
//! expiry, the pod's budget, and answers that could not be sent.

use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;

use flowlane_lane::proto::{ChannelGrant, StockGrant, MAX_STOCK_GRANTS};

use super::tests::{node, pod, sa, Node};
use super::*;

/// Pods 1 to 3 (`tests::node`); a server process of pod 2 listening on
/// `0.0.0.0:80` and `0.0.0.0:81`, and a client process of pod 1.
struct Stocked {
    n: Node,
    client: Caller,
    server: Caller,
}

fn stocked_node(name: &str, limits: Limits) -> Stocked {
    let n = node(name, limits);
    let client = Caller {
        process: Some(n.kernel.start_process()),
        ..pod(1)
    };
    let server = Caller {
        process: Some(n.kernel.start_process()),
        ..pod(2)
    };
    let mut s = Stocked { n, client, server };
    for port in [80, 81] {
        s.n.kernel.listen(port);
        let addr = sa(&format!("0.0.0.0:{port}"));
        let r =
            s.n.broker
                .handle(&server, Request::RegisterListener { addr });
        assert_eq!(r.response, Response::Ok);
    }
    s
}

/// `taking_stock`, whose pods may each hold `max_pending` channels.
fn budgeted(name: &str, max_pending: usize) -> Stocked {
    let limits = Limits {
        max_pending_per_pod: max_pending,
        ..Limits::default()
    };
    taking_stock(name, limits)
}

/// A node with a listener on port 80 that takes stock.
fn taking_stock(name: &str, limits: Limits) -> Stocked {
    let mut s = stocked_node(name, limits);
    takes_stock(&mut s.n.broker, &s.server, "10.202.9.2:80");
    s
}

/// Another process of pod `i`.
fn process_of(n: &Node, i: u64) -> Caller {
    Caller {
        process: Some(n.kernel.start_process()),
        ..pod(i)
    }
}

fn stock_intent(b: &mut Broker, who: &Caller, src: &str, dst: &str, want: u32) -> Answer {
    b.handle(
        who,
        Request::StockIntent {
            src: sa(src),
            dst: sa(dst),
            region_len: 12288,
            socket_fd: 3,
            want,
        },
    )
}

fn stock_claim(b: &mut Broker, who: &Caller, local: &str, peer: &str) -> Answer {
    b.handle(
        who,
        Request::StockClaim {
            local: sa(local),
            peer: sa(peer),
            socket_fd: 4,
        },
    )
}

fn taken(b: &mut Broker, who: &Caller, id: u64, local: &str, peer: &str) {
    let req = Request::StockTaken {
        channel_id: id,
        local: sa(local),
        peer: sa(peer),
    };
    // One way: the answer is never sent.
    drop(b.handle(who, req));
}

fn report(b: &mut Broker, who: &Caller, id: u64, sent: u64, received: u64) -> Response {
    let req = Request::ReportClosedOneWay {
        channel_id: id,
        sent,
        received,
    };
    b.handle(who, req).response
}

/// The server shows that it looks at stock: a stock claim for `local`
/// (finding no channel).
fn takes_stock(b: &mut Broker, server: &Caller, local: &str) {
    let a = stock_claim(b, server, local, "10.202.9.1:1");
    assert!(
        matches!(a.response, Response::NoChannel { .. }),
        "{:?}",
        a.response
    );
}

/// The stock an answer grants (checked against its fds).
fn grants(a: &Answer) -> Vec<StockGrant> {
    match &a.response {
        Response::Stocked { channel, stock } => {
            assert_eq!(a.fds.len(), usize::from(channel.is_some()) + stock.len());
            stock.clone()
        }
        _ => Vec::new(),
    }
}

fn ids(g: &[StockGrant]) -> Vec<u64> {
    g.iter().map(|g| g.id).collect()
}

fn ino(fd: &OwnedFd) -> u64 {
    std::fs::File::from(fd.try_clone().unwrap())
        .metadata()
        .unwrap()
        .ino()
}

fn stats(b: &Broker) -> LaneStats {
    b.stats().lanes[SHM_LANE].clone()
}

use flowlane_lane::proto::LaneStats;

#[test]
fn only_a_listener_whose_server_claimed_with_stock_gets_stock() {
    let Stocked {
        mut n,
        client,
        server,
    } = stocked_node("stock-takes", Limits::default());
    let b = &mut n.broker;
    // Nobody showed that it looks at stock: the relayable intent's answer.
    let a = stock_intent(b, &client, "10.202.9.1:40000", "10.202.9.2:80", 4);
    assert!(
        matches!(a.response, Response::Channel { .. }),
        "{:?}",
        a.response
    );
    assert_eq!(a.fds.len(), 1);
    takes_stock(b, &server, "10.202.9.2:80");
    let a = stock_intent(b, &client, "10.202.9.1:40001", "10.202.9.2:80", 4);
    let Response::Stocked {
        channel: Some(ChannelGrant { id, len: 12288 }),
        ref stock,
    } = a.response
    else {
        panic!("{:?}", a.response)
    };
    assert_eq!(stock.len(), 4);
    assert_eq!(a.fds.len(), 5);
    for g in stock {
        assert_eq!((g.len, g.client), (12288, sa("10.202.9.1:0").ip()));
        assert!(g.id != id);
    }
    // The channel's fd first: the pending channel's region.
    let channel_ino = ino(&a.fds[0]);
    assert!(a.fds[1..].iter().all(|fd| ino(fd) != channel_ino));
    assert_eq!(stats(b).channels_stocked, 4);
    assert_eq!(stats(b).channels_pending, 2);
    // The client's view of one of its stock channels.
    let client_view = flowlane_lane::region::Region::map_memfd(a.fds[1].as_fd(), 12288).unwrap();
    assert_eq!(client_view.offer(), flowlane_lane::offer::Offer::Free);
    // Another listener of the same server has not shown it.
    let a = stock_intent(b, &client, "10.202.9.1:40002", "10.202.9.2:81", 4);
    assert!(
        matches!(a.response, Response::Channel { .. }),
        "{:?}",
        a.response
    );
    // A listener that goes and comes back (another server now) must show
    // it again.
    for req in [
        Request::UnregisterListener {
            addr: sa("0.0.0.0:80"),
        },
        Request::RegisterListener {
            addr: sa("0.0.0.0:80"),
        },
    ] {
        assert_eq!(b.handle(&server, req).response, Response::Ok);
    }
    let a = stock_intent(b, &client, "10.202.9.1:40003", "10.202.9.2:80", 4);
    assert!(
        matches!(a.response, Response::Channel { .. }),
        "{:?}",
        a.response
    );
    // No channel (no listener at all): no stock either.
    let a = stock_intent(b, &client, "10.202.9.1:40004", "10.202.9.2:82", 4);
    assert!(
        matches!(a.response, Response::NoChannel { .. }),
        "{:?}",
        a.response
    );
    // The listener that went took its stock with it, revoked in the
    // offer word: the client asks again instead of offering it.
    assert_eq!(stats(b).channels_stocked, 0);
    assert_eq!(client_view.offer(), flowlane_lane::offer::Offer::Dead);
    assert!(!client_view.offer_begin());
}

#[test]
fn a_portless_stock_intent_grants_for_the_pods_address_facing_the_destination() {
    let Stocked {
        mut n,
        client,
        server,
    } = stocked_node("stock-portless", Limits::default());
    let b = &mut n.broker;
    takes_stock(b, &server, "10.202.9.2:80");
    let a = stock_intent(b, &client, "0.0.0.0:0", "10.202.9.2:80", 2);
    let g = grants(&a);
    assert_eq!(g.len(), 2, "{:?}", a.response);
    assert!(g.iter().all(|g| g.client == sa("10.202.9.1:0").ip()));
}

#[test]
fn want_is_clamped_and_a_client_process_holds_a_bounded_stock_per_destination() {
    let Stocked {
        mut n,
        client,
        server,
    } = taking_stock("stock-bounds", Limits::default());
    takes_stock(&mut n.broker, &server, "10.202.9.2:81");
    let other = process_of(&n, 1);
    let b = &mut n.broker;
    let a = stock_intent(b, &client, "10.202.9.1:40000", "10.202.9.2:80", 10);
    assert_eq!(grants(&a).len(), 10);
    // Fewer, to fit the pair's bound; then none (the relayable answer).
    let a = stock_intent(b, &client, "10.202.9.1:40001", "10.202.9.2:80", 10);
    assert_eq!(grants(&a).len(), MAX_STOCK_GRANTS - 10);
    let a = stock_intent(b, &client, "10.202.9.1:40002", "10.202.9.2:80", 10);
    assert!(
        matches!(a.response, Response::Channel { .. }),
        "{:?}",
        a.response
    );
    // The bound is per client process and destination.
    let a = stock_intent(b, &client, "10.202.9.1:40003", "10.202.9.2:81", 3);
    assert_eq!(grants(&a).len(), 3);
    let a = stock_intent(b, &other, "10.202.9.1:40004", "10.202.9.2:80", u32::MAX);
    assert_eq!(grants(&a).len(), MAX_STOCK_GRANTS);
    assert_eq!(
        stats(b).channels_stocked,
        (MAX_STOCK_GRANTS + 3 + MAX_STOCK_GRANTS) as u64
    );
    // want 0: none.
    let third = process_of(&n, 1);
    let a = stock_intent(
        &mut n.broker,
        &third,
        "10.202.9.1:40005",
        "10.202.9.2:80",
        0,
    );
    assert!(
        matches!(a.response, Response::Channel { .. }),
        "{:?}",
        a.response
    );
}

#[test]
fn a_claim_grants_each_stock_channel_once_per_process_the_peers_pod_first() {
    let Stocked {
        mut n,
        client,
        server,
    } = taking_stock("stock-claim", Limits::default());
    let from_pod3 = process_of(&n, 3);
    let worker = process_of(&n, 2);
    let b = &mut n.broker;
    let fallbacks = |b: &Broker| {
        b.stats()
            .fallbacks
            .get("claim-without-intent")
            .copied()
            .unwrap_or(0)
    };
    let without_intent = fallbacks(b);
    // Pod 3's stock is older (lower ids) than pod 1's.
    let a3 = stock_intent(b, &from_pod3, "10.202.9.3:40000", "10.202.9.2:80", 2);
    let a1 = stock_intent(b, &client, "10.202.9.1:40000", "10.202.9.2:80", 2);
    let (g3, g1) = (grants(&a3), grants(&a1));
    assert_eq!((g3.len(), g1.len()), (2, 2));
    // The stock made for port 81 is not this listener's.
    takes_stock(b, &server, "10.202.9.2:81");
    let a81 = stock_intent(b, &client, "10.202.9.1:40001", "10.202.9.2:81", 2);
    assert_eq!(grants(&a81).len(), 2);
    let without_intent = without_intent + 1;
    // A connection from pod 1 that nobody announced (it used stock the
    // server does not hold yet): no channel, the stock granted, pod 1's
    // first; not a connection left on TCP.
    let c = stock_claim(b, &server, "10.202.9.2:80", "10.202.9.1:50000");
    let Response::Stocked {
        channel: None,
        ref stock,
    } = c.response
    else {
        panic!("{:?}", c.response)
    };
    assert_eq!(ids(stock), [ids(&g1), ids(&g3)].concat());
    assert_eq!(c.fds.len(), 4);
    assert_eq!(fallbacks(b), without_intent);
    // The server's grant is the client's region.
    assert_eq!(ino(&c.fds[0]), ino(&a1.fds[1]));
    assert_eq!(ino(&c.fds[2]), ino(&a3.fds[1]));
    // Granted once per process: the same process gets nothing more (and
    // that claim is one without intent), another process of the pod all.
    let again = stock_claim(b, &server, "10.202.9.2:80", "10.202.9.1:50001");
    assert!(matches!(again.response, Response::NoChannel { .. }));
    assert_eq!(fallbacks(b), without_intent + 1);
    let w = stock_claim(b, &worker, "10.202.9.2:80", "10.202.9.3:50000");
    assert_eq!(ids(&grants(&w)), [ids(&g3), ids(&g1)].concat());
    // A claim that finds its channel carries it first, then the new stock.
    let a = stock_intent(b, &client, "10.202.9.1:40002", "10.202.9.2:80", 1);
    let Response::Stocked {
        channel: Some(ChannelGrant { id, .. }),
        ..
    } = a.response
    else {
        panic!("{:?}", a.response)
    };
    let fresh = grants(&a);
    let c = stock_claim(b, &server, "10.202.9.2:80", "10.202.9.1:40002");
    assert_eq!(
        c.response,
        Response::Stocked {
            channel: Some(ChannelGrant { id, len: 12288 }),
            stock: fresh,
        }
    );
    assert_eq!(ino(&c.fds[0]), ino(&a.fds[0]));
    assert_eq!(ino(&c.fds[1]), ino(&a.fds[1]));
    assert_eq!(stats(b).connections_opened, 1);
}

#[test]
fn a_claim_grants_at_most_a_batch() {
    let Stocked {
        mut n,
        client,
        server,
    } = taking_stock("stock-batch", Limits::default());
    let other = process_of(&n, 1);
    let b = &mut n.broker;
    for (who, port) in [(&client, 40000), (&other, 40001)] {
        let src = format!("10.202.9.1:{port}");
        let a = stock_intent(b, who, &src, "10.202.9.2:80", u32::MAX);
        assert_eq!(grants(&a).len(), MAX_STOCK_GRANTS);
    }
    let first = grants(&stock_claim(b, &server, "10.202.9.2:80", "10.202.9.1:1"));
    let second = grants(&stock_claim(b, &server, "10.202.9.2:80", "10.202.9.1:1"));
    assert_eq!(
        (first.len(), second.len()),
        (MAX_STOCK_GRANTS, MAX_STOCK_GRANTS)
    );
    assert!(first.iter().all(|g| !second.contains(g)));
}

#[test]
fn stock_taken_opens_the_connection_once_and_only_for_its_listener_and_client() {
    let Stocked {
        mut n,
        client,
        server: _,
    } = taking_stock("stock-taken", Limits::default());
    let worker = process_of(&n, 2);
    let third = process_of(&n, 3);
    let b = &mut n.broker;
    let a = stock_intent(b, &client, "10.202.9.1:40000", "10.202.9.2:80", 2);
    let id = grants(&a)[0].id;
    let auth = |b: &Broker| b.stats().auth_failures;
    let before = auth(b);
    // Another pod; another listener of the server's pod; a peer address
    // the client's pod does not own; an id that is no stock.
    taken(b, &third, id, "10.202.9.2:80", "10.202.9.1:5000");
    taken(b, &worker, id, "10.202.9.2:81", "10.202.9.1:5000");
    taken(b, &worker, id, "10.202.9.2:80", "10.202.9.3:5000");
    taken(b, &worker, id + 100, "10.202.9.2:80", "10.202.9.1:5000");
    assert_eq!(auth(b), before + 4);
    let st = stats(b);
    assert_eq!((st.connections_opened, st.channels_stocked), (0, 2));
    // Its server (a worker that did not register the listener), in any
    // address form.
    taken(b, &worker, id, "[::ffff:10.202.9.2]:80", "10.202.9.1:5000");
    let st = stats(b);
    assert_eq!(
        (
            st.connections_opened,
            st.connections_active,
            st.channels_stocked
        ),
        (1, 1, 1)
    );
    assert_eq!(auth(b), before + 4);
    let conn = &b.stats().connections[0];
    assert_eq!(
        (conn.id, conn.client.addr, conn.server.addr),
        (id, sa("10.202.9.1:5000"), sa("10.202.9.2:80"))
    );
    // The worker accepts on the listener: it keeps it alive.
    let listener = b.stats().listeners;
    let l = listener
        .iter()
        .find(|l| l.addr == sa("0.0.0.0:80"))
        .unwrap();
    assert_eq!(l.processes, 2);
    // Once: a second `stock-taken` of its server opens nothing.
    taken(b, &worker, id, "10.202.9.2:80", "10.202.9.1:5000");
    assert_eq!(auth(b), before + 4);
    assert_eq!(stats(b).connections_opened, 1);
    // Both ends report: closed as a claimed connection is.
    assert_eq!(report(b, &client, id, 30, 4), Response::Ok);
    assert_eq!(report(b, &worker, id, 4, 30), Response::Ok);
    let st = stats(b);
    assert_eq!(
        (st.connections_active, st.connections_closed, st.bytes),
        (0, 1, 34)
    );
}

#[test]
fn a_close_report_before_or_after_stock_taken_ends_with_one_connection() {
    for client_first in [false, true] {
        let Stocked {
            mut n,
            client,
            server,
        } = taking_stock("stock-race", Limits::default());
        let third = process_of(&n, 3);
        let b = &mut n.broker;
        let a = stock_intent(b, &client, "10.202.9.1:40000", "10.202.9.2:80", 1);
        let id = grants(&a)[0].id;
        // A report from a pod that is not the stock's client opens nothing.
        report(b, &third, id, 1, 1);
        report(b, &server, id, 1, 1);
        assert_eq!(stats(b).channels_stocked, 1);
        if client_first {
            assert_eq!(report(b, &client, id, 100, 7), Response::Ok);
            let st = stats(b);
            assert_eq!((st.connections_opened, st.channels_stocked), (1, 0));
        }
        taken(b, &server, id, "10.202.9.2:80", "10.202.9.1:5000");
        let st = b.stats();
        assert_eq!(
            st.connections[0].client.addr,
            sa("10.202.9.1:5000"),
            "{client_first}"
        );
        if !client_first {
            assert_eq!(report(b, &client, id, 100, 7), Response::Ok);
        }
        assert_eq!(report(b, &server, id, 7, 100), Response::Ok);
        let st = stats(b);
        assert_eq!(
            (
                st.connections_opened,
                st.connections_active,
                st.connections_closed,
                st.bytes
            ),
            (1, 0, 1, 107),
            "client first: {client_first}"
        );
        assert_eq!(b.stats().auth_failures, 0, "client first: {client_first}");
    }
}

#[test]
fn stock_expires_and_goes_with_its_client_process() {
    let limits = Limits {
        stock_ttl: Duration::from_secs(60),
        intent_ttl: Duration::from_secs(30),
        ..Limits::default()
    };
    let Stocked {
        mut n,
        client,
        server,
    } = stocked_node("stock-expiry", limits);
    takes_stock(&mut n.broker, &server, "10.202.9.2:80");
    let other = process_of(&n, 1);
    let t0 = Instant::now();
    let b = &mut n.broker;
    stock_intent(b, &client, "10.202.9.1:40000", "10.202.9.2:80", 2);
    let kept = grants(&stock_intent(
        b,
        &other,
        "10.202.9.1:40001",
        "10.202.9.2:80",
        3,
    ));
    b.tick(t0);
    assert_eq!(stats(b).channels_stocked, 5);
    // A close report opens one of `other`'s; its server never says it
    // took it.
    report(b, &other, kept[0].id, 1, 0);
    assert_eq!(stats(b).connections_active, 1);
    // A client process that exits takes its stock with it (at the sweep).
    n.kernel.exit(client.process.unwrap());
    let b = &mut n.broker;
    b.tick(t0 + Duration::from_secs(3));
    let st = stats(b);
    assert_eq!((st.channels_stocked, st.connections_active), (2, 1));
    let c = stock_claim(b, &server, "10.202.9.2:80", "10.202.9.1:1");
    assert_eq!(ids(&grants(&c)), ids(&kept[1..]));
    // The early connection is closed once a claim's time has passed.
    b.tick(t0 + Duration::from_secs(31));
    let st = stats(b);
    assert_eq!(
        (
            st.connections_active,
            st.connections_closed,
            st.channels_stocked
        ),
        (0, 1, 2)
    );
    // The stock lives its TTL, not a moment more.
    b.tick(t0 + Duration::from_secs(59));
    assert_eq!(stats(b).channels_stocked, 2);
    b.tick(Instant::now() + Duration::from_secs(60));
    assert_eq!(stats(b).channels_stocked, 0);
}

#[test]
fn a_pods_stock_and_pending_channels_share_its_budget() {
    let Stocked {
        mut n,
        client,
        server,
    } = budgeted("stock-budget", 6);
    let b = &mut n.broker;
    // The channel and stock to fill the budget.
    let a = stock_intent(b, &client, "10.202.9.1:40000", "10.202.9.2:80", 16);
    assert_eq!(grants(&a).len(), 5);
    let a = stock_intent(b, &client, "10.202.9.1:40001", "10.202.9.2:81", 1);
    assert!(
        matches!(
            a.response,
            Response::Error {
                code: ErrorCode::TooLarge,
                ..
            }
        ),
        "{:?}",
        a.response
    );
    // The claim frees the channel's place: a channel fits, no stock.
    let c = stock_claim(b, &server, "10.202.9.2:80", "10.202.9.1:40000");
    assert!(matches!(
        c.response,
        Response::Stocked {
            channel: Some(_),
            ..
        }
    ));
    let a = stock_intent(b, &client, "10.202.9.1:40002", "10.202.9.2:80", 16);
    assert!(
        matches!(a.response, Response::Channel { .. }),
        "{:?}",
        a.response
    );
    // Another pod's budget is its own.
    let a = stock_intent(b, &pod(3), "10.202.9.3:40000", "10.202.9.2:80", 2);
    assert_eq!(grants(&a).len(), 2);
    assert_eq!(b.stats().fallbacks["too-many-pending"], 1);
}

#[test]
fn an_undelivered_answer_drops_what_it_made_and_keeps_what_it_granted() {
    let Stocked {
        mut n,
        client,
        server,
    } = taking_stock("stock-undelivered", Limits::default());
    let b = &mut n.broker;
    // An intent's answer: its channel and its stock go.
    let a = stock_intent(b, &client, "10.202.9.1:40000", "10.202.9.2:80", 3);
    let made = Undelivered::of(true, &a.response).unwrap();
    assert!(
        matches!(made, Undelivered::Intent { channel: Some(_), ref stock } if stock.len() == 3)
    );
    b.answer_undelivered(&client, made);
    let st = stats(b);
    assert_eq!((st.channels_pending, st.channels_stocked), (0, 0));
    assert_eq!(b.stats().fallbacks["intent-undelivered"], 1);
    // A claim's grants stay stock; the caller holds none, so its next
    // claim gets them again.
    let made = grants(&stock_intent(
        b,
        &client,
        "10.202.9.1:40001",
        "10.202.9.2:80",
        2,
    ));
    let c = stock_claim(b, &server, "10.202.9.2:80", "10.202.9.1:1");
    assert_eq!(grants(&c), made);
    let undo = Undelivered::of(false, &c.response).unwrap();
    assert_eq!(undo, Undelivered::Grants(ids(&made)));
    b.answer_undelivered(&server, undo);
    assert_eq!(stats(b).channels_stocked, 2);
    let c = stock_claim(b, &server, "10.202.9.2:80", "10.202.9.1:1");
    assert_eq!(grants(&c), made);
    // Other answers: a plain intent's channel as before; a claim's
    // channel, nothing.
    let plain = Response::Channel { id: 7, len: 12288 };
    assert_eq!(
        Undelivered::of(true, &plain),
        Some(Undelivered::Intent {
            channel: Some(7),
            stock: Vec::new()
        })
    );
    assert_eq!(Undelivered::of(false, &plain), None);
}

/// A stats request counts a stock channel opened as soon as its offer word
/// says a server took it (the server's one-way `stock-taken` comes on
/// another daemon connection, maybe later); the `stock-taken` that follows
/// fills in the server's side and counts nothing twice.
#[test]
fn a_channel_seen_taken_is_counted_opened_before_its_stock_taken() {
    let Stocked {
        mut n,
        client,
        server,
    } = taking_stock("stock-seen", Limits::default());
    let b = &mut n.broker;
    let a = stock_intent(b, &client, "10.202.9.1:40000", "10.202.9.2:80", 2);
    let g = grants(&a)[0];
    let view = flowlane_lane::region::Region::map_memfd(a.fds[1].as_fd(), 12288).unwrap();
    let opened = |b: &mut Broker| {
        let Response::Stats { stats } = b
            .handle(&super::tests::on_node(0, 0), Request::Stats)
            .response
        else {
            panic!("no stats")
        };
        let shm = &stats.lanes["shm"];
        (shm.connections_opened, shm.channels_stocked)
    };
    assert_eq!(opened(b), (0, 2));
    // The client offers port 5000; a server takes it.
    assert!(view.offer_begin());
    view.offer_port(5000);
    assert_eq!(opened(b), (0, 2), "offered is not taken");
    assert!(view.offer_take(5000));
    assert_eq!(opened(b), (1, 1));
    taken(b, &server, g.id, "10.202.9.2:80", "10.202.9.1:5000");
    assert_eq!(opened(b), (1, 1));
    let conn = &b.stats().connections[0];
    assert_eq!(
        (conn.id, conn.client.addr, conn.server.addr),
        (g.id, sa("10.202.9.1:5000"), sa("10.202.9.2:80"))
    );
    // A channel a server took is not revoked when its stock expires: the
    // second one is, in its word.
    let other = a.fds[2].as_fd();
    let other = flowlane_lane::region::Region::map_memfd(other, 12288).unwrap();
    b.tick(Instant::now() + Limits::default().stock_ttl + Duration::from_secs(1));
    assert_eq!(other.offer(), flowlane_lane::offer::Offer::Dead);
    assert_eq!(view.offer(), flowlane_lane::offer::Offer::Taken);
}

/// The library sends no message for a stock connection: the daemon opens
/// it from its offer word, and closes it, with the bytes its rings carried,
/// once both producers closed (before stats are read; at the next tick).
/// A producer that closes early does not end it.
#[test]
fn a_stock_connection_opens_and_closes_without_a_message() {
    use flowlane_lane::ring::Side;
    for at_tick in [false, true] {
        let Stocked {
            mut n,
            client,
            server: _,
        } = taking_stock("stock-quiet", Limits::default());
        let b = &mut n.broker;
        let a = stock_intent(b, &client, "10.202.9.1:40000", "10.202.9.2:80", 1);
        let view = flowlane_lane::region::Region::map_memfd(a.fds[1].as_fd(), 12288).unwrap();
        let lane = |b: &mut Broker| {
            if at_tick {
                b.tick(Instant::now());
                let st = b.stats();
                let shm = &st.lanes["shm"];
                (shm.connections_active, shm.connections_closed, shm.bytes)
            } else {
                let Response::Stats { stats } = b
                    .handle(&super::tests::on_node(0, 0), Request::Stats)
                    .response
                else {
                    panic!("no stats")
                };
                let shm = &stats.lanes["shm"];
                (shm.connections_active, shm.connections_closed, shm.bytes)
            }
        };
        assert!(view.offer_begin());
        view.offer_port(5000);
        assert!(view.offer_take(5000));
        let (mut ctx, _crx) = view.endpoints(Side::Client);
        let (mut stx, _srx) = view.endpoints(Side::Server);
        assert_eq!(ctx.write(&[1u8; 700]), 700);
        assert_eq!(stx.write(&[2u8; 50]), 50);
        // Live bytes are read from the rings too.
        assert_eq!(lane(b), (1, 0, 750), "at_tick {at_tick}");
        ctx.close();
        assert_eq!(lane(b), (1, 0, 750), "one end closed: still open");
        stx.close();
        assert_eq!(lane(b), (0, 1, 750), "at_tick {at_tick}");
    }
}

/// Stock a server took (its word says so) leaves the pod's budget at the
/// client's next intent, not only at the next tick: a client connecting
/// faster than the ticks keeps getting stock.
#[test]
fn stock_taken_between_ticks_leaves_the_budget_at_the_next_intent() {
    let Stocked {
        mut n,
        client,
        server,
    } = budgeted("stock-refill", 3);
    let b = &mut n.broker;
    let a = stock_intent(b, &client, "10.202.9.1:40000", "10.202.9.2:80", 2);
    assert_eq!(grants(&a).len(), 2);
    // The intent's channel is claimed; both stock channels are used.
    let _ = stock_claim(b, &server, "10.202.9.2:80", "10.202.9.1:40000");
    for (i, fd) in a.fds[1..].iter().enumerate() {
        let view = flowlane_lane::region::Region::map_memfd(fd.as_fd(), 12288).unwrap();
        assert!(view.offer_begin());
        view.offer_port(5000 + i as u16);
        assert!(view.offer_take(5000 + i as u16));
    }
    let a = stock_intent(b, &client, "10.202.9.1:40001", "10.202.9.2:80", 2);
    assert_eq!(grants(&a).len(), 2, "{:?}", a.response);
}

/// A stock connection opens on its region's offer word, which the client
/// can write itself: a pod that marks its stock taken and never closes it
/// gets no more stock once its live stock connections reach its budget,
/// and gets stock again when they close.
#[test]
fn live_stock_connections_are_bounded_per_pod() {
    use flowlane_lane::region::Region;
    use flowlane_lane::ring::Side;
    let Stocked {
        mut n,
        client,
        server,
    } = budgeted("stock-live-bound", 3);
    let b = &mut n.broker;
    let mut views = Vec::new();
    let mut port = 5000u16;
    for round in 0..2 {
        let src = format!("10.202.9.1:{}", 40000 + round);
        let a = stock_intent(b, &client, &src, "10.202.9.2:80", 2);
        assert_eq!(grants(&a).len(), 2, "round {round}: {:?}", a.response);
        let _ = stock_claim(b, &server, "10.202.9.2:80", &src);
        for fd in &a.fds[1..] {
            let view = Region::map_memfd(fd.as_fd(), 12288).unwrap();
            // The client alone writes every state up to "taken".
            assert!(view.offer_begin());
            view.offer_port(port);
            assert!(view.offer_take(port));
            port += 1;
            views.push(view);
        }
    }
    let a = stock_intent(b, &client, "10.202.9.1:40002", "10.202.9.2:80", 2);
    assert!(
        grants(&a).is_empty(),
        "4 live stock connections, budget 3: {:?}",
        a.response
    );
    assert!(
        matches!(a.response, Response::Channel { .. }),
        "the connection itself still gets its channel: {:?}",
        a.response
    );
    let _ = stock_claim(b, &server, "10.202.9.2:80", "10.202.9.1:40002");
    // They close (both producers): stock again.
    for v in &views {
        for side in [Side::Client, Side::Server] {
            let (tx, _rx) = v.endpoints(side);
            tx.close();
        }
    }
    let a = stock_intent(b, &client, "10.202.9.1:40003", "10.202.9.2:80", 2);
    assert_eq!(grants(&a).len(), 2, "{:?}", a.response);
}

fn refill(b: &mut Broker, who: &Caller, dst: &str, want: u32) -> Answer {
    b.handle(who, Request::StockRefill { dst: sa(dst), want })
}

fn fetch(b: &mut Broker, who: &Caller, local: &str) -> Answer {
    b.handle(who, Request::StockFetch { local: sa(local) })
}

/// An empty answer to a request sent ahead: no channel, no stock, no fd.
fn assert_none_stocked(a: &Answer) {
    assert_eq!(
        a.response,
        Response::Stocked {
            channel: None,
            stock: Vec::new()
        }
    );
    assert!(a.fds.is_empty());
}

#[test]
fn a_refill_repeats_only_what_an_intent_admitted_while_its_stock_is_held() {
    let Stocked {
        mut n,
        client,
        server,
    } = taking_stock("stock-refill", Limits::default());
    let other = process_of(&n, 1);
    let intruder = process_of(&n, 3);
    let b = &mut n.broker;
    // Nothing admitted yet: nothing to repeat.
    assert_none_stocked(&refill(b, &client, "10.202.9.2:80", 8));
    let a = stock_intent(b, &client, "10.202.9.1:40000", "10.202.9.2:80", 2);
    let first = grants(&a);
    assert_eq!(first.len(), 2);
    // The same process gets more, made as its intent's stock was; no
    // channel of its own (no connection waits for this answer).
    let a = refill(b, &client, "10.202.9.2:80", 8);
    let Response::Stocked {
        channel: None,
        ref stock,
    } = a.response
    else {
        panic!("{:?}", a.response)
    };
    assert_eq!(stock.len(), 8);
    assert_eq!(a.fds.len(), 8);
    for g in stock {
        assert_eq!((g.len, g.client), (12288, sa("10.202.9.1:0").ip()));
        assert!(!ids(&first).contains(&g.id));
    }
    assert_eq!(stats(b).channels_stocked, 10);
    // Within the pair's bound: 16 at most held at once.
    assert_eq!(grants(&refill(b, &client, "10.202.9.2:80", 16)).len(), 6);
    assert_none_stocked(&refill(b, &client, "10.202.9.2:80", 16));
    // Another process of the same pod, another pod, another destination:
    // none of them was admitted by that intent.
    assert_none_stocked(&refill(b, &other, "10.202.9.2:80", 8));
    assert_none_stocked(&refill(b, &intruder, "10.202.9.2:80", 8));
    assert_none_stocked(&refill(b, &client, "10.202.9.2:81", 8));
    // The server's fetch brings what it does not hold yet, once.
    let fetched = grants(&fetch(b, &server, "10.202.9.2:80"));
    assert_eq!(fetched.len(), MAX_STOCK_GRANTS);
    let rest = grants(&fetch(b, &server, "10.202.9.2:80"));
    assert_eq!(fetched.len() + rest.len(), 16);
    assert_none_stocked(&fetch(b, &server, "10.202.9.2:80"));
    // Not the listener's pod: nothing; a listener that does not take
    // stock: nothing.
    assert_none_stocked(&fetch(b, &other, "10.202.9.2:80"));
    assert_none_stocked(&fetch(b, &server, "10.202.9.2:81"));
    // The listener goes: its stock goes with it, and a refill makes none.
    let r = b.handle(
        &server,
        Request::UnregisterListener {
            addr: sa("0.0.0.0:80"),
        },
    );
    assert_eq!(r.response, Response::Ok);
    assert_eq!(stats(b).channels_stocked, 0);
    assert_none_stocked(&refill(b, &client, "10.202.9.2:80", 8));
}

#[test]
fn a_refill_stays_within_the_pods_budget_and_an_undelivered_one_is_dropped() {
    let Stocked { mut n, client, .. } = budgeted("stock-refill-budget", 6);
    let b = &mut n.broker;
    let a = stock_intent(b, &client, "10.202.9.1:40000", "10.202.9.2:80", 2);
    assert_eq!(grants(&a).len(), 2);
    // 1 pending channel + 2 stock held: 3 more fit the budget of 6.
    let a = refill(b, &client, "10.202.9.2:80", 8);
    let made = ids(&grants(&a));
    assert_eq!(made.len(), 3);
    assert_none_stocked(&refill(b, &client, "10.202.9.2:80", 8));
    // The answer never reached the client: what it made is dropped.
    let undelivered = Undelivered::of(true, &a.response).unwrap();
    b.answer_undelivered(&client, undelivered);
    assert_eq!(stats(b).channels_stocked, 2);
    assert_eq!(grants(&refill(b, &client, "10.202.9.2:80", 8)).len(), 3);
}

/// A server process that was granted stock ahead (a fetch) may never have
/// read the answer (its thread found the kept connection busy and claimed
/// on a connection of its own; the connection broke): its claim still gets
/// the channel offered for its own connection, and only that one again.
#[test]
fn a_claim_grants_its_own_offered_channel_even_to_a_recorded_holder() {
    let Stocked {
        mut n,
        client,
        server,
    } = taking_stock("stock-regrant", Limits::default());
    let b = &mut n.broker;
    let a = stock_intent(b, &client, "10.202.9.1:40000", "10.202.9.2:80", 3);
    let made = grants(&a);
    assert_eq!(made.len(), 3);
    let fetched = grants(&fetch(b, &server, "10.202.9.2:80"));
    assert_eq!(ids(&fetched), ids(&made), "the fetch records the server");
    // The client offers the second channel for port 5000; another is
    // between its connect and its port.
    let offered = flowlane_lane::region::Region::map_memfd(a.fds[2].as_fd(), 12288).unwrap();
    assert!(offered.offer_begin());
    offered.offer_port(5000);
    let connecting = flowlane_lane::region::Region::map_memfd(a.fds[3].as_fd(), 12288).unwrap();
    assert!(connecting.offer_begin());
    // A claim for another port, or from another pod at that port, gets
    // nothing again.
    let other_port = stock_claim(b, &server, "10.202.9.2:80", "10.202.9.1:5001");
    assert!(grants(&other_port).is_empty(), "{:?}", other_port.response);
    let other_pod = stock_claim(b, &server, "10.202.9.2:80", "10.202.9.3:5000");
    assert!(grants(&other_pod).is_empty(), "{:?}", other_pod.response);
    // The claim for the offered connection gets its channel once more,
    // the same region, and nothing else it holds.
    let c = stock_claim(b, &server, "10.202.9.2:80", "10.202.9.1:5000");
    assert_eq!(ids(&grants(&c)), [made[1].id]);
    assert_eq!(ino(&c.fds[0]), ino(&a.fds[2]));
    // Taken, it is no stock any more: not granted again.
    assert!(offered.offer_take(5000));
    let again = stock_claim(b, &server, "10.202.9.2:80", "10.202.9.1:5000");
    assert!(grants(&again).is_empty(), "{:?}", again.response);
}
