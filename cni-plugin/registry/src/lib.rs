//! The node's pod registry: one small JSON file per CNI attachment.
//!
//! The CNI plugin writes an entry on ADD and removes it on DEL/GC; `flowlaned`
//! reads the directory to learn which pods (network namespaces, IPs) live on
//! this node. Every write is atomic (temporary file, rename), so a
//! reader never sees half an entry, and concurrent ADDs never contend: each
//! attachment has its own file.
//!
//! Layout: `<state_dir>/pods/<network>/<container_id>-<ifname>.json`.

use std::fs;
use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// One pod attachment: what the CNI plugin wired for a container on one network.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attachment {
    pub network: String,
    pub container_id: String,
    pub ifname: String,
    /// Network namespace path as the runtime gave it (`CNI_NETNS`).
    pub netns: String,
    /// Inode of the network namespace; this is how the daemon recognises a
    /// client process as this pod (`/proc/PID/ns/net`).
    pub netns_inode: u64,
    /// Addresses with prefix length, e.g. `10.22.0.5/24`, `fd00::5/64`.
    pub ips: Vec<String>,
    pub mac: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// Seconds since the Unix epoch when the attachment was recorded.
    pub created_unix: u64,
}

impl Attachment {
    /// The attachment's addresses without prefix length.
    pub fn addresses(&self) -> Vec<IpAddr> {
        self.ips
            .iter()
            .filter_map(|s| s.split('/').next()?.parse().ok())
            .collect()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("pod registry {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("pod registry entry {path}: {source}")]
    Corrupt {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("invalid registry key component {0:?}")]
    InvalidKey(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> RegistryError + '_ {
    move |source| RegistryError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A handle on the registry directory of one node.
#[derive(Debug, Clone)]
pub struct Registry {
    root: PathBuf,
}

impl Registry {
    /// The registry under `state_dir` (created lazily on first write).
    pub fn new(state_dir: impl AsRef<Path>) -> Self {
        Registry {
            root: state_dir.as_ref().join("pods"),
        }
    }

    /// The directory holding the entries (for watchers such as `flowlaned`).
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn entry_path(
        &self,
        network: &str,
        container_id: &str,
        ifname: &str,
    ) -> Result<PathBuf, RegistryError> {
        for part in [network, container_id, ifname] {
            if part.is_empty()
                || part.contains('/')
                || part.contains('\0')
                || part == "."
                || part == ".."
            {
                return Err(RegistryError::InvalidKey(part.to_string()));
            }
        }
        Ok(self
            .root
            .join(network)
            .join(format!("{container_id}-{ifname}.json")))
    }

    /// Records an attachment atomically, replacing any earlier entry.
    pub fn put(&self, a: &Attachment) -> Result<PathBuf, RegistryError> {
        let path = self.entry_path(&a.network, &a.container_id, &a.ifname)?;
        let dir = path.parent().expect("entry has a parent");
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let tmp = dir.join(format!(
            ".{}.{}.tmp",
            path.file_name().unwrap().to_string_lossy(),
            std::process::id()
        ));
        let body = serde_json::to_vec_pretty(a).expect("attachment serialises");
        // No fsync: the rename alone makes the entry atomic for readers, and
        // durability across a power loss is worthless here (the network
        // namespaces and veths an entry describes do not survive a reboot;
        // GC removes such entries). Two fsyncs cost milliseconds on every
        // pod start, on the CNI ADD hot path.
        let write = || -> std::io::Result<()> {
            let mut f = fs::File::create(&tmp)?;
            f.write_all(&body)?;
            drop(f);
            fs::rename(&tmp, &path)
        };
        if let Err(e) = write() {
            let _ = fs::remove_file(&tmp);
            return Err(io_err(&path)(e));
        }
        Ok(path)
    }

    /// Reads one entry, `Ok(None)` when it does not exist.
    pub fn get(
        &self,
        network: &str,
        container_id: &str,
        ifname: &str,
    ) -> Result<Option<Attachment>, RegistryError> {
        let path = self.entry_path(network, container_id, ifname)?;
        read_entry(&path)
    }

    /// Removes an entry. Removing a missing entry succeeds (DEL is idempotent).
    pub fn remove(
        &self,
        network: &str,
        container_id: &str,
        ifname: &str,
    ) -> Result<bool, RegistryError> {
        let path = self.entry_path(network, container_id, ifname)?;
        match fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io_err(&path)(e)),
        }
    }

    /// All entries of every network. Unreadable or corrupt files are skipped
    /// with a warning: one bad file must not hide the rest of the node.
    pub fn list(&self) -> Result<Vec<Attachment>, RegistryError> {
        let mut out = Vec::new();
        let networks = match fs::read_dir(&self.root) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(io_err(&self.root)(e)),
        };
        for net in networks.flatten() {
            if !net.path().is_dir() {
                continue;
            }
            let net_name = net.file_name().to_string_lossy().into_owned();
            out.extend(self.list_network(&net_name)?);
        }
        out.sort_by(|a, b| {
            (&a.network, &a.container_id, &a.ifname).cmp(&(&b.network, &b.container_id, &b.ifname))
        });
        Ok(out)
    }

    /// Entries of one network.
    pub fn list_network(&self, network: &str) -> Result<Vec<Attachment>, RegistryError> {
        let dir = self.root.join(network);
        let mut out = Vec::new();
        let entries = match fs::read_dir(&dir) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(io_err(&dir)(e)),
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with('.') || !name.ends_with(".json") {
                continue;
            }
            match read_entry(&path) {
                Ok(Some(a)) => out.push(a),
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "skipping unreadable registry entry"),
            }
        }
        Ok(out)
    }

    /// The attachment that owns `ip`, if any.
    pub fn find_by_ip(&self, ip: IpAddr) -> Result<Option<Attachment>, RegistryError> {
        Ok(self
            .list()?
            .into_iter()
            .find(|a| a.addresses().contains(&ip)))
    }
}

fn read_entry(path: &Path) -> Result<Option<Attachment>, RegistryError> {
    match fs::read(path) {
        Ok(bytes) => {
            serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|source| RegistryError::Corrupt {
                    path: path.to_path_buf(),
                    source,
                })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err(path)(e)),
    }
}

/// Seconds since the Unix epoch (for `Attachment::created_unix`).
pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(id: &str, ip: &str) -> Attachment {
        Attachment {
            network: "net1".into(),
            container_id: id.into(),
            ifname: "eth0".into(),
            netns: format!("/var/run/netns/{id}"),
            netns_inode: 4026532000,
            ips: vec![format!("{ip}/24")],
            mac: "02:00:00:00:00:01".into(),
            pod_namespace: Some("default".into()),
            pod_name: Some(id.into()),
            pod_uid: None,
            created_unix: now_unix(),
        }
    }

    fn tmpdir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "flowlane-registry-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn put_get_list_remove_roundtrip() {
        let dir = tmpdir();
        let reg = Registry::new(&dir);
        assert!(reg.list().unwrap().is_empty());
        let a = sample("c1", "10.1.0.2");
        let b = sample("c2", "10.1.0.3");
        reg.put(&a).unwrap();
        reg.put(&b).unwrap();
        assert_eq!(reg.get("net1", "c1", "eth0").unwrap(), Some(a.clone()));
        assert_eq!(reg.list().unwrap(), vec![a.clone(), b.clone()]);
        assert_eq!(
            reg.find_by_ip("10.1.0.3".parse().unwrap()).unwrap(),
            Some(b.clone())
        );
        assert!(reg.remove("net1", "c1", "eth0").unwrap());
        assert!(
            !reg.remove("net1", "c1", "eth0").unwrap(),
            "second remove is a no-op"
        );
        assert_eq!(reg.list().unwrap(), vec![b]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn corrupt_entries_are_skipped_and_keys_validated() {
        let dir = tmpdir();
        let reg = Registry::new(&dir);
        reg.put(&sample("good", "10.1.0.9")).unwrap();
        fs::write(reg.root().join("net1").join("bad-eth0.json"), b"{not json").unwrap();
        assert_eq!(reg.list().unwrap().len(), 1);
        assert!(matches!(
            reg.get("net1", "../x", "eth0"),
            Err(RegistryError::InvalidKey(_))
        ));
        fs::remove_dir_all(&dir).unwrap();
    }
}
