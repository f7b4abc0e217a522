//! Is `flowlaned` up, is it this version, does it read the same pod
//! registry, and what are its lanes carrying? Asks the daemon's `stats`
//! request over its Unix socket (the answer names its pid, whose limits
//! the host section reads).

use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::time::Duration;

use flowlane_lane::client::DaemonClient;
use flowlane_lane::proto::Stats;

use super::report::Section;

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct DaemonState {
    pub up: bool,
    pub pid: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stats: Option<Stats>,
}

const START: &str = "start flowlaned (kubectl -n kube-system get pods -l app=flowlane -o wide; \
                     locally: flowlaned --state-dir <dir> --socket <path>). Pods keep working on \
                     plain TCP meanwhile";

pub fn check(socket: &Path, state_dir: &Path) -> (Section, DaemonState) {
    let mut s = Section::new("daemon", format!("Node daemon ({})", socket.display()));
    let mut st = DaemonState::default();
    match std::fs::metadata(socket) {
        Err(_) => s.error(
            "daemon.down",
            "flowlaned is not running: its socket does not exist; every connection stays on plain TCP",
            START,
        ),
        Ok(m) if !m.file_type().is_socket() => s.error(
            "daemon.socket_not_a_socket",
            format!("{} exists but is not a socket", socket.display()),
            "remove the file and restart flowlaned",
        ),
        Ok(_) => match DaemonClient::connect(socket, Duration::from_secs(5)) {
            Err(e) => s.error(
                "daemon.down",
                format!(
                    "nobody answers on the socket ({e}): flowlaned died and left it behind; \
                     every connection stays on plain TCP"
                ),
                START,
            ),
            Ok(mut client) => {
                st.up = true;
                match client.stats() {
                    Ok(stats) => {
                        describe(&mut s, &stats, state_dir);
                        st.pid = i32::try_from(stats.daemon.pid).ok();
                        st.stats = Some(stats);
                    }
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
                        ) =>
                    {
                        s.error(
                            "daemon.unresponsive",
                            format!(
                                "flowlaned accepts connections but does not answer ({e}): pods' \
                                 connects wait for its timeout, then stay on TCP"
                            ),
                            "restart flowlaned (live channels keep flowing; it rebuilds its state \
                             from the pod registry) and look at its log for the cause",
                        )
                    }
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::UnexpectedEof
                                | std::io::ErrorKind::ConnectionReset
                                | std::io::ErrorKind::ConnectionAborted
                                | std::io::ErrorKind::BrokenPipe
                        ) =>
                    {
                        s.error(
                            "daemon.down",
                            format!(
                                "flowlaned closed the connection without answering ({e}): it is \
                                 crashing or shutting down; connections stay on plain TCP"
                            ),
                            START,
                        )
                    }
                    Err(e) => s.warn(
                        "daemon.stats_unavailable",
                        format!("flowlaned is up, but did not give its stats ({e})"),
                        "run diag on the node (its network namespace) as root or as a member of \
                         flowlaned's --admin-gid group (the daemon answers stats only to them), \
                         and use the same release for daemon and plugin",
                    ),
                }
            }
        },
    }
    s.data = serde_json::to_value(&st).unwrap_or_default();
    (s, st)
}

fn describe(s: &mut Section, stats: &Stats, state_dir: &Path) {
    let d = &stats.daemon;
    s.ok(
        "daemon.up",
        format!(
            "flowlaned {} answers (pid {}, up {}, protocol {}), {} pod(s) known",
            d.version,
            d.pid,
            duration(d.uptime_secs),
            d.protocol,
            d.pods
        ),
    );
    let ours = env!("CARGO_PKG_VERSION");
    if d.version != ours {
        s.error(
            "daemon.version_mismatch",
            format!(
                "flowlaned is version {}, the plugin and this diag are {ours}",
                d.version
            ),
            "finish the upgrade: restart the flowlane DaemonSet pod on this node so daemon and \
             plugin come from the same release",
        );
    }
    if !d.state_dir.is_empty() && Path::new(&d.state_dir) != state_dir {
        s.warn(
            "daemon.state_dir_differs",
            format!(
                "flowlaned reads the pod registry in {}, the plugin writes it in {}",
                d.state_dir,
                state_dir.display()
            ),
            "give flowlaned --state-dir the plugin's stateDir; until then it knows no pods and \
             every connection stays on TCP",
        );
    }
    for (lane, l) in &stats.lanes {
        s.info(
            "daemon.lane",
            format!(
                "lane {lane}: {} active, {} opened, {} closed, {} moved by closed connections, {} pending, {} stocked",
                l.connections_active,
                l.connections_opened,
                l.connections_closed,
                crate::cli::human_bytes(l.bytes),
                l.channels_pending,
                l.channels_stocked
            ),
        );
    }
    if !stats.fallbacks.is_empty() {
        let list: Vec<String> = stats
            .fallbacks
            .iter()
            .map(|(r, n)| format!("{r} {n}"))
            .collect();
        s.info(
            "daemon.fallbacks",
            format!("connections kept on TCP, by reason: {}", list.join(", ")),
        );
    }
    for c in stats.connections.iter().take(50) {
        s.info(
            "daemon.connection",
            format!(
                "#{} {}: {} {} -> {} {}, {} client->server, {} server->client (counted as the ends close), age {}",
                c.id,
                c.lane,
                c.client.pod,
                c.client.addr,
                c.server.pod,
                c.server.addr,
                crate::cli::human_bytes(c.bytes_client_to_server),
                crate::cli::human_bytes(c.bytes_server_to_client),
                duration(c.age_secs)
            ),
        );
    }
    if stats.connections.len() > 50 {
        s.info(
            "daemon.connection",
            format!("... and {} more (see --json)", stats.connections.len() - 50),
        );
    }
    if stats.auth_failures > 0 {
        s.warn(
            "daemon.auth_failures",
            format!(
                "{} request(s) refused because the caller is not the pod it claimed to be",
                stats.auth_failures
            ),
            "a process asked for channels of another pod's addresses: check the pods' registry \
             entries (below) and the daemon's log",
        );
    }
}

fn duration(secs: u64) -> String {
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}
