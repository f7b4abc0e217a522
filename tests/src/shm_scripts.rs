//! Small Python programs (Debian's /usr/bin/python3) the shared-memory lane
//! tests run in pods: plain sockets, checksummed, nothing flowlane-specific.

/// The interpreter (Debian's, with only the standard library needed).
pub const PYTHON: &str = "/usr/bin/python3";

/// `echo_server.py PORT [CONNS]`: accepts CONNS connections one after the
/// other (default 1) and echoes each until EOF, then closes it.
pub const ECHO_SERVER: &str = r#"
import socket, sys
port = int(sys.argv[1]); conns = int(sys.argv[2]) if len(sys.argv) > 2 else 1
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', port)); s.listen(128)
for _ in range(conns):
    c, _ = s.accept()
    while True:
        d = c.recv(1 << 20)
        if not d:
            break
        c.sendall(d)
    c.close()
"#;

/// `echo_client.py IP PORT BYTES SEED`: sends BYTES pseudo-random bytes in
/// random-sized writes from one thread, reads the echo in another, half-
/// closes after sending, expects EOF after the echo; checks sha256 of both
/// directions and prints "ok <bytes> <sha>".
pub const ECHO_CLIENT: &str = r#"
import socket, sys, threading, hashlib, random
ip, port, total, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
block = rng.randbytes(1 << 20)
c = socket.create_connection((ip, port))
sent = hashlib.sha256()
def sender():
    n = 0
    while n < total:
        k = min(rng.randint(1, 200000), total - n)
        off = rng.randint(0, (1 << 20) - 1 - min(k, (1 << 20) - 1))
        chunk = block[off:off + k]
        if len(chunk) < k:
            chunk = (block * 2)[off:off + k]
        c.sendall(chunk); sent.update(chunk); n += k
    c.shutdown(socket.SHUT_WR)
t = threading.Thread(target=sender); t.start()
got = hashlib.sha256(); n = 0
while True:
    d = c.recv(rng.randint(1, 300000))
    if not d:
        break
    got.update(d); n += len(d)
t.join()
assert n == total, (n, total)
assert got.digest() == sent.digest(), "echo differs"
print("ok", n, got.hexdigest())
"#;

/// `semantics.py server PORT CASE` / `semantics.py client IP PORT CASE`:
/// one socket-semantics case per run, both ends checking what a TCP
/// program expects. Prints "ok CASE" on success (asserts otherwise).
pub const SEMANTICS: &str = r#"
import socket, sys, os, time, select, fcntl, termios, struct, errno, signal

def listen(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(('0.0.0.0', port)); s.listen(64); return s

def echo(c):
    while True:
        d = c.recv(65536)
        if not d: break
        c.sendall(d)
    c.close()

def recv_exact(c, n):
    b = b''
    while len(b) < n:
        d = c.recv(n - len(b))
        assert d, "early EOF"
        b += d
    return b

role, case = sys.argv[1], sys.argv[-1]
if role == 'server':
    port = int(sys.argv[2]); s = listen(port)
    if case == 'prefork':
        kids = []
        for _ in range(2):
            pid = os.fork()
            if pid == 0:
                for _ in range(2):
                    c, _ = s.accept(); echo(c)
                os._exit(0)
            kids.append(pid)
        for k in kids:
            _, st = os.waitpid(k, 0); assert st == 0, st
    elif case == 'dup2':
        c, _ = s.accept()
        os.dup2(c.fileno(), 100); c.close()
        d = socket.socket(fileno=100)
        echo(d)
    elif case == 'flags':
        c, _ = s.accept()
        assert c.recv(5, socket.MSG_PEEK) == b'hello'
        n = struct.unpack('i', fcntl.ioctl(c.fileno(), termios.FIONREAD, b'\0\0\0\0'))[0]
        assert n >= 5, n
        assert c.recv(11, socket.MSG_WAITALL) == b'hello world'
        try:
            c.recv(10, socket.MSG_DONTWAIT); assert False, "expected EAGAIN"
        except BlockingIOError:
            pass
        assert c.getsockname()[1] == port and c.getpeername()[0] != '0.0.0.0'
        assert c.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) == socket.SOCK_STREAM
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
        assert c.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
        c.sendall(b'x'); echo(c)
    elif case == 'waits':
        c, _ = s.accept(); c.setblocking(False)
        p = select.poll(); p.register(c, select.POLLIN)
        assert p.poll(5000), "poll: no POLLIN"
        assert c.recv(100) == b'a'
        assert not p.poll(50), "poll: POLLIN without data"
        r, w, _ = select.select([c], [c], [], 5)
        assert not r and w == [c], (r, w)
        c.sendall(b'1')
        r, _, _ = select.select([c], [], [], 5); assert r == [c], "select: no read"
        assert c.recv(100) == b'b'
        e = select.epoll(); e.register(c.fileno(), select.EPOLLIN | select.EPOLLET)
        c.sendall(b'2')
        ev = e.poll(5); assert ev and ev[0][1] & select.EPOLLIN, ev
        assert c.recv(1) == b'c'            # leave 'c' bytes behind on purpose
        assert not e.poll(0.1), "EPOLLET re-reported without new data"
        c.sendall(b'3')
        ev = e.poll(5); assert ev, "EPOLLET: new data not reported"
        while True:
            try:
                if not c.recv(100): break
            except BlockingIOError:
                r, _, _ = select.select([c], [], [], 5)
        e.close(); c.close()
    elif case == 'splice':
        c, _ = s.accept(); r, w = os.pipe()
        while True:
            n = os.splice(c.fileno(), w, 65536)
            if n == 0: break
            while n:
                n -= os.splice(r, c.fileno(), n)
        c.close()
    elif case == 'kill':
        c, _ = s.accept()
        c.recv(1)
        blob = b'z' * 65536
        while True:
            c.sendall(blob)
    else:
        c, _ = s.accept(); echo(c)
    print('ok', case)
else:
    ip, port = sys.argv[2], int(sys.argv[3])
    if case == 'prefork':
        for i in range(4):
            c = socket.create_connection((ip, port)); m = b'pre%d' % i * 1000
            c.sendall(m); c.shutdown(socket.SHUT_WR)
            b = b''
            while True:
                d = c.recv(65536)
                if not d: break
                b += d
            assert b == m; c.close()
    elif case == 'dup2':
        c = socket.create_connection((ip, port))
        c.sendall(b'dup'); assert recv_exact(c, 3) == b'dup'
        c.shutdown(socket.SHUT_WR); assert c.recv(10) == b''
    elif case == 'flags':
        c = socket.create_connection((ip, port))
        c.sendall(b'hello'); time.sleep(0.2); c.sendall(b' world')
        assert recv_exact(c, 1) == b'x'
        c.sendall(b'more'); assert recv_exact(c, 4) == b'more'
        c.shutdown(socket.SHUT_WR); assert c.recv(10) == b''
    elif case == 'waits':
        c = socket.create_connection((ip, port))
        time.sleep(0.1); c.sendall(b'a')
        assert recv_exact(c, 1) == b'1'; c.sendall(b'b')
        assert recv_exact(c, 1) == b'2'; c.sendall(b'cc')
        time.sleep(0.1); assert recv_exact(c, 1) == b'3'; c.sendall(b'd')
        c.shutdown(socket.SHUT_WR); assert c.recv(10) == b''
    elif case == 'nonblocking':
        c = socket.socket(); c.setblocking(False)
        r = c.connect_ex((ip, port)); assert r in (0, errno.EINPROGRESS), r
        _, w, _ = select.select([], [c], [], 10); assert w == [c], "connect never writable"
        assert c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        msg = b'n' * 300000; sent = 0; got = b''
        while sent < len(msg) or len(got) < len(msg):
            r, w, _ = select.select([c], [c] if sent < len(msg) else [], [], 10)
            assert r or w, "stalled"
            if w:
                try: sent += c.send(msg[sent:sent + 100000])
                except BlockingIOError: pass
            if r:
                try: got += c.recv(65536)
                except BlockingIOError: pass
        assert got == msg
        c.shutdown(socket.SHUT_WR)
        c.setblocking(True); assert c.recv(10) == b''
    elif case == 'splice':
        c = socket.create_connection((ip, port))
        msg = os.urandom(600000); c.sendall(msg); c.shutdown(socket.SHUT_WR)  # < ring size: no echo deadlock
        got = b''
        while True:
            d = c.recv(65536)
            if not d: break
            got += d
        assert got == msg, (len(got), len(msg))
    elif case == 'kill':
        c = socket.create_connection((ip, port)); c.sendall(b'g')
        recv_exact(c, 1 << 20)
        print('streaming', flush=True)
        t0 = None
        try:
            while True:
                d = c.recv(65536)
                if not d: break
        except ConnectionResetError:
            pass
        print('eof-after-kill', flush=True)
    print('ok', case)
"#;

/// `asyncio_echo.py server PORT` / `asyncio_echo.py client IP PORT CONNS`:
/// asyncio streams; the client holds CONNS connections open at once, each
/// sends 2000 bytes and checks the echo. Prints "ok CONNS".
pub const ASYNCIO_ECHO: &str = r#"
import asyncio, sys
async def handle(r, w):
    while True:
        d = await r.read(65536)
        if not d: break
        w.write(d); await w.drain()
    w.close()
async def server(port):
    s = await asyncio.start_server(handle, '0.0.0.0', port, backlog=2048)
    async with s: await s.serve_forever()
async def one(ip, port, i, opened, go):
    r, w = await asyncio.open_connection(ip, port)
    opened.append(1)
    await go.wait()
    msg = (b'%06d' % i) * 333 + b'xx'
    w.write(msg); await w.drain()
    got = await r.readexactly(len(msg))
    assert got == msg
    w.write_eof()
    assert await r.read() == b''
    w.close()
async def client(ip, port, n):
    opened = []; go = asyncio.Event()
    tasks = [asyncio.create_task(one(ip, port, i, opened, go)) for i in range(n)]
    while len(opened) < n:
        await asyncio.sleep(0.05)
        for t in tasks:
            if t.done() and t.exception(): raise t.exception()
    go.set()   # all n connections are open at the same time now
    await asyncio.gather(*tasks)
    print('ok', n)
if sys.argv[1] == 'server': asyncio.run(server(int(sys.argv[2])))
else: asyncio.run(client(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
"#;

/// `grpc_echo.py server PORT` / `grpc_echo.py client IP PORT N`: a grpcio
/// bidirectional streaming RPC (generic handler, raw bytes) echoing N
/// random-sized messages; the client checks every one. Prints "ok N BYTES".
pub const GRPC_ECHO: &str = r#"
import grpc, sys, hashlib, random
from concurrent import futures
def stream(it, ctx):
    for m in it:
        yield m
if sys.argv[1] == 'server':
    s = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    h = grpc.method_handlers_generic_handler('fl.Echo', {'Stream': grpc.stream_stream_rpc_method_handler(stream)})
    s.add_generic_rpc_handlers((h,))
    s.add_insecure_port('0.0.0.0:%s' % sys.argv[2]); s.start(); s.wait_for_termination()
else:
    ip, port, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
    ch = grpc.insecure_channel('%s:%s' % (ip, port))
    call = ch.stream_stream('/fl.Echo/Stream')
    rng = random.Random(5)
    msgs = [rng.randbytes(rng.randint(1, 200000)) for _ in range(n)]
    got = list(call(iter(msgs), timeout=60))
    assert len(got) == n and all(a == b for a, b in zip(msgs, got)), "stream differs"
    print('ok', n, sum(map(len, got)))
"#;

/// `peer_kill.py server PORT` reads until EOF/error; `peer_kill.py client
/// IP PORT` writes until an error. Each prints how it ended.
pub const PEER_KILL: &str = r#"
import socket, sys, time
role = sys.argv[1]
if role == "server":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(('0.0.0.0', int(sys.argv[2]))); s.listen(8)
    c, _ = s.accept()
    print("accepted", flush=True)
    n = 0
    try:
        while True:
            d = c.recv(65536)
            if not d:
                print("ended eof", n, flush=True); break
            n += len(d)
    except OSError as e:
        print("ended", type(e).__name__, n, flush=True)
else:
    c = socket.create_connection((sys.argv[2], int(sys.argv[3])))
    print("connected", flush=True)
    buf = b"x" * 65536; n = 0
    try:
        while True:
            c.sendall(buf); n += len(buf)
            if n > (64 << 20):
                time.sleep(0.01)
    except OSError as e:
        print("ended", type(e).__name__, n, flush=True)
"#;

/// Python: `echo(host, port, rnd, largest)` sends `E` and random bytes
/// (1 to `largest` of them) on a new connection, reads the echo back and
/// closes; returns (bytes sent, bytes echoed, whether they are the same).
macro_rules! py_checked_echo {
    () => {
        r#"
def echo(host, port, rnd, largest):
    data = rnd.randbytes(rnd.randint(1, largest))
    s = socket.create_connection((host, port))
    s.sendall(b"E" + data)
    got = bytearray()
    while len(got) < len(data):
        chunk = s.recv(len(data) - len(got))
        if not chunk:
            break
        got += chunk
    s.close()
    return len(data), len(got), bytes(got) == data
"#
    };
}

/// Threads x connections each, every connection an echo of random bytes
/// of a random size, checked byte for byte. Prints `ok N errors M [first errors]`
/// (`ok` counts the intact ones; the server echoes after a first byte `E`).
pub const THREADED_CLIENT: &str = concat!(
    "import os, random, socket, sys, threading\n",
    py_checked_echo!(),
    r#"
host, port, threads, each = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ok = []
errors = []
def run(seed):
    rnd = random.Random(seed)
    for _ in range(each):
        try:
            sent, echoed, same = echo(host, port, rnd, 65536)
            if not same:
                errors.append("corrupt echo of %d bytes (got %d)" % (sent, echoed))
            else:
                ok.append(1)
        except Exception as e:
            errors.append(repr(e))
ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
for t in ts: t.start()
for t in ts: t.join()
print("ok", len(ok), "errors", len(errors), errors[:3])
"#
);

/// A client that forks while connecting: each round the parent makes a
/// few more connections than the last (so that the fork lands at every
/// point of its stock's cycle, also while the answer to a refill it sent
/// ahead is still owed), forks a child that connects as often, and keeps
/// connecting while the child runs. Prints `ok N errors M [first errors]`.
pub const FORKING_CLIENT: &str = concat!(
    "import os, random, socket, sys\n",
    py_checked_echo!(),
    r#"
host, port, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ok, errors, rnd = 0, [], random.Random(1)
def burst(n, rnd):
    good = 0
    for _ in range(n):
        try:
            good += echo(host, port, rnd, 4096)[2]
        except Exception as e:
            errors.append(repr(e))
    return good
for r in range(rounds):
    each = 9 + r
    ok += burst(each, rnd)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if burst(each, random.Random(100 + r)) == each else 1)
    ok += burst(each, rnd)
    _, status = os.waitpid(pid, 0)
    if status == 0:
        ok += each
    else:
        errors.append("child %d failed" % r)
print("ok", ok, "errors", len(errors), errors[:3])
"#
);
