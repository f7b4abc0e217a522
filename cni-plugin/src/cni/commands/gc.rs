//! GC: drop every lease, registry entry and masquerade rule of this network
//! whose attachment is not in `cni.dev/valid-attachments`. Keeps going
//! after errors and reports the first.

use crate::cni::config::{Mode, NetConf};
use crate::cni::env::CniEnv;
use crate::cni::error::{code, CniError, CniResult};
use crate::cni::ipam;
use crate::cni::masq;
use crate::cni::podreg;
use crate::cni::version::Version;

pub fn run(conf: &NetConf, env: &CniEnv) -> CniResult<()> {
    if conf.version < Version::V1_1_0 {
        return Err(CniError::new(
            code::INCOMPATIBLE_VERSION,
            "config version does not allow GC",
        ));
    }
    let valid = conf.valid_attachments.clone().unwrap_or_default();
    let chained = conf.mode == Mode::Chained;
    let mut errors = Vec::new();
    // Chained: leases and rules belong to the plugin that wired the pods.
    if !chained {
        if let Err(e) = ipam::gc(conf, env, &valid) {
            errors.push(e);
        }
    }
    match podreg::gc(conf, &valid) {
        Ok(n) => tracing::info!(removed = n, "registry gc"),
        Err(e) => errors.push(e),
    }
    if !chained {
        if let Err(e) = masq::gc(conf, &valid) {
            errors.push(e);
        }
    }
    match errors.into_iter().next() {
        None => Ok(()),
        Some(e) => Err(e),
    }
}
