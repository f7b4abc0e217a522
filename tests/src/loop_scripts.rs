//! Programs of the event-loop conformance suite (`tests/e2e/shm/event_loops.rs`):
//! the same small protocol in each runtime, so any client can be paired
//! with any server, with or without the preload library.
//!
//! The protocol ("echo and trailer"): the client streams BYTES bytes of a
//! pseudo-random stream (below) and half-closes (`shutdown(SHUT_WR)`); the
//! server echoes everything it receives while it arrives (both directions
//! at once), and after the client's end of stream writes the trailer
//! `<bytes> <crc32 hex>\n` of what it received and closes. The client checks
//! every echoed byte against the stream as it arrives and the trailer
//! against what it sent, then prints `ok <bytes> <crc32>` (exit 0). A
//! wrong byte prints `wrong byte at <pos>` (exit 2); an end of stream too
//! early, a reset or any other error prints `eof ...`/`error ...`/`short
//! ...` (exit 3). BYTES 0 streams until the connection breaks (the
//! peer-killed checks). Over TLS (the Python program's `tls` mode) the
//! client sends `<bytes>\n` first instead of half-closing: TLS has no
//! half-close.
//!
//! The server serves CONNS connections, as they come (concurrently), prints
//! one line per connection when it ends (`conn <bytes> <crc32>` or `conn
//! error <why>`: a client killed mid-stream is an error, not the server's
//! end) and exits 0.
//!
//! The stream: a 64 KiB base block B from xorshift32 (state `seed *
//! 2654435761 mod 2^32`, or 1 if that is 0; `x ^= x << 13; x ^= x >> 17;
//! x ^= x << 5` per 32-bit word, little-endian); byte `p` of the stream is
//! `B[(p mod 65536 + (p / 65536) * 4099) mod 65536]` (each 64 KiB block a
//! different rotation of B, so a repeated, lost or reordered block shows).
//! The client writes it in chunks cycling through [`CHUNKS`].

use std::sync::Arc;

/// Write sizes of the clients, in turn.
pub const CHUNKS: [usize; 6] = [65536, 1, 4093, 100000, 777, 30001];

/// The pseudo-random stream of one seed (see the module comment).
#[derive(Clone)]
pub struct Stream(Arc<Vec<u8>>);

impl Stream {
    pub fn new(seed: u32) -> Stream {
        let mut x = seed.wrapping_mul(2654435761);
        if x == 0 {
            x = 1;
        }
        let mut b = Vec::with_capacity(1 << 17);
        for _ in 0..16384 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            b.extend_from_slice(&x.to_le_bytes());
        }
        b.extend_from_within(..1 << 16);
        Stream(Arc::new(b))
    }

    /// Appends bytes `p .. p + n` of the stream to `out`.
    pub fn span(&self, mut p: u64, mut n: usize, out: &mut Vec<u8>) {
        while n > 0 {
            let (j, o) = (p >> 16, (p & 0xffff) as usize);
            let r = ((j * 4099) & 0xffff) as usize;
            let k = n.min(65536 - o);
            let s = (o + r) & 0xffff;
            out.extend_from_slice(&self.0[s..s + k]);
            p += k as u64;
            n -= k;
        }
    }
}

/// CRC-32 (IEEE, as zlib's `crc32`) of `data`, continuing from `crc`.
pub fn crc32_update(crc: u32, data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let t = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, e) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    0xEDB8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                };
            }
            *e = c;
        }
        t
    });
    let mut c = !crc;
    for &b in data {
        c = t[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

/// Node.js (`/usr/bin/node`, `net`: libuv): `node -e NODE_LOOP server PORT
/// CONNS` / `node -e NODE_LOOP client IP PORT BYTES SEED`.
pub const NODE_LOOP: &str = r#"
const net = require('net'), zlib = require('zlib');
const [mode, a, b, c, d] = process.argv.slice(1);
const CHUNKS = [65536, 1, 4093, 100000, 777, 30001];
function base(seed) {
  let x = Math.imul(seed, 2654435761) >>> 0 || 1;
  const bb = Buffer.alloc(131072);
  for (let i = 0; i < 16384; i++) {
    x ^= x << 13; x >>>= 0; x ^= x >>> 17; x ^= x << 5; x >>>= 0;
    bb.writeUInt32LE(x, 4 * i);
  }
  bb.copy(bb, 65536, 0, 65536);
  return bb;
}
function span(bb, p, n) {
  const parts = [];
  while (n > 0) {
    const j = Math.floor(p / 65536), o = p % 65536, r = (j * 4099) % 65536;
    const k = Math.min(n, 65536 - o), s = (o + r) % 65536;
    parts.push(bb.subarray(s, s + k)); p += k; n -= k;
  }
  return parts.length === 1 ? parts[0] : Buffer.concat(parts);
}
if (mode === 'server') {
  let left = Number(b);
  const srv = net.createServer({ allowHalfOpen: true }, (sock) => {
    let crc = 0, n = 0, done = false;
    const end = (line) => {
      if (done) return; done = true; console.log(line);
      if (--left === 0) srv.close();
    };
    sock.on('data', (chunk) => {
      crc = zlib.crc32(chunk, crc); n += chunk.length;
      if (!sock.write(chunk)) { sock.pause(); sock.once('drain', () => sock.resume()); }
    });
    sock.on('end', () => sock.end(`${n} ${(crc >>> 0).toString(16).padStart(8, '0')}\n`));
    sock.on('error', (e) => { end(`conn error ${e.code || e.message}`); sock.destroy(); });
    sock.on('close', () => end(`conn ${n} ${(crc >>> 0).toString(16).padStart(8, '0')}`));
  });
  srv.listen(Number(a), '0.0.0.0');
} else {
  const [ip, port, total, seed] = [a, Number(b), Number(c), Number(d)];
  const bb = base(seed);
  let p = 0, i = 0, crc = 0, echoed = 0, tail = Buffer.alloc(0);
  const fail = (code, line) => { console.log(line); process.exit(code); };
  const sock = net.connect({ host: ip, port, allowHalfOpen: true }, () => {
    const pump = () => {
      while (total === 0 || p < total) {
        let n = CHUNKS[i++ % CHUNKS.length];
        if (total) n = Math.min(n, total - p);
        const chunk = Buffer.from(span(bb, p, n));
        crc = zlib.crc32(chunk, crc); p += n;
        if (!sock.write(chunk)) { sock.once('drain', pump); return; }
      }
      sock.end();
    };
    pump();
  });
  sock.on('data', (chunk) => {
    if (total === 0 || echoed < total) {
      const m = total === 0 ? chunk.length : Math.min(chunk.length, total - echoed);
      const want = span(bb, echoed, m);
      if (!want.equals(chunk.subarray(0, m))) {
        let k = 0; while (want[k] === chunk[k]) k++;
        fail(2, `wrong byte at ${echoed + k}`);
      }
      echoed += m; chunk = chunk.subarray(m);
    }
    if (chunk.length) tail = Buffer.concat([tail, chunk]);
  });
  sock.on('end', () => {
    if (total === 0 || echoed < total) fail(3, `eof after ${echoed}`);
    const want = `${total} ${(crc >>> 0).toString(16).padStart(8, '0')}\n`;
    if (tail.toString() !== want) fail(3, `short: trailer ${JSON.stringify(tail.toString())}`);
    console.log(`ok ${total} ${(crc >>> 0).toString(16).padStart(8, '0')}`);
  });
  sock.on('error', (e) => fail(3, `error ${e.code || e.message} after ${echoed}`));
}
"#;

/// Python asyncio (`/usr/bin/python3 -c PY_LOOP`): `server PORT CONNS` /
/// `client IP PORT BYTES SEED`, then options: `uvloop` (uvloop's loop:
/// libuv), `tls DIR` (TLS with `DIR/cert.pem`, `DIR/key.pem`: OpenSSL
/// through Python's `ssl`).
pub const PY_LOOP: &str = r#"
import asyncio, os, ssl, sys, zlib
CHUNKS = [65536, 1, 4093, 100000, 777, 30001]
args = sys.argv[1:]
mode = args[0]
tls = args[args.index('tls') + 1] if 'tls' in args else None
if 'uvloop' in args:
    import uvloop
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())

def base(seed):
    x = (seed * 2654435761) & 0xffffffff or 1
    out = bytearray(65536)
    for i in range(16384):
        x ^= (x << 13) & 0xffffffff; x ^= x >> 17; x ^= (x << 5) & 0xffffffff
        out[4 * i:4 * i + 4] = x.to_bytes(4, 'little')
    return bytes(out) * 2

def span(bb, p, n):
    parts = []
    while n > 0:
        j, o = p >> 16, p & 0xffff
        k = min(n, 65536 - o); s = (o + j * 4099) & 0xffff
        parts.append(bb[s:s + k]); p += k; n -= k
    return b''.join(parts)

def say(line, code=None):
    print(line, flush=True)
    if code is not None:
        os._exit(code)

async def server(port, conns):
    done = asyncio.Event(); left = [conns]
    async def handle(reader, writer):
        n = crc = 0
        try:
            limit = int(await reader.readline()) if tls else 0
            while limit == 0 or n < limit:
                d = await reader.read(65536 if limit == 0 else min(65536, limit - n))
                if not d:
                    break
                crc = zlib.crc32(d, crc); n += len(d)
                writer.write(d); await writer.drain()
            writer.write(f'{n} {crc:08x}\n'.encode()); await writer.drain()
            if not tls:
                writer.write_eof(); await reader.read()
            # close() only starts the flush: uvloop still buffers the
            # trailer here (it writes at the end of the loop's iteration),
            # and a write that met a full ring waits for room. Returning
            # before wait_closed let the last connection's trailer die with
            # the loop when the server exited.
            writer.close(); await writer.wait_closed()
            say(f'conn {n} {crc:08x}')
        except Exception as e:
            say(f'conn error {e!r}'); writer.close()
        left[0] -= 1
        if left[0] == 0:
            done.set()
    ctx = None
    if tls:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(f'{tls}/cert.pem', f'{tls}/key.pem')
    srv = await asyncio.start_server(handle, '0.0.0.0', port, ssl=ctx, backlog=128)
    await done.wait()
    srv.close()

async def client(ip, port, total, seed):
    bb = base(seed); crc = 0
    ctx = None
    if tls:
        ctx = ssl.create_default_context(cafile=f'{tls}/cert.pem')
    try:
        reader, writer = await asyncio.open_connection(ip, port, ssl=ctx,
                                                       server_hostname='flowlane-test' if tls else None)
    except Exception as e:
        say(f'error connect {e!r}', 3)
    async def send():
        nonlocal crc
        p = i = 0
        try:
            if tls:
                writer.write(f'{total}\n'.encode())
            while total == 0 or p < total:
                n = CHUNKS[i % len(CHUNKS)]; i += 1
                if total:
                    n = min(n, total - p)
                d = span(bb, p, n); crc = zlib.crc32(d, crc); p += n
                writer.write(d); await writer.drain()
            if not tls:
                writer.write_eof()
        except Exception as e:
            say(f'error write {e!r} after {p}', 3)
    task = asyncio.create_task(send())
    echoed = 0; tail = b''
    try:
        while True:
            d = await reader.read(65536)
            if not d:
                break
            if total == 0 or echoed < total:
                m = len(d) if total == 0 else min(len(d), total - echoed)
                want = span(bb, echoed, m)
                if d[:m] != want:
                    k = next(i for i in range(m) if d[i] != want[i])
                    say(f'wrong byte at {echoed + k}', 2)
                echoed += m; d = d[m:]
            tail += d
    except Exception as e:
        say(f'error read {e!r} after {echoed}', 3)
    if total == 0 or echoed < total:
        say(f'eof after {echoed}', 3)
    await task
    if tail != f'{total} {crc:08x}\n'.encode():
        say(f'short: trailer {tail!r}', 3)
    say(f'ok {total} {crc:08x}')
    writer.close()

if mode == 'server':
    asyncio.run(server(int(args[1]), int(args[2])))
else:
    asyncio.run(client(args[1], int(args[2]), int(args[3]), int(args[4])))
"#;

/// Standalone asio (Debian's `libasio-dev`, header only), built by the
/// suite with g++ (`asio-echo server PORT CONNS` / `asio-echo client IP
/// PORT BYTES SEED`). Its epoll reactor registers every socket when it is
/// opened, before `connect` (`EPOLLET | EPOLLIN | EPOLLPRI | EPOLLERR |
/// EPOLLHUP`, a pointer as the data word), and adds `EPOLLOUT` with
/// `EPOLL_CTL_MOD` for the connect and for writes that would block.
pub const ASIO_ECHO_CPP: &str = r#"
#define ASIO_STANDALONE
#include <asio.hpp>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>
using asio::ip::tcp;

static const size_t CHUNKS[6] = {65536, 1, 4093, 100000, 777, 30001};
static uint32_t TABLE[256];
static void crc_init() {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    TABLE[i] = c;
  }
}
static uint32_t crc32(uint32_t crc, const uint8_t* p, size_t n) {
  uint32_t c = ~crc;
  for (size_t i = 0; i < n; i++) c = TABLE[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return ~c;
}
struct Stream {
  std::vector<uint8_t> bb;
  explicit Stream(uint32_t seed) : bb(131072) {
    uint32_t x = seed * 2654435761u;
    if (x == 0) x = 1;
    for (int i = 0; i < 16384; i++) {
      x ^= x << 13; x ^= x >> 17; x ^= x << 5;
      for (int k = 0; k < 4; k++) bb[4 * i + k] = uint8_t(x >> (8 * k));
    }
    std::copy(bb.begin(), bb.begin() + 65536, bb.begin() + 65536);
  }
  void span(uint64_t p, size_t n, std::vector<uint8_t>& out) const {
    out.clear();
    while (n > 0) {
      uint64_t j = p >> 16; size_t o = p & 0xffff;
      size_t k = std::min(n, size_t(65536) - o), s = (o + j * 4099) & 0xffff;
      out.insert(out.end(), bb.begin() + s, bb.begin() + s + k);
      p += k; n -= k;
    }
  }
};
static std::string hex8(uint32_t c) { char b[16]; snprintf(b, sizeof b, "%08x", c); return b; }
static void say(const std::string& s) { printf("%s\n", s.c_str()); fflush(stdout); }
[[noreturn]] static void fail(int code, const std::string& s) { say(s); _exit(code); }

struct Session : std::enable_shared_from_this<Session> {
  tcp::socket s; std::array<uint8_t, 65536> buf; uint64_t n = 0; uint32_t crc = 0;
  std::string trailer; int* left; asio::io_context* io; bool done = false;
  Session(tcp::socket s, int* left, asio::io_context* io) : s(std::move(s)), left(left), io(io) {}
  void end(const std::string& line) {
    if (done) return;
    done = true; say(line);
    if (--*left == 0) io->stop();
  }
  void read() {
    auto self = shared_from_this();
    s.async_read_some(asio::buffer(buf), [this, self](std::error_code e, size_t k) {
      if (e == asio::error::eof) {
        trailer = std::to_string(n) + " " + hex8(crc) + "\n";
        asio::async_write(s, asio::buffer(trailer), [this, self](std::error_code e, size_t) {
          if (e) return end("conn error " + e.message());
          std::error_code ig; s.shutdown(tcp::socket::shutdown_send, ig); s.close(ig);
          end("conn " + std::to_string(n) + " " + hex8(crc));
        });
        return;
      }
      if (e) return end("conn error " + e.message());
      crc = crc32(crc, buf.data(), k); n += k;
      asio::async_write(s, asio::buffer(buf.data(), k), [this, self](std::error_code e, size_t) {
        if (e) return end("conn error " + e.message());
        read();
      });
    });
  }
};

static void accept_loop(tcp::acceptor& a, int* left, asio::io_context& io) {
  a.async_accept([&a, left, &io](std::error_code e, tcp::socket s) {
    if (!e) std::make_shared<Session>(std::move(s), left, &io)->read();
    accept_loop(a, left, io);
  });
}

struct Client {
  tcp::socket s; Stream st; uint64_t total, p = 0, echoed = 0; size_t i = 0; uint32_t crc = 0;
  std::vector<uint8_t> out, want; std::array<uint8_t, 65536> buf; std::string tail;
  Client(asio::io_context& io, uint64_t total, uint32_t seed) : s(io), st(seed), total(total) {}
  void write() {
    if (total != 0 && p >= total) {
      std::error_code e; s.shutdown(tcp::socket::shutdown_send, e);
      if (e) fail(3, "error shutdown " + e.message());
      return;
    }
    size_t n = CHUNKS[i++ % 6];
    if (total != 0) n = std::min<uint64_t>(n, total - p);
    st.span(p, n, out); crc = crc32(crc, out.data(), n); p += n;
    asio::async_write(s, asio::buffer(out), [this](std::error_code e, size_t) {
      if (e) fail(3, "error write " + e.message() + " after " + std::to_string(p));
      write();
    });
  }
  void read() {
    s.async_read_some(asio::buffer(buf), [this](std::error_code e, size_t k) {
      if (e == asio::error::eof) return finish();
      if (e) fail(3, "error read " + e.message() + " after " + std::to_string(echoed));
      size_t m = k;
      if (total != 0 && echoed >= total) m = 0;
      else if (total != 0) m = std::min<uint64_t>(k, total - echoed);
      st.span(echoed, m, want);
      for (size_t j = 0; j < m; j++)
        if (buf[j] != want[j]) fail(2, "wrong byte at " + std::to_string(echoed + j));
      echoed += m;
      tail.append(reinterpret_cast<char*>(buf.data()) + m, k - m);
      read();
    });
  }
  void finish() {
    if (total == 0 || echoed < total) fail(3, "eof after " + std::to_string(echoed));
    std::string want = std::to_string(total) + " " + hex8(crc) + "\n";
    if (p < total || tail != want) fail(3, "short: trailer " + tail);
    say("ok " + std::to_string(total) + " " + hex8(crc));
    _exit(0);
  }
};

int main(int argc, char** argv) {
  crc_init();
  std::string mode = argc > 1 ? argv[1] : "";
  asio::io_context io;
  if (mode == "server" && argc == 4) {
    int left = atoi(argv[3]);
    tcp::acceptor a(io);
    a.open(tcp::v4());
    a.set_option(tcp::acceptor::reuse_address(true));
    a.bind(tcp::endpoint(tcp::v4(), uint16_t(atoi(argv[2]))));
    a.listen(128);
    accept_loop(a, &left, io);
    io.run();
    return 0;
  }
  if (mode == "client" && argc == 6) {
    Client c(io, strtoull(argv[4], nullptr, 10), uint32_t(strtoul(argv[5], nullptr, 10)));
    c.s.open(tcp::v4());  // the reactor registers the socket here, before connect
    c.s.async_connect(tcp::endpoint(asio::ip::make_address(argv[2]), uint16_t(atoi(argv[3]))),
                      [&c](std::error_code e) {
                        if (e) fail(3, "error connect " + e.message());
                        c.write();
                        c.read();
                      });
    io.run();
    fail(3, "event loop ended");
  }
  fprintf(stderr, "usage: asio-echo server PORT CONNS | client IP PORT BYTES SEED\n");
  return 64;
}
"#;

/// Epoll registrations made before `connect`, through Python's
/// `select.epoll` (`python3 -c EPOLL_BEFORE_CONNECT IP PORT`), against a
/// `PY_LOOP` server: each case exchanges 200 kB with the echo protocol and
/// asserts what the kernel would report on plain TCP (the script passes
/// without the library too). Prints `ok` and one `case <name> <fd>` line
/// per case.
///
/// - `two-sets`: the socket in an edge-triggered set with
///   `EPOLLIN|EPOLLOUT|EPOLLPRI|EPOLLERR|EPOLLHUP` (modified once before
///   connect), in a level-triggered `EPOLLIN` set, and added to and
///   removed from a third set, all before a non-blocking connect; the
///   edge-triggered set reports the connect (`EPOLLOUT`), the
///   level-triggered one the echo, the third never the socket.
/// - `oneshot`: `EPOLLIN|EPOLLOUT|EPOLLONESHOT` before connect; the
///   unconnected socket's `EPOLLHUP` disarms it, so nothing is reported
///   after connect until the application's `EPOLL_CTL_MOD` re-arms it.
/// - `forked`: registered before a `fork`, connected in the child (the set
///   may be shared with the parent: the connection stays on TCP).
pub const EPOLL_BEFORE_CONNECT: &str = r#"
import errno, os, select, socket, sys, zlib
ip, port = sys.argv[1], int(sys.argv[2])
N = 200000
DATA = bytes((i * 7 + i // 251) & 0xff for i in range(N))
WANT = DATA + f'{N} {zlib.crc32(DATA):08x}\n'.encode()
IN, OUT, PRI, ERR, HUP, ET, ONESHOT = (select.EPOLLIN, select.EPOLLOUT, select.EPOLLPRI,
    select.EPOLLERR, select.EPOLLHUP, select.EPOLLET, select.EPOLLONESHOT)

def fds(ep, t):
    return [fd for fd, _ in ep.poll(t)]

def exchange(s, ep):
    # Sends DATA, half-closes, reads until EOF through `ep` (level-triggered).
    sent, got = 0, b''
    while True:
        if sent < N:
            try:
                sent += s.send(DATA[sent:sent + 65536])
            except BlockingIOError:
                pass
            if sent == N:
                s.shutdown(socket.SHUT_WR)
        try:
            d = s.recv(65536)
            if not d:
                break
            got += d
            continue
        except BlockingIOError:
            pass
        if sent == N:
            assert s.fileno() in fds(ep, 5), 'no EPOLLIN while the echo is due'
    assert got == WANT, f'echo: {len(got)} bytes, want {len(WANT)}'

def connect(s):
    try:
        s.connect((ip, port))
    except BlockingIOError:
        pass

def wait_connected(ep, s):
    for _ in range(100):
        if s.fileno() in fds(ep, 0.1):
            break
    assert s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0

# two-sets
s = socket.socket(); s.setblocking(False); fd = s.fileno()
e1, e2, e3 = select.epoll(), select.epoll(), select.epoll()
e1.register(fd, IN | PRI | ERR | HUP | ET)
e1.modify(fd, IN | OUT | PRI | ERR | HUP | ET)
e2.register(fd, IN)
e3.register(fd, IN | OUT); e3.unregister(fd)
fds(e1, 0)  # consume the unconnected socket's edge
connect(s)
wait_connected(e1, s)
assert fds(e1, 0) == [], 'edge-triggered set reported the same edge twice'
exchange(s, e2)
assert fds(e3, 0.05) == [], 'a set the socket was removed from reported it'
print('case two-sets', fd); s.close()

# oneshot
s = socket.socket(); s.setblocking(False); fd = s.fileno()
e = select.epoll()
e.register(fd, IN | OUT | ONESHOT)
assert fds(e, 1) == [fd], 'the unconnected socket did not fire (EPOLLHUP)'
connect(s)
assert fds(e, 0.3) == [], 'a fired one-shot registration reported again before its MOD'
e.modify(fd, OUT | ONESHOT)
wait_connected(e, s)
e.modify(fd, IN)
exchange(s, e)
print('case oneshot', fd); s.close()

# forked
s = socket.socket(); fd = s.fileno()
e = select.epoll(); e.register(fd, IN)
pid = os.fork()
if pid == 0:
    try:
        s.connect((ip, port)); s.setblocking(False)
        exchange(s, e)
        os._exit(0)
    except BaseException as x:
        print('child:', repr(x), flush=True); os._exit(1)
_, st = os.waitpid(pid, 0)
assert st == 0, f'forked child: {st}'
print('case forked', fd)
print('ok')
"#;
