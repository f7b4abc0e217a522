//! Python programs for the hostile-peer tests (`tests/e2e/security/rings.rs`):
//! a hostile end that gets a real channel through the preload library and
//! then scribbles the region's shared words in its own mapping, and honest
//! victims that read, peek, poll, epoll, splice and sendfile through the
//! library. Standard library only (ctypes for the raw memory and syscalls).

/// `hostile.py client IP PORT [MODES] | server PORT`: for every shared word of the
/// region and every kind of hostile value (extreme, zero, one back, a MiB
/// ahead, random), opens one lane connection (5 bytes echoed over the
/// ring), writes the value into its own mapping of the channel, rings a raw
/// doorbell (a raw syscall, so its own library is not involved), and waits
/// up to 0.8 s for the victim to end the connection. It then checks that
/// every byte the victim wrote into the ring towards it is one it was given
/// (the attacker only ever sends `A`-`Z`; a fresh memfd is all zero), and
/// runs one honest connection (64 KiB echoed and compared) to show that the
/// victim still serves. Prints `attack WORD MODE reset|ignored`, `leak ...`,
/// `tcp ...` (the lane did not engage) and `done N`.
pub const HOSTILE: &str = r#"
import ctypes, os, random, socket, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
SYS_SENDTO, SYS_POLL = 44, 7
POLLRDHUP, POLLHUP, POLLERR = 0x2000, 0x10, 0x8
ALPHA = bytes(range(65, 91))
# The region (shm-proxy/lane/src/ring.rs): attach word at 0; control blocks
# client->server at 512 and server->client at 1024: tail +0, head +128,
# then reader_waiting, writer_waiting, producer_closed, consumer_closed,
# data_seq, room_seq (u32 from +256) and writer_need (u64 at +280).
FIELDS = [("tail", 0, 8), ("head", 128, 8), ("reader_waiting", 256, 4),
          ("writer_waiting", 260, 4), ("producer_closed", 264, 4),
          ("consumer_closed", 268, 4), ("data_seq", 272, 4), ("room_seq", 276, 4),
          ("writer_need", 280, 8)]
WORDS = [("attach", 0, 4)] + [(d + "." + n, b + o, w)
         for d, b in (("c2s", 512), ("s2c", 1024)) for n, o, w in FIELDS]
MODES = ["max", "zero", "back", "ahead", "random"]
rng = random.Random(7)

class PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]

def maps():
    out = {}
    for line in open("/proc/self/maps"):
        # flowlane-ch-N: a same-node channel; flowlane-relay-N: the relay's
        if "/memfd:flowlane-ch-" in line or "/memfd:flowlane-relay-" in line:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            out[lo] = hi - lo
    return out

def word(addr, w):
    return (ctypes.c_uint64 if w == 8 else ctypes.c_uint32).from_address(addr)

def hostile(cur, w, mode):
    top = (1 << (8 * w)) - 1
    return {"max": top, "zero": 0, "back": (cur - 1) & top,
            "ahead": (cur + (1 << 20)) & top, "random": rng.getrandbits(8 * w)}[mode]

def doorbell(fd):
    libc.syscall(SYS_SENDTO, fd, b"\0", 1, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL, None, 0)

def victim_ended(fd, secs):
    # Raw poll: the library's poll would answer from the rings.
    p = PollFd(fd, POLLRDHUP, 0)
    end = time.time() + secs
    while time.time() < end:
        if libc.syscall(SYS_POLL, ctypes.byref(p), 1, 50) > 0 and p.revents & (POLLRDHUP | POLLHUP | POLLERR):
            return True
    return False

def this_connection(towards_me):
    # The region of the connection that just echoed HELLO: attached (word
    # 1), and this end wrote 5 bytes into its ring (the peer may have
    # written more into the other). Not "the newest mapping": stock
    # channels (made ahead, docs/shm-lane.md) are mapped before their
    # connection exists and sit unused (attach word 0) beside it.
    mine = 512 if towards_me else 1024
    for base, length in maps().items():
        if word(base, 4).value == 1 and word(base + mine, 8).value == 5:
            return base, length
    return None

def attack(c, name, off, w, mode, towards_me):
    found = this_connection(towards_me)
    if not found:
        print("tcp", name, mode, flush=True)
        return
    base, length = found
    ring = (length - 4096) // 2
    wv = word(base + off, w)
    wv.value = hostile(wv.value, w, mode)
    doorbell(c.fileno())
    outcome = "reset" if victim_ended(c.fileno(), 0.8) else "ignored"
    data = ctypes.string_at(base + 4096 + towards_me * ring, ring)
    bad = [b for b in data if b != 0 and b not in ALPHA]
    if bad:
        print("leak", name, mode, len(bad), flush=True)
    print("attack", name, mode, outcome, flush=True)

def echo_ok(c, payload):
    # Piece by piece: with 4 KiB rings both ways a whole-payload write
    # would wait for an echo nobody reads yet.
    got = b""
    for i in range(0, len(payload), 2048):
        piece = payload[i:i + 2048]
        c.sendall(piece)
        want = len(got) + len(piece)
        while len(got) < want:
            d = c.recv(65536)
            if not d:
                return False
            got += d
    return got == payload

role = sys.argv[1]
if len(sys.argv) > 4 and role == "client":
    MODES = sys.argv[4].split(",")
payload = bytes(ALPHA[i % 26] for i in range(65536))
n = 0
if role == "client":
    ip, port = sys.argv[2], int(sys.argv[3])
    for name, off, w in WORDS:
        for mode in MODES:
            c = socket.create_connection((ip, port))
            c.sendall(b"HELLO")
            assert c.recv(5) == b"HELLO"
            attack(c, name, off, w, mode, 1)
            c.close()
            h = socket.create_connection((ip, port))
            print("honest", "ok" if echo_ok(h, payload) else "BROKEN", flush=True)
            h.close()
            n += 1
    c = socket.create_connection((ip, port)); c.sendall(b"QUIT!"); c.close()
else:
    port = int(sys.argv[2])
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(16)
    for name, off, w in WORDS:
        for mode in MODES:
            c, _ = s.accept()
            d = c.recv(5)
            c.sendall(d)
            attack(c, name, off, w, mode, 0)
            c.close()
            h, _ = s.accept()
            while True:
                d = h.recv(65536)
                if not d:
                    break
                h.sendall(d)
            h.close()
            n += 1
print("done", n, flush=True)
"#;

/// The read paths a victim takes, one per connection in turn.
const VICTIM_COMMON: &str = r#"
import os, select, socket, sys, tempfile
MODES = ["recv", "peek", "recvmsg", "readv", "poll", "epoll", "select", "splice", "sendfile"]

def recv_some(c, mode):
    fd = c.fileno()
    if mode == "peek":
        d = c.recv(65536, socket.MSG_PEEK)
        return c.recv(len(d)) if d else d
    if mode == "recvmsg":
        return c.recvmsg(65536)[0]
    if mode == "readv":
        a, b = bytearray(1000), bytearray(64536)
        k = os.readv(fd, [a, b])
        return (bytes(a) + bytes(b))[:k]
    if mode == "poll":
        p = select.poll(); p.register(fd, select.POLLIN); p.poll()
    elif mode == "epoll":
        e = select.epoll(); e.register(fd, select.EPOLLIN | select.EPOLLET); e.poll(); e.close()
    elif mode == "select":
        select.select([c], [], [])
    elif mode == "splice":
        r, w = os.pipe()
        try:
            k = os.splice(fd, w, 65536)
            return os.read(r, k) if k else b""
        finally:
            os.close(r); os.close(w)
    return c.recv(65536)

def send_back(c, d, mode):
    if mode == "sendfile":
        with tempfile.TemporaryFile() as f:
            f.write(d); f.flush(); f.seek(0)
            c.sendfile(f)
    else:
        c.sendall(d)
"#;

/// `victim_server.py PORT`: an echo server under the library; each
/// connection is served with the next read path; a connection that fails
/// prints `conn I MODE reset ERRNO` and the server goes on. A connection
/// that starts with `QUIT!` ends it: `served N resets R`.
pub fn victim_server() -> String {
    format!(
        "{VICTIM_COMMON}{}",
        r#"
port = int(sys.argv[1])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", port)); s.listen(16)
served = resets = 0
while True:
    c, _ = s.accept()
    mode = MODES[served % len(MODES)]
    served += 1
    try:
        first = True
        while True:
            d = recv_some(c, mode)
            if not d:
                break
            if first and d.startswith(b"QUIT!"):
                print("served", served, "resets", resets, flush=True)
                sys.exit(0)
            first = False
            send_back(c, d, mode)
    except OSError as e:
        resets += 1
        print("conn", served, mode, "reset", e.errno, flush=True)
    finally:
        c.close()
"#
    )
}

/// `victim_client.py IP PORT N`: N times: an attacked connection (5 bytes
/// echoed, then it keeps reading with the next read path until the end,
/// and writes into the ring meanwhile), then an honest one (64 KiB echoed
/// and compared). Bytes it receives must be bytes the attacker could have
/// put in the ring (`A`-`Z`, or a fresh ring's zeros). Prints `conn I
/// MODE eof|reset ERRNO`, `honest ok|BROKEN`, `got-foreign` (any other
/// byte), and `done N resets R`.
pub fn victim_client() -> String {
    format!(
        "{VICTIM_COMMON}{}",
        r#"
ip, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ALPHA = bytes(range(65, 91))
payload = bytes(ALPHA[i % 26] for i in range(65536))
resets = 0
for i in range(n):
    mode = MODES[i % len(MODES)]
    c = socket.create_connection((ip, port))
    try:
        c.sendall(b"HELLO")
        got = b""
        while True:
            d = recv_some(c, mode)
            if not d:
                break
            got += d
            # The attacker may "send" ring bytes it never wrote (a fresh
            # ring is zero): still its stream. Anything else came from
            # outside the ring.
            if any(b != 0 and b not in ALPHA for b in d):
                print("got-foreign", i, flush=True)
            send_back(c, b"WORLD", mode)
        print("conn", i, mode, "eof", flush=True)
    except OSError as e:
        resets += 1
        print("conn", i, mode, "reset", e.errno, flush=True)
    finally:
        c.close()
    h = socket.create_connection((ip, port))
    back = b""
    for k in range(0, len(payload), 2048):  # 4 KiB rings: echo piece by piece
        h.sendall(payload[k:k + 2048])
        while len(back) < k + 2048:
            d = h.recv(65536)
            if not d:
                break
            back += d
    print("honest", "ok" if back == payload else "BROKEN", flush=True)
    h.close()
print("done", n, "resets", resets, flush=True)
"#
    )
}

/// `stock_hostile.py IP PORT ROUNDS`: a client that holds stock channels
/// (docs/shm-lane.md, "Pre-created channels") and scribbles, in its own
/// mapping of every stock region it has not used yet, the words a server
/// and the daemon read before an attach: the offer word (connecting with a
/// stamp in the future or a fresh one, "connecting, waited for", offered
/// for a port no connection of its own uses, taken, random), the
/// attach-waiter word (futex, both, random) and the server→client data
/// futex. Each round: 10 connections of its own to get stock (an echo each),
/// the scribbles, then 10 more connections of its own, each an echo of
/// random bytes checked byte for byte. Prints `round R scribbled N`, and
/// `own ok|bad|error` per connection: `bad` (wrong bytes without an
/// error) must never happen; `error` is the attacker hurting itself.
pub const STOCK_HOSTILE: &str = r#"
import ctypes, random, socket, sys, time
host, port, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(13)
CONNECTING, OFFERED, TAKEN = 1 << 16, 2 << 16, 3 << 16
OFFER, STAMP, WAITER, S2C_DATA_SEQ = 128, 192, 256, 1024 + 256 + 16

def regions():
    out = []
    for line in open("/proc/self/maps"):
        if "/memfd:flowlane-ch-" in line:
            out.append(int(line.split()[0].split("-")[0], 16))
    return out

def u32(a):
    return ctypes.c_uint32.from_address(a)

def now_ms():
    return int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1000)

def echo(payload):
    s = socket.create_connection((host, port), timeout=10)
    try:
        s.sendall(b"E" + payload)
        got = b""
        while len(got) < len(payload):
            d = s.recv(65536)
            if not d:
                break
            got += d
        return got == payload
    finally:
        s.close()

for r in range(rounds):
    for _ in range(10):
        assert echo(b"x" * 100), "an honest echo before any scribble"
    fresh = [b for b in regions() if u32(b).value == 0 and u32(b + OFFER).value == 0]
    for j, b in enumerate(fresh):
        kind = (j + r) % 8
        if kind == 0:
            u32(b + OFFER).value = CONNECTING
            ctypes.c_uint64.from_address(b + STAMP).value = now_ms() + 10 ** 9
        elif kind == 1:
            ctypes.c_uint64.from_address(b + STAMP).value = now_ms()
            u32(b + OFFER).value = CONNECTING | 1
        elif kind == 2:
            # A port below every ephemeral one: no connection of its own.
            u32(b + OFFER).value = OFFERED | rng.randint(1, 1000)
        elif kind == 3:
            u32(b + OFFER).value = TAKEN
        elif kind == 4:
            u32(b + OFFER).value = rng.getrandbits(32)
        elif kind == 5:
            u32(b + WAITER).value = rng.choice([3, 4, rng.getrandbits(32)])
        elif kind == 6:
            u32(b + S2C_DATA_SEQ).value = rng.getrandbits(32)
        # kind 7: left as it is.
    print("round", r, "scribbled", len(fresh), flush=True)
    for _ in range(10):
        data = rng.randbytes(rng.randint(1, 65536))
        try:
            print("own", "ok" if echo(data) else "bad", flush=True)
        except OSError as e:
            print("own error", e, flush=True)
print("done", flush=True)
"#;
