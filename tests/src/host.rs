//! Links and addresses as `ip -j` reports them, on the host or in a netns,
//! and guards for host-side objects a test creates or causes.

use std::net::IpAddr;

use serde::Deserialize;

use crate::process;

/// One address of a link.
#[derive(Debug, Clone, Deserialize)]
pub struct AddrInfo {
    pub family: String,
    pub local: IpAddr,
    pub prefixlen: u8,
    #[serde(default)]
    pub scope: String,
}

/// One link as `ip -j addr show` prints it.
#[derive(Debug, Clone, Deserialize)]
pub struct Link {
    pub ifindex: u32,
    pub ifname: String,
    #[serde(default)]
    pub flags: Vec<String>,
    #[serde(default)]
    pub mtu: u32,
    #[serde(default)]
    pub master: Option<String>,
    #[serde(default)]
    pub operstate: String,
    #[serde(default)]
    pub link_type: String,
    /// The MAC address.
    #[serde(default)]
    pub address: String,
    #[serde(default)]
    pub addr_info: Vec<AddrInfo>,
}

impl Link {
    pub fn is_up(&self) -> bool {
        self.flags.iter().any(|f| f == "UP")
    }

    /// `addr/prefix` strings, without link-local IPv6 addresses.
    pub fn cidrs(&self) -> Vec<String> {
        self.addr_info
            .iter()
            .filter(|a| a.scope != "link")
            .map(|a| format!("{}/{}", a.local, a.prefixlen))
            .collect()
    }
}

/// Parses `ip -j addr show` / `ip -j link show` output.
pub fn parse_links(json: &str) -> Vec<Link> {
    serde_json::from_str(json.trim()).unwrap_or_else(|e| panic!("bad ip -j output ({e}): {json}"))
}

/// All links of the host (the test process's namespace).
pub fn links() -> Vec<Link> {
    parse_links(
        &process::sh(&["ip", "-j", "addr", "show"])
            .expect_ok("ip addr")
            .stdout,
    )
}

/// One host link, if present.
pub fn link(name: &str) -> Option<Link> {
    let out = process::sh(&["ip", "-j", "addr", "show", "dev", name]);
    if !out.success() {
        return None;
    }
    parse_links(&out.stdout).into_iter().next()
}

/// Host links enslaved to `bridge` (the host ends of pod veths).
pub fn bridge_ports(bridge: &str) -> Vec<Link> {
    let out = process::sh(&["ip", "-j", "link", "show", "master", bridge]);
    if !out.success() {
        return Vec::new();
    }
    parse_links(&out.stdout)
}

/// A host sysctl value.
pub fn sysctl(key: &str) -> Option<String> {
    let path = format!("/proc/sys/{}", key.replace('.', "/"));
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

/// Deletes a host link (the bridge a plugin created for a test) when dropped.
#[derive(Debug)]
pub struct LinkGuard {
    name: String,
}

impl LinkGuard {
    /// Guards the host link `name` (which may not exist yet: e.g. the bridge
    /// a plugin will create).
    pub fn new(name: &str) -> Self {
        LinkGuard {
            name: name.to_string(),
        }
    }

    /// Guards a fresh unique name from `tag` that no host link has yet.
    pub fn fresh(tag: &str) -> Self {
        loop {
            let name = crate::names::unique(tag);
            if link(&name).is_none() {
                return Self::new(&name);
            }
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for LinkGuard {
    fn drop(&mut self) {
        let _ = process::sh(&["ip", "link", "del", &self.name]);
    }
}
