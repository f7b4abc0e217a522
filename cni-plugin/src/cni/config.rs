//! The network configuration on stdin: the reference `bridge` plugin's keys
//! plus flowlane's own. Unknown keys are ignored (as the reference plugins
//! do); known keys with the wrong type or a bad value are error 7, JSON that
//! does not parse at all is error 6.

use serde::Deserialize;
use serde_json::Value;

use super::env::{is_valid_name, validate_ifname};
use super::error::{code, CniError, CniResult};
use super::ipam::config::IpamConf;
use super::result::Dns;
use super::version::{self, Version};

pub const DEFAULT_BRIDGE: &str = "cni0";
pub const DEFAULT_STATE_DIR: &str = flowlane_defaults::STATE_DIR;
pub const DEFAULT_DAEMON_SOCKET: &str = flowlane_defaults::DAEMON_SOCKET;

/// The keys as they appear in JSON. Validation turns this into [`NetConf`].
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawConf {
    #[serde(default)]
    name: Option<String>,
    #[serde(default, rename = "type")]
    plugin_type: Option<String>,
    #[serde(default)]
    bridge: Option<String>,
    #[serde(default)]
    is_gateway: Option<bool>,
    #[serde(default)]
    is_default_gateway: Option<bool>,
    #[serde(default)]
    force_address: Option<bool>,
    #[serde(default)]
    ip_masq: Option<bool>,
    /// Destinations `ipMasq` never masquerades (the cluster's pod CIDRs).
    #[serde(default, rename = "clusterCIDRs")]
    cluster_cidrs: Vec<ipnetwork::IpNetwork>,
    #[serde(default)]
    mtu: Option<u32>,
    #[serde(default)]
    hairpin_mode: Option<bool>,
    #[serde(default)]
    promisc_mode: Option<bool>,
    #[serde(default)]
    ipam: Option<Value>,
    #[serde(default)]
    dns: Option<Dns>,
    #[serde(default)]
    state_dir: Option<String>,
    #[serde(default)]
    daemon_socket: Option<String>,
    #[serde(default)]
    log_file: Option<String>,
    #[serde(default)]
    mode: Option<String>,
    #[serde(default)]
    prev_result: Option<Value>,
    #[serde(default, rename = "cni.dev/valid-attachments")]
    valid_attachments: Option<Vec<AttachmentRef>>,
    #[serde(default, rename = "cni.dev/attachments")]
    attachments: Option<Vec<AttachmentRef>>,
}

/// One entry of `cni.dev/valid-attachments` (GC).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Deserialize)]
pub struct AttachmentRef {
    #[serde(rename = "containerID")]
    pub container_id: String,
    pub ifname: String,
}

/// How the plugin takes part in the network (`"mode"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// flowlane wires the pod (bridge, veth, IPAM, routes, masquerade).
    #[default]
    Primary,
    /// A later plugin of a conflist: another CNI wired the pod; flowlane
    /// records it from `prevResult` and wires nothing.
    Chained,
}

/// A validated network configuration.
#[derive(Debug, Clone)]
pub struct NetConf {
    /// `cniVersion` exactly as given (results echo it).
    pub cni_version: String,
    pub version: Version,
    pub name: String,
    pub bridge: String,
    pub is_gateway: bool,
    pub is_default_gateway: bool,
    pub force_address: bool,
    pub ip_masq: bool,
    pub cluster_cidrs: Vec<ipnetwork::IpNetwork>,
    pub mtu: Option<u32>,
    pub hairpin_mode: bool,
    pub promisc_mode: bool,
    pub ipam: Option<IpamConf>,
    pub dns: Option<Dns>,
    pub state_dir: String,
    pub daemon_socket: String,
    pub log_file: Option<String>,
    pub mode: Mode,
    pub prev_result: Option<Value>,
    /// GC's list of attachments still in use, when given.
    pub valid_attachments: Option<Vec<AttachmentRef>>,
    /// The raw stdin bytes: delegated plugins receive them unchanged.
    pub raw: Vec<u8>,
}

/// Best effort: the `cniVersion` of a config, for tagging an error result
/// even when the rest of the config is bad.
pub fn sniff_version(stdin: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(stdin).ok()?;
    Some(v.get("cniVersion")?.as_str()?.to_string())
}

/// Parses and validates stdin.
pub fn parse(stdin: &[u8]) -> CniResult<NetConf> {
    let value: Value = serde_json::from_slice(stdin).map_err(|e| {
        CniError::new(code::DECODE, "error decoding network configuration").with_details(e)
    })?;
    if !value.is_object() {
        return Err(CniError::new(
            code::DECODE,
            "network configuration is not a JSON object",
        ));
    }
    // Version first: an unsupported version is error 1 whatever else is wrong.
    let cni_version = match value.get("cniVersion") {
        None | Some(Value::Null) => "0.1.0".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(
                CniError::new(code::DECODE, "cniVersion must be a string").with_details(other)
            )
        }
    };
    let version = version::check_supported(&cni_version)?;
    let raw: RawConf = serde_json::from_value(value)
        .map_err(|e| CniError::config("invalid network configuration").with_details(e))?;

    let name = raw.name.unwrap_or_default();
    if name.is_empty() {
        return Err(CniError::config("missing network name"));
    }
    if !is_valid_name(&name) {
        return Err(CniError::config("invalid characters found in network name").with_details(name));
    }
    if raw.plugin_type.as_deref().unwrap_or("").is_empty() {
        return Err(CniError::config("missing \"type\""));
    }
    let bridge = raw.bridge.unwrap_or_else(|| DEFAULT_BRIDGE.to_string());
    if bridge.is_empty() || validate_ifname(&bridge).is_err() {
        return Err(CniError::config(format!(
            "invalid bridge name {bridge:?}: 1-15 bytes without '/', ':' or whitespace"
        )));
    }
    if let Some(mtu) = raw.mtu {
        // 68 is the IPv4 minimum; 65535 the largest the kernel accepts on veth.
        if !(68..=65535).contains(&mtu) {
            return Err(CniError::config(format!(
                "invalid mtu {mtu}: must be 68..=65535"
            )));
        }
    }
    let hairpin_mode = raw.hairpin_mode.unwrap_or(false);
    let promisc_mode = raw.promisc_mode.unwrap_or(false);
    if hairpin_mode && promisc_mode {
        return Err(CniError::config(
            "cannot set hairpin mode and promiscuous mode at the same time",
        ));
    }
    let is_default_gateway = raw.is_default_gateway.unwrap_or(false);
    let ipam = match raw.ipam {
        None | Some(Value::Null) => None,
        Some(v) => IpamConf::parse(v, &name)?,
    };
    let path_key = |key: &str, v: Option<String>, default: &str| -> CniResult<String> {
        let v = v.unwrap_or_else(|| default.to_string());
        if v.is_empty() || !v.starts_with('/') {
            return Err(CniError::config(format!(
                "{key} must be an absolute path, got {v:?}"
            )));
        }
        Ok(v)
    };
    let state_dir = path_key("stateDir", raw.state_dir, DEFAULT_STATE_DIR)?;
    let daemon_socket = path_key("daemonSocket", raw.daemon_socket, DEFAULT_DAEMON_SOCKET)?;
    let log_file = match raw.log_file {
        None => None,
        Some(f) if f.is_empty() => None,
        Some(f) => Some(path_key("logFile", Some(f), "")?),
    };
    let mode = match raw.mode.as_deref() {
        None | Some("primary") => Mode::Primary,
        Some("chained") => Mode::Chained,
        Some(other) => {
            return Err(CniError::config(format!(
                "invalid mode {other:?}: \"primary\" or \"chained\""
            )))
        }
    };
    Ok(NetConf {
        cni_version,
        version,
        name,
        bridge,
        // Reference semantics: isDefaultGateway implies isGateway.
        is_gateway: raw.is_gateway.unwrap_or(false) || is_default_gateway,
        is_default_gateway,
        force_address: raw.force_address.unwrap_or(false),
        ip_masq: raw.ip_masq.unwrap_or(false),
        cluster_cidrs: raw.cluster_cidrs,
        mtu: raw.mtu,
        hairpin_mode,
        promisc_mode,
        ipam,
        dns: raw.dns,
        state_dir,
        daemon_socket,
        log_file,
        mode,
        prev_result: raw.prev_result.filter(|v| !v.is_null()),
        valid_attachments: raw.valid_attachments.or(raw.attachments),
        raw: stdin.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{
        "cniVersion": "1.1.0", "name": "net1", "type": "flowlane",
        "bridge": "fl0", "isGateway": true, "ipMasq": true, "mtu": 1400,
        "someUnknownKey": {"x": [1,2]},
        "ipam": {"type": "flowlane", "subnet": "10.22.0.0/24"}
    }"#;

    fn with(patch: &str) -> CniResult<NetConf> {
        let mut v: Value = serde_json::from_str(GOOD).unwrap();
        let p: Value = serde_json::from_str(patch).unwrap();
        for (k, val) in p.as_object().unwrap() {
            if val.is_null() {
                v.as_object_mut().unwrap().remove(k);
            } else {
                v[k] = val.clone();
            }
        }
        parse(serde_json::to_string(&v).unwrap().as_bytes())
    }

    #[test]
    fn defaults_and_good_config() {
        let c = parse(GOOD.as_bytes()).unwrap();
        assert_eq!(c.bridge, "fl0");
        assert!(c.is_gateway && !c.is_default_gateway && c.ip_masq);
        assert_eq!(c.mtu, Some(1400));
        assert_eq!(c.state_dir, "/var/lib/flowlane");
        assert_eq!(c.daemon_socket, "/run/flowlane/flowlaned.sock");
        assert_eq!(c.mode, Mode::Primary);
        assert_eq!(with(r#"{"mode": "chained"}"#).unwrap().mode, Mode::Chained);
        let c = with(r#"{"bridge": null, "isGateway": null, "isDefaultGateway": true}"#).unwrap();
        assert_eq!(c.bridge, "cni0");
        assert!(c.is_gateway, "isDefaultGateway implies isGateway");
        let c = with(r#"{"ipam": null}"#).unwrap();
        assert!(c.ipam.is_none());
    }

    #[test]
    fn every_bad_config_gets_its_code() {
        let cases: &[(&str, u32)] = &[
            (r#"{"cniVersion": "0.2.0"}"#, 1),
            (r#"{"cniVersion": "9.9.9"}"#, 1),
            (r#"{"cniVersion": null}"#, 1),
            (r#"{"cniVersion": 1}"#, 6),
            (r#"{"name": null}"#, 7),
            (r#"{"name": ""}"#, 7),
            (r#"{"name": "bad/name"}"#, 7),
            (r#"{"name": 5}"#, 7),
            (r#"{"type": null}"#, 7),
            (r#"{"bridge": "this-name-is-too-long"}"#, 7),
            (r#"{"bridge": "a b"}"#, 7),
            (r#"{"bridge": 3}"#, 7),
            (r#"{"isGateway": "yes"}"#, 7),
            (r#"{"ipMasq": 1}"#, 7),
            (r#"{"mtu": "1500"}"#, 7),
            (r#"{"mtu": -1}"#, 7),
            (r#"{"mtu": 10}"#, 7),
            (r#"{"mtu": 70000}"#, 7),
            (r#"{"hairpinMode": true, "promiscMode": true}"#, 7),
            (r#"{"stateDir": "relative/dir"}"#, 7),
            (r#"{"stateDir": 1}"#, 7),
            (r#"{"daemonSocket": ""}"#, 7),
            (r#"{"logFile": "x.log"}"#, 7),
            (r#"{"dns": "8.8.8.8"}"#, 7),
            (r#"{"ipam": "host-local"}"#, 7),
            (r#"{"ipam": {"type": "flowlane"}}"#, 7),
            (
                r#"{"ipam": {"type": "flowlane", "subnet": "10.0.0.0/33"}}"#,
                7,
            ),
            (r#"{"ipam": {"type": "flowlane", "subnet": "nonsense"}}"#, 7),
            (
                r#"{"ipam": {"type": "flowlane", "subnet": "10.0.0.0/31"}}"#,
                7,
            ),
            (
                r#"{"ipam": {"type": "flowlane", "subnet": "10.0.0.0/24", "rangeStart": "10.0.1.5"}}"#,
                7,
            ),
            (
                r#"{"ipam": {"type": "flowlane", "subnet": "10.0.0.0/24", "rangeStart": "10.0.0.50", "rangeEnd": "10.0.0.10"}}"#,
                7,
            ),
            (
                r#"{"ipam": {"type": "flowlane", "subnet": "10.0.0.0/24", "gateway": "10.9.0.1"}}"#,
                7,
            ),
            (
                r#"{"ipam": {"type": "flowlane", "ranges": [[{"subnet": "10.0.0.0/24"}, {"subnet": "fd00::/64"}]]}}"#,
                7,
            ),
            (
                r#"{"ipam": {"type": "flowlane", "ranges": [[{"subnet": "10.0.0.0/24"}], [{"subnet": "10.0.0.0/25"}]]}}"#,
                7,
            ),
            (r#"{"ipam": {"type": "flowlane", "ranges": []}}"#, 7),
            (r#"{"ipam": {"type": "flowlane", "ranges": [[]]}}"#, 7),
            (r#"{"ipam": {"type": "flowlane", "ranges": "x"}}"#, 7),
            (
                r#"{"ipam": {"type": "flowlane", "subnet": "10.0.0.0/24", "routes": [{"dst": "nope"}]}}"#,
                7,
            ),
            (
                r#"{"ipam": {"type": "flowlane", "subnet": "10.0.0.0/24", "routes": [{"dst": "0.0.0.0/0", "gw": "x"}]}}"#,
                7,
            ),
            (
                r#"{"ipam": {"type": "flowlane", "subnet": "10.0.0.0/24", "dataDir": "rel"}}"#,
                7,
            ),
            (r#"{"ipam": {"type": "../../bin/sh"}}"#, 7),
            (r#"{"mode": "sidecar"}"#, 7),
            (r#"{"mode": true}"#, 7),
        ];
        for (patch, want) in cases {
            let got = with(patch).map(|_| ()).unwrap_err();
            assert_eq!(got.code, *want, "patch {patch}: {got}");
        }
        assert_eq!(parse(b"{not json").unwrap_err().code, 6);
        assert_eq!(parse(b"").unwrap_err().code, 6);
        assert_eq!(parse(b"[1]").unwrap_err().code, 6);
    }

    #[test]
    fn gc_attachments_new_and_old_key() {
        let c = with(r#"{"cni.dev/valid-attachments": [{"containerID": "a", "ifname": "eth0"}]}"#)
            .unwrap();
        assert_eq!(c.valid_attachments.unwrap().len(), 1);
        let c =
            with(r#"{"cni.dev/attachments": [{"containerID": "a", "ifname": "eth0"}]}"#).unwrap();
        assert_eq!(c.valid_attachments.unwrap()[0].container_id, "a");
    }

    #[test]
    fn version_sniffing() {
        assert_eq!(
            sniff_version(br#"{"cniVersion":"0.4.0","x":1}"#).as_deref(),
            Some("0.4.0")
        );
        assert_eq!(sniff_version(b"garbage"), None);
    }
}
