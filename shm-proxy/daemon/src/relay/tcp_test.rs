//! `TcpTestTransport`: the test double behind [`LaneTransport`] for hosts
//! without RDMA. One plain TCP connection per stream between the two
//! daemons; the stream's [`StreamKey`] travels as a header at the start.
//!
//! It exists so that the whole relay (pairing, pumps, doorbells, close and
//! failure handling) runs and is tested end to end on any machine; the
//! production transport is `flowlane_rdma`'s RDMA one (`--lane-transport`).
//! Header: `b"FLR1"`, u16-le length, the key as JSON.
//!
//! Reset: the trait wants the peer's `recv` to fail; plain TCP can only
//! promise an RST when the last reference closes, so a reset here shuts the
//! socket down (the peer sees end-of-stream) and closes with `SO_LINGER` 0.
//! The relay never mistakes that for a clean end: a clean end is always
//! announced in-band first (`FINAL`, see `frames.rs`).

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use flowlane_rdma::{LaneStream, LaneTransport, StreamKey};

const MAGIC: &[u8; 4] = b"FLR1";
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const HEADER_TIMEOUT: Duration = Duration::from_secs(2);
const MAX_KEY_LEN: usize = 1024;

pub struct TcpTestTransport {
    listener: TcpListener,
}

impl TcpTestTransport {
    /// Listens for peer daemons' streams on `addr`.
    pub fn bind(addr: SocketAddr) -> io::Result<Self> {
        Ok(TcpTestTransport {
            listener: TcpListener::bind(addr)?,
        })
    }

    #[cfg(test)]
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    fn read_header(s: &mut TcpStream) -> io::Result<StreamKey> {
        s.set_read_timeout(Some(HEADER_TIMEOUT))?;
        let mut head = [0u8; 6];
        s.read_exact(&mut head)?;
        if &head[..4] != MAGIC {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a lane stream",
            ));
        }
        let len = u16::from_le_bytes([head[4], head[5]]) as usize;
        if len > MAX_KEY_LEN {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "key too long"));
        }
        let mut body = vec![0u8; len];
        s.read_exact(&mut body)?;
        s.set_read_timeout(None)?;
        serde_json::from_slice(&body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }
}

impl LaneTransport for TcpTestTransport {
    fn name(&self) -> &'static str {
        "tcp-test"
    }

    fn open(&self, peer: SocketAddr, key: StreamKey) -> io::Result<Box<dyn LaneStream>> {
        let mut s = TcpStream::connect_timeout(&peer, CONNECT_TIMEOUT)?;
        s.set_nodelay(true)?;
        let body = serde_json::to_vec(&key).map_err(io::Error::other)?;
        let mut msg = Vec::with_capacity(6 + body.len());
        msg.extend_from_slice(MAGIC);
        msg.extend_from_slice(&(body.len() as u16).to_le_bytes());
        msg.extend_from_slice(&body);
        s.write_all(&msg)?;
        Ok(Box::new(TcpLane::new(s)))
    }

    fn accept(&self) -> io::Result<(StreamKey, Box<dyn LaneStream>)> {
        loop {
            let (mut s, from) = self.listener.accept()?;
            match Self::read_header(&mut s) {
                Ok(key) => {
                    s.set_nodelay(true)?;
                    return Ok((key, Box::new(TcpLane::new(s))));
                }
                // A stray connection must not stop the lane.
                Err(e) => tracing::debug!(%from, error = %e, "bad lane stream header"),
            }
        }
    }
}

struct TcpLane {
    s: TcpStream,
    reset: AtomicBool,
}

impl TcpLane {
    fn new(s: TcpStream) -> Self {
        TcpLane {
            s,
            reset: AtomicBool::new(false),
        }
    }

    fn check(&self) -> io::Result<()> {
        if self.reset.load(Ordering::Acquire) {
            Err(io::ErrorKind::ConnectionReset.into())
        } else {
            Ok(())
        }
    }
}

impl LaneStream for TcpLane {
    fn send(&self, buf: &[u8]) -> io::Result<usize> {
        self.check()?;
        loop {
            match (&self.s).write(buf) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => return r,
            }
        }
    }

    fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.check()?;
        let n = loop {
            match (&self.s).read(buf) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => break r?,
            }
        };
        // A local reset wakes a blocked recv with end-of-stream: report it
        // as the reset it is.
        self.check()?;
        Ok(n)
    }

    fn shutdown_send(&self) -> io::Result<()> {
        self.s.shutdown(Shutdown::Write)
    }

    fn reset(&self) {
        self.reset.store(true, Ordering::Release);
        let l = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        // SAFETY: setsockopt with a local linger struct on our socket.
        unsafe {
            libc::setsockopt(
                self.s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&l as *const libc::linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            )
        };
        let _ = self.s.shutdown(Shutdown::Both);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> StreamKey {
        StreamKey {
            client: "10.173.1.2:40000".parse().unwrap(),
            server: "10.174.1.2:5201".parse().unwrap(),
        }
    }

    #[test]
    fn a_stream_carries_its_key_bytes_eof_and_reset() {
        let t = TcpTestTransport::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = t.local_addr().unwrap();
        let opener = std::thread::spawn(move || {
            let c = TcpTestTransport::bind("127.0.0.1:0".parse().unwrap()).unwrap();
            let s = c.open(addr, key()).unwrap();
            super::super::frames::send_all(&*s, b"hello").unwrap();
            s.shutdown_send().unwrap();
            let mut b = [0u8; 8];
            let n = s.recv(&mut b).unwrap();
            assert_eq!(&b[..n], b"back");
            s
        });
        let (k, s) = t.accept().unwrap();
        assert_eq!(k, key());
        let mut got = Vec::new();
        let mut b = [0u8; 8];
        loop {
            let n = s.recv(&mut b).unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&b[..n]);
        }
        assert_eq!(got, b"hello");
        s.send(b"back").unwrap();
        let other = opener.join().unwrap();
        s.reset();
        assert_eq!(
            s.recv(&mut b).unwrap_err().kind(),
            io::ErrorKind::ConnectionReset
        );
        // The peer sees the end (EOF or RST), never a hang.
        assert!(matches!(other.recv(&mut b), Ok(0) | Err(_)));
    }
}
