//! The node's pod registry (`flowlane_registry`): recorded on ADD, removed
//! on DEL and GC, and the daemon told about it (best effort).

use std::path::Path;
use std::time::Duration;

use flowlane_registry::{now_unix, Attachment, Registry};

use super::config::NetConf;
use super::env::CniEnv;
use super::error::{CniError, CniResult};
use super::result::AddResult;

pub fn record(
    conf: &NetConf,
    env: &CniEnv,
    netns_inode: u64,
    result: &AddResult,
    pod_iface: usize,
) -> CniResult<()> {
    let a = Attachment {
        network: conf.name.clone(),
        container_id: env.container_id.clone(),
        ifname: env.ifname.clone(),
        netns: env.netns.clone(),
        netns_inode,
        ips: result
            .ips
            .iter()
            .filter(|i| i.interface == Some(pod_iface))
            .map(|i| i.address.to_string())
            .collect(),
        mac: result
            .interfaces
            .get(pod_iface)
            .map(|i| i.mac.clone())
            .unwrap_or_default(),
        pod_namespace: env.args.get("K8S_POD_NAMESPACE").map(str::to_string),
        pod_name: env.args.get("K8S_POD_NAME").map(str::to_string),
        pod_uid: env.args.get("K8S_POD_UID").map(str::to_string),
        created_unix: now_unix(),
    };
    Registry::new(&conf.state_dir)
        .put(&a)
        .map_err(|e| CniError::io("writing the pod registry", e))?;
    notify(conf);
    Ok(())
}

pub fn remove(conf: &NetConf, container_id: &str, ifname: &str) -> CniResult<bool> {
    let removed = Registry::new(&conf.state_dir)
        .remove(&conf.name, container_id, ifname)
        .map_err(|e| CniError::io("removing the pod registry entry", e))?;
    if removed {
        notify(conf);
    }
    Ok(removed)
}

/// Entries of this network whose attachment is not in `valid`; removed.
pub fn gc(conf: &NetConf, valid: &[super::config::AttachmentRef]) -> CniResult<usize> {
    let reg = Registry::new(&conf.state_dir);
    let entries = reg
        .list_network(&conf.name)
        .map_err(|e| CniError::io("reading the pod registry", e))?;
    let mut n = 0;
    for a in entries {
        if !valid
            .iter()
            .any(|v| v.container_id == a.container_id && v.ifname == a.ifname)
        {
            reg.remove(&a.network, &a.container_id, &a.ifname)
                .map_err(|e| CniError::io("removing a stale registry entry", e))?;
            n += 1;
        }
    }
    if n > 0 {
        notify(conf);
    }
    Ok(n)
}

/// Tells flowlaned the registry changed; it may not be running.
fn notify(conf: &NetConf) {
    let sock = Path::new(&conf.daemon_socket);
    if !sock.exists() {
        return;
    }
    if let Err(e) = flowlane_lane::notify::notify_registry_changed(sock, Duration::from_millis(200))
    {
        tracing::debug!(socket = %sock.display(), error = %e, "daemon not notified");
    }
}
