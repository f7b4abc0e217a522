//! Stock: channels the daemon makes ahead for one (client process,
//! destination listener address) pair, so that later connections of that
//! process to that listener need no round trip to the daemon
//! (docs/daemon.md, "Pre-created channels").
//!
//! - `stock-intent`: served as a relayable intent; when that yields a
//!   channel to a listener that takes stock, up to `want` more sealed
//!   regions are made and granted to the client with it.
//! - `stock-claim`: served as a relayable claim; it also marks the listener
//!   as one that takes stock (its server looks at stock), and grants the
//!   calling process the listener's stock it does not hold yet.
//! - No message per connection: the daemon keeps a mapping of each stock
//!   region, and a channel whose offer word says a server took it becomes
//!   an active connection (`open_taken_stock`, at every tick and before
//!   stats are read); it is counted closed when both its producers closed
//!   (`close_finished_mapped`), with the bytes its rings' positions show.
//!   The library sends neither `stock-taken` nor close reports for stock.
//! - From an older library: `stock-taken` (one way) fills in the server's
//!   side of a connection seen taken, or makes stock active; a close report
//!   from the client's pod may name stock not taken yet: it becomes active
//!   at once, and a later `stock-taken` fills in the server's side.
//!
//! Bounds: a pod's stock counts against its pending channels
//! (`max_pending_per_pod`), a (client process, destination) pair holds at
//! most `MAX_STOCK_PER_PAIR`, an answer grants at most `MAX_STOCK_GRANTS`.
//! A pod whose live stock connections reach `max_pending_per_pod` gets no
//! more stock: they open on a word the client can write itself.
//! Stock expires (`stock_ttl`, and with its client process); dropping it
//! closes the daemon's copy only.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Instant;

use flowlane_lane::offer::Offer;
use flowlane_lane::region::Region;

use flowlane_lane::proto::{
    ChannelGrant, ErrorCode, FallbackReason, Response, StockGrant, MAX_STOCK_GRANTS,
};

use super::connections::Active;
use super::{Answer, Broker, Caller};
use crate::identity::ProcessId;
use crate::pods::PodId;
use crate::ring_watch::RingWatch;

/// Most stock one (client process, destination) pair holds: the library
/// asks for more only when it has none left, so one batch is all a pair
/// ever needs at once.
const MAX_STOCK_PER_PAIR: usize = MAX_STOCK_GRANTS;

/// A channel made ahead, not taken yet.
#[derive(Debug)]
pub(super) struct Stock {
    /// The daemon's copy: every grant is a dup of it.
    memfd: OwnedFd,
    pub(super) len: u64,
    pub(super) client_pod: PodId,
    pub(super) client_process: ProcessId,
    /// The client pod's address as its server sees the peer (the grant's
    /// `client`).
    pub(super) client_ip: IpAddr,
    pub(super) server_pod: PodId,
    /// The destination the client named (canonical): the listener address
    /// a server's `local` must equal.
    pub(super) dst: SocketAddr,
    pub(super) created: Instant,
    /// The server processes it was granted to.
    pub(super) holders: Vec<ProcessId>,
    /// The daemon's mapping of the region, for its offer word only: a
    /// channel a server took is counted opened when the daemon sees the
    /// word say so (before the server's one-way `stock-taken` arrives), and
    /// stock the daemon drops is revoked there. `None` if it could not be
    /// mapped (then neither happens for it).
    view: Option<Arc<Region>>,
}

/// The stock an intent's answer is to carry: how many, and for whom.
struct StockOrder {
    count: usize,
    len: u64,
    client_pod: PodId,
    client_process: ProcessId,
    client_ip: IpAddr,
    server_pod: PodId,
    dst: SocketAddr,
}

/// What an answer that could not be sent had made or granted, to undo.
#[derive(Debug, PartialEq, Eq)]
pub enum Undelivered {
    /// An intent's channel and the stock made with it: the client never
    /// got them.
    Intent {
        channel: Option<u64>,
        stock: Vec<u64>,
    },
    /// A stock claim's grants: they stay stock, the caller holds none.
    Grants(Vec<u64>),
}

impl Undelivered {
    /// What the answer `response` to a request (`intent`: an intent of any
    /// kind) made or granted.
    pub fn of(intent: bool, response: &Response) -> Option<Self> {
        match response {
            Response::Channel { id, .. } if intent => Some(Undelivered::Intent {
                channel: Some(*id),
                stock: Vec::new(),
            }),
            Response::Stocked { channel, stock } => {
                let ids = stock.iter().map(|g| g.id).collect();
                Some(if intent {
                    Undelivered::Intent {
                        channel: channel.map(|c| c.id),
                        stock: ids,
                    }
                } else {
                    Undelivered::Grants(ids)
                })
            }
            _ => None,
        }
    }
}

impl Broker {
    /// `stock-intent`: the relayable intent, and stock with its channel
    /// when the listener takes it.
    pub(super) fn stock_intent(
        &mut self,
        caller: &Caller,
        src: SocketAddr,
        dst: SocketAddr,
        region_len: u64,
        socket_fd: i32,
        want: u32,
    ) -> Answer {
        // Stock taken since the last tick is no stock any more: it must not
        // count against the pod's budget nor the pair's bound; stock
        // connections closed since then no longer count as live.
        self.refresh_connections();
        let answer = self.connect_intent(caller, src, dst, region_len, Some(socket_fd));
        let Response::Channel { id, len } = answer.response else {
            return answer;
        };
        let Some(order) = self.stock_order(caller, id, want) else {
            return answer;
        };
        let made = self.make_stock(order);
        if made.is_empty() {
            return answer;
        }
        Self::stocked(Some(ChannelGrant { id, len }), answer.fds, made)
    }

    /// How much stock the intent that just announced `channel_id` gets:
    /// `want` within the bounds (module header); `None` for none.
    fn stock_order(&self, caller: &Caller, channel_id: u64, want: u32) -> Option<StockOrder> {
        // Stock is bounded and expired per client process: an
        // unidentified one gets none.
        let client_process = caller.process?;
        let p = self.pending.get(self.pending_ids.get(&channel_id)?)?;
        let server_pod = p.server_pod?;
        // An older library on the server would never look at stock, and
        // the client would wait for an attach that never comes.
        let listener = self.listener_key(server_pod, p.dst)?;
        if !self.takes_stock.contains(&listener) {
            return None;
        }
        // A stock connection opens on its region's offer word, which the
        // client can write itself: without its server's word nothing else
        // bounds how many connections (each a mapping here) the daemon
        // keeps for a pod. Past its budget in live stock connections a pod
        // gets no more stock: its next connections ask, and a server's
        // claim admits them.
        let count = self.stock_count(p.client_pod, client_process, p.dst, want);
        (count > 0).then_some(StockOrder {
            count,
            len: p.len,
            client_pod: p.client_pod,
            client_process,
            // The admitted source: a portless intent's is the pod's
            // address facing `dst` (`admit_intent`).
            client_ip: p.key.src.ip(),
            server_pod,
            dst: p.dst,
        })
    }

    /// How many of `want` stock channels (client process, `dst`) may have
    /// now: none past the pod's budget in live stock connections, then
    /// within the pair's bound and the pod's budget of held channels.
    fn stock_count(
        &self,
        client_pod: PodId,
        client_process: ProcessId,
        dst: SocketAddr,
        want: u32,
    ) -> usize {
        if self.live_stock_of_pod(client_pod) >= self.limits.max_pending_per_pod {
            tracing::debug!(pod = ?client_pod, "no more stock: the pod's live stock connections reach its budget");
            return 0;
        }
        let of_pair = self
            .stock
            .values()
            .filter(|s| s.client_process == client_process && s.dst == dst)
            .count();
        let budget = self
            .limits
            .max_pending_per_pod
            .saturating_sub(self.held_by_pod(client_pod));
        (want as usize)
            .min(MAX_STOCK_GRANTS)
            .min(MAX_STOCK_PER_PAIR.saturating_sub(of_pair))
            .min(budget)
    }

    /// `stock-refill`: more stock for a client process that still holds
    /// stock for `dst`, made as that stock was (its intent's admission:
    /// client address, server pod, length), after the same checks an
    /// intent's stock gets. A process that holds none of it any more
    /// asks with an intent.
    pub(super) fn stock_refill(&mut self, caller: &Caller, dst: SocketAddr, want: u32) -> Answer {
        let pod = match self.caller_pod(caller) {
            Ok(p) => p,
            Err(refused) => return refused,
        };
        self.refresh_connections();
        let none = || Self::stocked(None, Vec::new(), Vec::new());
        let Some(client_process) = caller.process else {
            return none();
        };
        let Some(order) = self
            .stock
            .values()
            .find(|s| s.client_process == client_process && s.client_pod == pod && s.dst == dst)
            .map(|s| StockOrder {
                count: 0,
                len: s.len,
                client_pod: pod,
                client_process,
                client_ip: s.client_ip,
                server_pod: s.server_pod,
                dst,
            })
        else {
            return none();
        };
        // The listener went away, or its server no longer takes stock.
        let takes = self
            .listener_key(order.server_pod, dst)
            .is_some_and(|l| self.takes_stock.contains(&l));
        if !takes || !self.pod_is_live(order.server_pod) {
            return none();
        }
        let count = self.stock_count(pod, client_process, dst, want);
        if count == 0 {
            return none();
        }
        let made = self.make_stock(StockOrder { count, ..order });
        Self::stocked(None, Vec::new(), made)
    }

    /// `stock-fetch`: the stock of the caller's pod's listener `local`
    /// that the calling process does not hold yet (what a `stock-claim`
    /// would grant with its answer).
    pub(super) fn stock_fetch(&mut self, caller: &Caller, local: SocketAddr) -> Answer {
        let pod = match self.caller_pod(caller) {
            Ok(p) => p,
            Err(refused) => return refused,
        };
        // Stock taken since the last tick is not granted again.
        self.open_taken_stock();
        let grants = match self.listener_key(pod, local) {
            Some(l) if self.takes_stock.contains(&l) => self.grant_stock(caller, pod, local, None),
            _ => Vec::new(),
        };
        Self::stocked(None, Vec::new(), grants)
    }

    /// Live connections of `pod` (as client) that opened from stock.
    fn live_stock_of_pod(&self, pod: PodId) -> usize {
        self.active
            .values()
            .filter(|c| c.client_pod == pod && c.watch.as_ref().is_some_and(|w| w.is_mapped()))
            .count()
    }

    /// Channels a pod holds against `max_pending_per_pod`: pending, stock,
    /// and stock a close report made active before its server took it.
    pub(super) fn held_by_pod(&self, pod: PodId) -> usize {
        let pending = self
            .pending
            .values()
            .filter(|p| p.client_pod == pod)
            .count();
        let stock = self.stock.values().filter(|s| s.client_pod == pod).count();
        let early = self
            .stock_early
            .keys()
            .filter(|id| self.active.get(id).is_some_and(|c| c.client_pod == pod))
            .count();
        pending + stock + early
    }

    /// Makes and records the stock of `order`; returns each grant with the
    /// client's copy of its memfd (fewer than ordered if the kernel
    /// refuses a memfd).
    fn make_stock(&mut self, order: StockOrder) -> Vec<(StockGrant, OwnedFd)> {
        let mut made = Vec::with_capacity(order.count);
        for _ in 0..order.count {
            let id = self.next_channel_id();
            let created = self
                .kernel
                .channel_memfd(&super::channel_memfd_name(id), order.len)
                .and_then(|fd| Ok((fd.try_clone()?, fd)));
            let (client_copy, kept) = match created {
                Ok(fds) => fds,
                Err(e) => {
                    tracing::warn!(error = %e, len = order.len, "cannot create a stock memfd");
                    break;
                }
            };
            let view = Region::map_memfd(kept.as_fd(), order.len as usize)
                .inspect_err(|e| tracing::warn!(error = %e, id, "cannot map a stock region"))
                .ok();
            self.stock.insert(
                id,
                Stock {
                    view,
                    memfd: kept,
                    len: order.len,
                    client_pod: order.client_pod,
                    client_process: order.client_process,
                    client_ip: order.client_ip,
                    server_pod: order.server_pod,
                    dst: order.dst,
                    created: Instant::now(),
                    holders: Vec::new(),
                },
            );
            let grant = StockGrant {
                id,
                len: order.len,
                client: order.client_ip,
            };
            made.push((grant, client_copy));
        }
        tracing::debug!(made = made.len(), client = %order.client_ip, dst = %order.dst, "stock made");
        made
    }

    /// A `stocked` answer: the channel's fds (if any) first, then one per
    /// grant, in the grants' order.
    fn stocked(
        channel: Option<ChannelGrant>,
        channel_fds: Vec<OwnedFd>,
        grants: Vec<(StockGrant, OwnedFd)>,
    ) -> Answer {
        let (stock, grant_fds): (Vec<StockGrant>, Vec<OwnedFd>) = grants.into_iter().unzip();
        let mut fds = channel_fds;
        fds.extend(grant_fds);
        Answer {
            response: Response::Stocked { channel, stock },
            fds,
        }
    }

    /// `stock-claim`: the relayable claim, and the listener's stock the
    /// caller does not hold yet.
    pub(super) fn stock_claim(
        &mut self,
        caller: &Caller,
        local: SocketAddr,
        peer: SocketAddr,
    ) -> Answer {
        // Stock taken since the last tick is not granted again.
        self.open_taken_stock();
        let answer = self.claim_accepted(caller, local, peer);
        let channel = match answer.response {
            Response::Channel { id, len } => Some(ChannelGrant { id, len }),
            Response::NoChannel { .. } => None,
            // Refused: nothing is granted to a caller whose claim is.
            _ => return answer,
        };
        // A channel or none is answered only to the pod that owns `local`.
        let Some(pod) = caller.netns else {
            return answer;
        };
        if let Some(listener) = self.listener_key(pod, local) {
            self.takes_stock.insert(listener);
        }
        let grants = self.grant_stock(caller, pod, local, Some(peer));
        if grants.is_empty() {
            return answer;
        }
        if channel.is_none() {
            // Not a connection left on TCP: the server looks for the
            // connection's offer in the stock it was just granted (the
            // client used stock the server did not hold yet).
            self.counters
                .fallback_retracted(FallbackReason::ClaimWithoutIntent);
        }
        Self::stocked(channel, answer.fds, grants)
    }

    /// Grants the caller the stock of listener `local` of `pod` it does not
    /// hold yet, the stock made for `peer`'s pod first (a claim's peer; a
    /// fetch names none), and records it as a holder.
    ///
    /// The channel offered for a claim's own connection is granted even to
    /// a process recorded as holding it: the answer that carried it may be
    /// unread or lost (a request sent ahead whose connection broke), and
    /// without it the connection would stay on TCP. A duplicate costs the
    /// server one mapping, dropped once the channel reads taken.
    fn grant_stock(
        &mut self,
        caller: &Caller,
        pod: PodId,
        local: SocketAddr,
        peer: Option<SocketAddr>,
    ) -> Vec<(StockGrant, OwnedFd)> {
        // A holder is a process: an unidentified one would get the same
        // stock again at every claim.
        let Some(process) = caller.process else {
            return Vec::new();
        };
        let mut ids: Vec<(u8, bool, u64)> = self
            .stock
            .iter()
            .filter(|(_, s)| s.server_pod == pod && s.dst == local)
            .filter_map(|(id, s)| {
                let from_peer = peer.is_some_and(|p| self.pod_owns(s.client_pod, p.ip()));
                let rank = match s.view.as_ref().map(|v| v.offer()) {
                    Some(Offer::Offered(port))
                        if from_peer && peer.is_some_and(|p| p.port() == port) =>
                    {
                        0
                    }
                    _ if s.holders.contains(&process) => return None,
                    Some(Offer::Connecting { .. }) => 1,
                    _ => 2,
                };
                Some((rank, !from_peer, *id))
            })
            .collect();
        // The channel offered for this connection first, then those a
        // client is connecting with (with several client processes of one
        // pod, more than one answer's worth of stock may be new to this
        // process), then the peer's pod's.
        ids.sort_unstable();
        let mut grants = Vec::new();
        for (_, _, id) in ids.into_iter().take(MAX_STOCK_GRANTS) {
            let Some(s) = self.stock.get_mut(&id) else {
                continue;
            };
            match s.memfd.try_clone() {
                Ok(fd) => {
                    if s.holders.contains(&process) {
                        tracing::debug!(
                            id,
                            ?process,
                            "stock granted again: offered for the claim's connection"
                        );
                    } else {
                        s.holders.push(process);
                    }
                    let grant = StockGrant {
                        id,
                        len: s.len,
                        client: s.client_ip,
                    };
                    grants.push((grant, fd));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot duplicate a stock memfd");
                    break;
                }
            }
        }
        grants
    }

    /// `stock-taken` (one way): stock `channel_id` of the caller's pod's
    /// listener `local` carries the connection from `peer`. Anything else
    /// is refused (counted, logged; the answer is never sent).
    pub(super) fn stock_taken(
        &mut self,
        caller: &Caller,
        channel_id: u64,
        local: SocketAddr,
        peer: SocketAddr,
    ) -> Answer {
        let pod = match self.caller_pod(caller) {
            Ok(p) => p,
            Err(refused) => return refused,
        };
        // Seen taken in its offer word already (or reported closed).
        if self.stock_early.contains_key(&channel_id) || self.active.contains_key(&channel_id) {
            return self.take_early(caller, pod, channel_id, local, peer);
        }
        let fits = self.stock.get(&channel_id).is_some_and(|s| {
            s.server_pod == pod && s.dst == local && self.pod_owns(s.client_pod, peer.ip())
        });
        if !fits {
            return self.deny(
                ErrorCode::Forbidden,
                "not stock of this listener for that peer",
            );
        }
        let Some(s) = self.stock.remove(&channel_id) else {
            return Response::Ok.into();
        };
        self.open_stock(channel_id, s, caller.process, (peer, local));
        self.keep_listener_for(caller, pod, local);
        tracing::debug!(id = channel_id, client = %peer, server = %local, "stock taken");
        Response::Ok.into()
    }

    /// Stock `id` becomes an active connection, as a claim makes one:
    /// counted opened, its rings watched through the daemon's copy.
    fn open_stock(
        &mut self,
        id: u64,
        s: Stock,
        server_process: Option<ProcessId>,
        (client_addr, server_addr): (SocketAddr, SocketAddr),
    ) {
        self.counters.shm.opened += 1;
        self.active.insert(
            id,
            Active {
                id,
                client_pod: s.client_pod,
                server_pod: s.server_pod,
                client_addr,
                server_addr,
                len: s.len,
                opened: Instant::now(),
                client_process: Some(s.client_process),
                server_process,
                client_report: None,
                server_report: None,
                // The daemon's mapping when it has one: the ends of a
                // stock connection send no close report, and a mapping is
                // read at every tick without a system call.
                watch: Some(match s.view {
                    Some(view) => RingWatch::Mapped(view),
                    None => RingWatch::new(s.memfd),
                }),
                seen: Default::default(),
            },
        );
    }

    /// A close report from `pod` names stock `id` (an older library's
    /// client): when `pod` is the stock's client, the stock becomes active
    /// first (its server's `stock-taken` may still be on its way), so that
    /// the report counts.
    pub(super) fn open_stock_reported(&mut self, pod: PodId, id: u64) {
        if self.stock.get(&id).is_none_or(|s| s.client_pod != pod) {
            return;
        }
        self.open_untaken(id, true);
        tracing::debug!(id, "stock reported closed before it was taken");
    }

    /// Stock whose offer word says a server took it becomes an active
    /// connection: this is how the daemon learns of every stock
    /// connection (at each tick and before stats are read, so counters
    /// read after a connection find it). An older library's server also
    /// sends `stock-taken`, which then fills in its side.
    pub(super) fn open_taken_stock(&mut self) {
        let taken: Vec<u64> = self
            .stock
            .iter()
            .filter(|(_, s)| s.view.as_ref().is_some_and(|v| v.offer() == Offer::Taken))
            .map(|(id, _)| *id)
            .collect();
        for id in taken {
            self.open_untaken(id, false);
            tracing::debug!(id, "stock seen taken");
        }
    }

    /// Stock `id` becomes active without its server's word. `early`: on a
    /// close report, before any sign that a server took it (it is closed
    /// if no `stock-taken` follows within `intent_ttl`).
    fn open_untaken(&mut self, id: u64, early: bool) {
        let Some(s) = self.stock.remove(&id) else {
            return;
        };
        // What is known without the server's word: the client's address
        // (not its port), the listener address it named, and the server
        // process when only one holds the stock.
        let addrs = (SocketAddr::new(s.client_ip, 0), s.dst);
        let server = match s.holders.as_slice() {
            [only] => Some(*only),
            _ => None,
        };
        let created = s.created;
        self.open_stock(id, s, server, addrs);
        if let Some(c) = self.active.get_mut(&id) {
            // The connection is younger than its stock: the byte counts'
            // bound must not refuse what it carried before this report.
            c.opened = created;
        }
        if early {
            self.stock_early.insert(id, Instant::now());
        }
    }

    /// `stock-taken` for stock already active (seen taken in its offer
    /// word, or made active by a close report): fills in the server's
    /// side, checked as the stock would have been.
    fn take_early(
        &mut self,
        caller: &Caller,
        pod: PodId,
        id: u64,
        local: SocketAddr,
        peer: SocketAddr,
    ) -> Answer {
        // A connection seen taken names its server when one process held
        // the stock: another process cannot say it took it.
        let early = self.stock_early.contains_key(&id);
        let fits = self.active.get(&id).is_some_and(|c| {
            c.server_pod == pod
                && c.server_addr == local
                && self.pod_owns(c.client_pod, peer.ip())
                && (early || c.server_process.is_none() || c.server_process == caller.process)
        });
        if !fits {
            return self.deny(
                ErrorCode::Forbidden,
                "not stock of this listener for that peer",
            );
        }
        self.stock_early.remove(&id);
        if let Some(c) = self.active.get_mut(&id) {
            c.server_process = caller.process;
            c.client_addr = peer;
        }
        self.keep_listener_for(caller, pod, local);
        tracing::debug!(id, client = %peer, server = %local, "stock taken after its client's close report");
        Response::Ok.into()
    }

    /// An answer that could not be sent: the intent's channel and stock
    /// are dropped (the client never got them), a claim's grants stay
    /// stock that the caller does not hold.
    pub fn answer_undelivered(&mut self, caller: &Caller, made: Undelivered) {
        match made {
            Undelivered::Intent { channel, stock } => {
                if let Some(id) = channel {
                    self.intent_undelivered(id);
                }
                for id in stock {
                    self.drop_stock(id);
                }
            }
            Undelivered::Grants(ids) => {
                for id in ids {
                    if let Some(s) = self.stock.get_mut(&id) {
                        s.holders.retain(|p| Some(*p) != caller.process);
                    }
                }
            }
        }
    }

    /// Drops stock `id`, closing the daemon's copy, and revokes it in its
    /// offer word (free → dead), so that a client still holding it asks
    /// the daemon again instead of offering it to a server that no longer
    /// looks. Stock a server already took is opened instead.
    fn drop_stock(&mut self, id: u64) {
        let Some(view) = self.stock.get(&id).map(|s| s.view.clone()) else {
            return;
        };
        if view.as_ref().is_some_and(|v| v.offer() == Offer::Taken) {
            self.open_untaken(id, false);
            return;
        }
        if let Some(v) = view {
            v.offer_revoke();
        }
        self.stock.remove(&id);
        tracing::debug!(id, "stock dropped");
    }

    /// Drops the stock older than `stock_ttl`, and closes the connections
    /// a close report opened whose server never said it took them within
    /// `intent_ttl` (the time a claim has).
    pub(super) fn expire_stock(&mut self, now: Instant) {
        let ttl = self.limits.stock_ttl;
        let old: Vec<u64> = self
            .stock
            .iter()
            .filter(|(_, s)| now.saturating_duration_since(s.created) >= ttl)
            .map(|(id, _)| *id)
            .collect();
        for id in old {
            self.drop_stock(id);
        }
        let ttl = self.limits.intent_ttl;
        let untaken: Vec<u64> = self
            .stock_early
            .iter()
            .filter(|(_, since)| now.saturating_duration_since(**since) >= ttl)
            .map(|(id, _)| *id)
            .collect();
        for id in untaken {
            self.close_active(id);
        }
    }

    /// Drops the stock of client processes that are gone, and forgets
    /// holders that are (`alive`: the sweep's answers so far).
    pub(super) fn sweep_stock(&mut self, alive: &mut HashMap<ProcessId, bool>) {
        let kernel = &*self.kernel;
        let mut is_alive = |p: &ProcessId| *alive.entry(*p).or_insert_with(|| kernel.is_alive(p));
        let gone: Vec<u64> = self
            .stock
            .iter()
            .filter(|(_, s)| !is_alive(&s.client_process))
            .map(|(id, _)| *id)
            .collect();
        for s in self.stock.values_mut() {
            s.holders.retain(|p| is_alive(p));
        }
        if !gone.is_empty() {
            tracing::debug!(dropped = gone.len(), "stock of gone processes dropped");
        }
        for id in gone {
            self.drop_stock(id);
        }
    }

    /// Forgets stock of pods that left the registry.
    pub(super) fn forget_stock_of_gone_pods(&mut self) {
        let pods = &self.pods;
        let gone: Vec<u64> = self
            .stock
            .iter()
            .filter(|(_, s)| !pods.contains(s.client_pod) || !pods.contains(s.server_pod))
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.drop_stock(id);
        }
    }

    /// Forgets that a listener takes stock once it is gone, and drops (and
    /// revokes) its stock: a server that listens there next may run a
    /// library that never looks at stock, or none at all.
    pub(super) fn forget_gone_stock_takers(&mut self) {
        let listeners = &self.listeners;
        self.takes_stock.retain(|key| listeners.contains_key(key));
        let orphaned: Vec<u64> = self
            .stock
            .iter()
            .filter(|(_, s)| self.listener_key(s.server_pod, s.dst).is_none())
            .map(|(id, _)| *id)
            .collect();
        for id in orphaned {
            self.drop_stock(id);
        }
    }
}
