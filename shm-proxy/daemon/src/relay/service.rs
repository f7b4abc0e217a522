//! Service connections whose backend is a pod of another node (issue 16;
//! docs/relay.md, "Service IPs").
//!
//! kube-proxy DNATs the client's SYN in its own node, so the backend is
//! known only after connect, from the node's conntrack table, and the
//! server sees the client's own address:
//!
//! 1. Client daemon, at `resolve-service`: the broker finds the backend
//!    (`broker/service.rs`); when it is a pod of another node publishing a
//!    lane, the channel comes here. This daemon takes its own reference to
//!    the client's socket, maps the channel's region itself (it is the
//!    pod's ring peer), opens the lane stream keyed by (client, backend)
//!    and answers `ok` once the server daemon REGISTERED it; the rest is
//!    the relay's usual set-up (`client_setup`). Any failure: `no-channel`,
//!    the client stays on TCP at once, the reason counted.
//! 2. Server daemon: the backend pod's claim may come before that stream
//!    (a blocking connect returns after the handshake, and the server may
//!    accept and claim before the client even asks to resolve). When this
//!    daemon serves Service IPs, a relayed claim that finds no stream asks
//!    the client's daemon over the lane whether one is coming (a query
//!    stream: the same key, opened the other way round). That daemon
//!    answers from what it holds: a pending Service intent from the client's
//!    address, or a relay set-up for it in flight, means STREAM_COMING;
//!    anything else STREAM_NONE. Only a coming stream is waited for, at
//!    most [`STREAM_WAIT`] from the claim; so a client without the library
//!    (or a connection not to a Service) costs one lane round trip, not a
//!    blind wait. After the wait or a "none", the key is remembered and a
//!    stream that still comes is refused (the client daemon answers
//!    `no-channel`, its pod stays on TCP too) instead of waiting for a
//!    claim that will not come.
//!
//! Why the answer is exact: the client pod's library sends its
//! `service-intent` before its connect, so before the server can accept and
//! claim; the intent then moves from pending (broker) to in flight (here:
//! `service_inflight`, under the broker's lock, which the answer holds too)
//! and leaves that set only once the server daemon has REGISTERED the
//! stream (a claim told "none" after that looks at its accepted streams
//! again and finds it) or the set-up failed (no stream comes). A client
//! without the library announced nothing: "none".

use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flowlane_lane::proto::{FallbackReason, NoChannelReason, Response};
use flowlane_lane::region::Region;
use flowlane_rdma::{LaneStream, StreamKey};

use super::{frames, lock, recv_byte_within, ClientSetup, Relay};
use crate::broker::{Answer, Caller, RemoteService, Resolved};

/// Longest a relayed claim waits for a Service connection's stream,
/// asking the client's daemon included. The pod waits 500 ms for its
/// claim's answer, of which the set-up handshake that follows may take
/// `HANDSHAKE_WAIT` (300 ms).
const STREAM_WAIT: Duration = Duration::from_millis(150);

/// The client daemon's count of the queries it answered (`requests`).
pub const QUERY_OP: &str = "peer-stream-query";

type Refusal = (NoChannelReason, FallbackReason);

impl Relay {
    /// `resolve-service` of a pending Service channel: the broker's answer,
    /// or, for a backend on another node, the relay's set-up.
    pub(super) fn resolve_service(
        self: &Arc<Self>,
        caller: &Caller,
        channel_id: u64,
        socket_fd: Option<i32>,
    ) -> Answer {
        // A library that does not name its socket cannot be relayed.
        let remote = |ip: IpAddr| socket_fd.is_some() && self.router.lane_peer(ip).is_some();
        let r = {
            let mut broker = self.shared.lock();
            match broker.resolve_service_with(caller, channel_id, &remote) {
                Resolved::Answer(a) => return a,
                Resolved::Remote(r) => {
                    // Out of the broker's pending table, into ours, under
                    // the lock a peer's query holds: never in neither.
                    lock(&self.service_inflight).insert(r.src, r.backend);
                    r
                }
            }
        };
        let (id, src, backend) = (r.id, r.src, r.backend);
        let carried = self.carry_service(caller, r, socket_fd);
        // Carried: the server daemon has registered the stream (a claim
        // told "none" from now finds it); failed: none will come.
        lock(&self.service_inflight).remove(&src);
        match carried {
            Ok(()) => {
                tracing::debug!(id, %src, %backend, "relay: Service connection announced");
                Response::Ok.into()
            }
            Err((why, counter)) => {
                tracing::debug!(id, %src, %backend, reason = %counter, "relay: Service connection stays on TCP");
                self.fallback(why, counter)
            }
        }
    }

    fn carry_service(
        self: &Arc<Self>,
        caller: &Caller,
        r: RemoteService,
        socket_fd: Option<i32>,
    ) -> Result<(), Refusal> {
        let failed = (
            NoChannelReason::NotLocalPod,
            FallbackReason::RelaySetupFailed,
        );
        let socket_fd = socket_fd.ok_or(failed)?;
        let peer_daemon = self
            .router
            .lane_peer(r.backend.ip())
            .ok_or((NoChannelReason::NotLocalPod, FallbackReason::NotLocalPod))?;
        let reservation = self
            .reserve(r.len)
            .ok_or((NoChannelReason::NotLocalPod, FallbackReason::RelayBudget))?;
        // Connected (or connecting) to the Service IP: only the local
        // address is checked.
        let (sock, pidfd, pid) =
            Self::take_socket(caller, socket_fd, r.src, None).map_err(|e| {
                tracing::debug!(src = %r.src, error = %e, "relay: cannot take the client's socket");
                failed
            })?;
        // Mapped fixed before the pod maps it (after our answer): its
        // producer never changes the ring's capacity (docs/shm-lane.md).
        let len = usize::try_from(r.len).map_err(|_| failed)?;
        let region = Region::map_memfd_fixed(r.memfd.as_fd(), len).map_err(|e| {
            tracing::warn!(error = %e, "relay: cannot map a Service channel");
            failed
        })?;
        let key = StreamKey {
            client: r.src,
            server: r.backend,
        };
        let stream = self.open_registered(peer_daemon, key)?;
        let setup = ClientSetup {
            id: r.id,
            pod: r.client_pod,
            key,
            region,
            sock,
            pidfd,
            pid,
            memfd_name: r.memfd_name,
            reservation,
        };
        self.start_client_setup(setup, stream)
    }

    /// Server daemon: the stream of a claim that found none yet, when it
    /// may be a Service connection's still being opened (this daemon
    /// serves Service IPs and the client's daemon says it is coming);
    /// else why the claim stays on TCP, the key then remembered as missed.
    pub(super) fn await_service_stream(
        &self,
        key: &StreamKey,
    ) -> Result<Arc<dyn LaneStream>, FallbackReason> {
        if !self.shared.lock().serves_services() {
            return Err(FallbackReason::ClaimWithoutIntent);
        }
        let deadline = Instant::now() + STREAM_WAIT;
        let coming = self.stream_coming(key, deadline);
        let mut acc = lock(&self.accepted);
        loop {
            // Also after "none": the stream may have been registered
            // between our first look and the answer.
            if let Some((s, _)) = acc.remove(key) {
                tracing::debug!(client = %key.client, server = %key.server, "relay: claim met its stream after asking");
                return Ok(s);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if !coming || left.is_zero() {
                // Recorded under `accepted`, where the accept thread checks
                // `missed`: a stream either was seen above or is refused.
                lock(&self.missed).insert(*key, Instant::now());
                if coming {
                    tracing::info!(client = %key.client, server = %key.server, "relay: the stream announced for a claim did not come; TCP");
                    return Err(FallbackReason::ServiceStreamMissed);
                }
                return Err(FallbackReason::ClaimWithoutIntent);
            }
            acc = self
                .arrived
                .wait_timeout(acc, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Server daemon: asks the daemon of `key`'s client, before `deadline`,
    /// whether a stream with `key` is coming. No answer in time, or any
    /// other answer: not coming (the claim goes on over TCP).
    fn stream_coming(&self, key: &StreamKey, deadline: Instant) -> bool {
        let Some(peer_daemon) = self.router.lane_peer(key.client.ip()) else {
            return false;
        };
        let asked = Instant::now();
        let left = || deadline.saturating_duration_since(Instant::now());
        let answer = self
            .open_within(peer_daemon, *key, left())
            .and_then(|stream| {
                let a = recv_byte_within(&stream, left());
                if a.is_err() {
                    stream.reset();
                }
                a.map_err(|e| e.to_string())
            });
        let us = asked.elapsed().as_micros() as u64;
        let coming = match answer {
            Ok(frames::STREAM_COMING) => true,
            Ok(frames::STREAM_NONE) => false,
            other => {
                tracing::info!(%peer_daemon, client = %key.client, server = %key.server, answer = ?other, us, "relay: the client's daemon did not answer whether a stream is coming; TCP");
                return false;
            }
        };
        tracing::debug!(%peer_daemon, client = %key.client, server = %key.server, coming, us, "relay: asked the client's daemon");
        coming
    }

    /// Client daemon: a stream opened by the daemon of `key.server`'s node
    /// whose client is a pod of ours: that daemon's question whether a
    /// stream with this key is coming from us. Answered from what this
    /// daemon holds, never blocking (the accept thread runs it).
    pub(super) fn answer_stream_query(&self, key: &StreamKey, stream: Box<dyn LaneStream>) {
        let coming = {
            let mut broker = self.shared.lock();
            broker.count_request(QUERY_OP);
            broker.has_pending_service_from(key.client)
                || lock(&self.service_inflight).get(&key.client) == Some(&key.server)
        };
        tracing::debug!(client = %key.client, server = %key.server, coming, "relay: answered whether a stream is coming");
        let answer = if coming {
            frames::STREAM_COMING
        } else {
            frames::STREAM_NONE
        };
        self.answer_and_linger(stream, answer);
    }

    /// Accept thread: true (and forgotten) when `key`'s claim stopped
    /// waiting for its stream.
    pub(super) fn missed_claim(&self, key: &StreamKey) -> bool {
        lock(&self.missed).remove(key).is_some()
    }
}

/// Client daemon: Service connections handed to the relay whose stream the
/// server daemon has not registered yet: client address -> backend.
pub(super) type InFlight = std::collections::HashMap<SocketAddr, SocketAddr>;
