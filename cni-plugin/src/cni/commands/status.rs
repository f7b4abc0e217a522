//! STATUS: can this plugin serve ADDs? State directory writable, IPAM ready
//! (50 otherwise); and is the network itself intact: pods are registered
//! but their bridge is gone or down (51: existing pods have limited
//! connectivity).

use crate::cni::config::{Mode, NetConf};
use crate::cni::env::CniEnv;
use crate::cni::error::{code, CniError, CniResult};
use crate::cni::ipam;
use crate::cni::netlink::{link, RtNetlink};
use crate::cni::version::Version;

pub fn run(conf: &NetConf, env: &CniEnv) -> CniResult<()> {
    if conf.version < Version::V1_1_0 {
        return Err(CniError::new(
            code::INCOMPATIBLE_VERSION,
            "config version does not allow STATUS",
        ));
    }
    let dir = std::path::Path::new(&conf.state_dir);
    let probe = dir.join(format!(".status-probe-{}", std::process::id()));
    std::fs::create_dir_all(dir)
        .and_then(|_| std::fs::write(&probe, b""))
        .and_then(|_| std::fs::remove_file(&probe))
        .map_err(|e| {
            CniError::new(
                code::NOT_AVAILABLE,
                format!("state directory {} is not writable", conf.state_dir),
            )
            .with_details(e)
        })?;
    if conf.mode == Mode::Chained {
        // No IPAM and no bridge of ours: the first plugin reports on those.
        return Ok(());
    }
    ipam::status(conf, env).map_err(|e| {
        if e.code == code::NOT_AVAILABLE || e.code == code::LIMITED_CONNECTIVITY {
            e
        } else {
            CniError::new(code::NOT_AVAILABLE, format!("ipam not ready: {}", e.msg))
                .with_details(e.details)
        }
    })?;
    bridge_serves_registered_pods(conf)
}

/// A missing bridge is normal before the first ADD (it is created then);
/// with pods registered on this network it means they are cut off.
fn bridge_serves_registered_pods(conf: &NetConf) -> CniResult<()> {
    let pods = flowlane_registry::Registry::new(&conf.state_dir)
        .list_network(&conf.name)
        .map(|l| l.len())
        .unwrap_or(0);
    if pods == 0 {
        return Ok(());
    }
    let mut nl = RtNetlink::open().map_err(|e| CniError::netlink("netlink socket", e))?;
    let problem = match link::by_name(&mut nl, &conf.bridge) {
        Ok(None) => Some("is missing"),
        Ok(Some(b)) if !b.up => Some("is down"),
        Ok(Some(b)) if b.kind.as_deref() != Some("bridge") => Some("is not a bridge"),
        Ok(Some(_)) => None,
        Err(e) => return Err(CniError::netlink("looking up the bridge", e)),
    };
    match problem {
        None => Ok(()),
        Some(p) => Err(CniError::new(
            code::LIMITED_CONNECTIVITY,
            format!(
                "bridge {} {p} while {pods} pod(s) are attached to network {}",
                conf.bridge, conf.name
            ),
        )),
    }
}
