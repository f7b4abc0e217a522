//! The RDMA lane between node daemons: pod streams multiplexed over a few
//! RC queue pairs per node pair. See `docs/rdma.md` ("The transport").
//!
//! - [`wire`]: the message header inside a receive slot;
//! - [`credit`]: link credits (slots) and stream windows (bytes);
//! - [`fabric`]: the trait between the multiplexer and the verbs, with
//!   [`verbs`] (sideway: RDMA WRITE WITH IMMEDIATE on an RC queue pair) and
//!   `mem_fabric` (in-process, for host tests; feature `test-doubles`) behind it;
//! - `link`/`stream`: one link per peer and the streams on it;
//! - [`mux`]: the [`LaneTransport`](crate::LaneTransport) (listener, handshake, links).

pub mod credit;
pub mod exercise;
pub mod fabric;
mod link;
#[cfg(feature = "test-doubles")]
pub mod mem_fabric;
pub mod mux;
mod stream;
pub mod verbs;
pub mod wire;

use std::{io, time::Duration};

pub use fabric::{Fabric, FabricProvider, Geometry};
#[cfg(feature = "test-doubles")]
pub use mem_fabric::MemProvider;
pub use mux::{MuxTransport, TransportStats};
pub use verbs::VerbsProvider;

/// The RDMA transport: the multiplexer over verbs.
pub type RdmaTransport = MuxTransport<VerbsProvider>;
/// The same multiplexer over an in-process fabric (host tests).
#[cfg(feature = "test-doubles")]
pub type MemTransport = MuxTransport<MemProvider>;

/// Tunables of the lane. Both daemons must use the same ring shape (the
/// handshake refuses a mismatch).
#[derive(Debug, Clone)]
pub struct RdmaOptions {
    /// Receive slots per link (a power of two, at least 4): at most this
    /// many messages are in flight per direction.
    pub slots: u32,
    /// Bytes per slot, header included: the largest message.
    pub slot_size: u32,
    /// Bytes a stream's receiver buffers before the sender must wait.
    pub stream_window: u32,
    /// CRC-32 of every payload, checked on arrival (catches corruption the
    /// sequence checks cannot; costs CPU at full speed).
    pub checksums: bool,
    /// Send a ping when nothing was sent for this long.
    pub keepalive: Duration,
    /// Fail the link when nothing arrived for this long.
    pub dead_after: Duration,
    /// TCP connect and handshake timeout.
    pub connect_timeout: Duration,
    /// RC queue pairs (links) per peer daemon; streams go to the least
    /// loaded one. A link's failure resets only its own streams; the peer
    /// daemon's death fails them all (every control connection closes).
    pub links_per_peer: usize,
}

impl Default for RdmaOptions {
    fn default() -> Self {
        RdmaOptions {
            slots: 64,
            // 64 KiB of payload plus the header: a 64 KiB write is one message.
            slot_size: 64 * 1024 + 64,
            stream_window: 1024 * 1024,
            checksums: false,
            keepalive: Duration::from_secs(1),
            dead_after: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            links_per_peer: 2,
        }
    }
}

impl RdmaOptions {
    pub fn geometry(&self) -> Geometry {
        Geometry {
            slots: self.slots,
            slot_size: self.slot_size,
        }
    }

    pub fn validate(&self) -> io::Result<()> {
        let bad = |m: &str| Err(io::Error::new(io::ErrorKind::InvalidInput, m.to_string()));
        if self.slots < 4 || !self.slots.is_power_of_two() {
            return bad("slots must be a power of two >= 4");
        }
        if (self.slot_size as usize) <= wire::HEADER_LEN + wire::KEY_LEN {
            return bad("slot_size too small");
        }
        if self.links_per_peer == 0 {
            return bad("links_per_peer must be > 0");
        }
        if self.stream_window == 0 {
            return bad("stream_window must be > 0");
        }
        if self.dead_after <= self.keepalive {
            return bad("dead_after must exceed keepalive");
        }
        Ok(())
    }
}
