//! `shm-bench bench --memory`: what 1,000 idle connections cost (issue 12
//! item 3), beside the 64 KiB stream and the 1 KiB / 64 B request/response
//! rates, with the library against plain TCP in the same run.
//!
//! The idle figure: a client opens 1,000 connections to the echo server,
//! each carries `CARRY` bytes each way in 8 KiB request/responses (more
//! than the default 1 MiB ring, so a ring kept at its full size touched
//! every page), then all are held idle while the memory is read:
//! - with the library, the lane's shared memory: the sum of the allocated
//!   blocks of the channel memfds the daemon holds (one per live channel);
//! - plain TCP has no shared memory; its row shows the kernel's TCP buffer
//!   memory (`/proc/net/sockstat` "mem", pages, machine-wide) while the
//!   idle connections are open minus before: what idle sockets hold in
//!   buffers (their socket structures are not in it).
//!
//! `FLOWLANE_PRELOAD_LIB_BEFORE=<another build of the library>` adds a
//! column for it (e.g. main's build before a change), measured in the same
//! run, alternating with the others.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use flowlane_e2e::shm::{channel_memfds, wait_listening, Bg, Node};

use super::{figures_of, median};

const T: Duration = Duration::from_secs(600);
const CONNS: usize = 1000;
const CARRY: usize = (1 << 20) + (256 << 10);
const MSG: usize = 8192;

/// The kernel's TCP buffer memory now, bytes (sockstat counts pages).
fn tcp_buffer_bytes() -> f64 {
    let s = std::fs::read_to_string("/proc/net/sockstat").unwrap_or_default();
    let pages = s
        .lines()
        .find(|l| l.starts_with("TCP:"))
        .and_then(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            w.iter()
                .position(|x| *x == "mem")
                .and_then(|i| w.get(i + 1)?.parse::<f64>().ok())
        })
        .unwrap_or(0.0);
    pages * 4096.0
}

/// The client program: `idle ADDR N CARRY MSG DIR`. Opens N connections
/// (echo mode), each carries CARRY bytes in MSG-byte round trips, then
/// writes DIR/ready and holds them until DIR/go exists; closes them all and
/// prints `idle N`.
pub fn idle_client(addr: &str, n: usize, carry: usize, msg: usize, dir: &str) {
    let dir = std::path::Path::new(dir);
    flowlane_e2e::shm::raise_fd_limit();
    let mut conns = Vec::with_capacity(n);
    let out = vec![3u8; msg];
    let mut inb = vec![0u8; msg];
    for _ in 0..n {
        let mut c = super::dial(addr);
        c.write_all(b"E").unwrap();
        let mut done = 0;
        while done < carry {
            c.write_all(&out).unwrap();
            c.read_exact(&mut inb).unwrap();
            assert!(inb == out, "echo differs");
            done += msg;
        }
        conns.push(c);
    }
    std::fs::write(dir.join("ready"), "ready").unwrap();
    while !dir.join("go").exists() {
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(conns);
    println!("idle {n}");
}

/// A command in `pod`: with the library at `lib`, or plain.
fn cmd(node: &Node, pod: usize, lib: Option<&str>, argv: &[&str]) -> std::process::Command {
    let Some(lib) = lib else {
        return node.cmd(&node.pods[pod], false, argv);
    };
    let pre = format!("LD_PRELOAD={lib}");
    let sock = format!("FLOWLANE_SOCKET={}", node.socket().display());
    let mut a = vec!["env", pre.as_str(), sock.as_str()];
    a.extend_from_slice(argv);
    node.cmd(&node.pods[pod], false, &a)
}

/// One idle round: returns the bytes held while the connections idle.
fn idle_round(node: &Node, lib: Option<&str>, addr: &str, me: &str, tag: &str) -> f64 {
    let lib_on = lib.is_some();
    let dir = std::env::temp_dir().join(format!("shm-bench-idle-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.to_str().unwrap();
    let daemon = node.daemon_pid().expect("daemon");
    let base = if lib_on { 0.0 } else { tcp_buffer_bytes() };
    let (n, carry, msg) = (CONNS.to_string(), CARRY.to_string(), MSG.to_string());
    let mut cli = Bg::spawn(cmd(node, 0, lib, &[me, "idle", addr, &n, &carry, &msg, d]));
    let t0 = Instant::now();
    while !dir.join("ready").exists() {
        if let Ok(Some(st)) = cli.0.try_wait() {
            panic!("idle client ended ({st}) before it was ready");
        }
        assert!(t0.elapsed() < T, "idle client not ready within {T:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let held = if lib_on {
        // Every idle connection on the lane, and the stock made ahead for
        // this client's next connections (counted: it is memory too).
        let stocked = node.stats().lanes["shm"].channels_stocked as usize;
        let fds = channel_memfds(daemon);
        assert_eq!(
            fds.len(),
            CONNS + stocked,
            "every idle connection on the lane"
        );
        fds.iter().map(|(_, b)| *b as f64).sum()
    } else {
        tcp_buffer_bytes() - base
    };
    std::fs::write(dir.join("go"), "go").unwrap();
    let (st, out, err) = cli.finish(T);
    assert!(
        st.is_some_and(|s| s.success()) && out.starts_with("idle "),
        "idle client: {out} {err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    held
}

/// A rate figure: its row name, the client's arguments (the address at
/// index 1 is filled in per variant), which number of the client's output
/// line it is, and the values measured per variant.
struct Figure {
    name: &'static str,
    args: Vec<String>,
    index: usize,
    values: Vec<Vec<f64>>,
}

pub fn run(quick: bool) {
    let node = Node::new("ptmb", 2);
    let s = &node.pods[1];
    let me = std::env::current_exe().unwrap();
    let me = me.to_str().unwrap().to_string();
    let after = flowlane_e2e::shm::preload_lib()
        .to_str()
        .unwrap()
        .to_string();
    let before = std::env::var("FLOWLANE_PRELOAD_LIB_BEFORE").ok();
    // (column, library, server port): each variant has its own server.
    let mut variants: Vec<(&str, Option<&str>, u16)> = vec![("with library", Some(&after), 7101)];
    if let Some(b) = before.as_deref() {
        variants.push(("library before", Some(b), 7102));
    }
    variants.push(("plain TCP", None, 7100));
    let _servers: Vec<Bg> = variants
        .iter()
        .map(|(_, lib, port)| Bg::spawn(cmd(&node, 1, *lib, &[&me, "serve", &port.to_string()])))
        .collect();
    for (_, _, port) in &variants {
        wait_listening(s, *port);
    }
    let pod = |port: u16| format!("{}:{port}", s.ip);
    let run = |lib: Option<&str>, args: &[&str]| -> Vec<f64> {
        let mut argv = vec![me.as_str()];
        argv.extend_from_slice(args);
        figures_of(cmd(&node, 0, lib, &argv), T, &format!("shm-bench {args:?}"))
    };
    let rounds = if quick { 1 } else { 3 };
    let iters = if quick { "20000" } else { "100000" };
    let total = if quick { "536870912" } else { "2147483648" };
    let k = variants.len();
    let mut mem = vec![Vec::new(); k];
    // (name, client arguments with the address at 1, figure index, values per variant)
    let mut figs: Vec<Figure> = [
        ("stream GB/s, 64 KiB messages", "stream", "65536", total, 0),
        (
            "request/response/s, 1 KiB, one conn",
            "pingpong",
            "1024",
            iters,
            2,
        ),
        (
            "request/response/s, 64 B, one conn",
            "pingpong",
            "64",
            iters,
            2,
        ),
    ]
    .into_iter()
    .map(|(name, prog, size, n, index)| Figure {
        name,
        args: vec![prog.into(), "-".into(), size.into(), n.into()],
        index,
        values: vec![Vec::new(); k],
    })
    .collect();
    for r in 0..rounds {
        for (i, (_, lib, port)) in variants.iter().enumerate() {
            mem[i].push(idle_round(
                &node,
                *lib,
                &pod(*port),
                &me,
                &format!("{r}{i}"),
            ));
        }
        for f in figs.iter_mut() {
            for (i, (_, lib, port)) in variants.iter().enumerate() {
                let mut a: Vec<&str> = f.args.iter().map(String::as_str).collect();
                let addr = pod(*port);
                a[1] = &addr;
                f.values[i].push(run(*lib, &a)[f.index]);
            }
        }
    }
    println!(
        "flowlane memory benchmark (same run; median of {rounds} rounds alternating the variants)"
    );
    println!(
        "pod wiring: {}; FLOWLANE_RING_SIZE default 1 MiB per direction",
        node.wiring
    );
    if let Some(b) = &before {
        println!("library before: {b}");
    }
    println!();
    let mut head = format!("{:<40}", "figure");
    for (name, _, _) in &variants {
        head += &format!(" {name:>15}");
    }
    println!("{head} {:>9}", "lib/tcp");
    let mut line = format!("{:<40}", format!("MiB held by {CONNS} idle connections"));
    for m in &mem {
        line += &format!(" {:>15.1}", median(m.clone()) / (1 << 20) as f64);
    }
    println!("{line} {:>9}", "-");
    for f in &figs {
        let med: Vec<f64> = f.values.iter().map(|x| median(x.clone())).collect();
        let mut line = format!("{:<40}", f.name);
        for m in &med {
            line += &format!(" {m:>15.2}");
        }
        println!("{line} {:>8.3}x", med[0] / med[k - 1]);
    }
    println!(
        "(idle: each connection first carried {} KiB each way in {} B request/responses; library: the channel memfds' allocated blocks; plain TCP: kernel TCP buffer memory (sockstat), which idle sockets release)",
        CARRY >> 10,
        MSG
    );
}
