//! The stream multiplexer over the in-process fabric: everything above the
//! verbs (handshake over real TCP on loopback, credits, windows, half-close,
//! resets, link failure). The same code over Soft-RoCE is tested in
//! tests/e2e/rdma/transport.rs.

use std::{
    io::{ErrorKind, Write},
    net::{IpAddr, SocketAddr, TcpStream},
    sync::Arc,
    thread,
    time::{Duration, Instant},
};

use flowlane_rdma::transport::exercise::{
    check_receive, direct_exchange, exchange, DirectSpec, ExchangeSpec, Pattern,
};
use flowlane_rdma::transport::{MemProvider, MemTransport, RdmaOptions};
use flowlane_rdma::{LaneAuth, LaneKey, LaneStream, LaneTransport, Piece, RingArea, StreamKey};

fn small_opts() -> RdmaOptions {
    // A tiny ring and window so credits and windows run out constantly.
    RdmaOptions {
        slots: 8,
        slot_size: 4096,
        stream_window: 16 * 1024,
        checksums: true,
        keepalive: Duration::from_millis(200),
        dead_after: Duration::from_secs(5),
        ..RdmaOptions::default()
    }
}

const KEY: &[u8] = b"transport tests: a lane key of 32 bytes or more";

/// The lane's authentication as the daemons set it up: the key, and
/// loopback as the node table.
fn auth_with(key: &[u8]) -> LaneAuth {
    LaneAuth::new(
        LaneKey::from_bytes(key).unwrap(),
        Arc::new(|ip: IpAddr| ip.is_loopback()),
    )
}

fn auth() -> LaneAuth {
    auth_with(KEY)
}

fn start(opts: &RdmaOptions) -> Arc<MemTransport> {
    Arc::new(
        MemTransport::start(
            MemProvider,
            "127.0.0.1:0".parse().unwrap(),
            opts.clone(),
            auth(),
        )
        .unwrap(),
    )
}

fn key(i: u16) -> StreamKey {
    StreamKey {
        client: SocketAddr::from(([10, 1, 0, 2], 40000 + i)),
        server: SocketAddr::from(([10, 2, 0, 3], 5201)),
    }
}

fn spec(i: u64, opener: bool) -> ExchangeSpec {
    let (a_bytes, b_bytes) = (200_000 + i * 3, 50_000 + i * 7919);
    if opener {
        ExchangeSpec {
            send_seed: i,
            recv_seed: 1000 + i,
            send_bytes: a_bytes,
            recv_bytes: b_bytes,
            max_msg: 20_000,
        }
    } else {
        ExchangeSpec {
            send_seed: 1000 + i,
            recv_seed: i,
            send_bytes: b_bytes,
            recv_bytes: a_bytes,
            max_msg: 9000,
        }
    }
}

/// Waits for `f` to hold, up to a generous bound (liveness only).
fn eventually(what: &str, f: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        thread::sleep(Duration::from_millis(10));
    }
}

/// One of the transport's error counters (`LaneTransport::error_counts`).
fn errors(t: &dyn LaneTransport, kind: &str) -> u64 {
    t.error_counts()
        .into_iter()
        .find(|(k, _)| *k == kind)
        .unwrap_or_else(|| panic!("no error counter {kind}"))
        .1
}

/// Opens stream `key(i)` from `a` to `b` and accepts it there: the opened
/// end, and the accepted key and end.
fn open_and_accept(
    a: &MemTransport,
    b: &MemTransport,
    i: u16,
) -> (Box<dyn LaneStream>, (StreamKey, Box<dyn LaneStream>)) {
    let opened = a.open(b.local_addr(), key(i)).unwrap();
    (opened, b.accept().unwrap())
}

/// Opens `n` streams from `a` to `b` (`key(first)` on) and runs `side` for
/// both ends of each on its own thread, all at once; `side` gets the key's
/// index, whether its end opened the stream, and the end. Returns the
/// opening ends' results.
fn on_many_streams<R, F>(
    a: &MemTransport,
    b: &Arc<MemTransport>,
    first: u16,
    n: u16,
    side: F,
) -> Vec<R>
where
    R: Send + 'static,
    F: Fn(u64, bool, Arc<dyn LaneStream>) -> R + Send + Copy + 'static,
{
    let b2 = Arc::clone(b);
    let acceptor = thread::spawn(move || {
        let workers: Vec<_> = (0..n)
            .map(|_| {
                let (k, s) = b2.accept().unwrap();
                let i = (k.client.port() - 40000) as u64;
                thread::spawn(move || side(i, false, Arc::from(s)))
            })
            .collect();
        workers.into_iter().for_each(|w| {
            w.join().unwrap();
        });
    });
    let workers: Vec<_> = (first..first + n)
        .map(|i| {
            let s = a.open(b.local_addr(), key(i)).unwrap();
            thread::spawn(move || side(i as u64, true, Arc::from(s)))
        })
        .collect();
    let opened = workers.into_iter().map(|w| w.join().unwrap()).collect();
    acceptor.join().unwrap();
    opened
}

/// `len` bytes of `Pattern(seed)`.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut data = vec![0u8; len];
    Pattern::new(seed).fill(&mut data);
    data
}

/// Sends all of `data` on `s` (the sends block for window).
fn send_all(s: &dyn LaneStream, data: &[u8]) {
    let mut off = 0;
    while off < data.len() {
        off += s.send(&data[off..]).unwrap();
    }
}

/// `msg` sent on `s` arrives on `t` in one receive of its length.
#[track_caller]
fn assert_carries(s: &dyn LaneStream, t: &dyn LaneStream, msg: &[u8]) {
    s.send(msg).unwrap();
    let mut buf = vec![0u8; msg.len()];
    assert_eq!(t.recv(&mut buf).unwrap(), msg.len());
}

/// A send or receive that failed because the stream was reset.
#[track_caller]
fn assert_reset(r: std::io::Result<usize>) {
    assert_eq!(r.unwrap_err().kind(), ErrorKind::ConnectionReset);
}

#[test]
fn many_streams_random_sizes_both_directions_arrive_intact() {
    let opts = small_opts();
    let (a, b) = (start(&opts), start(&opts));
    let n = 12u16;
    on_many_streams(&a, &b, 0, n, |i, opener, s| {
        exchange(s, spec(i, opener)).unwrap()
    });
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!(sa.bytes_sent, sb.bytes_received);
    assert_eq!(sb.bytes_sent, sa.bytes_received);
    assert_eq!(sa.streams_opened, n as u64);
    assert_eq!(sb.streams_accepted, n as u64);
    // The first open makes a link; later opens use it at once and the
    // extra links (up to links_per_peer) come up in the background.
    eventually("links_per_peer links up", || {
        a.stats().links_up as usize == opts.links_per_peer
    });
    assert!(sa.links_up >= 1);
    eventually("streams forgotten after both sides closed", || {
        a.stats().streams_open == 0 && b.stats().streams_open == 0
    });
}

#[test]
fn half_close_delivers_eof_after_the_data_and_the_other_direction_keeps_working() {
    let opts = small_opts();
    let (a, b) = (start(&opts), start(&opts));
    let (sa, (k, sb)) = open_and_accept(&a, &b, 1);
    assert_eq!(k, key(1));
    let data = pattern(7, 100_000);
    let sa: Arc<dyn LaneStream> = Arc::from(sa);
    // The data is several windows long: the reader must run meanwhile.
    let writer = {
        let (sa, data) = (Arc::clone(&sa), data.clone());
        thread::spawn(move || {
            send_all(&*sa, &data);
            sa.shutdown_send().unwrap();
            assert_eq!(sa.send(b"x").unwrap_err().kind(), ErrorKind::BrokenPipe);
        })
    };
    let mut got = Vec::new();
    let mut buf = [0u8; 3000];
    loop {
        let n = sb.recv(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    writer.join().unwrap();
    assert_eq!(got, data);
    assert_eq!(sb.recv(&mut buf).unwrap(), 0, "EOF stays EOF");
    // The reverse direction is still open.
    assert_eq!(sb.send(b"reply").unwrap(), 5);
    sb.shutdown_send().unwrap();
    let mut r = [0u8; 16];
    assert_eq!(sa.recv(&mut r).unwrap(), 5);
    assert_eq!(&r[..5], b"reply");
    assert_eq!(sa.recv(&mut r).unwrap(), 0);
}

#[test]
fn reset_reaches_the_peer_as_connection_reset() {
    let opts = small_opts();
    let (a, b) = (start(&opts), start(&opts));
    let (sa, (_, sb)) = open_and_accept(&a, &b, 2);
    let sb: Arc<dyn LaneStream> = Arc::from(sb);
    let reader = {
        let sb = Arc::clone(&sb);
        thread::spawn(move || {
            let mut buf = [0u8; 100];
            loop {
                match sb.recv(&mut buf) {
                    Ok(0) => return Err("EOF instead of reset".to_string()),
                    Ok(_) => continue,
                    Err(e) => return Ok(e.kind()),
                }
            }
        })
    };
    sa.send(b"some bytes").unwrap();
    sa.reset();
    assert_eq!(reader.join().unwrap(), Ok(ErrorKind::ConnectionReset));
    assert_reset(sb.send(b"x"));
    assert_reset(sa.send(b"x"));
    // Other streams on the link are unaffected.
    let (s2, (_, t2)) = open_and_accept(&a, &b, 3);
    assert_carries(&*s2, &*t2, b"ok");
}

#[test]
fn dropping_an_open_stream_resets_it_for_the_peer() {
    let opts = small_opts();
    let (a, b) = (start(&opts), start(&opts));
    let (sa, (_, sb)) = open_and_accept(&a, &b, 4);
    drop(sa);
    let mut buf = [0u8; 8];
    assert_reset(sb.recv(&mut buf));
}

#[test]
fn a_slow_reader_stalls_only_its_own_stream() {
    let opts = small_opts();
    let (a, b) = (start(&opts), start(&opts));
    let (stalled, (_, _never_read)) = open_and_accept(&a, &b, 5);
    // Fill the stalled stream's window: its next send must block, so do it
    // on a thread and check it is still blocked afterwards.
    let stalled: Arc<dyn LaneStream> = Arc::from(stalled);
    let blocked = {
        let s = Arc::clone(&stalled);
        thread::spawn(move || {
            let buf = vec![1u8; 64 * 1024];
            let mut sent = 0usize;
            while sent < buf.len() {
                match s.send(&buf[sent..]) {
                    Ok(n) => sent += n,
                    Err(_) => return sent,
                }
            }
            sent
        })
    };
    // Meanwhile another stream moves 20 windows' worth.
    let (s2, (_, t2)) = open_and_accept(&a, &b, 6);
    let total = 20 * opts.stream_window as u64;
    let sender = thread::spawn(move || {
        exchange(
            Arc::from(s2),
            ExchangeSpec {
                send_seed: 9,
                recv_seed: 10,
                send_bytes: total,
                recv_bytes: 0,
                max_msg: 5000,
            },
        )
    });
    let check = check_receive(&*t2, 9, total, 4096);
    t2.shutdown_send().unwrap();
    assert_eq!(check.unwrap(), total);
    assert_eq!(sender.join().unwrap().unwrap().sent, total);
    assert!(
        !blocked.is_finished(),
        "the stalled stream cannot have sent more than its window"
    );
    stalled.reset(); // unblocks the sender with an error
    let sent = blocked.join().unwrap();
    assert!(
        sent <= opts.stream_window as usize,
        "sent {sent} past a {} window",
        opts.stream_window
    );
}

#[test]
fn peer_death_resets_streams_and_new_opens_fail_until_it_is_back() {
    let opts = small_opts();
    let a = start(&opts);
    let b = start(&opts);
    let b_addr = b.local_addr();
    let (sa, (_, _sb)) = open_and_accept(&a, &b, 7);
    let sa: Arc<dyn LaneStream> = Arc::from(sa);
    let reader = {
        let sa = Arc::clone(&sa);
        thread::spawn(move || sa.recv(&mut [0u8; 10]).map_err(|e| e.kind()))
    };
    drop(_sb);
    // "Kill" the peer daemon: its transport goes away, closing the control
    // connection and the fabric.
    drop(b);
    let r = reader.join().unwrap();
    assert_eq!(r, Err(ErrorKind::ConnectionReset), "got {r:?}");
    assert_reset(sa.send(b"x"));
    eventually("link counted as down", || a.stats().links_up == 0);
    assert_eq!(
        errors(&*a, "link_failed"),
        1,
        "the peer's death is one link failure"
    );
    let e = a.open(b_addr, key(8)).map(|_| ()).unwrap_err();
    assert_eq!(
        errors(&*a, "link_setup_failed"),
        1,
        "the refused reconnect is counted"
    );
    assert!(
        matches!(
            e.kind(),
            ErrorKind::ConnectionRefused | ErrorKind::ConnectionReset
        ),
        "{e}"
    );
    // The peer comes back on the same port: opens work again.
    let b2 = Arc::new(MemTransport::start(MemProvider, b_addr, opts.clone(), auth()).unwrap());
    let (s, (k, t)) = open_and_accept(&a, &b2, 9);
    assert_eq!(k, key(9));
    assert_carries(&*s, &*t, b"back");
}

#[test]
fn a_fabric_failure_resets_every_stream_of_that_peer() {
    let opts = small_opts();
    let (a, b) = (start(&opts), start(&opts));
    let streams: Vec<_> = (10..14)
        .map(|i| a.open(b.local_addr(), key(i)).unwrap())
        .collect();
    let accepted: Vec<_> = (0..4).map(|_| b.accept().unwrap().1).collect();
    assert_eq!(errors(&*a, "link_failed"), 0);
    assert!(a.fail_link(b.local_addr(), "simulated QP error"));
    // One per link to that peer (`links_per_peer`).
    assert!(errors(&*a, "link_failed") >= 1);
    for s in &streams {
        assert_reset(s.send(b"x"));
    }
    let mut buf = [0u8; 4];
    for t in &accepted {
        assert_reset(t.recv(&mut buf));
    }
    // A new link is made for the next open.
    let (s, (_, t)) = open_and_accept(&a, &b, 20);
    assert_carries(&*s, &*t, b"new!");
}

#[test]
fn garbage_on_the_lane_port_is_refused_and_the_listener_keeps_working() {
    let opts = small_opts();
    let (a, b) = (start(&opts), start(&opts));
    for junk in [
        &b"GET / HTTP/1.1\r\n\r\n"[..],
        &[0xff, 0xff, 0xff, 0x7f][..],
        b"",
    ] {
        let mut c = TcpStream::connect(b.local_addr()).unwrap();
        c.write_all(junk).unwrap();
        drop(c);
    }
    eventually("the three bad handshakes are counted", || {
        errors(&*b, "peer_auth_failed") == 3
    });
    let (s, (_, t)) = open_and_accept(&a, &b, 30);
    assert_carries(&*s, &*t, b"fine");
    // (the accepting side files the link right after its first stream may
    // already have arrived)
    eventually("one link up on the accepting side", || {
        b.stats().links_up == 1
    });
    assert_eq!(a.stats().links_up, 1);
}

#[test]
fn idle_links_stay_up_on_keepalives() {
    let opts = RdmaOptions {
        keepalive: Duration::from_millis(50),
        dead_after: Duration::from_millis(600),
        ..small_opts()
    };
    let (a, b) = (start(&opts), start(&opts));
    let (s, (_, t)) = open_and_accept(&a, &b, 40);
    thread::sleep(Duration::from_millis(2000));
    assert_carries(&*s, &*t, b"still here");
    assert!(
        a.stats().messages_sent > 10,
        "pings were sent: {:?}",
        a.stats()
    );
}

#[test]
fn bad_options_are_refused() {
    for o in [
        RdmaOptions {
            slots: 6,
            ..RdmaOptions::default()
        },
        RdmaOptions {
            slots: 2,
            ..RdmaOptions::default()
        },
        RdmaOptions {
            slot_size: 40,
            ..RdmaOptions::default()
        },
        RdmaOptions {
            stream_window: 0,
            ..RdmaOptions::default()
        },
    ] {
        let e = MemTransport::start(MemProvider, "127.0.0.1:0".parse().unwrap(), o, auth())
            .map(|_| ())
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
    }
}

#[test]
fn a_transport_shut_down_right_after_its_last_send_still_delivers_it() {
    let opts = small_opts();
    let b = start(&opts);
    let total = 300_000u64;
    let b2 = Arc::clone(&b);
    let reader = thread::spawn(move || {
        let (_, t) = b2.accept().unwrap();
        check_receive(&*t, 77, total, 5000)
    });
    let a = start(&opts);
    let s = a.open(b.local_addr(), key(50)).unwrap();
    send_all(&*s, &pattern(77, total as usize));
    s.shutdown_send().unwrap();
    // The daemon exits right away: the tail and the FIN must still arrive.
    a.shutdown();
    assert_eq!(reader.join().unwrap().unwrap(), total);
}

// ---- Zero copy: placements from a registered sending ring straight into
// the peer's registered receiving ring (`DirectLane`), as the relay does
// with pod rings. The in-process fabric copies registered memory like the
// NIC would and refuses writes outside a registration (remote access
// error), so bounds and credit bugs fail here.

fn direct_spec(i: u64, opener: bool, tx_ring: usize, rx_ring: usize) -> DirectSpec {
    DirectSpec {
        exchange: spec(i, opener),
        tx_ring,
        rx_ring,
        reader_delay: Duration::ZERO,
        bench: false,
    }
}

/// Both directions at once, random placement sizes, rings of different
/// sizes on the two sides (4 KiB and 16 KiB), so transfers are cut at both
/// rings' wraps and the sender waits for ring space (ROOM) constantly;
/// every byte is checked where it landed, with payload CRCs on.
#[test]
fn placements_move_bytes_ring_to_ring_across_wraps_both_ways() {
    let opts = small_opts();
    let (a, b) = (start(&opts), start(&opts));
    let n = 4u16;
    let opened = on_many_streams(&a, &b, 100, n, |i, opener, s| {
        // The opener's rings: 4 KiB sending, 16 KiB receiving.
        let (tx_ring, rx_ring) = if opener {
            (4 << 10, 16 << 10)
        } else {
            (16 << 10, 4 << 10)
        };
        direct_exchange(s, direct_spec(i, opener, tx_ring, rx_ring)).unwrap()
    });
    for r in opened {
        assert!(r.sent > 0 && r.received > 0);
    }
    assert_eq!(errors(&*a, "link_failed"), 0);
}

/// A slow reader: the receiver pauses after every placement; the sender
/// may only place into room the reader reported, so nothing is overwritten
/// before it was read (the byte check would see it).
#[test]
fn a_slow_reader_limits_placements_to_its_ring_space() {
    let opts = small_opts();
    let (a, b) = (start(&opts), start(&opts));
    let (sa, (_, sb)) = open_and_accept(&a, &b, 120);
    let mut slow = direct_spec(7, false, 4 << 10, 4 << 10);
    slow.reader_delay = Duration::from_millis(2);
    slow.exchange.send_bytes = 0;
    slow.exchange.recv_bytes = 120_000;
    let mut fast = direct_spec(7, true, 8 << 10, 4 << 10);
    fast.exchange.send_bytes = 120_000;
    fast.exchange.recv_bytes = 0;
    let r = thread::spawn(move || direct_exchange(Arc::from(sb), slow).unwrap());
    let w = direct_exchange(Arc::from(sa), fast).unwrap();
    assert_eq!(w.sent, 120_000);
    assert_eq!(r.join().unwrap().received, 120_000);
}

/// The queue pair fails in the middle of a transfer: both sides' placements
/// and receives end with an error (ConnectionReset), nobody hangs, and
/// unregistering the rings does not wait for completions that never come.
#[test]
fn a_link_failure_mid_placement_ends_both_sides_with_an_error() {
    let opts = small_opts();
    let (a, b) = (start(&opts), start(&opts));
    let (sa, (_, sb)) = open_and_accept(&a, &b, 130);
    let big = |opener: bool| {
        let mut s = direct_spec(9, opener, 4 << 10, 4 << 10);
        s.exchange.send_bytes = 50_000_000;
        s.exchange.recv_bytes = 50_000_000;
        s.reader_delay = Duration::from_micros(200);
        s
    };
    let (sa_spec, sb_spec) = (big(true), big(false));
    let ta = thread::spawn(move || direct_exchange(Arc::from(sa), sa_spec));
    let tb = thread::spawn(move || direct_exchange(Arc::from(sb), sb_spec));
    thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    assert!(a.fail_link(b.local_addr(), "test: queue pair error"));
    let (ra, rb) = (ta.join().unwrap(), tb.join().unwrap());
    assert!(ra.is_err(), "opener finished despite the failure: {ra:?}");
    assert!(rb.is_err(), "acceptor finished despite the failure: {rb:?}");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}

/// A placement outside the peer's registered ring (a sender that trusts a
/// wrong size) is a remote access error: the link fails and the streams
/// reset, nothing is written outside the registration.
#[test]
fn a_placement_outside_the_peer_ring_fails_the_link() {
    let opts = small_opts();
    let (a, b) = (start(&opts), start(&opts));
    let (sa, (_, sb)) = open_and_accept(&a, &b, 140);
    let mut a_tx = vec![7u8; 8192];
    let mut a_rx = vec![0u8; 4096];
    let mut b_tx = vec![0u8; 4096];
    let mut b_rx = vec![0u8; 4096 + 4096];
    let area = |v: &mut Vec<u8>, len: usize| RingArea {
        ptr: v.as_mut_ptr(),
        len,
    };
    let (da, db) = (sa.direct().unwrap(), sb.direct().unwrap());
    // SAFETY: the vectors outlive the guards (dropped at the end).
    let (_, ga) = unsafe {
        da.register_rings(
            area(&mut a_tx, 8192),
            area(&mut a_rx, 4096),
            Box::new(|_| {}),
        )
    }
    .unwrap();
    // B registers only the first 4 KiB of its buffer as its ring.
    // SAFETY: as for A: the vectors outlive the guards.
    let (desc_b, gb) = unsafe {
        db.register_rings(
            area(&mut b_tx, 4096),
            area(&mut b_rx, 4096),
            Box::new(|_| {}),
        )
    }
    .unwrap();
    assert_eq!(da.set_peer_ring(&desc_b).unwrap(), 4096);
    // In range: fine.
    da.place(
        &[Piece {
            src: 0,
            dst: 0,
            len: 4096,
        }],
        b"ok",
    )
    .unwrap();
    let mut buf = [0u8; 2];
    assert_eq!(sb.recv(&mut buf).unwrap(), 2);
    assert_eq!(&b_rx[..4096], &[7u8; 4096][..]);
    // Out of range: refused before posting.
    assert_eq!(
        da.place(
            &[Piece {
                src: 0,
                dst: 4096,
                len: 1
            }],
            b"no"
        )
        .unwrap_err()
        .kind(),
        ErrorKind::InvalidInput
    );
    // A peer description lying about the size: the fabric refuses the
    // write (remote access error) and the link fails.
    let mut lie: serde_json::Value = serde_json::from_slice(&desc_b).unwrap();
    lie["len"] = serde_json::json!(8192);
    da.set_peer_ring(&serde_json::to_vec(&lie).unwrap())
        .unwrap();
    let _ = da.place(
        &[Piece {
            src: 0,
            dst: 4096,
            len: 4096,
        }],
        b"xx",
    );
    eventually("the link failed", || errors(&*a, "link_failed") >= 1);
    assert_reset(sb.recv(&mut buf));
    assert_eq!(
        &b_rx[4096..],
        &[0u8; 4096][..],
        "nothing written outside the ring"
    );
    drop((ga, gb));
}

/// A link is set up only between daemons holding the same key: a peer with
/// another key gets no link (on either side), and the transports go on
/// serving the right peers.
#[test]
fn a_peer_with_another_key_gets_no_link_and_the_lane_keeps_working() {
    let opts = small_opts();
    let b = start(&opts);
    let wrong = MemTransport::start(
        MemProvider,
        "127.0.0.1:0".parse().unwrap(),
        opts.clone(),
        auth_with(b"another key, also at least 32 bytes long"),
    )
    .unwrap();
    let e = wrong.open(b.local_addr(), key(1)).map(|_| ()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnexpectedEof, "{e}");
    let t0 = Instant::now();
    while errors(&*b, "peer_auth_failed") == 0 {
        assert!(t0.elapsed() < Duration::from_secs(5), "no refusal counted");
        thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(b.stats().links_up, 0);
    // It only sees the connection close: a set-up failure.
    assert_eq!(errors(&wrong, "link_setup_failed"), 1);
    // The other way round: our side refuses the impostor's listener.
    let e = b.open(wrong.local_addr(), key(2)).map(|_| ()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnexpectedEof, "{e}");
    // A right peer still gets its link and streams.
    let a = start(&opts);
    let (s, (k, t)) = open_and_accept(&a, &b, 3);
    assert_eq!(k, key(3));
    s.send(b"ok").unwrap();
    let mut buf = [0u8; 2];
    assert_eq!(t.recv(&mut buf).unwrap(), 2);
}

/// A source outside the node table is closed before a byte is read.
#[test]
fn a_source_outside_the_node_table_gets_no_link() {
    let opts = small_opts();
    let b = Arc::new(
        MemTransport::start(
            MemProvider,
            "127.0.0.1:0".parse().unwrap(),
            opts.clone(),
            LaneAuth::new(
                LaneKey::from_bytes(KEY).unwrap(),
                Arc::new(|_: IpAddr| false),
            ),
        )
        .unwrap(),
    );
    let a = start(&opts);
    assert!(a.open(b.local_addr(), key(1)).is_err());
    assert_eq!(errors(&*b, "peer_unknown"), 1);
    assert_eq!(errors(&*b, "peer_auth_failed"), 0);
    assert_eq!(b.stats().links_up, 0);
}

/// A peer with the key that announces, after the handshake, a lane at
/// another address than its own (so that our opens to that other node
/// would ride its link) gets no link; the same peer announcing its own
/// address gets one.
#[test]
fn a_peer_announcing_another_nodes_lane_gets_no_link() {
    use flowlane_rdma::transport::FabricProvider;
    use std::io::Read;
    let opts = small_opts();
    let b = start(&opts);
    // Returns whether b sent its ready byte (the link is up on its side).
    let announce = |lane: &str| -> bool {
        let mut s = TcpStream::connect(b.local_addr()).unwrap();
        auth().initiate(&mut s).expect("the key is right");
        let (_half, desc) = MemProvider.prepare(opts.geometry()).unwrap();
        let hello = serde_json::json!({
            "protocol": 2,
            "lane": lane,
            "geometry": {"slots": opts.slots, "slot_size": opts.slot_size},
            "window": opts.stream_window,
            "fabric": desc,
        })
        .to_string();
        let mut msg = (hello.len() as u32).to_le_bytes().to_vec();
        msg.extend_from_slice(hello.as_bytes());
        s.write_all(&msg).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut len = [0u8; 4];
        s.read_exact(&mut len).unwrap();
        let mut theirs = vec![0u8; u32::from_le_bytes(len) as usize];
        s.read_exact(&mut theirs).unwrap();
        let mut ready = [0u8; 1];
        matches!(s.read(&mut ready), Ok(1)) && &ready == b"R"
    };
    assert!(!announce("127.0.0.2:7471"), "another address: no link");
    eventually("the refused link is counted", || {
        errors(&*b, "link_setup_failed") == 1
    });
    assert!(
        announce("127.0.0.1:7471"),
        "its own address: the link comes up"
    );
}
