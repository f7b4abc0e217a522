//! `flowlane-webhook`: the mutating admission webhook that injects flowlane into pods
//! that opt in. See docs/deploy.md.

use anyhow::Context as _;
use clap::Parser;
use flowlane_webhook::{server, tls::CertFiles};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser)]
#[command(
    version,
    about = "flowlane pod injection webhook (AdmissionReview v1 over HTTPS)"
)]
struct Args {
    /// Address to listen on (port 0: any free port; the bound address is logged).
    #[arg(long, default_value = "0.0.0.0:8443")]
    listen: String,
    /// PEM certificate chain served to the API server.
    #[arg(long)]
    tls_cert: PathBuf,
    /// PEM private key of that certificate.
    #[arg(long)]
    tls_key: PathBuf,
    /// tracing filter; env FLOWLANE_LOG, else info.
    #[arg(long)]
    log_level: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let filter = args
        .log_level
        .clone()
        .or_else(|| std::env::var("FLOWLANE_LOG").ok())
        .unwrap_or_else(|| "info".into());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let certs = Arc::new(CertFiles::load(&args.tls_cert, &args.tls_key)?);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(&args.listen)
            .await
            .with_context(|| format!("cannot listen on {}", args.listen))?;
        tracing::info!(addr = %listener.local_addr()?, "flowlane-webhook listening");
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            r = server::serve(listener, certs) => r.context("accept failed")?,
            _ = term.recv() => tracing::info!("SIGTERM: stopping"),
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: stopping"),
        }
        Ok(())
    })
}
