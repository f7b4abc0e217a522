//! `kubectl exec ds/flowlane-node -c flowlaned -- flowlane diag`, as the
//! DaemonSet runs it: a healthy node must be reported healthy from inside the
//! flowlaned container, which sees the host only through the manifest's
//! volume mounts.
//!
//! The node is a network namespace (the container is hostNetwork) with its
//! own private mount namespace in which the host's well-known directories
//! (`/etc/cni/net.d`, `/opt/cni/bin`, `/var/lib/flowlane`, `/var/lib/cni`,
//! `/run/flowlane`, `/run/netns`) are fresh tmpfs: the real plugin (from the
//! ConfigMap's conflist template) wires two pods there and the real flowlaned
//! serves them, with the DaemonSet's own paths. The container is a chroot
//! whose only view of the host is the flowlaned container's hostPath mounts,
//! read from `daemonset.yaml` (plus what a privileged, hostPID container has:
//! /proc, /sys, /dev, and the image's userland, here the host's Debian /usr
//! and /etc). Nothing is faked but the kubelet that would make the mounts.
//!
//! The control run drops one mount (the IPAM lease directory): diag must then
//! say the node is broken, so the healthy verdict depends on the mounts.
//!
//! Names: node netns `fldsd<pid>`, pods 10.234.1.0/24.

use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::apps::v1::DaemonSet;
use serde_json::Value;

mod common;
use common::{release_dir, TempDir};

fn deploy_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../kubernetes")
        .join(name)
}

/// The flowlaned container's hostPath mounts, in manifest order:
/// (host path, mount path, read only).
fn host_mounts() -> Vec<(String, String, bool)> {
    let text = std::fs::read_to_string(deploy_file("daemonset.yaml")).unwrap();
    let ds: DaemonSet = serde_yaml::from_str(&text).unwrap();
    let spec = ds.spec.unwrap().template.spec.unwrap();
    let volumes = spec.volumes.unwrap_or_default();
    let container = spec
        .containers
        .iter()
        .find(|c| c.name == "flowlaned")
        .expect("the DaemonSet has a flowlaned container");
    container
        .volume_mounts
        .iter()
        .flatten()
        .filter_map(|m| {
            let v = volumes.iter().find(|v| v.name == m.name)?;
            let host = v.host_path.as_ref()?.path.clone();
            Some((host, m.mount_path.clone(), m.read_only == Some(true)))
        })
        .collect()
}

/// The shipped conflist template with this node's pod range filled in, as
/// install.sh fills it.
fn conflist() -> Value {
    let cm: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(deploy_file("configmap.yaml")).unwrap())
            .unwrap();
    let tmpl = cm["data"]["10-flowlane.conflist.tmpl"].as_str().unwrap();
    let mut conf: Value = serde_json::from_str(tmpl).unwrap();
    conf["plugins"][0]["ipam"]["ranges"] = serde_json::json!([[{"subnet": "10.234.1.0/24"}]]);
    conf["plugins"][0]["ipam"]["routes"] = serde_json::json!([{"dst": "0.0.0.0/0"}]);
    conf
}

/// The node's directories the plugin and daemon use; each becomes a tmpfs in
/// the node's mount namespace (its mount point is made on the host if absent
/// and removed afterwards).
const NODE_DIRS: &[&str] = &[
    "/etc/cni/net.d",
    "/opt/cni/bin",
    "/var/lib/flowlane",
    "/var/lib/cni",
    "/run/flowlane",
    "/run/netns",
];

const SCRIPT: &str = r#"
set -eu
for d in $NODE_DIRS; do mount -t tmpfs tmpfs "$d"; done
cp "$BIN/flowlane" /opt/cni/bin/flowlane
cp /usr/lib/cni/portmap /opt/cni/bin/portmap
cp "$CONFLIST" /etc/cni/net.d/10-flowlane.conflist
ip link set lo up
"$BIN/flowlaned" --state-dir=/var/lib/flowlane --socket=/run/flowlane/flowlaned.sock \
  >"$WORK/flowlaned.log" 2>&1 &
daemon=$!
trap 'kill $daemon 2>/dev/null || true' EXIT
for i in 1 2; do
  touch /run/netns/pod$i
  unshare --net=/run/netns/pod$i true
  CNI_COMMAND=ADD CNI_CONTAINERID=c0ffee0$i CNI_NETNS=/run/netns/pod$i CNI_IFNAME=eth0 \
    CNI_PATH=/opt/cni/bin CNI_ARGS="K8S_POD_NAMESPACE=default;K8S_POD_NAME=pod$i" \
    /opt/cni/bin/flowlane <"$PLUGIN_CONF" >"$WORK/add$i.json"
done
for _ in $(seq 100); do [ -S /run/flowlane/flowlaned.sock ] && break; sleep 0.05; done

# The container: the image's userland, then the kubelet's mounts.
R="$WORK/root"
mkdir -p "$R/usr" "$R/etc" "$R/proc" "$R/sys" "$R/dev" "$R/image"
for l in bin lib lib64 sbin; do ln -s "usr/$l" "$R/$l"; done
mount --rbind /usr "$R/usr"; mount -o remount,bind,ro "$R/usr"
mount --bind /etc "$R/etc"
mount --rbind /proc "$R/proc"
mount --rbind /sys "$R/sys"
mount --rbind /dev "$R/dev"
cp "$BIN/flowlane" "$R/image/flowlane"
while read -r host target ro; do
  [ -e "$host" ] || continue
  mkdir -p "$R$target"
  # containerd mounts a hostPath with rbind: the pods' nsfs mounts under
  # /run/netns come along
  mount --rbind "$host" "$R$target"
  if [ "$ro" = ro ]; then mount -o remount,bind,ro "$R$target"; fi
done <"$MOUNTS"
mount -o remount,bind,ro "$R/etc"
set +e
chroot "$R" /image/flowlane diag --json >"$WORK/diag.json" 2>"$WORK/diag.err"
echo $? >"$WORK/diag.rc"
"#;

struct Node {
    name: String,
}

impl Node {
    fn new(tag: &str) -> Node {
        let name = format!("flds{tag}{}", std::process::id() % 100_000);
        let _ = Command::new("ip")
            .args(["netns", "del", &name])
            .stderr(std::process::Stdio::null())
            .status();
        let ok = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .unwrap();
        assert!(ok.success(), "ip netns add {name}");
        Node { name }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// Runs the scenario with the given container mounts; returns diag's exit
/// code and JSON report.
fn diag_in_container(tag: &str, mounts: &[(String, String, bool)]) -> (i32, Value) {
    let bin = release_dir();
    for b in ["flowlane", "flowlaned"] {
        assert!(
            bin.join(b).exists(),
            "{b} not built in {}: run `cargo build --release --workspace` first",
            bin.display()
        );
    }
    let work = TempDir::new(&format!("diag-ds-{tag}"));
    let conf = conflist();
    std::fs::write(work.0.join("conflist"), conf.to_string()).unwrap();
    let mut plugin_conf = conf["plugins"][0].clone();
    plugin_conf["cniVersion"] = conf["cniVersion"].clone();
    plugin_conf["name"] = conf["name"].clone();
    std::fs::write(work.0.join("plugin.json"), plugin_conf.to_string()).unwrap();
    let lines: String = mounts
        .iter()
        .map(|(h, t, ro)| format!("{h} {t} {}\n", if *ro { "ro" } else { "rw" }))
        .collect();
    std::fs::write(work.0.join("mounts"), lines).unwrap();

    // Every directory made on the host for a mount point, parents first
    // (removed in reverse order afterwards).
    let mut created = Vec::new();
    for d in NODE_DIRS {
        for a in Path::new(d)
            .ancestors()
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
        {
            if !a.exists() {
                std::fs::create_dir(a).unwrap();
                created.push(a.to_path_buf());
            }
        }
    }
    let node = Node::new(tag);
    let out = Command::new("ip")
        .args(["netns", "exec", &node.name, "unshare", "--mount"])
        .args(["--propagation", "private", "sh", "-c", SCRIPT])
        .env("NODE_DIRS", NODE_DIRS.join(" "))
        .env("BIN", &bin)
        .env("WORK", &work.0)
        .env("CONFLIST", work.0.join("conflist"))
        .env("PLUGIN_CONF", work.0.join("plugin.json"))
        .env("MOUNTS", work.0.join("mounts"))
        .output()
        .unwrap();
    drop(node);
    for d in created.iter().rev() {
        let _ = std::fs::remove_dir(d);
    }
    let read = |f: &str| std::fs::read_to_string(work.0.join(f)).unwrap_or_default();
    assert!(
        out.status.success(),
        "node set-up failed: {}\n{}\nflowlaned: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        read("flowlaned.log")
    );
    let rc: i32 = read("diag.rc").trim().parse().expect("diag ran");
    let report: Value = serde_json::from_str(&read("diag.json")).unwrap_or_else(|e| {
        panic!(
            "diag printed no JSON ({e}): {}\nstderr: {}",
            read("diag.json"),
            read("diag.err")
        )
    });
    (rc, report)
}

fn problems(report: &Value) -> Vec<String> {
    report["sections"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| s["findings"].as_array().cloned().unwrap_or_default())
        .filter(|f| f["severity"] == "error")
        .map(|f| format!("{}: {}", f["id"], f["summary"]))
        .collect()
}

fn finding_ids(report: &Value) -> Vec<String> {
    report["sections"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| s["findings"].as_array().cloned().unwrap_or_default())
        .filter_map(|f| f["id"].as_str().map(str::to_string))
        .collect()
}

#[test]
fn diag_in_the_daemonset_container_reports_a_healthy_node_healthy() {
    let mounts = host_mounts();
    for needed in ["/etc/cni/net.d", "/var/lib/flowlane", "/run/netns"] {
        assert!(
            mounts.iter().any(|(_, t, _)| t == needed),
            "the flowlaned container does not mount {needed}"
        );
    }
    let (rc, report) = diag_in_container("ok", &mounts);
    assert_eq!(
        (rc, report["healthy"].as_bool()),
        (0, Some(true)),
        "a healthy node reported broken from inside the DaemonSet: {:#?}",
        problems(&report)
    );
    let ids = finding_ids(&report);
    for seen in ["pods.live", "ipam.usage"] {
        assert!(
            ids.iter().any(|i| i == seen),
            "diag did not see the node's pods ({seen}): {ids:?}"
        );
    }

    // Control: without the lease directory the same node is reported broken,
    // so the verdict above rests on what the container can see.
    let without_leases: Vec<_> = mounts
        .iter()
        .filter(|(h, _, _)| !h.starts_with("/var/lib/cni"))
        .cloned()
        .collect();
    assert!(without_leases.len() < mounts.len());
    let (rc, report) = diag_in_container("ctl", &without_leases);
    assert_eq!(rc, 1, "diag missed the unreadable lease directory");
    assert!(
        finding_ids(&report).iter().any(|i| i.starts_with("ipam.")),
        "{:#?}",
        problems(&report)
    );
}
