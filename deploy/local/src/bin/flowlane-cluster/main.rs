//! `flowlane-cluster`: the heavy commands of the `flowlane` tool, `flowlane
//! cluster ...` and `flowlane demo ...`, in a binary of their own so the CNI
//! plugin binary (`flowlane`, which a container runtime runs on every pod
//! start) links neither the local cluster nor the training workloads.
//! `flowlane cluster|demo ARGS` executes `flowlane-cluster cluster|demo ARGS`
//! (found beside `flowlane`, then on `PATH`), the way `git` runs its
//! subcommands; run directly it takes the same arguments.

mod cluster;
mod demo;

const USAGE: &str = "\
flowlane-cluster: the local training cluster and the demo (run by `flowlane cluster` and `flowlane demo`)
  flowlane-cluster cluster up|down|status|exec|check [options]
  flowlane-cluster demo [options]
";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let code = match args.first().map(String::as_str) {
        Some("cluster") => cluster::main(&args[1..]),
        Some("demo") => demo::main(&args[1..]),
        Some("help") | Some("--help") | Some("-h") | None => {
            print!("{USAGE}");
            0
        }
        Some(other) => {
            eprintln!("flowlane-cluster: unknown command {other:?}\n\n{USAGE}");
            2
        }
    };
    std::process::exit(code);
}
