//! The spec's error result: `{"cniVersion","code","msg","details"}` on
//! stdout and a non-zero exit. Codes 0-99 are the spec's; 100+ are ours and
//! are listed in docs/cni.md.

use std::fmt;

/// Error codes reserved by the CNI specification (SPEC.md, "Error").
pub mod code {
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    #[allow(dead_code)] // every config key we know is supported
    pub const UNSUPPORTED_FIELD: u32 = 2;
    pub const UNKNOWN_CONTAINER: u32 = 3;
    pub const INVALID_ENV: u32 = 4;
    pub const IO: u32 = 5;
    pub const DECODE: u32 = 6;
    pub const INVALID_CONFIG: u32 = 7;
    pub const TRY_AGAIN_LATER: u32 = 11;
    pub const NOT_AVAILABLE: u32 = 50;
    pub const LIMITED_CONNECTIVITY: u32 = 51;

    // flowlane's own codes (docs/cni.md, "Error codes").
    /// `CNI_IFNAME` already exists in the container, or the attachment's
    /// host-side veth already exists (ADD twice without DEL).
    pub const IFACE_EXISTS: u32 = 100;
    /// A netlink request (link, address, route) failed.
    pub const NETLINK: u32 = 101;
    /// The built-in IPAM has no free address left in a range set.
    pub const IPAM_EXHAUSTED: u32 = 102;
    /// The delegated IPAM plugin is missing, failed or answered garbage.
    pub const IPAM_PLUGIN: u32 = 103;
    /// Installing or removing the masquerade rule (nftables) failed.
    pub const MASQUERADE: u32 = 104;
    /// CHECK found the container's interface, addresses or routes differ
    /// from prevResult.
    pub const CHECK_MISMATCH: u32 = 105;
    /// The bridge name is taken by a link that is not a bridge.
    pub const NOT_A_BRIDGE: u32 = 106;
    /// The built-in IPAM found the attachment already holds an address.
    pub const IPAM_DUPLICATE: u32 = 107;
}

/// A CNI error ready to be printed as the spec's error JSON.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CniError {
    pub code: u32,
    pub msg: String,
    pub details: String,
}

pub type CniResult<T> = Result<T, CniError>;

impl CniError {
    pub fn new(code: u32, msg: impl Into<String>) -> Self {
        CniError {
            code,
            msg: msg.into(),
            details: String::new(),
        }
    }

    pub fn with_details(mut self, details: impl fmt::Display) -> Self {
        self.details = details.to_string();
        self
    }

    pub fn config(msg: impl Into<String>) -> Self {
        Self::new(code::INVALID_CONFIG, msg)
    }

    pub fn env(msg: impl Into<String>) -> Self {
        Self::new(code::INVALID_ENV, msg)
    }

    pub fn io(msg: impl Into<String>, err: impl fmt::Display) -> Self {
        Self::new(code::IO, msg).with_details(err)
    }

    pub fn netlink(msg: impl Into<String>, err: impl fmt::Display) -> Self {
        Self::new(code::NETLINK, msg).with_details(err)
    }

    /// The JSON object the spec asks for, tagged with `cni_version`.
    pub fn to_json(&self, cni_version: &str) -> serde_json::Value {
        serde_json::json!({
            "cniVersion": cni_version,
            "code": self.code,
            "msg": self.msg,
            "details": self.details,
        })
    }
}

impl fmt::Display for CniError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "code {}: {}", self.code, self.msg)?;
        if !self.details.is_empty() {
            write!(f, " ({})", self.details)?;
        }
        Ok(())
    }
}

impl std::error::Error for CniError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_json_has_all_spec_fields() {
        let e = CniError::config("bad mtu").with_details("mtu 5 below 68");
        assert_eq!(
            e.to_json("1.1.0"),
            serde_json::json!({"cniVersion":"1.1.0","code":7,"msg":"bad mtu","details":"mtu 5 below 68"})
        );
    }
}
