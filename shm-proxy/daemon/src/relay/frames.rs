//! The relay's framing inside one lane stream (one pod connection).
//!
//! ```text
//! set-up (first bytes each way, before anything else):
//!   server daemon -> client daemon   REGISTERED  the stream waits for the server pod's
//!                                                claim (sent before the client pod's TCP
//!                                                connect, so a claim never waits for it)
//!                                    NO_LISTENER (instead) the server pod has no flowlane
//!                                                listener there: the client stays on TCP
//!                                    STREAM_REFUSED (instead) the stream is not acceptable:
//!                                                its client is no pod of the opening node,
//!                                                or a live stream has the same key
//!   server daemon -> client daemon   CLAIMED     the server pod claimed the connection
//!   client daemon -> server daemon   ATTACHED    the client pod is on the ring: go
//!                                    REFUSED     it is not (gave up / never mapped): TCP
//! a query stream (opened the other way: by the daemon of the key's server,
//! to the daemon of the key's client; `service.rs`), one byte, then the end:
//!   client daemon -> server daemon   STREAM_COMING  a stream with this key is on its
//!                                                way (or came): the client pod has a
//!                                                pending Service connection from that
//!                                                address, or its relay set-up runs
//!                                    STREAM_NONE    none will come: the claim stays on
//!                                                TCP at once
//! then, both ways:
//!   DATA  u32-le length, bytes       application bytes from my pod
//!   WAKE                             ring a doorbell on your pod's socket: my pod sleeps
//!                                    in poll/epoll and only a byte on its TCP socket,
//!                                    which your pod's socket sends, wakes it
//!   EOF                              my pod will send no more (shutdown/close)
//!   GONE                             my pod reads no more (closed): fail your pod's writes
//!   FINAL                            both directions are settled here and every frame you
//!                                    sent has reached my pod's ring; nothing follows
//!                                    (then shutdown_send). An end without FINAL is a failure.
//! zero copy (only over a transport with `LaneStream::direct`), both ways:
//!   RING  u8 can_place, u16-le n, n bytes   first frame: the description of my pod's
//!                                    receiving ring (n = 0: none) and whether I can place
//!                                    from my pod's sending ring. A direction places iff
//!                                    its receiver offered a ring and its sender can place.
//!   PLACED u32-le n                  n more bytes of my pod's stream are in your pod's
//!                                    receiving ring at its tail (written by the NIC
//!                                    before this frame): publish them
//!   PLACED_CRC u32-le n, u32-le crc  the same, with the CRC-32 of those bytes
//!   ROOM  u64-le head                your placements into my pod's ring: my pod has
//!                                    consumed up to stream position `head` (credits:
//!                                    you may place up to head + ring size)
//! ```

use std::io;

use flowlane_rdma::LaneStream;

pub const REGISTERED: u8 = 0xB1;
pub const NO_LISTENER: u8 = 0xB0;
pub const STREAM_REFUSED: u8 = 0xB2;
pub const STREAM_NONE: u8 = 0xD0;
pub const STREAM_COMING: u8 = 0xD1;
pub const CLAIMED: u8 = 0xC1;
pub const ATTACHED: u8 = 0xA1;
pub const REFUSED: u8 = 0xA0;
pub const DATA: u8 = 1;
pub const WAKE: u8 = 2;
pub const EOF: u8 = 3;
pub const GONE: u8 = 4;
pub const FINAL: u8 = 5;
pub const RING: u8 = 6;
pub const PLACED: u8 = 7;
pub const PLACED_CRC: u8 = 8;
pub const ROOM: u8 = 9;

/// Bytes before a DATA frame's payload.
pub const DATA_HEADER: usize = 5;

/// Largest DATA payload the relay sends (the receiver accepts any u32).
pub const MAX_DATA: usize = 256 << 10;

/// Sends all of `buf` (the stream may take it in pieces).
pub fn send_all(stream: &dyn LaneStream, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        let n = stream.send(buf)?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        buf = &buf[n..];
    }
    Ok(())
}

/// A RING frame.
pub fn ring_frame(can_place: bool, desc: &[u8]) -> Vec<u8> {
    let mut f = vec![RING, can_place as u8];
    f.extend_from_slice(&(desc.len() as u16).to_le_bytes());
    f.extend_from_slice(desc);
    f
}

/// A PLACED (or PLACED_CRC) frame.
pub fn placed_frame(len: usize, crc: Option<u32>) -> Vec<u8> {
    let mut f = vec![if crc.is_some() { PLACED_CRC } else { PLACED }];
    f.extend_from_slice(&(len as u32).to_le_bytes());
    if let Some(c) = crc {
        f.extend_from_slice(&c.to_le_bytes());
    }
    f
}

/// A ROOM frame.
pub fn room_frame(head: u64) -> [u8; 9] {
    let mut f = [ROOM; 9];
    f[1..].copy_from_slice(&head.to_le_bytes());
    f
}

/// Writes a DATA header for `len` payload bytes into `hdr`.
pub fn data_header(hdr: &mut [u8], len: usize) {
    hdr[0] = DATA;
    hdr[1..DATA_HEADER].copy_from_slice(&(len as u32).to_le_bytes());
}

/// A receive buffer over a lane stream: frames are parsed out of it, and
/// DATA payloads are handed out in the pieces that arrived.
pub struct InBuf {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

/// What the next frame is.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame {
    Data(usize),
    Control(u8),
    Ring {
        can_place: bool,
        desc: Vec<u8>,
    },
    Placed {
        len: usize,
        crc: Option<u32>,
    },
    Room(u64),
    /// The stream ended (shutdown_send by the peer).
    End,
}

impl InBuf {
    pub fn new(cap: usize) -> Self {
        InBuf {
            buf: vec![0; cap],
            start: 0,
            end: 0,
        }
    }

    /// Bytes buffered and not yet taken.
    fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// Reads more from the stream; false at the stream's end.
    fn fill(&mut self, stream: &dyn LaneStream) -> io::Result<bool> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let n = stream.recv(&mut self.buf[self.end..])?;
        self.end += n;
        Ok(n > 0)
    }

    /// Ensures `n` bytes are buffered; false if the stream ended first.
    fn want(&mut self, stream: &dyn LaneStream, n: usize) -> io::Result<bool> {
        while self.buffered() < n {
            if !self.fill(stream)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The next frame's kind (for DATA, its payload length; the payload is
    /// then taken with [`InBuf::payload`]).
    pub fn next_frame(&mut self, stream: &dyn LaneStream) -> io::Result<Frame> {
        if !self.want(stream, 1)? {
            return Ok(Frame::End);
        }
        let t = self.buf[self.start];
        match t {
            DATA => {}
            RING => {
                if !self.want(stream, 4)? {
                    return Err(truncated());
                }
                let s = self.start;
                let can_place = self.buf[s + 1] != 0;
                let n = u16::from_le_bytes([self.buf[s + 2], self.buf[s + 3]]) as usize;
                if !self.want(stream, 4 + n)? {
                    return Err(truncated());
                }
                let desc = self.buf[self.start + 4..self.start + 4 + n].to_vec();
                self.start += 4 + n;
                return Ok(Frame::Ring { can_place, desc });
            }
            PLACED | PLACED_CRC => {
                let n = if t == PLACED { 5 } else { 9 };
                if !self.want(stream, n)? {
                    return Err(truncated());
                }
                let b = &self.buf[self.start..self.start + n];
                let len = u32::from_le_bytes(b[1..5].try_into().unwrap()) as usize;
                let crc =
                    (t == PLACED_CRC).then(|| u32::from_le_bytes(b[5..9].try_into().unwrap()));
                self.start += n;
                return Ok(Frame::Placed { len, crc });
            }
            ROOM => {
                if !self.want(stream, 9)? {
                    return Err(truncated());
                }
                let b = &self.buf[self.start + 1..self.start + 9];
                let head = u64::from_le_bytes(b.try_into().unwrap());
                self.start += 9;
                return Ok(Frame::Room(head));
            }
            _ => {
                self.start += 1;
                return Ok(Frame::Control(t));
            }
        }
        if !self.want(stream, DATA_HEADER)? {
            return Err(truncated());
        }
        let mut len = [0u8; 4];
        len.copy_from_slice(&self.buf[self.start + 1..self.start + DATA_HEADER]);
        self.start += DATA_HEADER;
        Ok(Frame::Data(u32::from_le_bytes(len) as usize))
    }

    /// Up to `max` payload bytes (at least one), reading from the stream if
    /// nothing is buffered; the caller consumes them with [`InBuf::consume`].
    pub fn payload(&mut self, stream: &dyn LaneStream, max: usize) -> io::Result<&[u8]> {
        if self.buffered() == 0 && !self.fill(stream)? {
            return Err(truncated());
        }
        let n = self.buffered().min(max);
        Ok(&self.buf[self.start..self.start + n])
    }

    pub fn consume(&mut self, n: usize) {
        debug_assert!(n <= self.buffered());
        self.start += n;
    }
}

fn truncated() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "lane stream ended inside a frame",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A stream that hands out a fixed byte sequence in small pieces.
    struct Script(Mutex<(Vec<u8>, usize)>);

    impl LaneStream for Script {
        fn send(&self, buf: &[u8]) -> io::Result<usize> {
            Ok(buf.len())
        }
        fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
            let mut g = self.0.lock().unwrap();
            let (data, pos) = &mut *g;
            let n = (data.len() - *pos).min(buf.len()).min(3);
            buf[..n].copy_from_slice(&data[*pos..*pos + n]);
            *pos += n;
            Ok(n)
        }
        fn shutdown_send(&self) -> io::Result<()> {
            Ok(())
        }
        fn reset(&self) {}
    }

    #[test]
    fn frames_parse_across_arbitrary_piece_boundaries() {
        let mut wire = vec![WAKE];
        let mut hdr = [0u8; DATA_HEADER];
        data_header(&mut hdr, 10);
        wire.extend_from_slice(&hdr);
        wire.extend_from_slice(b"0123456789");
        wire.extend_from_slice(&ring_frame(true, b"desc"));
        wire.extend_from_slice(&placed_frame(70000, None));
        wire.extend_from_slice(&placed_frame(9, Some(0xDEAD_BEEF)));
        wire.extend_from_slice(&room_frame(1 << 40));
        wire.extend_from_slice(&[EOF, FINAL]);
        let s = Script(Mutex::new((wire, 0)));
        let mut b = InBuf::new(16);
        assert_eq!(b.next_frame(&s).unwrap(), Frame::Control(WAKE));
        assert_eq!(b.next_frame(&s).unwrap(), Frame::Data(10));
        let mut got = Vec::new();
        while got.len() < 10 {
            let p = b.payload(&s, 10 - got.len()).unwrap().to_vec();
            b.consume(p.len());
            got.extend_from_slice(&p);
        }
        assert_eq!(got, b"0123456789");
        assert_eq!(
            b.next_frame(&s).unwrap(),
            Frame::Ring {
                can_place: true,
                desc: b"desc".to_vec()
            }
        );
        assert_eq!(
            b.next_frame(&s).unwrap(),
            Frame::Placed {
                len: 70000,
                crc: None
            }
        );
        assert_eq!(
            b.next_frame(&s).unwrap(),
            Frame::Placed {
                len: 9,
                crc: Some(0xDEAD_BEEF)
            }
        );
        assert_eq!(b.next_frame(&s).unwrap(), Frame::Room(1 << 40));
        assert_eq!(b.next_frame(&s).unwrap(), Frame::Control(EOF));
        assert_eq!(b.next_frame(&s).unwrap(), Frame::Control(FINAL));
        assert_eq!(b.next_frame(&s).unwrap(), Frame::End);
    }

    #[test]
    fn a_stream_ending_inside_a_frame_is_an_error() {
        let s = Script(Mutex::new((vec![DATA, 5, 0], 0)));
        let mut b = InBuf::new(16);
        assert!(b.next_frame(&s).is_err());
    }
}
