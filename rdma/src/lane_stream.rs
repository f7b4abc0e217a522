//! The interface between the cross-node transport (RDMA, or TCP in host-only
//! tests) and the daemon's relay that pumps pod rings into it.
//!
//! Blocking on purpose: the daemon runs one pump thread per direction per
//! carried connection, and tokio stays on the control plane.
//! Agreed in `/work/coord/rdma-lane-interface.md`; change only by agreement.

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
}

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
