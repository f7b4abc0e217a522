//! A network and pods owned by a test, with the check that nothing of them
//! leaked.

use std::path::PathBuf;

use serde_json::{json, Value};

use super::invocation::{Invocation, PluginOutput};
use crate::binaries::PluginUnderTest;
use crate::fsutil::TempDir;
use crate::host::LinkGuard;
use crate::netns::Netns;

/// A network a test owns: its bridge (deleted on drop), its state and IPAM
/// data directories (removed on drop), its subnets, and the plugin under test.
#[derive(Debug)]
pub struct TestNet {
    pub plugin: PluginUnderTest,
    pub name: String,
    pub bridge: LinkGuard,
    pub subnets: Vec<String>,
    pub dir: TempDir,
}

impl TestNet {
    /// A network tagged `tag` (≤6 chars) with one IPAM range set per subnet.
    pub fn new(tag: &str, subnets: &[&str]) -> Self {
        Self::with_plugin(tag, subnets, PluginUnderTest::from_env())
    }

    /// Like [`TestNet::new`] for an explicit plugin (the benchmark runs both).
    pub fn with_plugin(tag: &str, subnets: &[&str], plugin: PluginUnderTest) -> Self {
        let bridge = LinkGuard::fresh(tag);
        TestNet {
            plugin,
            name: bridge.name().to_string(),
            bridge,
            subnets: subnets.iter().map(|s| s.to_string()).collect(),
            dir: TempDir::new(tag),
        }
    }

    /// The pod registry / plugin state directory (`stateDir`).
    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("state")
    }

    /// The IPAM lease directory (`ipam.dataDir`).
    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("ipam")
    }

    /// The IPAM section with the test's ranges.
    pub fn ipam(&self) -> Value {
        let ranges: Vec<Value> = self
            .subnets
            .iter()
            .map(|s| json!([{ "subnet": s }]))
            .collect();
        json!({
            "type": self.plugin.builtin_ipam(),
            "ranges": ranges,
            "dataDir": self.data_dir().display().to_string(),
        })
    }

    /// A complete network configuration for `version`.
    pub fn conf(&self, version: &str) -> Value {
        json!({
            "cniVersion": version,
            "name": self.name,
            "type": self.plugin.type_name(),
            "bridge": self.name,
            "isGateway": true,
            "isDefaultGateway": true,
            "ipMasq": false,
            "hairpinMode": false,
            "stateDir": self.state_dir().display().to_string(),
            "daemonSocket": self.dir.join("no-daemon.sock").display().to_string(),
            "ipam": self.ipam(),
        })
    }

    /// An invocation of the plugin under test with `CNI_PATH` set.
    pub fn invoke(&self, command: &str) -> Invocation {
        Invocation::new(self.plugin.binary(), command).cni_path(&self.plugin.cni_path())
    }

    /// An invocation for a pod: container id, netns and ifname set.
    pub fn pod_call(&self, command: &str, pod: &Pod, conf: &Value) -> Invocation {
        self.invoke(command)
            .container_id(&pod.id)
            .netns(pod.netns.path_str())
            .ifname(&pod.ifname)
            .args(&pod.cni_args)
            .config(conf)
    }

    /// ADD; panics on failure; returns the result.
    pub fn add(&self, pod: &Pod, version: &str) -> Value {
        self.pod_call("ADD", pod, &self.conf(version))
            .run()
            .expect_json()
    }

    /// The configuration with `prevResult` set, as libcni sends it for CHECK/DEL.
    pub fn conf_with_prev(&self, version: &str, prev: &Value) -> Value {
        let mut c = self.conf(version);
        c["prevResult"] = prev.clone();
        c
    }

    /// CHECK with `prev` as prevResult.
    pub fn check(&self, pod: &Pod, version: &str, prev: &Value) -> PluginOutput {
        self.pod_call("CHECK", pod, &self.conf_with_prev(version, prev))
            .run()
    }

    /// DEL with `prev` as prevResult (if any).
    pub fn del(&self, pod: &Pod, version: &str, prev: Option<&Value>) -> PluginOutput {
        let conf = match prev {
            Some(p) => self.conf_with_prev(version, p),
            None => self.conf(version),
        };
        self.pod_call("DEL", pod, &conf).run()
    }

    /// Lease files left in the IPAM data directory.
    pub fn leases(&self) -> Vec<PathBuf> {
        crate::fsutil::lease_files(&self.data_dir())
    }

    /// Pod registry entries of this network.
    pub fn registry_entries(&self) -> Vec<flowlane_registry::Attachment> {
        flowlane_registry::Registry::new(self.state_dir())
            .list_network(&self.name)
            .expect("registry readable")
    }

    /// Asserts nothing of the network's pods is left: no lease, no host veth
    /// on the bridge, no registry entry, no file naming a container id.
    pub fn assert_clean(&self, container_ids: &[&str]) {
        assert_eq!(self.leases(), Vec::<PathBuf>::new(), "leases leaked");
        // A netns destroyed just before takes its veth with it asynchronously
        // (the kernel's netns cleanup runs in a work queue): allow it time.
        let ports = || -> Vec<String> {
            crate::host::bridge_ports(&self.name)
                .into_iter()
                .map(|l| l.ifname)
                .collect()
        };
        crate::wait::until(std::time::Duration::from_secs(10), || ports().is_empty());
        let ports = ports();
        assert_eq!(
            ports,
            Vec::<String>::new(),
            "host veths leaked on {}",
            self.name
        );
        assert!(
            self.registry_entries().is_empty(),
            "registry entries leaked: {:?}",
            self.registry_entries()
        );
        for id in container_ids {
            let left = crate::fsutil::files_mentioning(self.dir.path(), id);
            assert!(left.is_empty(), "files still mention {id}: {left:?}");
        }
    }
}

/// Runs a prepared DEL when dropped (unless disarmed), so that host-wide
/// state a plugin installs for a pod (masquerade rules) never outlives a
/// failing test.
pub struct DelOnDrop {
    del: Option<Invocation>,
}

impl DelOnDrop {
    pub fn new(del: Invocation) -> Self {
        DelOnDrop { del: Some(del) }
    }

    /// The test ran its own DEL.
    pub fn disarm(mut self) {
        self.del = None;
    }
}

impl Drop for DelOnDrop {
    fn drop(&mut self) {
        if let Some(d) = self.del.take() {
            let _ = d.run();
        }
    }
}

/// A pod's attachment parameters: its netns (owned), container id, ifname, CNI_ARGS.
#[derive(Debug)]
pub struct Pod {
    pub netns: Netns,
    pub id: String,
    pub ifname: String,
    pub cni_args: String,
}

impl Pod {
    /// A pod with a fresh netns, `eth0`, and the K8S_* args a kubelet passes.
    pub fn new(tag: &str) -> Self {
        let netns = Netns::new(tag);
        let id = crate::names::container_id(tag);
        let cni_args = format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=flt-ns;K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={};K8S_POD_UID=uid-{}",
            netns.name(),
            id,
            netns.name()
        );
        Pod {
            netns,
            id,
            ifname: "eth0".to_string(),
            cni_args,
        }
    }
}
