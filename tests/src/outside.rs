//! A host outside every pod network: a network namespace joined to one
//! pod by a veth pair of its own (a /30 of the caller's subnet), so the
//! pod reaches it without any node route, pod CIDR or daemon knowing it.
//! What a pod's connections to the outside world look like to the
//! library: destinations that can never be lane peers.

use std::process::Command;
use std::time::Duration;

use crate::shm::{fresh_netns, sh, sh_ok, Pod};

/// The namespace and its address; deleted (with the veth pair) on drop.
pub struct OutsideHost {
    pub netns: String,
    /// The outside end's address.
    pub ip: String,
}

impl OutsideHost {
    /// A namespace `<tag>o<pid>` reached from `client` over a veth pair
    /// in 10.238.x.0/30 (x from the pid).
    pub fn new(client: &Pod, tag: &str) -> OutsideHost {
        let id = std::process::id() % 10_000;
        let netns = format!("{tag}o{id}");
        let (a, b) = (format!("{tag}v{id}a"), format!("{tag}v{id}b"));
        assert!(a.len() <= 15, "{a}");
        let k = id % 250 + 1;
        let (here, there) = (format!("10.238.{k}.1"), format!("10.238.{k}.2"));
        fresh_netns(&netns);
        sh_ok(&[
            "ip",
            "-n",
            &client.netns,
            "link",
            "add",
            &a,
            "type",
            "veth",
            "peer",
            "name",
            &b,
            "netns",
            &netns,
        ]);
        let here_cidr = format!("{here}/30");
        let there_cidr = format!("{there}/30");
        sh_ok(&[
            "ip",
            "-n",
            &client.netns,
            "addr",
            "add",
            &here_cidr,
            "dev",
            &a,
        ]);
        sh_ok(&["ip", "-n", &netns, "addr", "add", &there_cidr, "dev", &b]);
        sh_ok(&["ip", "-n", &client.netns, "link", "set", &a, "up"]);
        sh_ok(&["ip", "-n", &netns, "link", "set", &b, "up"]);
        OutsideHost { netns, ip: there }
    }

    /// `argv` run in the outside namespace (no library).
    pub fn cmd(&self, argv: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.netns]);
        c.args(argv);
        c
    }

    /// Waits until something listens on `port` in the namespace.
    pub fn wait_listening(&self, port: u16) {
        let filter = format!("sport = :{port}");
        let up = crate::wait::until(Duration::from_secs(10), || {
            self.cmd(&["ss", "-Hltn", &filter])
                .output()
                .is_ok_and(|o| !o.stdout.is_empty())
        });
        assert!(up, "nothing listens on {}:{port}", self.ip);
    }
}

impl Drop for OutsideHost {
    fn drop(&mut self) {
        // The veth pair goes with the namespace.
        let _ = sh(&["ip", "netns", "del", &self.netns]);
    }
}
