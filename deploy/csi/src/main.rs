//! `flowlane-csi`: the CSI node plugin, a container of flowlane's DaemonSet
//! (docs/deploy.md, "The CSI node plugin").

use std::path::PathBuf;

use clap::Parser;
use flowlane_csi::node::NodeDirs;
use flowlane_csi::serve::{self, Config};

#[derive(Parser)]
#[command(version, about = "flowlane's CSI node plugin (csi.flowlane.io)")]
struct Args {
    /// This node's name (the DaemonSet passes spec.nodeName).
    #[arg(long)]
    node_id: String,
    /// The kubelet's root directory (its --root-dir), spelt as the kubelet spells
    /// it and without symbolic links: targets must be under <this>/pods.
    #[arg(long, default_value = flowlane_defaults::KUBELET_DIR)]
    kubelet_dir: PathBuf,
    /// Where to bind the CSI endpoint
    /// (default <kubelet-dir>/plugins/csi.flowlane.io/csi.sock).
    #[arg(long)]
    endpoint: Option<PathBuf>,
    /// The endpoint as the kubelet sees it, when the container mounts it elsewhere.
    #[arg(long)]
    kubelet_endpoint: Option<String>,
    /// The registration directory the kubelet watches
    /// (default <kubelet-dir>/plugins_registry).
    #[arg(long)]
    registration_dir: Option<PathBuf>,
    /// The node's flowlane library directory, as this container sees it.
    #[arg(long, default_value = flowlane_defaults::HOST_LIB_DIR)]
    lib_dir: PathBuf,
    /// The daemon's socket directory, as this container sees it.
    #[arg(long, default_value = flowlane_defaults::RUN_DIR)]
    run_dir: PathBuf,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let a = Args::parse();
    let endpoint = a.endpoint.unwrap_or_else(|| {
        a.kubelet_dir
            .join("plugins")
            .join(flowlane_csi::DRIVER_NAME)
            .join("csi.sock")
    });
    let cfg = Config {
        node_id: a.node_id,
        kubelet_endpoint: a
            .kubelet_endpoint
            .unwrap_or_else(|| endpoint.display().to_string()),
        endpoint,
        registration_socket: a
            .registration_dir
            .unwrap_or_else(|| a.kubelet_dir.join("plugins_registry"))
            .join(serve::registration_socket_name()),
        dirs: NodeDirs {
            pods_dir: a.kubelet_dir.join("pods"),
            lib_dir: a.lib_dir,
            run_dir: a.run_dir,
        },
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(serve::run(cfg, stop_signal()))
}

/// SIGTERM (the kubelet stopping the container) or SIGINT.
async fn stop_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
