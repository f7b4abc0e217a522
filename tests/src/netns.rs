//! Network namespaces owned by a test.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::process::{self, Output};

/// Where `ip netns` pins named namespaces.
pub const NETNS_RUN_DIR: &str = "/var/run/netns";

/// A named network namespace (`/var/run/netns/<name>`), deleted on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
    path: PathBuf,
}

impl Netns {
    /// Creates a namespace with a unique name from `tag` (see [`crate::names::unique`]),
    /// skipping names already pinned (another run's); its loopback is brought
    /// up, as a runtime does.
    pub fn new(tag: &str) -> Self {
        loop {
            let name = crate::names::unique(tag);
            if !Path::new(NETNS_RUN_DIR).join(&name).exists() {
                return Self::named(&name);
            }
        }
    }

    /// Creates the namespace `name`; panics if it exists.
    pub fn named(name: &str) -> Self {
        let path = Path::new(NETNS_RUN_DIR).join(name);
        process::sh(&["ip", "netns", "add", name]).expect_ok("ip netns add");
        let ns = Netns {
            name: name.to_string(),
            path,
        };
        ns.ip(&["link", "set", "lo", "up"]).expect_ok("lo up");
        ns
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The path a runtime passes as `CNI_NETNS`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn path_str(&self) -> String {
        self.path.display().to_string()
    }

    /// Inode of the namespace (what the pod registry records).
    pub fn inode(&self) -> u64 {
        std::fs::metadata(&self.path).expect("netns stat").ino()
    }

    /// Runs `ip -n <ns> ARGS`.
    pub fn ip(&self, args: &[&str]) -> Output {
        let mut full = vec!["ip", "-n", &self.name];
        full.extend_from_slice(args);
        process::sh(&full)
    }

    /// Runs a program inside the namespace (`ip netns exec`).
    pub fn exec(&self, args: &[&str]) -> Output {
        let mut full = vec!["ip", "netns", "exec", &self.name];
        full.extend_from_slice(args);
        process::sh(&full)
    }

    /// A `Command` that runs `program` inside the namespace.
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name, program]);
        c
    }

    /// Runs `f` on a fresh thread that has entered the namespace (a thread's
    /// namespace is its own; the test's threads are untouched).
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        self.spawn(f).join().expect("thread in netns panicked")
    }

    /// Like [`Netns::run`], returning the thread's handle.
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::thread::JoinHandle<T> {
        let file = File::open(&self.path).expect("open netns");
        std::thread::spawn(move || {
            enter(&file).expect("setns");
            f()
        })
    }

    /// Interfaces inside the namespace (`ip -j addr show`).
    pub fn links(&self) -> Vec<crate::host::Link> {
        crate::host::parse_links(&self.ip(&["-j", "addr", "show"]).expect_ok("ip addr").stdout)
    }

    /// One interface of the namespace, if present.
    pub fn link(&self, ifname: &str) -> Option<crate::host::Link> {
        self.links().into_iter().find(|l| l.ifname == ifname)
    }

    /// Routes of one family (`4` or `6`), JSON objects as `ip -j route` prints them.
    pub fn routes(&self, family: u8) -> Vec<serde_json::Value> {
        let fam = format!("-{family}");
        let out = self.ip(&["-j", &fam, "route", "show", "table", "all"]);
        serde_json::from_str(out.expect_ok("ip route").stdout.trim()).unwrap_or_default()
    }

    /// A sysctl value inside the namespace.
    pub fn sysctl(&self, key: &str) -> String {
        self.exec(&["sysctl", "-n", key])
            .expect_ok("sysctl")
            .stdout
            .trim()
            .to_string()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if self.path.exists() {
            let _ = process::sh(&["ip", "netns", "del", &self.name]);
        }
    }
}

/// Moves the calling thread into the namespace opened as `file`.
pub fn enter(file: &File) -> nix::Result<()> {
    nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
}

/// True when a namespace with this path is still pinned.
pub fn exists(path: &Path) -> bool {
    path.exists()
}
