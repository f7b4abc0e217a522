//! `flowlane status`: the node daemon's lanes, counters, connections and
//! listeners. `--json` prints the daemon's stats answer as it is (for
//! scripts); `--socket PATH` picks the daemon (else `$FLOWLANE_SOCKET`,
//! else the default socket).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use flowlane_lane::client::DaemonClient;
use flowlane_lane::proto::Stats;

const TIMEOUT: Duration = Duration::from_secs(5);

/// `flowlane status`'s command line.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Print the daemon's stats answer as JSON, as it is (for scripts).
    #[arg(long)]
    json: bool,
    /// The daemon's socket [default: $FLOWLANE_SOCKET, else the node's default socket].
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
}

pub fn main(args: Args) -> i32 {
    let socket = args
        .socket
        .clone()
        .or_else(|| std::env::var_os("FLOWLANE_SOCKET").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(flowlane_defaults::DAEMON_SOCKET));
    let stats = match DaemonClient::connect(&socket, TIMEOUT).and_then(|mut c| c.stats()) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            eprintln!(
                "flowlane status: flowlaned on {} refused: {e}\n\
                 (node-wide stats are for root or flowlaned's --admin-gid group, in the node's \
                 network namespace)",
                socket.display()
            );
            return 1;
        }
        Err(e) => {
            eprintln!(
                "flowlane status: no flowlaned answers on {}: {e}\n\
                 (is the daemon running on this node? choose its socket with --socket PATH)",
                socket.display()
            );
            return 1;
        }
    };
    if args.json {
        match serde_json::to_string_pretty(&stats) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("flowlane status: {e}");
                return 1;
            }
        }
    } else {
        print!("{}", render(&stats));
    }
    0
}

fn duration(secs: u64) -> String {
    match secs {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m{:02}s", s / 60, s % 60),
        s => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// Left-aligned columns sized to their widest cell.
fn table(head: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = head.iter().map(|h| h.len()).collect();
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let mut out = String::new();
    let mut line = |cells: Vec<&str>| {
        let mut l = String::new();
        for (i, (c, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                l.push_str(c);
            } else {
                let _ = write!(l, "{c:<w$}  ");
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(head.to_vec());
    for r in rows {
        line(r.iter().map(String::as_str).collect());
    }
    out
}

fn render(s: &Stats) -> String {
    let d = &s.daemon;
    let mut out = format!(
        "flowlaned {} (pid {}, up {}), socket {}, state {}\n\
         pods {}, listeners {}, registry reloads {}\n\n",
        d.version,
        d.pid,
        duration(d.uptime_secs),
        d.socket,
        d.state_dir,
        d.pods,
        s.listeners.len(),
        d.registry_reloads
    );
    let lanes: Vec<Vec<String>> = s
        .lanes
        .iter()
        .map(|(name, l)| {
            vec![
                name.clone(),
                l.connections_opened.to_string(),
                l.connections_active.to_string(),
                l.connections_closed.to_string(),
                l.channels_pending.to_string(),
                l.channels_stocked.to_string(),
                crate::cli::human_bytes(l.bytes),
            ]
        })
        .collect();
    out += &table(
        &[
            "LANE", "OPENED", "ACTIVE", "CLOSED", "PENDING", "STOCKED", "BYTES",
        ],
        &lanes,
    );
    let total: u64 = s.fallbacks.values().sum();
    let _ = writeln!(out, "\nFALLBACKS TO TCP: {total}");
    if !s.fallbacks.is_empty() {
        let rows: Vec<Vec<String>> = s
            .fallbacks
            .iter()
            .map(|(r, n)| vec![format!("  {r}"), n.to_string()])
            .collect();
        out += &table(&["  REASON", "COUNT"], &rows);
    }
    let _ = writeln!(
        out,
        "auth failures {}, bad requests {}, refused connections {}",
        s.auth_failures, s.bad_requests, s.connections_refused
    );
    // Cross-node lane failures and refusals (peers not in the node table,
    // peers without the lane key, streams refused): the kinds seen.
    let lane_errors: Vec<Vec<String>> = s
        .lane_errors
        .iter()
        .flat_map(|(lane, kinds)| {
            kinds
                .iter()
                .filter(|(_, n)| **n > 0)
                .map(move |(k, n)| vec![format!("  {lane}"), k.clone(), n.to_string()])
        })
        .collect();
    if !lane_errors.is_empty() {
        let total: u64 = s.lane_errors.values().flat_map(|k| k.values()).sum();
        let _ = writeln!(out, "\nLANE ERRORS: {total}");
        out += &table(&["  LANE", "KIND", "COUNT"], &lane_errors);
    }
    let _ = writeln!(out, "\nCONNECTIONS: {}", s.connections.len());
    if !s.connections.is_empty() {
        let rows: Vec<Vec<String>> = s
            .connections
            .iter()
            .map(|c| {
                vec![
                    c.id.to_string(),
                    c.lane.clone(),
                    format!("{} {}", c.client.pod, c.client.addr),
                    format!("{} {}", c.server.pod, c.server.addr),
                    crate::cli::human_bytes(c.bytes_client_to_server),
                    crate::cli::human_bytes(c.bytes_server_to_client),
                    duration(c.age_secs),
                ]
            })
            .collect();
        out += &table(
            &["ID", "LANE", "CLIENT", "SERVER", "C->S", "S->C", "AGE"],
            &rows,
        );
    }
    let _ = writeln!(out, "\nLISTENERS: {}", s.listeners.len());
    if !s.listeners.is_empty() {
        let rows: Vec<Vec<String>> = s
            .listeners
            .iter()
            .map(|l| vec![l.pod.clone(), l.addr.to_string(), l.processes.to_string()])
            .collect();
        out += &table(&["POD", "ADDRESS", "PROCESSES"], &rows);
    }
    // The webhook's probes: which containers load the library (lane) and which
    // stay on plain TCP (musl, no libc, glibc too old), per pod and image.
    if !s.injections.is_empty() {
        let _ = writeln!(out, "\nINJECTION: {}", s.injections.len());
        let rows: Vec<Vec<String>> = s
            .injections
            .iter()
            .map(|i| {
                let verdict = match i.verdict {
                    flowlane_lane::proto::InjectionVerdict::Lane => "lane",
                    flowlane_lane::proto::InjectionVerdict::Tcp => "tcp",
                };
                vec![
                    i.pod.clone(),
                    i.containers.join(","),
                    verdict.to_string(),
                    i.libc.clone(),
                    i.reason.clone(),
                ]
            })
            .collect();
        out += &table(&["POD", "CONTAINERS", "GETS", "LIBC", "WHY"], &rows);
    }
    if let Some(p) = &s.processes {
        out += &render_processes(p);
    }
    out
}

/// The daemon's scan of the pods' processes: per pod how many run the
/// library (LANE), how many hold TCP sockets without it (TCP) or hold none
/// now (IDLE), and why; then each process that holds TCP sockets without
/// the lane (the JSON form lists the idle ones too).
fn render_processes(p: &flowlane_lane::proto::ProcessScan) -> String {
    let mut out = format!(
        "\nPROCESSES: {} pods with processes, scanned {} ago in {} ms{}{}\n",
        p.pods.len(),
        duration(p.age_ms / 1000),
        p.duration_ms,
        if p.complete {
            ""
        } else {
            " (cut short by its bounds: some processes not seen)"
        },
        if p.unreadable > 0 {
            format!(
                "; {} processes not readable by the daemon (it needs CAP_SYS_PTRACE)",
                p.unreadable
            )
        } else {
            String::new()
        }
    );
    if p.pods.is_empty() {
        return out;
    }
    let why = |reasons: &mut dyn Iterator<Item = (String, u32)>| -> String {
        reasons
            .map(|(r, n)| format!("{r} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let rows: Vec<Vec<String>> = p
        .pods
        .iter()
        .map(|pod| {
            vec![
                pod.pod.clone(),
                pod.lane.to_string(),
                pod.tcp.to_string(),
                pod.idle.to_string(),
                why(&mut pod.reasons.iter().map(|(r, n)| (r.name().to_string(), *n))),
            ]
        })
        .collect();
    out += &table(&["POD", "LANE", "TCP", "IDLE", "WHY NOT"], &rows);
    let on_tcp: Vec<Vec<String>> = p
        .pods
        .iter()
        .flat_map(|pod| {
            pod.off_lane
                .iter()
                .filter(|o| o.tcp_sockets > 0)
                .map(move |o| {
                    vec![
                        format!("  {}", pod.pod),
                        o.pid.to_string(),
                        o.tcp_sockets.to_string(),
                        o.reasons
                            .iter()
                            .map(|r| r.name())
                            .collect::<Vec<_>>()
                            .join(","),
                        o.exe.clone(),
                    ]
                })
        })
        .collect();
    if !on_tcp.is_empty() {
        let _ = writeln!(out, "\nON TCP: {}", on_tcp.len());
        out += &table(&["  POD", "PID", "TCP", "WHY", "EXE"], &on_tcp);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use flowlane_lane::proto::{ConnectionInfo, Endpoint, LaneStats};

    fn parse(v: &[&str]) -> Result<Args, clap::Error> {
        match crate::cli::parse(&[&["status"], v].concat())? {
            crate::cli::Command::Status(a) => Ok(a),
            _ => unreachable!("parsed as another command"),
        }
    }

    #[test]
    fn parses_flags_and_rejects_unknown_ones() {
        let o = parse(&["--json", "--socket", "/tmp/x.sock"]).unwrap();
        assert!(o.json);
        assert_eq!(o.socket, Some(PathBuf::from("/tmp/x.sock")));
        assert_eq!(
            parse(&["--socket=/y"]).unwrap().socket,
            Some(PathBuf::from("/y"))
        );
        assert!(parse(&["--socket"]).is_err());
        assert!(parse(&["--bogus"]).is_err());
    }

    #[test]
    fn renders_lanes_fallbacks_and_connections() {
        let mut s = Stats::default();
        s.lanes.insert(
            "shm".into(),
            LaneStats {
                connections_opened: 3,
                connections_active: 1,
                connections_closed: 2,
                bytes: 3 << 30,
                channels_pending: 0,
                channels_stocked: 5,
                ..LaneStats::default()
            },
        );
        s.fallbacks.insert("no-listener".into(), 4);
        s.lane_errors.insert(
            "relay".into(),
            [
                ("peer_auth_failed".to_string(), 3),
                ("peer_unknown".to_string(), 0),
            ]
            .into_iter()
            .collect(),
        );
        s.connections.push(ConnectionInfo {
            id: 9,
            lane: "shm".into(),
            client: Endpoint {
                pod: "default/a".into(),
                addr: "10.0.0.2:4000".parse().unwrap(),
            },
            server: Endpoint {
                pod: "default/b".into(),
                addr: "10.0.0.3:80".parse().unwrap(),
            },
            region_len: 4096,
            bytes_client_to_server: 2048,
            bytes_server_to_client: 0,
            age_secs: 75,
        });
        let t = render(&s);
        assert!(
            t.contains("shm   3       1       2       0        5        3.0 GiB"),
            "{t}"
        );
        assert!(t.contains("FALLBACKS TO TCP: 4"));
        assert!(t.contains("no-listener"));
        assert!(t.contains("default/a 10.0.0.2:4000"));
        assert!(t.contains("2.0 KiB"));
        assert!(t.contains("1m15s"));
        assert!(t.contains("LANE ERRORS: 3"), "{t}");
        assert!(t.contains("relay  peer_auth_failed  3"), "{t}");
        assert!(
            !t.contains("peer_unknown"),
            "zero counts are not shown: {t}"
        );
        assert!(!t.contains("INJECTION"), "no probe reported: {t}");
        s.injections.push(flowlane_lane::proto::InjectionInfo {
            pod: "default/mixed".into(),
            containers: vec!["tool".into(), "sidecar".into()],
            verdict: flowlane_lane::proto::InjectionVerdict::Tcp,
            libc: "musl".into(),
            reason: "musl cannot load a glibc library".into(),
        });
        let t = render(&s);
        assert!(!t.contains("PROCESSES"), "no scan: {t}");
        assert!(t.contains("INJECTION: 1"), "{t}");
        assert!(
            t.contains("default/mixed  tool,sidecar  tcp   musl  musl cannot load a glibc library"),
            "{t}"
        );
    }

    #[test]
    fn renders_the_process_scan() {
        use flowlane_lane::proto::{OffLaneProcess, OffLaneReason, PodProcesses, ProcessScan};
        let mut s = Stats {
            processes: Some(ProcessScan {
                age_ms: 2500,
                duration_ms: 7,
                complete: true,
                unreadable: 0,
                pods: vec![PodProcesses {
                    pod: "default/app".into(),
                    lane: 3,
                    tcp: 1,
                    idle: 1,
                    reasons: [(OffLaneReason::Static, 2), (OffLaneReason::IoUring, 1)]
                        .into_iter()
                        .collect(),
                    off_lane: vec![
                        OffLaneProcess {
                            pid: 812,
                            exe: "/srv/app".into(),
                            tcp_sockets: 2,
                            reasons: vec![OffLaneReason::Static, OffLaneReason::IoUring],
                        },
                        OffLaneProcess {
                            pid: 1,
                            exe: "/pause".into(),
                            tcp_sockets: 0,
                            reasons: vec![OffLaneReason::Static],
                        },
                    ],
                }],
            }),
            ..Stats::default()
        };
        let t = render(&s);
        assert!(
            t.contains("PROCESSES: 1 pods with processes, scanned 2s ago in 7 ms\n"),
            "{t}"
        );
        assert!(
            t.contains("default/app  3     1    1     static 2, io-uring 1"),
            "{t}"
        );
        assert!(t.contains("ON TCP: 1"), "{t}");
        assert!(
            t.contains("  default/app  812  2    static,io-uring  /srv/app"),
            "{t}"
        );
        assert!(
            !t.contains("/pause"),
            "idle processes are counted only: {t}"
        );
        s.processes.as_mut().unwrap().complete = false;
        s.processes.as_mut().unwrap().unreadable = 2;
        let t = render(&s);
        assert!(t.contains("cut short"), "{t}");
        assert!(t.contains("; 2 processes not readable"), "{t}");
    }
}
