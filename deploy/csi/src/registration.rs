//! The kubelet's plugin registration (pluginregistration v1): the kubelet's plugin
//! watcher sees the socket appear in its `plugins_registry` directory, asks
//! GetInfo, validates the answer and says how it went with
//! NotifyRegistrationStatus. A refused registration ends the plugin (the
//! container restarts and the socket is made anew, which is how the kubelet
//! retries), as the node-driver-registrar does.

use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

use crate::proto::registration::{
    registration_server::Registration, InfoRequest, PluginInfo, RegistrationStatus,
    RegistrationStatusResponse,
};

/// What the plugin registration reports: `CSIPlugin`.
pub const PLUGIN_TYPE: &str = "CSIPlugin";

pub struct RegistrationService {
    /// The CSI endpoint as the kubelet sees it (a path on the node).
    pub endpoint: String,
    /// Where the verdicts go ([`crate::serve`] ends on a refusal).
    pub status: mpsc::UnboundedSender<RegistrationStatus>,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: PLUGIN_TYPE.into(),
            name: crate::DRIVER_NAME.into(),
            endpoint: self.endpoint.clone(),
            supported_versions: crate::SUPPORTED_VERSIONS
                .iter()
                .map(|v| v.to_string())
                .collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        req: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let mut s = req.into_inner();
        // The kubelet's text, bounded before it reaches a log line.
        s.error.truncate(s.error.floor_char_boundary_compat(1024));
        if s.plugin_registered {
            tracing::info!("registered with the kubelet");
        } else {
            tracing::error!(error = %s.error, "the kubelet refused the registration");
        }
        let _ = self.status.send(s);
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// `str::floor_char_boundary` is newer than the workspace's rust-version.
trait FloorCharBoundary {
    fn floor_char_boundary_compat(&self, i: usize) -> usize;
}

impl FloorCharBoundary for String {
    fn floor_char_boundary_compat(&self, i: usize) -> usize {
        (0..=i.min(self.len()))
            .rev()
            .find(|&j| self.is_char_boundary(j))
            .unwrap_or(0)
    }
}
