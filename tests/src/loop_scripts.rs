//! Programs of the event-loop conformance suite (`tests/tests/shm_event_loops.rs`):
//! the same small protocol in each runtime, so any client can be paired
//! with any server, with or without the preload library.
//!
//! The protocol ("echo and trailer"): the client streams BYTES
//! pseudo-random bytes and half-closes; the server echoes everything it
//! receives while it arrives (both directions at once), and after the
//! client's end of stream writes the trailer `<bytes> <sha256 hex>\n` of
//! what it received and closes. The client checks that the echo and the
//! trailer match what it sent, then prints `ok <bytes> <sha256>`.

/// Node.js (`/usr/bin/node`): `node -e NODE_LOOP server PORT CONNS` serves
/// CONNS connections (concurrently, as they come) and exits;
/// `node -e NODE_LOOP client IP PORT BYTES SEED` runs one client.
pub const NODE_LOOP: &str = r#"
const net = require('net'), crypto = require('crypto');
const [mode, a, b, c, d] = process.argv.slice(1);
if (mode === 'server') {
  let left = Number(b);
  const srv = net.createServer({ allowHalfOpen: true }, (sock) => {
    const h = crypto.createHash('sha256'); let n = 0;
    sock.on('data', (chunk) => {
      h.update(chunk); n += chunk.length;
      if (!sock.write(chunk)) { sock.pause(); sock.once('drain', () => sock.resume()); }
    });
    sock.on('end', () => sock.end(`${n} ${h.digest('hex')}\n`));
    sock.on('error', (e) => { console.error('server socket:', e.message); process.exit(3); });
    sock.on('close', () => { if (--left === 0) srv.close(); });
  });
  srv.listen(Number(a), '0.0.0.0');
} else {
  const [ip, port, total, seed] = [a, Number(b), Number(c), Number(d)];
  let x = (seed * 2654435761) >>> 0 || 1;
  const block = Buffer.alloc(1 << 16);
  const sent = crypto.createHash('sha256'), got = crypto.createHash('sha256');
  let n = 0, echoed = 0, tail = Buffer.alloc(0);
  const sock = net.connect({ host: ip, port, allowHalfOpen: true }, () => {
    const pump = () => {
      while (n < total) {
        for (let i = 0; i < block.length; i += 4) {
          x ^= x << 13; x >>>= 0; x ^= x >>> 17; x ^= x << 5; x >>>= 0;
          block.writeUInt32LE(x, i);
        }
        const k = Math.min(block.length - (x % 1000), total - n);
        const chunk = Buffer.from(block.subarray(0, k));
        sent.update(chunk); n += k;
        if (!sock.write(chunk)) { sock.once('drain', pump); return; }
      }
      sock.end();
    };
    pump();
  });
  sock.on('data', (chunk) => {
    const want = total - echoed;
    if (chunk.length <= want) { got.update(chunk); echoed += chunk.length; return; }
    got.update(chunk.subarray(0, want)); echoed += want;
    tail = Buffer.concat([tail, chunk.subarray(want)]);
  });
  sock.on('end', () => {
    const s = sent.digest('hex'), g = got.digest('hex');
    const want = `${total} ${s}\n`;
    if (echoed !== total || g !== s || tail.toString() !== want) {
      console.error(`mismatch: echoed ${echoed}/${total}, echo ${g} vs sent ${s}, trailer ${JSON.stringify(tail.toString())}`);
      process.exit(2);
    }
    console.log(`ok ${total} ${s}`);
  });
  sock.on('error', (e) => { console.error('client:', e.code || e.message); process.exit(1); });
}
"#;
