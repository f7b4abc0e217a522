//! The CSI Identity service: who the plugin is and whether it is ready.

use std::path::PathBuf;

use tonic::{Request, Response, Status};

use crate::proto::csi::{
    identity_server::Identity, GetPluginCapabilitiesRequest, GetPluginCapabilitiesResponse,
    GetPluginInfoRequest, GetPluginInfoResponse, ProbeRequest, ProbeResponse,
};

pub struct IdentityService {
    /// The node's library directory: the plugin is ready once the DaemonSet's
    /// install step has put the library there.
    pub lib_dir: PathBuf,
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: crate::DRIVER_NAME.into(),
            vendor_version: crate::VERSION.into(),
            manifest: Default::default(),
        }))
    }

    /// A node-only plugin: no CONTROLLER_SERVICE, no topology.
    async fn get_plugin_capabilities(
        &self,
        _: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        Ok(Response::new(GetPluginCapabilitiesResponse {
            capabilities: vec![],
        }))
    }

    async fn probe(&self, _: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        let ready = self.lib_dir.join("libflowlane_preload.so").is_file();
        Ok(Response::new(ProbeResponse { ready: Some(ready) }))
    }
}
