//! Pending channels: announced by a client's intent (its memfd made here),
//! found again by the server's claim after accept, cancelled, undelivered
//! or expired.
//!
//! **Portless intents.** A client whose socket is not bound yet sends its
//! intent with source port 0 and its socket's fd number, and connects
//! without binding first: `connect` picks the port as for any TCP
//! connection (a `bind(ip, 0)` before it would reserve the port against
//! every destination and scan the port space under many TIME_WAIT
//! sockets). The server's claim names the peer's address; a claim that
//! finds no intent under it looks at the portless intents of the peer's
//! pod to the claimed port and asks the kernel for each one's socket
//! (`Kernel::connection_of`: the client's own socket, through pidfd):
//! the one bound to the peer's address and connected to the claimed
//! local address is this connection. By the time the server accepted,
//! the client's `connect` has sent its SYN, so its socket has the port.

use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::time::Instant;

use flowlane_lane::proto::{ErrorCode, FallbackReason, NoChannelReason, Response};

use super::admission::Admitted;
use super::connections::Active;
use super::{canonical, Answer, Broker, Caller};
use crate::identity::ProcessId;
use crate::pods::PodId;
use crate::ring_watch::RingWatch;

/// Pending channels are found again by the client's source address and the
/// destination port: exactly what the server sees after accept, even behind
/// DNAT. A connection to a Service IP is keyed by its source alone
/// (`service`, `dst_port` 0): the Service's port is not the backend's. Only
/// the pod that owns `src` can make either key (`admit_intent`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct IntentKey {
    pub(super) src: SocketAddr,
    pub(super) dst_port: u16,
    pub(super) service: bool,
    /// A portless intent's channel id (its `src` has port 0, so several
    /// may wait at once); 0 for every other key.
    pub(super) portless: u64,
}

/// An intent admitted, to be recorded (`Broker::announce`).
pub(super) struct Announce {
    pub(super) key: IntentKey,
    pub(super) client_pod: PodId,
    /// The server's pod; `None` for a Service connection until resolved.
    pub(super) server_pod: Option<PodId>,
    /// The destination the client named.
    pub(super) dst: SocketAddr,
    pub(super) region_len: u64,
    /// A portless intent's socket: its fd number in the client process.
    pub(super) client_socket: Option<i32>,
}

#[derive(Debug)]
pub(super) struct Pending {
    pub(super) id: u64,
    pub(super) memfd: OwnedFd,
    pub(super) len: u64,
    pub(super) client_pod: PodId,
    /// The server's pod; for a Service connection, its backend's once the
    /// client resolved it (`service.rs`).
    pub(super) server_pod: Option<PodId>,
    pub(super) key: IntentKey,
    /// The destination the client named (a Service IP for a Service key).
    pub(super) dst: SocketAddr,
    pub(super) client_process: Option<ProcessId>,
    /// A portless intent's socket: its fd number in the client process.
    pub(super) client_socket: Option<i32>,
    pub(super) created: Instant,
}

impl Broker {
    /// A fresh channel id (the relay's connections share the id space).
    pub fn next_channel_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// `socket_fd`: the client's socket, named by a relayable intent; with
    /// it, `src` may have port 0 (a portless intent, module header).
    pub(super) fn connect_intent(
        &mut self,
        caller: &Caller,
        src: SocketAddr,
        dst: SocketAddr,
        region_len: u64,
        socket_fd: Option<i32>,
    ) -> Answer {
        let Admitted {
            client_pod,
            src: client_addr,
        } = match self.admit_intent(caller, src, dst, region_len, socket_fd.is_some()) {
            Ok(admitted) => admitted,
            Err(refused) => return refused,
        };
        let Some(server_pod) = self.local_pod_of(dst.ip()) else {
            return self.no_channel(NoChannelReason::NotLocalPod, FallbackReason::NotLocalPod);
        };
        if !self.has_listener(server_pod, dst) {
            return self.no_channel(NoChannelReason::NoListener, FallbackReason::NoListener);
        }
        let portless = client_addr.port() == 0;
        let key = IntentKey {
            src: client_addr,
            dst_port: dst.port(),
            service: false,
            // Unique per intent: the id `announce` is about to give it.
            portless: if portless { self.next_id } else { 0 },
        };
        self.announce(
            caller,
            Announce {
                key,
                client_pod,
                server_pod: Some(server_pod),
                dst,
                region_len,
                client_socket: if portless { socket_fd } else { None },
            },
        )
    }

    /// Records a pending channel under `key` and answers it to the client.
    pub(super) fn announce(&mut self, caller: &Caller, a: Announce) -> Answer {
        let Announce {
            key,
            client_pod,
            server_pod,
            dst,
            region_len,
            client_socket,
        } = a;
        // The pod's stock counts too (`stock.rs`).
        if self.held_by_pod(client_pod) >= self.limits.max_pending_per_pod {
            self.counters.fallback(FallbackReason::TooManyPending);
            return Response::error(
                ErrorCode::TooLarge,
                "too many pending channels for this pod",
            )
            .into();
        }
        // The same source port again means the earlier attempt is dead.
        self.drop_pending(key, FallbackReason::IntentCancelled);

        let id = self.next_id;
        self.next_id += 1;
        let created = self
            .kernel
            .channel_memfd(&super::channel_memfd_name(id), region_len)
            .and_then(|fd| Ok((fd.try_clone()?, fd)));
        let (client_copy, kept) = match created {
            Ok(fds) => fds,
            Err(e) => {
                tracing::warn!(error = %e, region_len, "cannot create a channel memfd");
                self.counters.fallback(FallbackReason::DaemonError);
                return Response::error(ErrorCode::Internal, format!("memfd: {e}")).into();
            }
        };
        tracing::debug!(id, src = %key.src, %dst, region_len, "channel announced");
        self.pending_ids.insert(id, key);
        self.pending.insert(
            key,
            Pending {
                id,
                memfd: kept,
                len: region_len,
                client_pod,
                server_pod,
                key,
                dst,
                client_process: caller.process,
                client_socket,
                created: Instant::now(),
            },
        );
        Answer::with_fd(
            Response::Channel {
                id,
                len: region_len,
            },
            client_copy,
        )
    }

    pub(super) fn no_channel(&mut self, why: NoChannelReason, counter: FallbackReason) -> Answer {
        self.counters.fallback(counter);
        Response::NoChannel { reason: why }.into()
    }

    pub(super) fn drop_pending(
        &mut self,
        key: IntentKey,
        counter: FallbackReason,
    ) -> Option<Pending> {
        let p = self.pending.remove(&key)?;
        self.pending_ids.remove(&p.id);
        self.counters.fallback(counter);
        tracing::debug!(id = p.id, reason = %counter, "pending channel dropped");
        Some(p)
    }

    pub(super) fn cancel_intent(&mut self, caller: &Caller, channel_id: u64) -> Answer {
        let pod = match self.caller_pod(caller) {
            Ok(p) => p,
            Err(a) => return a,
        };
        let Some(&key) = self.pending_ids.get(&channel_id) else {
            return Response::Ok.into();
        };
        if self.pending.get(&key).map(|p| p.client_pod) != Some(pod) {
            return self.deny(
                ErrorCode::Forbidden,
                "the channel was announced by another pod",
            );
        }
        self.drop_pending(key, FallbackReason::IntentCancelled);
        Response::Ok.into()
    }

    /// The answer to intent `channel_id` could not be sent: its client
    /// gave up waiting (the library's 500 ms budget) and closed the
    /// connection, so it runs that TCP connection without the ring. A
    /// server claiming the channel would attach to a ring nobody writes
    /// and read the client's bytes as doorbells: drop it, and the claim
    /// keeps both ends on TCP.
    pub fn intent_undelivered(&mut self, channel_id: u64) {
        if let Some(&key) = self.pending_ids.get(&channel_id) {
            self.drop_pending(key, FallbackReason::IntentUndelivered);
        }
    }

    pub(super) fn claim_accepted(
        &mut self,
        caller: &Caller,
        local: SocketAddr,
        peer: SocketAddr,
    ) -> Answer {
        let pod = match self.admit_claim(caller, local) {
            Ok(p) => p,
            Err(refused) => return refused,
        };
        let direct = IntentKey {
            src: peer,
            dst_port: local.port(),
            service: false,
            portless: 0,
        };
        let key = match self.pending.get(&direct) {
            Some(p) if p.server_pod != Some(pod) => {
                // Leave the channel for its real server.
                self.counters.fallback(FallbackReason::AuthFailed);
                return self.deny(ErrorCode::Forbidden, "the channel belongs to another pod");
            }
            Some(_) => direct,
            None => match self.portless_claim(pod, local, peer) {
                Some(key) => key,
                // A connection to a Service IP, if conntrack says that it
                // reached `local` (`service.rs`).
                None => match self.service_claim(pod, local, peer) {
                    Ok(key) => key,
                    Err(refused) => return refused,
                },
            },
        };
        let Some(p) = self.pending.remove(&key) else {
            return Response::error(ErrorCode::Internal, "pending channel vanished").into();
        };
        self.pending_ids.remove(&p.id);
        self.counters.shm.opened += 1;
        self.counters.channel_setup.observe(p.created.elapsed());
        self.keep_listener_for(caller, pod, local);
        tracing::debug!(id = p.id, client = %p.key.src, server = %local, "channel claimed");
        let watch = match p.memfd.try_clone() {
            Ok(fd) => Some(RingWatch::new(fd)),
            Err(e) => {
                tracing::warn!(error = %e, "cannot keep a view of the channel; no live counters");
                None
            }
        };
        self.active.insert(
            p.id,
            Active {
                id: p.id,
                client_pod: p.client_pod,
                server_pod: pod,
                client_addr: p.key.src,
                // A Service connection's server is its backend.
                server_addr: if p.key.service { local } else { p.dst },
                len: p.len,
                opened: Instant::now(),
                client_process: p.client_process,
                server_process: caller.process,
                client_report: None,
                server_report: None,
                watch,
                seen: Default::default(),
            },
        );
        Answer::with_fd(
            Response::Channel {
                id: p.id,
                len: p.len,
            },
            p.memfd,
        )
    }

    /// The portless intent (module header) whose client socket is this
    /// connection's: from `peer`'s pod, to `local`'s port, for the claiming
    /// pod, its socket bound to `peer` and connected to `local`.
    ///
    /// Every portless intent of that pod and port whose socket has its port
    /// by now is re-keyed under its real source address on the way
    /// (`learn_port`), so each socket is read about once, not once per
    /// claim: a client opening a thousand connections at once (an asyncio
    /// program) costs a thousand reads, not half a million.
    pub(super) fn portless_claim(
        &mut self,
        pod: PodId,
        local: SocketAddr,
        peer: SocketAddr,
    ) -> Option<IntentKey> {
        // At most the pod's pending intents (`max_pending_per_pod`); each
        // is read until its socket has a port, or dropped at its first
        // read when it can never match.
        let candidates: Vec<(IntentKey, ProcessId, i32)> = self
            .pending
            .values()
            .filter(|p| {
                p.key.portless != 0
                    && p.key.dst_port == local.port()
                    && p.server_pod == Some(pod)
                    && self.pod_owns(p.client_pod, peer.ip())
            })
            .filter_map(|p| Some((p.key, p.client_process?, p.client_socket?)))
            .collect();
        for (key, process, fd) in candidates {
            match self.kernel.connection_of(&process, fd) {
                Ok((bound, connected)) if bound.port() != 0 => {
                    self.learn_port(key, bound, connected);
                }
                // Not connected yet: read again at a later claim.
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {}
                // The process is gone, or the fd it named is no TCP socket
                // (any more): the intent can never match. Dropped, so that
                // a pod cannot make every claim of its connections read
                // thousands of bogus fds.
                Err(e) => {
                    tracing::debug!(pid = process.pid, fd, error = %e, "portless intent: cannot read the client's socket; dropped");
                    self.drop_pending(key, FallbackReason::IntentCancelled);
                }
            }
        }
        let direct = IntentKey {
            src: peer,
            dst_port: local.port(),
            service: false,
            portless: 0,
        };
        self.pending
            .get(&direct)
            .is_some_and(|p| p.server_pod == Some(pod))
            .then_some(direct)
    }

    /// The portless intent `key`'s socket turned out bound to `bound` and
    /// connected to `connected`: it waits from now on under its real
    /// source, as an intent that named its port. A socket connected to
    /// another destination than its intent named, or bound to an address
    /// its pod does not own, is not its connection: left as it is (it
    /// expires). The address may differ from the one the intent was
    /// admitted with: `connect` picked it by route, like `pod_owns`
    /// checks any of the pod's addresses for an intent that names one.
    fn learn_port(&mut self, key: IntentKey, bound: SocketAddr, connected: SocketAddr) {
        let Some(p) = self.pending.get(&key) else {
            return;
        };
        if canonical(p.dst) != connected || !self.pod_owns(p.client_pod, bound.ip()) {
            return;
        }
        let real = IntentKey {
            src: bound,
            dst_port: key.dst_port,
            service: false,
            portless: 0,
        };
        // The same source port again means the earlier attempt is dead.
        self.drop_pending(real, FallbackReason::IntentCancelled);
        let Some(mut p) = self.pending.remove(&key) else {
            return;
        };
        p.key = real;
        self.pending_ids.insert(p.id, real);
        self.pending.insert(real, p);
    }
}
