//! What the broker asks of the kernel and of the node's files, behind one
//! trait (the seam youki's `Syscall` is for a runtime): the broker's logic
//! runs against `RealKernel` in the daemon and against a faithful double in
//! its unit tests (`fake_kernel.rs`), which so need no sockets, ports,
//! processes or state directory.
//!
//! Grouped by what the broker asks, not by system call. `RealKernel` is
//! the code the broker ran itself before (moved, not rewritten). The
//! seam's own tests: this file's (the real registry, `/proc`, a memfd)
//! and those next to the code it calls: `crate::sockets` (a real listener
//! seen and gone), `crate::identity`, `crate::pods::netns_is_live`,
//! `crate::memfd`, the two stores.
//!
//! Left outside: the clock, and `RingWatch`'s `pread` of a channel's
//! region through the fd the broker keeps (the rings are the tests' real
//! memfds, which they write to move the live byte counts).

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use flowlane_registry::{Attachment, Registry, RegistryError};

use crate::channel_store::{ChannelRecord, ChannelStore};
use crate::identity::ProcessId;
use crate::listener_store::{ListenerRecord, ListenerStore};

/// A snapshot of the registry's entries that changes when one is added,
/// removed or replaced (see `RealKernel::registry_stamp`).
pub type RegistryStamp = Vec<(PathBuf, u64)>;

/// The kernel and the node's files, as the broker needs them.
pub trait Kernel: Send {
    /// The pod registry's entries (the CNI plugin's files).
    fn registry(&self) -> Result<Vec<Attachment>, RegistryError>;
    /// Cheap: what `registry` would read changed iff this did.
    fn registry_stamp(&self) -> RegistryStamp;
    /// Whether a registry entry's namespace `path` is still a network
    /// namespace with inode `inode` (not gone, not another one now).
    fn netns_is_live(&self, path: &str, inode: u64) -> bool;
    /// The registry was reread: the node's pod addresses, for the peer
    /// table the libraries read (`crate::peer_table`).
    fn publish_pods(&self, pod_ips: &[IpAddr]);
    /// The network namespaces whose administrators are the node's: the
    /// daemon's own and the initial one.
    fn node_netns(&self) -> Vec<u64>;
    /// Whether this very process (not a later one with its pid) runs.
    fn is_alive(&self, process: &ProcessId) -> bool;
    /// The supplementary groups of process `pid`.
    fn groups_of(&self, pid: u32) -> io::Result<Vec<u32>>;
    /// Whether the network namespace of process `pid` has a TCP socket
    /// listening on `port`.
    fn listens_on(&self, pid: u32, port: u16) -> io::Result<bool>;
    /// A sealed memfd of exactly `len` bytes (a channel's region).
    fn channel_memfd(&self, name: &str, len: u64) -> io::Result<OwnedFd>;
    /// The local and the peer address of the TCP socket `fd` of `process`
    /// (a portless intent's socket, `channels.rs`). An error when the
    /// process is gone, `fd` is no TCP socket or it is not connected.
    fn connection_of(&self, process: &ProcessId, fd: i32) -> io::Result<(SocketAddr, SocketAddr)>;
    /// The listeners a predecessor saved (none when unreadable; logged).
    fn load_listeners(&self) -> Vec<ListenerRecord>;
    fn save_listeners(&self, records: &[ListenerRecord]) -> io::Result<()>;
    /// The connections a predecessor handed over, taken (read and
    /// removed) so that no later daemon finds them.
    fn take_connections(&self) -> Vec<ChannelRecord>;
    fn save_connections(&self, records: &[ChannelRecord]) -> io::Result<()>;
}

/// The real kernel: `/proc`, memfd, the registry and the state files in
/// the daemon's state directory.
pub struct RealKernel {
    registry: Registry,
    listeners: ListenerStore,
    connections: ChannelStore,
    /// The device of namespace files (nsfs): a registry entry's path must
    /// be on it.
    nsfs_dev: u64,
}

impl RealKernel {
    pub fn new(state_dir: &Path) -> Self {
        let nsfs_dev = crate::identity::nsfs_dev().unwrap_or_else(|e| {
            // No pod can be verified: every client stays on TCP.
            tracing::error!(error = %e, "cannot stat /proc/self/ns/net; no pod will be trusted");
            u64::MAX
        });
        RealKernel {
            registry: Registry::new(state_dir),
            listeners: ListenerStore::new(state_dir),
            connections: ChannelStore::new(state_dir),
            nsfs_dev,
        }
    }
}

impl Kernel for RealKernel {
    fn registry(&self) -> Result<Vec<Attachment>, RegistryError> {
        self.registry.list()
    }

    fn registry_stamp(&self) -> RegistryStamp {
        registry_stamp(self.registry.root())
    }

    fn netns_is_live(&self, path: &str, inode: u64) -> bool {
        crate::pods::netns_is_live(path, inode, self.nsfs_dev)
    }

    fn publish_pods(&self, pod_ips: &[IpAddr]) {
        crate::peer_table::pods_changed(pod_ips);
    }

    fn node_netns(&self) -> Vec<u64> {
        crate::identity::own_netns_inode()
            .into_iter()
            .chain([crate::identity::INIT_NETNS_INODE])
            .collect()
    }

    fn is_alive(&self, process: &ProcessId) -> bool {
        process.is_alive()
    }

    fn groups_of(&self, pid: u32) -> io::Result<Vec<u32>> {
        crate::identity::groups_of(pid)
    }

    fn listens_on(&self, pid: u32, port: u16) -> io::Result<bool> {
        crate::sockets::netns_listens_on(pid, port)
    }

    fn channel_memfd(&self, name: &str, len: u64) -> io::Result<OwnedFd> {
        crate::memfd::create_sealed(name, len)
    }

    fn connection_of(&self, process: &ProcessId, fd: i32) -> io::Result<(SocketAddr, SocketAddr)> {
        use crate::relay::os;
        let (sock, _pidfd) = os::take_tcp_socket(process, fd)?;
        let name = |peer| {
            os::socket_name(&sock, peer)
                .map(|a| SocketAddr::new(a.ip().to_canonical(), a.port()))
                .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOTCONN))
        };
        Ok((name(false)?, name(true)?))
    }

    fn load_listeners(&self) -> Vec<ListenerRecord> {
        self.listeners.load()
    }

    fn save_listeners(&self, records: &[ListenerRecord]) -> io::Result<()> {
        self.listeners.save(records)
    }

    fn take_connections(&self) -> Vec<ChannelRecord> {
        self.connections.take()
    }

    fn save_connections(&self, records: &[ChannelRecord]) -> io::Result<()> {
        self.connections.save(records)
    }
}

/// The registry's entries as (path, inode) pairs: an added, removed or
/// replaced entry (the registry renames a new file into place) changes it.
/// Directory mtimes would be cheaper but have coarse (jiffy) resolution, so
/// two changes within a few milliseconds could look like one.
fn registry_stamp(root: &Path) -> RegistryStamp {
    use std::os::unix::fs::DirEntryExt;
    let mut out = Vec::new();
    let Ok(networks) = std::fs::read_dir(root) else {
        return out;
    };
    for net in networks.flatten() {
        let Ok(entries) = std::fs::read_dir(net.path()) else {
            continue;
        };
        out.extend(entries.flatten().map(|e| (e.path(), e.ino())));
    }
    out.sort();
    out
}

/// The seam's own test: `RealKernel` answers from the real registry,
/// `/proc` and memfds (a real listener seen and gone: `crate::sockets`).
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_real_kernel_sees_registry_changes_this_process_and_its_namespace() {
        let dir = std::env::temp_dir().join(format!("fld-kernel-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let k = RealKernel::new(&dir);
        assert!(k.registry().unwrap().is_empty());
        let empty = k.registry_stamp();
        let own = crate::identity::own_netns_inode().unwrap();
        let entry = Attachment {
            network: "n".into(),
            container_id: "c1".into(),
            ifname: "eth0".into(),
            netns: "/proc/self/ns/net".into(),
            netns_inode: own,
            ips: vec!["10.202.7.1/24".into()],
            mac: String::new(),
            pod_namespace: None,
            pod_name: None,
            pod_uid: None,
            created_unix: 0,
        };
        let reg = Registry::new(&dir);
        reg.put(&entry).unwrap();
        let one = k.registry_stamp();
        assert_ne!(one, empty);
        assert_eq!(k.registry().unwrap().len(), 1);
        // Replaced in place (a new file renamed over it): another stamp.
        reg.put(&entry).unwrap();
        assert_ne!(k.registry_stamp(), one);
        reg.remove("n", "c1", "eth0").unwrap();
        assert_eq!(k.registry_stamp(), empty);

        assert!(k.netns_is_live("/proc/self/ns/net", own));
        assert!(!k.netns_is_live("/proc/self/ns/net", own + 1));
        assert!(!k.netns_is_live("", own));
        assert!(k.node_netns().contains(&own));
        assert!(k.node_netns().contains(&crate::identity::INIT_NETNS_INODE));

        let me = ProcessId::of(std::process::id()).unwrap();
        assert!(k.is_alive(&me));
        assert!(!k.is_alive(&ProcessId {
            start: me.start + 1,
            ..me
        }));
        assert!(k.groups_of(me.pid).is_ok());

        let fd = k.channel_memfd("fld-kernel-test", 8192).unwrap();
        let f = std::fs::File::from(fd);
        assert_eq!(f.metadata().unwrap().len(), 8192);
        assert!(f.set_len(4096).is_err(), "sealed");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
