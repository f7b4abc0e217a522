//! The boundary between the stream multiplexer and the verbs.
//!
//! A [`Fabric`] is one reliable, ordered message pipe between two daemons
//! with a ring of `slots` receive slots on each side: `post` copies a message
//! into local send slot `i` and writes it into the peer's receive slot `i`.
//! [`VerbsFabric`](super::verbs) does that with an RC queue pair and RDMA
//! WRITE WITH IMMEDIATE; [`MemFabric`](super::mem_fabric) does it in process
//! memory so the multiplexer's logic runs in host tests (this machine's
//! kernel has no RDMA).

use std::{io, time::Duration};

use serde::{Deserialize, Serialize};

/// Ring shape both ends of a link use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Geometry {
    pub slots: u32,
    pub slot_size: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Completion {
    /// A posted message left its local send slot.
    Sent,
    /// A message arrived in receive slot `imm % slots`.
    Received { imm: u32, len: u32 },
    /// The link broke (queue pair error, flushed work request, ...).
    Failed(String),
}

pub trait Fabric: Send + Sync {
    /// Copies `header` then `payload` into send slot `slot` and writes them
    /// to the peer's receive slot `slot`, announced with immediate `imm`.
    fn post(&self, slot: u32, header: &[u8], payload: &[u8], imm: u32) -> io::Result<()>;
    /// Gives `f` the first `len` bytes of receive slot `slot`.
    fn read_slot(&self, slot: u32, len: usize, f: &mut dyn FnMut(&[u8]));
    /// Re-arms the receive a consumed message used up.
    fn repost_recv(&self) -> io::Result<()>;
    /// Appends completions to `out`, waiting up to `timeout` for the first.
    fn poll(&self, out: &mut Vec<Completion>, timeout: Duration) -> io::Result<()>;
    /// Breaks the pipe (both ends then see `Completion::Failed` or errors).
    fn shutdown(&self);
}

/// Creates fabrics: each side `prepare`s its half and describes it in JSON,
/// the two descriptions cross over the TCP control connection, and
/// `connect` joins the halves.
pub trait FabricProvider: Send + Sync + 'static {
    type Half: Send;
    /// Short name for counters and logs ("rdma").
    fn name(&self) -> &'static str;
    fn prepare(&self, geometry: Geometry) -> io::Result<(Self::Half, serde_json::Value)>;
    fn connect(&self, half: Self::Half, peer: &serde_json::Value) -> io::Result<Box<dyn Fabric>>;
}
