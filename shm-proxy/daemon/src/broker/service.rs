//! Connections to Service IPs (docs/shm-lane.md, "Service IPs").
//!
//! kube-proxy DNATs a connection to a Service IP to one of the Service's
//! backends in the node's PREROUTING, after the client's connect started,
//! so the intent cannot name the backend:
//!
//! 1. `service-intent {src, dst}` before connect: a channel keyed by `src`
//!    alone (the Service's port is not the backend's), when `dst` is in a
//!    Service CIDR and some pod of the node has a flowlane listener.
//! 2. `resolve-service {id}` once connect returned: the node's conntrack
//!    table names the backend (the reply tuple's source). A pod of this
//!    node with a flowlane listener there: `ok`, the client waits for the
//!    server's attach as for any channel. Anything else (another node, no
//!    listener, no entry yet, a connection also source-NATed): the channel
//!    is dropped and the answer is `no-channel`: the client stays on TCP at
//!    once, it never waits for an attach that cannot come.
//! 3. The backend's claim after accept (`peer` == `src`) pairs only if
//!    conntrack says that this connection was DNATed to the claimer's
//!    `local`: a pod cannot take a Service connection sent elsewhere. The
//!    claim may come before step 2 (a blocking connect returns after the
//!    handshake); it resolves the same way.
//! 4. A backend that is a pod of another node publishing a lane (the daemon
//!    runs the relay): [`Broker::resolve_service_with`] hands the channel
//!    to the relay (`relay/service.rs`), which carries it as a relayed
//!    connection keyed by (client, backend).

use std::net::{IpAddr, SocketAddr};

use flowlane_lane::peer_table::Entry;
use flowlane_lane::proto::{ErrorCode, FallbackReason, NoChannelReason, Response};

use super::{Admitted, Answer, Broker, Caller, IntentKey};
use crate::conntrack::Conntrack;
use crate::pods::PodId;

/// The cluster's Service CIDRs and the table that resolves them.
#[derive(Default)]
pub struct Services {
    ranges: Vec<Entry>,
    conntrack: Option<Box<dyn Conntrack>>,
    /// The daemon runs the relay: a backend may be a pod of another node,
    /// so a Service intent gets a channel even when no local pod listens.
    remote_backends: bool,
}

/// What `resolve-service` found.
pub enum Resolved {
    /// Answer the client now (a local backend, or TCP).
    Answer(Answer),
    /// The backend is a pod of another node with a lane: the relay carries
    /// the channel (taken out of the broker, no fallback counted yet).
    Remote(RemoteService),
}

/// A Service channel whose backend is on another node.
#[derive(Debug)]
pub struct RemoteService {
    pub id: u64,
    /// The client's address (the stream key's client).
    pub src: SocketAddr,
    /// The backend conntrack names (the stream key's server).
    pub backend: SocketAddr,
    pub client_pod: PodId,
    /// The channel's memfd (the client got its own copy at the intent) and
    /// its name, as the client process maps it.
    pub memfd: std::os::fd::OwnedFd,
    pub memfd_name: String,
    pub len: u64,
}

impl std::fmt::Debug for Services {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Services")
            .field("ranges", &self.ranges)
            .field("conntrack", &self.conntrack.is_some())
            .finish()
    }
}

impl Broker {
    /// Serves connections to the Service CIDRs `ranges`, resolved through
    /// `conntrack`.
    pub fn set_services(&mut self, ranges: Vec<Entry>, conntrack: Box<dyn Conntrack>) {
        self.services = Services {
            ranges,
            conntrack: Some(conntrack),
            remote_backends: self.services.remote_backends,
        };
    }

    /// The relay runs: Service backends may be pods of other nodes.
    pub fn set_remote_service_backends(&mut self) {
        self.services.remote_backends = true;
    }

    /// True when this daemon serves Service IPs (`--service-cidr`): a
    /// relayed claim may then arrive before the stream a peer daemon opens
    /// once it resolved its client's Service connection (`relay/service.rs`).
    pub fn serves_services(&self) -> bool {
        self.services.conntrack.is_some()
    }

    /// True when `channel_id` is a pending Service channel (the relay
    /// takes its `resolve-service`).
    pub fn is_pending_service(&self, channel_id: u64) -> bool {
        self.pending_ids.get(&channel_id).is_some_and(|k| k.service)
    }

    /// True when a pod of this node announced a Service connection from
    /// `src` that is not resolved yet (the backend's daemon asks whether a
    /// relay stream for it may still come: `relay/service.rs`).
    pub fn has_pending_service_from(&self, src: SocketAddr) -> bool {
        let key = IntentKey {
            src: canonical(src),
            dst_port: 0,
            service: true,
            portless: 0,
        };
        self.pending.contains_key(&key)
    }

    fn is_service_ip(&self, ip: IpAddr) -> bool {
        self.services.ranges.iter().any(|r| r.holds(ip))
    }

    pub(super) fn service_intent(
        &mut self,
        caller: &Caller,
        src: SocketAddr,
        dst: SocketAddr,
        region_len: u64,
    ) -> Answer {
        let Admitted {
            client_pod,
            src: client_addr,
        } = match self.admit_intent(caller, src, dst, region_len, false) {
            Ok(admitted) => admitted,
            Err(refused) => return refused,
        };
        if !self.is_service_ip(dst.ip()) || self.services.conntrack.is_none() {
            return self.no_channel(NoChannelReason::NotLocalPod, FallbackReason::NotLocalPod);
        }
        // No pod of the node serves the lane and no other node's can be
        // reached: no backend can have one.
        if self.listeners.is_empty() && !self.services.remote_backends {
            return self.no_channel(NoChannelReason::NoListener, FallbackReason::NoListener);
        }
        let key = IntentKey {
            src: client_addr,
            dst_port: 0,
            service: true,
            portless: 0,
        };
        self.announce(
            caller,
            super::channels::Announce {
                key,
                client_pod,
                server_pod: None,
                dst,
                region_len,
                client_socket: None,
            },
        )
    }

    pub(super) fn resolve_service(&mut self, caller: &Caller, channel_id: u64) -> Answer {
        match self.resolve_service_with(caller, channel_id, &|_| false) {
            Resolved::Answer(a) => a,
            Resolved::Remote(_) => unreachable!("no backend is remote here"),
        }
    }

    /// `resolve-service`; `remote(ip)`: `ip` is a pod of another node
    /// whose daemon the relay reaches (then the channel goes to the relay).
    pub fn resolve_service_with(
        &mut self,
        caller: &Caller,
        channel_id: u64,
        remote: &dyn Fn(IpAddr) -> bool,
    ) -> Resolved {
        let pod = match self.caller_pod(caller) {
            Ok(p) => p,
            Err(a) => return Resolved::Answer(a),
        };
        let answer = |a: Answer| Resolved::Answer(a);
        let Some(&key) = self.pending_ids.get(&channel_id) else {
            // Claimed already (the server's claim resolved it), or gone.
            return answer(match self.active.get(&channel_id) {
                Some(c) if c.client_pod == pod => Response::Ok.into(),
                Some(_) => self.deny(ErrorCode::Forbidden, "the channel belongs to other pods"),
                None => Response::NoChannel {
                    reason: NoChannelReason::NoIntent,
                }
                .into(),
            });
        };
        let Some((client_pod, dst)) = self.pending.get(&key).map(|p| (p.client_pod, p.dst)) else {
            return answer(Response::error(ErrorCode::Internal, "pending channel vanished").into());
        };
        if client_pod != pod {
            return answer(self.deny(
                ErrorCode::Forbidden,
                "the channel was announced by another pod",
            ));
        }
        if !key.service {
            return answer(Response::error(ErrorCode::BadRequest, "not a Service channel").into());
        }
        let (why, counter) = match self.backend_of(key.src, dst) {
            None => (
                NoChannelReason::Unresolved,
                FallbackReason::ServiceUnresolved,
            ),
            Some(backend) => match self.local_pod_of(backend.ip()) {
                None if remote(backend.ip()) => {
                    let Some(p) = self.pending.remove(&key) else {
                        return answer(
                            Response::error(ErrorCode::Internal, "pending channel vanished").into(),
                        );
                    };
                    self.pending_ids.remove(&p.id);
                    tracing::debug!(id = channel_id, src = %key.src, service = %dst, %backend, "service connection to another node: the relay's");
                    return Resolved::Remote(RemoteService {
                        id: p.id,
                        src: key.src,
                        backend,
                        client_pod: p.client_pod,
                        memfd: p.memfd,
                        memfd_name: super::channel_memfd_name(p.id),
                        len: p.len,
                    });
                }
                None => (NoChannelReason::NotLocalPod, FallbackReason::NotLocalPod),
                Some(server) if !self.has_listener(server, backend) => {
                    (NoChannelReason::NoListener, FallbackReason::NoListener)
                }
                Some(server) => {
                    if let Some(p) = self.pending.get_mut(&key) {
                        p.server_pod = Some(server);
                    }
                    tracing::debug!(id = channel_id, src = %key.src, service = %dst, %backend, "service connection resolved");
                    return answer(Response::Ok.into());
                }
            },
        };
        tracing::debug!(id = channel_id, src = %key.src, service = %dst, reason = %counter, "service connection stays on TCP");
        if let Some(p) = self.pending.remove(&key) {
            self.pending_ids.remove(&p.id);
        }
        answer(self.no_channel(why, counter))
    }

    /// The pending Service channel of client `peer` that conntrack says
    /// reached `local` (the claimer's, which `admit_claim` checked the pod
    /// owns): its key, or the answer refusing the claim.
    pub(super) fn service_claim(
        &mut self,
        pod: PodId,
        local: SocketAddr,
        peer: SocketAddr,
    ) -> Result<IntentKey, Answer> {
        let key = IntentKey {
            src: peer,
            dst_port: 0,
            service: true,
            portless: 0,
        };
        let Some((dst, resolved)) = self.pending.get(&key).map(|p| (p.dst, p.server_pod)) else {
            if let Some(key) = self.remapped_claim(pod, local, peer) {
                return Ok(key);
            }
            return Err(self.no_channel(
                NoChannelReason::NoIntent,
                FallbackReason::ClaimWithoutIntent,
            ));
        };
        let reached = self.backend_of(peer, dst);
        if reached.map(canonical) != Some(canonical(local)) || resolved.is_some_and(|s| s != pod) {
            // Leave the channel for the backend conntrack names.
            tracing::debug!(client = %peer, service = %dst, claimer = %local, ?reached, "service claim by a pod the connection did not reach");
            self.counters.fallback(FallbackReason::AuthFailed);
            return Err(self.deny(
                ErrorCode::Forbidden,
                "the Service connection was not sent to this pod",
            ));
        }
        Ok(key)
    }

    /// The pending channel of a connection whose source port the node's NAT
    /// remapped (its reply tuple would have clashed with an entry an
    /// earlier, DNATed connection still holds): the server sees `peer`,
    /// conntrack's original source is what the client announced. Direct
    /// and Service channels alike, each checked as its own claim is.
    fn remapped_claim(
        &mut self,
        pod: PodId,
        local: SocketAddr,
        peer: SocketAddr,
    ) -> Option<IntentKey> {
        let ct = self.services.conntrack.as_mut()?;
        let (src, dst) = match ct.original_of(local, peer) {
            Ok(Some((src, dst))) => (canonical(src), canonical(dst)),
            Ok(None) => return None,
            Err(e) => {
                tracing::warn!(error = %e, %local, %peer, "conntrack lookup failed");
                return None;
            }
        };
        // Only the port may differ: another address is a masquerade.
        if src.ip() != peer.ip() || src == peer {
            return None;
        }
        let direct = IntentKey {
            src,
            dst_port: local.port(),
            service: false,
            portless: 0,
        };
        if dst == canonical(local)
            && self
                .pending
                .get(&direct)
                .is_some_and(|p| p.server_pod == Some(pod) && canonical(p.dst) == dst)
        {
            tracing::debug!(client = %src, seen_as = %peer, "claim of a source-port-remapped connection");
            return Some(direct);
        }
        if dst == canonical(local) {
            if let Some(key) = self.portless_claim(pod, local, src) {
                tracing::debug!(client = %src, seen_as = %peer, "claim of a source-port-remapped connection (portless intent)");
                return Some(key);
            }
        }
        let service = IntentKey {
            src,
            dst_port: 0,
            service: true,
            portless: 0,
        };
        let (svc, resolved) = self.pending.get(&service).map(|p| (p.dst, p.server_pod))?;
        let ok = svc == dst
            && resolved.is_none_or(|s| s == pod)
            && self.backend_of(src, svc) == Some(canonical(local));
        ok.then_some(service)
    }

    /// The backend the connection `src` → `service` reached, per
    /// conntrack; `None` when there is no entry (yet), it cannot be asked,
    /// or the connection was source-NATed to another address (the backend
    /// sees another peer than `src`: kube-proxy's hairpin masquerade).
    fn backend_of(&mut self, src: SocketAddr, service: SocketAddr) -> Option<SocketAddr> {
        let ct = self.services.conntrack.as_mut()?;
        match ct.lookup(src, service) {
            // The port may have been remapped (see `remapped_claim`), the
            // address not.
            Ok(Some(m)) if m.reply_dst.ip().to_canonical() == src.ip().to_canonical() => {
                Some(canonical(m.reply_src))
            }
            Ok(Some(m)) => {
                tracing::debug!(%src, %service, reply_dst = %m.reply_dst, "service connection source-NATed too");
                None
            }
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(error = %e, %src, %service, "conntrack lookup failed");
                None
            }
        }
    }
}

fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}
