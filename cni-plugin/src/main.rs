//! `flowlane`: the CNI plugin when a container runtime runs it (`CNI_COMMAND`
//! is set), and the node's command-line tool when a person runs it
//! (`flowlane status`, `flowlane diag`, `flowlane cluster ...`, `flowlane demo`).

mod cli;
mod cni;

fn main() {
    let code = if std::env::var_os("CNI_COMMAND").is_some() {
        cni::main()
    } else {
        cli::main(std::env::args_os().skip(1).collect())
    };
    std::process::exit(code);
}
