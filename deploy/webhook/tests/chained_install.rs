//! components/chained, run as the DaemonSet runs it: install.sh from
//! deploy/kubernetes/configmap.yaml with FLOWLANE_MODE=chained execs chain.sh
//! from the component's ConfigMap patch, both unmodified, against a temporary
//! host tree whose /etc/cni/net.d holds another CNI's config (a reference
//! bridge conflist). flowlane is appended once, a restart changes nothing,
//! and the uninstall DaemonSet's script takes it out again.

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{config_data, install_tree, kubernetes_file, uninstall_script, TempDir};

/// `value` of each `add /data/<key>` operation of the component's ConfigMap patch.
fn component_data(key: &str) -> String {
    let text = std::fs::read_to_string(kubernetes_file("components/chained/configmap-patch.yaml"))
        .unwrap();
    let ops: Value =
        serde_json::to_value(serde_yaml::from_str::<serde_yaml::Value>(&text).unwrap()).unwrap();
    ops.as_array()
        .unwrap()
        .iter()
        .find(|op| op["path"] == format!("/data/{key}"))
        .and_then(|op| op["value"].as_str())
        .unwrap_or_else(|| panic!("no /data/{key} in the chained component"))
        .to_string()
}

/// A node's host tree with the scripts and entry where the ConfigMap mounts them.
struct Node {
    _root: TempDir,
    root: PathBuf,
}

impl Node {
    fn new(tag: &str) -> Node {
        let root = TempDir::new(&format!("chained-{tag}"));
        let r = root.0.clone();
        install_tree(
            &r,
            &[
                "opt/cni/bin",
                "etc/cni/net.d",
                "opt/flowlane/lib",
                "etc/flowlane",
            ],
        );
        let etc = r.join("etc/flowlane");
        let install = config_data()["install.sh"].as_str().unwrap().to_string();
        std::fs::write(etc.join("install.sh"), install).unwrap();
        for key in ["chain.sh", "chained-entry.json"] {
            std::fs::write(etc.join(key), component_data(key)).unwrap();
        }
        Node {
            _root: root,
            root: r,
        }
    }

    fn net_d(&self) -> PathBuf {
        self.root.join("etc/cni/net.d")
    }

    /// The init container: install.sh with the DaemonSet's chained env; its output.
    fn install(&self, chained_conflist: &str) -> String {
        let etc = self.root.join("etc/flowlane");
        let out = Command::new("/bin/sh")
            .arg(etc.join("install.sh"))
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("NODE_NAME", "node-a")
            // the kubelet sets these in every pod; chained mode never calls the API
            .env("KUBERNETES_SERVICE_HOST", "192.0.2.1")
            .env("KUBERNETES_SERVICE_PORT", "443")
            .env("FLOWLANE_MODE", "chained")
            .env("CHAINED_CONFLIST", chained_conflist)
            .env("CHAINED_WAIT_SECONDS", "0")
            .env("CHAIN_SCRIPT", etc.join("chain.sh"))
            .env("CHAINED_ENTRY", etc.join("chained-entry.json"))
            .env("FLOWLANE_SRC_DIR", self.root.join("src"))
            .env("HOST_CNI_BIN_DIR", self.root.join("opt/cni/bin"))
            .env("HOST_CNI_NET_DIR", self.net_d())
            .env("HOST_LIB_DIR", self.root.join("opt/flowlane/lib"))
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(out.status.success(), "stdout: {stdout}\nstderr: {stderr}");
        format!("{stdout}{stderr}")
    }

    fn write(&self, name: &str, v: &Value) {
        std::fs::write(
            self.net_d().join(name),
            serde_json::to_vec_pretty(v).unwrap(),
        )
        .unwrap();
    }

    fn read(&self, name: &str) -> Value {
        serde_json::from_slice(&std::fs::read(self.net_d().join(name)).unwrap()).unwrap()
    }

    fn listing(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.net_d())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    fn uninstall(&self) {
        let out = Command::new("unshare")
            .args(["--net", "/bin/sh", "-c", "/bin/sh -c \"$SCRIPT\""])
            .env("SCRIPT", uninstall_script())
            .env("HOST_ROOT", &self.root)
            .output()
            .expect("unshare (util-linux)");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn bridge_conflist() -> Value {
    json!({
        "cniVersion": "1.0.0",
        "name": "cbr-net",
        "plugins": [
            {"type": "bridge", "bridge": "cbr0", "isGateway": true,
             "ipam": {"type": "host-local", "subnet": "10.232.9.0/24"}},
            {"type": "portmap", "capabilities": {"portMappings": true}}
        ]
    })
}

fn types(v: &Value) -> Vec<&str> {
    v["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["type"].as_str().unwrap())
        .collect()
}

fn assert_no_temp_files(dir: &Path) {
    let left: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
}

#[test]
fn chained_install_appends_once_keeps_the_rest_and_uninstall_removes_it() {
    let node = Node::new("first");
    let orig = bridge_conflist();
    node.write("10-bridge.conflist", &orig);
    node.write(
        "20-later.conflist",
        &json!({"cniVersion": "1.0.0", "name": "later",
        "plugins": [{"type": "bridge"}]}),
    );
    let out = node.install("");
    assert!(out.contains("chained into"), "{out}");

    let v = node.read("10-bridge.conflist");
    assert_eq!(types(&v), ["bridge", "portmap", "flowlane"]);
    assert_eq!(v["name"], "cbr-net");
    assert_eq!(v["cniVersion"], "1.0.0");
    assert_eq!(
        v["plugins"][0], orig["plugins"][0],
        "other plugins kept as they are"
    );
    let entry = &v["plugins"][2];
    assert_eq!(entry["mode"], "chained");
    assert_eq!(entry["stateDir"], "/var/lib/flowlane");
    assert_eq!(entry["daemonSocket"], "/run/flowlane/flowlaned.sock");
    // the later file and flowlane's own primary conflist: untouched / not written
    assert_eq!(types(&node.read("20-later.conflist")), ["bridge"]);
    assert_eq!(node.listing(), ["10-bridge.conflist", "20-later.conflist"]);
    assert_no_temp_files(&node.net_d());
    // the binaries were installed as in primary mode
    assert!(node.root.join("opt/cni/bin/flowlane").exists());

    // A restart of the DaemonSet: nothing doubled, the file not even rewritten.
    let inode = |n: &Node| {
        std::os::unix::fs::MetadataExt::ino(
            &std::fs::metadata(n.net_d().join("10-bridge.conflist")).unwrap(),
        )
    };
    let before = inode(&node);
    let out = node.install("");
    assert!(out.contains("already chained"), "{out}");
    assert_eq!(inode(&node), before);
    assert_eq!(
        types(&node.read("10-bridge.conflist")),
        ["bridge", "portmap", "flowlane"]
    );

    // Uninstall: the entry goes, the rest is the original.
    node.uninstall();
    assert_eq!(node.read("10-bridge.conflist"), orig);
    assert_eq!(types(&node.read("20-later.conflist")), ["bridge"]);
    assert_no_temp_files(&node.net_d());
}

#[test]
fn chained_install_named_file_single_conf_and_no_config() {
    // CHAINED_CONFLIST names a file other than the first.
    let node = Node::new("named");
    node.write("05-first.conflist", &bridge_conflist());
    node.write("10-cni.conflist", &bridge_conflist());
    node.install("10-cni.conflist");
    assert_eq!(
        types(&node.read("05-first.conflist")),
        ["bridge", "portmap"]
    );
    assert_eq!(
        types(&node.read("10-cni.conflist")),
        ["bridge", "portmap", "flowlane"]
    );

    // A single-plugin .conf becomes a conflist (original kept aside), and back.
    let node = Node::new("conf");
    let conf = json!({"cniVersion": "0.4.0", "name": "single", "type": "bridge",
                      "ipam": {"type": "host-local", "subnet": "10.232.8.0/24"}});
    node.write("10-single.conf", &conf);
    node.install("");
    assert_eq!(
        node.listing(),
        ["10-single.conf.flowlane-orig", "10-single.conflist"]
    );
    let v = node.read("10-single.conflist");
    assert_eq!(v["name"], "single");
    assert_eq!(v["cniVersion"], "0.4.0");
    assert_eq!(types(&v), ["bridge", "flowlane"]);
    assert_eq!(v["plugins"][0]["ipam"], conf["ipam"]);
    node.install("");
    assert_eq!(
        types(&node.read("10-single.conflist")),
        ["bridge", "flowlane"]
    );
    node.uninstall();
    assert_eq!(node.listing(), ["10-single.conf"]);
    assert_eq!(node.read("10-single.conf"), conf);

    // No CNI config at all: a clear error, nothing written.
    let node = Node::new("empty");
    let etc = node.root.join("etc/flowlane");
    let out = Command::new("/bin/sh")
        .arg(etc.join("chain.sh"))
        .env("HOST_CNI_NET_DIR", node.net_d())
        .env("CHAINED_ENTRY", etc.join("chained-entry.json"))
        .env("CHAINED_WAIT_SECONDS", "0")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no CNI config"), "{err}");
    assert!(node.listing().is_empty());
}
