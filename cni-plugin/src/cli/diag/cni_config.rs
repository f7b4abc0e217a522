//! Is a flowlane network config installed, valid, and the one the runtime
//! will use?
//!
//! Runtimes (containerd's CRI through go-cni, CRI-O, the kubelet's old
//! dockershim) list `*.conf`, `*.conflist` and `*.json` in the config
//! directory, sort the names lexically and load the first one. A first file
//! that does not parse leaves every new pod without a network.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use ipnetwork::IpNetwork;
use serde_json::Value;

use super::report::Section;

/// Extensions a runtime considers, as libcni's `ConfFiles`.
const EXTENSIONS: [&str; 3] = ["conf", "conflist", "json"];

/// One IPAM range of the flowlane network.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Range {
    pub subnet: IpNetwork,
    pub gateway: Option<IpAddr>,
    pub range_start: Option<IpAddr>,
    pub range_end: Option<IpAddr>,
}

/// What the rest of the diagnosis needs from the flowlane config.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FlowlaneNet {
    pub file: PathBuf,
    pub network: String,
    pub cni_version: String,
    pub bridge: String,
    pub is_gateway: bool,
    pub plugin_types: Vec<String>,
    pub ipam_type: Option<String>,
    /// Lease directory of the network (host-local layout), when the IPAM is
    /// the built-in one or host-local.
    pub lease_dir: Option<PathBuf>,
    pub ranges: Vec<Range>,
    pub state_dir: Option<PathBuf>,
    pub daemon_socket: Option<PathBuf>,
    /// `"mode": "chained"`: an earlier plugin wires the pods (its bridge,
    /// IPAM and routes are not flowlane's to check).
    pub chained: bool,
}

/// The default of both the built-in IPAM and host-local.
const DEFAULT_IPAM_DATA_DIR: &str = flowlane_defaults::IPAM_DATA_DIR;
/// The reference bridge plugin's default bridge name, which flowlane keeps.
const DEFAULT_BRIDGE: &str = "cni0";

pub fn check(conf_dir: &Path) -> (Section, Option<FlowlaneNet>) {
    let mut s = Section::new(
        "cni_config",
        format!("CNI configuration ({})", conf_dir.display()),
    );
    let files = match config_files(conf_dir) {
        Ok(f) => f,
        Err(e) => {
            s.error(
                "cni.conf_dir_missing",
                format!("cannot read {}: {e}", conf_dir.display()),
                "install the flowlane conflist (deploy/ writes it from the DaemonSet's init \
                 container), or point --cni-conf-dir at the runtime's config directory",
            );
            return (s, None);
        }
    };
    if files.is_empty() {
        s.error(
            "cni.no_config",
            format!("no *.conf, *.conflist or *.json file in {}", conf_dir.display()),
            "install the flowlane conflist; until then the runtime reports the network as not ready",
        );
        return (s, None);
    }

    let mut parsed: Vec<(PathBuf, Result<Value, String>)> = files
        .into_iter()
        .map(|p| {
            let r = std::fs::read(&p)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<Value>(&b).map_err(|e| e.to_string()));
            (p, r)
        })
        .collect();
    let (first_path, first) = parsed.remove(0);
    let first_name = file_name(&first_path);

    let mut net = None;
    match &first {
        Err(e) => s.error(
            "cni.invalid_json",
            format!("{first_name} (the file the runtime loads first) is not valid JSON: {e}"),
            format!(
                "fix or remove {}; the runtime cannot set up any pod network until it parses",
                first_path.display()
            ),
        ),
        Ok(v) => {
            match network_shape(&first_path, v) {
                Err(why) => s.error(
                    "cni.invalid_config",
                    format!("{first_name} is not a usable network config: {why}"),
                    format!("rewrite {} from deploy/'s conflist", first_path.display()),
                ),
                Ok(plugins) => {
                    let pos = plugins
                        .iter()
                        .position(|p| p.get("type").and_then(Value::as_str) == Some("flowlane"));
                    match pos {
                        None => {
                            let types = plugin_types(&plugins).join(", ");
                            s.error(
                            "cni.not_flowlane",
                            format!("{first_name} is the config the runtime uses, and it is not flowlane (plugins: {types})"),
                            "flowlane's conflist must sort first in the config directory \
                             (name it e.g. 00-flowlane.conflist), or remove the other network's config",
                        );
                        }
                        Some(i) => {
                            let cfg = describe(&first_path, v, &plugins, i);
                            s.ok(
                            "cni.config_ok",
                            format!(
                                "{first_name} is the config the runtime uses: network {:?}, cniVersion {}, plugins {}",
                                cfg.network,
                                cfg.cni_version,
                                cfg.plugin_types.join(" -> ")
                            ),
                        );
                            if cfg.chained {
                                chained_findings(&mut s, &cfg, i);
                            } else if i != 0 {
                                s.warn(
                                "cni.flowlane_not_first_plugin",
                                format!("flowlane is plugin #{} of the chain, not the first", i + 1),
                                "flowlane creates the interface; put it first and chained plugins \
                                 (portmap, bandwidth, tuning) after it",
                            );
                            }
                            if cfg.ipam_type.is_none() && !cfg.chained {
                                s.warn(
                                "cni.no_ipam",
                                "the flowlane plugin has no ipam section: pods get no addresses",
                                "add \"ipam\": {\"type\": \"flowlane\", \"ranges\": [[{\"subnet\": \"<node pod CIDR>\"}]]}",
                            );
                            }
                            net = Some(cfg);
                        }
                    }
                }
            }
        }
    }

    // Files after the first are not loaded by the runtime; say so when they
    // could surprise someone (a flowlane config that is shadowed, or junk).
    for (path, r) in &parsed {
        let name = file_name(path);
        match r {
            Err(e) => s.warn(
                "cni.invalid_json_ignored",
                format!("{name} is not valid JSON ({e}); the runtime ignores it because it does not sort first"),
                format!("remove {} before it ever sorts first", path.display()),
            ),
            Ok(v) => {
                let is_flowlane = network_shape(path, v)
                    .map(|p| p.iter().any(|p| p.get("type").and_then(Value::as_str) == Some("flowlane")))
                    .unwrap_or(false);
                if is_flowlane && net.is_none() {
                    s.error(
                        "cni.flowlane_shadowed",
                        format!("flowlane's config {name} exists but {first_name} sorts before it, so the runtime never uses it"),
                        format!("rename {} so it sorts first, or remove {}", path.display(), first_path.display()),
                    );
                } else {
                    s.info("cni.other_config", format!("{name} is present but unused (it does not sort first)"));
                }
            }
        }
    }
    (s, net)
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn config_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .filter(|p| {
            p.extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| EXTENSIONS.contains(&e))
        })
        .collect();
    files.sort();
    Ok(files)
}

/// The plugin list of a `.conflist`, or the single plugin of a `.conf`/`.json`,
/// after the checks libcni makes before it would run anything.
fn network_shape(path: &Path, v: &Value) -> Result<Vec<Value>, String> {
    let obj = v.as_object().ok_or("not a JSON object")?;
    if obj
        .get("name")
        .and_then(Value::as_str)
        .is_none_or(str::is_empty)
    {
        return Err("no \"name\"".into());
    }
    if path.extension().is_some_and(|e| e == "conflist") {
        let plugins = obj
            .get("plugins")
            .and_then(Value::as_array)
            .ok_or("a .conflist needs a \"plugins\" array")?;
        if plugins.is_empty() {
            return Err("\"plugins\" is empty".into());
        }
        for (i, p) in plugins.iter().enumerate() {
            if p.get("type")
                .and_then(Value::as_str)
                .is_none_or(str::is_empty)
            {
                return Err(format!("plugin #{} has no \"type\"", i + 1));
            }
        }
        Ok(plugins.clone())
    } else {
        if obj
            .get("type")
            .and_then(Value::as_str)
            .is_none_or(str::is_empty)
        {
            return Err("no \"type\"".into());
        }
        Ok(vec![v.clone()])
    }
}

fn plugin_types(plugins: &[Value]) -> Vec<String> {
    plugins
        .iter()
        .filter_map(|p| p.get("type").and_then(Value::as_str).map(str::to_string))
        .collect()
}

fn describe(path: &Path, top: &Value, plugins: &[Value], idx: usize) -> FlowlaneNet {
    let p = &plugins[idx];
    let s = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
    let network = s(top, "name").unwrap_or_default();
    let ipam = p.get("ipam");
    let ipam_type = ipam.and_then(|i| s(i, "type"));
    let lease_dir = match ipam_type.as_deref() {
        Some("flowlane") | Some("host-local") => Some(
            PathBuf::from(
                ipam.and_then(|i| s(i, "dataDir"))
                    .unwrap_or_else(|| DEFAULT_IPAM_DATA_DIR.into()),
            )
            .join(&network),
        ),
        _ => None,
    };
    FlowlaneNet {
        file: path.to_path_buf(),
        cni_version: s(top, "cniVersion")
            .or_else(|| s(p, "cniVersion"))
            .unwrap_or_default(),
        network,
        bridge: s(p, "bridge").unwrap_or_else(|| DEFAULT_BRIDGE.into()),
        is_gateway: p.get("isGateway").and_then(Value::as_bool).unwrap_or(false),
        plugin_types: plugin_types(plugins),
        ipam_type,
        lease_dir,
        ranges: ipam.map(ranges).unwrap_or_default(),
        state_dir: s(p, "stateDir").map(PathBuf::from),
        daemon_socket: s(p, "daemonSocket").map(PathBuf::from),
        chained: s(p, "mode").as_deref() == Some("chained"),
    }
}

/// flowlane chained at plugin `i`: after the plugin that wires the pods.
fn chained_findings(s: &mut Section, cfg: &FlowlaneNet, i: usize) {
    if i == 0 {
        s.error(
            "cni.chained_first",
            "flowlane is in chained mode but is the first plugin: nothing wires the pods (ADD fails without prevResult)",
            "put the CNI that wires pods (bridge, calico, cilium, flannel) before flowlane, or drop \"mode\": \"chained\"",
        );
    } else {
        s.ok(
            "cni.chained",
            format!(
                "flowlane is chained after {}: that plugin wires the pods, flowlane records them",
                cfg.plugin_types[..i].join(" -> ")
            ),
        );
    }
}

/// host-local's `ranges` (a list of range sets) or its legacy `subnet` form.
fn ranges(ipam: &Value) -> Vec<Range> {
    let ip = |v: &Value, k: &str| {
        v.get(k)
            .and_then(Value::as_str)
            .and_then(|s| s.parse().ok())
    };
    let one = |r: &Value| -> Option<Range> {
        Some(Range {
            subnet: r.get("subnet")?.as_str()?.parse().ok()?,
            gateway: ip(r, "gateway"),
            range_start: ip(r, "rangeStart"),
            range_end: ip(r, "rangeEnd"),
        })
    };
    let mut out = Vec::new();
    if let Some(sets) = ipam.get("ranges").and_then(Value::as_array) {
        for set in sets {
            for r in set.as_array().into_iter().flatten() {
                out.extend(one(r));
            }
        }
    } else {
        out.extend(one(ipam));
    }
    out
}

impl Range {
    /// The gateway as host-local computes it: given, or the subnet's first host.
    pub fn effective_gateway(&self) -> Option<IpAddr> {
        self.gateway.or_else(|| nth_host(self.subnet, 1))
    }
}

/// The `n`th address of a network (0 = the network address).
pub fn nth_host(net: IpNetwork, n: u128) -> Option<IpAddr> {
    match net.network() {
        IpAddr::V4(a) => u32::try_from(u128::from(u32::from(a)) + n)
            .ok()
            .map(|x| IpAddr::V4(x.into())),
        IpAddr::V6(a) => u128::from(a).checked_add(n).map(|x| IpAddr::V6(x.into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::diag::report::Severity;

    struct Dir(PathBuf);
    impl Dir {
        fn new(tag: &str) -> Dir {
            let d = std::env::temp_dir()
                .join(format!("flowlane-diag-cni-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).unwrap();
            Dir(d)
        }
        fn write(&self, name: &str, body: &str) {
            std::fs::write(self.0.join(name), body).unwrap();
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn ids(s: &Section) -> Vec<(&'static str, Severity)> {
        s.findings.iter().map(|f| (f.id, f.severity)).collect()
    }

    const FLOWLANE: &str = r#"{"cniVersion": "1.1.0", "name": "pods", "plugins": [
        {"type": "flowlane", "bridge": "br-pods", "isGateway": true, "stateDir": "/srv/fl",
         "ipam": {"type": "flowlane", "dataDir": "/srv/ipam",
                  "ranges": [[{"subnet": "10.204.9.0/24", "rangeStart": "10.204.9.10", "rangeEnd": "10.204.9.50"}],
                             [{"subnet": "fd00:204:9::/64"}]]}},
        {"type": "portmap", "capabilities": {"portMappings": true}}]}"#;

    #[test]
    fn the_first_file_in_lexical_order_is_the_one_checked() {
        let d = Dir::new("order");
        d.write("10-flowlane.conflist", FLOWLANE);
        d.write("99-junk.conf", "{ nope");
        d.write("README", "not a config: ignored");
        let (s, net) = check(&d.0);
        assert_eq!(
            ids(&s),
            vec![
                ("cni.config_ok", Severity::Ok),
                ("cni.invalid_json_ignored", Severity::Warning)
            ]
        );
        let net = net.expect("flowlane config described");
        assert_eq!(net.network, "pods");
        assert_eq!(net.bridge, "br-pods");
        assert!(net.is_gateway);
        assert_eq!(net.plugin_types, vec!["flowlane", "portmap"]);
        assert_eq!(net.lease_dir, Some(PathBuf::from("/srv/ipam/pods")));
        assert_eq!(net.state_dir, Some(PathBuf::from("/srv/fl")));
        assert_eq!(net.ranges.len(), 2);
        assert_eq!(
            net.ranges[0].effective_gateway(),
            Some("10.204.9.1".parse().unwrap())
        );
        assert_eq!(
            net.ranges[1].effective_gateway(),
            Some("fd00:204:9::1".parse().unwrap())
        );

        // A broken file that sorts first breaks the node even though flowlane's is fine.
        d.write("00-broken.conflist", "{\"name\": ");
        let (s, net) = check(&d.0);
        assert!(net.is_none());
        assert_eq!(s.findings[0].id, "cni.invalid_json");
        assert_eq!(s.findings[0].severity, Severity::Error);
        assert!(ids(&s).contains(&("cni.flowlane_shadowed", Severity::Error)));
    }

    #[test]
    fn a_chained_flowlane_is_checked_as_chained() {
        let d = Dir::new("chained");
        d.write(
            "10-bridge.conflist",
            r#"{"cniVersion": "1.0.0", "name": "cbr", "plugins": [
                {"type": "bridge", "bridge": "cbr0", "ipam": {"type": "host-local", "subnet": "10.232.7.0/24"}},
                {"type": "portmap"},
                {"type": "flowlane", "mode": "chained", "stateDir": "/srv/fl"}]}"#,
        );
        let (s, net) = check(&d.0);
        assert_eq!(
            ids(&s),
            vec![
                ("cni.config_ok", Severity::Ok),
                ("cni.chained", Severity::Ok)
            ]
        );
        let net = net.expect("chained config described");
        assert!(net.chained);
        let b = super::super::bridge::check(Some(&net));
        assert_eq!(ids(&b), vec![("bridge.chained", Severity::Info)]);
        let i = super::super::ipam::check(Some(&net), &[]);
        assert_eq!(ids(&i), vec![("ipam.chained", Severity::Info)]);

        d.write(
            "00-alone.conflist",
            r#"{"cniVersion": "1.0.0", "name": "x", "plugins": [{"type": "flowlane", "mode": "chained"}]}"#,
        );
        let (s, _) = check(&d.0);
        assert!(ids(&s).contains(&("cni.chained_first", Severity::Error)));
    }

    #[test]
    fn configs_that_are_not_usable_are_explained() {
        for (name, body, id) in [
            (
                "a.conflist",
                r#"{"name": "x", "plugins": []}"#,
                "cni.invalid_config",
            ),
            (
                "a.conflist",
                r#"{"name": "x", "plugins": [{"bridge": "b"}]}"#,
                "cni.invalid_config",
            ),
            ("a.conf", r#"{"name": "x"}"#, "cni.invalid_config"),
            ("a.conf", r#"{"type": "flowlane"}"#, "cni.invalid_config"),
            ("a.json", r#"[1, 2]"#, "cni.invalid_config"),
            (
                "a.conf",
                r#"{"name": "x", "type": "bridge"}"#,
                "cni.not_flowlane",
            ),
        ] {
            let d = Dir::new("bad");
            d.write(name, body);
            let (s, net) = check(&d.0);
            assert!(net.is_none(), "{body}");
            assert_eq!(s.findings[0].id, id, "{body}");
            assert!(s.findings[0].fix.is_some());
        }
        let d = Dir::new("empty");
        assert_eq!(check(&d.0).0.findings[0].id, "cni.no_config");
        assert_eq!(
            check(&d.0.join("missing")).0.findings[0].id,
            "cni.conf_dir_missing"
        );
    }

    #[test]
    fn a_single_plugin_conf_and_defaults_are_understood() {
        let d = Dir::new("conf");
        d.write(
            "50-fl.conf",
            r#"{"cniVersion": "1.0.0", "name": "n1", "type": "flowlane", "ipam": {"type": "flowlane", "subnet": "10.204.8.0/24"}}"#,
        );
        let (s, net) = check(&d.0);
        assert_eq!(s.findings[0].id, "cni.config_ok");
        let net = net.unwrap();
        assert_eq!(net.bridge, "cni0", "the reference bridge plugin's default");
        assert!(!net.is_gateway);
        assert_eq!(
            net.lease_dir,
            Some(PathBuf::from("/var/lib/cni/networks/n1"))
        );
        assert_eq!(net.ranges[0].subnet.to_string(), "10.204.8.0/24");

        d.write(
            "50-fl.conf",
            r#"{"name": "n1", "type": "flowlane", "ipam": {"type": "dhcp"}}"#,
        );
        assert_eq!(
            check(&d.0).1.unwrap().lease_dir,
            None,
            "leases of other IPAM plugins are not ours to read"
        );
        d.write("50-fl.conf", r#"{"name": "n1", "type": "flowlane"}"#);
        assert!(ids(&check(&d.0).0).contains(&("cni.no_ipam", Severity::Warning)));
    }
}
