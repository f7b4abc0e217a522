//! Unique names for kernel objects and files.
//!
//! Tests of one binary run two at a time and other suites run concurrently on
//! the same machine, so every name carries the suite's prefix (`flt`), a
//! per-test tag and a per-process counter. Linux interface names are at most
//! 15 bytes, and so are these.

use std::sync::atomic::{AtomicU32, Ordering};

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// The prefix every netns, bridge and directory of the CNI suites starts with.
pub const PREFIX: &str = "flt";

/// Maximum length of a Linux interface name (IFNAMSIZ - 1).
pub const IFNAME_MAX: usize = 15;

/// A name `flt<tag><pp><n>`, at most 15 bytes: `tag` is up to 6 characters
/// chosen by the test (unique per test), `pp` two base-36 digits of the
/// process id (so that two runs of the suite at once rarely collide; callers
/// creating kernel objects still skip names that exist, see
/// [`crate::netns::Netns::new`] and [`crate::host::LinkGuard::fresh`]), `n` a
/// per-process counter.
pub fn unique(tag: &str) -> String {
    assert!(tag.len() <= 6, "tag {tag:?} too long for an interface name");
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let name = format!("{PREFIX}{tag}{}{n:x}", process_token());
    assert!(name.len() <= IFNAME_MAX, "{name} is too long");
    name
}

/// Two base-36 digits derived from the process id.
fn process_token() -> String {
    base36(std::process::id() % (36 * 36), 2)
}

/// `n` in base 36, at least `width` digits.
fn base36(mut n: u32, width: usize) -> String {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut out = Vec::new();
    while n > 0 || out.len() < width {
        out.push(DIGITS[(n % 36) as usize]);
        n /= 36;
    }
    out.reverse();
    String::from_utf8(out).unwrap()
}

/// Nodes of the same-host harness (`crate::shm::Node`) made by this
/// process: their own count, so that their 2-digit serial in the bridge
/// name stays short whatever else the run names.
static HOST_NODES: AtomicU32 = AtomicU32::new(0);

/// A same-host node's serial `n` (this process's n-th) and bridge name
/// `fls<tag><n in base 36, 2 digits><3 base-36 digits of the pid>b`.
///
/// The serial separates nodes within one test binary; the process digits
/// separate two runs of the binary at once (a full suite run next to
/// someone's single-suite run on a shared machine): with the serial alone
/// both made the same bridge and netns names, and each one's set-up
/// deleted and re-created the other's pods (a pod re-created by the other
/// run is unknown to this run's daemon: its connections stayed on TCP, or
/// its peer was unreachable).
pub fn host_node(tag: &str) -> (u32, String) {
    assert!(tag.len() <= 5, "tag {tag:?} too long for a bridge name");
    let n = HOST_NODES.fetch_add(1, Ordering::Relaxed);
    let run = base36(std::process::id() % (36 * 36 * 36), 3);
    let bridge = format!("fls{tag}{}{run}b", base36(n, 2));
    // The manual wiring's host veth end is as long as the bridge's name.
    assert!(bridge.len() <= IFNAME_MAX, "{bridge} is too long");
    (n, bridge)
}

/// A temporary directory's name, `flt-<tag>-<pid>-<n>` (see
/// [`crate::fsutil::TempDir`]: short, for the Unix sockets bound below it).
pub fn temp_dir_name(tag: &str) -> String {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{PREFIX}-{tag}-{}-{n}", std::process::id())
}

/// A network namespace's name, `<tag>-<pid>-<n>` (`tag` carries the
/// suite's own prefix): netns names are not interface names, so they may
/// be longer than 15 bytes and carry the whole process id.
pub fn netns(tag: &str) -> String {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{tag}-{}-{n}", std::process::id())
}

/// A multi-node cluster's tag, `<prefix><pid % 0xfff in hex><n in hex>`
/// (its node namespaces `<tag>n<i>`, underlay link `<tag>u0` and directory
/// start with it; short enough for the link's interface names), and `n`,
/// the cluster's number in this process (which picks its address slot).
pub fn cluster_tag(prefix: &str) -> (String, u32) {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let tag = format!("{prefix}{:x}{n:x}", std::process::id() % 0xfff);
    assert!(tag.len() + 2 <= IFNAME_MAX, "{tag} is too long");
    (tag, n)
}

/// A container id as a runtime would make it: long, unique, hex-ish.
pub fn container_id(tag: &str) -> String {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{PREFIX}-{tag}-{}-{n}-{:016x}", std::process::id(), nanos())
}

fn nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}
