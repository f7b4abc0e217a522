//! The `ipam` section. `"type": "flowlane"` selects the built-in allocator,
//! which takes host-local's format: `ranges` (a list of range sets, one
//! address allocated from each set), or the legacy single-range keys
//! `subnet`/`rangeStart`/`rangeEnd`/`gateway`; plus `routes` and `dataDir`.
//! Any other type names a plugin in `CNI_PATH`.

use std::net::IpAddr;
use std::path::PathBuf;

use ipnetwork::IpNetwork;
use serde::Deserialize;
use serde_json::Value;

use super::super::error::{CniError, CniResult};
use super::super::result::Route;
use super::addr::{add, bits, from_bits, network_first_last};

pub const BUILTIN_TYPE: &str = "flowlane";
pub const DEFAULT_DATA_DIR: &str = flowlane_defaults::IPAM_DATA_DIR;

#[derive(Debug, Clone)]
pub enum IpamConf {
    BuiltIn(BuiltinConf),
    /// The IPAM plugin's binary name (`ipam.type`).
    Delegated(String),
}

#[derive(Debug, Clone)]
pub struct BuiltinConf {
    pub range_sets: Vec<RangeSet>,
    pub routes: Vec<Route>,
    /// `<dataDir>/<network name>`: where the leases of this network live.
    pub dir: PathBuf,
}

/// Ranges of one address family; one address is allocated per set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangeSet(pub Vec<Range>);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Range {
    /// Subnet with host bits cleared.
    pub subnet: IpNetwork,
    pub start: IpAddr,
    pub end: IpAddr,
    pub gateway: IpAddr,
}

impl Range {
    pub fn contains(&self, ip: IpAddr) -> bool {
        ip.is_ipv4() == self.start.is_ipv4()
            && bits(self.start) <= bits(ip)
            && bits(ip) <= bits(self.end)
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawRange {
    subnet: String,
    #[serde(default)]
    range_start: Option<IpAddr>,
    #[serde(default)]
    range_end: Option<IpAddr>,
    #[serde(default)]
    gateway: Option<IpAddr>,
}

#[derive(Deserialize)]
struct RawRoute {
    dst: String,
    #[serde(default)]
    gw: Option<String>,
    // CNI 1.1.0 route attributes.
    #[serde(default)]
    mtu: Option<u32>,
    #[serde(default)]
    advmss: Option<u32>,
    #[serde(default)]
    priority: Option<u32>,
    #[serde(default)]
    table: Option<u32>,
    #[serde(default)]
    scope: Option<u32>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawIpam {
    #[serde(default, rename = "type")]
    ipam_type: Option<String>,
    #[serde(default)]
    ranges: Option<Vec<Vec<RawRange>>>,
    #[serde(default)]
    subnet: Option<String>,
    #[serde(default)]
    range_start: Option<IpAddr>,
    #[serde(default)]
    range_end: Option<IpAddr>,
    #[serde(default)]
    gateway: Option<IpAddr>,
    #[serde(default)]
    routes: Option<Vec<RawRoute>>,
    #[serde(default)]
    data_dir: Option<String>,
}

impl IpamConf {
    /// `Ok(None)` when the section names no type (layer-2 only, as the
    /// reference bridge plugin treats it).
    pub fn parse(v: Value, network: &str) -> CniResult<Option<IpamConf>> {
        let raw: RawIpam = serde_json::from_value(v)
            .map_err(|e| CniError::config("invalid ipam configuration").with_details(e))?;
        let ipam_type = raw.ipam_type.clone().unwrap_or_default();
        if ipam_type.is_empty() {
            return Ok(None);
        }
        if ipam_type.contains('/') || ipam_type.contains('\\') || ipam_type.starts_with('.') {
            return Err(CniError::config(format!("invalid ipam type {ipam_type:?}")));
        }
        if ipam_type != BUILTIN_TYPE {
            return Ok(Some(IpamConf::Delegated(ipam_type)));
        }
        Ok(Some(IpamConf::BuiltIn(builtin(raw, network)?)))
    }
}

fn builtin(raw: RawIpam, network: &str) -> CniResult<BuiltinConf> {
    let mut raw_sets = raw.ranges.unwrap_or_default();
    if let Some(subnet) = raw.subnet {
        raw_sets.insert(
            0,
            vec![RawRange {
                subnet,
                range_start: raw.range_start,
                range_end: raw.range_end,
                gateway: raw.gateway,
            }],
        );
    }
    if raw_sets.is_empty() {
        return Err(CniError::config("ipam: no IP ranges specified"));
    }
    let mut range_sets = Vec::new();
    for (i, set) in raw_sets.into_iter().enumerate() {
        if set.is_empty() {
            return Err(CniError::config(format!("ipam: range set {i} is empty")));
        }
        let ranges = set
            .into_iter()
            .map(canonical_range)
            .collect::<CniResult<Vec<_>>>()?;
        let v4 = ranges[0].subnet.is_ipv4();
        if ranges.iter().any(|r| r.subnet.is_ipv4() != v4) {
            return Err(CniError::config(format!(
                "ipam: range set {i} mixes IPv4 and IPv6"
            )));
        }
        range_sets.push(RangeSet(ranges));
    }
    // No two ranges anywhere may overlap (host-local's rule).
    let all: Vec<&Range> = range_sets.iter().flat_map(|s| s.0.iter()).collect();
    for (a_i, a) in all.iter().enumerate() {
        for b in &all[a_i + 1..] {
            if a.subnet.is_ipv4() == b.subnet.is_ipv4()
                && bits(a.start) <= bits(b.end)
                && bits(b.start) <= bits(a.end)
            {
                return Err(CniError::config(format!(
                    "ipam: ranges {} and {} overlap",
                    a.subnet, b.subnet
                )));
            }
        }
    }
    let mut routes = Vec::new();
    for r in raw.routes.unwrap_or_default() {
        let dst: IpNetwork = r
            .dst
            .parse()
            .map_err(|_| CniError::config(format!("ipam: invalid route dst {:?}", r.dst)))?;
        let gw = match r.gw.as_deref() {
            None | Some("") => None,
            Some(g) => Some(
                g.parse()
                    .map_err(|_| CniError::config(format!("ipam: invalid route gw {g:?}")))?,
            ),
        };
        if r.scope.is_some_and(|sc| sc > 255) {
            return Err(CniError::config(format!(
                "ipam: route {dst}: scope must be 0..255"
            )));
        }
        routes.push(Route {
            mtu: r.mtu,
            advmss: r.advmss,
            priority: r.priority,
            table: r.table,
            scope: r.scope,
            ..Route::new(dst, gw)
        });
    }
    let data_dir = raw.data_dir.unwrap_or_else(|| DEFAULT_DATA_DIR.to_string());
    if !data_dir.starts_with('/') {
        return Err(CniError::config(format!(
            "ipam: dataDir must be an absolute path, got {data_dir:?}"
        )));
    }
    Ok(BuiltinConf {
        range_sets,
        routes,
        dir: PathBuf::from(data_dir).join(network),
    })
}

/// host-local's `Range.Canonicalize`: defaults and bounds.
fn canonical_range(r: RawRange) -> CniResult<Range> {
    let bad = |why: String| Err(CniError::config(format!("ipam: range {}: {why}", r.subnet)));
    let net: IpNetwork = match r.subnet.parse() {
        Ok(n) => n,
        Err(_) => return bad("not a CIDR subnet".into()),
    };
    let width = if net.is_ipv4() { 32 } else { 128 };
    if net.prefix() > width - 2 {
        return bad("network too small to allocate from".into());
    }
    let subnet = IpNetwork::new(net.network(), net.prefix()).expect("prefix already valid");
    let (first, last) = network_first_last(subnet);
    // Usable: after the network address, before the broadcast address.
    let lo = add(first, 1);
    let hi = from_bits(bits(last) - 1, subnet.is_ipv4());
    let inside = |ip: IpAddr| {
        ip.is_ipv4() == subnet.is_ipv4() && bits(lo) <= bits(ip) && bits(ip) <= bits(hi)
    };
    let start = r.range_start.unwrap_or(lo);
    let end = r.range_end.unwrap_or(hi);
    if !inside(start) {
        return bad(format!(
            "rangeStart {start} outside the usable range {lo}-{hi}"
        ));
    }
    if !inside(end) {
        return bad(format!("rangeEnd {end} outside the usable range {lo}-{hi}"));
    }
    if bits(start) > bits(end) {
        return bad(format!("rangeStart {start} after rangeEnd {end}"));
    }
    let gateway = r.gateway.unwrap_or(lo);
    if !subnet.contains(gateway) {
        return bad(format!("gateway {gateway} outside the subnet"));
    }
    Ok(Range {
        subnet,
        start,
        end,
        gateway,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn conf(v: Value) -> BuiltinConf {
        match IpamConf::parse(v, "n1").unwrap().unwrap() {
            IpamConf::BuiltIn(b) => b,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn legacy_keys_and_defaults() {
        let c = conf(json!({"type": "flowlane", "subnet": "10.5.0.7/24"}));
        let r = &c.range_sets[0].0[0];
        assert_eq!(r.subnet.to_string(), "10.5.0.0/24");
        assert_eq!(r.start.to_string(), "10.5.0.1");
        assert_eq!(r.end.to_string(), "10.5.0.254");
        assert_eq!(r.gateway.to_string(), "10.5.0.1");
        assert_eq!(c.dir, PathBuf::from("/var/lib/cni/networks/n1"));
    }

    #[test]
    fn ranges_dual_stack_routes_datadir() {
        let c = conf(json!({"type": "flowlane", "dataDir": "/tmp/x",
            "ranges": [[{"subnet": "10.5.0.0/24", "rangeStart": "10.5.0.10", "rangeEnd": "10.5.0.20", "gateway": "10.5.0.254"}],
                       [{"subnet": "fd00:5::/64"}]],
            "routes": [{"dst": "0.0.0.0/0"}, {"dst": "10.9.0.0/16", "gw": "10.5.0.1"}]}));
        assert_eq!(c.range_sets.len(), 2);
        assert_eq!(c.range_sets[0].0[0].gateway.to_string(), "10.5.0.254");
        assert_eq!(c.range_sets[1].0[0].start.to_string(), "fd00:5::1");
        assert_eq!(c.routes.len(), 2);
        assert_eq!(c.dir, PathBuf::from("/tmp/x/n1"));
        let c11 = conf(json!({"type": "flowlane", "subnet": "10.5.0.0/24",
            "routes": [{"dst": "192.0.2.0/24", "mtu": 1300, "advmss": 1200, "priority": 55, "table": 100, "scope": 253}]}));
        let r = &c11.routes[0];
        assert_eq!(
            (r.mtu, r.advmss, r.priority, r.table, r.scope),
            (Some(1300), Some(1200), Some(55), Some(100), Some(253))
        );
        let bad = IpamConf::parse(
            json!({"type": "flowlane", "subnet": "10.5.0.0/24",
            "routes": [{"dst": "192.0.2.0/24", "mtu": "x"}]}),
            "n1",
        );
        assert_eq!(bad.unwrap_err().code, 7);
    }

    #[test]
    fn other_types_delegate_and_empty_type_is_layer2() {
        assert!(matches!(
            IpamConf::parse(json!({"type": "host-local"}), "n").unwrap(),
            Some(IpamConf::Delegated(t)) if t == "host-local"
        ));
        assert!(IpamConf::parse(json!({}), "n").unwrap().is_none());
    }
}
