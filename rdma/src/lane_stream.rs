//! The interface between the cross-node transport (RDMA, or TCP in host-only
//! tests) and the daemon's relay that pumps pod rings into it.
//!
//! Blocking on purpose: the daemon runs one pump thread per direction per
//! carried connection, and tokio stays on the control plane.
//! Both sides build on it (the transports in `transport/`, the daemon's
//! `relay/`): a change here is a change to both.
//! Extended additively for zero copy: [`LaneStream::direct`] (default
//! `None`) and [`DirectLane`]; implementations without them are unchanged.

use std::{io, net::SocketAddr};

use serde::{Deserialize, Serialize};

/// One pod TCP connection carried across nodes: the client's and the server's
/// pod addresses as each pod sees them (no NAT between pods here).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StreamKey {
    pub client: SocketAddr,
    pub server: SocketAddr,
}

/// A reliable, ordered, bidirectional byte stream between two daemons,
/// carrying one pod connection. Implementations are Send + Sync so one thread
/// can send while another receives.
pub trait LaneStream: Send + Sync {
    /// Blocks until at least one byte is accepted (flow control: waits for
    /// credit); returns how many bytes were taken. Err after reset/link loss.
    fn send(&self, buf: &[u8]) -> io::Result<usize>;
    /// Blocks until bytes arrive. Ok(0) = the peer called shutdown_send (EOF).
    /// Err(ConnectionReset) = the peer reset or the link failed.
    fn recv(&self, buf: &mut [u8]) -> io::Result<usize>;
    /// No more bytes from this side; the peer's recv returns Ok(0) after the
    /// bytes already sent.
    fn shutdown_send(&self) -> io::Result<()>;
    /// Abort both directions; the peer's recv/send fail with ConnectionReset.
    fn reset(&self);
    /// Zero-copy placement into the peer's memory, when the transport can
    /// do it (RDMA WRITE); `None`: bytes go through `send`/`recv` only.
    fn direct(&self) -> Option<&dyn DirectLane> {
        None
    }
    /// The underlay address of the daemon at the other end, as its
    /// connection's source shows it (authenticated: see `lane_auth`): the
    /// relay checks that a stream's client belongs to that node. `None`:
    /// the transport cannot say, and the relay refuses the stream.
    fn peer_node(&self) -> Option<std::net::IpAddr> {
        None
    }
}

/// One ring's data area in the daemon's own mapping of a pod's channel.
#[derive(Debug, Clone, Copy)]
pub struct RingArea {
    pub ptr: *mut u8,
    pub len: usize,
}

/// `len` bytes from offset `src` of our sending area to offset `dst` of the
/// peer's receiving area (a ring wrap splits a transfer into pieces).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub src: usize,
    pub dst: usize,
    pub len: usize,
}

impl Piece {
    /// Cuts `len` bytes from stream position `src` of a ring of `src_size`
    /// bytes to position `dst` of a ring of `dst_size` bytes (both powers of
    /// two) at both rings' wraps: at most three pieces.
    pub fn split(src: u64, src_size: usize, dst: u64, dst_size: usize, len: usize) -> Vec<Piece> {
        let (mut s, mut d, mut left) = (src, dst, len);
        let mut v = Vec::with_capacity(3);
        while left > 0 {
            let so = (s as usize) & (src_size - 1);
            let dof = (d as usize) & (dst_size - 1);
            let k = left.min(src_size - so).min(dst_size - dof);
            v.push(Piece {
                src: so,
                dst: dof,
                len: k,
            });
            s += k as u64;
            d += k as u64;
            left -= k;
        }
        v
    }
}

/// Bytes moved without copies (the ring memory is registered with the
/// NIC). Each daemon registers its pod's two ring data areas; the
/// receiving side describes its area to the sender in-band (opaque bytes:
/// address, key, size), and the sender writes straight from its pod's
/// sending ring into the remote pod's receiving ring, then sends a small
/// notification on the stream. RDMA orders the write before the message, so
/// when the peer reads the notification the bytes are in its memory.
pub trait DirectLane: Send + Sync {
    /// Registers `tx` (the source of our placements) and `rx` (where the
    /// peer may place) and returns `rx`'s description for the peer plus a
    /// guard: dropping it waits (bounded) for placements in flight and then
    /// unregisters. `on_placed(n)` is called, in order, when `n` more bytes
    /// of our placements reached the peer's memory (from a transport thread:
    /// it must not block).
    ///
    /// # Safety
    /// Both areas must stay mapped, and `rx` must be written by nothing but
    /// the peer's placements past the ring's tail, until the guard is dropped.
    unsafe fn register_rings(
        &self,
        tx: RingArea,
        rx: RingArea,
        on_placed: Box<dyn Fn(u64) + Send + Sync>,
    ) -> io::Result<(Vec<u8>, Box<dyn Send + Sync>)>;
    /// Takes the peer's description; returns the size of its area.
    fn set_peer_ring(&self, desc: &[u8]) -> io::Result<usize>;
    /// Writes `pieces` of our `tx` area into the peer's area, then sends
    /// `notify` as ordinary stream bytes behind them (all of it, blocking
    /// for flow control like `send`).
    fn place(&self, pieces: &[Piece], notify: &[u8]) -> io::Result<()>;
    /// The transport checksums payloads (tests): the relay then checksums
    /// placed bytes end to end too.
    fn checksums(&self) -> bool {
        false
    }
}

// SAFETY: a RingArea is only an address and a length; whoever dereferences
// it does so under `DirectLane::register_rings`' contract.
unsafe impl Send for RingArea {}
// SAFETY: as above.
unsafe impl Sync for RingArea {}

/// Streams to and from peer daemons, multiplexed over a few links per peer.
pub trait LaneTransport: Send + Sync {
    /// Short name for counters and logs: "rdma", "tcp-test".
    fn name(&self) -> &'static str;
    /// Open a stream to the daemon listening at `peer` (its underlay IP and
    /// lane port); `key` travels with the open so the peer can pair it.
    fn open(&self, peer: SocketAddr, key: StreamKey) -> io::Result<Box<dyn LaneStream>>;
    /// The next stream a peer opened to us (blocking).
    fn accept(&self) -> io::Result<(StreamKey, Box<dyn LaneStream>)>;
    /// Failures of the transport itself so far, by kind, for the daemon's
    /// metrics. Empty for a transport that keeps no such counts (then the
    /// daemon shows none rather than a made-up zero).
    fn error_counts(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
}
