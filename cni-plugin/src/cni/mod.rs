//! The CNI plugin (spec 1.1.0): reads the runtime's environment and stdin,
//! runs the command, writes the result or the spec's error JSON on stdout.
//!
//! Layout: `env` and `config` parse the input, `commands` holds one module
//! per CNI command, `ipam` the built-in allocator and plugin delegation,
//! `netlink`/`netns` the kernel side, `masq` the nftables masquerade,
//! `podreg` the node's pod registry, `result` the versioned result format.

mod commands;
mod config;
mod env;
mod error;
mod ipam;
mod logging;
mod masq;
mod names;
mod netlink;
mod netns;
mod podreg;
mod result;
mod sysctl;
mod version;

use std::io::{Read, Write};

use env::Command;
use error::{CniError, CniResult};

/// Runs the CNI command named by `CNI_COMMAND`; returns the exit code.
pub fn main() -> i32 {
    let mut stdin = Vec::new();
    let cmd = std::env::var("CNI_COMMAND").unwrap_or_default();
    let read = if cmd == "VERSION" {
        // VERSION may come with or without a config; never block on a tty.
        let _ = std::io::stdin().read_to_end(&mut stdin);
        Ok(())
    } else {
        std::io::stdin()
            .read_to_end(&mut stdin)
            .map(drop)
            .map_err(|e| CniError::io("error reading stdin", e))
    };
    let version = config::sniff_version(&stdin).unwrap_or_else(|| version::CURRENT.to_string());
    match read.and_then(|_| run(&cmd, &stdin)) {
        Ok(Some(out)) => {
            print_json(&out);
            0
        }
        Ok(None) => 0,
        Err(e) => {
            // Errors before the config was read still reach stderr.
            logging::init(None);
            tracing::error!(command = %cmd, error = %e, "CNI command failed");
            print_json(&e.to_json(&version));
            1
        }
    }
}

fn print_json(v: &serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = serde_json::to_writer(&mut out, v);
    let _ = out.write_all(b"\n");
    let _ = out.flush();
}

fn run(cmd: &str, stdin: &[u8]) -> CniResult<Option<serde_json::Value>> {
    let command = Command::parse(cmd)?;
    if command == Command::Version {
        let asked = config::sniff_version(stdin).unwrap_or_else(|| version::CURRENT.to_string());
        return Ok(Some(serde_json::json!({
            "cniVersion": asked,
            "supportedVersions": version::SUPPORTED,
        })));
    }
    let env = env::from_lookup(command, |k| std::env::var(k).ok())?;
    let conf = config::parse(stdin)?;
    logging::init(conf.log_file.as_deref());
    let span = tracing::info_span!("cni", cmd = command.as_str(), id = %env.container_id, ifname = %env.ifname, net = %conf.name);
    let _g = span.enter();
    let start = std::time::Instant::now();
    let out = match command {
        Command::Add if conf.mode == config::Mode::Chained => {
            Some(commands::chained::add(&conf, &env)?)
        }
        Command::Add => {
            let r = commands::add::run(&conf, &env)?;
            Some(r.to_json(&conf.cni_version, conf.version))
        }
        Command::Del => commands::del::run(&conf, &env).map(|_| None)?,
        Command::Check => commands::check::run(&conf, &env).map(|_| None)?,
        Command::Status => commands::status::run(&conf, &env).map(|_| None)?,
        Command::Gc => commands::gc::run(&conf, &env).map(|_| None)?,
        Command::Version => unreachable!("handled above"),
    };
    tracing::info!(elapsed_us = start.elapsed().as_micros() as u64, "done");
    Ok(out)
}
