//! The CSI Node service: publish and unpublish flowlane's two node directories.
//! No staging, no stats, no expansion: the kubelet learns that from
//! NodeGetCapabilities, and the generated default stubs answer UNIMPLEMENTED to
//! the rest.

use std::path::PathBuf;

use tokio::sync::Mutex;
use tonic::{Request, Response, Status};

use crate::mounts::{self, MountError, Published};
use crate::proto::csi::{
    node_server::Node, NodeGetCapabilitiesRequest, NodeGetCapabilitiesResponse, NodeGetInfoRequest,
    NodeGetInfoResponse, NodePublishVolumeRequest, NodePublishVolumeResponse,
    NodeUnpublishVolumeRequest, NodeUnpublishVolumeResponse,
};
use crate::request::{self, Content};

/// Where the plugin finds things on the node (as its own mount namespace sees them).
#[derive(Debug, Clone)]
pub struct NodeDirs {
    /// The kubelet's pods directory (`<kubelet root>/pods`): every target is under it.
    pub pods_dir: PathBuf,
    /// The node's flowlane library directory (`/opt/flowlane/lib` on the node).
    pub lib_dir: PathBuf,
    /// The daemon's socket directory (`/run/flowlane` on the node).
    pub run_dir: PathBuf,
}

pub struct NodeService {
    pub node_id: String,
    pub dirs: NodeDirs,
    /// One publish or unpublish at a time: each is a few system calls, and two
    /// racing calls for one target could otherwise stack two mounts.
    pub busy: Mutex<()>,
}

impl NodeService {
    pub fn new(node_id: String, dirs: NodeDirs) -> NodeService {
        NodeService {
            node_id,
            dirs,
            busy: Mutex::new(()),
        }
    }
}

fn status(e: MountError) -> Status {
    match e {
        MountError::Conflict(m) => Status::already_exists(m),
        MountError::Precondition(m) => Status::failed_precondition(m),
        e @ MountError::Io { .. } => Status::internal(e.to_string()),
    }
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_publish_volume(
        &self,
        req: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        let p = request::publish(req.get_ref(), &self.dirs.pods_dir).map_err(|e| {
            tracing::warn!(error = %e, "NodePublishVolume refused");
            Status::invalid_argument(e.0)
        })?;
        let (source, exec) = match p.content {
            // The probe runs from there and the library is mapped executable.
            Content::Lib => (&self.dirs.lib_dir, true),
            Content::Run => (&self.dirs.run_dir, false),
        };
        let _busy = self.busy.lock().await;
        let done = mounts::publish(source, &p.target, exec).map_err(|e| {
            tracing::warn!(volume = %p.volume_id, path = %p.target.display(), error = %e, "NodePublishVolume failed");
            status(e)
        })?;
        tracing::info!(
            volume = %p.volume_id,
            content = p.content.name(),
            path = %p.target.display(),
            already = done == Published::AlreadyThere,
            "published"
        );
        Ok(Response::new(NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        req: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let u = request::unpublish(req.get_ref(), &self.dirs.pods_dir).map_err(|e| {
            tracing::warn!(error = %e, "NodeUnpublishVolume refused");
            Status::invalid_argument(e.0)
        })?;
        let _busy = self.busy.lock().await;
        mounts::unpublish(&u.target).map_err(|e| {
            tracing::warn!(volume = %u.volume_id, path = %u.target.display(), error = %e, "NodeUnpublishVolume failed");
            status(e)
        })?;
        tracing::info!(volume = %u.volume_id, path = %u.target.display(), "unpublished");
        Ok(Response::new(NodeUnpublishVolumeResponse {}))
    }

    /// No capability: no STAGE_UNSTAGE_VOLUME (so the kubelet publishes directly),
    /// no GET_VOLUME_STATS, no VOLUME_MOUNT_GROUP (the kubelet applies no fsGroup;
    /// the CSIDriver says fsGroupPolicy None as well).
    async fn node_get_capabilities(
        &self,
        _: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        Ok(Response::new(NodeGetCapabilitiesResponse {
            capabilities: vec![],
        }))
    }

    async fn node_get_info(
        &self,
        _: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        Ok(Response::new(NodeGetInfoResponse {
            node_id: self.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: None,
        }))
    }
}
