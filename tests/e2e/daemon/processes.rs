//! The daemon's process scan against real programs in real pods: a client
//! pod holds one TCP connection per program to a server pod (a lane
//! listener), and `flowlane status` must say, per process, who runs the
//! library and why the others stay on TCP:
//!
//! | program | started with | expected |
//! |---|---|---|
//! | Python | the library | lane |
//! | Python | nothing | tcp: no-library |
//! | Python | the probe's no-op object under the library's name | tcp: noop-library |
//! | C, `gcc -static` | the library (ignored) | tcp: static |
//! | Go, `CGO_ENABLED=0` (static) | the library (ignored) | tcp: static, go |
//! | Go with cgo (dynamic) | the library (loaded, bypassed) | tcp: go |
//! | C with an io_uring | the library | tcp: io-uring |
//!
//! The programs are built here (gcc, Go from Debian's golang-go, offline);
//! a missing compiler fails the suite.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use flowlane_e2e::binaries::workspace_artifact;
use flowlane_e2e::shm::{self, wait_listening, Bg, Node, Pod};
use flowlane_lane::proto::{OffLaneReason, PodProcesses, Stats};

const PORT: u16 = 7413;

const SERVER: &str = r#"
import socket, sys
l = socket.socket()
l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind(("0.0.0.0", int(sys.argv[1])))
l.listen(64)
held = []
while True:
    c, _ = l.accept()
    held.append(c)
"#;

const PY_CLIENT: &str = r#"
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
s.sendall(b"x")
print("connected", flush=True)
time.sleep(3600)
"#;

/// A TCP client, optionally holding an io_uring (made with the raw system
/// call, as liburing does) before it connects.
const C_CLIENT: &str = r#"
#include <arpa/inet.h>
#include <linux/io_uring.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(int argc, char **argv) {
    if (argc > 3) {
        struct io_uring_params p;
        memset(&p, 0, sizeof p);
        if (syscall(__NR_io_uring_setup, 8, &p) < 0) { perror("io_uring_setup"); return 2; }
    }
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(atoi(argv[2])) };
    inet_pton(AF_INET, argv[1], &a.sin_addr);
    if (connect(s, (struct sockaddr *)&a, sizeof a) != 0) { perror("connect"); return 1; }
    if (write(s, "x", 1) != 1) { perror("write"); return 1; }
    printf("connected\n");
    fflush(stdout);
    pause();
    return 0;
}
"#;

const GO_CLIENT: &str = r#"package main

import (
	"fmt"
	"net"
	"os"
	"time"
)

func main() {
	c, err := net.Dial("tcp", net.JoinHostPort(os.Args[1], os.Args[2]))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	c.Write([]byte("x"))
	fmt.Println("connected")
	time.Sleep(time.Hour)
}
"#;

fn build(cmd: &mut Command) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e} (.ci/install-deps installs gcc and golang-go)"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The test programs, built into `dir`.
struct Programs {
    c_static: PathBuf,
    c_dynamic: PathBuf,
    go_static: PathBuf,
    go_dynamic: PathBuf,
    /// The no-op object, under the library's file name.
    noop: PathBuf,
}

fn build_programs(dir: &Path) -> Programs {
    std::fs::write(dir.join("client.c"), C_CLIENT).unwrap();
    let gcc = |out: &str, flags: &[&str]| {
        let p = dir.join(out);
        build(
            Command::new("gcc")
                .args(flags)
                .arg("-o")
                .arg(&p)
                .arg(dir.join("client.c")),
        );
        p
    };
    let c_static = gcc("c-static", &["-static", "-O1"]);
    let c_dynamic = gcc("c-dynamic", &["-O1"]);
    std::fs::write(dir.join("main.go"), GO_CLIENT).unwrap();
    let go = |out: &str, cgo: &str| {
        let p = dir.join(out);
        build(
            Command::new("go")
                .args(["build", "-o"])
                .arg(&p)
                .arg("main.go")
                .current_dir(dir)
                .env(
                    "GOCACHE",
                    std::env::temp_dir().join("flowlane-test-gocache"),
                )
                .env("GOPATH", dir.join("gopath"))
                .env("GOPROXY", "off")
                .env("GO111MODULE", "off")
                .env("CGO_ENABLED", cgo),
        );
        p
    };
    let go_static = go("go-static", "0");
    let go_dynamic = go("go-dynamic", "1");
    let noop_dir = dir.join("noop");
    std::fs::create_dir_all(&noop_dir).unwrap();
    let noop = noop_dir.join("libflowlane_preload.so");
    std::fs::copy(
        shm::build_dir().join("shipped").join("libflowlane_noop.so"),
        &noop,
    )
    .expect("the shipped no-op object (bash shm-proxy/preload/ship.sh builds it)");
    Programs {
        c_static,
        c_dynamic,
        go_static,
        go_dynamic,
        noop,
    }
}

/// Starts `cmd` and waits for its "connected" line; panics with its
/// stderr if it exits first.
fn connected(cmd: Command, what: &str) -> Bg {
    let mut bg = Bg::spawn(cmd);
    let mut line = String::new();
    let mut out = std::io::BufReader::new(bg.0.stdout.take().unwrap());
    out.read_line(&mut line).unwrap();
    if line.trim() != "connected" {
        let (st, _, err) = bg.finish(Duration::from_secs(5));
        panic!("{what} did not connect ({st:?}): {line}{err}");
    }
    bg
}

fn status(node: &Node, json: bool) -> String {
    let mut c = Command::new(workspace_artifact("flowlane"));
    c.arg("status").arg("--socket").arg(node.socket());
    if json {
        c.arg("--json");
    }
    let out = c.output().expect("flowlane status");
    assert!(
        out.status.success(),
        "flowlane status: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The scan's entry of the pod holding `pid`.
fn pod_of(stats: &Stats, pid: u32) -> Option<PodProcesses> {
    stats
        .processes
        .as_ref()?
        .pods
        .iter()
        .find(|p| p.off_lane.iter().any(|o| o.pid == pid))
        .cloned()
}

#[test]
fn status_tells_which_processes_run_the_library_and_why_others_do_not() {
    let _turn = crate::turn::take(module_path!());
    let dir = std::env::temp_dir().join(format!("fls-rep-progs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let progs = build_programs(&dir);
    let node = Node::new_in("rep", 2, 213);
    let (client, server): (&Pod, &Pod) = (&node.pods[0], &node.pods[1]);
    let _srv = Bg::spawn(node.cmd(server, true, &["python3", "-c", SERVER, &PORT.to_string()]));
    wait_listening(server, PORT);
    let (ip, port) = (server.ip.to_string(), PORT.to_string());
    let py = |preload| node.cmd(client, preload, &["python3", "-c", PY_CLIENT, &ip, &port]);
    let lane = connected(py(true), "python with the library");
    let plain = connected(py(false), "python without the library");
    let mut noop_cmd = node.cmd(client, false, &["env"]);
    noop_cmd.arg(format!("LD_PRELOAD={}", progs.noop.display()));
    noop_cmd.args(["python3", "-c", PY_CLIENT, &ip, &port]);
    let noop = connected(noop_cmd, "python with the no-op object");
    let run = |p: &Path, extra: &[&str]| {
        let mut argv = vec![p.to_str().unwrap(), ip.as_str(), port.as_str()];
        argv.extend_from_slice(extra);
        node.cmd(client, true, &argv)
    };
    let c_static = connected(run(&progs.c_static, &[]), "static C client");
    let go_static = connected(run(&progs.go_static, &[]), "static Go client");
    let go_dynamic = connected(run(&progs.go_dynamic, &[]), "dynamic Go client");
    let uring = connected(run(&progs.c_dynamic, &["uring"]), "io_uring client");
    let expected: BTreeMap<u32, Vec<OffLaneReason>> = [
        (plain.pid(), vec![OffLaneReason::NoLibrary]),
        (noop.pid(), vec![OffLaneReason::NoopLibrary]),
        (c_static.pid(), vec![OffLaneReason::Static]),
        (
            go_static.pid(),
            vec![OffLaneReason::Static, OffLaneReason::Go],
        ),
        (go_dynamic.pid(), vec![OffLaneReason::Go]),
        (uring.pid(), vec![OffLaneReason::IoUring]),
    ]
    .into_iter()
    .collect();
    // The daemon scans every 10 s, and again when a status request finds
    // the last scan more than a second old: ask until a scan has seen all
    // seven programs (a bound for a stuck scan, not a timing assertion).
    let t0 = Instant::now();
    let pod = loop {
        let stats: Stats = serde_json::from_str(&status(&node, true)).unwrap();
        if let Some(p) = pod_of(&stats, plain.pid()) {
            if p.lane + p.tcp == 7 {
                break p;
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no scan saw the client pod's seven programs: {:#?}\n{}",
            stats.processes,
            node.daemon_log()
        );
        std::thread::sleep(Duration::from_millis(300));
    };
    assert_eq!((pod.lane, pod.tcp, pod.idle), (1, 6, 0), "{pod:#?}");
    let found: BTreeMap<u32, Vec<OffLaneReason>> = pod
        .off_lane
        .iter()
        .map(|o| (o.pid, o.reasons.clone()))
        .collect();
    assert_eq!(found, expected, "{pod:#?}");
    assert!(pod.off_lane.iter().all(|o| o.tcp_sockets == 1), "{pod:#?}");
    assert!(
        !pod.off_lane.iter().any(|o| o.pid == lane.pid()),
        "the library's process is on the lane: {pod:#?}"
    );
    let go_exe = pod
        .off_lane
        .iter()
        .find(|o| o.pid == go_static.pid())
        .map(|o| o.exe.clone());
    assert_eq!(
        go_exe.as_deref(),
        progs.go_static.to_str(),
        "the executable's path is shown"
    );
    // The server pod: one process, on the lane.
    let stats: Stats = serde_json::from_str(&status(&node, true)).unwrap();
    let scan = stats.processes.clone().unwrap();
    let server_pods: Vec<&PodProcesses> = scan
        .pods
        .iter()
        .filter(|p| p.lane == 1 && p.tcp == 0 && p.off_lane.is_empty())
        .collect();
    assert_eq!(server_pods.len(), 1, "{scan:#?}");
    // The lane client really is on the lane (its library asked for it).
    assert!(node.shm_opened() >= 1, "{:?}", stats.lanes);
    // The table: the counts per pod, then a row per process on TCP.
    let text = status(&node, false);
    println!("{text}");
    assert!(text.contains("PROCESSES: 2 pods with processes"), "{text}");
    assert!(text.contains("ON TCP: 6"), "{text}");
    for (pid, reasons) in &expected {
        let why: Vec<&str> = reasons.iter().map(|r| r.name()).collect();
        let row = text
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(&pid.to_string()))
            .unwrap_or_else(|| panic!("no row for pid {pid}: {text}"));
        assert!(row.contains(&why.join(",")), "{row} lacks {why:?}");
    }
    // A figure, not an assertion: what two scans of the node took (the
    // one above, and one at least two seconds later).
    let first = scan.duration_ms;
    let t1 = Instant::now();
    let later = loop {
        std::thread::sleep(Duration::from_millis(200));
        let s: Stats = serde_json::from_str(&status(&node, true)).unwrap();
        let p = s.processes.unwrap();
        // Ended after t1 + 2.3 s: a scan that began after this wait did.
        if p.age_ms < 200 && t1.elapsed() > Duration::from_millis(2500) {
            break p.duration_ms;
        }
        assert!(t1.elapsed() < Duration::from_secs(60), "no later scan");
    };
    let host = std::fs::read_dir("/proc")
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        })
        .count();
    println!(
        "figure process-scan: {host} processes on the host, 9 in pods: scans of {first} ms and {later} ms"
    );
    // Metrics come from the same answer: checked in metrics.rs's unit tests.
    drop((lane, plain, noop, c_static, go_static, go_dynamic, uring));
    std::fs::remove_dir_all(&dir).unwrap();
}
