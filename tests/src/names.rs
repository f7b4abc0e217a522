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
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let p = std::process::id() as usize % (36 * 36);
    format!("{}{}", DIGITS[p / 36] as char, DIGITS[p % 36] as char)
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
