//! The unit tests' kernel: a node the test describes (registry entries,
//! pinned namespaces, running processes, listening ports, the state
//! files, the peer table), answering as `RealKernel` would for such a node. Shared by
//! clones, so a test changes the node under a running broker and a
//! successor broker finds what its predecessor saved.
//!
//! Faithful where the broker's behaviour depends on it:
//! - a process runs from `start_process` until `exit`; a pid that does not
//!   run has no `/proc` entry, so its groups and sockets are NotFound (the
//!   broker keeps a listener it cannot check);
//! - a namespace path is live while pinned, with the inode it was pinned
//!   with; an empty path never is (`pods::netns_is_live`);
//! - a port listens only if the test said so. All processes share one
//!   network namespace, as the test processes the tests used before did;
//! - the registry stamp changes on every put and removal (each put is a new
//!   file, as the registry renames one into place);
//! - the connection file is taken once;
//! - the peer table holds what was last published.
//!
//! Channel regions are real memfds (`crate::memfd`): tests map them and
//! write the rings to check the live byte counts, and a memfd is no socket,
//! takes no port and is private to the test.

use std::collections::{HashMap, HashSet};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use flowlane_registry::{Attachment, RegistryError};

use super::kernel::{Kernel, RegistryStamp};
use crate::channel_store::ChannelRecord;
use crate::identity::{ProcessId, INIT_NETNS_INODE};
use crate::listener_store::ListenerRecord;

/// The daemon's own network namespace on the fake node.
pub const NODE_NETNS: u64 = 4_026_531_000;

#[derive(Default)]
struct Node {
    /// Registry entries with the serial of the put that wrote them.
    entries: Vec<(u64, Attachment)>,
    serial: u64,
    /// Pinned namespace paths and their inodes.
    namespaces: HashMap<String, u64>,
    running: HashSet<ProcessId>,
    next_pid: u32,
    groups: HashMap<u32, Vec<u32>>,
    listening: HashSet<u16>,
    /// Connected TCP sockets: (process, fd) -> (local, peer).
    sockets: HashMap<(ProcessId, i32), (SocketAddr, SocketAddr)>,
    /// How often the broker read each socket (`connection_of`).
    socket_reads: HashMap<(ProcessId, i32), u32>,
    listener_file: Vec<ListenerRecord>,
    /// What the broker last published for the peer table.
    published: Option<Vec<IpAddr>>,
    connection_file: Option<Vec<ChannelRecord>>,
}

#[derive(Clone, Default)]
pub struct FakeKernel(Arc<Mutex<Node>>);

impl FakeKernel {
    fn node(&self) -> MutexGuard<'_, Node> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds or replaces (same network, container and interface) an entry.
    pub fn put(&self, a: Attachment) {
        let mut n = self.node();
        n.serial += 1;
        let serial = n.serial;
        n.entries.retain(|(_, e)| {
            (&e.network, &e.container_id, &e.ifname) != (&a.network, &a.container_id, &a.ifname)
        });
        n.entries.push((serial, a));
    }

    /// Removes container `container_id`'s entries (CNI DEL).
    pub fn remove(&self, container_id: &str) {
        self.node()
            .entries
            .retain(|(_, e)| e.container_id != container_id);
    }

    /// A namespace at `path` with `inode` (a runtime's bind mount).
    pub fn pin_netns(&self, path: &str, inode: u64) {
        self.node().namespaces.insert(path.to_string(), inode);
    }

    /// The namespace at `path` goes (its pod's sandbox died).
    pub fn unpin_netns(&self, path: &str) {
        self.node().namespaces.remove(path);
    }

    /// Starts a new process.
    pub fn start_process(&self) -> ProcessId {
        let mut n = self.node();
        n.next_pid += 1;
        let p = ProcessId {
            pid: 100_000 + n.next_pid,
            start: 1,
        };
        n.running.insert(p);
        p
    }

    /// Marks `p` as running (a process the tests name as a constant).
    pub fn run(&self, p: ProcessId) {
        self.node().running.insert(p);
    }

    pub fn exit(&self, p: ProcessId) {
        self.node().running.remove(&p);
    }

    pub fn set_groups(&self, pid: u32, groups: Vec<u32>) {
        self.node().groups.insert(pid, groups);
    }

    /// Process `p`'s fd `fd` is a TCP socket bound to `local`, connected
    /// to `peer` (what its `connect` made of it).
    pub fn connect_socket(&self, p: ProcessId, fd: i32, local: SocketAddr, peer: SocketAddr) {
        self.node().sockets.insert((p, fd), (local, peer));
    }

    /// How often the broker read process `p`'s socket `fd`.
    pub fn socket_reads(&self, p: ProcessId, fd: i32) -> u32 {
        self.node().socket_reads.get(&(p, fd)).copied().unwrap_or(0)
    }

    pub fn listen(&self, port: u16) {
        self.node().listening.insert(port);
    }

    pub fn close_listener(&self, port: u16) {
        self.node().listening.remove(&port);
    }

    /// The pod addresses the broker last published (peer table).
    pub fn published(&self) -> Option<Vec<IpAddr>> {
        self.node().published.clone()
    }

    fn runs(n: &Node, pid: u32) -> io::Result<()> {
        if n.running.iter().any(|p| p.pid == pid) {
            Ok(())
        } else {
            Err(io::ErrorKind::NotFound.into())
        }
    }
}

impl Kernel for FakeKernel {
    fn registry(&self) -> Result<Vec<Attachment>, RegistryError> {
        Ok(self.node().entries.iter().map(|(_, a)| a.clone()).collect())
    }

    fn registry_stamp(&self) -> RegistryStamp {
        let mut out: RegistryStamp = self
            .node()
            .entries
            .iter()
            .map(|(serial, a)| {
                let path = format!("{}/{}-{}", a.network, a.container_id, a.ifname);
                (PathBuf::from(path), *serial)
            })
            .collect();
        out.sort();
        out
    }

    fn netns_is_live(&self, path: &str, inode: u64) -> bool {
        !path.is_empty() && self.node().namespaces.get(path) == Some(&inode)
    }

    fn publish_pods(&self, pod_ips: &[IpAddr]) {
        self.node().published = Some(pod_ips.to_vec());
    }

    fn node_netns(&self) -> Vec<u64> {
        vec![NODE_NETNS, INIT_NETNS_INODE]
    }

    fn is_alive(&self, process: &ProcessId) -> bool {
        self.node().running.contains(process)
    }

    fn groups_of(&self, pid: u32) -> io::Result<Vec<u32>> {
        let n = self.node();
        Self::runs(&n, pid)?;
        Ok(n.groups.get(&pid).cloned().unwrap_or_default())
    }

    fn listens_on(&self, pid: u32, port: u16) -> io::Result<bool> {
        let n = self.node();
        Self::runs(&n, pid)?;
        Ok(n.listening.contains(&port))
    }

    fn channel_memfd(&self, name: &str, len: u64) -> io::Result<OwnedFd> {
        crate::memfd::create_sealed(name, len)
    }

    fn connection_of(&self, process: &ProcessId, fd: i32) -> io::Result<(SocketAddr, SocketAddr)> {
        let mut n = self.node();
        if !n.running.contains(process) {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        *n.socket_reads.entry((*process, fd)).or_default() += 1;
        n.sockets
            .get(&(*process, fd))
            .copied()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))
    }

    fn load_listeners(&self) -> Vec<ListenerRecord> {
        self.node().listener_file.clone()
    }

    fn save_listeners(&self, records: &[ListenerRecord]) -> io::Result<()> {
        self.node().listener_file = records.to_vec();
        Ok(())
    }

    fn take_connections(&self) -> Vec<ChannelRecord> {
        self.node().connection_file.take().unwrap_or_default()
    }

    fn save_connections(&self, records: &[ChannelRecord]) -> io::Result<()> {
        self.node().connection_file = Some(records.to_vec());
        Ok(())
    }
}
