//! The Kubernetes implementation of [`NodeDirectory`]: the node table from
//! the API server's `Node` objects, read with kube-rs.
//!
//! - [`KubeNodeDirectory::connect`] lists the Nodes once (it fails when the
//!   API server cannot be read, so a misconfigured daemon says so at start)
//!   and keeps the snapshot; [`KubeNodeDirectory::spawn_refresh`] re-lists on
//!   an interval on the caller's tokio runtime and swaps in a new
//!   `Arc<ClusterView>`. [`NodeDirectory::view`] never touches the network.
//! - [`publish_rdma_lane`] writes this node's lane into the annotation
//!   [`RDMA_ANNOTATION`] of its own Node (a JSON merge patch), which is
//!   where every other node's directory reads it from.
//!
//! ## Why a periodic re-list rather than a watch
//!
//! Node objects change rarely (a node joins, gets its pod CIDR, its daemon
//! publishes its lane) and a stale entry costs only a slower lane: the
//! daemon falls back to TCP for a peer it does not know yet. A re-list is
//! one request, always converges, and has no resume/bookmark/relist-on-410
//! state machine to get wrong; it needs only kube's client, not
//! `kube-runtime`, which keeps the build smaller. The list is sent with
//! `resourceVersion=0`, so the API server answers from its watch cache
//! instead of etcd. At thousands of nodes a reflector (kube-runtime
//! `watcher`) would be the better trade, and it fits behind the same trait.

use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::{ListParams, Patch, PatchParams};
use kube::Api;

use super::node_object::{node_entry, PublishedLane, RDMA_ANNOTATION};
use super::{ClusterView, NodeDirectory, RdmaLane, TopologyError};

pub use kube::Client;

/// A client configured from the environment, as `kubectl` and client-go
/// do: `KUBECONFIG` (or `~/.kube/config`) when there is one, else the
/// pod's in-cluster service account (`KUBERNETES_SERVICE_HOST` + the
/// mounted token and CA).
pub async fn client_from_environment() -> Result<Client, TopologyError> {
    Client::try_default().await.map_err(|e| {
        TopologyError::Kubernetes(format!(
            "no Kubernetes client configuration (KUBECONFIG, or the in-cluster service account): {e}"
        ))
    })
}

/// Field manager recorded by the API server for our annotation patches.
pub const FIELD_MANAGER: &str = "flowlaned";

/// Turns a kube-rs error into ours: the API server's own message and code
/// (kube's `Display` repeats it in `Debug` form), plus a hint for the usual
/// RBAC gap.
fn api_error(what: &str, e: kube::Error) -> TopologyError {
    match &e {
        kube::Error::Api(r) => {
            let hint = if r.code == 403 {
                "; the daemon's service account needs RBAC list on nodes and patch on its own node"
            } else {
                ""
            };
            TopologyError::Kubernetes(format!(
                "{what}: {} ({} {}){hint}",
                r.message, r.code, r.reason
            ))
        }
        _ => TopologyError::Kubernetes(format!("{what}: {}", with_causes(&e))),
    }
}

/// An error and its sources, `a: b: c`: kube's transport errors say only
/// "client error (Connect)" at the top, the reason (refused, certificate
/// not trusted, DNS) is further down the chain.
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let s = c.to_string();
        if !out.contains(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        cur = c.source();
    }
    out
}

/// Lists all Nodes and builds the node table (one request).
pub async fn list_cluster_view(client: &Client) -> Result<ClusterView, TopologyError> {
    let nodes: Api<Node> = Api::all(client.clone());
    let list = nodes
        .list(&ListParams::default().match_any())
        .await
        .map_err(|e| api_error("listing nodes", e))?;
    let mut entries = Vec::with_capacity(list.items.len());
    for node in &list.items {
        let value = serde_json::to_value(node)
            .map_err(|e| TopologyError::Kubernetes(format!("re-encoding a Node object: {e}")))?;
        entries.extend(node_entry(&value)?);
    }
    ClusterView::new(entries)
}

/// Publishes this node's RDMA lane and the port its daemon accepts lane
/// streams on (`lane_port`), or the lane's absence (`None`, which removes
/// the annotation: without RDMA there is no lane to offer, whatever the
/// port), on its own Node object.
pub async fn publish_rdma_lane(
    client: &Client,
    node_name: &str,
    lane: Option<&RdmaLane>,
    lane_port: Option<u16>,
) -> Result<(), TopologyError> {
    let value = match lane {
        Some(l) => serde_json::Value::String(
            PublishedLane {
                rdma: l.clone(),
                lane_port,
            }
            .to_annotation(),
        ),
        None => serde_json::Value::Null,
    };
    let patch = serde_json::json!({ "metadata": { "annotations": { RDMA_ANNOTATION: value } } });
    let nodes: Api<Node> = Api::all(client.clone());
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PatchParams::default()
    };
    nodes
        .patch(node_name, &params, &Patch::Merge(&patch))
        .await
        .map_err(|e| api_error(&format!("publishing the RDMA lane on node {node_name}"), e))?;
    Ok(())
}

/// The node table kept from the API server.
pub struct KubeNodeDirectory {
    client: Client,
    snapshot: RwLock<Arc<ClusterView>>,
}

impl KubeNodeDirectory {
    /// Lists the Nodes once; an unreachable or forbidden API is an error.
    pub async fn connect(client: Client) -> Result<Arc<Self>, TopologyError> {
        let view = list_cluster_view(&client).await?;
        Ok(Arc::new(KubeNodeDirectory {
            client,
            snapshot: RwLock::new(Arc::new(view)),
        }))
    }

    /// A directory with an empty node table, filled by the first successful
    /// [`KubeNodeDirectory::refresh`]. For a daemon that must start (and
    /// serve its node's pods) even while the API server is unreachable.
    pub fn unlisted(client: Client) -> Arc<Self> {
        Arc::new(KubeNodeDirectory {
            client,
            snapshot: RwLock::new(Arc::new(ClusterView::default())),
        })
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Re-lists now and swaps the snapshot. On error the old snapshot stays.
    pub async fn refresh(&self) -> Result<Arc<ClusterView>, TopologyError> {
        let view = Arc::new(list_cluster_view(&self.client).await?);
        *self.snapshot.write().unwrap_or_else(|p| p.into_inner()) = view.clone();
        Ok(view)
    }

    /// Re-lists every `every` until the directory is dropped. Failures are
    /// logged and the last good snapshot is kept (a flaky API server must
    /// not make every peer look unknown).
    pub fn spawn_refresh(self: &Arc<Self>, every: Duration) -> tokio::task::JoinHandle<()> {
        let weak: Weak<Self> = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(dir) = weak.upgrade() else { return };
                match dir.refresh().await {
                    Ok(v) => tracing::debug!(nodes = v.nodes().len(), "node table refreshed"),
                    Err(e) => {
                        tracing::warn!(error = %e, "node table refresh failed; keeping the last one")
                    }
                }
            }
        })
    }
}

impl NodeDirectory for KubeNodeDirectory {
    fn view(&self) -> Result<Arc<ClusterView>, TopologyError> {
        Ok(self
            .snapshot
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone())
    }
}
