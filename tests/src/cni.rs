//! Running a CNI plugin exactly as a runtime does: environment variables
//! (`CNI_COMMAND`, `CNI_CONTAINERID`, `CNI_NETNS`, `CNI_IFNAME`, `CNI_ARGS`,
//! `CNI_PATH`) and the network configuration on stdin (CNI spec 1.1.0).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::Duration;

use serde_json::{json, Value};

use crate::binaries::PluginUnderTest;
use crate::fsutil::TempDir;
use crate::host::LinkGuard;
use crate::netns::Netns;
use crate::process;

/// Spec versions a 1.1.0 plugin must be able to answer in.
pub const VERSIONS: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// The spec's well-known error codes.
pub mod code {
    pub const INCOMPATIBLE_VERSION: u64 = 1;
    pub const UNSUPPORTED_FIELD: u64 = 2;
    pub const UNKNOWN_CONTAINER: u64 = 3;
    pub const INVALID_ENV: u64 = 4;
    pub const IO_FAILURE: u64 = 5;
    pub const DECODE_FAILURE: u64 = 6;
    pub const INVALID_CONFIG: u64 = 7;
    pub const TRY_AGAIN_LATER: u64 = 11;
    pub const NOT_AVAILABLE: u64 = 50;
    pub const LIMITED_CONNECTIVITY: u64 = 51;
}

/// One plugin execution being prepared. Every variable can be left unset
/// (to test the plugin's handling of a missing one).
#[derive(Debug, Clone)]
pub struct Invocation {
    plugin: PathBuf,
    node: Option<String>,
    env: BTreeMap<String, String>,
    stdin: Vec<u8>,
    timeout: Duration,
}

impl Invocation {
    /// `CNI_COMMAND=<command>` for `plugin`, nothing else set yet.
    pub fn new(plugin: impl AsRef<Path>, command: &str) -> Self {
        let mut env = BTreeMap::new();
        env.insert("CNI_COMMAND".to_string(), command.to_string());
        Invocation {
            plugin: plugin.as_ref().to_path_buf(),
            node: None,
            env,
            stdin: Vec::new(),
            timeout: Duration::from_secs(120),
        }
    }

    pub fn env(mut self, key: &str, value: impl Into<String>) -> Self {
        self.env.insert(key.to_string(), value.into());
        self
    }

    pub fn unset(mut self, key: &str) -> Self {
        self.env.remove(key);
        self
    }

    pub fn container_id(self, id: &str) -> Self {
        self.env("CNI_CONTAINERID", id)
    }

    pub fn netns(self, path: impl Into<String>) -> Self {
        self.env("CNI_NETNS", path)
    }

    pub fn ifname(self, name: &str) -> Self {
        self.env("CNI_IFNAME", name)
    }

    pub fn args(self, args: &str) -> Self {
        self.env("CNI_ARGS", args)
    }

    pub fn cni_path(self, path: &str) -> Self {
        self.env("CNI_PATH", path)
    }

    /// The network configuration (serialised as stdin).
    pub fn config(mut self, conf: &Value) -> Self {
        self.stdin = serde_json::to_vec(conf).expect("config serialises");
        self
    }

    /// Raw stdin bytes (for malformed-input tests).
    pub fn stdin(mut self, bytes: impl Into<Vec<u8>>) -> Self {
        self.stdin = bytes.into();
        self
    }

    /// Runs the plugin inside the network namespace `node` (named, as
    /// `ip netns` knows it) instead of the test's: a "node" of a cluster
    /// simulated on one machine, whose bridge and host-side veths live there.
    pub fn in_netns(mut self, node: &str) -> Self {
        self.node = Some(node.to_string());
        self
    }

    /// Runs the plugin with exactly these variables (plus `PATH`), as
    /// libcni does (it passes the runtime's environment, which has no CNI_*).
    pub fn run(&self) -> PluginOutput {
        let mut cmd = match &self.node {
            Some(node) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", node]).arg(&self.plugin);
                c
            }
            None => Command::new(&self.plugin),
        };
        cmd.env_clear().env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        );
        if let Ok(v) = std::env::var("RUST_LOG") {
            cmd.env("RUST_LOG", v);
        }
        cmd.envs(&self.env);
        let out = process::run_with_input(&mut cmd, &self.stdin, self.timeout)
            .unwrap_or_else(|e| panic!("running {}: {e}", self.plugin.display()));
        PluginOutput {
            // Debian's reference plugins predate the 1.0 rule that errors carry cniVersion.
            strict: !self.plugin.starts_with(crate::binaries::REFERENCE_CNI_DIR),
            command: self.env.get("CNI_COMMAND").cloned().unwrap_or_default(),
            status: out.status,
            stdout: out.stdout,
            stderr: out.stderr,
        }
    }
}

/// What a plugin execution produced.
#[derive(Debug, Clone)]
pub struct PluginOutput {
    /// Whether spec-1.0 strictness applies (error JSON carries `cniVersion`).
    pub strict: bool,
    pub command: String,
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

/// The spec's error object.
#[derive(Debug, Clone)]
pub struct CniError {
    pub code: u64,
    pub msg: String,
    pub details: Option<String>,
    pub raw: Value,
}

impl PluginOutput {
    fn describe(&self) -> String {
        format!(
            "CNI {} exit {}:\nstdout: {}\nstderr: {}",
            self.command, self.status, self.stdout, self.stderr
        )
    }

    /// Stdout parsed as exactly one JSON document (logs must never appear there).
    pub fn json(&self) -> Value {
        serde_json::from_str(self.stdout.trim()).unwrap_or_else(|e| {
            panic!(
                "stdout is not exactly one JSON document ({e}); {}",
                self.describe()
            )
        })
    }

    pub fn success(&self) -> bool {
        self.status.success()
    }

    /// Exit 0 with a JSON document on stdout (ADD, VERSION, STATUS-less results).
    pub fn expect_json(&self) -> Value {
        assert!(self.success(), "expected success; {}", self.describe());
        self.json()
    }

    /// Exit 0; stdout empty or a single JSON document (DEL, CHECK, GC, STATUS
    /// print nothing on success).
    pub fn expect_ok(&self) {
        assert!(self.success(), "expected success; {}", self.describe());
        if !self.stdout.trim().is_empty() {
            let _ = self.json();
        }
    }

    /// A non-zero exit with the spec's error JSON on stdout.
    pub fn error(&self) -> CniError {
        assert!(
            !self.success(),
            "expected a failure, got success; {}",
            self.describe()
        );
        let v = self.json();
        let code = v["code"]
            .as_u64()
            .unwrap_or_else(|| panic!("error JSON has no numeric code; {}", self.describe()));
        let msg = v["msg"].as_str().unwrap_or_default().to_string();
        assert!(
            !msg.is_empty(),
            "error JSON has no msg; {}",
            self.describe()
        );
        assert!(
            !self.strict || v.get("cniVersion").and_then(Value::as_str).is_some(),
            "error JSON has no cniVersion; {}",
            self.describe()
        );
        CniError {
            code,
            msg,
            details: v["details"].as_str().map(str::to_string),
            raw: v,
        }
    }

    /// A failure with error code `code`.
    pub fn expect_error(&self, code: u64) -> CniError {
        let e = self.error();
        assert_eq!(e.code, code, "wrong error code; {}", self.describe());
        e
    }

    /// A failure with one of `codes`.
    pub fn expect_error_in(&self, codes: &[u64]) -> CniError {
        let e = self.error();
        assert!(
            codes.contains(&e.code),
            "error code {} not in {codes:?}; {}",
            e.code,
            self.describe()
        );
        e
    }
}

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

/// Runs the chain's DEL when dropped unless [`ChainAttachment::detach`] ran:
/// plugins such as portmap leave host-wide state (iptables rules) that must
/// not outlive a failed test.
pub struct ChainAttachment<'a> {
    chain: &'a Chain,
    pod: &'a Pod,
    result: Option<Value>,
}

impl<'a> ChainAttachment<'a> {
    /// ADD through `chain`; the returned guard owns the attachment.
    pub fn add(chain: &'a Chain, pod: &'a Pod) -> Self {
        let result = chain.add(pod);
        ChainAttachment {
            chain,
            pod,
            result: Some(result),
        }
    }

    pub fn result(&self) -> &Value {
        self.result.as_ref().expect("attached")
    }

    /// DEL through the chain (asserting success).
    pub fn detach(mut self) {
        let r = self.result.take();
        self.chain.del(self.pod, r.as_ref());
    }
}

impl Drop for ChainAttachment<'_> {
    fn drop(&mut self) {
        if let Some(r) = self.result.take() {
            for i in (0..self.chain.plugins.len()).rev() {
                let _ = self.chain.call("DEL", i, self.pod, Some(&r));
            }
        }
    }
}

/// Runs a conflist the way libcni does: ADD through the plugins in order,
/// each receiving the previous plugin's result as `prevResult`; DEL in
/// reverse order with the cached final result as `prevResult`.
#[derive(Debug, Clone)]
pub struct Chain {
    pub name: String,
    pub version: String,
    /// Plugin configurations (each with its `type`); `name`/`cniVersion` are injected.
    pub plugins: Vec<Value>,
    /// Directories searched for `type` executables, in order.
    pub cni_path: String,
}

impl Chain {
    fn plugin_conf(&self, i: usize, prev: Option<&Value>) -> Value {
        let mut c = self.plugins[i].clone();
        c["name"] = json!(self.name);
        c["cniVersion"] = json!(self.version);
        if let Some(p) = prev {
            c["prevResult"] = p.clone();
        }
        c
    }

    fn binary(&self, conf: &Value) -> PathBuf {
        let ty = conf["type"].as_str().expect("plugin type");
        self.cni_path
            .split(':')
            .map(|d| Path::new(d).join(ty))
            .find(|p| p.exists())
            .unwrap_or_else(|| panic!("plugin {ty} not in {}", self.cni_path))
    }

    fn call(&self, command: &str, i: usize, pod: &Pod, prev: Option<&Value>) -> PluginOutput {
        self.call_in(command, i, pod, &pod.netns.path_str(), prev)
    }

    fn call_in(
        &self,
        command: &str,
        i: usize,
        pod: &Pod,
        netns: &str,
        prev: Option<&Value>,
    ) -> PluginOutput {
        let conf = self.plugin_conf(i, prev);
        Invocation::new(self.binary(&conf), command)
            .cni_path(&self.cni_path)
            .container_id(&pod.id)
            .netns(netns)
            .ifname(&pod.ifname)
            .args(&pod.cni_args)
            .config(&conf)
            .run()
    }

    /// containerd's second DEL: `CNI_NETNS=""` and no prevResult, reverse order.
    pub fn del_without_netns(&self, pod: &Pod) {
        for i in (0..self.plugins.len()).rev() {
            self.call_in("DEL", i, pod, "", None).expect_ok();
        }
    }

    /// ADD through the chain; returns the final result.
    pub fn add(&self, pod: &Pod) -> Value {
        let mut prev: Option<Value> = None;
        for i in 0..self.plugins.len() {
            let out = self.call("ADD", i, pod, prev.as_ref());
            prev = Some(out.expect_json());
        }
        prev.expect("chain has plugins")
    }

    /// CHECK of each plugin of the chain with the final result.
    pub fn check(&self, pod: &Pod, result: &Value) -> Vec<PluginOutput> {
        (0..self.plugins.len())
            .map(|i| self.call("CHECK", i, pod, Some(result)))
            .collect()
    }

    /// DEL in reverse order; every plugin must succeed.
    pub fn del(&self, pod: &Pod, result: Option<&Value>) {
        for i in (0..self.plugins.len()).rev() {
            self.call("DEL", i, pod, result).expect_ok();
        }
    }
}
