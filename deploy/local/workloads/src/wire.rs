//! The generators' wire format: a fixed 16-byte header and an f32 payload,
//! little-endian, over a TCP stream.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

const MAGIC: u32 = 0x464c_5452; // "FLTR"

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Kind {
    /// Worker -> PS, first frame: `step` holds the worker's index.
    Hello = 1,
    /// Worker -> PS: a gradient shard for `step`.
    Push = 2,
    /// PS -> worker: the parameter shard after applying `step`.
    Params = 3,
    /// All-reduce: a chunk of the ring.
    Chunk = 4,
    /// Worker -> PS: the worker is done.
    Bye = 5,
}

impl Kind {
    fn from_u32(v: u32) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Push,
            3 => Kind::Params,
            4 => Kind::Chunk,
            5 => Kind::Bye,
            _ => return None,
        })
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub step: u32,
    /// Number of f32 values that follow.
    pub count: u32,
}

pub fn write_header(w: &mut impl Write, kind: Kind, step: u32, count: usize) -> io::Result<()> {
    let count = u32::try_from(count)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame too large"))?;
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4..8].copy_from_slice(&(kind as u32).to_le_bytes());
    h[8..12].copy_from_slice(&step.to_le_bytes());
    h[12..16].copy_from_slice(&count.to_le_bytes());
    w.write_all(&h)
}

pub fn read_header(r: &mut impl Read) -> io::Result<Header> {
    let mut h = [0u8; 16];
    r.read_exact(&mut h)?;
    let word = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
    if word(0) != MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "bad frame magic",
        ));
    }
    let kind = Kind::from_u32(word(4))
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "unknown frame kind"))?;
    Ok(Header {
        kind,
        step: word(8),
        count: word(12),
    })
}

/// Reads a header and checks it is `kind` with `count` values.
pub fn expect_header(r: &mut impl Read, kind: Kind, count: usize) -> io::Result<Header> {
    let h = read_header(r)?;
    if h.kind != kind || h.count as usize != count {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("expected {kind:?} x{count}, got {:?} x{}", h.kind, h.count),
        ));
    }
    Ok(h)
}

/// The bytes of an f32 slice (x86/ARM are little-endian, which is the wire order).
pub fn as_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and every bit pattern is a valid u8; the
    // returned slice covers exactly the same memory and borrows `v`.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// The bytes of a mutable f32 slice, to read a payload into in place.
pub fn as_bytes_mut(v: &mut [f32]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; any byte pattern written through the result
    // is a valid f32 (possibly NaN), and the borrow is exclusive.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

const _: () = assert!(
    cfg!(target_endian = "little"),
    "wire format is little-endian"
);

/// Writes one frame: header and payload.
pub fn write_frame(w: &mut impl Write, kind: Kind, step: u32, payload: &[f32]) -> io::Result<()> {
    write_header(w, kind, step, payload.len())?;
    w.write_all(as_bytes(payload))
}

/// Connects to `addr`, retrying while the peer is not listening yet (the
/// processes of a job start in any order). Nagle is off: every frame is
/// latency-relevant.
pub fn connect_retry(addr: SocketAddr, deadline: Duration) -> io::Result<TcpStream> {
    let start = Instant::now();
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(s) => {
                s.set_nodelay(true)?;
                return Ok(s);
            }
            Err(e) if start.elapsed() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("connect {addr}: {e} (gave up after {deadline:?})"),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_round_trip() {
        let mut buf = Vec::new();
        write_frame(&mut buf, Kind::Push, 7, &[1.5, -2.0]).unwrap();
        let mut r = &buf[..];
        let h = read_header(&mut r).unwrap();
        assert_eq!(
            h,
            Header {
                kind: Kind::Push,
                step: 7,
                count: 2
            }
        );
        let mut v = [0f32; 2];
        r.read_exact(as_bytes_mut(&mut v)).unwrap();
        assert_eq!(v, [1.5, -2.0]);
    }

    #[test]
    fn bad_magic_is_an_error() {
        let buf = [0u8; 16];
        assert!(read_header(&mut &buf[..]).is_err());
    }
}
