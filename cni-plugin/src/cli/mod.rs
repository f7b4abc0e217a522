//! The commands a person runs on a node. Each subcommand lives in its own
//! module and returns the process exit code.

mod diag;
mod external;
mod status;

use std::ffi::OsString;

use clap::{CommandFactory, Parser, Subcommand};

/// The command line of `flowlane` when a person runs it (clap: `--flag value`
/// and `--flag=value`, generated help, completions). A container runtime
/// runs the same binary with `CNI_COMMAND` set and never gets here.
#[derive(Parser, Debug)]
#[command(
    name = "flowlane",
    version,
    about = "flowlane: CNI plugin and node tool for ML training networks",
    long_about = "flowlane: CNI plugin and node tool for ML training networks.\n\n\
                  When run by a container runtime (CNI_COMMAND set) it is the CNI plugin;\n\
                  these are the commands for people.",
    arg_required_else_help = true,
    // A repeated option takes its last value (scripts append overrides).
    args_override_self = true
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    /// Lanes, connections and counters of the node daemon.
    Status(status::Args),
    Diag(diag::Args),
    /// A local training cluster on this machine (runs the flowlane-cluster binary;
    /// `flowlane cluster --help` for its commands).
    #[command(disable_help_flag = true)]
    Cluster(Passthrough),
    /// Run the training-traffic demo and write a report (runs the flowlane-cluster
    /// binary; `flowlane demo --help` for its options).
    #[command(disable_help_flag = true)]
    Demo(Passthrough),
    /// Print the version.
    Version,
    /// Print shell completions for flowlane's commands.
    Completions {
        shell: clap_complete::Shell,
    },
}

/// The rest of a `cluster` or `demo` command line, as typed: the
/// flowlane-cluster binary parses it.
#[derive(clap::Args, Debug)]
pub(crate) struct Passthrough {
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "ARGS"
    )]
    args: Vec<OsString>,
}

pub fn main(args: Vec<OsString>) -> i32 {
    let cli = match Cli::try_parse_from(std::iter::once(OsString::from("flowlane")).chain(args)) {
        Ok(cli) => cli,
        // Help and version to stdout with 0, usage errors to stderr with 2.
        Err(e) => {
            let _ = e.print();
            return e.exit_code();
        }
    };
    match cli.command {
        Command::Status(a) => status::main(a),
        Command::Diag(a) => diag::main(a),
        Command::Cluster(p) => external::exec("cluster", &p.args),
        Command::Demo(p) => external::exec("demo", &p.args),
        Command::Version => {
            println!("flowlane {}", env!("CARGO_PKG_VERSION"));
            0
        }
        Command::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "flowlane",
                &mut std::io::stdout(),
            );
            0
        }
    }
}

/// Parses a person's command line (the unit tests of each command).
#[cfg(test)]
pub(crate) fn parse(args: &[&str]) -> Result<Command, clap::Error> {
    Cli::try_parse_from(std::iter::once("flowlane").chain(args.iter().copied())).map(|c| c.command)
}

/// Human-readable size with binary units (`flowlane status` and `diag`).
fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `cluster` and `demo` hand the rest of the line, flags and `--help`
    /// included, to flowlane-cluster untouched.
    #[test]
    fn cluster_and_demo_pass_their_arguments_through() {
        let Command::Cluster(p) = parse(&["cluster", "up", "--nodes=2", "--help"]).unwrap() else {
            panic!("not parsed as cluster");
        };
        assert_eq!(p.args, ["up", "--nodes=2", "--help"]);
        let Command::Demo(p) = parse(&["demo", "--out", "/tmp/x"]).unwrap() else {
            panic!("not parsed as demo");
        };
        assert_eq!(p.args, ["--out", "/tmp/x"]);
    }

    #[test]
    fn no_command_or_an_unknown_one_is_a_usage_error() {
        use clap::error::ErrorKind;
        let e = parse(&[]).unwrap_err();
        assert_eq!(
            e.kind(),
            ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
        );
        assert_eq!(e.exit_code(), 2);
        let e = parse(&["bogus"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidSubcommand);
        assert_eq!(e.exit_code(), 2);
    }

    #[test]
    fn completions_name_every_command() {
        let mut out = Vec::new();
        clap_complete::generate(
            clap_complete::Shell::Bash,
            &mut Cli::command(),
            "flowlane",
            &mut out,
        );
        let script = String::from_utf8(out).unwrap();
        for cmd in [
            "status",
            "diag",
            "cluster",
            "demo",
            "version",
            "completions",
        ] {
            assert!(script.contains(cmd), "{cmd} missing from the completions");
        }
        assert!(script.contains("--cni-conf-dir"));
    }
}
