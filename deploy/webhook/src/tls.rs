//! The serving certificate: PEM files given by flags, re-read when the certificate file
//! changes, so a rotated Secret (cert-manager, webhook-certs.sh) is picked up without a
//! restart. A rotation that leaves a broken pair keeps serving the last good one.

use anyhow::Context as _;
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;
use tokio_rustls::rustls::{self, ServerConfig};

pub struct CertFiles {
    cert: PathBuf,
    key: PathBuf,
    current: Mutex<(Option<SystemTime>, Arc<ServerConfig>)>,
}

impl CertFiles {
    /// Loads the pair now: a webhook that cannot serve TLS should fail at start.
    pub fn load(cert: &Path, key: &Path) -> anyhow::Result<Self> {
        let config = server_config(cert, key)?;
        Ok(CertFiles {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            current: Mutex::new((modified(cert), config)),
        })
    }

    /// The config for a new connection (one stat per connection).
    pub fn config(&self) -> Arc<ServerConfig> {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        let now = modified(&self.cert);
        if now != current.0 {
            match server_config(&self.cert, &self.key) {
                Ok(config) => {
                    tracing::info!(cert = %self.cert.display(), "serving certificate reloaded");
                    *current = (now, config);
                }
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), "keeping the previous certificate")
                }
            }
        }
        current.1.clone()
    }
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

fn server_config(cert: &Path, key: &Path) -> anyhow::Result<Arc<ServerConfig>> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .with_context(|| format!("cannot read certificate {}", cert.display()))?
        .collect::<Result<_, _>>()
        .with_context(|| format!("bad PEM in {}", cert.display()))?;
    anyhow::ensure!(!chain.is_empty(), "no certificate in {}", cert.display());
    let key = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("cannot read a private key from {}", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .context("certificate and key do not form a usable pair")?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
