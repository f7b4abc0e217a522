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
