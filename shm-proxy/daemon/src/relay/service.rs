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
//!    daemon serves Service IPs, a relayed claim that finds no stream waits
//!    for it, at most [`STREAM_WAIT`]; then it stays on TCP and the key is
//!    remembered, so a stream that still comes is refused (the client
//!    daemon answers `no-channel`, its pod stays on TCP too) instead of
//!    waiting for a claim that will not come.

use std::net::IpAddr;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flowlane_lane::proto::{FallbackReason, NoChannelReason, Response};
use flowlane_lane::region::Region;
use flowlane_rdma::{LaneStream, StreamKey};

use super::{lock, ClientSetup, Relay};
use crate::broker::{Answer, Caller, RemoteService, Resolved};

/// Longest a relayed claim waits for a Service connection's stream. The
/// pod waits 500 ms for its claim's answer, of which the set-up handshake
/// that follows may take `HANDSHAKE_WAIT` (300 ms).
const STREAM_WAIT: Duration = Duration::from_millis(150);

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
        let resolved = self
            .shared
            .lock()
            .resolve_service_with(caller, channel_id, &remote);
        let r = match resolved {
            Resolved::Answer(a) => return a,
            Resolved::Remote(r) => r,
        };
        let (id, src, backend) = (r.id, r.src, r.backend);
        match self.carry_service(caller, r, socket_fd) {
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
    /// serves Service IPs); `None` after [`STREAM_WAIT`], the key then
    /// remembered as missed.
    pub(super) fn await_service_stream(&self, key: &StreamKey) -> Option<Arc<dyn LaneStream>> {
        if !self.shared.lock().serves_services() {
            return None;
        }
        let deadline = Instant::now() + STREAM_WAIT;
        let mut acc = lock(&self.accepted);
        loop {
            if let Some((s, _)) = acc.remove(key) {
                tracing::debug!(client = %key.client, server = %key.server, "relay: claim met its stream after waiting");
                return Some(s);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                // Recorded under `accepted`, where the accept thread checks
                // `missed`: a stream either was seen above or is refused.
                lock(&self.missed).insert(*key, Instant::now());
                return None;
            }
            acc = self
                .arrived
                .wait_timeout(acc, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Accept thread: true (and forgotten) when `key`'s claim stopped
    /// waiting for its stream.
    pub(super) fn missed_claim(&self, key: &StreamKey) -> bool {
        lock(&self.missed).remove(key).is_some()
    }
}
