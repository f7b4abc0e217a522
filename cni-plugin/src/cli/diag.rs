//! `flowlane diag`: check this node and explain every problem.
//!
//! Each check lives in its own module under `diag/` and fills one section
//! of the report; a check never aborts the others, so the command runs on
//! any node (no daemon, no RDMA, no config) and says what it found. The
//! exit code is 1 when something is broken, 0 otherwise (warnings alone
//! do not fail).

use std::net::IpAddr;
use std::path::PathBuf;

mod binary;
mod bridge;
mod cni_config;
mod daemon;
mod host;
mod ipam;
mod netinfo;
mod nodes;
mod pods;
mod rdma;
mod report;

use report::Report;

const USAGE: &str = "\
usage: flowlane diag [--json] [options]

Checks this node and explains every problem, with what to do about it.
Exit code: 0 healthy (or warnings only), 1 something is broken, 2 bad usage.

  --json                 machine-readable report
  --cni-conf-dir DIR     CNI config directory          (default /etc/cni/net.d)
  --cni-bin-dir DIR      CNI plugin directory          (default /opt/cni/bin)
  --state-dir DIR        flowlane state directory      (default: the config's stateDir, else /var/lib/flowlane)
  --socket PATH          flowlaned's socket            (default: the config's daemonSocket, else /run/flowlane/flowlaned.sock)
  --sysfs DIR            sysfs root for RDMA discovery (default /sys)
  --node-ip IP           the node's underlay address for GID selection
                         (default: the addresses of the default-route interface)
  --nodes FILE           the cluster's node table (JSON: name, podCIDRs, underlay, rdma)
                         to check routes to other nodes' pods and RDMA lanes
                         (default: the daemon's view, <state-dir>/daemon/nodes.json)
";

#[derive(Debug, Clone)]
struct Options {
    json: bool,
    cni_conf_dir: PathBuf,
    cni_bin_dir: PathBuf,
    state_dir: Option<PathBuf>,
    socket: Option<PathBuf>,
    sysfs: PathBuf,
    node_ip: Option<IpAddr>,
    nodes: Option<PathBuf>,
}

fn parse(args: &[String]) -> Result<Option<Options>, String> {
    let mut o = Options {
        json: false,
        cni_conf_dir: flowlane_defaults::CNI_CONF_DIR.into(),
        cni_bin_dir: flowlane_defaults::CNI_BIN_DIR.into(),
        state_dir: None,
        socket: None,
        sysfs: flowlane_defaults::SYSFS.into(),
        node_ip: None,
        nodes: None,
    };
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let (key, inline) = match arg.split_once('=') {
            Some((k, v)) if k.starts_with("--") => (k, Some(v.to_string())),
            _ => (arg.as_str(), None),
        };
        let mut value = || -> Result<String, String> {
            inline
                .clone()
                .or_else(|| it.next().cloned())
                .ok_or_else(|| format!("{key} needs a value"))
        };
        match key {
            "--json" => o.json = true,
            "--cni-conf-dir" => o.cni_conf_dir = value()?.into(),
            "--cni-bin-dir" => o.cni_bin_dir = value()?.into(),
            "--state-dir" => o.state_dir = Some(value()?.into()),
            "--socket" => o.socket = Some(value()?.into()),
            "--sysfs" => o.sysfs = value()?.into(),
            "--node-ip" => {
                let v = value()?;
                o.node_ip = Some(
                    v.parse()
                        .map_err(|_| format!("--node-ip: {v:?} is not an IP address"))?,
                );
            }
            "--nodes" => o.nodes = Some(value()?.into()),
            "-h" | "--help" => return Ok(None),
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    Ok(Some(o))
}

pub fn main(args: &[String]) -> i32 {
    let opts = match parse(args) {
        Ok(Some(o)) => o,
        Ok(None) => {
            print!("{USAGE}");
            return 0;
        }
        Err(e) => {
            eprintln!("flowlane diag: {e}\n\n{USAGE}");
            return 2;
        }
    };
    let report = run(&opts);
    let text = if opts.json {
        report.to_json() + "\n"
    } else {
        report.to_text()
    };
    // A reader that goes away (`| head`) is not an error of the node.
    let _ = std::io::Write::write_all(&mut std::io::stdout().lock(), text.as_bytes());
    report.exit_code()
}

fn run(o: &Options) -> Report {
    let (cni, net) = cni_config::check(&o.cni_conf_dir);
    let net = net.as_ref();
    // An explicit option wins, then what the installed config says, then the default.
    let state_dir = o
        .state_dir
        .clone()
        .or_else(|| net.and_then(|n| n.state_dir.clone()))
        .unwrap_or_else(|| flowlane_defaults::STATE_DIR.into());
    let socket = o
        .socket
        .clone()
        .or_else(|| net.and_then(|n| n.daemon_socket.clone()))
        .unwrap_or_else(|| flowlane_defaults::DAEMON_SOCKET.into());

    let bins = binary::check(&o.cni_bin_dir, net);
    let bridge = bridge::check(net);
    let (pods, pod_states) = pods::check(&state_dir);
    let ipam = ipam::check(net, &pod_states);
    let (daemon, daemon_state) = daemon::check(&socket, &state_dir);
    let (rdma, inventory, gid) = rdma::check(&o.sysfs, o.node_ip);
    let daemon_view = state_dir.join("daemon").join("nodes.json");
    let nodes = nodes::check(o.nodes.as_deref(), &daemon_view, net, gid.as_ref());
    let host = host::check(daemon_state.pid, !inventory.devices.is_empty());
    Report::new(vec![
        cni, bins, bridge, ipam, daemon, pods, rdma, nodes, host,
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn options_parse_both_forms_and_reject_junk() {
        let o = parse(&args(&[
            "--json",
            "--cni-conf-dir",
            "/x",
            "--socket=/s",
            "--node-ip",
            "10.0.0.1",
        ]))
        .unwrap()
        .unwrap();
        assert!(o.json);
        assert_eq!(o.cni_conf_dir, PathBuf::from("/x"));
        assert_eq!(o.socket, Some(PathBuf::from("/s")));
        assert_eq!(o.node_ip, Some("10.0.0.1".parse().unwrap()));
        assert_eq!(o.cni_bin_dir, PathBuf::from("/opt/cni/bin"));
        assert!(parse(&args(&["--bogus"])).is_err());
        assert!(parse(&args(&["--state-dir"])).is_err());
        assert!(parse(&args(&["--node-ip", "nope"])).is_err());
        assert!(parse(&args(&["--help"])).unwrap().is_none());
    }
}
