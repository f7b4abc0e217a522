//! Periodic upkeep (`tick`): expiry of unclaimed channels and of stock, and
//! a sweep of connections, stock and listeners whose processes or sockets
//! are gone.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use flowlane_lane::proto::FallbackReason;

use super::channels::IntentKey;
use super::listeners::LISTENER_GRACE;
use super::{Broker, Kernel};
use crate::identity::ProcessId;

impl Broker {
    /// Periodic upkeep: expires unclaimed channels and stock, closes
    /// connections whose processes are all gone, drops stock of dead
    /// clients, forgets listeners of dead processes.
    pub fn tick(&mut self, now: Instant) {
        let ttl = self.limits.intent_ttl;
        let expired: Vec<IntentKey> = self
            .pending
            .values()
            .filter(|p| now.saturating_duration_since(p.created) >= ttl)
            .map(|p| p.key)
            .collect();
        for key in expired {
            self.drop_pending(key, FallbackReason::IntentExpired);
        }
        self.refresh_connections();
        self.expire_stock(now);
        // The sweep below reads /proc and the rings of every connection:
        // at most every SWEEP_EVERY, and each process's liveness once.
        const SWEEP_EVERY: Duration = Duration::from_secs(2);
        if self
            .last_sweep
            .is_some_and(|t| now.saturating_duration_since(t) < SWEEP_EVERY)
        {
            return;
        }
        self.last_sweep = Some(now);
        let mut alive: HashMap<ProcessId, bool> = HashMap::new();
        self.sweep_stock(&mut alive);
        let mut is_alive = |kernel: &dyn Kernel, p: &ProcessId| {
            *alive.entry(*p).or_insert_with(|| kernel.is_alive(p))
        };
        let kernel = &*self.kernel;
        let dead: Vec<u64> = self
            .active
            .values()
            .filter(|c| {
                let mut gone = |p: Option<ProcessId>| p.is_none_or(|p| !is_alive(kernel, &p));
                c.progress().both_closed || (gone(c.client_process) && gone(c.server_process))
            })
            .map(|c| c.id)
            .collect();
        for id in dead {
            self.close_active(id);
        }
        // Inherited connections whose processes are all gone will not
        // report any more.
        let kernel = &*self.kernel;
        self.inherited.retain(|_, r| {
            let mut gone = |p: Option<ProcessId>| p.is_none_or(|p| !is_alive(kernel, &p));
            !(gone(r.client_process) && gone(r.server_process))
        });
        let before: usize = self.listeners.values().map(Vec::len).sum();
        for procs in self.listeners.values_mut() {
            procs.retain(|p| is_alive(kernel, p));
        }
        let since = &self.listener_since;
        self.listeners.retain(|key, procs| {
            // The library registers a listener just BEFORE its real
            // listen(): a socket that is not listening yet is not gone.
            let young = since
                .get(key)
                .is_some_and(|t| now.saturating_duration_since(*t) < LISTENER_GRACE);
            // The pod's namespace must still have the listening socket
            // (checked through a process of it; unreadable = keep).
            !procs.is_empty()
                && (young
                    || procs
                        .first()
                        .is_some_and(|p| kernel.listens_on(p.pid, key.1.port()).unwrap_or(true)))
        });
        let listeners = &self.listeners;
        self.listener_since
            .retain(|key, _| listeners.contains_key(key));
        self.forget_gone_stock_takers();
        let after: usize = self.listeners.values().map(Vec::len).sum();
        if before != after {
            self.save_listeners();
        }
    }
}
