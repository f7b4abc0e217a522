//! Is `flowlaned` up? Connects to its Unix socket; when it answers, the
//! peer credentials of the connection name its process (for its limits).

use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::Path;

use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};

use super::report::Section;

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct DaemonState {
    pub up: bool,
    pub pid: Option<i32>,
}

pub fn check(socket: &Path) -> (Section, DaemonState) {
    let mut s = Section::new("daemon", format!("Node daemon ({})", socket.display()));
    let mut st = DaemonState::default();
    let start = "start flowlaned (kubectl -n kube-system get pods -l app=flowlane on this node; \
                 locally: flowlaned --socket <path>). Pods keep working on plain TCP meanwhile";
    match std::fs::metadata(socket) {
        Err(_) => s.error(
            "daemon.down",
            "flowlaned is not running: its socket does not exist; every connection stays on plain TCP",
            start,
        ),
        Ok(m) if !m.file_type().is_socket() => s.error(
            "daemon.socket_not_a_socket",
            format!("{} exists but is not a socket", socket.display()),
            "remove the file and restart flowlaned",
        ),
        Ok(_) => match UnixStream::connect(socket) {
            Err(e) => s.error(
                "daemon.down",
                format!("nobody answers on the socket ({e}): flowlaned died and left it behind; every connection stays on plain TCP"),
                start,
            ),
            Ok(conn) => {
                st.up = true;
                st.pid = getsockopt(&conn, PeerCredentials).ok().map(|c| c.pid());
                s.ok(
                    "daemon.up",
                    format!(
                        "flowlaned answers{}",
                        st.pid.map(|p| format!(" (pid {p})")).unwrap_or_default()
                    ),
                );
            }
        },
    }
    s.data = serde_json::to_value(&st).unwrap_or_default();
    (s, st)
}
