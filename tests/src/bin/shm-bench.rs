//! shm-bench: the shared-memory lane benchmark, and the traffic programs
//! the shm e2e tests run in pods. Plain `std` sockets: under
//! `LD_PRELOAD=libflowlane_preload.so` its TCP goes through the library
//! like any unmodified program's.
//!
//! Programs (run in pods):
//!   shm-bench serve PORT | serve-unix PATH     accept loop, one thread per connection
//!   shm-bench stream ADDR SIZE BYTES           one-way stream, prints GB/s and CPU s/GB
//!   shm-bench pingpong ADDR SIZE ITERS         prints one-way latency p50/p99 (RTT/2) and
//!                                              request/responses per second
//!   shm-bench connrate ADDR N                  connect + 1-byte echo + close, prints conn/s
//!                                              and p50/p99 us of connect + first byte
//!   shm-bench integrity ADDR BYTES SEED        random sizes, both directions, checksummed
//!   shm-bench idle ADDR N CARRY MSG DIR        N connections carry CARRY bytes each, then
//!                                              idle until DIR/go (module `memory_bench`)
//!   shm-bench ceiling SIZE                     the hardware reference (module `ceiling`)
//! ADDR is ip:port, or unix:PATH for AF_UNIX.
//!
//! The benchmark (root): `shm-bench bench [--quick]` builds a node (two pods
//! wired by the real plugin, flowlaned), runs every figure over the shm
//! lane, plain TCP over veth and AF_UNIX in the same run, plus iperf3 and
//! sockperf with and without the library, and the fallback path's overhead
//! (library loaded, connection stays on TCP) against plain TCP, and prints
//! tables with ratios, and the hardware ceiling of the two cores next to
//! them (`ceiling`). `bench --stream` runs just the 64 KiB and 1 MiB stream
//! rows and the ceiling; `bench --setup` just the connection set-up figures
//! (module `setup_bench`: pod to pod, pod to a host outside every pod
//! network, request/response rates, the fallback path's first byte);
//! `bench --memory` the memory of 1,000 idle connections beside the 64 KiB
//! stream and request/response rates (module `memory_bench`);
//! `bench --relay-setup` the connection set-up across two nodes through the
//! relay (module `relay_setup_bench`).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

trait Conn: Read + Write + Send {
    fn shutdown_write(&self);
}
impl Conn for TcpStream {
    fn shutdown_write(&self) {
        let _ = self.shutdown(std::net::Shutdown::Write);
    }
}
impl Conn for UnixStream {
    fn shutdown_write(&self) {
        let _ = self.shutdown(std::net::Shutdown::Write);
    }
}

fn dial(addr: &str) -> Box<dyn Conn> {
    match addr.strip_prefix("unix:") {
        Some(p) => Box::new(UnixStream::connect(p).expect("connect unix")),
        None => {
            let s = TcpStream::connect(addr).expect("connect tcp");
            s.set_nodelay(true).unwrap();
            Box::new(s)
        }
    }
}

/// CPU seconds (user + system) of the calling thread.
fn thread_cpu() -> f64 {
    // SAFETY: rusage is plain old data and getrusage fills it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to a local rusage.
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// FNV-1a over 8-byte words (and the tail): cheap, order-sensitive.
#[derive(Clone, Copy)]
struct Sum(u64, u64);
impl Sum {
    fn new() -> Sum {
        Sum(0xcbf2_9ce4_8422_2325, 0)
    }
    fn update(&mut self, b: &[u8]) {
        for &x in b {
            self.0 = (self.0 ^ x as u64).wrapping_mul(0x100_0000_01b3);
        }
        self.1 += b.len() as u64;
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn handle(mut c: Box<dyn Conn>) {
    let mut mode = [0u8; 1];
    if c.read_exact(&mut mode).is_err() {
        return;
    }
    let mut buf = vec![0u8; 1 << 20];
    match mode[0] {
        // Sink: count bytes until EOF, reply with the count and our CPU time.
        b'S' => {
            let cpu0 = thread_cpu();
            let mut n = 0u64;
            loop {
                match c.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(k) => n += k as u64,
                }
            }
            let cpu = thread_cpu() - cpu0;
            let _ = c.write_all(&n.to_le_bytes());
            let _ = c.write_all(&cpu.to_le_bytes());
        }
        // Echo until EOF (ping-pong, integrity, connection rate).
        b'E' => loop {
            match c.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(k) => {
                    if c.write_all(&buf[..k]).is_err() {
                        break;
                    }
                }
            }
        },
        _ => {}
    }
}

fn serve_tcp(port: u16) {
    flowlane_e2e::shm::raise_fd_limit();
    let l = TcpListener::bind(("0.0.0.0", port)).expect("bind");
    for c in l.incoming().flatten() {
        let _ = c.set_nodelay(true);
        std::thread::spawn(move || handle(Box::new(c)));
    }
}

fn serve_unix(path: &str) {
    let _ = std::fs::remove_file(path);
    let l = UnixListener::bind(path).expect("bind unix");
    for c in l.incoming().flatten() {
        std::thread::spawn(move || handle(Box::new(c)));
    }
}

/// One-way stream of `total` bytes in `size`-byte writes. Prints
/// `stream <GB/s> <client cpu s> <server cpu s>`.
fn stream(addr: &str, size: usize, total: u64) {
    let mut c = dial(addr);
    c.write_all(b"S").unwrap();
    let buf = vec![7u8; size];
    let cpu0 = thread_cpu();
    let t0 = Instant::now();
    let mut sent = 0u64;
    while sent < total {
        c.write_all(&buf).unwrap();
        sent += size as u64;
    }
    c.shutdown_write();
    let mut reply = [0u8; 16];
    c.read_exact(&mut reply).unwrap();
    let secs = t0.elapsed().as_secs_f64();
    let got = u64::from_le_bytes(reply[..8].try_into().unwrap());
    let srv_cpu = f64::from_le_bytes(reply[8..].try_into().unwrap());
    assert_eq!(got, sent, "server counted a different byte total");
    println!(
        "stream {:.3} {:.3} {:.3}",
        sent as f64 / secs / 1e9,
        thread_cpu() - cpu0,
        srv_cpu
    );
}

/// Ping-pong of `size`-byte messages. Prints `pingpong <p50 us> <p99 us>` (one way).
fn pingpong(addr: &str, size: usize, iters: usize) {
    let mut c = dial(addr);
    c.write_all(b"E").unwrap();
    let out = vec![1u8; size];
    let mut inb = vec![0u8; size];
    let mut lat = Vec::with_capacity(iters);
    let mut measured = Duration::ZERO;
    for i in 0..iters + iters / 10 {
        let t0 = Instant::now();
        c.write_all(&out).unwrap();
        c.read_exact(&mut inb).unwrap();
        if i >= iters / 10 {
            let took = t0.elapsed();
            measured += took;
            lat.push(took.as_nanos() as f64 / 2000.0);
        }
    }
    let rate = lat.len() as f64 / measured.as_secs_f64();
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "pingpong {:.2} {:.2} {:.0}",
        lat[lat.len() / 2],
        lat[lat.len() * 99 / 100],
        rate
    );
}

/// `n` connections one after another, each echoing one byte. Prints
/// `connrate <conn/s> <p50 us> <p99 us>`, the latter two of connect + first
/// echoed byte per connection (close not included).
fn connrate(addr: &str, n: usize) {
    let t0 = Instant::now();
    let mut lat = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let mut c = dial(addr);
        c.write_all(b"Ex").unwrap();
        let mut b = [0u8; 1];
        c.read_exact(&mut b).unwrap();
        lat.push(t.elapsed().as_nanos() as f64 / 1000.0);
    }
    let secs = t0.elapsed().as_secs_f64();
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
    // p90 last: the figure indices of earlier pages stay as they were.
    println!(
        "connrate {:.0} {:.1} {:.1} {:.1}",
        n as f64 / secs,
        lat[lat.len() / 2],
        lat[lat.len() * 99 / 100],
        lat[lat.len() * 9 / 10]
    );
}

/// `total` bytes each way at once, random write/read sizes, checksummed
/// against the echo. Prints `integrity ok <bytes>`.
fn integrity(addr: &str, total: u64, seed: u64) {
    assert!(!addr.starts_with("unix:"), "integrity runs over TCP");
    let mut r = TcpStream::connect(addr).expect("connect tcp");
    // try_clone is fcntl(F_DUPFD_CLOEXEC): the writer thread uses an alias fd.
    let mut w = r.try_clone().expect("dup");
    w.write_all(b"E").unwrap();
    let writer = std::thread::spawn(move || {
        let mut rng = Rng(seed | 1);
        let mut sum = Sum::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut sent = 0u64;
        while sent < total {
            let len = ((rng.next() % (1 << 20)) as usize + 1).min((total - sent) as usize);
            for (i, b) in buf[..len].iter_mut().enumerate() {
                *b = (sent + i as u64).wrapping_mul(seed | 1).to_le_bytes()[3];
            }
            w.write_all(&buf[..len]).unwrap();
            sum.update(&buf[..len]);
            sent += len as u64;
        }
        let _ = w.shutdown(std::net::Shutdown::Write);
        sum
    });
    let mut rng = Rng(seed.wrapping_mul(3) | 1);
    let mut sum = Sum::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let want = (rng.next() % (1 << 20)) as usize + 1;
        match r.read(&mut buf[..want]) {
            Ok(0) => break,
            Ok(k) => sum.update(&buf[..k]),
            Err(e) => panic!("read: {e}"),
        }
    }
    let sent = writer.join().unwrap();
    assert_eq!(sent.1, total);
    assert_eq!(sum.1, total, "echo length");
    assert_eq!(sum.0, sent.0, "echo checksum");
    println!("integrity ok {total}");
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let a = |i: usize| args.get(i).map(String::as_str).unwrap_or_else(|| usage());
    // The benchmarks' daemon logs as in production (info), not as in
    // tests (debug): per-connection debug lines would be measured as
    // set-up cost.
    if a(1) == "bench" && std::env::var_os("FLS_DAEMON_LOG").is_none() {
        std::env::set_var("FLS_DAEMON_LOG", "info");
    }
    match a(1) {
        "serve" => serve_tcp(a(2).parse().unwrap()),
        "serve-unix" => serve_unix(a(2)),
        "stream" => stream(a(2), a(3).parse().unwrap(), a(4).parse().unwrap()),
        "pingpong" => pingpong(a(2), a(3).parse().unwrap(), a(4).parse().unwrap()),
        "connrate" => connrate(a(2), a(3).parse().unwrap()),
        "integrity" => integrity(a(2), a(3).parse().unwrap(), a(4).parse().unwrap()),
        "idle" => memory_bench::idle_client(
            a(2),
            a(3).parse().unwrap(),
            a(4).parse().unwrap(),
            a(5).parse().unwrap(),
            a(6),
        ),
        "bench" if args.iter().any(|x| x == "--memory") => {
            memory_bench::run(args.iter().any(|x| x == "--quick"))
        }
        "bench" if args.iter().any(|x| x == "--setup") => {
            setup_bench::run(args.iter().any(|x| x == "--quick"))
        }
        "bench" if args.iter().any(|x| x == "--relay-setup") => {
            relay_setup_bench::run(args.iter().any(|x| x == "--quick"))
        }
        "bench" => bench::run(
            args.iter().any(|x| x == "--quick"),
            args.iter().any(|x| x == "--stream"),
        ),
        "ceiling" => ceiling::print(a(2).parse().unwrap()),
        _ => usage(),
    }
}

fn usage() -> ! {
    eprintln!("usage: shm-bench serve PORT | serve-unix PATH | stream ADDR SIZE BYTES | pingpong ADDR SIZE ITERS | connrate ADDR N | integrity ADDR BYTES SEED | idle ADDR N CARRY MSG DIR | ceiling SIZE | bench [--quick] [--stream | --setup | --relay-setup | --memory]");
    std::process::exit(2)
}

/// The median of one figure's rounds (robust against a round hit by other
/// load).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs one of this program's client commands (`cmd`, set up in its pod)
/// within `timeout` and returns the figures of its output line: every
/// number after the first word.
fn figures_of(cmd: std::process::Command, timeout: Duration, what: &str) -> Vec<f64> {
    flowlane_e2e::shm::run_ok(cmd, timeout, what)
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect()
}

#[path = "shm-bench/setup_bench.rs"]
mod setup_bench;

#[path = "shm-bench/memory_bench.rs"]
mod memory_bench;

#[path = "shm-bench/relay_setup_bench.rs"]
mod relay_setup_bench;

mod bench {
    use super::{median, Duration};
    use flowlane_e2e::shm::{run_ok, wait_listening, Bg, Node};

    const T: Duration = Duration::from_secs(300);

    #[derive(Clone, Copy, PartialEq)]
    enum Lane {
        Shm,
        Tcp,
        Unix,
    }

    fn prog(node: &Node, lane: Lane, server: bool, args: &[&str]) -> std::process::Command {
        let me = std::env::current_exe().unwrap();
        let me = me.to_str().unwrap();
        let pod = if server && lane != Lane::Unix {
            &node.pods[1]
        } else {
            &node.pods[0]
        };
        let mut argv = vec![me];
        argv.extend_from_slice(args);
        node.cmd(pod, lane == Lane::Shm, &argv)
    }

    fn client(node: &Node, lane: Lane, args: &[&str]) -> Vec<f64> {
        let out = run_ok(
            prog(node, lane, false, args),
            T,
            &format!("shm-bench {args:?}"),
        );
        out.split_whitespace()
            .skip(1)
            .filter_map(|x| x.parse().ok())
            .collect()
    }

    /// `stream_only`: just the 64 KiB and 1 MiB stream rows and the
    /// hardware ceiling (a quick look while tuning the ring).
    pub fn run(quick: bool, stream_only: bool) {
        // A held node (experiments by hand) gets its own names, so a
        // benchmark run next to it does not replace its pods.
        let hold = std::env::var_os("SHM_BENCH_HOLD").is_some();
        let node = Node::new(if hold { "hold" } else { "bench" }, 2);
        let sock = node.dir.join("bench.sock");
        let sock = sock.to_str().unwrap().to_string();
        let _tcp = Bg::spawn(prog(&node, Lane::Tcp, true, &["serve", "7100"]));
        let _shm = Bg::spawn(prog(&node, Lane::Shm, true, &["serve", "7101"]));
        let _unix = Bg::spawn(prog(&node, Lane::Unix, true, &["serve-unix", &sock]));
        wait_listening(&node.pods[1], 7100);
        wait_listening(&node.pods[1], 7101);
        let ip = node.pods[1].ip;
        let addr = |lane| match lane {
            Lane::Tcp => format!("{ip}:7100"),
            Lane::Shm => format!("{ip}:7101"),
            Lane::Unix => format!("unix:{sock}"),
        };
        if hold {
            // Keeps the node up for experiments by hand until stdin closes.
            println!(
                "hold: client netns {} server netns {} ip {ip} socket {} preload {}",
                node.pods[0].netns,
                node.pods[1].netns,
                node.socket().display(),
                flowlane_e2e::shm::preload_lib().display()
            );
            let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new());
            return;
        }
        let lanes = [Lane::Shm, Lane::Tcp, Lane::Unix];
        let scale = if quick { 1 } else { 4 };
        println!("flowlane shared-memory lane benchmark (same run; ratios are shm vs plain TCP over veth)");
        println!("stream figures: median of 3 rounds alternating the lanes; latency: p50/p99 of all round trips");
        println!(
            "pod wiring: {}; ring size: FLOWLANE_RING_SIZE default 1 MiB per direction",
            node.wiring
        );
        println!();
        println!(
            "{:<34} {:>12} {:>12} {:>12} {:>9}",
            "figure", "shm", "tcp(veth)", "af_unix", "shm/tcp"
        );
        let row = |name: &str, v: [f64; 3], better_low: bool| {
            let ratio = if better_low { v[1] / v[0] } else { v[0] / v[1] };
            println!(
                "{name:<34} {:>12.2} {:>12.2} {:>12.2} {:>8.1}x",
                v[0], v[1], v[2], ratio
            );
        };
        let mut cpu = [0.0f64; 3];
        let mut gbs64 = [0.0f64; 3];
        // Each stream figure is the median of ROUNDS rounds that alternate
        // the lanes, so one lane is not measured alone in a burst of other
        // load on this shared machine.
        const ROUNDS: usize = 3;
        let sizes: &[usize] = if stream_only {
            &[65536, 1 << 20]
        } else {
            &[64, 1024, 65536, 1 << 20]
        };
        let mut tcp_gbs = Vec::new();
        for &size in sizes {
            let total: u64 = match size {
                64 => 64 << 20,
                1024 => 512 << 20,
                _ => 2 << 30,
            } * scale
                / 4;
            let mut gbs: [Vec<f64>; 3] = Default::default();
            let mut cpus: [Vec<f64>; 3] = Default::default();
            for _ in 0..ROUNDS {
                for (i, lane) in lanes.iter().enumerate() {
                    let r = client(
                        &node,
                        *lane,
                        &[
                            "stream",
                            &addr(*lane),
                            &size.to_string(),
                            &total.to_string(),
                        ],
                    );
                    gbs[i].push(r[0]);
                    cpus[i].push((r[1] + r[2]) / (total as f64 / 1e9));
                }
            }
            let v = gbs.map(median);
            tcp_gbs.push((size, v[0], v[1]));
            if size == 65536 {
                cpu = cpus.map(median);
                gbs64 = v;
            }
            row(&format!("stream GB/s, {size} B messages"), v, false);
        }
        row("CPU s per GB (64 KiB stream)", cpu, true);
        // Cores kept busy by the two ends (CPU s per GB x GB/s): below 2
        // means the ends took turns (sleep/wake) instead of overlapping.
        let busy = [0, 1, 2].map(|i| cpu[i] * gbs64[i]);
        println!(
            "{:<34} {:>12.2} {:>12.2} {:>12.2}",
            "cores busy, of 2 (64 KiB stream)", busy[0], busy[1], busy[2]
        );
        ceiling_rows(&tcp_gbs);
        if stream_only {
            return;
        }
        for size in [64usize, 4096] {
            let iters = (20_000 * scale as usize).to_string();
            let mut p50 = [0.0; 3];
            let mut p99 = [0.0; 3];
            for (i, lane) in lanes.iter().enumerate() {
                let r = client(
                    &node,
                    *lane,
                    &["pingpong", &addr(*lane), &size.to_string(), &iters],
                );
                p50[i] = r[0];
                p99[i] = r[1];
            }
            row(&format!("ping-pong one-way p50 us, {size} B"), p50, true);
            row(&format!("ping-pong one-way p99 us, {size} B"), p99, true);
        }
        let mut rate = [0.0; 3];
        for (i, lane) in lanes.iter().enumerate() {
            rate[i] = client(
                &node,
                *lane,
                &["connrate", &addr(*lane), &(500 * scale).to_string()],
            )[0];
        }
        row("connections per second", rate, false);
        let st = node.stats();
        if let Some(l) = st.lanes.get("shm") {
            println!(
                "\ndaemon: shm connections opened {}, closed {}, bytes {}",
                l.connections_opened, l.connections_closed, l.bytes
            );
        }
        fallback(&node, quick);
        third_party(&node);
    }

    /// The hardware ceiling (see `ceiling`) next to the lane and TCP figures
    /// of this run: how far the lane is from what the two cores can do, and
    /// what ratio to TCP the hardware allows at all.
    fn ceiling_rows(runs: &[(usize, f64, f64)]) {
        println!();
        println!("hardware ceiling (same run; threads pinned to cores 0/1, spin only, no syscalls, best of 5)");
        println!(
            "{:<44} {:>8} {:>8} {:>9}",
            "reference", "GB/s", "x tcp", "shm/ref"
        );
        // The large-message rows only: the goal is stated at 64 KiB, and
        // small messages are bound by per-call costs, not by the cores.
        for &(size, shm, tcp) in runs.iter().filter(|r| r.0 >= 65536) {
            for (name, v) in crate::ceiling::figures(size) {
                println!(
                    "{:<44} {:>8.2} {:>7.1}x {:>8.0}%",
                    format!("{name}, {size} B"),
                    v,
                    v / tcp,
                    shm / v * 100.0
                );
            }
        }
        println!(
            "futex wake-up, one way (what a sleeping side costs): {:.1} us; cache line round trip between the cores: {:.0} ns",
            crate::ceiling::futex_wakeup_us(),
            crate::ceiling::line_round_trip_ns()
        );
    }

    /// The fallback path's overhead: plain TCP between the
    /// two pods without the library, against connections that stay on TCP
    /// with the library loaded on both sides. Two fallback causes: the
    /// server's library is switched off (`FLOWLANE_DISABLE=1`, so the peer
    /// has no flowlane listener), and no daemon at `FLOWLANE_SOCKET`. Runs
    /// alternate between the variants and each figure is the median of
    /// rounds, so slow phases of the (shared) machine hit all of them.
    fn fallback(node: &Node, quick: bool) {
        let (c, s) = (&node.pods[0], &node.pods[1]);
        let me = std::env::current_exe().unwrap();
        let me = me.to_str().unwrap();
        let _off = Bg::spawn(node.cmd(s, true, &["FLOWLANE_DISABLE=1", me, "serve", "7102"]));
        wait_listening(s, 7102);
        let ip = s.ip;
        let nodaemon = format!("FLOWLANE_SOCKET={}", node.dir.join("absent.sock").display());
        // (preload, extra env, port) per variant: no lib; lib, peer off; lib, no daemon.
        let variants: [(bool, Option<&str>, u16); 3] = [
            (false, None, 7100),
            (true, None, 7102),
            (true, Some(nodaemon.as_str()), 7100),
        ];
        let total: u64 = if quick { 512 << 20 } else { 2 << 30 };
        let conns = if quick { "300" } else { "1000" };
        let rounds = if quick { 3 } else { 5 };
        let mut gbs = vec![Vec::new(); 3];
        let mut p50 = vec![Vec::new(); 3];
        let mut rate = vec![Vec::new(); 3];
        for _ in 0..rounds {
            for (i, (pre, env, port)) in variants.iter().enumerate() {
                let addr = format!("{ip}:{port}");
                let run = |args: &[&str]| -> Vec<f64> {
                    let mut argv: Vec<&str> = env.iter().copied().collect();
                    argv.push(me);
                    argv.extend_from_slice(args);
                    let out = run_ok(node.cmd(c, *pre, &argv), T, &format!("shm-bench {args:?}"));
                    out.split_whitespace()
                        .skip(1)
                        .filter_map(|x| x.parse().ok())
                        .collect()
                };
                gbs[i].push(run(&["stream", &addr, "65536", &total.to_string()])[0]);
                let r = run(&["connrate", &addr, conns]);
                rate[i].push(r[0]);
                p50[i].push(r[1]);
            }
        }
        let gbs: Vec<f64> = gbs.into_iter().map(median).collect();
        let p50: Vec<f64> = p50.into_iter().map(median).collect();
        let rate: Vec<f64> = rate.into_iter().map(median).collect();
        println!();
        println!("fallback path (connection stays on TCP; median of {rounds} alternating rounds)");
        println!(
            "{:<34} {:>12} {:>12} {:>9} {:>12} {:>9}",
            "figure", "no lib", "lib,peer off", "ratio", "lib,no dmn", "ratio"
        );
        let row = |name: &str, v: &[f64]| {
            println!(
                "{name:<34} {:>12.2} {:>12.2} {:>8.3}x {:>12.2} {:>8.3}x",
                v[0],
                v[1],
                v[1] / v[0],
                v[2],
                v[2] / v[0]
            );
        };
        row("stream GB/s, 65536 B messages", &gbs);
        row("connect+1st byte p50 us", &p50);
        row("connections per second", &rate);
        println!(
            "connect+1st byte p50 added by the library: {:+.1} us (peer off), {:+.1} us (no daemon)",
            p50[1] - p50[0],
            p50[2] - p50[0]
        );
    }

    /// iperf3 and sockperf with and without the library.
    fn third_party(node: &Node) {
        let (c, s) = (&node.pods[0], &node.pods[1]);
        let ip = s.ip.to_string();
        println!();
        println!(
            "{:<34} {:>12} {:>12} {:>9}",
            "third-party program", "with lib", "without", "ratio"
        );
        let mut iperf = [0.0; 2];
        for (i, pre) in [true, false].into_iter().enumerate() {
            let port = if pre { "5301" } else { "5302" };
            let _srv = Bg::spawn(node.cmd(s, pre, &["iperf3", "-s", "-p", port]));
            wait_listening(s, port.parse().unwrap());
            let out = run_ok(
                node.cmd(
                    c,
                    pre,
                    &["iperf3", "-c", &ip, "-p", port, "-t", "4", "--json"],
                ),
                T,
                "iperf3",
            );
            let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
            iperf[i] = v["end"]["sum_received"]["bits_per_second"]
                .as_f64()
                .unwrap_or(0.0)
                / 1e9;
        }
        println!(
            "{:<34} {:>12.1} {:>12.1} {:>8.1}x",
            "iperf3 Gbit/s (1 stream)",
            iperf[0],
            iperf[1],
            iperf[0] / iperf[1]
        );
        let mut lat = [0.0; 2];
        let mut lat99 = [0.0; 2];
        for (i, pre) in [true, false].into_iter().enumerate() {
            let port = if pre { "11111" } else { "11112" };
            let _srv = Bg::spawn(node.cmd(
                s,
                pre,
                &["sockperf", "server", "--tcp", "-i", &ip, "-p", port],
            ));
            wait_listening(s, port.parse().unwrap());
            let out = run_ok(
                node.cmd(
                    c,
                    pre,
                    &[
                        "sockperf",
                        "ping-pong",
                        "--tcp",
                        "-i",
                        &ip,
                        "-p",
                        port,
                        "-t",
                        "3",
                        "-m",
                        "64",
                        // Unpaced over the lane (~3M round trips/s) sockperf
                        // overran its sequence table ("_seqN >
                        // m_maxSequenceNo"); plain TCP stays far below this.
                        "--mps",
                        "1000000",
                    ],
                ),
                T,
                "sockperf",
            );
            let pct = |p: &str| {
                out.lines()
                    .find(|l| l.contains(&format!("{p} =")))
                    .and_then(|l| l.split('=').nth(1))
                    .and_then(|x| x.trim().parse().ok())
                    .unwrap_or(f64::NAN)
            };
            lat[i] = pct("50.000");
            lat99[i] = pct("99.000");
        }
        // sockperf reports half the round trip (one way), like our ping-pong.
        for (name, v) in [
            ("sockperf p-p p50 us (64 B, ≤1M/s)", lat),
            ("sockperf p-p p99 us (64 B, ≤1M/s)", lat99),
        ] {
            println!(
                "{:<34} {:>12.2} {:>12.2} {:>8.1}x",
                name,
                v[0],
                v[1],
                v[1] / v[0]
            );
        }
    }
}

/// The hardware reference for the stream figures: what these two cores can
/// move through shared memory at all, measured with the tightest code:
/// threads pinned to cores 0 and 1 (SCHED_FIFO when allowed, see `pin`),
/// two MAP_SHARED mappings of one memfd as two processes would have, spin
/// only, no syscalls, no library. Same message shape as the `stream`
/// figures: the writer sends `msg`-byte messages from its own buffer, the
/// reader reads into a 1 MiB buffer (as `serve` does), both buffers 16 bytes
/// past a page boundary as glibc's malloc places them.
///
/// - two-copy, lane ring: the lane's own `Producer`/`Consumer` (ring.rs,
///   1 MiB ring) in a spin loop: the two copies of the lane, nothing else.
/// - two-copy, minimal ring: a bare SPSC byte ring (head and tail on their
///   own lines, peer index cached, publish every 64 KiB) as a cross-check.
/// - one-copy: the reader copies from a shared buffer the writer filled
///   once (no second copy, no cross-core handover): the reader's copy alone.
/// - memcpy, one core: two cache-resident private buffers.
/// - memcpy, both cores at once: shows whether the two virtual CPUs really
///   ran in parallel during the run.
/// - futex wake-up: one-way latency of waking a thread that sleeps on a
///   futex (threads not pinned): what a sleeping side of the lane costs.
/// - cache line round trip between the pinned cores: the price of each
///   handover of a line. On this VM it depends on where the host places
///   the two virtual CPUs (several times cheaper on one core complex than
///   across; figures: docs/benchmarks/2026-11-30-hardware-ceiling.md), and
///   the two-copy figures follow it.
mod ceiling {
    use flowlane_lane::ring::{self, Side};
    use std::os::fd::AsFd;
    use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
    use std::time::Instant;

    #[repr(C, align(128))]
    struct Line(AtomicU64);

    /// A memfd of `len` bytes mapped twice (one mapping per "process").
    struct Shared {
        maps: [*mut u8; 2],
        len: usize,
    }

    impl Shared {
        fn new(len: usize) -> Shared {
            // SAFETY: memfd_create with a valid C string.
            let fd = unsafe { libc::memfd_create(c"ceiling".as_ptr(), libc::MFD_CLOEXEC) };
            assert!(fd >= 0, "memfd_create");
            // SAFETY: fd is ours.
            assert_eq!(unsafe { libc::ftruncate(fd, len as libc::off_t) }, 0);
            let map = || {
                // SAFETY: a fresh shared mapping of the memfd.
                let p = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        len,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_SHARED | libc::MAP_POPULATE,
                        fd,
                        0,
                    )
                };
                assert_ne!(p, libc::MAP_FAILED, "mmap");
                p as *mut u8
            };
            let maps = [map(), map()];
            // SAFETY: the mappings keep the memory alive.
            unsafe { libc::close(fd) };
            Shared { maps, len }
        }
    }

    impl Drop for Shared {
        fn drop(&mut self) {
            for m in self.maps {
                // SAFETY: our own mapping; its users (scoped threads) are done.
                unsafe { libc::munmap(m as *mut libc::c_void, self.len) };
            }
        }
    }

    /// A private buffer 16 bytes past a page boundary, touched once.
    struct Buf {
        ptr: *mut u8,
        len: usize,
        layout: std::alloc::Layout,
    }

    // SAFETY: an owned allocation, used by one thread at a time.
    unsafe impl Send for Buf {}

    impl Buf {
        fn new(len: usize) -> Buf {
            let layout = std::alloc::Layout::from_size_align(len + 4096, 4096).unwrap();
            // SAFETY: non-zero size.
            let base = unsafe { std::alloc::alloc(layout) };
            assert!(!base.is_null());
            // SAFETY: inside the allocation.
            let ptr = unsafe { base.add(16) };
            // SAFETY: [ptr, ptr+len) is inside the allocation.
            unsafe { std::ptr::write_bytes(ptr, 7, len) };
            Buf { ptr, len, layout }
        }

        fn slice(&mut self) -> &mut [u8] {
            // SAFETY: our allocation, initialised in new.
            unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
        }
    }

    impl Drop for Buf {
        fn drop(&mut self) {
            // SAFETY: allocated in new with this layout, 16 bytes before ptr.
            unsafe { std::alloc::dealloc(self.ptr.sub(16), self.layout) };
        }
    }

    /// A spin step; every 2^20th (milliseconds) yields, in case the peer
    /// is off its core after all.
    fn relax(spins: &mut u32) {
        *spins = spins.wrapping_add(1);
        if *spins % (1 << 20) == 0 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }

    /// Pins the calling thread to `cpu` and, when allowed (root), makes it
    /// SCHED_FIFO: a spin-only pipeline collapses whenever one side is
    /// descheduled (the other spins its whole slice), so on a shared machine
    /// the reference is measured undisturbed by other load
    /// (`CEILING_NO_RT=1` turns that off). The kernel's RT throttling (95%
    /// per second) still applies; each run is well under a second.
    fn pin(cpu: usize) {
        // SAFETY: cpu_set_t and sched_param are plain data; both calls act
        // on the calling thread only.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
            if std::env::var_os("CEILING_NO_RT").is_none() {
                let p = libc::sched_param { sched_priority: 1 };
                libc::sched_setscheduler(0, libc::SCHED_FIFO, &p);
            }
        }
    }

    /// Runs `writer` on core 0 and `reader` on core 1 (scoped threads, so
    /// the caller's scheduling is untouched); GB/s of `total` bytes.
    fn pair(total: u64, writer: impl FnOnce() + Send, reader: impl FnOnce() + Send) -> f64 {
        let barrier = std::sync::Barrier::new(2);
        // Each side times itself; the run spans from the earlier start to
        // the later end (a side held up before its first step counts).
        let timed = |f: &mut dyn FnMut()| {
            barrier.wait();
            let t0 = Instant::now();
            f();
            (t0, Instant::now())
        };
        let (w, r) = std::thread::scope(|s| {
            let w = s.spawn(|| {
                pin(0);
                let mut f = Some(writer);
                timed(&mut || (f.take().unwrap())())
            });
            let r = s.spawn(|| {
                pin(1);
                let mut f = Some(reader);
                timed(&mut || (f.take().unwrap())())
            });
            (w.join().unwrap(), r.join().unwrap())
        });
        let secs = w.1.max(r.1).duration_since(w.0.min(r.0)).as_secs_f64();
        total as f64 / secs / 1e9
    }

    /// The lane's ring (ring.rs) in a spin-only loop.
    fn lane_ring(msg: usize, total: u64) -> f64 {
        let len = ring::region_len_for(1 << 20);
        // Two mappings of one memfd, as the two processes have.
        let fd = flowlane_lane::region::sealed_memfd(len).unwrap();
        let map = || flowlane_lane::region::Region::map_memfd(fd.as_fd(), len).unwrap();
        let (mut tx, _) = map().endpoints(Side::Client);
        let (_, mut rx) = map().endpoints(Side::Server);
        let mut src = Buf::new(msg);
        let mut dst = Buf::new(1 << 20);
        pair(
            total,
            move || {
                let (src, mut spins, mut sent) = (src.slice(), 0u32, 0u64);
                while sent < total {
                    let mut off = 0;
                    while off < msg {
                        let n = tx.write(&src[off..]);
                        if n == 0 {
                            relax(&mut spins);
                        }
                        tx.take_reader_wakeup();
                        off += n;
                    }
                    sent += msg as u64;
                }
            },
            move || {
                let (dst, mut spins, mut got) = (dst.slice(), 0u32, 0u64);
                while got < total {
                    let n = rx.read(dst);
                    if n == 0 {
                        relax(&mut spins);
                    }
                    rx.take_writer_wakeup();
                    got += n as u64;
                }
            },
        )
    }

    /// A bare SPSC ring: tail and head on their own lines, 64 KiB publish.
    fn minimal_ring(msg: usize, total: u64) -> f64 {
        const RING: usize = 1 << 20;
        const CHUNK: usize = 64 << 10;
        let sh = Shared::new(4096 + RING);
        let (wp, rp) = (sh.maps[0] as usize, sh.maps[1] as usize);
        let mut src = Buf::new(msg);
        let mut dst = Buf::new(1 << 20);
        // (tail, head, data) of one mapping.
        let parts = |base: usize| {
            let b = base as *mut u8;
            // SAFETY: the two lines lie in the first page of the mapping,
            // the data area after it; the mapping outlives the threads.
            unsafe {
                (
                    &*(b as *const Line),
                    &*(b.add(128) as *const Line),
                    b.add(4096),
                )
            }
        };
        pair(
            total,
            move || {
                let (tail, head, data) = parts(wp);
                let src = src.slice();
                let (mut pos, mut head_cache, mut spins) = (0u64, 0u64, 0u32);
                while pos < total {
                    let mut off = 0;
                    while off < msg {
                        let n = CHUNK.min(msg - off);
                        while pos + n as u64 - head_cache > RING as u64 {
                            head_cache = head.0.load(Ordering::Acquire);
                            relax(&mut spins);
                        }
                        let at = pos as usize & (RING - 1);
                        let first = n.min(RING - at);
                        // SAFETY: [pos, pos+n) is free room; src holds msg bytes.
                        unsafe {
                            super::copy(data.add(at), src.as_ptr().add(off), first);
                            super::copy(data, src.as_ptr().add(off + first), n - first);
                        }
                        pos += n as u64;
                        off += n;
                        tail.0.store(pos, Ordering::Release);
                    }
                }
            },
            move || {
                let (tail, head, data) = parts(rp);
                let dst = dst.slice();
                let (mut pos, mut tail_cache, mut spins) = (0u64, 0u64, 0u32);
                while pos < total {
                    while tail_cache == pos {
                        tail_cache = tail.0.load(Ordering::Acquire);
                        relax(&mut spins);
                    }
                    // One "read call": what is there, up to the buffer.
                    let mut want = ((tail_cache - pos) as usize).min(dst.len());
                    let mut d = 0;
                    while want > 0 {
                        let n = want.min(CHUNK);
                        let at = pos as usize & (RING - 1);
                        let first = n.min(RING - at);
                        // SAFETY: [pos, pos+n) was published; dst has room.
                        unsafe {
                            super::copy(dst.as_mut_ptr().add(d), data.add(at), first);
                            super::copy(dst.as_mut_ptr().add(d + first), data, n - first);
                        }
                        pos += n as u64;
                        d += n;
                        want -= n;
                        head.0.store(pos, Ordering::Release);
                    }
                    // The copies must not be optimised away as dead stores.
                    std::hint::black_box(&mut *dst);
                }
            },
        )
    }

    /// The reader's copy alone: from a shared buffer filled once by the
    /// writer's core into the reader's buffer, `msg` bytes at a time.
    fn one_copy(msg: usize, total: u64) -> f64 {
        const LEN: usize = 1 << 20;
        let sh = Shared::new(LEN);
        let (w, r) = (sh.maps[0] as usize, sh.maps[1] as usize);
        let mut dst = Buf::new(1 << 20);
        pair(
            total,
            // The writer fills it once, before the reader starts (barrier).
            // SAFETY: the whole mapping.
            move || unsafe { std::ptr::write_bytes(w as *mut u8, 9, LEN) },
            move || {
                let dst = dst.slice();
                let mut pos = 0u64;
                while pos < total {
                    let at = pos as usize % LEN;
                    let n = msg.min(LEN - at);
                    // SAFETY: in bounds of both.
                    unsafe { super::copy(dst.as_mut_ptr(), (r as *const u8).add(at), n) };
                    std::hint::black_box(&mut *dst);
                    pos += n as u64;
                }
            },
        )
    }

    /// One core copying `msg` bytes between two private buffers.
    fn memcpy_one_core(msg: usize, total: u64) -> f64 {
        std::thread::scope(|s| s.spawn(|| memcpy_loop(1, msg, total)).join().unwrap())
    }

    /// Both cores copying at once (each its own buffers); the slower
    /// core's GB/s. Far below `memcpy_one_core` means the two virtual CPUs
    /// did not really run in parallel during this run (host contention),
    /// which caps every two-core figure.
    fn memcpy_both_cores(msg: usize, total: u64) -> f64 {
        std::thread::scope(|s| {
            let a = s.spawn(|| memcpy_loop(0, msg, total));
            let b = s.spawn(|| memcpy_loop(1, msg, total));
            a.join().unwrap().min(b.join().unwrap())
        })
    }

    /// On `cpu`: copies `msg` bytes between two private buffers until
    /// `total` bytes are copied; GB/s.
    fn memcpy_loop(cpu: usize, msg: usize, total: u64) -> f64 {
        {
            {
                let (mut src, mut dst) = (Buf::new(msg), Buf::new(msg));
                pin(cpu);
                let t0 = Instant::now();
                let mut done = 0;
                while done < total {
                    // SAFETY: both buffers hold msg bytes.
                    unsafe { super::copy(dst.slice().as_mut_ptr(), src.slice().as_ptr(), msg) };
                    std::hint::black_box(dst.slice());
                    done += msg as u64;
                }
                total as f64 / t0.elapsed().as_secs_f64() / 1e9
            }
        }
    }

    /// One core copying `msg`-byte pieces out of a 256 MiB buffer (far
    /// larger than the caches) into a private one: what a reader can pull
    /// from memory. A ring the writer fills with streaming stores is read
    /// from memory, so this bounds the lane when the vCPUs sit far apart
    /// (see docs/benchmarks/2026-11-30-streaming-stores.md).
    fn copy_from_memory(msg: usize, total: u64) -> f64 {
        std::thread::scope(|s| {
            s.spawn(|| {
                const SPAN: usize = 256 << 20;
                let msg = msg.min(SPAN);
                let (mut src, mut dst) = (Buf::new(SPAN), Buf::new(msg));
                pin(1);
                let t0 = Instant::now();
                let (mut done, mut at) = (0u64, 0usize);
                while done < total {
                    if at + msg > SPAN {
                        at = 0;
                    }
                    // SAFETY: [at, at + msg) lies inside src; dst holds msg bytes.
                    unsafe {
                        super::copy(dst.slice().as_mut_ptr(), src.slice().as_ptr().add(at), msg)
                    };
                    std::hint::black_box(dst.slice());
                    (done, at) = (done + msg as u64, at + msg);
                }
                total as f64 / t0.elapsed().as_secs_f64() / 1e9
            })
            .join()
            .unwrap()
        })
    }

    /// One-way futex wake-up latency in microseconds: two unpinned threads
    /// at normal priority hand a token back and forth, sleeping each time.
    pub fn futex_wakeup_us() -> f64 {
        let word = AtomicU32::new(0);
        let rounds = 2000u32;
        let wait = |v: u32| {
            while word.load(Ordering::Acquire) == v {
                // SAFETY: FUTEX_WAIT on a live, aligned word.
                unsafe {
                    libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, v, 0, 0, 0)
                };
            }
        };
        let wake = || {
            // SAFETY: FUTEX_WAKE on a live, aligned word.
            unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, 1, 0, 0, 0) };
        };
        let t0 = Instant::now();
        std::thread::scope(|s| {
            s.spawn(|| {
                for i in 0..rounds {
                    wait(2 * i);
                    word.store(2 * i + 2, Ordering::Release);
                    wake();
                }
            });
            for i in 0..rounds {
                word.store(2 * i + 1, Ordering::Release);
                wake();
                wait(2 * i + 1);
            }
        });
        t0.elapsed().as_secs_f64() * 1e6 / (2.0 * rounds as f64)
    }

    /// Round trip of one cache line between the two cores in nanoseconds
    /// (pinned threads take turns incrementing a shared counter): the
    /// price of every handover of a ring line or index.
    pub fn line_round_trip_ns() -> f64 {
        let line = Line(AtomicU64::new(0));
        let rounds = 200_000u64;
        let barrier = std::sync::Barrier::new(2);
        let play = |cpu: usize, me: u64| {
            pin(cpu);
            barrier.wait();
            let t0 = Instant::now();
            let mut spins = 0u32;
            for i in 0..rounds {
                while line.0.load(Ordering::Acquire) != 2 * i + me {
                    relax(&mut spins);
                }
                line.0.store(2 * i + me + 1, Ordering::Release);
            }
            t0.elapsed()
        };
        let t = std::thread::scope(|s| {
            let a = s.spawn(|| play(0, 0));
            s.spawn(|| play(1, 1));
            a.join().unwrap()
        });
        t.as_secs_f64() * 1e9 / rounds as f64
    }

    /// The best of `runs` (a ceiling: the least disturbed run).
    ///
    /// Each run is short (1 GiB) and followed by a 100 ms pause: SCHED_FIFO
    /// spinners hold both cores while they run (the kernel leaves other
    /// tasks only 5%), so everything else on the machine gets the cores
    /// back between runs.
    fn best(runs: usize, f: impl Fn() -> f64) -> f64 {
        (0..runs)
            .map(|_| {
                let v = f();
                std::thread::sleep(std::time::Duration::from_millis(100));
                v
            })
            .fold(0.0, f64::max)
    }

    /// `(name, GB/s)` rows for `msg`-byte messages, best of 5 runs each.
    pub fn figures(msg: usize) -> Vec<(&'static str, f64)> {
        let total: u64 = 1 << 30;
        vec![
            (
                "two-copy, lane ring, spin",
                best(5, || lane_ring(msg, total)),
            ),
            (
                "two-copy, minimal ring, spin",
                best(5, || minimal_ring(msg, total)),
            ),
            (
                "one-copy (reader copy only)",
                best(5, || one_copy(msg, total)),
            ),
            (
                "memcpy, one core, cached",
                best(5, || memcpy_one_core(msg, total)),
            ),
            (
                "memcpy, both cores at once (per core)",
                best(5, || memcpy_both_cores(msg, total)),
            ),
            (
                "copy out of memory (256 MiB source), one core",
                best(3, || copy_from_memory(msg, total)),
            ),
        ]
    }

    /// `shm-bench ceiling SIZE`.
    pub fn print(msg: usize) {
        for (name, v) in figures(msg) {
            println!("ceiling {msg} {v:.2} GB/s {name}");
        }
        println!("futex one-way wake-up {:.1} us", futex_wakeup_us());
        println!("cache line round trip {:.0} ns", line_round_trip_ns());
    }
}

/// The copy the ceiling uses: the lane's (ring.rs `copy_bytes`).
///
/// # Safety
/// As `ptr::copy_nonoverlapping`.
unsafe fn copy(dst: *mut u8, src: *const u8, n: usize) {
    // SAFETY: caller contract.
    unsafe { flowlane_lane::copy::copy_bytes(dst, src, n) }
}
