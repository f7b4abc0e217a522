//! Keeps the peer table (`flowlane_lane::peer_table`) current: the file
//! next to the daemon's socket that tells every pod's library which
//! destinations can be lane peers, so that a connection to anything else
//! stays on TCP without a daemon round trip (docs/shm-lane.md, "The peer
//! table").
//!
//! What it lists: every address of this node's pods (listener or not: a
//! listener registers moments before its first client, the table would
//! lag behind it), and, when this daemon's relay runs, the pod CIDRs of the
//! other nodes that offer a lane port; after them, the cluster's Service
//! CIDRs (`--service-cidr`), which the library asks about with a service
//! intent. Rewritten only when that changes.

use std::net::IpAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flowlane_lane::peer_table::{self, Entry, Mapped};
use flowlane_rdma::topology::ClusterView;

use crate::nodes::Nodes;
use crate::server::Shared;

/// How often the node view is looked at when it matters (the relay runs):
/// the view changes without telling anyone (the static file is reread by
/// its directory), pods come through [`pods_changed`].
const REFRESH: Duration = Duration::from_millis(100);

/// The table's entries: this node's pod addresses, and the pod CIDRs of the
/// other nodes with a lane when `relay` runs. Sorted, without duplicates.
pub fn entries(
    pod_ips: &[IpAddr],
    view: Option<&ClusterView>,
    me: &str,
    relay: bool,
) -> Vec<Entry> {
    let mut out: Vec<Entry> = pod_ips.iter().map(|ip| Entry::host(*ip)).collect();
    if let (true, Some(view)) = (relay, view) {
        for n in view.nodes() {
            if n.name == me || n.lane_port.is_none() {
                continue;
            }
            out.extend(
                n.pod_cidrs
                    .iter()
                    .map(|c| Entry::new(c.network(), c.prefix())),
            );
        }
    }
    out.sort();
    out.dedup();
    out
}

/// The published table, what it holds, and where the other nodes come from.
struct Publisher {
    map: Mapped,
    last: Option<Vec<Entry>>,
    /// The Service CIDRs (fixed for the daemon's life).
    services: Vec<Entry>,
    nodes: Option<Arc<Nodes>>,
    relay: bool,
}

impl Publisher {
    fn publish(&mut self, pod_ips: &[IpAddr]) {
        let view = self.nodes.as_ref().and_then(|n| n.current_view());
        let me = self.nodes.as_ref().map_or("", |n| n.node_name());
        let entries = entries(pod_ips, view.as_deref(), me, self.relay);
        if self.last.as_ref() == Some(&entries) {
            return;
        }
        self.map
            .table()
            .publish_with_services(&entries, &self.services);
        if entries.len() > peer_table::capacity(peer_table::FILE_LEN) {
            tracing::warn!(
                entries = entries.len(),
                "peer table full: destinations left out are asked about"
            );
        }
        tracing::debug!(entries = entries.len(), "peer table published");
        self.last = Some(entries);
    }
}

/// The daemon's one table (`None` until `start`, or when it cannot be
/// written).
static PUBLISHER: Mutex<Option<Publisher>> = Mutex::new(None);

/// The pod registry was reread: publish at once, before the plugin's poke
/// is answered, so a pod is listed by the time its ADD returns.
pub fn pods_changed(pod_ips: &[IpAddr]) {
    if let Some(p) = PUBLISHER.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        p.publish(pod_ips);
    }
}

/// Creates the table next to `socket`, publishes it once, and keeps it
/// current: pods through [`pods_changed`]; with the relay on, the other
/// nodes' CIDRs by looking at the node view every [`REFRESH`] and
/// recomputing only when it is another view. Without a table (it cannot be
/// written) every library asks the daemon, as before.
pub fn start(
    socket: &Path,
    shared: Shared,
    nodes: Option<Arc<Nodes>>,
    relay: bool,
    services: Vec<Entry>,
) {
    let path = peer_table::path_for(socket);
    let map = match Mapped::create(&path) {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot write the peer table; every connection asks the daemon");
            return;
        }
    };
    let watched = nodes.clone().filter(|_| relay);
    *PUBLISHER.lock().unwrap_or_else(|e| e.into_inner()) = Some(Publisher {
        map,
        last: None,
        services,
        nodes,
        relay,
    });
    // The broker's lock first, then the table's (as in `pods_changed`).
    let refresh = move || {
        let ips = shared.lock().pod_ips();
        pods_changed(&ips);
    };
    // The view the first table is computed from, or a later one.
    let mut seen = watched.as_ref().and_then(|n| n.current_view());
    refresh();
    tracing::info!(path = %path.display(), "peer table published");
    // Without the relay the table holds only this node's pods, which
    // `pods_changed` publishes: nothing to watch.
    let Some(nodes) = watched else { return };
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(REFRESH);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let view = nodes.current_view();
            let same = match (&seen, &view) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                (None, None) => true,
                _ => false,
            };
            if !same {
                seen = view;
                refresh();
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use flowlane_rdma::topology::NodeEntry;

    fn node(name: &str, cidr: &str, lane_port: Option<u16>) -> NodeEntry {
        NodeEntry {
            name: name.into(),
            pod_cidrs: vec![cidr.parse().unwrap()],
            underlay: "192.168.0.1".parse().unwrap(),
            rdma: None,
            lane_port,
        }
    }

    #[test]
    fn local_pods_and_the_cidrs_of_other_nodes_with_a_lane() {
        let view = ClusterView::new(vec![
            node("me", "10.1.0.0/24", Some(7000)),
            node("lane", "10.2.0.0/24", Some(7000)),
            node("nolane", "10.3.0.0/24", None),
        ])
        .unwrap();
        let ips: Vec<IpAddr> = vec!["10.1.0.5".parse().unwrap(), "10.1.0.5".parse().unwrap()];
        let e = entries(&ips, Some(&view), "me", true);
        assert_eq!(
            e,
            vec![
                Entry::host("10.1.0.5".parse().unwrap()),
                Entry::new("10.2.0.0".parse().unwrap(), 24),
            ]
        );
        // No relay here: no other node can be a peer.
        assert_eq!(
            entries(&ips, Some(&view), "me", false),
            vec![Entry::host("10.1.0.5".parse().unwrap())]
        );
    }
}
