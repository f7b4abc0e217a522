//! A conflist run the way libcni runs it.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::invocation::{Invocation, PluginOutput};
use super::net::Pod;

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
