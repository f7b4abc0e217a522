//! The serving certificate: PEM files given by flags, re-read when either file's contents
//! change, so a rotated Secret (cert-manager, webhook-certs.sh) is picked up without a
//! restart. A rotation that leaves a broken pair keeps serving the last good one.
//!
//! Change is detected by content, not by modification time: a file rewritten within
//! the filesystem's timestamp tick (a few ms) keeps its mtime, and a rotation right
//! after start-up was missed that way. The two files are a few KiB and read once per
//! connection, which an admission webhook's connection rate does not notice.

use anyhow::Context as _;
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tokio_rustls::rustls::{self, ServerConfig};

pub struct CertFiles {
    cert: PathBuf,
    key: PathBuf,
    current: Mutex<Current>,
}

struct Current {
    /// The files' contents last tried (good or not), so a broken pair is reported once.
    seen: Pems,
    config: Arc<ServerConfig>,
}

impl CertFiles {
    /// Loads the pair now: a webhook that cannot serve TLS should fail at start.
    pub fn load(cert: &Path, key: &Path) -> anyhow::Result<Self> {
        let pems = read_pems(cert, key)?;
        let config = server_config(cert, key, &pems)?;
        Ok(CertFiles {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            current: Mutex::new(Current { seen: pems, config }),
        })
    }

    /// The config for a new connection (the two files read once per connection).
    pub fn config(&self) -> Arc<ServerConfig> {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        // Unreadable mid-swap: keep what we have and look again next connection.
        if let Ok(now) = read_pems(&self.cert, &self.key) {
            if now != current.seen {
                match server_config(&self.cert, &self.key, &now) {
                    Ok(config) => {
                        tracing::info!(cert = %self.cert.display(), "serving certificate reloaded");
                        current.config = config;
                    }
                    Err(e) => {
                        tracing::warn!(error = %format!("{e:#}"), "keeping the previous certificate")
                    }
                }
                current.seen = now;
            }
        }
        current.config.clone()
    }
}

/// The certificate chain's and the key's PEM bytes, as read together.
type Pems = (Vec<u8>, Vec<u8>);

fn read_pems(cert: &Path, key: &Path) -> anyhow::Result<Pems> {
    let read = |p: &Path| std::fs::read(p).with_context(|| format!("cannot read {}", p.display()));
    Ok((read(cert)?, read(key)?))
}

fn server_config(
    cert: &Path,
    key: &Path,
    (cert_pem, key_pem): &Pems,
) -> anyhow::Result<Arc<ServerConfig>> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .map(|c| c.map(|c| c.into_owned()))
        .collect::<Result<_, _>>()
        .with_context(|| format!("bad PEM in {}", cert.display()))?;
    anyhow::ensure!(!chain.is_empty(), "no certificate in {}", cert.display());
    let key = PrivateKeyDer::from_pem_slice(key_pem)
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
