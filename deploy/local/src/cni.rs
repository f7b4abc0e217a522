//! Invoking the node's CNI network exactly as a container runtime does:
//! the conflist's plugins in order for ADD (each given the previous one's
//! result as `prevResult`), in reverse for DEL, each found by `type` in
//! `CNI_PATH`, run as the node's "host" (inside the node namespace) with the
//! CNI environment and the plugin's config on stdin.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

use crate::procs;
use crate::spec::{Binaries, ClusterSpec, NODE_BRIDGE};

/// Kubernetes namespace the cluster's pods claim in `CNI_ARGS`.
pub const POD_NAMESPACE: &str = "flowlane-cluster";

/// The node's conflist, from the plugin's template under `deploy/local/`.
pub fn render_conflist(spec: &ClusterSpec, node: u32) -> String {
    let dir = spec.node_dir(node);
    spec.plugin
        .conflist_template()
        .replace("${BRIDGE}", NODE_BRIDGE)
        .replace("${POD_CIDR}", &spec.pod_cidr(node))
        .replace("${GATEWAY}", &spec.gateway(node).to_string())
        .replace("${STATE_DIR}", &dir.join("state").display().to_string())
        .replace("${IPAM_DIR}", &dir.join("ipam").display().to_string())
        .replace(
            "${DAEMON_SOCKET}",
            &spec.daemon_socket(node).display().to_string(),
        )
        .replace("${LOG_FILE}", &dir.join("cni.log").display().to_string())
}

/// Where the runtime keeps a pod's ADD result for its DEL (libcni's cache).
fn result_cache(spec: &ClusterSpec, node: u32, container_id: &str) -> PathBuf {
    spec.node_dir(node)
        .join("results")
        .join(format!("{container_id}.json"))
}

/// A pod to attach or detach.
pub struct PodRef<'a> {
    pub node: u32,
    pub pod_name: &'a str,
    pub netns: &'a str,
    pub container_id: &'a str,
}

fn find_plugin(cni_path: &str, kind: &str) -> Result<PathBuf, String> {
    if kind.contains('/') || kind.is_empty() {
        return Err(format!("invalid plugin type {kind:?}"));
    }
    cni_path
        .split(':')
        .map(|d| Path::new(d).join(kind))
        .find(|p| p.is_file())
        .ok_or_else(|| format!("CNI plugin {kind:?} not found in CNI_PATH {cni_path}"))
}

fn invoke(
    spec: &ClusterSpec,
    bins: &Binaries,
    pod: &PodRef,
    command: &str,
    conf: &Value,
) -> Result<Value, String> {
    let kind = conf["type"].as_str().unwrap_or_default();
    let cni_path = bins.cni_path();
    let plugin = find_plugin(&cni_path, kind)?;
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &spec.node_netns(pod.node)])
        .arg(&plugin)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", pod.container_id)
        .env("CNI_NETNS", format!("/var/run/netns/{}", pod.netns))
        .env("CNI_IFNAME", "eth0")
        .env(
            "CNI_ARGS",
            format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE={POD_NAMESPACE};K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={}",
                pod.pod_name, pod.container_id
            ),
        )
        .env("CNI_PATH", &cni_path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    procs::die_with_parent(&mut cmd);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("run {}: {e}", plugin.display()))?;
    let input = serde_json::to_vec(conf).map_err(|e| e.to_string())?;
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(&input);
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("wait for {}: {e}", plugin.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "CNI {command} by {kind} for {} failed ({}): {} {}",
            pod.pod_name,
            out.status,
            stdout.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    if command == "DEL" || stdout.trim().is_empty() {
        return Ok(Value::Null);
    }
    serde_json::from_str(&stdout)
        .map_err(|e| format!("CNI {command} by {kind}: result is not JSON ({e}): {stdout}"))
}

/// The per-plugin configs of a conflist, each with the list's name and version.
fn plugin_confs(conflist: &Value) -> Result<Vec<Value>, String> {
    let plugins = conflist["plugins"]
        .as_array()
        .ok_or("conflist has no plugins")?;
    Ok(plugins
        .iter()
        .map(|p| {
            let mut c = p.clone();
            c["name"] = conflist["name"].clone();
            c["cniVersion"] = conflist["cniVersion"].clone();
            c
        })
        .collect())
}

/// CNI ADD of the whole list; returns the final result (and caches it).
pub fn add(spec: &ClusterSpec, bins: &Binaries, pod: &PodRef) -> Result<Value, String> {
    let conflist: Value =
        serde_json::from_str(&render_conflist(spec, pod.node)).map_err(|e| e.to_string())?;
    let mut prev = Value::Null;
    for mut conf in plugin_confs(&conflist)? {
        if !prev.is_null() {
            conf["prevResult"] = prev.clone();
        }
        prev = invoke(spec, bins, pod, "ADD", &conf)?;
    }
    let cache = result_cache(spec, pod.node, pod.container_id);
    if let Some(d) = cache.parent() {
        std::fs::create_dir_all(d).map_err(|e| e.to_string())?;
    }
    std::fs::write(
        &cache,
        serde_json::to_vec(&prev).map_err(|e| e.to_string())?,
    )
    .map_err(|e| format!("{}: {e}", cache.display()))?;
    Ok(prev)
}

/// CNI DEL of the whole list, in reverse order, with the cached result.
pub fn del(spec: &ClusterSpec, bins: &Binaries, pod: &PodRef) -> Result<(), String> {
    let conflist: Value =
        serde_json::from_str(&render_conflist(spec, pod.node)).map_err(|e| e.to_string())?;
    let cache = result_cache(spec, pod.node, pod.container_id);
    let prev: Value = std::fs::read(&cache)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null);
    let mut errors = Vec::new();
    for mut conf in plugin_confs(&conflist)?.into_iter().rev() {
        if !prev.is_null() {
            conf["prevResult"] = prev.clone();
        }
        if let Err(e) = invoke(spec, bins, pod, "DEL", &conf) {
            errors.push(e);
        }
    }
    let _ = std::fs::remove_file(&cache);
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

/// The first IPv4 address (without prefix) of a CNI result.
pub fn first_ipv4(result: &Value) -> Option<String> {
    result["ips"].as_array()?.iter().find_map(|ip| {
        let a = ip["address"].as_str()?;
        let addr = a.split('/').next()?;
        addr.parse::<std::net::Ipv4Addr>()
            .ok()
            .map(|_| addr.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::Plugin;
    use serde_json::json;

    #[test]
    fn conflists_render_to_valid_json() {
        for plugin in [Plugin::Flowlane, Plugin::Bridge] {
            let mut spec = ClusterSpec::new("t", 2, 1);
            spec.plugin = plugin;
            let v: Value = serde_json::from_str(&render_conflist(&spec, 1)).unwrap();
            let confs = plugin_confs(&v).unwrap();
            assert_eq!(confs[0]["name"], "flowlane-cluster");
            assert_eq!(confs[0]["ipam"]["ranges"][0][0]["subnet"], "10.210.1.0/24");
            assert!(!render_conflist(&spec, 1).contains("${"));
        }
    }

    #[test]
    fn first_ipv4_skips_v6() {
        let r = json!({"ips": [{"address": "fd00::2/64"}, {"address": "10.1.2.3/24"}]});
        assert_eq!(first_ipv4(&r).as_deref(), Some("10.1.2.3"));
        assert_eq!(first_ipv4(&json!({})), None);
    }
}
