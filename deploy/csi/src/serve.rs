//! The plugin's two Unix sockets: the CSI endpoint (Identity + Node) and the
//! registration socket in the kubelet's `plugins_registry` directory. Both are
//! the kubelet's alone (mode 0600, in root's directories).

use std::future::Future;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use tokio::net::UnixListener;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;

use crate::identity::IdentityService;
use crate::node::{NodeDirs, NodeService};
use crate::proto::csi::{identity_server::IdentityServer, node_server::NodeServer};
use crate::proto::registration::registration_server::RegistrationServer;
use crate::registration::RegistrationService;
use crate::MAX_REQUEST_BYTES;

/// How long a stopping plugin waits for requests in flight.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

#[derive(Debug, Clone)]
pub struct Config {
    /// The node's name (NodeGetInfo's node_id: the kubelet writes it into CSINode).
    pub node_id: String,
    pub dirs: NodeDirs,
    /// Where the plugin binds its CSI endpoint.
    pub endpoint: PathBuf,
    /// The endpoint as the kubelet names it (registration's PluginInfo.endpoint):
    /// the same path when the plugin's container mounts the node's
    /// `/var/lib/kubelet/plugins/csi.flowlane.io` at the same place.
    pub kubelet_endpoint: String,
    /// The registration socket: `<kubelet root>/plugins_registry/csi.flowlane.io-reg.sock`.
    pub registration_socket: PathBuf,
}

/// The registration socket's file name, the node-driver-registrar's convention.
pub fn registration_socket_name() -> String {
    format!("{}-reg.sock", crate::DRIVER_NAME)
}

/// Serves until `shutdown` completes (Ok) or the kubelet refuses the registration
/// (Err). Both socket files are removed on the way out, so the kubelet
/// deregisters the plugin.
pub async fn run(cfg: Config, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let csi = bind(&cfg.endpoint)?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let csi_server = Server::builder()
        .add_service(
            IdentityServer::new(IdentityService {
                lib_dir: cfg.dirs.lib_dir.clone(),
            })
            .max_decoding_message_size(MAX_REQUEST_BYTES),
        )
        .add_service(
            NodeServer::new(NodeService::new(cfg.node_id.clone(), cfg.dirs.clone()))
                .max_decoding_message_size(MAX_REQUEST_BYTES),
        )
        .serve_with_incoming_shutdown(UnixListenerStream::new(csi), stopped(stop_rx.clone()));
    let csi_task = tokio::spawn(csi_server);

    // Registration last: the kubelet calls the endpoint as soon as it registers.
    let reg = bind(&cfg.registration_socket)?;
    let (status_tx, mut status_rx) = mpsc::unbounded_channel();
    let reg_server = Server::builder()
        .add_service(
            RegistrationServer::new(RegistrationService {
                endpoint: cfg.kubelet_endpoint.clone(),
                status: status_tx,
            })
            .max_decoding_message_size(MAX_REQUEST_BYTES),
        )
        .serve_with_incoming_shutdown(UnixListenerStream::new(reg), stopped(stop_rx));
    let reg_task = tokio::spawn(reg_server);
    tracing::info!(
        endpoint = %cfg.endpoint.display(),
        registration = %cfg.registration_socket.display(),
        node = %cfg.node_id,
        "serving"
    );

    tokio::pin!(shutdown);
    let outcome = loop {
        tokio::select! {
            _ = &mut shutdown => break Ok(()),
            s = status_rx.recv() => match s {
                Some(s) if !s.plugin_registered => break Err(s.error),
                Some(_) => {}
                None => break Ok(()),
            },
        }
    };
    // Requests in flight get a moment; idle connections (the kubelet keeps its
    // own open) do not hold the exit.
    let _ = stop_tx.send(true);
    let both = async {
        let _ = csi_task.await;
        let _ = reg_task.await;
    };
    if tokio::time::timeout(SHUTDOWN_GRACE, both).await.is_err() {
        tracing::info!("connections still open after {SHUTDOWN_GRACE:?}: closing them");
    }
    for p in [&cfg.registration_socket, &cfg.endpoint] {
        let _ = std::fs::remove_file(p);
    }
    match outcome {
        Ok(()) => Ok(()),
        Err(e) => bail!("the kubelet refused the registration: {e}"),
    }
}

/// Binds a Unix socket at `path`, replacing a stale socket file (a previous run
/// that was killed) but nothing else.
fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)
            .with_context(|| format!("removing the stale socket {}", path.display()))?,
        Ok(_) => bail!("{} exists and is not a socket", path.display()),
        Err(_) => {}
    }
    let listener =
        UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("chmod {}", path.display()))?;
    Ok(listener)
}
