//! CNI results: checking a result document against the shape its
//! `cniVersion` prescribes, and reading its interfaces, IPs and routes.

use std::net::IpAddr;

use serde_json::Value;

/// One `ips` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResultIp {
    pub address: IpAddr,
    pub prefix: u8,
    pub gateway: Option<IpAddr>,
    pub interface: Option<usize>,
}

impl ResultIp {
    pub fn cidr(&self) -> String {
        format!("{}/{}", self.address, self.prefix)
    }
}

/// One `interfaces` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResultIface {
    pub name: String,
    pub mac: String,
    pub sandbox: Option<String>,
}

/// A result reduced to what the tests compare.
#[derive(Debug, Clone)]
pub struct CniResult {
    pub version: String,
    pub interfaces: Vec<ResultIface>,
    pub ips: Vec<ResultIp>,
    /// `(dst, gw)` pairs.
    pub routes: Vec<(String, Option<IpAddr>)>,
    pub raw: Value,
}

impl CniResult {
    /// The interface entry that lives in the sandbox `netns`.
    pub fn sandbox_iface(&self, netns: &str) -> Option<&ResultIface> {
        self.interfaces
            .iter()
            .find(|i| i.sandbox.as_deref() == Some(netns))
    }

    pub fn ipv4(&self) -> Option<&ResultIp> {
        self.ips.iter().find(|i| i.address.is_ipv4())
    }

    pub fn ipv6(&self) -> Option<&ResultIp> {
        self.ips.iter().find(|i| i.address.is_ipv6())
    }
}

fn parse_cidr(s: &str) -> Option<(IpAddr, u8)> {
    let (a, p) = s.split_once('/')?;
    Some((a.parse().ok()?, p.parse().ok()?))
}

fn is_mac(s: &str) -> bool {
    let parts: Vec<&str> = s.split(':').collect();
    parts.len() == 6
        && parts
            .iter()
            .all(|p| p.len() == 2 && p.chars().all(|c| c.is_ascii_hexdigit()))
}

/// Parses `v` and checks it is a well-formed result for `version`:
/// `cniVersion` echoes it; `ips[].version` is present ("4"/"6", matching the
/// address) for 0.3.x/0.4.0 and absent for 1.x; every `ips[].interface`
/// indexes `interfaces`; addresses are CIDRs; MACs are MACs.
pub fn validate(version: &str, v: &Value) -> Result<CniResult, String> {
    let got = v["cniVersion"].as_str().ok_or("no cniVersion")?;
    if got != version {
        return Err(format!("cniVersion {got:?}, requested {version:?}"));
    }
    let legacy = version.starts_with("0.");
    let mut interfaces = Vec::new();
    for i in v["interfaces"].as_array().cloned().unwrap_or_default() {
        let name = i["name"]
            .as_str()
            .ok_or("interface without name")?
            .to_string();
        let mac = i["mac"].as_str().unwrap_or_default().to_string();
        if !mac.is_empty() && !is_mac(&mac) {
            return Err(format!("interface {name}: bad mac {mac:?}"));
        }
        interfaces.push(ResultIface {
            name,
            mac,
            sandbox: i["sandbox"].as_str().map(str::to_string),
        });
    }
    let mut ips = Vec::new();
    for ip in v["ips"].as_array().cloned().unwrap_or_default() {
        let addr = ip["address"].as_str().ok_or("ip without address")?;
        let (address, prefix) = parse_cidr(addr).ok_or(format!("bad address {addr:?}"))?;
        let fam = if address.is_ipv4() { "4" } else { "6" };
        match (legacy, ip.get("version").and_then(Value::as_str)) {
            (true, Some(f)) if f == fam => {}
            (true, other) => return Err(format!("{version}: ips[].version {other:?} for {addr}")),
            (false, None) => {}
            (false, Some(f)) => {
                return Err(format!("{version}: ips[].version {f:?} must be absent"))
            }
        }
        let gateway = match ip.get("gateway").and_then(Value::as_str) {
            Some(g) => Some(g.parse().map_err(|_| format!("bad gateway {g:?}"))?),
            None => None,
        };
        let interface = match ip.get("interface") {
            Some(Value::Number(n)) => {
                let idx = n.as_u64().ok_or("bad interface index")? as usize;
                if idx >= interfaces.len() {
                    return Err(format!("ips[].interface {idx} out of range"));
                }
                Some(idx)
            }
            None | Some(Value::Null) => None,
            Some(other) => return Err(format!("ips[].interface {other} is not an index")),
        };
        ips.push(ResultIp {
            address,
            prefix,
            gateway,
            interface,
        });
    }
    let mut routes = Vec::new();
    for r in v["routes"].as_array().cloned().unwrap_or_default() {
        let dst = r["dst"].as_str().ok_or("route without dst")?;
        parse_cidr(dst).ok_or(format!("bad route dst {dst:?}"))?;
        let gw = match r.get("gw").and_then(Value::as_str) {
            Some(g) => Some(g.parse().map_err(|_| format!("bad route gw {g:?}"))?),
            None => None,
        };
        routes.push((dst.to_string(), gw));
    }
    Ok(CniResult {
        version: version.to_string(),
        interfaces,
        ips,
        routes,
        raw: v.clone(),
    })
}

/// [`validate`] that panics with the document on failure.
pub fn expect_valid(version: &str, v: &Value) -> CniResult {
    validate(version, v).unwrap_or_else(|e| panic!("invalid {version} result ({e}): {v:#}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn legacy_results_need_ip_version_and_new_ones_forbid_it() {
        let r = json!({"cniVersion":"0.3.1","interfaces":[{"name":"eth0","mac":"0a:58:0a:00:00:02","sandbox":"/x"}],
            "ips":[{"version":"4","address":"10.0.0.2/24","gateway":"10.0.0.1","interface":0}]});
        let p = validate("0.3.1", &r).unwrap();
        assert_eq!(p.ipv4().unwrap().cidr(), "10.0.0.2/24");
        assert!(validate("1.0.0", &r).is_err(), "wrong cniVersion");
        let mut r1 = r.clone();
        r1["cniVersion"] = json!("1.0.0");
        assert!(validate("1.0.0", &r1).is_err(), "version field in 1.0.0");
        r1["ips"][0].as_object_mut().unwrap().remove("version");
        assert!(validate("1.0.0", &r1).is_ok());
        r1["ips"][0]["interface"] = json!(3);
        assert!(
            validate("1.0.0", &r1).is_err(),
            "interface index out of range"
        );
    }
}
