//! STATUS: can this plugin serve ADDs? State directory writable, IPAM ready.

use crate::cni::config::NetConf;
use crate::cni::env::CniEnv;
use crate::cni::error::{code, CniError, CniResult};
use crate::cni::ipam;
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
    ipam::status(conf, env).map_err(|e| {
        if e.code == code::NOT_AVAILABLE || e.code == code::LIMITED_CONNECTIVITY {
            e
        } else {
            CniError::new(code::NOT_AVAILABLE, format!("ipam not ready: {}", e.msg))
                .with_details(e.details)
        }
    })
}
