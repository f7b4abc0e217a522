//! The commands a person runs on a node. Each subcommand lives in its own
//! module and returns the process exit code.

mod diag;
mod external;
mod status;

const USAGE: &str = "\
flowlane: CNI plugin and node tool for ML training networks

When run by a container runtime (CNI_COMMAND set) it is the CNI plugin.
Commands for people:
  flowlane status [--json] [--socket PATH]   lanes, connections and counters of the node daemon
  flowlane diag [--json] [options]           check this node and explain every problem
  flowlane cluster up|down|status [options]  a local training cluster on this machine
  flowlane demo [--out DIR]                  run the training-traffic demo and write a report
                                             (cluster and demo run the flowlane-cluster binary)
  flowlane version                           print the version
";

pub fn main(args: Vec<String>) -> i32 {
    match args.first().map(String::as_str) {
        Some("status") => status::main(&args[1..]),
        Some("diag") => diag::main(&args[1..]),
        Some("cluster") | Some("demo") => external::exec(&args),
        Some("version") | Some("--version") | Some("-V") => {
            println!("flowlane {}", env!("CARGO_PKG_VERSION"));
            0
        }
        Some("help") | Some("--help") | Some("-h") | None => {
            print!("{USAGE}");
            0
        }
        Some(other) => {
            eprintln!("flowlane: unknown command {other:?}\n\n{USAGE}");
            2
        }
    }
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
