//! The relay's framing inside one lane stream (one pod connection).
//!
//! ```text
//! set-up (first bytes each way, before anything else):
//!   server daemon -> client daemon   REGISTERED  the stream waits for the server pod's
//!                                                claim (sent before the client pod's TCP
//!                                                connect, so a claim never waits for it)
//!                                    NO_LISTENER (instead) the server pod has no flowlane
//!                                                listener there: the client stays on TCP
//!   server daemon -> client daemon   CLAIMED     the server pod claimed the connection
//!   client daemon -> server daemon   ATTACHED    the client pod is on the ring: go
//!                                    REFUSED     it is not (gave up / never mapped): TCP
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
//! ```

use std::io;

use flowlane_rdma::LaneStream;

pub const REGISTERED: u8 = 0xB1;
pub const NO_LISTENER: u8 = 0xB0;
pub const CLAIMED: u8 = 0xC1;
pub const ATTACHED: u8 = 0xA1;
pub const REFUSED: u8 = 0xA0;
pub const DATA: u8 = 1;
pub const WAKE: u8 = 2;
pub const EOF: u8 = 3;
pub const GONE: u8 = 4;
pub const FINAL: u8 = 5;

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
        if t != DATA {
            self.start += 1;
            return Ok(Frame::Control(t));
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
        wire.extend_from_slice(&[EOF, FINAL]);
        let s = Script(Mutex::new((wire, 0)));
        let mut b = InBuf::new(8);
        assert_eq!(b.next_frame(&s).unwrap(), Frame::Control(WAKE));
        assert_eq!(b.next_frame(&s).unwrap(), Frame::Data(10));
        let mut got = Vec::new();
        while got.len() < 10 {
            let p = b.payload(&s, 10 - got.len()).unwrap().to_vec();
            b.consume(p.len());
            got.extend_from_slice(&p);
        }
        assert_eq!(got, b"0123456789");
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
