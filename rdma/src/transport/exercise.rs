//! Checked transfers over any [`LaneStream`], shared by the host tests, the
//! Soft-RoCE tests and `rdma-lane-bench`: both directions at once, random
//! message sizes, and every received byte compared with what the sender's
//! generator produced (a dropped, duplicated, reordered or corrupted byte
//! fails the check at its offset).

use std::{
    io,
    sync::Arc,
    thread,
    time::{Duration, Instant},
};

use crate::lane_stream::LaneStream;

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
