//! A node without rdma-core: binaries that link the RDMA transport start
//! and run, and opening a device fails with a clear error (sideway's
//! rdma-mummy-sys loads libibverbs.so.1 with dlopen at start; nothing is
//! linked at build time).

use std::{path::Path, process::Command};

const BIN: &str = env!("CARGO_BIN_EXE_rdma-lane-bench");

#[test]
fn the_binary_does_not_link_libibverbs() {
    let out = Command::new("ldd").arg(BIN).output().expect("ldd");
    let libs = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ldd: {libs}");
    assert!(
        !libs.contains("libibverbs"),
        "linked at build time:\n{libs}"
    );
    assert!(!libs.contains("librdmacm"), "linked at build time:\n{libs}");
}

#[test]
fn without_libibverbs_the_binary_starts_and_says_why_there_is_no_rdma() {
    // Hide the library in a private mount namespace when it is installed
    // (CI installs rdma-core for the Soft-RoCE rig); as root only.
    let lib = [
        "/usr/lib/x86_64-linux-gnu/libibverbs.so.1",
        "/lib/x86_64-linux-gnu/libibverbs.so.1",
    ]
    .into_iter()
    .find(|p| Path::new(p).exists());
    let is_root = nix_is_root();
    let out = match (lib, is_root) {
        (Some(lib), true) => Command::new("unshare")
            .args(["-m", "sh", "-c"])
            .arg(format!(
                "mount --make-rprivate / && mount --bind /dev/null {lib} && exec {BIN} probe --device rxe0"
            ))
            .output()
            .expect("unshare"),
        (Some(_), false) => {
            eprintln!("SKIP: not root, cannot hide the installed libibverbs");
            return;
        }
        (None, _) => Command::new(BIN).args(["probe", "--device", "rxe0"]).output().expect("run"),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "exit {:?}: {stdout} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("@@PROBE {\"ok\":false"), "{stdout}");
    assert!(
        stdout.contains("libibverbs.so.1"),
        "the error names what is missing: {stdout}"
    );
}

fn nix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}
