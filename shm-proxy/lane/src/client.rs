//! The blocking client side of the daemon protocol, used by the preload
//! library (and by `flowlane status`). Plain `std` + `libc`: it runs inside
//! arbitrary application processes, so it never spawns threads, never panics
//! on bad input and bounds every wait with a timeout.
//!
//! INTERFACE CONTRACT between the daemon (owner of `proto.rs` and this file's
//! bodies) and the preload library (caller). Signatures may grow, but change
//! them only together with the callers.

use std::io;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::time::Duration;

/// A brokered shared-memory channel for one TCP connection.
#[derive(Debug)]
pub struct Channel {
    /// Daemon-wide unique id of the channel (for reports and logs).
    pub id: u64,
    /// The memfd holding the channel's whole region (both ring directions and
    /// their headers), sealed against shrinking. Layout: `crate::ring`.
    pub memfd: OwnedFd,
    /// Length of the region in bytes.
    pub len: usize,
}

/// Why a connection stayed on TCP (counted by the daemon per reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackReason {
    NoDaemon,
    NotLocalPod,
    NoPeerLibrary,
    Unsupported,
    InternalError,
}

/// One connection to the node daemon.
pub struct DaemonClient {
    _private: (),
}

impl DaemonClient {
    /// Connects to the daemon's Unix socket; fails fast when no daemon listens.
    pub fn connect(_socket: &Path, _timeout: Duration) -> io::Result<Self> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "daemon client not implemented yet"))
    }

    /// The calling process's pod listens on `addr` (0.0.0.0/:: = all its IPs).
    pub fn register_listener(&mut self, _addr: SocketAddr) -> io::Result<()> {
        Err(io::ErrorKind::Unsupported.into())
    }

    /// The listener on `addr` closed.
    pub fn unregister_listener(&mut self, _addr: SocketAddr) -> io::Result<()> {
        Err(io::ErrorKind::Unsupported.into())
    }

    /// Called by a client BEFORE its TCP connect, with its bound source
    /// address: `Some(channel)` when `dst` is a co-located pod with a
    /// flowlane listener (the connection then uses the ring from its first
    /// byte), `None` to stay on TCP. `region_len` is the requested size.
    pub fn connect_intent(
        &mut self,
        _src: SocketAddr,
        _dst: SocketAddr,
        _region_len: usize,
    ) -> io::Result<Option<Channel>> {
        Err(io::ErrorKind::Unsupported.into())
    }

    /// The client's connect failed after `connect_intent`: drop the channel.
    pub fn cancel_intent(&mut self, _channel_id: u64) -> io::Result<()> {
        Err(io::ErrorKind::Unsupported.into())
    }

    /// Called by a server right after `accept`: the channel the client
    /// `peer` announced for its connection to our `local` address, if any.
    pub fn claim_accepted(
        &mut self,
        _local: SocketAddr,
        _peer: SocketAddr,
    ) -> io::Result<Option<Channel>> {
        Err(io::ErrorKind::Unsupported.into())
    }

    /// A channel ended; `sent`/`received` are the application bytes moved.
    pub fn report_closed(&mut self, _channel_id: u64, _sent: u64, _received: u64) -> io::Result<()> {
        Err(io::ErrorKind::Unsupported.into())
    }

    /// A connection stayed on TCP for `reason`.
    pub fn report_fallback(&mut self, _reason: FallbackReason) -> io::Result<()> {
        Err(io::ErrorKind::Unsupported.into())
    }
}
