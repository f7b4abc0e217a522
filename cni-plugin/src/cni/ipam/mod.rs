//! IP address management: the built-in allocator or a delegated plugin,
//! behind one set of operations the commands call.

pub mod addr;
pub mod builtin;
pub mod config;
pub mod delegate;
pub mod store;

use super::config::{AttachmentRef, NetConf};
use super::env::{CniEnv, Command};
use super::error::CniResult;
use super::result::AddResult;
use config::IpamConf;
use delegate::Delegate;

fn delegate<'a>(plugin: &'a str, conf: &'a NetConf, env: &'a CniEnv) -> Delegate<'a> {
    Delegate {
        plugin,
        env,
        stdin: &conf.raw,
        version: conf.version,
    }
}

/// ADD: addresses (without interface index), gateways, routes, dns.
pub fn add(conf: &NetConf, env: &CniEnv) -> CniResult<Option<AddResult>> {
    match &conf.ipam {
        None => Ok(None),
        Some(IpamConf::BuiltIn(b)) => {
            builtin::allocate(b, &env.container_id, &env.ifname).map(Some)
        }
        Some(IpamConf::Delegated(p)) => delegate(p, conf, env).add().map(Some),
    }
}

/// DEL: release; releasing nothing succeeds.
pub fn del(conf: &NetConf, env: &CniEnv) -> CniResult<()> {
    match &conf.ipam {
        None => Ok(()),
        Some(IpamConf::BuiltIn(b)) => builtin::release(b, &env.container_id, &env.ifname),
        Some(IpamConf::Delegated(p)) => delegate(p, conf, env).del(),
    }
}

/// CHECK: the attachment still holds `expected` (built-in) or the plugin's
/// own CHECK passes (delegated).
pub fn check(conf: &NetConf, env: &CniEnv, expected: &[std::net::IpAddr]) -> CniResult<()> {
    match &conf.ipam {
        None => Ok(()),
        Some(IpamConf::BuiltIn(b)) => {
            let held = builtin::leased(b, &env.container_id, &env.ifname)?;
            for ip in expected {
                if !held.contains(ip) {
                    return Err(super::error::CniError::new(
                        super::error::code::CHECK_MISMATCH,
                        format!(
                            "ipam: {ip} is not reserved for {}/{}",
                            env.container_id, env.ifname
                        ),
                    ));
                }
            }
            Ok(())
        }
        Some(IpamConf::Delegated(p)) => delegate(p, conf, env).check(),
    }
}

pub fn gc(conf: &NetConf, env: &CniEnv, valid: &[AttachmentRef]) -> CniResult<()> {
    match &conf.ipam {
        None => Ok(()),
        Some(IpamConf::BuiltIn(b)) => {
            let n = builtin::gc(b, valid)?;
            tracing::info!(released = n, "ipam gc");
            Ok(())
        }
        Some(IpamConf::Delegated(p)) => delegate(p, conf, env).v11_command(Command::Gc).map(drop),
    }
}

pub fn status(conf: &NetConf, env: &CniEnv) -> CniResult<()> {
    match &conf.ipam {
        None => Ok(()),
        Some(IpamConf::BuiltIn(b)) => builtin::status(b),
        Some(IpamConf::Delegated(p)) => delegate(p, conf, env)
            .v11_command(Command::Status)
            .map(drop),
    }
}
