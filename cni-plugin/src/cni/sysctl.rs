//! The sysctls forwarding needs, written through /proc/sys (no `sysctl`
//! process). Only written when not already set, which is the common case.

use std::fs;

use super::error::{CniError, CniResult};

pub const IPV4_FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";
pub const IPV6_FORWARD: &str = "/proc/sys/net/ipv6/conf/all/forwarding";

pub fn ensure_one(path: &str) -> CniResult<()> {
    if fs::read_to_string(path)
        .map(|v| v.trim() == "1")
        .unwrap_or(false)
    {
        return Ok(());
    }
    fs::write(path, b"1").map_err(|e| CniError::io(format!("enabling {path}"), e))
}
