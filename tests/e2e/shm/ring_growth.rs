//! Memory that follows use (issue 12 item 3): 1,000 lane connections
//! opened by a Python asyncio client and server through the preload
//! library, each carrying more than a full ring's worth of small
//! request/response traffic (so that rings kept at their full size would
//! have touched every page), then held idle. Their shared memory (the sum
//! of the channel memfds' allocated blocks, read through the daemon, which
//! keeps one fd of each live channel) must stay within 64 MiB in all. Then
//! a bulk stream on one of them must grow its ring to the full size with
//! every byte checked, and closing everything must leave nothing behind:
//! no channel memfd in the daemon, no mapping and no socket in either
//! process.
//!
//! Names: tag `grow`; pods in 10.243.x.0/24.

use flowlane_e2e::shm::{channel_memfds, fd_and_memfd_count, wait_listening, Bg, Node};
use flowlane_e2e::shm_scripts::PYTHON;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(300);
const CONNS: usize = 1000;
/// Bytes each connection carries each way before it idles: more than the
/// default 1 MiB ring, so every page of a full-size ring was touched.
const CARRY: usize = (1 << 20) + (256 << 10);
const BULK: usize = 64 << 20;
const RING: u64 = 1 << 20;
const GOAL: u64 = 64 << 20;
/// Stock channels a client process may hold for one listener beside its
/// connections (made ahead, docs/shm-lane.md "Pre-created channels").
const MAX_STOCK: usize = flowlane_lane::proto::MAX_STOCK_GRANTS;

const SERVER: &str = r#"
import asyncio, os, resource, sys
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
port, n, ctl = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
closed = 0
async def handle(reader, writer):
    global closed
    try:
        while True:
            data = await reader.read(1 << 20)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()
        closed += 1
        if closed == n:
            done.set()
async def main():
    global done
    done = asyncio.Event()
    srv = await asyncio.start_server(handle, '0.0.0.0', port, backlog=4096)
    await done.wait()
    await asyncio.sleep(0.2)  # the transports close on the next loop turns
    with open(os.path.join(ctl, 'server-closed'), 'w') as f:
        f.write(str(closed))
    while not os.path.exists(os.path.join(ctl, 'server-exit')):
        await asyncio.sleep(0.05)
    srv.close()
    await srv.wait_closed()
    print('served', closed)
asyncio.run(main())
"#;

const CLIENT: &str = r#"
import asyncio, os, random, resource, socket, sys, threading, time
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
ip, port, n, carry, bulk, ctl = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
MSG = 8192
def status(name, text):
    p = os.path.join(ctl, name)
    with open(p + '.tmp', 'w') as f:
        f.write(text)
    os.rename(p + '.tmp', p)
def wait_for(name):
    while not os.path.exists(os.path.join(ctl, name)):
        time.sleep(0.05)
async def one(loop, i, sem):
    s = socket.socket()
    s.setblocking(False)
    await loop.sock_connect(s, (ip, port))
    async with sem:
        sent = 0
        while sent < carry:
            msg = bytes([(i * 7 + sent // MSG) & 0xff]) * MSG
            await loop.sock_sendall(s, msg)
            got = 0
            while got < MSG:
                b = await loop.sock_recv(s, MSG - got)
                if not b:
                    raise SystemExit(f'connection {i}: early end of stream')
                if b != msg[got:got + len(b)]:
                    raise SystemExit(f'connection {i}: echo differs at {sent + got}')
                got += len(b)
            sent += MSG
    return s
async def main():
    loop = asyncio.get_running_loop()
    sem = asyncio.Semaphore(64)
    return await asyncio.gather(*(one(loop, i, sem) for i in range(n)))
socks = asyncio.run(main())
status('idle', str(len(socks)))
wait_for('bulk')
s = socks[0]
s.setblocking(True)
data = random.Random(12).randbytes(bulk)
errors = []
def reader():
    got = 0
    while got < bulk:
        b = s.recv(1 << 20)
        if not b:
            errors.append(f'end of stream after {got}')
            return
        if b != data[got:got + len(b)]:
            errors.append(f'echo differs in [{got}, {got + len(b)})')
            return
        got += len(b)
t = threading.Thread(target=reader)
t.start()
for off in range(0, bulk, 1 << 20):
    s.sendall(data[off:off + (1 << 20)])
t.join()
if errors:
    raise SystemExit('bulk: ' + errors[0])
status('bulk-done', 'ok')
wait_for('close')
for c in socks:
    c.close()
status('closed', str(len(socks)))
wait_for('client-exit')
print('ok', len(socks))
"#;

/// The two capacity words (client→server, server→client) of a region.
fn capacities(memfd: &Path) -> (u64, u64) {
    let f = std::fs::File::open(memfd).unwrap();
    let word = |off: u64| {
        let mut b = [0u8; 8];
        f.read_exact_at(&mut b, off).unwrap();
        u64::from_ne_bytes(b)
    };
    // Layout: flowlane_lane::ring (control blocks at 512 and 1024, the
    // capacity word right after each tail).
    (word(512 + 8), word(1024 + 8))
}

fn wait_file(ctl: &Path, name: &str, procs: &mut [&mut Bg]) -> String {
    let t0 = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(ctl.join(name)) {
            return s;
        }
        for p in procs.iter_mut() {
            if let Ok(Some(st)) = p.0.try_wait() {
                panic!("a program ended ({st}) before {name}");
            }
        }
        assert!(t0.elapsed() < T, "no {name} within {T:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn touch(ctl: &Path, name: &str) {
    std::fs::write(ctl.join(name), "go").unwrap();
}

#[test]
fn thousand_idle_connections_cost_little_and_a_bulk_stream_still_grows() {
    let _turn = crate::turn::take(module_path!());
    let _heavy = flowlane_e2e::shm::heavy();
    let node = Node::new_in("grow", 2, 243);
    let (c, s) = (&node.pods[0], &node.pods[1]);
    let daemon = node.daemon_pid().expect("daemon");
    let ctl = std::env::temp_dir().join(format!("fls-grow-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&ctl);
    std::fs::create_dir_all(&ctl).unwrap();
    let ctl_s = ctl.to_string_lossy().to_string();
    let port = 7431u16;
    let (n, carry, bulk) = (CONNS.to_string(), CARRY.to_string(), BULK.to_string());
    let mut srv = Bg::spawn(node.cmd(
        s,
        true,
        &[PYTHON, "-c", SERVER, &port.to_string(), &n, &ctl_s],
    ));
    wait_listening(s, port);
    let ip = s.ip.to_string();
    let mut cli = Bg::spawn(node.cmd(
        c,
        true,
        &[
            PYTHON,
            "-c",
            CLIENT,
            &ip,
            &port.to_string(),
            &n,
            &carry,
            &bulk,
            &ctl_s,
        ],
    ));

    // Idle: every connection on the lane, their memory within the goal.
    let idle = wait_file(&ctl, "idle", &mut [&mut srv, &mut cli]);
    assert_eq!(idle.trim(), n);
    assert_eq!(
        node.shm_opened(),
        CONNS as u64,
        "every connection on the lane"
    );
    // Beside one fd per live channel, the daemon keeps the stock it made
    // ahead for this client's next connections (docs/shm-lane.md,
    // "Pre-created channels"): at most a batch per (process, listener).
    let stocked = node.stats().lanes["shm"].channels_stocked as usize;
    assert!(stocked <= MAX_STOCK, "{stocked} stock channels");
    let fds = channel_memfds(daemon);
    assert_eq!(
        fds.len(),
        CONNS + stocked,
        "the daemon keeps one fd per live channel and one per stock channel"
    );
    let total: u64 = fds.iter().map(|(_, b)| b).sum();
    println!(
        "{CONNS} idle lane connections (each carried {CARRY} bytes each way): {} KiB of shared memory in all, {} KiB each",
        total >> 10,
        (total / CONNS as u64) >> 10
    );
    assert!(
        total <= GOAL,
        "{CONNS} idle connections hold {} KiB of shared memory, goal {} KiB",
        total >> 10,
        GOAL >> 10
    );
    let (cli_fds, cli_maps) = fd_and_memfd_count(cli.pid());
    let (srv_fds, srv_maps) = fd_and_memfd_count(srv.pid());
    assert!(cli_fds >= CONNS && srv_fds >= CONNS, "{cli_fds} {srv_fds}");
    assert!(
        cli_maps >= CONNS && srv_maps >= CONNS,
        "{cli_maps} {srv_maps}"
    );

    // Bulk on one connection: its rings grow to the full size, and only its.
    touch(&ctl, "bulk");
    let done = wait_file(&ctl, "bulk-done", &mut [&mut srv, &mut cli]);
    assert_eq!(done, "ok");
    let mut grown = Vec::new();
    for (path, bytes) in channel_memfds(daemon) {
        let (c2s, s2c) = capacities(&path);
        if c2s == RING {
            grown.push((c2s, s2c, bytes));
        } else {
            assert!(
                c2s <= 16 << 10 && s2c <= 16 << 10,
                "an idle ring grew: {c2s} {s2c}"
            );
        }
    }
    println!("the bulk connection's rings (c2s, s2c, bytes held): {grown:?}");
    assert_eq!(grown.len(), 1, "exactly the bulk connection reached 1 MiB");
    assert!(grown[0].2 >= RING, "the full ring is in use: {grown:?}");

    // Close: nothing left in the daemon or in either process.
    touch(&ctl, "close");
    wait_file(&ctl, "closed", &mut [&mut srv, &mut cli]);
    wait_file(&ctl, "server-closed", &mut [&mut srv, &mut cli]);
    // What is left is stock (channels made ahead for the next
    // connections: bounded, and gone with its client process).
    let t0 = Instant::now();
    loop {
        let left = channel_memfds(daemon).len();
        let stocked = node.stats().lanes["shm"].channels_stocked as usize;
        if left == stocked && stocked <= MAX_STOCK {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the daemon still holds {left} channel memfds ({stocked} of them stock) after every connection closed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (cli_fds, cli_maps) = fd_and_memfd_count(cli.pid());
    let (srv_fds, srv_maps) = fd_and_memfd_count(srv.pid());
    println!("after close: client {cli_fds} fds {cli_maps} memfd maps, server {srv_fds} fds {srv_maps} memfd maps");
    assert!(
        cli_maps <= MAX_STOCK && srv_maps <= MAX_STOCK,
        "regions still mapped beyond the stock: {cli_maps} {srv_maps}"
    );
    assert!(
        cli_fds < 64 && srv_fds < 64,
        "fds left: {cli_fds} {srv_fds}"
    );
    touch(&ctl, "client-exit");
    touch(&ctl, "server-exit");
    let (st, out, err) = cli.finish(T);
    assert!(st.is_some_and(|s| s.success()), "client: {out} {err}");
    assert_eq!(out.trim(), format!("ok {CONNS}"));
    let (st, out, err) = srv.finish(T);
    assert!(st.is_some_and(|s| s.success()), "server: {out} {err}");
    let _ = std::fs::remove_dir_all(&ctl);
}
