//! The wire protocol between `flowlaned` and its clients (the preload
//! library, `flowlane status`, the CNI plugin's registry poke).
//!
//! Request/response over a Unix stream socket. Every message is one frame:
//!
//! ```text
//! u32 little-endian body length | body: one JSON object
//! ```
//!
//! A response that hands over a channel carries the channel's memfd in the
//! SCM_RIGHTS ancillary data of its frame. Requests never carry fds (the
//! relayable ops name the caller's socket by its fd number; the daemon takes
//! its own reference with `pidfd_getfd`, see `flowlaned`'s relay).
//!
//! The decoder is strict and total: garbage, truncated and oversized input
//! produce a [`ProtoError`], never a panic. A request frame's body is bounded
//! by [`MAX_REQUEST_FRAME`]; a response's by [`MAX_RESPONSE_FRAME`] (a stats
//! answer lists every connection of the node, so it may be large).

use std::collections::BTreeMap;
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// Version of this protocol; bumped on incompatible changes.
pub const PROTOCOL_VERSION: u32 = 1;

/// Largest request body the daemon accepts.
pub const MAX_REQUEST_FRAME: usize = 64 * 1024;

/// Largest response body a client accepts.
pub const MAX_RESPONSE_FRAME: usize = 16 * 1024 * 1024;

/// Bytes of the length prefix.
pub const HEADER_LEN: usize = 4;

pub use crate::fallback::FallbackReason;

/// A client's request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Request {
    /// The caller's pod listens on `addr` (unspecified IP = all its IPs).
    RegisterListener { addr: SocketAddr },
    /// The listener on `addr` closed.
    UnregisterListener { addr: SocketAddr },
    /// Before a TCP connect from `src` (IP may be unspecified: the daemon
    /// fills in the caller pod's address facing `dst`) to `dst`.
    ConnectIntent {
        src: SocketAddr,
        dst: SocketAddr,
        region_len: u64,
    },
    /// The connect after an intent failed: drop its channel.
    CancelIntent { channel_id: u64 },
    /// After accept: the channel the client `peer` announced towards `local`.
    ClaimAccepted { local: SocketAddr, peer: SocketAddr },
    /// A channel ended; application bytes moved by the reporting side.
    ReportClosed {
        channel_id: u64,
        sent: u64,
        received: u64,
    },
    /// A connection stayed on TCP for `reason`.
    ReportFallback { reason: FallbackReason },
    /// [`Request::ReportClosed`] as a one-way message: the daemon sends no
    /// answer (not even an error), so a closing connection does not wait
    /// for the daemon. The report counts exactly as a `report-closed` does
    /// (once per side); it may also arrive after its process exited (see
    /// docs/daemon.md, "One-way messages"). Added after protocol 1 without
    /// a version bump: a daemon that predates it answers `bad-request`,
    /// which the client's next request notices (the kept connection looks
    /// closed) and reconnects; that daemon then counts the connection
    /// closed from its rings, as for a process that died.
    ReportClosedOneWay {
        channel_id: u64,
        sent: u64,
        received: u64,
    },
    /// The CNI plugin changed the pod registry.
    RegistryChanged,
    /// Counters, connections and listeners of the node.
    Stats,
    /// [`Request::ConnectIntent`] from a library that can ride the
    /// cross-node relay: `socket_fd` is the number of the caller's TCP socket
    /// in the calling process (bound to `src`). The daemon may take its own
    /// reference to that socket (doorbells, liveness) when `dst` is a pod on
    /// another node with a lane; otherwise it is an ordinary intent. Added
    /// after protocol 1 without a version bump: older daemons answer
    /// `bad-request`, and the client then retries with the classic op.
    RelayableIntent {
        src: SocketAddr,
        dst: SocketAddr,
        region_len: u64,
        socket_fd: i32,
    },
    /// [`Request::ClaimAccepted`] with the accepted socket's fd number (see
    /// [`Request::RelayableIntent`]).
    RelayableClaim {
        local: SocketAddr,
        peer: SocketAddr,
        socket_fd: i32,
    },
    /// The injection probe's verdict for the caller's pod (`deploy/probe`: the
    /// init container the webhook adds per distinct image, run in that image):
    /// whether `containers` load the preload library. Added after protocol 1
    /// without a version bump (older daemons answer `bad-request`; the probe
    /// ignores the answer).
    ReportInjection {
        verdict: InjectionVerdict,
        /// What the probe found: `glibc 2.36`, `musl`, `none`, ...
        libc: String,
        /// Why, in words.
        reason: String,
        containers: Vec<String>,
    },
    /// Before a TCP connect from `src` to `dst`, a Service IP (the peer
    /// table's Service ranges): the daemon answers a channel when the
    /// Service may have a lane behind it; which backend the connection
    /// reaches is known only after connect ([`Request::ResolveService`]).
    /// Sent only by a library that read Service ranges from the peer
    /// table, which only a daemon that knows the op publishes.
    ServiceIntent {
        src: SocketAddr,
        dst: SocketAddr,
        region_len: u64,
    },
    /// After the connect of [`Request::ServiceIntent`] `channel_id`
    /// returned (connected or in progress): the daemon looks the
    /// connection up in the node's conntrack table. `ok`: the backend is a
    /// pod of this node with a flowlane listener, or a pod of another node
    /// that publishes a lane, whose daemon registered the relay's stream:
    /// wait for the attach; `no-channel`: stay on TCP now (the channel is
    /// dropped). `socket_fd` (the connecting socket's fd number in the
    /// calling process, as in [`Request::RelayableIntent`]) lets the relay
    /// carry a connection to a backend on another node; without it such a
    /// connection stays on TCP.
    ResolveService {
        channel_id: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        socket_fd: Option<i32>,
    },
    /// [`Request::RelayableIntent`] from a library that keeps *stock*:
    /// channels made ahead for later connections of this process to the
    /// same `dst` (docs/shm-lane.md, "Pre-created channels"). `want` (at
    /// most [`MAX_STOCK_GRANTS`]) is how many the caller would take beside
    /// this connection's channel; the daemon may grant fewer, or none (the
    /// listener's server has not shown it takes stock, the destination is
    /// on another node, the pod's budget is spent). The answer is
    /// [`Response::Stocked`] or any answer of a relayable intent. Added
    /// after protocol 1 without a version bump: older daemons answer
    /// `bad-request`, and the client then sends the relayable intent.
    StockIntent {
        src: SocketAddr,
        dst: SocketAddr,
        region_len: u64,
        socket_fd: i32,
        want: u32,
    },
    /// [`Request::RelayableClaim`] from a library that takes stock: the
    /// answer may also grant the stock that clients made for `local` and
    /// that the calling process does not hold yet ([`Response::Stocked`]).
    /// Older daemons answer `bad-request` (the client then sends the
    /// relayable claim).
    StockClaim {
        local: SocketAddr,
        peer: SocketAddr,
        socket_fd: i32,
    },
    /// One-way: the caller's server attached stock channel `channel_id` to
    /// the connection it accepted on `local` from `peer` (the daemon
    /// counts it opened, as a claim would). Sent only to a daemon that
    /// granted stock.
    StockTaken {
        channel_id: u64,
        local: SocketAddr,
        peer: SocketAddr,
    },
    /// From a client process that still holds stock for `dst` and will run
    /// out soon: up to `want` more, made as its last stock intent's were
    /// (the daemon repeats only what an intent admitted, while the process
    /// still holds stock from it). Sent ahead: the library reads the
    /// answer ([`Response::Stocked`] without a channel, possibly with no
    /// stock) at its next use of the connection, so no connection waits
    /// for it. Older daemons answer `bad-request`.
    StockRefill { dst: SocketAddr, want: u32 },
    /// From a server process that still holds stock for its listener
    /// `local` and will run out soon: the listener's stock it does not
    /// hold yet, as a [`Request::StockClaim`] would grant it (sent ahead,
    /// like [`Request::StockRefill`]).
    StockFetch { local: SocketAddr },
}

/// Most stock channels one answer grants (and one intent may ask for).
pub const MAX_STOCK_GRANTS: usize = 16;

/// One stock channel handed over in a [`Response::Stocked`]; its memfd
/// travels in the frame's SCM_RIGHTS data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StockGrant {
    pub id: u64,
    pub len: u64,
    /// The client pod's address the channel was made for: a server uses
    /// it only for a connection accepted from this address.
    pub client: std::net::IpAddr,
}

/// A channel as a [`Response::Stocked`] names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChannelGrant {
    pub id: u64,
    pub len: u64,
}

/// The injection probe's decision for one image of a pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum InjectionVerdict {
    /// The library is in place: the containers use the lanes.
    Lane,
    /// The no-op object is in place: the containers stay on plain TCP.
    Tcp,
}

/// One probe verdict of a pod of this node (see [`Request::ReportInjection`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InjectionInfo {
    pub pod: String,
    pub containers: Vec<String>,
    pub verdict: InjectionVerdict,
    pub libc: String,
    pub reason: String,
}

impl Request {
    /// True for a message the daemon never answers.
    pub fn is_one_way(&self) -> bool {
        matches!(
            self,
            Request::ReportClosedOneWay { .. } | Request::StockTaken { .. }
        )
    }

    /// Short name for logs and counters.
    pub fn op_name(&self) -> &'static str {
        match self {
            Request::RegisterListener { .. } => "register-listener",
            Request::UnregisterListener { .. } => "unregister-listener",
            Request::ConnectIntent { .. } => "connect-intent",
            Request::CancelIntent { .. } => "cancel-intent",
            Request::ClaimAccepted { .. } => "claim-accepted",
            Request::ReportClosed { .. } => "report-closed",
            Request::ReportFallback { .. } => "report-fallback",
            Request::ReportClosedOneWay { .. } => "report-closed-one-way",
            Request::RegistryChanged => "registry-changed",
            Request::Stats => "stats",
            Request::RelayableIntent { .. } => "relayable-intent",
            Request::RelayableClaim { .. } => "relayable-claim",
            Request::ReportInjection { .. } => "report-injection",
            Request::ServiceIntent { .. } => "service-intent",
            Request::ResolveService { .. } => "resolve-service",
            Request::StockIntent { .. } => "stock-intent",
            Request::StockClaim { .. } => "stock-claim",
            Request::StockTaken { .. } => "stock-taken",
            Request::StockRefill { .. } => "stock-refill",
            Request::StockFetch { .. } => "stock-fetch",
        }
    }
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ErrorCode {
    /// The frame or its body could not be decoded.
    BadRequest,
    /// The caller's network namespace is not a pod of this node.
    UnknownPod,
    /// The caller's pod does not own the address or channel it named.
    Forbidden,
    /// A size or count exceeds the daemon's bounds.
    TooLarge,
    /// The daemon failed internally (e.g. memfd creation).
    Internal,
}

/// Why an intent or claim got no channel (the connection stays on TCP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NoChannelReason {
    /// The destination is not a pod on this node.
    NotLocalPod,
    /// The destination pod has no flowlane listener on that port.
    NoListener,
    /// No pending channel matches the accepted connection.
    NoIntent,
    /// The node's conntrack table does not name the backend of a Service
    /// connection (see [`FallbackReason::ServiceUnresolved`]).
    Unresolved,
}

/// The daemon's answer to one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Response {
    Ok,
    /// A channel; its memfd travels in the frame's SCM_RIGHTS data.
    Channel {
        id: u64,
        len: u64,
    },
    NoChannel {
        reason: NoChannelReason,
    },
    Error {
        code: ErrorCode,
        message: String,
    },
    Stats {
        stats: Box<Stats>,
    },
    /// The answer to [`Request::StockIntent`] and [`Request::StockClaim`]
    /// when it grants stock, and always to [`Request::StockRefill`] and
    /// [`Request::StockFetch`] (no channel; the stock may be empty): this connection's channel, if any, and up to
    /// [`MAX_STOCK_GRANTS`] stock channels (at least one of the two). The
    /// frame's SCM_RIGHTS data holds the channel's memfd first (when
    /// there is a channel), then one memfd per grant, in order.
    Stocked {
        channel: Option<ChannelGrant>,
        stock: Vec<StockGrant>,
    },
}

impl Response {
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        Response::Error {
            code,
            message: message.into(),
        }
    }
}

/// Counters of one lane (`shm` today; `rdma` later).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaneStats {
    pub connections_opened: u64,
    pub connections_active: u64,
    pub connections_closed: u64,
    /// Application bytes moved through the lane, live connections
    /// included (both directions; never decreases).
    pub bytes: u64,
    /// Channels announced by a client and not yet claimed by the server.
    pub channels_pending: u64,
    /// `bytes` of the client-to-server direction (absent in older daemons).
    #[serde(default)]
    pub bytes_client_to_server: u64,
    /// `bytes` of the server-to-client direction (absent in older daemons).
    #[serde(default)]
    pub bytes_server_to_client: u64,
    /// Stock channels the daemon holds now: made ahead for later
    /// connections, not taken yet (absent in older daemons).
    #[serde(default)]
    pub channels_stocked: u64,
}

/// One end of a connection in a stats answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    /// `namespace/name` of the pod, or its container id when unnamed.
    pub pod: String,
    pub addr: SocketAddr,
}

/// One brokered connection (claimed channel) in a stats answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectionInfo {
    pub id: u64,
    pub lane: String,
    pub client: Endpoint,
    pub server: Endpoint,
    pub region_len: u64,
    /// Bytes reported so far (sides report when they close).
    pub bytes_client_to_server: u64,
    pub bytes_server_to_client: u64,
    pub age_secs: u64,
}

/// One flowlane listener in a stats answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListenerInfo {
    pub pod: String,
    pub addr: SocketAddr,
    /// Processes that registered it and are still alive.
    pub processes: u32,
}

/// Facts about the daemon itself.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonInfo {
    pub version: String,
    pub protocol: u32,
    pub pid: u32,
    pub uptime_secs: u64,
    pub state_dir: String,
    pub socket: String,
    /// Pods (network namespaces) known from the registry.
    pub pods: u64,
    pub registry_reloads: u64,
}

/// The answer to [`Request::Stats`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    pub daemon: DaemonInfo,
    /// Per lane, by lane name (`shm`).
    pub lanes: BTreeMap<String, LaneStats>,
    /// Connections that stayed on TCP, by reason.
    pub fallbacks: BTreeMap<String, u64>,
    /// Requests refused because of the caller's identity.
    pub auth_failures: u64,
    /// Frames that could not be decoded.
    pub bad_requests: u64,
    /// Client connections closed at once (connection budget exhausted).
    #[serde(default)]
    pub connections_refused: u64,
    /// Requests served, by operation.
    pub requests: BTreeMap<String, u64>,
    pub connections: Vec<ConnectionInfo>,
    pub listeners: Vec<ListenerInfo>,
    /// Per claimed channel: time from the client's intent arriving at the
    /// daemon to the server's claim arriving (absent in older daemons).
    #[serde(default)]
    pub channel_setup: LatencyHistogram,
    /// Per request: time the daemon spent handling it, from decoded
    /// request to answer (socket I/O excluded; absent in older daemons).
    #[serde(default)]
    pub request_handling: LatencyHistogram,
    /// The daemon's cross-node view (which node owns which pod CIDR, this
    /// node's RDMA lane, what it published), as `<state-dir>/daemon/nodes.json`
    /// holds it; absent when the daemon runs without one (no
    /// `--nodes-file`/`--kubernetes`) and in older daemons.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<serde_json::Value>,
    /// Failures of a cross-node lane's transport, by lane (`rdma`) and kind
    /// (`link_failed`, `link_setup_failed`, `peer_unknown`, `peer_auth_failed`,
    /// `stream_foreign_client`, `stream_duplicate`); absent without a relay, for a
    /// transport that keeps none, and in older daemons.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub lane_errors: BTreeMap<String, BTreeMap<String, u64>>,
    /// The relay's memory budget and what its connections pin now; absent
    /// without a relay and in older daemons.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relay_memory: Option<RelayMemory>,
    /// The injection probes' verdicts for the node's pods (which containers
    /// got the lane, which stay on TCP and why); absent when no probe
    /// reported and in older daemons.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub injections: Vec<InjectionInfo>,
    /// The node's pods' processes as the daemon's last `/proc` scan found
    /// them: which run the library, which cannot use the lane and why;
    /// absent when the scan is off and in older daemons.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub processes: Option<ProcessScan>,
}

/// One scan of the node's pod processes (`flowlaned` walks `/proc`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessScan {
    /// Milliseconds since the scan ended, when the answer was made.
    pub age_ms: u64,
    /// How long the scan took.
    pub duration_ms: u64,
    /// False when the scan stopped at its time or process bound: pods may
    /// have more processes than listed.
    pub complete: bool,
    /// Pod processes the daemon was not allowed to read (it needs root
    /// with CAP_SYS_PTRACE): not in any count below.
    #[serde(default)]
    pub unreadable: u32,
    /// Per pod with at least one process, by pod name.
    pub pods: Vec<PodProcesses>,
}

/// The processes of one pod (those in its network namespace).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodProcesses {
    pub pod: String,
    /// Processes that run the preload library and nothing that bypasses it.
    pub lane: u32,
    /// Processes that hold TCP sockets and cannot use the lane.
    pub tcp: u32,
    /// Processes that cannot use the lane and hold no TCP socket now.
    pub idle: u32,
    /// Processes off the lane by reason (one process may have several).
    pub reasons: BTreeMap<OffLaneReason, u32>,
    /// The processes that cannot use the lane, each with why (at most 64
    /// per pod, those holding TCP sockets first; `lane + tcp + idle`
    /// counts them all).
    pub off_lane: Vec<OffLaneProcess>,
}

/// A pod process that cannot use the lane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffLaneProcess {
    pub pid: u32,
    /// Its executable's path as the kernel reports it (from the pod's own
    /// file system: display only), cut to 256 bytes.
    pub exe: String,
    /// TCP sockets it holds (listening ones included).
    pub tcp_sockets: u32,
    /// Every reason found, at least one.
    pub reasons: Vec<OffLaneReason>,
}

/// Why a process cannot use the lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OffLaneReason {
    /// Dynamically linked, without the library (`LD_PRELOAD` unset).
    NoLibrary,
    /// The probe's no-op object is loaded in its place: the image cannot
    /// load the library (musl, too old a glibc).
    NoopLibrary,
    /// Statically linked (no program interpreter): `LD_PRELOAD` is ignored.
    Static,
    /// A Go program: its runtime makes socket system calls itself, past libc.
    Go,
    /// It holds an io_uring, whose socket operations bypass libc.
    IoUring,
    /// Its executable could not be read or is no ELF file the scan parses.
    UnknownExe,
}

impl OffLaneReason {
    /// The kebab-case name (as in JSON and the metrics' labels).
    pub fn name(self) -> &'static str {
        match self {
            OffLaneReason::NoLibrary => "no-library",
            OffLaneReason::NoopLibrary => "noop-library",
            OffLaneReason::Static => "static",
            OffLaneReason::Go => "go",
            OffLaneReason::IoUring => "io-uring",
            OffLaneReason::UnknownExe => "unknown-exe",
        }
    }
}

/// Memory the relay holds for its connections (`--relay-memory-budget`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayMemory {
    /// Most bytes the relay may hold for connections at once.
    pub budget_bytes: u64,
    /// Bytes held now by live relayed connections and their set-ups.
    pub used_bytes: u64,
}

/// Upper bounds (nanoseconds) of the latency buckets the daemon uses:
/// 50µs, 100µs, 250µs, 500µs, 1ms, 2.5ms, 5ms, 10ms, 25ms, 100ms, 1s
/// (`+Inf` is implicit).
pub const LATENCY_BOUNDS_NS: [u64; 11] = [
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    100_000_000,
    1_000_000_000,
];

/// A latency histogram in whole nanoseconds (integers keep the stats
/// exact and comparable). `counts[i]` is the number of observations in
/// bucket `i` alone (not cumulative): `bounds_ns[i-1] < v <= bounds_ns[i]`;
/// the last entry of `counts` (one more than `bounds_ns`) is the `+Inf`
/// bucket.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LatencyHistogram {
    pub bounds_ns: Vec<u64>,
    pub counts: Vec<u64>,
    pub sum_ns: u64,
    pub count: u64,
}

impl LatencyHistogram {
    /// An empty histogram with these (ascending) upper bounds.
    pub fn with_bounds(bounds_ns: &[u64]) -> Self {
        debug_assert!(bounds_ns.windows(2).all(|w| w[0] < w[1]));
        LatencyHistogram {
            bounds_ns: bounds_ns.to_vec(),
            counts: vec![0; bounds_ns.len() + 1],
            sum_ns: 0,
            count: 0,
        }
    }

    /// An empty histogram with [`LATENCY_BOUNDS_NS`].
    pub fn latency() -> Self {
        Self::with_bounds(&LATENCY_BOUNDS_NS)
    }

    /// Records one observation.
    pub fn observe(&mut self, d: std::time::Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        if self.counts.len() != self.bounds_ns.len() + 1 {
            // A default (bound-less) histogram: everything is `+Inf`.
            self.counts.resize(self.bounds_ns.len() + 1, 0);
        }
        let bucket = self.bounds_ns.partition_point(|&b| b < ns);
        self.counts[bucket] += 1;
        self.sum_ns = self.sum_ns.saturating_add(ns);
        self.count += 1;
    }

    /// `(upper bound in ns or None for +Inf, observations <= bound)`, the
    /// cumulative view Prometheus exposes.
    pub fn cumulative(&self) -> Vec<(Option<u64>, u64)> {
        let mut total = 0u64;
        let mut out = Vec::with_capacity(self.bounds_ns.len() + 1);
        for (i, c) in self.counts.iter().enumerate() {
            total += c;
            out.push((self.bounds_ns.get(i).copied(), total));
        }
        if out.is_empty() {
            out.push((None, 0));
        }
        out
    }
}

/// A decoding failure. Never fatal to the daemon: it answers with
/// [`ErrorCode::BadRequest`] (and drops the connection when the framing
/// itself is lost).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtoError {
    #[error("empty frame")]
    Empty,
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    TooLarge { len: usize, max: usize },
    #[error("truncated frame: {have} of {need} bytes")]
    Truncated { have: usize, need: usize },
    #[error("malformed message: {0}")]
    Malformed(String),
}

impl ProtoError {
    /// True when the stream can no longer be parsed (the length prefix is
    /// unusable), so the connection must be dropped after answering.
    pub fn loses_framing(&self) -> bool {
        matches!(self, ProtoError::Empty | ProtoError::TooLarge { .. })
    }
}

/// The body length announced by a frame header, checked against `max`.
pub fn frame_len(header: [u8; HEADER_LEN], max: usize) -> Result<usize, ProtoError> {
    let len = u32::from_le_bytes(header) as usize;
    if len == 0 {
        return Err(ProtoError::Empty);
    }
    if len > max {
        return Err(ProtoError::TooLarge { len, max });
    }
    Ok(len)
}

/// Splits one complete frame off the front of `buf`: `Ok(Some((body,
/// consumed)))`, `Ok(None)` when more bytes are needed.
pub fn split_frame(buf: &[u8], max: usize) -> Result<Option<(&[u8], usize)>, ProtoError> {
    let Some(header) = buf.get(..HEADER_LEN) else {
        return Ok(None);
    };
    let mut h = [0u8; HEADER_LEN];
    h.copy_from_slice(header);
    let len = frame_len(h, max)?;
    match buf.get(HEADER_LEN..HEADER_LEN + len) {
        Some(body) => Ok(Some((body, HEADER_LEN + len))),
        None => Ok(None),
    }
}

/// Decodes exactly one complete frame (header + body, nothing after it).
pub fn decode_frame<T: for<'de> Deserialize<'de>>(buf: &[u8], max: usize) -> Result<T, ProtoError> {
    match split_frame(buf, max)? {
        Some((body, used)) if used == buf.len() => decode_body(body),
        Some((_, used)) => Err(ProtoError::Malformed(format!(
            "{} trailing bytes after the frame",
            buf.len() - used
        ))),
        None => Err(ProtoError::Truncated {
            have: buf.len(),
            need: if buf.len() < HEADER_LEN {
                HEADER_LEN
            } else {
                HEADER_LEN + u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize
            },
        }),
    }
}

/// Decodes a frame body (the JSON object).
pub fn decode_body<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ProtoError> {
    serde_json::from_slice(body).map_err(|e| ProtoError::Malformed(e.to_string()))
}

/// Decodes a request body.
pub fn decode_request(body: &[u8]) -> Result<Request, ProtoError> {
    decode_body(body)
}

/// Decodes a response body.
pub fn decode_response(body: &[u8]) -> Result<Response, ProtoError> {
    decode_body(body)
}

/// Encodes `msg` as one frame. Fails only if the body exceeds `max` (or the
/// message cannot be serialised, which our types never cause).
pub fn encode_frame<T: Serialize>(msg: &T, max: usize) -> Result<Vec<u8>, ProtoError> {
    let mut out = vec![0u8; HEADER_LEN];
    serde_json::to_writer(&mut out, msg).map_err(|e| ProtoError::Malformed(e.to_string()))?;
    let len = out.len() - HEADER_LEN;
    if len > max {
        return Err(ProtoError::TooLarge { len, max });
    }
    out[..HEADER_LEN].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn histogram_places_values_in_their_bucket_inclusive_upper_bound() {
        let mut h = LatencyHistogram::with_bounds(&[100, 1_000]);
        h.observe(Duration::from_nanos(0));
        h.observe(Duration::from_nanos(100)); // on the bound: le=100
        h.observe(Duration::from_nanos(101));
        h.observe(Duration::from_nanos(1_000));
        h.observe(Duration::from_nanos(5_000)); // +Inf
        assert_eq!(h.counts, vec![2, 2, 1]);
        assert_eq!(h.count, 5);
        assert_eq!(h.sum_ns, 100 + 101 + 1_000 + 5_000);
    }

    #[test]
    fn histogram_cumulative_counts_end_at_count() {
        let mut h = LatencyHistogram::latency();
        for us in [10, 60, 60, 700, 3_000, 2_000_000] {
            h.observe(Duration::from_micros(us));
        }
        let cum = h.cumulative();
        assert_eq!(cum.len(), LATENCY_BOUNDS_NS.len() + 1);
        assert_eq!(cum[0], (Some(50_000), 1));
        assert_eq!(cum[1], (Some(100_000), 3));
        assert_eq!(cum[4], (Some(1_000_000), 4));
        assert_eq!(cum[6], (Some(5_000_000), 5));
        assert_eq!(cum[10], (Some(1_000_000_000), 5));
        assert_eq!(cum[11], (None, 6));
        assert!(cum.windows(2).all(|w| w[0].1 <= w[1].1));
        assert_eq!(h.sum_ns, (10 + 60 + 60 + 700 + 3_000 + 2_000_000) * 1_000);
    }

    #[test]
    fn stats_without_histograms_still_parse() {
        let old = r#"{"daemon":{"version":"0","protocol":1,"pid":1,"uptime_secs":0,
            "state_dir":"/s","socket":"/s/x","pods":0,"registry_reloads":0},
            "lanes":{},"fallbacks":{},"auth_failures":0,"bad_requests":0,
            "requests":{},"connections":[],"listeners":[]}"#;
        let st: Stats = serde_json::from_str(old).unwrap();
        assert_eq!(st.channel_setup.count, 0);
        assert_eq!(st.channel_setup.cumulative(), vec![(None, 0)]);
    }

    fn all_requests() -> Vec<Request> {
        let a: SocketAddr = "10.202.0.2:8080".parse().unwrap();
        let b: SocketAddr = "[fd00::3]:41000".parse().unwrap();
        vec![
            Request::RegisterListener { addr: a },
            Request::UnregisterListener { addr: b },
            Request::ConnectIntent {
                src: "0.0.0.0:41000".parse().unwrap(),
                dst: a,
                region_len: 2 << 20,
            },
            Request::CancelIntent { channel_id: 7 },
            Request::ClaimAccepted { local: a, peer: b },
            Request::ReportClosed {
                channel_id: u64::MAX,
                sent: 1,
                received: 2,
            },
            Request::ReportFallback {
                reason: FallbackReason::Unsupported,
            },
            Request::ReportClosedOneWay {
                channel_id: 9,
                sent: 3,
                received: 4,
            },
            Request::RegistryChanged,
            Request::Stats,
            Request::RelayableIntent {
                src: "10.202.0.3:41000".parse().unwrap(),
                dst: a,
                region_len: 2 << 20,
                socket_fd: 5,
            },
            Request::RelayableClaim {
                local: a,
                peer: b,
                socket_fd: 9,
            },
            Request::ReportInjection {
                verdict: InjectionVerdict::Tcp,
                libc: "musl".into(),
                reason: "musl cannot load a glibc library".into(),
                containers: vec!["app".into(), "tool".into()],
            },
            Request::StockRefill { dst: a, want: 8 },
            Request::StockFetch { local: b },
        ]
    }

    #[test]
    fn the_probes_report_decodes() {
        // byte for byte what deploy/probe/probe.c writes
        let body = br#"{"op":"report-injection","verdict":"lane","libc":"glibc 2.36","reason":"ok","containers":["app"]}"#;
        assert_eq!(
            decode_request(body).unwrap(),
            Request::ReportInjection {
                verdict: InjectionVerdict::Lane,
                libc: "glibc 2.36".into(),
                reason: "ok".into(),
                containers: vec!["app".into()],
            }
        );
        let bad =
            br#"{"op":"report-injection","verdict":"maybe","libc":"","reason":"","containers":[]}"#;
        assert!(decode_request(bad).is_err());
    }

    #[test]
    fn only_the_one_way_report_goes_unanswered() {
        for req in all_requests() {
            assert_eq!(
                req.is_one_way(),
                matches!(req, Request::ReportClosedOneWay { .. }),
                "{req:?}"
            );
        }
    }

    #[test]
    fn every_request_roundtrips() {
        for req in all_requests() {
            let frame = encode_frame(&req, MAX_REQUEST_FRAME).unwrap();
            let back: Request = decode_frame(&frame, MAX_REQUEST_FRAME).unwrap();
            assert_eq!(back, req);
        }
    }

    #[test]
    fn every_response_roundtrips() {
        let mut stats = Stats::default();
        stats.lanes.insert("shm".into(), LaneStats::default());
        stats.fallbacks.insert("no-listener".into(), 3);
        stats.connections.push(ConnectionInfo {
            id: 1,
            lane: "shm".into(),
            client: Endpoint {
                pod: "default/a".into(),
                addr: "10.202.0.2:5000".parse().unwrap(),
            },
            server: Endpoint {
                pod: "default/b".into(),
                addr: "10.202.0.3:80".parse().unwrap(),
            },
            region_len: 4096,
            bytes_client_to_server: 10,
            bytes_server_to_client: 20,
            age_secs: 3,
        });
        for resp in [
            Response::Ok,
            Response::Channel { id: 3, len: 4096 },
            Response::NoChannel {
                reason: NoChannelReason::NoListener,
            },
            Response::error(ErrorCode::Forbidden, "not yours"),
            Response::Stats {
                stats: Box::new(stats),
            },
        ] {
            let frame = encode_frame(&resp, MAX_RESPONSE_FRAME).unwrap();
            let back: Response = decode_frame(&frame, MAX_RESPONSE_FRAME).unwrap();
            assert_eq!(back, resp);
        }
    }

    #[test]
    fn wire_format_is_length_prefixed_json() {
        let frame = encode_frame(&Request::Stats, MAX_REQUEST_FRAME).unwrap();
        assert_eq!(&frame[..4], &(frame.len() as u32 - 4).to_le_bytes());
        assert_eq!(&frame[4..], br#"{"op":"stats"}"#);
    }

    #[test]
    fn truncated_frames_are_reported_not_decoded() {
        let frame = encode_frame(&all_requests()[2], MAX_REQUEST_FRAME).unwrap();
        for cut in 0..frame.len() {
            let r: Result<Request, _> = decode_frame(&frame[..cut], MAX_REQUEST_FRAME);
            assert!(
                matches!(
                    r,
                    Err(ProtoError::Truncated { .. }) | Err(ProtoError::Empty)
                ),
                "cut at {cut}: {r:?}"
            );
            assert_eq!(split_frame(&frame[..cut], MAX_REQUEST_FRAME), Ok(None));
        }
    }

    #[test]
    fn zero_and_oversized_lengths_lose_framing() {
        let e = frame_len([0; 4], MAX_REQUEST_FRAME).unwrap_err();
        assert!(e.loses_framing());
        let big = (MAX_REQUEST_FRAME as u32 + 1).to_le_bytes();
        let e = frame_len(big, MAX_REQUEST_FRAME).unwrap_err();
        assert!(matches!(e, ProtoError::TooLarge { .. }) && e.loses_framing());
        // The CNI plugin's old newline-JSON poke reads as a huge length.
        assert!(frame_len(*b"{\"op", MAX_REQUEST_FRAME).is_err());
    }

    #[test]
    fn garbage_bodies_are_malformed() {
        let bodies: &[&[u8]] = &[
            b"not json",
            b"{}",
            b"[]",
            b"null",
            b"{\"op\":\"no-such-op\"}",
            b"{\"op\":\"register-listener\"}",
            b"{\"op\":\"register-listener\",\"addr\":\"nonsense\"}",
            b"{\"op\":\"register-listener\",\"addr\":\"1.2.3.4:80\",\"extra\":1}",
            b"{\"op\":\"connect-intent\",\"src\":\"1.2.3.4:1\",\"dst\":\"1.2.3.5:2\",\"region_len\":-1}",
            b"{\"op\":\"stats\"",
            b"\xff\xfe\x00",
        ];
        for body in bodies {
            let r = decode_request(body);
            assert!(
                matches!(r, Err(ProtoError::Malformed(_))),
                "{:?} -> {r:?}",
                String::from_utf8_lossy(body)
            );
            assert!(!r.unwrap_err().loses_framing());
        }
    }

    #[test]
    fn trailing_bytes_are_rejected() {
        let mut frame = encode_frame(&Request::Stats, MAX_REQUEST_FRAME).unwrap();
        frame.push(b' ');
        assert!(decode_frame::<Request>(&frame, MAX_REQUEST_FRAME).is_err());
    }

    #[test]
    fn random_input_never_panics() {
        // Deterministic xorshift; mutates valid frames and feeds random bytes.
        let mut seed: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let valid: Vec<Vec<u8>> = all_requests()
            .iter()
            .map(|r| encode_frame(r, MAX_REQUEST_FRAME).unwrap())
            .collect();
        for i in 0..20_000 {
            let mut buf = if i % 2 == 0 {
                valid[(next() as usize) % valid.len()].clone()
            } else {
                (0..(next() % 64)).map(|_| next() as u8).collect()
            };
            for _ in 0..(next() % 4) {
                if buf.is_empty() {
                    break;
                }
                let at = (next() as usize) % buf.len();
                buf[at] = next() as u8;
            }
            if next() % 3 == 0 && !buf.is_empty() {
                let cut = (next() as usize) % buf.len();
                buf.truncate(cut);
            }
            let _ = decode_frame::<Request>(&buf, MAX_REQUEST_FRAME);
            let _ = split_frame(&buf, MAX_REQUEST_FRAME);
        }
    }
}
