//! Unmodified third-party programs over the shared-memory lane: each run
//! checks the program's own success and the daemon's counters (the lane was
//! really used). Figures are printed, never asserted.

use flowlane_e2e::shm::{heavy, run_ok, wait_listening, Bg, Node};
use std::time::Duration;

const T: Duration = Duration::from_secs(180);

fn iperf3_json_gbps(out: &str) -> f64 {
    let v: serde_json::Value = serde_json::from_str(out).expect("iperf3 --json output");
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap_or(0.0)
        / 1e9
}

/// iperf3 both directions (-R) and with four parallel streams (-P 4).
#[test]
fn iperf3_over_shared_memory() {
    let _turn = crate::turn::take(module_path!());
    let _g = heavy();
    let node = Node::new("ipf", 2);
    let (client, server) = (&node.pods[0], &node.pods[1]);
    let ip = server.ip.to_string();
    let mut opened = node.shm_opened();
    for extra in [&[][..], &["-R"][..], &["-P", "4"][..]] {
        // A server per run (--one-off): a long-running `iperf3 -s` closes
        // its listening socket after each test and opens a new one, so a
        // client started right after the previous run ended could be
        // refused (seen once under load: the -P 4 run got "Connection
        // refused").
        let srv = Bg::spawn(node.cmd(server, true, &["iperf3", "-s", "-1", "-p", "5201"]));
        wait_listening(server, 5201);
        let mut argv = vec!["iperf3", "-c", &ip, "-p", "5201", "-t", "3", "--json"];
        argv.extend_from_slice(extra);
        let out = run_ok(node.cmd(client, true, &argv), T, "iperf3 client");
        let (st, sout, serr) = srv.finish(T);
        assert!(
            st.is_some_and(|s| s.success()),
            "iperf3 server {extra:?}: {sout} {serr}"
        );
        let gbps = iperf3_json_gbps(&out);
        eprintln!("iperf3 {extra:?} over shm: {gbps:.1} Gbit/s");
        assert!(gbps > 0.0, "iperf3 moved nothing: {out}");
        let now = node.shm_opened();
        // Control connection + data streams all go over the lane.
        let streams = if extra.first() == Some(&"-P") { 4 } else { 1 };
        assert!(
            now - opened > streams,
            "iperf3 {extra:?}: only {} shm connections",
            now - opened
        );
        opened = now;
    }
}

fn sockperf_p50(out: &str) -> Option<f64> {
    out.lines()
        .find(|l| l.contains("percentile 50.000"))
        .and_then(|l| l.split('=').nth(1))
        .and_then(|x| x.trim().parse().ok())
}

/// sockperf ping-pong and throughput in its epoll, poll and select modes.
#[test]
fn sockperf_modes_over_shared_memory() {
    let _turn = crate::turn::take(module_path!());
    let _g = heavy();
    let node = Node::new("sperf", 2);
    let (client, server) = (&node.pods[0], &node.pods[1]);
    let ip = server.ip.to_string();
    for (i, mode) in ["e", "p", "s"].into_iter().enumerate() {
        let port = 11211 + i as u16;
        // sockperf takes its I/O multiplexer (-F) only with a feed file.
        let feed = node.dir.join(format!("feed-{mode}"));
        std::fs::write(&feed, format!("T:{ip}:{port}\n")).unwrap();
        let feed = feed.to_str().unwrap();
        let before = node.shm_opened();
        let _srv = Bg::spawn(node.cmd(
            server,
            true,
            &["sockperf", "server", "-f", feed, "-F", mode],
        ));
        wait_listening(server, port);
        let pp = run_ok(
            node.cmd(
                client,
                true,
                &[
                    "sockperf",
                    "ping-pong",
                    "-f",
                    feed,
                    "-F",
                    mode,
                    "-t",
                    "2",
                    "-m",
                    "64",
                    // Unpaced over the lane (millions of round trips/s on an
                    // idle machine) sockperf overruns its own sequence table
                    // ("_seqN > m_maxSequenceNo"); shm-bench paces the same way.
                    "--mps",
                    "1000000",
                ],
            ),
            T,
            "sockperf ping-pong",
        );
        let p50 =
            sockperf_p50(&pp).unwrap_or_else(|| panic!("no latency in sockperf output: {pp}"));
        let tp = run_ok(
            node.cmd(
                client,
                true,
                &[
                    "sockperf",
                    "throughput",
                    "-f",
                    feed,
                    "-F",
                    mode,
                    "-t",
                    "2",
                    "-m",
                    "65000",
                ],
            ),
            T,
            "sockperf throughput",
        );
        assert!(tp.contains("BandWidth"), "{tp}");
        eprintln!("sockperf -F {mode}: ping-pong p50 {p50} us over shm");
        assert!(
            node.shm_opened() >= before + 2,
            "sockperf -F {mode} did not use the shm lane"
        );
    }
}

/// redis-server + redis-benchmark (epoll, non-blocking sockets, 20 clients).
#[test]
fn redis_benchmark_over_shared_memory() {
    let _turn = crate::turn::take(module_path!());
    let _g = heavy();
    let node = Node::new("redis", 2);
    let (client, server) = (&node.pods[0], &node.pods[1]);
    let dir = node.dir.display().to_string();
    let _srv = Bg::spawn(node.cmd(
        server,
        true,
        &[
            "redis-server",
            "--port",
            "6390",
            "--bind",
            "0.0.0.0",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--dir",
            &dir,
        ],
    ));
    wait_listening(server, 6390);
    let ip = server.ip.to_string();
    let out = run_ok(
        node.cmd(
            client,
            true,
            &[
                "redis-benchmark",
                "-h",
                &ip,
                "-p",
                "6390",
                "-n",
                "20000",
                "-c",
                "20",
                "-q",
                "-t",
                "set,get,lpush,lrange_100",
            ],
        ),
        T,
        "redis-benchmark",
    );
    eprintln!("{out}");
    assert!(out.matches("requests per second").count() >= 4, "{out}");
    let st = node.stats();
    let opened = st.lanes.get("shm").map_or(0, |l| l.connections_opened);
    eprintln!(
        "shm connections opened {opened}; fallbacks {:?}; requests {:?}; channel setup {:?}",
        st.fallbacks, st.requests, st.channel_setup
    );
    assert!(
        opened >= 20,
        "redis-benchmark's clients did not use the shm lane: {opened} opened, fallbacks {:?}, \
         requests {:?}; daemon log (end):\n{}",
        st.fallbacks,
        st.requests,
        log_tail(&node, 60)
    );
}

/// The last `n` lines of the node's daemon log (for failure messages).
fn log_tail(node: &Node, n: usize) -> String {
    let log = node.daemon_log();
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Stops nginx the way its master expects (SIGTERM: it stops its workers
/// first), so no worker outlives the test.
struct Nginx(Bg);

impl Drop for Nginx {
    fn drop(&mut self) {
        // SAFETY: signalling our own child (the nginx master).
        unsafe { libc::kill(self.0.pid() as i32, libc::SIGTERM) };
        let t0 = std::time::Instant::now();
        while self.0 .0.try_wait().ok().flatten().is_none()
            && t0.elapsed() < Duration::from_secs(10)
        {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// nginx (master + worker, epoll, sendfile on) serving a large file; curl
/// fetches it through the lane and the bytes match.
#[test]
fn nginx_sendfile_to_curl_over_shared_memory() {
    let _turn = crate::turn::take(module_path!());
    let _g = heavy();
    let node = Node::new("nginx", 2);
    let (client, server) = (&node.pods[0], &node.pods[1]);
    let root = node.dir.join("www");
    std::fs::create_dir_all(&root).unwrap();
    let mut data = vec![0u8; 48 << 20];
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for b in data.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    std::fs::write(root.join("big.bin"), &data).unwrap();
    let conf = node.dir.join("nginx.conf");
    let d = node.dir.display();
    std::fs::write(
        &conf,
        format!(
            "daemon off; master_process on; worker_processes 1; pid {d}/nginx.pid; error_log {d}/nginx.err;\n\
             events {{ use epoll; }}\n\
             http {{ sendfile on; tcp_nopush on; access_log off; client_body_temp_path {d}; proxy_temp_path {d};\n\
               fastcgi_temp_path {d}; uwsgi_temp_path {d}; scgi_temp_path {d};\n\
               server {{ listen 8080; root {}; }} }}\n",
            root.display()
        ),
    )
    .unwrap();
    let _srv = Nginx(Bg::spawn(node.cmd(
        server,
        true,
        &[
            "nginx",
            "-c",
            conf.to_str().unwrap(),
            "-e",
            &format!("{d}/nginx.err"),
        ],
    )));
    wait_listening(server, 8080);
    let out_file = node.dir.join("fetched.bin");
    let url = format!("http://{}:8080/big.bin", server.ip);
    for _ in 0..2 {
        run_ok(
            node.cmd(
                client,
                true,
                &["curl", "-sSf", "-o", out_file.to_str().unwrap(), &url],
            ),
            T,
            "curl",
        );
        let got = std::fs::read(&out_file).unwrap();
        assert!(
            got == data,
            "fetched file differs ({} of {} bytes)",
            got.len(),
            data.len()
        );
    }
    assert!(
        node.shm_opened() >= 2,
        "curl/nginx did not use the shm lane"
    );
}

/// Python asyncio streams with 1000 connections open at the same time.
#[test]
fn asyncio_thousand_concurrent_connections() {
    let _turn = crate::turn::take(module_path!());
    use flowlane_e2e::shm_scripts::{ASYNCIO_ECHO, PYTHON};
    let _g = heavy();
    let node = Node::new("async", 2);
    let (client, server) = (&node.pods[0], &node.pods[1]);
    let script = format!(
        "import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (8192, 8192))\n{ASYNCIO_ECHO}"
    );
    let _srv = Bg::spawn(node.cmd(server, true, &[PYTHON, "-c", &script, "server", "7400"]));
    wait_listening(server, 7400);
    let ip = server.ip.to_string();
    let out = run_ok(
        node.cmd(
            client,
            true,
            &[PYTHON, "-c", &script, "client", &ip, "7400", "1000"],
        ),
        T,
        "asyncio client",
    );
    assert!(out.contains("ok 1000"), "{out}");
    assert_eq!(node.shm_opened(), 1000);
}

/// Integrity at volume: random message sizes, both directions at once,
/// checksummed, several connections (FLS_INTEGRITY_GIB total, default 10).
#[test]
fn integrity_random_sizes_both_directions() {
    let _turn = crate::turn::take(module_path!());
    let _g = heavy();
    let node = Node::new("integ", 2);
    let (client, server) = (&node.pods[0], &node.pods[1]);
    let bench = flowlane_e2e::shm::build_dir().join("shm-bench");
    let bench = bench.to_str().unwrap();
    let _srv = Bg::spawn(node.cmd(server, true, &[bench, "serve", "7500"]));
    wait_listening(server, 7500);
    let gib: u64 = std::env::var("FLS_INTEGRITY_GIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let conns = 2u64;
    // Each connection carries `per` bytes each way: total = 2 * conns * per.
    let per = (gib << 30) / (2 * conns);
    let addr = format!("{}:7500", server.ip);
    let t0 = std::time::Instant::now();
    let clients: Vec<_> = (0..conns)
        .map(|i| {
            Bg::spawn(node.cmd(
                client,
                true,
                &[
                    bench,
                    "integrity",
                    &addr,
                    &per.to_string(),
                    &(i + 7).to_string(),
                ],
            ))
        })
        .collect();
    for c in clients {
        let (st, out, err) = c.finish(Duration::from_secs(600));
        assert!(
            st.is_some_and(|s| s.success()) && out.contains("integrity ok"),
            "{out} {err}"
        );
    }
    eprintln!(
        "integrity: {gib} GiB through the lane in {:?}",
        t0.elapsed()
    );
    assert_eq!(node.shm_opened(), conns);
}

/// The daemon restarts mid-stream: the live connection keeps flowing, a new
/// connection while it is down falls back to TCP, and once it is back new
/// connections use shared memory again.
#[test]
fn daemon_restart_mid_stream() {
    let _turn = crate::turn::take(module_path!());
    use flowlane_e2e::shm_scripts::{ECHO_CLIENT, ECHO_SERVER, PYTHON};
    let _g = heavy();
    let mut node = Node::new("rstrt", 2);
    let (client, server) = (node.pods[0].clone(), node.pods[1].clone());
    let bench = flowlane_e2e::shm::build_dir().join("shm-bench");
    let bench = bench.to_str().unwrap().to_string();
    let _srv = Bg::spawn(node.cmd(&server, true, &[&bench, "serve", "7600"]));
    let _echo = Bg::spawn(node.cmd(&server, true, &[PYTHON, "-c", ECHO_SERVER, "7601", "3"]));
    wait_listening(&server, 7600);
    wait_listening(&server, 7601);
    let addr = format!("{}:7600", server.ip);
    let ip = server.ip.to_string();
    let live = Bg::spawn(node.cmd(
        &client,
        true,
        &[&bench, "integrity", &addr, &(1u64 << 30).to_string(), "3"],
    ));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(node.shm_opened(), 1);
    node.stop_daemon();
    let echo = |node: &Node, seed: &str| {
        let out = run_ok(
            node.cmd(
                &client,
                true,
                &[PYTHON, "-c", ECHO_CLIENT, &ip, "7601", "2000000", seed],
            ),
            T,
            "echo",
        );
        assert!(out.starts_with("ok 2000000"), "{out}");
    };
    echo(&node, "1"); // daemon down: TCP
    node.start_daemon();
    let before = node.shm_opened();
    echo(&node, "2");
    echo(&node, "3");
    let (st, out, err) = live.finish(Duration::from_secs(600));
    assert!(
        st.is_some_and(|s| s.success()) && out.contains("integrity ok"),
        "live stream: {out} {err}"
    );
    assert!(
        node.shm_opened() > before,
        "after the restart new connections must use shm again; log:\n{}",
        node.daemon_log()
    );
}

/// grpcio: a bidirectional streaming RPC over the lane.
#[test]
fn grpcio_streaming_rpc_over_shared_memory() {
    let _turn = crate::turn::take(module_path!());
    use flowlane_e2e::shm_scripts::{GRPC_ECHO, PYTHON};
    let node = Node::new("grpc", 2);
    let (client, server) = (&node.pods[0], &node.pods[1]);
    let _srv = Bg::spawn(node.cmd(server, true, &[PYTHON, "-c", GRPC_ECHO, "server", "7700"]));
    wait_listening(server, 7700);
    let ip = server.ip.to_string();
    let out = run_ok(
        node.cmd(
            client,
            true,
            &[PYTHON, "-c", GRPC_ECHO, "client", &ip, "7700", "300"],
        ),
        T,
        "grpc client",
    );
    assert!(out.starts_with("ok 300"), "{out}");
    assert!(node.shm_opened() >= 1, "grpc did not use the shm lane");
}
