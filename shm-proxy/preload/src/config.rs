//! Environment settings, read once when the library loads.

use flowlane_lane::ring;
use std::ffi::CStr;
use std::path::PathBuf;
use std::sync::OnceLock;

/// Default spin budget before a wait sleeps in the kernel, in microseconds.
pub const DEFAULT_SPIN_US: u64 = 50;

/// Default longest kernel sleep of a poll/select/epoll wait that watches a
/// shared-memory connection, in milliseconds. Only a safety net: every
/// sleeper is woken explicitly (see `sleepers`); tests make it long so that
/// a missed wake-up fails instead of being rescued.
pub const DEFAULT_WAIT_SLICE_MS: i32 = 250;

/// The library's settings (see docs/shm-lane.md).
#[derive(Debug)]
pub struct Config {
    /// `FLOWLANE_DISABLE=1`: the library passes every call straight through.
    pub disabled: bool,
    /// `FLOWLANE_RING_SIZE`: bytes per direction (suffix K/M/G allowed):
    /// the largest a ring grows to.
    pub ring_size: usize,
    /// `FLOWLANE_RING_INITIAL`: the capacity a ring starts with (grows
    /// with the traffic up to `ring_size`; at or above it, no growth).
    pub ring_initial: usize,
    /// `FLOWLANE_SPIN_US`: spin budget before sleeping.
    pub spin_us: u64,
    /// `FLOWLANE_LOG`: 0 = silent (default), 1 error, 2 warn, 3 info, 4 debug.
    pub log_level: u8,
    /// `FLOWLANE_SOCKET`: the daemon's Unix socket.
    pub socket: PathBuf,
    /// `FLOWLANE_WAIT_SLICE_MS`: longest single kernel sleep of a
    /// poll/select/epoll wait on a shared-memory connection.
    pub wait_slice_ms: i32,
    /// `FLOWLANE_NT_STORES=0`: bulk copies into rings use ordinary stores
    /// only (default: streaming stores, see `flowlane_lane::copy`).
    pub nt_stores: bool,
}

static CONFIG: OnceLock<Config> = OnceLock::new();

/// The settings (read from the environment on first use).
pub fn get() -> &'static Config {
    CONFIG.get_or_init(read_env)
}

fn env(name: &CStr) -> Option<String> {
    // SAFETY: getenv with a valid C string; the result is copied at once
    // (settings are read in the constructor, before threads usually exist).
    let p = unsafe { libc::getenv(name.as_ptr()) };
    if p.is_null() {
        return None;
    }
    // SAFETY: getenv returned a NUL-terminated string.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// Parses "65536", "64K", "1M", "1G".
pub fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mult) = match s.chars().last()?.to_ascii_uppercase() {
        'K' => (&s[..s.len() - 1], 1usize << 10),
        'M' => (&s[..s.len() - 1], 1 << 20),
        'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.trim().parse::<usize>().ok()?.checked_mul(mult)
}

/// An on/off setting: `Some(false)` for "", 0, false, no, off; `Some(true)`
/// for 1, true, yes, on; `None` for anything else (the caller's choice).
fn switch(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "" | "0" | "false" | "no" | "off" => Some(false),
        "1" | "true" | "yes" | "on" => Some(true),
        _ => None,
    }
}

fn parse_level(s: &str) -> u8 {
    match s.trim().to_ascii_lowercase().as_str() {
        "" | "0" | "off" | "none" => 0,
        "error" | "1" => 1,
        "warn" | "2" => 2,
        "info" | "3" => 3,
        _ => 4,
    }
}

fn read_env() -> Config {
    let disabled = env(c"FLOWLANE_DISABLE").is_some_and(|v| switch(&v).unwrap_or(true));
    let ring_size = env(c"FLOWLANE_RING_SIZE")
        .and_then(|v| parse_size(&v))
        .unwrap_or(ring::DEFAULT_RING_SIZE)
        .clamp(ring::MIN_RING_SIZE, ring::MAX_RING_SIZE);
    let ring_initial = env(c"FLOWLANE_RING_INITIAL")
        .and_then(|v| parse_size(&v))
        .unwrap_or(ring::DEFAULT_INITIAL_RING)
        .clamp(ring::MIN_RING_SIZE, ring_size);
    let spin_us = env(c"FLOWLANE_SPIN_US")
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(DEFAULT_SPIN_US)
        .min(1_000_000);
    let log_level = env(c"FLOWLANE_LOG").map(|v| parse_level(&v)).unwrap_or(0);
    let socket = env(c"FLOWLANE_SOCKET")
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| flowlane_defaults::DAEMON_SOCKET.to_string())
        .into();
    let wait_slice_ms = env(c"FLOWLANE_WAIT_SLICE_MS")
        .and_then(|v| v.trim().parse::<i32>().ok())
        .unwrap_or(DEFAULT_WAIT_SLICE_MS)
        .clamp(1, 3_600_000);
    let nt_stores = env(c"FLOWLANE_NT_STORES").is_none_or(|v| switch(&v).unwrap_or(true));
    Config {
        disabled,
        ring_size,
        ring_initial,
        spin_us,
        log_level,
        socket,
        wait_slice_ms,
        nt_stores,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("64K"), Some(65536));
        assert_eq!(parse_size("1m"), Some(1 << 20));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size(""), None);
    }

    #[test]
    fn switches_parse() {
        assert_eq!(switch("0"), Some(false));
        assert_eq!(switch(" Off "), Some(false));
        assert_eq!(switch(""), Some(false));
        assert_eq!(switch("yes"), Some(true));
        assert_eq!(switch("1"), Some(true));
        assert_eq!(switch("maybe"), None);
    }

    #[test]
    fn levels_parse() {
        assert_eq!(parse_level("off"), 0);
        assert_eq!(parse_level("warn"), 2);
        assert_eq!(parse_level("debug"), 4);
    }
}
