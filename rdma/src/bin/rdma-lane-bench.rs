//! Exercises and measures the RDMA lane between two hosts (the Soft-RoCE
//! guests of deploy/local/rdma-rig, or two real RDMA nodes).
//!
//! ```text
//! rdma-lane-bench serve   --device rxe0 --gid-index 1 --listen 192.168.47.2:7480 [--checksums]
//! rdma-lane-bench check   --device rxe0 --gid-index 1 --peer 192.168.47.2:7480 --streams 16 [--checksums]
//! rdma-lane-bench bench   --device rxe0 --gid-index 1 --peer 192.168.47.2:7480 --size 65536 --total 67108864 [--streams 1] [--direct]
//! rdma-lane-bench lat     --device rxe0 --gid-index 1 --peer 192.168.47.2:7480 --size 2 --iters 1000
//! rdma-lane-bench wait-reset --device rxe0 --gid-index 1 --peer 192.168.47.2:7480
//! rdma-lane-bench tcp-serve --listen 192.168.47.2:7481
//! rdma-lane-bench tcp-bench --peer 192.168.47.2:7481 --size 65536 --total 67108864
//! rdma-lane-bench probe   --device rxe0        # opens the device; says why not (no libibverbs, ...)
//! ```
//! Streams say what they want through the server port of their key:
//! 1 = checked exchange (both directions, random sizes), 2 = sink (count
//! bytes until EOF, answer the count), 4 = echo (ping-pong), 3 = hold (never answer: the client
//! waits for the reset when the server process is killed).
//! Results are printed as `@@` lines with JSON for the tests to parse.
//! The lane is authenticated as the daemons' is (`lane_auth`), with the key
//! from `--key-file` or, without one, a fixed benchmark key (not a secret:
//! the bench is a measuring tool, its peers are whoever runs it), and any
//! source address admitted.

use std::{
    io::{self, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    process::ExitCode,
    sync::Arc,
    thread,
    time::{Duration, Instant},
};

use flowlane_rdma::transport::exercise::{direct_exchange, exchange, DirectSpec, ExchangeSpec};
use flowlane_rdma::transport::{RdmaOptions, RdmaTransport, VerbsProvider};
use flowlane_rdma::{LaneStream, LaneTransport, StreamKey};

struct Args(Vec<String>);

impl Args {
    fn get(&self, name: &str) -> Option<&str> {
        let i = self.0.iter().position(|a| a == name)?;
        self.0.get(i + 1).map(String::as_str)
    }
    fn has(&self, name: &str) -> bool {
        self.0.iter().any(|a| a == name)
    }
    fn num(&self, name: &str, default: u64) -> u64 {
        self.get(name).map_or(default, |v| {
            v.parse().unwrap_or_else(|_| die(&format!("bad {name}")))
        })
    }
    fn addr(&self, name: &str) -> SocketAddr {
        self.get(name)
            .unwrap_or_else(|| die(&format!("{name} is required")))
            .parse()
            .unwrap_or_else(|_| die(&format!("bad {name}")))
    }
}

fn die(msg: &str) -> ! {
    eprintln!("rdma-lane-bench: {msg}");
    std::process::exit(2)
}

fn opts(a: &Args) -> RdmaOptions {
    RdmaOptions {
        checksums: a.has("--checksums"),
        ..RdmaOptions::default()
    }
}

fn transport(a: &Args, listen: SocketAddr) -> io::Result<RdmaTransport> {
    let dev = a.get("--device").unwrap_or("rxe0");
    let provider = VerbsProvider::open(
        dev,
        a.num("--port", 1) as u32,
        a.num("--gid-index", 1) as u32,
    )?;
    RdmaTransport::start(provider, listen, opts(a), auth(a)?)
}

/// The benchmark's lane authentication (see the top of this file).
fn auth(a: &Args) -> io::Result<flowlane_rdma::LaneAuth> {
    let key = match a.get("--key-file") {
        Some(p) => flowlane_rdma::LaneKey::from_file(std::path::Path::new(p)),
        None => flowlane_rdma::LaneKey::from_bytes(b"rdma-lane-bench: a fixed key, not a secret"),
    }
    .map_err(io::Error::other)?;
    Ok(flowlane_rdma::LaneAuth::new(
        key,
        Arc::new(|_: std::net::IpAddr| true),
    ))
}

fn key(i: u64, op: u16) -> StreamKey {
    StreamKey {
        client: SocketAddr::from(([10, 0, 0, 1], 10000 + i as u16)),
        server: SocketAddr::from(([10, 0, 0, 2], op)),
    }
}

/// The checked exchange of stream `i`, as seen by the opener (or the
/// acceptor): sizes differ per stream and per direction.
fn check_spec(i: u64, opener: bool) -> ExchangeSpec {
    let (up, down) = (1_500_000 + i * 12_345, 700_000 + i * 777);
    if opener {
        ExchangeSpec {
            send_seed: i,
            recv_seed: 100 + i,
            send_bytes: up,
            recv_bytes: down,
            max_msg: 200_000,
        }
    } else {
        ExchangeSpec {
            send_seed: 100 + i,
            recv_seed: i,
            send_bytes: down,
            recv_bytes: up,
            max_msg: 70_000,
        }
    }
}

fn serve_stream(key: StreamKey, s: Box<dyn LaneStream>) {
    let s: Arc<dyn LaneStream> = Arc::from(s);
    let i = key.client.port() as u64 - 10000;
    let r = match key.server.port() {
        1 => exchange(s, check_spec(i, false)).map(|_| ()),
        2 => sink(&*s),
        4 => echo(&*s),
        5 => direct_exchange(s, direct_sink()).map(|_| ()),
        _ => {
            let mut b = [0u8; 1];
            s.recv(&mut b).map(|_| ())
        }
    };
    if let Err(e) = r {
        eprintln!("stream {i}: {e}");
    }
}

/// The receiving side of `bench --direct`: 1 MiB rings (a pod's default).
fn direct_sink() -> DirectSpec {
    DirectSpec {
        exchange: ExchangeSpec {
            send_seed: 0,
            recv_seed: 0,
            send_bytes: 0,
            recv_bytes: u64::MAX,
            max_msg: 1,
        },
        tx_ring: 1 << 20,
        rx_ring: 1 << 20,
        reader_delay: Duration::ZERO,
        bench: true,
    }
}

/// `bench --direct`: `total` bytes placed from a registered 1 MiB ring
/// straight into the peer's registered 1 MiB ring in `size`-byte
/// placements, credits by the peer's ring space (what the relay does with
/// pod rings): no copy on either side.
fn bench_direct(t: &RdmaTransport, peer: SocketAddr, size: usize, total: u64) -> io::Result<f64> {
    let s: Arc<dyn LaneStream> = Arc::from(t.open(peer, key(0, 5))?);
    let spec = DirectSpec {
        exchange: ExchangeSpec {
            send_seed: 0,
            recv_seed: 0,
            send_bytes: total,
            recv_bytes: 0,
            max_msg: size.clamp(1, 1 << 20),
        },
        bench: true,
        ..direct_sink()
    };
    let r = direct_exchange(s, spec)?;
    Ok(r.sent as f64 / r.elapsed.as_secs_f64())
}

fn sink(s: &dyn LaneStream) -> io::Result<()> {
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        match s.recv(&mut buf)? {
            0 => break,
            k => n += k as u64,
        }
    }
    s.send(&n.to_le_bytes())?;
    s.shutdown_send()
}

fn echo(s: &dyn LaneStream) -> io::Result<()> {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match s.recv(&mut buf)? {
            0 => return s.shutdown_send(),
            k => send_all(s, &buf[..k])?,
        }
    }
}

/// Round trips of `size`-byte messages; returns sorted latencies in µs.
fn latency(s: &dyn LaneStream, size: usize, iters: u64) -> io::Result<Vec<f64>> {
    let msg = vec![7u8; size];
    let mut back = vec![0u8; size];
    let mut lat = Vec::with_capacity(iters as usize);
    for _ in 0..iters {
        let t0 = Instant::now();
        send_all(s, &msg)?;
        let mut got = 0;
        while got < size {
            match s.recv(&mut back[got..])? {
                0 => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "echo closed")),
                k => got += k,
            }
        }
        lat.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    lat.sort_by(f64::total_cmp);
    Ok(lat)
}

fn send_all(s: &dyn LaneStream, mut b: &[u8]) -> io::Result<()> {
    while !b.is_empty() {
        let n = s.send(b)?;
        b = &b[n..];
    }
    Ok(())
}

/// Sends `total` bytes in `size`-byte writes on each of `streams` streams
/// and waits for every sink's count: returns bytes/s over the whole run.
fn bench_rdma(
    t: &RdmaTransport,
    peer: SocketAddr,
    size: usize,
    total: u64,
    streams: u64,
) -> io::Result<f64> {
    let opened: Vec<Arc<dyn LaneStream>> = (0..streams)
        .map(|i| t.open(peer, key(i, 2)).map(Arc::from))
        .collect::<io::Result<_>>()?;
    let t0 = Instant::now();
    let workers: Vec<_> = opened
        .into_iter()
        .map(|s| {
            thread::spawn(move || -> io::Result<u64> {
                let buf = vec![0x5au8; size];
                let mut sent = 0u64;
                while sent < total {
                    let n = (total - sent).min(size as u64) as usize;
                    send_all(&*s, &buf[..n])?;
                    sent += n as u64;
                }
                s.shutdown_send()?;
                let mut c = [0u8; 8];
                let mut got = 0;
                while got < 8 {
                    match s.recv(&mut c[got..])? {
                        0 => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "no count")),
                        k => got += k,
                    }
                }
                Ok(u64::from_le_bytes(c))
            })
        })
        .collect();
    let mut bytes = 0;
    for w in workers {
        let n = w
            .join()
            .map_err(|_| io::Error::other("worker panicked"))??;
        if n != total {
            return Err(io::Error::other(format!(
                "sink counted {n} of {total} bytes"
            )));
        }
        bytes += n;
    }
    Ok(bytes as f64 / t0.elapsed().as_secs_f64())
}

fn bench_tcp(peer: SocketAddr, size: usize, total: u64) -> io::Result<f64> {
    let mut s = TcpStream::connect(peer)?;
    s.set_nodelay(true)?;
    let buf = vec![0x5au8; size];
    let t0 = Instant::now();
    let mut sent = 0u64;
    while sent < total {
        let n = (total - sent).min(size as u64) as usize;
        s.write_all(&buf[..n])?;
        sent += n as u64;
    }
    s.shutdown(std::net::Shutdown::Write)?;
    let mut c = [0u8; 8];
    s.read_exact(&mut c)?;
    let n = u64::from_le_bytes(c);
    if n != total {
        return Err(io::Error::other(format!("TCP sink counted {n} of {total}")));
    }
    Ok(total as f64 / t0.elapsed().as_secs_f64())
}

fn tcp_serve(listen: SocketAddr) -> io::Result<()> {
    let l = TcpListener::bind(listen)?;
    println!("@@READY tcp {}", l.local_addr()?);
    for c in l.incoming() {
        let mut c = c?;
        thread::spawn(move || -> io::Result<()> {
            let mut buf = vec![0u8; 1 << 20];
            let mut n = 0u64;
            loop {
                match c.read(&mut buf)? {
                    0 => break,
                    k => n += k as u64,
                }
            }
            c.write_all(&n.to_le_bytes())
        });
    }
    Ok(())
}

fn run() -> io::Result<bool> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let cmd = argv.first().cloned().unwrap_or_default();
    let a = Args(argv);
    match cmd.as_str() {
        "probe" => {
            let dev = a.get("--device").unwrap_or("rxe0");
            match VerbsProvider::open(dev, 1, a.num("--gid-index", 1) as u32) {
                Ok(p) => println!(
                    "@@PROBE {{\"ok\":true,\"device\":\"{}\",\"mtu\":{}}}",
                    p.device(),
                    p.active_mtu()
                ),
                Err(e) => println!("@@PROBE {{\"ok\":false,\"error\":{:?}}}", e.to_string()),
            }
            Ok(true)
        }
        "serve" => {
            let t = Arc::new(transport(&a, a.addr("--listen"))?);
            println!("@@READY rdma {}", t.local_addr());
            loop {
                let (k, s) = t.accept()?;
                println!("@@ACCEPTED {} op {}", k.client, k.server.port());
                thread::spawn(move || serve_stream(k, s));
            }
        }
        "check" => {
            let t = transport(&a, "0.0.0.0:0".parse().unwrap())?;
            let peer = a.addr("--peer");
            let n = a.num("--streams", 16);
            let t0 = Instant::now();
            let workers: Vec<_> = (0..n)
                .map(|i| {
                    let s = t.open(peer, key(i, 1));
                    thread::spawn(move || exchange(Arc::from(s?), check_spec(i, true)))
                })
                .collect();
            let mut ok = true;
            let (mut up, mut down) = (0, 0);
            for (i, w) in workers.into_iter().enumerate() {
                match w.join().map_err(|_| io::Error::other("panicked"))? {
                    Ok(r) => {
                        up += r.sent;
                        down += r.received;
                    }
                    Err(e) => {
                        ok = false;
                        eprintln!("stream {i}: {e}");
                    }
                }
            }
            println!(
                "@@CHECK {{\"ok\":{ok},\"streams\":{n},\"sent\":{up},\"received\":{down},\"seconds\":{:.2},\"stats\":{}}}",
                t0.elapsed().as_secs_f64(),
                serde_json::to_string(&t.stats()).unwrap()
            );
            Ok(ok)
        }
        "bench" => {
            let t = transport(&a, "0.0.0.0:0".parse().unwrap())?;
            let (size, total, streams) = (
                a.num("--size", 65536) as usize,
                a.num("--total", 64 << 20),
                a.num("--streams", 1),
            );
            let direct = a.has("--direct");
            let bps = if direct {
                bench_direct(&t, a.addr("--peer"), size, total)?
            } else {
                bench_rdma(&t, a.addr("--peer"), size, total, streams)?
            };
            println!("@@BENCH {{\"lane\":\"rdma\",\"direct\":{direct},\"size\":{size},\"streams\":{streams},\"bytes_per_sec\":{bps:.0}}}");
            Ok(true)
        }
        "lat" => {
            let t = transport(&a, "0.0.0.0:0".parse().unwrap())?;
            let s = t.open(a.addr("--peer"), key(0, 4))?;
            let (size, iters) = (a.num("--size", 2) as usize, a.num("--iters", 1000));
            let lat = latency(&*s, size.max(1), iters.max(1))?;
            let pct = |p: f64| lat[((lat.len() - 1) as f64 * p) as usize];
            println!(
                "@@LAT {{\"lane\":\"rdma\",\"size\":{size},\"iters\":{iters},\"p50_us\":{:.1},\"p99_us\":{:.1}}}",
                pct(0.5),
                pct(0.99)
            );
            s.shutdown_send()?;
            Ok(true)
        }
        "tcp-serve" => tcp_serve(a.addr("--listen")).map(|_| true),
        "tcp-bench" => {
            let (size, total) = (a.num("--size", 65536) as usize, a.num("--total", 64 << 20));
            let bps = bench_tcp(a.addr("--peer"), size, total)?;
            println!("@@BENCH {{\"lane\":\"tcp\",\"size\":{size},\"streams\":1,\"bytes_per_sec\":{bps:.0}}}");
            Ok(true)
        }
        "wait-reset" => {
            let t = transport(&a, "0.0.0.0:0".parse().unwrap())?;
            let s = t.open(a.addr("--peer"), key(0, 3))?;
            send_all(&*s, b"hello")?;
            println!("@@WAITING");
            let t0 = Instant::now();
            let mut b = [0u8; 16];
            let outcome = match s.recv(&mut b) {
                Ok(0) => "eof".to_string(),
                Ok(n) => format!("data {n}"),
                Err(e) => format!("{:?}", e.kind()),
            };
            println!(
                "@@RESET {{\"outcome\":{outcome:?},\"after_ms\":{}}}",
                t0.elapsed().as_millis()
            );
            Ok(outcome == "ConnectionReset" || outcome == "eof")
        }
        _ => {
            die("usage: rdma-lane-bench probe|serve|check|bench|wait-reset|tcp-serve|tcp-bench ...")
        }
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("rdma-lane-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
