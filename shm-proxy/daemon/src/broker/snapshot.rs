//! The broker's part of a stats answer: the same-node lane, its
//! connections, the listeners and the counters (`stats.rs` asks the other
//! parts of the daemon for theirs).

use std::collections::BTreeMap;
use std::time::Instant;

use flowlane_lane::proto::{
    ConnectionInfo, DaemonInfo, Endpoint, LaneStats, ListenerInfo, Stats, PROTOCOL_VERSION,
};

use super::{Broker, SHM_LANE};

impl Broker {
    /// The broker's part of a stats snapshot: the same-node lane, its
    /// connections, listeners, pods and counters (`stats.rs` adds the
    /// other lanes and the cross-node view).
    pub fn stats(&self) -> Stats {
        let now = Instant::now();
        let mut lanes = BTreeMap::new();
        let [c2s, s2c] = self
            .active
            .values()
            .fold(self.counters.shm.bytes, |[a, b], c| {
                let (x, y) = c.bytes();
                [a.saturating_add(x), b.saturating_add(y)]
            });
        lanes.insert(
            SHM_LANE.to_string(),
            LaneStats {
                connections_opened: self.counters.shm.opened,
                connections_active: self.active.len() as u64,
                connections_closed: self.counters.shm.closed,
                bytes: c2s.saturating_add(s2c),
                channels_pending: self.pending.len() as u64,
                bytes_client_to_server: c2s,
                bytes_server_to_client: s2c,
                channels_stocked: self.stock.len() as u64,
            },
        );
        let connections: Vec<ConnectionInfo> = self
            .active
            .values()
            .map(|c| {
                let (c2s, s2c) = c.bytes();
                ConnectionInfo {
                    id: c.id,
                    lane: SHM_LANE.to_string(),
                    client: Endpoint {
                        pod: self.pods.name_of(c.client_pod),
                        addr: c.client_addr,
                    },
                    server: Endpoint {
                        pod: self.pods.name_of(c.server_pod),
                        addr: c.server_addr,
                    },
                    region_len: c.len,
                    bytes_client_to_server: c2s,
                    bytes_server_to_client: s2c,
                    age_secs: now.saturating_duration_since(c.opened).as_secs(),
                }
            })
            .collect();
        let listeners = self
            .listeners
            .iter()
            .map(|((pod, addr), procs)| ListenerInfo {
                pod: self.pods.name_of(*pod),
                addr: *addr,
                processes: procs.len() as u32,
            })
            .collect();
        Stats {
            daemon: DaemonInfo {
                version: env!("CARGO_PKG_VERSION").to_string(),
                protocol: PROTOCOL_VERSION,
                pid: std::process::id(),
                uptime_secs: self.started.elapsed().as_secs(),
                state_dir: self.facts.state_dir.display().to_string(),
                socket: self.facts.socket.display().to_string(),
                pods: self.pods.len() as u64,
                registry_reloads: self.counters.registry_reloads,
            },
            lanes,
            fallbacks: self
                .counters
                .fallbacks
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect(),
            auth_failures: self.counters.auth_failures,
            channel_setup: self.counters.channel_setup.clone(),
            request_handling: self.counters.request_handling.clone(),
            bad_requests: self.counters.bad_requests,
            connections_refused: self.counters.connections_refused,
            requests: self
                .counters
                .requests
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect(),
            connections,
            listeners,
            // The other parts' (stats.rs).
            nodes: None,
            lane_errors: BTreeMap::new(),
            relay_memory: None,
            processes: None,
            injections: self
                .injections
                .list(|pod| self.pods.get(pod).map(|p| p.name.clone())),
        }
    }
}
