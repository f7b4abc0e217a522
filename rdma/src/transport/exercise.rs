//! Checked transfers over any [`LaneStream`], shared by the host tests, the
//! Soft-RoCE tests and `rdma-lane-bench`: both directions at once, random
//! message sizes, and every received byte compared with what the sender's
//! generator produced (a dropped, duplicated, reordered or corrupted byte
//! fails the check at its offset).

use std::{
    io,
    sync::{Arc, Condvar, Mutex},
    thread,
    time::{Duration, Instant},
};

use crate::lane_stream::{LaneStream, Piece, RingArea};

/// Small deterministic generator (xorshift64*), so both ends derive the
/// same bytes from a seed without sharing them.
#[derive(Debug, Clone)]
pub struct Pattern(u64);

impl Pattern {
    pub fn new(seed: u64) -> Self {
        Pattern(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// A byte stream: the bytes of `Pattern(seed)` in 8-byte words, read at any
/// offset, so a receiver can check data cut at arbitrary boundaries.
struct PatternStream {
    p: Pattern,
    word: [u8; 8],
    used: usize,
}

impl PatternStream {
    fn new(seed: u64) -> Self {
        PatternStream {
            p: Pattern::new(seed),
            word: [0; 8],
            used: 8,
        }
    }

    fn fill(&mut self, buf: &mut [u8]) {
        for b in buf {
            if self.used == 8 {
                self.word = self.p.next_u64().to_le_bytes();
                self.used = 0;
            }
            *b = self.word[self.used];
            self.used += 1;
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct ExchangeSpec {
    /// Seed of the bytes this side sends; the peer expects them.
    pub send_seed: u64,
    /// Seed of the bytes the peer sends.
    pub recv_seed: u64,
    pub send_bytes: u64,
    pub recv_bytes: u64,
    /// Message sizes are uniform in 1..=max_msg.
    pub max_msg: usize,
}

#[derive(Debug, Clone, Copy)]
pub struct ExchangeReport {
    pub sent: u64,
    pub received: u64,
    pub elapsed: Duration,
}

/// Sends `send_bytes` (then half-closes) while receiving until EOF, and
/// checks every received byte. Errors name the first bad offset.
pub fn exchange(stream: Arc<dyn LaneStream>, spec: ExchangeSpec) -> io::Result<ExchangeReport> {
    let t0 = Instant::now();
    let tx = Arc::clone(&stream);
    let sender = thread::spawn(move || -> io::Result<u64> {
        let mut data = PatternStream::new(spec.send_seed);
        let mut sizes = Pattern::new(spec.send_seed ^ 0xA5A5);
        let mut buf = vec![0u8; spec.max_msg.max(1)];
        let mut sent = 0u64;
        while sent < spec.send_bytes {
            let n = (1 + sizes.next_u64() % spec.max_msg.max(1) as u64).min(spec.send_bytes - sent)
                as usize;
            data.fill(&mut buf[..n]);
            let mut off = 0;
            while off < n {
                off += tx.send(&buf[off..n])?;
            }
            sent += n as u64;
        }
        tx.shutdown_send()?;
        Ok(sent)
    });
    let received = check_receive(&*stream, spec.recv_seed, spec.recv_bytes, spec.max_msg);
    let sent = sender
        .join()
        .map_err(|_| io::Error::other("sender thread panicked"))?;
    let received = received?;
    Ok(ExchangeReport {
        sent: sent?,
        received,
        elapsed: t0.elapsed(),
    })
}

/// Receives until EOF, comparing with `Pattern(seed)`; fails on a mismatch
/// or when the total differs from `expect`.
pub fn check_receive(
    stream: &dyn LaneStream,
    seed: u64,
    expect: u64,
    bufsize: usize,
) -> io::Result<u64> {
    let mut want = PatternStream::new(seed);
    let mut buf = vec![0u8; bufsize.max(1)];
    let mut exp = vec![0u8; bufsize.max(1)];
    let mut got = 0u64;
    loop {
        let n = stream.recv(&mut buf)?;
        if n == 0 {
            break;
        }
        want.fill(&mut exp[..n]);
        if let Some(i) = (0..n).find(|&i| buf[i] != exp[i]) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "byte {} differs: got {:#04x}, expected {:#04x}",
                    got + i as u64,
                    buf[i],
                    exp[i]
                ),
            ));
        }
        got += n as u64;
    }
    if got != expect {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("stream ended after {got} bytes, expected {expect}"),
        ));
    }
    Ok(got)
}

/// A zero-copy exchange ([`DirectLane`]): each side owns a sending ring and
/// a receiving ring (power-of-two sizes, which may differ between the
/// sides), registers them, and the sender places pattern bytes straight
/// into the peer's receiving ring, cut at both rings' wraps, never beyond
/// the room the peer reported; the receiver checks every byte where it
/// landed. What the relay does with pod rings, without pods.
#[derive(Debug, Clone, Copy)]
pub struct DirectSpec {
    pub exchange: ExchangeSpec,
    /// Our sending ring and receiving ring sizes (powers of two).
    pub tx_ring: usize,
    pub rx_ring: usize,
    /// The receiver pauses this long after each placement it consumed (a
    /// slow reader: the sender must wait for ring space).
    pub reader_delay: Duration,
    /// Benchmark mode: every placement is `max_msg` bytes, nothing is
    /// generated or checked (the bytes are whatever the ring holds), and
    /// `recv_bytes == u64::MAX` receives until the peer's end.
    pub bench: bool,
}

/// Messages of the exchange's own protocol on the stream.
const MSG_DESC: u8 = b'D';
const MSG_PLACED: u8 = b'P';
const MSG_ROOM: u8 = b'R';
const MSG_END: u8 = b'E';

/// Ring memory with a stable address (page-aligned, zeroed).
struct RingMem(memmap2::MmapMut);

impl RingMem {
    fn new(len: usize) -> io::Result<Self> {
        Ok(RingMem(memmap2::MmapMut::map_anon(len)?))
    }
    fn area(&mut self) -> RingArea {
        RingArea {
            ptr: self.0.as_mut_ptr(),
            len: self.0.len(),
        }
    }
}

/// Sends messages whole, from either thread.
struct Sender {
    stream: Arc<dyn LaneStream>,
    lock: Mutex<()>,
}

impl Sender {
    fn send(&self, m: &[u8]) -> io::Result<()> {
        let _g = self.lock.lock().unwrap();
        let mut off = 0;
        while off < m.len() {
            off += self.stream.send(&m[off..])?;
        }
        Ok(())
    }
    fn place(&self, pieces: &[Piece], notify: &[u8]) -> io::Result<()> {
        let _g = self.lock.lock().unwrap();
        let dl = self
            .stream
            .direct()
            .ok_or_else(|| io::Error::other("no direct lane"))?;
        dl.place(pieces, notify)
    }
}

/// Reads whole messages of the exchange's protocol.
struct Reader {
    stream: Arc<dyn LaneStream>,
    buf: Vec<u8>,
}

impl Reader {
    fn fill(&mut self, n: usize) -> io::Result<bool> {
        let mut b = [0u8; 64];
        while self.buf.len() < n {
            let k = self.stream.recv(&mut b)?;
            if k == 0 {
                return Ok(false);
            }
            self.buf.extend_from_slice(&b[..k]);
        }
        Ok(true)
    }
    /// The next message's kind and argument bytes; None at the stream's end.
    fn next(&mut self) -> io::Result<Option<(u8, Vec<u8>)>> {
        if !self.fill(1)? {
            return Ok(None);
        }
        let arg = match self.buf[0] {
            MSG_DESC => {
                if !self.fill(3)? {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                2 + u16::from_le_bytes([self.buf[1], self.buf[2]]) as usize
            }
            MSG_PLACED => 4,
            MSG_ROOM => 8,
            MSG_END => 0,
            k => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("bad message {k}"),
                ))
            }
        };
        if !self.fill(1 + arg)? {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let m: Vec<u8> = self.buf.drain(..1 + arg).collect();
        Ok(Some((m[0], m[1..].to_vec())))
    }
}

/// Runs a zero-copy exchange over `stream` (both sides call it).
pub fn direct_exchange(
    stream: Arc<dyn LaneStream>,
    spec: DirectSpec,
) -> io::Result<ExchangeReport> {
    let t0 = Instant::now();
    let dl_check = stream
        .direct()
        .ok_or_else(|| io::Error::other("the stream cannot place"))?;
    let _ = dl_check;
    let mut tx_mem = RingMem::new(spec.tx_ring)?;
    let mut rx_mem = RingMem::new(spec.rx_ring)?;
    let (tx_area, rx_area) = (tx_mem.area(), rx_mem.area());
    // (bytes completed, bytes of room the peer reported) + wake-up.
    let progress = Arc::new((Mutex::new((0u64, 0u64)), Condvar::new()));
    let p2 = Arc::clone(&progress);
    let on_placed = Box::new(move |n: u64| {
        p2.0.lock().unwrap().0 += n;
        p2.1.notify_all();
    });
    // SAFETY: both areas stay mapped (tx_mem, rx_mem) until after `guard`
    // is dropped at the end of this function; rx is written only by the
    // peer's placements.
    let (desc, guard) = unsafe {
        stream
            .direct()
            .unwrap()
            .register_rings(tx_area, rx_area, on_placed)?
    };
    let out = Arc::new(Sender {
        stream: Arc::clone(&stream),
        lock: Mutex::new(()),
    });
    let mut m = vec![MSG_DESC];
    m.extend_from_slice(&(desc.len() as u16).to_le_bytes());
    m.extend_from_slice(&desc);
    out.send(&m)?;
    let mut rd = Reader {
        stream: Arc::clone(&stream),
        buf: Vec::new(),
    };
    let peer_ring = match rd.next()? {
        Some((MSG_DESC, arg)) => stream.direct().unwrap().set_peer_ring(&arg[2..])?,
        other => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("expected the peer's ring, got {other:?}"),
            ))
        }
    };
    progress.0.lock().unwrap().1 = peer_ring as u64;
    // Our stream side ends when our sender is done and the peer's END came
    // (then neither side needs the other's ROOM any more): whichever of the
    // two comes second shuts the stream down.
    let ends = Arc::new(Mutex::new((false, false)));
    let finish = {
        let (ends, stream) = (Arc::clone(&ends), Arc::clone(&stream));
        move |sender: bool| -> io::Result<()> {
            let mut g = ends.lock().unwrap();
            if sender {
                g.0 = true
            } else {
                g.1 = true
            }
            if g.0 && g.1 {
                stream.shutdown_send()?;
            }
            Ok(())
        }
    };
    let finish2 = finish.clone();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = Arc::clone(&stop);
    let (out2, prog, tx_ptr) = (
        Arc::clone(&out),
        Arc::clone(&progress),
        tx_area.ptr as usize,
    );
    let sender = thread::spawn(move || -> io::Result<u64> {
        let mut data = PatternStream::new(spec.exchange.send_seed);
        let mut sizes = Pattern::new(spec.exchange.send_seed ^ 0x5A5A);
        let (size, max) = (spec.tx_ring, spec.exchange.max_msg.max(1));
        let mut written = 0u64; // bytes generated into our sending ring
        let mut placed = 0u64;
        while placed < spec.exchange.send_bytes {
            let want = if spec.bench {
                max as u64
            } else {
                1 + sizes.next_u64() % max as u64
            }
            .min(spec.exchange.send_bytes - placed);
            // Wait until our ring has room to generate and the peer's ring
            // room to receive.
            let k = {
                let (lock, cv) = &*prog;
                let mut g = lock.lock().unwrap();
                loop {
                    let (done, room) = *g;
                    let local = size as u64 - (written - done);
                    let remote = room.saturating_sub(placed);
                    let k = want.min(local).min(remote);
                    if k > 0 {
                        break k as usize;
                    }
                    if stop2.load(std::sync::atomic::Ordering::Acquire) {
                        return Err(io::Error::other("the receiving side failed"));
                    }
                    g = cv.wait_timeout(g, Duration::from_secs(1)).unwrap().0;
                }
            };
            // Generate k bytes at our ring's position `written` (= placed).
            let mut bytes = vec![0u8; if spec.bench { 0 } else { k }];
            data.fill(&mut bytes);
            let off = (written as usize) & (size - 1);
            let first = k.min(size - off);
            if !spec.bench {
                // SAFETY: [written, written + k) is free room of our ring
                // (k <= size - in flight), which nothing else touches.
                unsafe {
                    let base = tx_ptr as *mut u8;
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), base.add(off), first);
                    std::ptr::copy_nonoverlapping(bytes.as_ptr().add(first), base, k - first);
                }
            }
            written += k as u64;
            let pieces = Piece::split(placed, size, placed, peer_ring, k);
            let mut notify = vec![MSG_PLACED];
            notify.extend_from_slice(&(k as u32).to_le_bytes());
            out2.place(&pieces, &notify)?;
            placed += k as u64;
        }
        out2.send(&[MSG_END])?;
        finish2(true)?;
        Ok(placed)
    });
    // Receive: check placed bytes where they landed, report room.
    let mut want = PatternStream::new(spec.exchange.recv_seed);
    let (rsize, rptr) = (spec.rx_ring, rx_area.ptr as usize);
    let mut got = 0u64;
    let mut reported = 0u64;
    let mut exp = Vec::new();
    let recv_result = (|| -> io::Result<()> {
        loop {
            match rd.next()? {
                None => return Ok(()),
                Some((MSG_END, _)) => finish(false)?,
                Some((MSG_ROOM, arg)) => {
                    let head = u64::from_le_bytes(arg.try_into().unwrap());
                    let (lock, cv) = &*progress;
                    let mut g = lock.lock().unwrap();
                    g.1 = g.1.max(head + peer_ring as u64);
                    cv.notify_all();
                }
                Some((MSG_PLACED, arg)) => {
                    let n = u32::from_le_bytes(arg.try_into().unwrap()) as usize;
                    if got + n as u64 > reported + rsize as u64 {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            "the peer placed beyond the room reported",
                        ));
                    }
                    if !spec.bench {
                        exp.resize(n, 0);
                        want.fill(&mut exp);
                        let off = (got as usize) & (rsize - 1);
                        let first = n.min(rsize - off);
                        // SAFETY: the peer placed these bytes before this
                        // message (RC ordering) and places nothing there until
                        // we report the room.
                        let (a, b) = unsafe {
                            let base = rptr as *const u8;
                            (
                                std::slice::from_raw_parts(base.add(off), first),
                                std::slice::from_raw_parts(base, n - first),
                            )
                        };
                        if let Some(i) = a.iter().chain(b).zip(&exp).position(|(x, y)| x != y) {
                            return Err(io::Error::new(
                                io::ErrorKind::InvalidData,
                                format!("placed byte {} differs", got + i as u64),
                            ));
                        }
                    }
                    got += n as u64;
                    if !spec.reader_delay.is_zero() {
                        thread::sleep(spec.reader_delay);
                    }
                    // Consumed: report a quarter ring at a time.
                    if got - reported >= (rsize / 4) as u64 {
                        reported = got;
                        let mut m = vec![MSG_ROOM];
                        m.extend_from_slice(&got.to_le_bytes());
                        out.send(&m)?;
                    }
                }
                Some((k, _)) => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("unexpected message {k}"),
                    ))
                }
            }
            if got == spec.exchange.recv_bytes && reported != got {
                reported = got;
                let mut m = vec![MSG_ROOM];
                m.extend_from_slice(&got.to_le_bytes());
                out.send(&m)?;
            }
        }
    })();
    if recv_result.is_err() {
        stop.store(true, std::sync::atomic::Ordering::Release);
        stream.reset();
    }
    let sent = sender
        .join()
        .map_err(|_| io::Error::other("sender thread panicked"))?;
    if recv_result.is_err() || sent.is_err() {
        stream.reset();
    }
    drop(guard);
    drop((tx_mem, rx_mem));
    recv_result?;
    if got != spec.exchange.recv_bytes && spec.exchange.recv_bytes != u64::MAX {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!(
                "received {got} bytes, expected {}",
                spec.exchange.recv_bytes
            ),
        ));
    }
    Ok(ExchangeReport {
        sent: sent?,
        received: got,
        elapsed: t0.elapsed(),
    })
}
