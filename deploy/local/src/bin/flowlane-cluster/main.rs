//! `flowlane-cluster`: the heavy commands of the `flowlane` tool, `flowlane
//! cluster ...` and `flowlane demo ...`, in a binary of their own so the CNI
//! plugin binary (`flowlane`, which a container runtime runs on every pod
//! start) links neither the local cluster nor the training workloads.
//! `flowlane cluster|demo ARGS` executes `flowlane-cluster cluster|demo ARGS`
//! (found beside `flowlane`, then on `PATH`), the way `git` runs its
//! subcommands; run directly it takes the same arguments.
//!
//! The command line is clap's (`args.rs`): `--flag value` and
//! `--flag=value`, generated help, `completions SHELL`.

mod args;
mod cluster;
mod demo;

use clap::{CommandFactory, Parser};

use args::{Cli, Command};

fn main() {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Cluster(c) => cluster::main(c),
        Command::Demo(d) => demo::main(d),
        Command::Completions { shell } => {
            // Named as people type it: `flowlane cluster ...`.
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "flowlane",
                &mut std::io::stdout(),
            );
            0
        }
    };
    std::process::exit(code);
}
