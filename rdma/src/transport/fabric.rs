//! The boundary between the stream multiplexer and the verbs.
//!
//! A [`Fabric`] is one reliable, ordered message pipe between two daemons
//! with a ring of `slots` receive slots on each side: `post` copies a message
//! into local send slot `i` and writes it into the peer's receive slot `i`,
//! after any zero-copy [`Write`]s of registered memory posted with it.
//! [`VerbsFabric`](super::verbs) does that with an RC queue pair and RDMA
//! WRITE WITH IMMEDIATE; `MemFabric` (`mem_fabric`, feature `test-doubles`) does it in process
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

/// One RDMA WRITE (no immediate, unsignaled) from registered local memory
/// into registered memory of the peer: a zero-copy placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Write {
    pub local: u64,
    pub lkey: u32,
    pub remote: u64,
    pub rkey: u32,
    pub len: u32,
}

/// Memory registered with the fabric (an MR); unregistered on drop.
pub trait Registration: Send + Sync {
    fn addr(&self) -> u64;
    fn lkey(&self) -> u32;
    fn rkey(&self) -> u32;
}

pub trait Fabric: Send + Sync {
    /// Posts `writes` (in order), then copies `header` then `payload` into
    /// send slot `slot` and writes them to the peer's receive slot `slot`,
    /// announced with immediate `imm`. RC ordering: when the peer sees the
    /// message, the writes' bytes are in its memory, and this message's
    /// `Sent` completion also completes the writes.
    fn post(
        &self,
        slot: u32,
        header: &[u8],
        payload: &[u8],
        imm: u32,
        writes: &[Write],
    ) -> io::Result<()>;
    /// Registers `len` bytes at `ptr` as a source of writes, and as their
    /// target too when `remote_write`.
    ///
    /// # Safety
    /// The memory must stay mapped until the registration is dropped.
    unsafe fn register(
        &self,
        ptr: *mut u8,
        len: usize,
        remote_write: bool,
    ) -> io::Result<Box<dyn Registration>>;
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
