//! The ADD result (SPEC.md section 5) as one internal model, written in the
//! format of the requested version and read back from any version we speak
//! (prevResult, delegated IPAM output).
//!
//! Formats: 0.3.0/0.3.1/0.4.0 carry `"version": "4"|"6"` in every IP; 1.0.0
//! drops it; 1.1.0 adds interface `mtu`/`socketPath`/`pciID` and route
//! `mtu`/`advmss`/`priority`/`table`/`scope`. Results from the 0.1/0.2 era
//! (`ip4`/`ip6` objects) are accepted as input from delegated plugins.

use std::net::IpAddr;

use ipnetwork::IpNetwork;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::error::{code, CniError, CniResult};
use super::version::Version;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    pub mac: String,
    pub mtu: Option<u32>,
    /// Netns path for interfaces in the container, empty on the host.
    pub sandbox: String,
    pub socket_path: Option<String>,
    pub pci_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpConfig {
    /// Address with the prefix length of its subnet ("10.1.0.5/24").
    pub address: IpNetwork,
    pub gateway: Option<IpAddr>,
    /// Index into `interfaces`.
    pub interface: Option<usize>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub dst: IpNetwork,
    pub gw: Option<IpAddr>,
    pub mtu: Option<u32>,
    pub advmss: Option<u32>,
    pub priority: Option<u32>,
    pub table: Option<u32>,
    pub scope: Option<u32>,
}

impl Route {
    pub fn new(dst: IpNetwork, gw: Option<IpAddr>) -> Route {
        Route {
            dst,
            gw,
            mtu: None,
            advmss: None,
            priority: None,
            table: None,
            scope: None,
        }
    }
}

/// The `dns` object (config key and result field).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dns {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nameservers: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub search: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

impl Dns {
    pub fn is_empty(&self) -> bool {
        self.nameservers.is_empty()
            && self.domain.is_none()
            && self.search.is_empty()
            && self.options.is_empty()
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AddResult {
    pub interfaces: Vec<Interface>,
    pub ips: Vec<IpConfig>,
    pub routes: Vec<Route>,
    pub dns: Dns,
}

impl AddResult {
    /// Serialises in the format of `version` (tagged with `cni_version`).
    pub fn to_json(&self, cni_version: &str, version: Version) -> Value {
        let v11 = version >= Version::V1_1_0;
        let mut out = Map::new();
        out.insert("cniVersion".into(), json!(cni_version));
        if !self.interfaces.is_empty() {
            let ifaces: Vec<Value> = self
                .interfaces
                .iter()
                .map(|i| {
                    let mut m = Map::new();
                    m.insert("name".into(), json!(i.name));
                    if !i.mac.is_empty() {
                        m.insert("mac".into(), json!(i.mac));
                    }
                    if v11 {
                        if let Some(mtu) = i.mtu {
                            m.insert("mtu".into(), json!(mtu));
                        }
                    }
                    if !i.sandbox.is_empty() {
                        m.insert("sandbox".into(), json!(i.sandbox));
                    }
                    if v11 {
                        if let Some(s) = &i.socket_path {
                            m.insert("socketPath".into(), json!(s));
                        }
                        if let Some(p) = &i.pci_id {
                            m.insert("pciID".into(), json!(p));
                        }
                    }
                    Value::Object(m)
                })
                .collect();
            out.insert("interfaces".into(), Value::Array(ifaces));
        }
        if !self.ips.is_empty() {
            let ips: Vec<Value> = self
                .ips
                .iter()
                .map(|ip| {
                    let mut m = Map::new();
                    if version.is_0_x() {
                        let fam = if ip.address.is_ipv4() { "4" } else { "6" };
                        m.insert("version".into(), json!(fam));
                    }
                    if let Some(i) = ip.interface {
                        m.insert("interface".into(), json!(i));
                    }
                    m.insert("address".into(), json!(ip.address.to_string()));
                    if let Some(gw) = ip.gateway {
                        m.insert("gateway".into(), json!(gw.to_string()));
                    }
                    Value::Object(m)
                })
                .collect();
            out.insert("ips".into(), Value::Array(ips));
        }
        if !self.routes.is_empty() {
            let routes: Vec<Value> = self
                .routes
                .iter()
                .map(|r| {
                    let mut m = Map::new();
                    m.insert("dst".into(), json!(r.dst.to_string()));
                    if let Some(gw) = r.gw {
                        m.insert("gw".into(), json!(gw.to_string()));
                    }
                    if v11 {
                        for (k, v) in [
                            ("mtu", r.mtu),
                            ("advmss", r.advmss),
                            ("priority", r.priority),
                            ("table", r.table),
                            ("scope", r.scope),
                        ] {
                            if let Some(v) = v {
                                m.insert(k.into(), json!(v));
                            }
                        }
                    }
                    Value::Object(m)
                })
                .collect();
            out.insert("routes".into(), Value::Array(routes));
        }
        // The reference plugins (Go) always print "dns", empty or not.
        out.insert(
            "dns".into(),
            serde_json::to_value(&self.dns).unwrap_or_else(|_| json!({})),
        );
        Value::Object(out)
    }

    /// Reads a result of any supported version (prevResult, IPAM output).
    pub fn from_json(v: &Value) -> CniResult<AddResult> {
        let bad = |what: &str| {
            CniError::new(code::DECODE, format!("cannot decode result: {what}"))
                .with_details(v.to_string())
        };
        let obj = v.as_object().ok_or_else(|| bad("not an object"))?;
        let mut r = AddResult::default();
        if obj.contains_key("ip4") || obj.contains_key("ip6") {
            return legacy_0_2(obj).ok_or_else(|| bad("malformed 0.2.0 result"));
        }
        if let Some(ifaces) = obj.get("interfaces").filter(|x| !x.is_null()) {
            for i in ifaces.as_array().ok_or_else(|| bad("interfaces"))? {
                let s = |k: &str| i.get(k).and_then(Value::as_str).map(str::to_string);
                r.interfaces.push(Interface {
                    name: s("name").ok_or_else(|| bad("interface without name"))?,
                    mac: s("mac").unwrap_or_default(),
                    mtu: i.get("mtu").and_then(Value::as_u64).map(|m| m as u32),
                    sandbox: s("sandbox").unwrap_or_default(),
                    socket_path: s("socketPath"),
                    pci_id: s("pciID"),
                });
            }
        }
        if let Some(ips) = obj.get("ips").filter(|x| !x.is_null()) {
            for ip in ips.as_array().ok_or_else(|| bad("ips"))? {
                let address = ip
                    .get("address")
                    .and_then(Value::as_str)
                    .and_then(|a| a.parse::<IpNetwork>().ok())
                    .ok_or_else(|| bad("ip address"))?;
                let gateway = match ip.get("gateway").and_then(Value::as_str) {
                    None | Some("") => None,
                    Some(g) => Some(g.parse().map_err(|_| bad("gateway"))?),
                };
                r.ips.push(IpConfig {
                    address,
                    gateway,
                    interface: ip
                        .get("interface")
                        .and_then(Value::as_u64)
                        .map(|i| i as usize),
                });
            }
        }
        if let Some(routes) = obj.get("routes").filter(|x| !x.is_null()) {
            r.routes = parse_routes(routes).ok_or_else(|| bad("routes"))?;
        }
        if let Some(dns) = obj.get("dns").filter(|x| !x.is_null()) {
            r.dns = serde_json::from_value(dns.clone()).map_err(|_| bad("dns"))?;
        }
        Ok(r)
    }
}

fn parse_routes(v: &Value) -> Option<Vec<Route>> {
    let mut out = Vec::new();
    for r in v.as_array()? {
        let dst = r.get("dst")?.as_str()?.parse().ok()?;
        let gw = match r.get("gw").and_then(Value::as_str) {
            None | Some("") => None,
            Some(g) => Some(g.parse().ok()?),
        };
        let n = |k: &str| r.get(k).and_then(Value::as_u64).map(|x| x as u32);
        out.push(Route {
            dst,
            gw,
            mtu: n("mtu"),
            advmss: n("advmss"),
            priority: n("priority"),
            table: n("table"),
            scope: n("scope"),
        });
    }
    Some(out)
}

/// 0.1.0/0.2.0 results: `{"ip4": {"ip", "gateway", "routes"}, "ip6": ..., "dns"}`.
fn legacy_0_2(obj: &Map<String, Value>) -> Option<AddResult> {
    let mut r = AddResult::default();
    for key in ["ip4", "ip6"] {
        let Some(ipc) = obj.get(key).filter(|x| !x.is_null()) else {
            continue;
        };
        let address = ipc.get("ip")?.as_str()?.parse().ok()?;
        let gateway = match ipc.get("gateway").and_then(Value::as_str) {
            None | Some("") => None,
            Some(g) => Some(g.parse().ok()?),
        };
        r.ips.push(IpConfig {
            address,
            gateway,
            interface: None,
        });
        if let Some(routes) = ipc.get("routes").filter(|x| !x.is_null()) {
            r.routes.extend(parse_routes(routes)?);
        }
    }
    if let Some(dns) = obj.get("dns").filter(|x| !x.is_null()) {
        r.dns = serde_json::from_value(dns.clone()).ok()?;
    }
    Some(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> AddResult {
        AddResult {
            interfaces: vec![
                Interface {
                    name: "cni0".into(),
                    mac: "02:00:00:00:00:01".into(),
                    mtu: Some(1400),
                    ..Default::default()
                },
                Interface {
                    name: "veth0123456789a".into(),
                    mac: "02:00:00:00:00:02".into(),
                    mtu: Some(1400),
                    ..Default::default()
                },
                Interface {
                    name: "eth0".into(),
                    mac: "02:00:00:00:00:03".into(),
                    mtu: Some(1400),
                    sandbox: "/var/run/netns/p1".into(),
                    ..Default::default()
                },
            ],
            ips: vec![
                IpConfig {
                    address: "10.22.0.5/24".parse().unwrap(),
                    gateway: Some("10.22.0.1".parse().unwrap()),
                    interface: Some(2),
                },
                IpConfig {
                    address: "fd00::5/64".parse().unwrap(),
                    gateway: Some("fd00::1".parse().unwrap()),
                    interface: Some(2),
                },
            ],
            routes: vec![Route::new(
                "0.0.0.0/0".parse().unwrap(),
                Some("10.22.0.1".parse().unwrap()),
            )],
            dns: Dns::default(),
        }
    }

    fn golden_0x(v: &str) -> Value {
        serde_json::from_str(&format!(
            r#"{{"cniVersion":"{v}",
            "interfaces":[{{"name":"cni0","mac":"02:00:00:00:00:01"}},
                          {{"name":"veth0123456789a","mac":"02:00:00:00:00:02"}},
                          {{"name":"eth0","mac":"02:00:00:00:00:03","sandbox":"/var/run/netns/p1"}}],
            "ips":[{{"version":"4","interface":2,"address":"10.22.0.5/24","gateway":"10.22.0.1"}},
                   {{"version":"6","interface":2,"address":"fd00::5/64","gateway":"fd00::1"}}],
            "routes":[{{"dst":"0.0.0.0/0","gw":"10.22.0.1"}}],
            "dns":{{}}}}"#
        ))
        .unwrap()
    }

    #[test]
    fn golden_0_3_0_0_3_1_0_4_0() {
        for v in ["0.3.0", "0.3.1", "0.4.0"] {
            let out = sample().to_json(v, Version::parse(v).unwrap());
            assert_eq!(out, golden_0x(v), "version {v}");
        }
    }

    #[test]
    fn golden_1_0_0() {
        let out = sample().to_json("1.0.0", Version::V1_0_0);
        let want: Value = serde_json::from_str(
            r#"{"cniVersion":"1.0.0",
            "interfaces":[{"name":"cni0","mac":"02:00:00:00:00:01"},
                          {"name":"veth0123456789a","mac":"02:00:00:00:00:02"},
                          {"name":"eth0","mac":"02:00:00:00:00:03","sandbox":"/var/run/netns/p1"}],
            "ips":[{"interface":2,"address":"10.22.0.5/24","gateway":"10.22.0.1"},
                   {"interface":2,"address":"fd00::5/64","gateway":"fd00::1"}],
            "routes":[{"dst":"0.0.0.0/0","gw":"10.22.0.1"}],
            "dns":{}}"#,
        )
        .unwrap();
        assert_eq!(out, want);
    }

    #[test]
    fn golden_1_1_0() {
        let mut r = sample();
        r.routes[0].priority = Some(10);
        r.dns.nameservers = vec!["10.22.0.10".into()];
        let out = r.to_json("1.1.0", Version::V1_1_0);
        let want: Value = serde_json::from_str(
            r#"{"cniVersion":"1.1.0",
            "interfaces":[{"name":"cni0","mac":"02:00:00:00:00:01","mtu":1400},
                          {"name":"veth0123456789a","mac":"02:00:00:00:00:02","mtu":1400},
                          {"name":"eth0","mac":"02:00:00:00:00:03","mtu":1400,"sandbox":"/var/run/netns/p1"}],
            "ips":[{"interface":2,"address":"10.22.0.5/24","gateway":"10.22.0.1"},
                   {"interface":2,"address":"fd00::5/64","gateway":"fd00::1"}],
            "routes":[{"dst":"0.0.0.0/0","gw":"10.22.0.1","priority":10}],
            "dns":{"nameservers":["10.22.0.10"]}}"#,
        )
        .unwrap();
        assert_eq!(out, want);
    }

    #[test]
    fn roundtrip_every_version() {
        for (v, parsed) in [
            ("0.3.0", Version(0, 3, 0)),
            ("0.3.1", Version(0, 3, 1)),
            ("0.4.0", Version::V0_4_0),
            ("1.0.0", Version::V1_0_0),
            ("1.1.0", Version::V1_1_0),
        ] {
            let mut want = sample();
            if parsed < Version::V1_1_0 {
                for i in &mut want.interfaces {
                    i.mtu = None;
                }
            }
            let back = AddResult::from_json(&sample().to_json(v, parsed)).unwrap();
            assert_eq!(back, want, "version {v}");
        }
    }

    #[test]
    fn reads_ipam_and_legacy_results() {
        // host-local's 1.0.0 answer: no interfaces, no interface index.
        let v: Value = serde_json::from_str(
            r#"{"cniVersion":"1.0.0","ips":[{"address":"10.1.0.2/16","gateway":"10.1.0.1"}],
                "routes":[{"dst":"0.0.0.0/0"}],"dns":{}}"#,
        )
        .unwrap();
        let r = AddResult::from_json(&v).unwrap();
        assert_eq!(r.ips[0].interface, None);
        assert_eq!(r.routes[0].gw, None);
        let v: Value = serde_json::from_str(
            r#"{"cniVersion":"0.2.0","ip4":{"ip":"10.1.0.2/16","gateway":"10.1.0.1",
                "routes":[{"dst":"0.0.0.0/0"}]}}"#,
        )
        .unwrap();
        let r = AddResult::from_json(&v).unwrap();
        assert_eq!(r.ips.len(), 1);
        assert_eq!(r.routes.len(), 1);
        assert_eq!(
            AddResult::from_json(&json!({"ips": [{"address": "x"}]}))
                .unwrap_err()
                .code,
            6
        );
        assert_eq!(AddResult::from_json(&json!([])).unwrap_err().code, 6);
    }
}
