//! The flowlane listeners per pod: registration, the lookup an intent makes
//! (dual-stack and wildcard addresses), pruning of dead processes, and the
//! listener file that outlives a restart.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use flowlane_lane::proto::{ErrorCode, Response};

use super::{canonical, Answer, Broker, Caller};
use crate::identity::ProcessId;
use crate::listener_store::ListenerRecord;
use crate::pods::PodId;

/// A freshly registered listener is kept this long without checking that
/// its socket listens (the library registers it just before `listen()`).
pub(super) const LISTENER_GRACE: Duration = Duration::from_secs(5);

impl Broker {
    pub(super) fn register_listener(&mut self, caller: &Caller, addr: SocketAddr) -> Answer {
        let pod = match self.caller_pod(caller) {
            Ok(p) => p,
            Err(a) => return a,
        };
        if addr.port() == 0 {
            return Response::error(ErrorCode::BadRequest, "listener port 0").into();
        }
        if !addr.ip().is_unspecified() && !self.pod_owns(pod, addr.ip()) {
            return self.deny(
                ErrorCode::Forbidden,
                format!("{} is not an address of the calling pod", addr.ip()),
            );
        }
        let Some(process) = caller.process else {
            return self.deny(ErrorCode::UnknownPod, "cannot identify the calling process");
        };
        self.add_listener(pod, addr, process);
        self.save_listeners();
        tracing::debug!(pod = %self.pods.name_of(pod), %addr, "listener registered");
        Response::Ok.into()
    }

    pub(super) fn add_listener(&mut self, pod: PodId, addr: SocketAddr, process: ProcessId) {
        let procs = self.listeners.entry((pod, addr)).or_default();
        if !procs.contains(&process) {
            procs.push(process);
        }
        self.listener_since.insert((pod, addr), Instant::now());
    }

    pub(super) fn unregister_listener(&mut self, caller: &Caller, addr: SocketAddr) -> Answer {
        let pod = match self.caller_pod(caller) {
            Ok(p) => p,
            Err(a) => return a,
        };
        if let Some(procs) = self.listeners.get_mut(&(pod, addr)) {
            // Only the caller's own registration goes; another process of
            // the pod (e.g. a forked worker) may still listen.
            procs.retain(|p| Some(*p) != caller.process);
            if procs.is_empty() {
                self.listeners.remove(&(pod, addr));
                self.forget_gone_stock_takers();
            }
            self.save_listeners();
        }
        Response::Ok.into()
    }

    /// The claimer accepts on the listener: it keeps the listener alive
    /// even when the process that called listen() exits (pre-fork servers
    /// whose parent leaves).
    pub(super) fn keep_listener_for(&mut self, caller: &Caller, pod: PodId, local: SocketAddr) {
        if let (Some(process), Some(key)) = (caller.process, self.listener_key(pod, local)) {
            let procs = self.listeners.entry(key).or_default();
            if !procs.contains(&process) {
                procs.push(process);
                self.save_listeners();
            }
        }
    }

    /// Addresses a listener accepting `dst` may be registered on.
    fn listener_candidates(dst: SocketAddr) -> impl Iterator<Item = SocketAddr> {
        let port = dst.port();
        [
            dst,
            SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port),
            // A dual-stack `::` socket also accepts IPv4.
            SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port),
        ]
        .into_iter()
        .filter(move |a| !(a.is_ipv4() && dst.is_ipv6()))
    }

    /// The registered listener of `pod` that accepts `dst`, if any.
    pub(super) fn listener_key(&self, pod: PodId, dst: SocketAddr) -> Option<(PodId, SocketAddr)> {
        Self::listener_candidates(dst)
            .map(|a| (pod, a))
            .find(|k| self.listeners.contains_key(k))
    }

    /// True when `pod` has a live flowlane listener accepting `dst`.
    pub(super) fn has_listener(&mut self, pod: PodId, dst: SocketAddr) -> bool {
        let mut found = false;
        let mut pruned = false;
        for addr in Self::listener_candidates(dst) {
            if let Some(procs) = self.listeners.get_mut(&(pod, addr)) {
                let before = procs.len();
                procs.retain(|p| self.kernel.is_alive(p));
                pruned |= procs.len() != before;
                if procs.is_empty() {
                    self.listeners.remove(&(pod, addr));
                } else {
                    found = true;
                    break;
                }
            }
        }
        if pruned {
            self.forget_gone_stock_takers();
            self.save_listeners();
        }
        found
    }

    /// True when `dst` is a pod of this node with a live flowlane listener
    /// accepting it (the relay's server side asks before it registers a
    /// stream, so clients of pods without the library stay on TCP at once).
    pub fn has_flowlane_listener(&mut self, dst: SocketAddr) -> bool {
        let dst = canonical(dst);
        let Some(pod) = self.local_pod_of(dst.ip()) else {
            return false;
        };
        let found = self.has_listener(pod, dst);
        if !found {
            let mine: Vec<SocketAddr> = self
                .listeners
                .keys()
                .filter(|(p, _)| *p == pod)
                .map(|(_, a)| *a)
                .collect();
            tracing::debug!(%dst, pod, listeners = ?mine, "no flowlane listener for a relayed stream");
        }
        found
    }

    pub(super) fn save_listeners(&self) {
        let records: Vec<ListenerRecord> = self
            .listeners
            .iter()
            .flat_map(|((pod, addr), procs)| {
                procs.iter().map(|process| ListenerRecord {
                    pod: *pod,
                    addr: *addr,
                    process: *process,
                })
            })
            .collect();
        if let Err(e) = self.kernel.save_listeners(&records) {
            tracing::warn!(error = %e, "cannot save the listener table");
        }
    }
}
