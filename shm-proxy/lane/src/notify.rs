//! The CNI plugin's best-effort "the pod registry changed" poke to `flowlaned`.
//!
//! The plugin must work when the daemon is not running, so every failure here
//! is reported to the caller, who logs it and carries on.

use std::path::Path;
use std::time::Duration;

use crate::client::DaemonClient;

/// Tells the daemon at `socket` to reread the pod registry, and waits (bounded
/// by `timeout`) until it has: a pod that the plugin just added is then known
/// to the daemon when this returns `Ok`. Fails quickly when no daemon listens.
pub fn notify_registry_changed(socket: &Path, timeout: Duration) -> std::io::Result<()> {
    DaemonClient::connect(socket, timeout)?.registry_changed()
}
