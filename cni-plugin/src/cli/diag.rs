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

/// `flowlane diag`'s command line.
#[derive(clap::Args, Debug)]
#[command(
    about = "Check this node and explain every problem",
    long_about = "Checks this node and explains every problem, with what to do about it.\n\
                  Exit code: 0 healthy (or warnings only), 1 something is broken, 2 bad usage."
)]
pub struct Args {
    /// Machine-readable report.
    #[arg(long)]
    json: bool,
    /// CNI config directory.
    #[arg(long, value_name = "DIR", default_value = flowlane_defaults::CNI_CONF_DIR)]
    cni_conf_dir: PathBuf,
    /// CNI plugin directory.
    #[arg(long, value_name = "DIR", default_value = flowlane_defaults::CNI_BIN_DIR)]
    cni_bin_dir: PathBuf,
    /// flowlane state directory [default: the config's stateDir, else /var/lib/flowlane].
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// flowlaned's socket [default: the config's daemonSocket, else /run/flowlane/flowlaned.sock].
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// sysfs root for RDMA discovery.
    #[arg(long, value_name = "DIR", default_value = flowlane_defaults::SYSFS)]
    sysfs: PathBuf,
    /// The node's underlay address for GID selection [default: the addresses of the
    /// default-route interface].
    #[arg(long, value_name = "IP")]
    node_ip: Option<IpAddr>,
    /// The cluster's node table (JSON: name, podCIDRs, underlay, rdma) to check routes
    /// to other nodes' pods and RDMA lanes [default: the daemon's view,
    /// <state-dir>/daemon/nodes.json].
    #[arg(long, value_name = "FILE")]
    nodes: Option<PathBuf>,
}

pub fn main(opts: Args) -> i32 {
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

fn run(o: &Args) -> Report {
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

    fn parse(v: &[&str]) -> Result<Args, clap::Error> {
        match crate::cli::parse(&[&["diag"], v].concat())? {
            crate::cli::Command::Diag(a) => Ok(a),
            _ => unreachable!("parsed as another command"),
        }
    }

    #[test]
    fn options_parse_both_forms_and_reject_junk() {
        let o = parse(&[
            "--json",
            "--cni-conf-dir",
            "/x",
            "--socket=/s",
            "--node-ip",
            "10.0.0.1",
        ])
        .unwrap();
        assert!(o.json);
        assert_eq!(o.cni_conf_dir, PathBuf::from("/x"));
        assert_eq!(o.socket, Some(PathBuf::from("/s")));
        assert_eq!(o.node_ip, Some("10.0.0.1".parse().unwrap()));
        assert_eq!(o.cni_bin_dir, PathBuf::from("/opt/cni/bin"));
        assert!(parse(&["--bogus"]).is_err());
        assert!(parse(&["--state-dir"]).is_err());
        assert!(parse(&["--node-ip", "nope"]).is_err());
        let help = parse(&["--help"]).err().unwrap();
        assert_eq!(help.kind(), clap::error::ErrorKind::DisplayHelp);
    }

    /// The e2e suite passes its own `--sysfs` after the defaults it sets:
    /// the last one wins.
    #[test]
    fn a_repeated_option_takes_the_last_value() {
        let o = parse(&["--sysfs", "/a", "--sysfs=/b"]).unwrap();
        assert_eq!(o.sysfs, PathBuf::from("/b"));
    }
}
