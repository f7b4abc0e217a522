//! `TcpTestTransport`: the test double behind [`LaneTransport`] for hosts
//! without RDMA. One plain TCP connection per stream between the two
//! daemons; the stream's [`StreamKey`] travels as a header at the start.
//!
//! Every connection is authenticated first (`flowlane_rdma::lane_auth`,
//! as the RDMA transport's set-up connection is): the source address must
//! be a node of the node table, then both daemons prove the lane key;
//! only then the header. The listener hands each connection to a thread of
//! its own for that (at most [`MAX_HANDSHAKES`] at once), so a stranger
//! that connects and stalls delays nobody.
//!
//! It exists so that the whole relay (pairing, pumps, doorbells, close and
//! failure handling) runs and is tested end to end on any machine; the
//! production transport is `flowlane_rdma`'s RDMA one (`--lane-transport`).
//! Header: `b"FLR1"`, u16-le length, the key as JSON.
//!
//! Inside the stream, records: `0, u32-le n, n bytes` (stream bytes) and
//! `1, u32-le dst, u32-le n, n bytes` (a placement, see
//! [`DirectLane`]): the receiver copies a placement's bytes into its
//! registered ring area at `dst` before it reads on, so the relay's
//! zero-copy protocol (RING/PLACED/ROOM, credits by ring space) runs and is
//! tested on hosts without RDMA, with copies standing in for the NIC.
//!
//! Reset: the trait wants the peer's `recv` to fail; plain TCP can only
//! promise an RST when the last reference closes, so a reset here shuts the
//! socket down (the peer sees end-of-stream) and closes with `SO_LINGER` 0.
//! The relay never mistakes that for a clean end: a clean end is always
//! announced in-band first (`FINAL`, see `frames.rs`).

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use flowlane_rdma::lane_auth::{PEER_AUTH_FAILED, PEER_UNKNOWN};
use flowlane_rdma::{
    AuthError, DirectLane, LaneAuth, LaneStream, LaneTransport, Piece, RingArea, StreamKey,
};

const MAGIC: &[u8; 4] = b"FLR1";
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const HEADER_TIMEOUT: Duration = Duration::from_secs(2);
const MAX_KEY_LEN: usize = 1024;
/// Connections being authenticated at once; more are closed unread.
pub const MAX_HANDSHAKES: usize = 32;

type Accepted = (StreamKey, Box<dyn LaneStream>);

/// Refusals, for the daemon's counters (`lane_errors`).
#[derive(Default)]
struct Refused {
    peer_unknown: AtomicU64,
    peer_auth_failed: AtomicU64,
}

pub struct TcpTestTransport {
    /// Where we listen: our streams leave from its address.
    local: SocketAddr,
    auth: LaneAuth,
    accepted: Mutex<mpsc::Receiver<Accepted>>,
    refused: Arc<Refused>,
}

impl TcpTestTransport {
    /// Listens for peer daemons' streams on `addr`, admitting those `auth`
    /// admits (and proving the key to those we open streams to).
    pub fn bind(addr: SocketAddr, auth: LaneAuth) -> io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        let local = listener.local_addr()?;
        let (tx, rx) = mpsc::channel();
        let refused = Arc::<Refused>::default();
        let (a, r) = (auth.clone(), refused.clone());
        std::thread::Builder::new()
            .name("relay-lane-listen".into())
            .spawn(move || listen_loop(listener, a, r, tx))?;
        Ok(TcpTestTransport {
            local,
            auth,
            accepted: Mutex::new(rx),
            refused,
        })
    }

    #[cfg(test)]
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
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

impl Refused {
    fn count(&self, e: &AuthError) {
        match e.counter() {
            PEER_UNKNOWN => &self.peer_unknown,
            _ => &self.peer_auth_failed,
        }
        .fetch_add(1, Ordering::Relaxed);
    }
}

/// Accepts connections: the source is checked against the node table
/// before anything is read, then a thread authenticates the peer and reads
/// the header (a stalled peer holds only its own thread, for at most the
/// handshake's deadline plus the header's).
fn listen_loop(
    listener: TcpListener,
    auth: LaneAuth,
    refused: Arc<Refused>,
    tx: mpsc::Sender<Accepted>,
) {
    let busy = Arc::new(AtomicUsize::new(0));
    loop {
        let (mut s, from) = match listener.accept() {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "lane accept failed");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if let Err(e) = auth.admit(from) {
            refused.count(&e);
            tracing::info!(%from, error = %e, "lane connection refused");
            continue;
        }
        if busy.fetch_add(1, Ordering::AcqRel) >= MAX_HANDSHAKES {
            busy.fetch_sub(1, Ordering::AcqRel);
            refused.peer_auth_failed.fetch_add(1, Ordering::Relaxed);
            tracing::info!(%from, "too many lane handshakes at once; connection closed");
            continue;
        }
        let (auth, refused, tx, busy2) = (auth.clone(), refused.clone(), tx.clone(), busy.clone());
        let spawned = std::thread::Builder::new()
            .name("relay-lane-auth".into())
            .spawn(move || {
                let got = auth
                    .respond(&mut s)
                    .map_err(|e| {
                        refused.count(&e);
                        tracing::info!(%from, error = %e, "lane peer not authenticated; connection closed");
                    })
                    .and_then(|()| {
                        TcpTestTransport::read_header(&mut s).map_err(|e| {
                            // An authenticated peer: a bug or a version skew.
                            tracing::warn!(%from, error = %e, "bad lane stream header");
                        })
                    });
                busy2.fetch_sub(1, Ordering::AcqRel);
                if let Ok(key) = got {
                    if s.set_nodelay(true).is_ok() {
                        let _ = tx.send((key, Box::new(TcpLane::new(s))));
                    }
                }
            });
        if spawned.is_err() {
            busy.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(%from, "cannot start a lane handshake thread");
        }
    }
}

impl LaneTransport for TcpTestTransport {
    fn name(&self) -> &'static str {
        "tcp-test"
    }

    fn error_counts(&self) -> Vec<(&'static str, u64)> {
        vec![
            (
                PEER_UNKNOWN,
                self.refused.peer_unknown.load(Ordering::Relaxed),
            ),
            (
                PEER_AUTH_FAILED,
                self.refused.peer_auth_failed.load(Ordering::Relaxed),
            ),
        ]
    }

    fn open(&self, peer: SocketAddr, key: StreamKey) -> io::Result<Box<dyn LaneStream>> {
        let mut s = flowlane_rdma::lane_auth::connect_from(self.local, peer, CONNECT_TIMEOUT)?;
        s.set_nodelay(true)?;
        // The peer proves the key before it learns the stream's key.
        if let Err(e) = self.auth.initiate(&mut s) {
            if !matches!(e, AuthError::Io(_)) {
                self.refused.count(&e);
            }
            return Err(e.into());
        }
        let body = serde_json::to_vec(&key).map_err(io::Error::other)?;
        let mut msg = Vec::with_capacity(6 + body.len());
        msg.extend_from_slice(MAGIC);
        msg.extend_from_slice(&(body.len() as u16).to_le_bytes());
        msg.extend_from_slice(&body);
        s.write_all(&msg)?;
        Ok(Box::new(TcpLane::new(s)))
    }

    fn accept(&self) -> io::Result<(StreamKey, Box<dyn LaneStream>)> {
        self.accepted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .recv()
            .map_err(|_| io::Error::new(io::ErrorKind::NotConnected, "lane listener gone"))
    }
}

const REC_BYTES: u8 = 0;
const REC_PLACE: u8 = 1;

/// This side's sending ring (the source of placements) and what to call
/// when they left.
struct TxRing {
    area: RingArea,
    on_placed: Box<dyn Fn(u64) + Send + Sync>,
}

/// This side's registered rings, each under its own lock (a placement
/// blocked on a full socket must not stop the other direction's reader),
/// cleared when the relay drops the guard.
#[derive(Default)]
struct Rings {
    tx: Mutex<Option<TxRing>>,
    rx: Mutex<Option<RingArea>>,
}

/// Unregisters on drop: nothing is read from or copied into the areas
/// afterwards.
struct RingsGuard(Arc<Rings>);

impl Drop for RingsGuard {
    fn drop(&mut self) {
        *self.0.tx.lock().unwrap_or_else(|e| e.into_inner()) = None;
        *self.0.rx.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

struct TcpLane {
    s: TcpStream,
    reset: AtomicBool,
    /// Serialises records (the relay sends from several threads).
    send: Mutex<()>,
    /// Bytes left of the stream-bytes record being read.
    pending: Mutex<usize>,
    rings: Arc<Rings>,
    peer_ring: AtomicUsize,
}

fn write_all_vectored(mut s: &TcpStream, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !bufs.is_empty() {
        match s.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn read_u32(mut s: &TcpStream) -> io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

impl TcpLane {
    fn new(s: TcpStream) -> Self {
        TcpLane {
            s,
            reset: AtomicBool::new(false),
            send: Mutex::new(()),
            pending: Mutex::new(0),
            rings: Arc::default(),
            peer_ring: AtomicUsize::new(0),
        }
    }

    /// Reads the next record header; a placement is copied into our
    /// receiving ring here. Returns the next stream-bytes record's length,
    /// or None at a clean end of the stream.
    fn next_record(&self) -> io::Result<Option<usize>> {
        loop {
            let mut kind = [0u8; 1];
            let n = loop {
                match (&self.s).read(&mut kind) {
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    r => break r?,
                }
            };
            if n == 0 {
                return Ok(None);
            }
            match kind[0] {
                REC_BYTES => {
                    let len = read_u32(&self.s)? as usize;
                    if len > 0 {
                        return Ok(Some(len));
                    }
                }
                REC_PLACE => {
                    let dst = read_u32(&self.s)? as usize;
                    let len = read_u32(&self.s)? as usize;
                    let rx = self.rings.rx.lock().unwrap_or_else(|e| e.into_inner());
                    let Some(r) = rx.as_ref().filter(|r| dst + len <= r.len) else {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            "placement outside the registered ring",
                        ));
                    };
                    // SAFETY: [dst, dst + len) lies in the registered area,
                    // which stays mapped while registered (we hold the lock
                    // the guard's drop takes), and is free ring room that
                    // only placements write (register_rings' contract).
                    let area = unsafe { std::slice::from_raw_parts_mut(r.ptr.add(dst), len) };
                    (&self.s).read_exact(area)?;
                }
                other => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("bad lane record {other}"),
                    ))
                }
            }
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
    fn peer_node(&self) -> Option<std::net::IpAddr> {
        self.s.peer_addr().ok().map(|a| a.ip().to_canonical())
    }

    fn send(&self, buf: &[u8]) -> io::Result<usize> {
        self.check()?;
        if buf.is_empty() {
            return Ok(0);
        }
        let mut head = [REC_BYTES, 0, 0, 0, 0];
        head[1..].copy_from_slice(&(buf.len() as u32).to_le_bytes());
        let _g = self.send.lock().unwrap_or_else(|e| e.into_inner());
        write_all_vectored(&self.s, &mut [IoSlice::new(&head), IoSlice::new(buf)])?;
        Ok(buf.len())
    }

    fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.check()?;
        if buf.is_empty() {
            return Ok(0);
        }
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if *pending == 0 {
            match self.next_record()? {
                Some(len) => *pending = len,
                None => {
                    self.check()?;
                    return Ok(0);
                }
            }
        }
        let want = (*pending).min(buf.len());
        let n = loop {
            match (&self.s).read(&mut buf[..want]) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => break r?,
            }
        };
        if n == 0 {
            self.check()?;
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "lane stream ended inside a record",
            ));
        }
        *pending -= n;
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

    fn direct(&self) -> Option<&dyn DirectLane> {
        Some(self)
    }
}

impl DirectLane for TcpLane {
    unsafe fn register_rings(
        &self,
        tx: RingArea,
        rx: RingArea,
        on_placed: Box<dyn Fn(u64) + Send + Sync>,
    ) -> io::Result<(Vec<u8>, Box<dyn Send + Sync>)> {
        *self.rings.tx.lock().unwrap_or_else(|e| e.into_inner()) = Some(TxRing {
            area: tx,
            on_placed,
        });
        *self.rings.rx.lock().unwrap_or_else(|e| e.into_inner()) = Some(rx);
        let desc = (rx.len as u64).to_le_bytes().to_vec();
        Ok((desc, Box::new(RingsGuard(self.rings.clone()))))
    }

    fn set_peer_ring(&self, desc: &[u8]) -> io::Result<usize> {
        let size: [u8; 8] = desc
            .try_into()
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bad ring description"))?;
        let size = u64::from_le_bytes(size) as usize;
        self.peer_ring.store(size, Ordering::Release);
        Ok(size)
    }

    fn place(&self, pieces: &[Piece], notify: &[u8]) -> io::Result<()> {
        self.check()?;
        let peer = self.peer_ring.load(Ordering::Acquire);
        let tx = self.rings.tx.lock().unwrap_or_else(|e| e.into_inner());
        let Some(r) = tx.as_ref() else {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "rings not registered",
            ));
        };
        let _g = self.send.lock().unwrap_or_else(|e| e.into_inner());
        let mut total = 0u64;
        for p in pieces {
            if p.src + p.len > r.area.len || p.dst + p.len > peer {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "piece outside a ring",
                ));
            }
            let mut head = [REC_PLACE; 9];
            head[1..5].copy_from_slice(&(p.dst as u32).to_le_bytes());
            head[5..].copy_from_slice(&(p.len as u32).to_le_bytes());
            // SAFETY: within the registered sending area (checked), which
            // stays mapped while registered; the relay does not free these
            // bytes before `on_placed` says so.
            let bytes = unsafe { std::slice::from_raw_parts(r.area.ptr.add(p.src), p.len) };
            write_all_vectored(&self.s, &mut [IoSlice::new(&head), IoSlice::new(bytes)])?;
            total += p.len as u64;
        }
        let mut head = [REC_BYTES, 0, 0, 0, 0];
        head[1..].copy_from_slice(&(notify.len() as u32).to_le_bytes());
        write_all_vectored(&self.s, &mut [IoSlice::new(&head), IoSlice::new(notify)])?;
        // The kernel has the bytes: the ring may reuse their room.
        (r.on_placed)(total);
        Ok(())
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

    const KEY: &[u8] = b"tcp-test tests: a lane key of 32 bytes or more";

    fn auth(key: &[u8]) -> LaneAuth {
        LaneAuth::new(
            flowlane_rdma::LaneKey::from_bytes(key).unwrap(),
            Arc::new(|ip: std::net::IpAddr| ip.is_loopback()),
        )
    }

    fn bind(key: &[u8]) -> TcpTestTransport {
        TcpTestTransport::bind("127.0.0.1:0".parse().unwrap(), auth(key)).unwrap()
    }

    fn count(t: &TcpTestTransport, kind: &str) -> u64 {
        t.error_counts()
            .into_iter()
            .find(|(k, _)| *k == kind)
            .unwrap()
            .1
    }

    /// A stream opened with another key is refused (nothing is accepted,
    /// the refusal is counted), a silent connection holds nobody up, and a
    /// right stream right after them goes through.
    #[test]
    fn only_a_peer_with_the_key_opens_a_stream() {
        // (the silent connections must not time out, and be counted,
        // while the test runs)
        let t = TcpTestTransport::bind(
            "127.0.0.1:0".parse().unwrap(),
            auth(KEY).with_timeout(Duration::from_secs(60)),
        )
        .unwrap();
        let addr = t.local_addr().unwrap();
        let _silent: Vec<_> = (0..3).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let wrong = bind(b"another key, also 32 bytes or more long");
        assert!(wrong.open(addr, key()).is_err());
        let good = bind(KEY);
        let s = good.open(addr, key()).unwrap();
        super::super::frames::send_all(&*s, b"x").unwrap();
        let (k, r) = t.accept().unwrap();
        assert_eq!(k, key());
        assert_eq!(r.peer_node(), Some("127.0.0.1".parse().unwrap()));
        let mut b = [0u8; 1];
        assert_eq!(r.recv(&mut b).unwrap(), 1);
        assert_eq!(count(&t, "peer_auth_failed"), 1);
        assert_eq!(count(&t, "peer_unknown"), 0);
    }

    #[test]
    fn a_stream_carries_its_key_bytes_eof_and_reset() {
        let t = bind(KEY);
        let addr = t.local_addr().unwrap();
        let opener = std::thread::spawn(move || {
            let c = bind(KEY);
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
