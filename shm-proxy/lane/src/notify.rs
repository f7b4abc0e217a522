//! The CNI plugin's best-effort "the pod registry changed" poke to `flowlaned`.
//!
//! The plugin must work when the daemon is not running, so every failure here
//! is reported to the caller, who logs it and carries on.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// Default path of the daemon's Unix socket.
pub const DEFAULT_DAEMON_SOCKET: &str = "/run/flowlane/flowlaned.sock";

/// Tells the daemon at `socket` to reread the pod registry. Returns quickly
/// (bounded by `timeout`) whether or not a daemon is listening.
pub fn notify_registry_changed(socket: &Path, timeout: Duration) -> std::io::Result<()> {
    let mut s = UnixStream::connect(socket)?;
    s.set_write_timeout(Some(timeout))?;
    s.set_read_timeout(Some(timeout))?;
    // One JSON line; the daemon's protocol accepts it as its first message.
    s.write_all(b"{\"op\":\"registry-changed\"}\n")?;
    Ok(())
}
