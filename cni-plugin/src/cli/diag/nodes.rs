//! The cross-node view from this node: which node this is in the node
//! table, whether every other node's pod CIDR routes to that node's
//! underlay address, and which nodes an RDMA lane can reach.

use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

use flowlane_nodes::{ClusterView, NodeDirectory, NodeViewFile, StaticNodeFile};
use flowlane_rdma_discovery::SelectedGid;

use super::cni_config::FlowlaneNet;
use super::netinfo::{self, Route};
use super::report::Section;

/// Where the node table comes from: `--nodes FILE` when given, else the
/// view the running daemon keeps (`<state-dir>/daemon/nodes.json`, written
/// after every refresh from its static table or the Kubernetes API), so a
/// Kubernetes node needs no table file for this check.
pub fn check(
    file: Option<&Path>,
    daemon_view: &Path,
    net: Option<&FlowlaneNet>,
    local_gid: Option<&SelectedGid>,
) -> Section {
    // The daemon's own node name, when its view says it: in chained mode
    // the pod subnet comes from another CNI's config, which diag does not
    // read.
    let mut self_name: Option<String> = None;
    let (mut s, view) = match file {
        Some(file) => {
            let mut s = Section::new("nodes", format!("Cluster nodes ({})", file.display()));
            match StaticNodeFile::new(file).view() {
                Ok(v) => (s, v),
                Err(e) => {
                    s.error(
                        "nodes.table_invalid",
                        format!("cannot use the node table: {e}"),
                        "rewrite it as {\"nodes\": [{\"name\", \"podCIDRs\", \"underlay\", \"rdma\"?}]} with one entry per node",
                    );
                    return s;
                }
            }
        }
        None => match daemon_table(daemon_view) {
            DaemonTable::Missing => {
                let mut s = Section::new("nodes", "Cluster nodes");
                s.info(
                    "nodes.no_table",
                    "no node table (--nodes FILE) and no view from the daemon (flowlaned without --nodes-file/--kubernetes): routes to other nodes' pods are not checked",
                );
                return s;
            }
            DaemonTable::Unusable(why) => {
                let mut s = Section::new("nodes", "Cluster nodes");
                s.warn(
                    "nodes.daemon_view_invalid",
                    format!(
                        "cannot read the daemon's node view {}: {why}",
                        daemon_view.display()
                    ),
                    "check flowlaned's log; pass --nodes FILE to check against a table instead",
                );
                return s;
            }
            DaemonTable::View {
                view,
                source,
                error,
                node,
            } => {
                self_name = node;
                let mut s = Section::new(
                    "nodes",
                    format!("Cluster nodes (flowlaned's view, from {source})"),
                );
                if let Some(e) = error {
                    s.warn(
                        "nodes.daemon_refresh_failed",
                        format!("the daemon's last refresh of the node table failed ({e}); this is its last good table"),
                        "check that the API server (or the node table file) is reachable and valid; flowlaned retries every round",
                    );
                }
                (s, view)
            }
        },
    };
    s.data = serde_json::to_value(view.nodes()).unwrap_or_default();
    // This node is the daemon's own, else the one whose pod CIDR holds our
    // pod subnet.
    let me = self_name
        .as_deref()
        .and_then(|name| view.nodes().iter().find(|n| n.name == name))
        .or_else(|| {
            net.and_then(|n| n.ranges.first())
                .and_then(|r| view.owner_of(r.subnet.network()))
        });
    match me {
        Some(me) => s.ok(
            "nodes.self",
            format!(
                "this node is {} of {} in the table (underlay {})",
                me.name,
                view.nodes().len(),
                me.underlay
            ),
        ),
        None => s.warn(
            "nodes.self_unknown",
            "this node's pod subnet is in no node's podCIDRs",
            "add this node to the table with the pod subnet of its CNI config",
        ),
    }
    let routes = netinfo::routes();
    for other in view
        .nodes()
        .iter()
        .filter(|n| Some(n.name.as_str()) != me.map(|m| m.name.as_str()))
    {
        for cidr in &other.pod_cidrs {
            match covering_route(&routes, cidr) {
                Some(r) if r.gateway == Some(other.underlay) => s.ok(
                    "nodes.route_ok",
                    format!(
                        "{} ({cidr}) routes via its underlay {} dev {}",
                        other.name, other.underlay, r.dev
                    ),
                ),
                Some(r) => s.warn(
                    "nodes.route_elsewhere",
                    format!(
                        "{} ({cidr}) routes via {} dev {}, not via its underlay {}",
                        other.name,
                        r.gateway
                            .map(|g| g.to_string())
                            .unwrap_or("a direct link".into()),
                        r.dev,
                        other.underlay
                    ),
                    format!("ip route replace {cidr} via {}", other.underlay),
                ),
                None => s.error(
                    "nodes.route_missing",
                    format!(
                        "no route to {}'s pods ({cidr}): pods here cannot reach pods there",
                        other.name
                    ),
                    format!("ip route add {cidr} via {}", other.underlay),
                ),
            }
        }
        let lane = match (me.and_then(|m| m.rdma.as_ref()), other.rdma.as_ref()) {
            (Some(a), Some(b)) if a.link_layer == b.link_layer => format!(
                "RDMA lane to {} ({}, its GID {} on {}/{})",
                other.name, b.link_layer, b.gid, b.device, b.port
            ),
            (Some(_), Some(_)) => format!(
                "{}: TCP (RoCE and InfiniBand cannot talk to each other)",
                other.name
            ),
            (None, Some(_)) => format!("{}: TCP (it has RDMA, this node does not)", other.name),
            (_, None) => format!("{}: TCP (no RDMA lane there)", other.name),
        };
        s.info("nodes.lane", lane);
    }
    // Does the table describe this node's RDMA as discovery sees it now?
    if let Some(me) = me {
        match (&me.rdma, local_gid) {
            (Some(t), Some(g)) if t.gid != g.gid || t.device != g.device => s.warn(
                "nodes.rdma_stale",
                format!(
                    "the table gives this node GID {} on {}, discovery selects {} on {}",
                    t.gid, t.device, g.gid, g.device
                ),
                "republish this node's RDMA lane (restart flowlaned, or rewrite the node table)",
            ),
            (Some(t), None) => s.warn(
                "nodes.rdma_stale",
                format!("the table gives this node an RDMA lane ({} on {}), but no GID is usable here now", t.gid, t.device),
                "fix the RDMA section's problem, or remove the lane from the table so peers use TCP",
            ),
            (None, Some(g)) => s.info(
                "nodes.rdma_unpublished",
                format!("this node has a usable GID ({} on {}) that the table does not publish", g.gid, g.device),
            ),
            _ => {}
        }
    }
    s
}

/// The most specific non-default route that covers all of `cidr`.
fn covering_route<'a>(routes: &'a [Route], cidr: &ipnetwork::IpNetwork) -> Option<&'a Route> {
    routes
        .iter()
        .filter(|r| {
            r.dst.prefix() > 0 && r.dst.prefix() <= cidr.prefix() && r.dst.contains(cidr.network())
        })
        .filter(|r| {
            matches!(
                (r.dst.ip(), cidr.ip()),
                (IpAddr::V4(_), IpAddr::V4(_)) | (IpAddr::V6(_), IpAddr::V6(_))
            )
        })
        .max_by_key(|r| r.dst.prefix())
}

enum DaemonTable {
    Missing,
    Unusable(String),
    View {
        view: Arc<ClusterView>,
        source: String,
        error: Option<String>,
        /// The daemon's own node name.
        node: Option<String>,
    },
}

/// The `nodes`, `source`, `error` and `node` fields of the daemon's view
/// file.
fn daemon_table(path: &Path) -> DaemonTable {
    let parsed = match NodeViewFile::read(path) {
        Ok(Some(v)) => v,
        Ok(None) => return DaemonTable::Missing,
        Err(e) => return DaemonTable::Unusable(e.to_string()),
    };
    match ClusterView::new(parsed.nodes) {
        Ok(view) => DaemonTable::View {
            view: Arc::new(view),
            source: if parsed.source.is_empty() {
                "its node table".into()
            } else {
                parsed.source
            },
            error: parsed.error,
            node: Some(parsed.node).filter(|n| !n.is_empty()),
        },
        Err(e) => DaemonTable::Unusable(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(dst: &str, gw: Option<&str>, dev: &str) -> Route {
        Route {
            dst: dst.parse().unwrap(),
            gateway: gw.map(|g| g.parse().unwrap()),
            dev: dev.into(),
        }
    }

    #[test]
    fn the_most_specific_non_default_covering_route_is_chosen() {
        let routes = vec![
            route("0.0.0.0/0", Some("192.0.2.1"), "eth0"),
            route("10.204.0.0/16", Some("10.209.0.1"), "eth1"),
            route("10.204.2.0/24", Some("10.209.0.12"), "eth1"),
            route("10.204.3.0/25", Some("10.209.0.13"), "eth1"),
            route("fd00::/8", None, "eth1"),
        ];
        let pick =
            |c: &str| covering_route(&routes, &c.parse().unwrap()).map(|r| r.dst.to_string());
        assert_eq!(pick("10.204.2.0/24").as_deref(), Some("10.204.2.0/24"));
        assert_eq!(pick("10.204.5.0/24").as_deref(), Some("10.204.0.0/16"));
        // Half a CIDR routed is not the CIDR routed.
        assert_eq!(pick("10.204.3.0/24").as_deref(), Some("10.204.0.0/16"));
        // The default route does not count, nor another family.
        assert_eq!(pick("10.99.0.0/24"), None);
        assert_eq!(pick("fd00:1::/64").as_deref(), Some("fd00::/8"));
    }
}
