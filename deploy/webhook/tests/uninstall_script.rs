//! The uninstall DaemonSet's script (taken from deploy/kubernetes/uninstall/uninstall.yaml)
//! run with /bin/sh in a fresh network namespace (`unshare --net`, needs root) that holds
//! a real bridge `fl0` and real nftables tables, over a temporary host tree: it removes
//! flowlane's config, binaries, library, state, leases, bridge and tables, and nothing else.

use std::path::Path;
use std::process::Command;

mod common;
use common::{uninstall_script, TempDir};

fn touch(root: &Path, rel: &str) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, rel).unwrap();
}

#[test]
fn uninstall_removes_flowlane_and_nothing_else() {
    let root = TempDir::new("uninstall");
    let r = &root.0;
    let gone = [
        "etc/cni/net.d/10-flowlane.conflist",
        "etc/cni/net.d/.10-flowlane.conflist.tmp.42",
        "opt/cni/bin/flowlane",
        "opt/cni/bin/flowlaned",
        "opt/cni/bin/.flowlane.tmp.42",
        "opt/flowlane/lib/libflowlane_preload.so",
        "var/lib/flowlane/pods/flowlane/abc-eth0.json",
        "var/lib/flowlane/daemon/listeners.json",
        "run/flowlane/flowlaned.sock",
        "var/lib/cni/networks/flowlane/10.244.1.5",
        "var/lib/cni/networks/flowlane/lock",
    ];
    let kept = [
        "etc/cni/net.d/20-other.conflist",
        "opt/cni/bin/portmap",
        "opt/cni/bin/host-local",
        "var/lib/cni/networks/other/10.9.0.2",
    ];
    for f in gone.iter().chain(&kept) {
        touch(r, f);
    }
    let script = uninstall_script();
    // in a private netns: a bridge fl0, flowlane's tables and a table that is not ours
    let out = Command::new("unshare")
        .args(["--net", "/bin/sh", "-c"])
        .arg(
            "set -e
             ip link add fl0 type bridge
             ip link add other0 type bridge
             nft add table ip flowlane
             nft add table ip6 flowlane
             nft add table ip keepme
             /bin/sh -c \"$SCRIPT\"
             echo '--- links'; ip -o link show
             echo '--- tables'; nft list tables",
        )
        .env("SCRIPT", &script)
        .env("HOST_ROOT", r)
        .output()
        .expect("unshare (util-linux)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout: {stdout}\nstderr: {stderr}");
    assert!(stdout.contains("flowlane removed from"), "{stdout}");
    let (_, after) = stdout.split_once("--- links").unwrap();
    let (links, tables) = after.split_once("--- tables").unwrap();
    assert!(!links.contains("fl0:"), "bridge removed: {links}");
    assert!(links.contains("other0:"), "other bridge kept: {links}");
    assert!(!tables.contains("flowlane"), "tables removed: {tables}");
    assert!(tables.contains("table ip keepme"), "{tables}");
    for f in gone {
        assert!(!r.join(f).exists(), "{f} removed");
    }
    for f in kept {
        assert!(r.join(f).exists(), "{f} kept");
    }
    // the mount points themselves stay (they are hostPath volumes of the running pod)
    for d in ["opt/flowlane/lib", "var/lib/flowlane", "run/flowlane"] {
        assert!(r.join(d).is_dir(), "{d}");
    }

    // a second run on a clean node succeeds too (a node added during the uninstall)
    let again = Command::new("unshare")
        .args(["--net", "/bin/sh", "-c", "/bin/sh -c \"$SCRIPT\""])
        .env("SCRIPT", &script)
        .env("HOST_ROOT", r)
        .output()
        .unwrap();
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
}
