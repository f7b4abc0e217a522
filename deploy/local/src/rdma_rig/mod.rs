//! The Soft-RoCE two-node rig: two QEMU guests booting Debian's kernel, each a
//! flowlane node with a real RDMA device (`rdma_rxe` on its NIC), joined by a
//! QEMU socket netdev (one TCP connection) on 127.0.0.1. This machine's kernel has no RDMA, so real
//! verbs only exist inside the guests.
//!
//! It lives here, beside the demo, because `flowlane demo --rdma` runs the
//! RDMA lane in it (`rdma-demo`); the e2e rdma suites and `rdma-bench` use it
//! from here.
//!
//! The shell side lives in `deploy/local/rdma-rig/` (see `docs/rdma.md`, "Test rig"):
//! `prepare.sh` fetches and caches the kernel and builds the initramfs,
//! `boot-node.sh` runs one QEMU, `guest/agent.sh` wires the underlay and runs
//! jobs, `guest/node-up.sh` and `guest/pod-add.sh` make a node and its pods.
//! The guests' root is the host's own `/` (read-only 9p under a tmpfs overlay),
//! so the binaries under test run in the guests at their host paths.
//!
//! A job is a bash script dropped into the writable share; the guest runs it
//! and leaves its stdout, stderr and exit status there ([`RdmaRig::run`]).
//!
//! A test binary boots the rig once ([`shared`]) and its tests take turns
//! ([`RdmaRig::lock`]). Missing QEMU is a failure, not a skip (CI installs it
//! with `.ci/install-deps`); `FLOWLANE_RDMA_RIG=skip` skips on purpose.

pub mod perftest;

use anyhow::{anyhow, bail, Context, Result};
use std::fs::{self, File};
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The two nodes, as the guests number them.
pub const NODES: [u8; 2] = [1, 2];

/// Where the kernel, initramfs and run directories are cached
/// (`FLOWLANE_RDMA_VM_CACHE` overrides it).
pub fn cache_dir() -> PathBuf {
    std::env::var_os("FLOWLANE_RDMA_VM_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/flowlane-rdma-vm"))
}

/// `deploy/local/rdma-rig/` of this checkout.
pub fn scripts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("rdma-rig")
}

/// Node `n`'s underlay address (on its `eth0`, where `rxe0` lives).
pub fn underlay_addr(node: u8) -> Ipv4Addr {
    check_node(node);
    Ipv4Addr::new(192, 168, 47, node)
}

/// Node `n`'s pod CIDR.
pub fn pod_cidr(node: u8) -> String {
    check_node(node);
    format!("10.47.{node}.0/24")
}

/// The other node.
pub fn peer(node: u8) -> u8 {
    check_node(node);
    3 - node
}

/// The `<target>/release` the guests' jobs see: `FLOWLANE_BIN_DIR`, else the
/// running executable's (as the e2e harness finds the binaries under test).
fn build_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("FLOWLANE_BIN_DIR") {
        return PathBuf::from(dir);
    }
    crate::spec::Binaries::beside_current_exe()
        .expect("current_exe")
        .dir
}

fn check_node(node: u8) {
    assert!(NODES.contains(&node), "rig nodes are 1 and 2, not {node}");
}

/// How to boot the rig.
#[derive(Debug, Clone)]
pub struct RigConfig {
    /// Guest memory (MiB).
    pub mem_mib: u32,
    /// vCPUs per guest (two 1-vCPU guests on a 2-core host).
    pub smp: u32,
    /// How long both guests may take to get their underlay and rxe0 up.
    pub boot_timeout: Duration,
    /// The `<target>/release` the guests' jobs see as `FLOWLANE_BIN_DIR`.
    pub bin_dir: PathBuf,
}

impl Default for RigConfig {
    fn default() -> Self {
        RigConfig {
            mem_mib: 1024,
            smp: 1,
            // A TCG boot takes 5-15 s; a loaded 2-core CI machine and a first
            // run that downloads the kernel take longer.
            boot_timeout: Duration::from_secs(300),
            bin_dir: build_dir(),
        }
    }
}

/// What a job left behind.
#[derive(Debug, Clone)]
pub struct JobOutput {
    pub node: u8,
    /// The script's exit status (124: the guest-side timeout killed it).
    pub status: i32,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl JobOutput {
    pub fn success(&self) -> bool {
        self.status == 0
    }

    /// Panics with both streams unless the script exited 0.
    pub fn expect_ok(self, what: &str) -> Self {
        assert!(
            self.success(),
            "{what} failed on node{} (exit {}, {:.1?}):\nstdout: {}\nstderr: {}",
            self.node,
            self.status,
            self.elapsed,
            self.stdout,
            self.stderr
        );
        self
    }
}

/// A job running in a guest; [`Job::wait`] collects it.
pub struct Job<'a> {
    rig: &'a RdmaRig,
    node: u8,
    id: String,
    timeout: Duration,
    started: Instant,
}

impl Job<'_> {
    /// Waits for the job's exit status (the guest enforces `timeout`; the
    /// host gives it 30 s more before giving up on the guest).
    pub fn wait(self) -> Result<JobOutput> {
        let dir = self.rig.node_dir(self.node).join("out");
        let rc_path = dir.join(format!("{}.rc", self.id));
        let deadline = self.timeout + Duration::from_secs(30);
        let read = |ext: &str| {
            fs::read_to_string(dir.join(format!("{}.{ext}", self.id))).unwrap_or_default()
        };
        loop {
            if let Ok(rc) = fs::read_to_string(&rc_path) {
                let status = rc.trim().parse().unwrap_or(-1);
                let out = JobOutput {
                    node: self.node,
                    status,
                    stdout: read("stdout"),
                    stderr: read("stderr"),
                    elapsed: self.started.elapsed(),
                };
                for ext in ["rc", "stdout", "stderr"] {
                    let _ = fs::remove_file(dir.join(format!("{}.{ext}", self.id)));
                }
                let _ = fs::remove_file(
                    self.rig
                        .node_dir(self.node)
                        .join("run")
                        .join(format!("{}.sh", self.id)),
                );
                return Ok(out);
            }
            if let Some(dead) = self.rig.dead_guest() {
                bail!(
                    "node{dead}'s QEMU died during job {} on node{}; console:\n{}",
                    self.id,
                    self.node,
                    tail(&self.rig.console(dead), 30)
                );
            }
            if self.started.elapsed() > deadline {
                bail!(
                    "job {} on node{} left no exit status after {:?} (guest hung?)\nstdout so far: {}\nstderr so far: {}",
                    self.id,
                    self.node,
                    deadline,
                    read("stdout"),
                    read("stderr")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Two booted guests. Dropping it (or [`RdmaRig::shutdown`]) kills both QEMUs.
pub struct RdmaRig {
    run_dir: PathBuf,
    bin_dir: PathBuf,
    qemu: Mutex<Vec<(u8, Child)>>,
    keeper: Mutex<Option<(Arc<AtomicBool>, JoinHandle<()>)>>,
    /// Holds the port pair for the rig's lifetime.
    _port_lock: File,
    ports: (u16, u16),
    next_job: AtomicU64,
    boot_time: Duration,
    /// A test failed while holding the rig: keep the run dir for its logs.
    keep: AtomicBool,
    down: AtomicBool,
}

impl RdmaRig {
    /// Prepares (cached) and boots both guests, and waits until each has its
    /// underlay address and an ACTIVE `rxe0`.
    pub fn boot(cfg: &RigConfig) -> Result<RdmaRig> {
        let started = Instant::now();
        let bin_dir = cfg.bin_dir.canonicalize().with_context(|| {
            format!(
                "build dir {} (cargo build --release --workspace)",
                cfg.bin_dir.display()
            )
        })?;
        // The guests mount their own /proc, /sys and /dev (and /tmp, /run,
        // where guest/init binds the rig's own paths back).
        for hidden in ["/proc", "/sys", "/dev"] {
            if bin_dir.starts_with(hidden) {
                bail!(
                    "the build dir {} is under {hidden}, which the guests mount over; use a target dir elsewhere",
                    bin_dir.display()
                );
            }
        }
        let artifacts = prepare()?;
        let runs = cache_dir().join("runs");
        fs::create_dir_all(&runs)?;
        remove_stale_runs(&runs);
        let (port_lock, ports) = claim_ports()?;
        static RUNS: AtomicU64 = AtomicU64::new(0);
        let run_dir = runs.join(format!(
            "{}-{}",
            std::process::id(),
            RUNS.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&run_dir);
        fs::create_dir_all(run_dir.join("share"))?;
        fs::write(run_dir.join("owner.pid"), std::process::id().to_string())?;

        let mut rig = RdmaRig {
            run_dir,
            bin_dir,
            qemu: Mutex::new(Vec::new()),
            keeper: Mutex::new(None),
            _port_lock: port_lock,
            ports,
            next_job: AtomicU64::new(0),
            boot_time: Duration::ZERO,
            keep: AtomicBool::new(false),
            down: AtomicBool::new(false),
        };
        rig.start_guests(cfg, &artifacts)?;
        if let Err(e) = rig.wait_ready(cfg.boot_timeout) {
            // Dropping the rig kills the guests; keep their consoles and logs.
            rig.keep.store(true, Ordering::Release);
            return Err(e.context(format!("run dir kept: {}", rig.run_dir.display())));
        }
        rig.boot_time = started.elapsed();
        Ok(rig)
    }

    /// Starts both QEMUs from a keeper thread that lives as long as the rig:
    /// the children get `PR_SET_PDEATHSIG`, so they die with that thread,
    /// also when the test process exits without running destructors (a
    /// `static` rig) or is killed.
    fn start_guests(&self, cfg: &RigConfig, artifacts: &[(String, String)]) -> Result<()> {
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let stop_keeper = stop.clone();
        let boot = scripts_dir().join("boot-node.sh");
        let run_dir = self.run_dir.clone();
        let (p1, p2) = self.ports;
        let env: Vec<(String, String)> = artifacts
            .iter()
            .cloned()
            .chain([
                ("RIG_MEM".into(), cfg.mem_mib.to_string()),
                ("RIG_SMP".into(), cfg.smp.to_string()),
                ("RIG_BIN_DIR".into(), self.bin_dir.display().to_string()),
            ])
            .collect();
        let keeper = std::thread::Builder::new()
            .name("rdma-rig-keeper".into())
            .spawn(move || {
                let mut spawned = Vec::new();
                for (node, mine, theirs) in [(1u8, p1, p2), (2u8, p2, p1)] {
                    let log = match File::create(run_dir.join(format!("qemu-node{node}.out"))) {
                        Ok(f) => f,
                        Err(e) => {
                            let _ = tx.send(Err(anyhow!("qemu log: {e}")));
                            return;
                        }
                    };
                    let mut cmd = Command::new(&boot);
                    cmd.arg(node.to_string())
                        .arg(&run_dir)
                        .arg(mine.to_string())
                        .arg(theirs.to_string())
                        .envs(env.iter().map(|(k, v)| (k, v)))
                        .stdin(Stdio::null())
                        .stdout(log.try_clone().expect("dup log"))
                        .stderr(log);
                    // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe and
                    // touches no memory of the parent; it runs between fork
                    // and exec in the child.
                    unsafe {
                        cmd.pre_exec(|| {
                            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                                return Err(std::io::Error::last_os_error());
                            }
                            Ok(())
                        });
                    }
                    match cmd.spawn() {
                        Ok(child) => spawned.push((node, child)),
                        Err(e) => {
                            let _ = tx.send(Err(anyhow!("starting {}: {e}", boot.display())));
                            for (_, mut c) in spawned {
                                let _ = c.kill();
                                let _ = c.wait();
                            }
                            return;
                        }
                    }
                }
                let _ = tx.send(Ok(spawned));
                while !stop_keeper.load(Ordering::Acquire) {
                    std::thread::park();
                }
            })?;
        let children = rx
            .recv()
            .map_err(|_| anyhow!("the rig keeper thread died"))??;
        *self.qemu.lock().unwrap_or_else(|e| e.into_inner()) = children;
        *self.keeper.lock().unwrap_or_else(|e| e.into_inner()) = Some((stop, keeper));
        Ok(())
    }

    fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let t0 = Instant::now();
        for node in NODES {
            let dir = self.node_dir(node);
            loop {
                if dir.join("ready").exists() {
                    break;
                }
                if dir.join("failed").exists() {
                    bail!(
                        "node{node}: underlay/rxe setup failed:\n{}",
                        tail(&self.node_log(node, "agent.log"), 40)
                    );
                }
                if let Some(dead) = self.dead_guest() {
                    bail!(
                        "node{dead}'s QEMU exited during boot:\n{}\nconsole:\n{}",
                        fs::read_to_string(self.run_dir.join(format!("qemu-node{dead}.out")))
                            .unwrap_or_default(),
                        tail(&self.console(dead), 30)
                    );
                }
                if t0.elapsed() > timeout {
                    bail!(
                        "node{node} not ready after {timeout:?}; console:\n{}",
                        tail(&self.console(node), 30)
                    );
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(())
    }

    /// The first guest whose QEMU has exited, if any.
    fn dead_guest(&self) -> Option<u8> {
        let mut qemu = self.qemu.lock().unwrap_or_else(|e| e.into_inner());
        qemu.iter_mut()
            .find_map(|(n, c)| (!matches!(c.try_wait(), Ok(None))).then_some(*n))
    }

    /// How long `boot` took (prepare + both guests ready).
    pub fn boot_time(&self) -> Duration {
        self.boot_time
    }

    /// The run directory (consoles, the share with each node's logs).
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// Node `n`'s directory in the share (`jobs/`, `out/`, `logs/`, `pods/`).
    pub fn node_dir(&self, node: u8) -> PathBuf {
        check_node(node);
        self.run_dir.join("share").join(format!("node{node}"))
    }

    /// A log the guest keeps in its share (`agent.log`, `flowlaned.log`, `cni.log`).
    pub fn node_log(&self, node: u8, name: &str) -> String {
        fs::read_to_string(self.node_dir(node).join("logs").join(name)).unwrap_or_default()
    }

    /// Node `n`'s serial console so far.
    pub fn console(&self, node: u8) -> String {
        fs::read_to_string(self.run_dir.join(format!("console-node{node}.log"))).unwrap_or_default()
    }

    /// The build dir the guests' jobs use (`$FLOWLANE_BIN_DIR` in a job).
    pub fn bin_dir(&self) -> &Path {
        &self.bin_dir
    }

    /// Takes this rig for one test: tests sharing a rig run one at a time. A
    /// test that panics while holding it keeps the run dir (logs) at exit.
    pub fn lock(&self) -> RigLock<'_> {
        static TURN: Mutex<()> = Mutex::new(());
        RigLock {
            rig: self,
            _turn: TURN.lock().unwrap_or_else(|e| e.into_inner()),
        }
    }

    /// Starts `script` (bash) in guest `node`; the guest kills it after
    /// `timeout` (exit status 124).
    pub fn spawn(&self, node: u8, script: &str, timeout: Duration) -> Result<Job<'_>> {
        check_node(node);
        if self.down.load(Ordering::Acquire) {
            bail!("the rig is shut down");
        }
        let id = format!(
            "{}-{}",
            std::process::id(),
            self.next_job.fetch_add(1, Ordering::Relaxed)
        );
        let jobs = self.node_dir(node).join("jobs");
        let tmp = jobs.join(format!(".{id}.tmp"));
        let mut f = File::create(&tmp)?;
        writeln!(f, "#rig timeout={}", timeout.as_secs().max(1))?;
        f.write_all(script.as_bytes())?;
        writeln!(f)?;
        drop(f);
        fs::rename(&tmp, jobs.join(format!("{id}.job")))?;
        Ok(Job {
            rig: self,
            node,
            id,
            timeout,
            started: Instant::now(),
        })
    }

    /// Runs `script` (bash) in guest `node` and waits for it.
    pub fn run(&self, node: u8, script: &str, timeout: Duration) -> Result<JobOutput> {
        self.spawn(node, script, timeout)?.wait()
    }

    /// Runs `script` and panics with its output unless it exits 0.
    pub fn run_ok(&self, node: u8, script: &str, timeout: Duration) -> JobOutput {
        self.run(node, script, timeout)
            .unwrap_or_else(|e| panic!("node{node}: {e:#}"))
            .expect_ok(script.lines().next().unwrap_or(script))
    }

    /// Makes both guests flowlane nodes (`guest/node-up.sh`): CNI config,
    /// node table, and `flowlaned` started with `flowlaned_args` besides its
    /// state dir and socket. `$RIG_*` in an argument expands in each guest
    /// (`"$RIG_ADDR:7471"` is 192.168.47.1:7471 on node 1); nothing else is
    /// interpreted. Calling it again restarts the daemons.
    pub fn nodes_up(&self, flowlaned_args: &[&str]) -> Result<()> {
        let args = flowlaned_args
            .iter()
            .map(|a| shell_quote_expanding(a))
            .collect::<Vec<_>>()
            .join(" ");
        let jobs: Vec<Job> = NODES
            .iter()
            .map(|&n| {
                self.spawn(
                    n,
                    &format!("FLOWLANED_ARGS={} node-up.sh", shell_quote(&args)),
                    Duration::from_secs(120),
                )
            })
            .collect::<Result<_>>()?;
        for job in jobs {
            let out = job.wait()?;
            if !out.success() {
                bail!(
                    "node-up.sh failed on node{} (exit {}):\n{}\n{}\nflowlaned.log:\n{}",
                    out.node,
                    out.status,
                    out.stdout,
                    out.stderr,
                    tail(&self.node_log(out.node, "flowlaned.log"), 20)
                );
            }
        }
        Ok(())
    }

    /// The flags that give both guests' `flowlaned` the cross-node RDMA
    /// lane: the relay listening on the node's underlay address, the RDMA
    /// transport on `rxe0`, the node table and the lane key `node-up.sh`
    /// writes.
    pub const RDMA_LANE_ARGS: [&'static str; 10] = [
        "--lane-listen",
        "$RIG_ADDR:7471",
        "--lane-transport",
        "rdma",
        "--nodes-file",
        "/etc/flowlane/nodes.json",
        "--node-name",
        "node$RIG_NODE",
        "--lane-key-file",
        "/etc/flowlane/lane.key",
    ];

    /// [`RdmaRig::nodes_up`] with [`RdmaRig::RDMA_LANE_ARGS`] plus `extra`
    /// (e.g. `["--log-level", "info,flowlaned=debug"]`): both daemons carry
    /// cross-node connections over RDMA. Calling it again restarts them.
    pub fn nodes_up_with_rdma_lane(&self, extra: &[&str]) -> Result<()> {
        let args: Vec<&str> = Self::RDMA_LANE_ARGS.iter().chain(extra).copied().collect();
        self.nodes_up(&args)
            .context("flowlaned with the RDMA lane on both guests")
    }

    /// Adds pod `name` on `node` through the real plugin (`guest/pod-add.sh`)
    /// and returns its IPv4 address. Needs [`RdmaRig::nodes_up`] first.
    pub fn add_pod(&self, node: u8, name: &str) -> Result<Ipv4Addr> {
        let out = self.run(
            node,
            &format!("pod-add.sh {}", shell_quote(name)),
            Duration::from_secs(60),
        )?;
        if !out.success() {
            bail!(
                "pod-add.sh {name} on node{node} failed: {}{}",
                out.stdout,
                out.stderr
            );
        }
        out.stdout
            .trim()
            .parse()
            .with_context(|| format!("pod-add.sh {name} printed {:?}", out.stdout))
    }

    /// Removes pod `name` from `node` (CNI DEL through the plugin, then its netns).
    pub fn del_pod(&self, node: u8, name: &str) -> Result<()> {
        let out = self.run(
            node,
            &format!("pod-del.sh {}", shell_quote(name)),
            Duration::from_secs(60),
        )?;
        if !out.success() {
            bail!("pod-del.sh {name} on node{node} failed: {}", out.stderr);
        }
        Ok(())
    }

    /// Node `n`'s `flowlaned` counters (`flowlane status --json` in the guest).
    pub fn daemon_stats(&self, node: u8) -> Result<flowlane_lane::proto::Stats> {
        let out = self.run(
            node,
            "$FLOWLANE_BIN_DIR/flowlane status --json",
            Duration::from_secs(60),
        )?;
        if !out.success() {
            bail!(
                "flowlane status on node{node}: {}{}",
                out.stdout,
                out.stderr
            );
        }
        serde_json::from_str(&out.stdout)
            .with_context(|| format!("flowlane status --json on node{node}: {}", out.stdout))
    }

    /// Kills both QEMUs (by the pids this rig started) and removes the run
    /// dir, unless a test failed while holding the rig or
    /// `FLOWLANE_RDMA_RIG_KEEP` is set (then its path is printed). Never
    /// panics (it also runs from an `atexit` hook): locks poisoned by a failed
    /// test are taken over.
    pub fn shutdown(&self) {
        if self.down.swap(true, Ordering::AcqRel) {
            return;
        }
        for (_, child) in self
            .qemu
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter_mut()
        {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some((stop, keeper)) = self.keeper.lock().unwrap_or_else(|e| e.into_inner()).take() {
            stop.store(true, Ordering::Release);
            keeper.thread().unpark();
            let _ = keeper.join();
        }
        if self.keep.load(Ordering::Acquire) || std::env::var_os("FLOWLANE_RDMA_RIG_KEEP").is_some()
        {
            eprintln!(
                "rdma rig: kept {} (consoles, share/node*/logs)",
                self.run_dir.display()
            );
        } else {
            let _ = fs::remove_dir_all(&self.run_dir);
        }
    }
}

impl Drop for RdmaRig {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// One test's turn on a shared rig (see [`RdmaRig::lock`]).
pub struct RigLock<'a> {
    rig: &'a RdmaRig,
    _turn: MutexGuard<'static, ()>,
}

impl std::ops::Deref for RigLock<'_> {
    type Target = RdmaRig;
    fn deref(&self) -> &RdmaRig {
        self.rig
    }
}

impl Drop for RigLock<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.rig.keep.store(true, Ordering::Release);
        }
    }
}

/// A suite's rig, booted or not.
type Booted = std::result::Result<RdmaRig, String>;

/// The running suite's rig: the suite's source file and its rig. Leaked, not
/// dropped, when the next suite takes over: `&'static` references to it may
/// remain in the previous suite's (ended) tests.
static SHARED: Mutex<Option<(&'static str, &'static Booted)>> = Mutex::new(None);

/// The rig of the calling suite (the caller's source file, so a suite is a
/// file of `tests/e2e`), booted at the suite's first call with
/// [`RigConfig::default`], shut down when another suite asks for its own rig
/// and when the process exits. Each suite gets a fresh rig, as when it was a
/// test binary of its own; the e2e binary runs one suite at a time
/// (`tests/e2e/turn.rs`), so a rig is never shut down under a running test.
/// `None` only when `FLOWLANE_RDMA_RIG=skip` (a SKIP line is printed); a rig
/// that cannot boot panics (in this and every later test of the suite) with
/// the reason.
/// Shuts down the running suite's rig, if any ([`shared`]); the next call
/// of [`shared`] boots a fresh one. The e2e binary calls it when another
/// suite takes its turn (tests/e2e/turn.rs), so idle guests do not outlive
/// their suite.
pub fn shutdown_shared() {
    let mut current = SHARED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, Ok(rig))) = current.take() {
        rig.shutdown();
    }
}

#[track_caller]
pub fn shared() -> Option<&'static RdmaRig> {
    if std::env::var("FLOWLANE_RDMA_RIG").as_deref() == Ok("skip") {
        eprintln!("SKIP: FLOWLANE_RDMA_RIG=skip, the Soft-RoCE rig is not booted");
        return None;
    }
    let suite = std::panic::Location::caller().file();
    let rig = {
        let mut current = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        match *current {
            Some((of, rig)) if of == suite => rig,
            _ => {
                if let Some((_, Ok(previous))) = current.take() {
                    previous.shutdown();
                }
                let booted: &'static Booted = Box::leak(Box::new(
                    RdmaRig::boot(&RigConfig::default()).map_err(|e| format!("{e:#}")),
                ));
                static AT_EXIT: std::sync::Once = std::sync::Once::new();
                AT_EXIT.call_once(|| {
                    extern "C" fn shutdown_shared() {
                        // try_lock: never wait at exit for a test still
                        // holding it (its rig is then left to the kernel).
                        if let Ok(current) = SHARED.try_lock() {
                            if let Some((_, Ok(rig))) = *current {
                                rig.shutdown();
                            }
                        }
                    }
                    // SAFETY: registers a plain `extern "C" fn` without
                    // arguments; it runs at exit() (the test harness returns
                    // from main), when SHARED is still alive (statics are
                    // never dropped).
                    unsafe {
                        libc::atexit(shutdown_shared);
                    }
                });
                *current = Some((suite, booted));
                booted
            }
        }
    };
    match rig {
        Ok(rig) => Some(rig),
        Err(e) => panic!("the Soft-RoCE rig did not boot: {e}"),
    }
}

/// Runs `prepare.sh` (cached kernel + initramfs) and returns its KEY=VALUE lines.
fn prepare() -> Result<Vec<(String, String)>> {
    let script = scripts_dir().join("prepare.sh");
    let out = Command::new(&script)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let vars: Vec<(String, String)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    for key in ["KERNEL", "INITRD", "MODDIR"] {
        if !vars.iter().any(|(k, _)| k == key) {
            bail!("prepare.sh did not print {key}");
        }
    }
    Ok(vars)
}

/// A TCP port pair in 47100-47199 for the socket netdev (node 1 listens on
/// the first; the second stays reserved for the pair's layout), claimed with a lock
/// file held for the rig's lifetime (several rigs may run on one machine), and
/// checked free by binding it.
fn claim_ports() -> Result<(File, (u16, u16))> {
    fs::create_dir_all("/run/lock")?;
    for first in (47100u16..47200).step_by(2) {
        let lock = File::create(format!("/run/lock/flowlane-rdma-vm-{first}.lock"))?;
        // SAFETY: flock on a file descriptor we own.
        if unsafe {
            libc::flock(
                std::os::fd::AsRawFd::as_raw_fd(&lock),
                libc::LOCK_EX | libc::LOCK_NB,
            )
        } != 0
        {
            continue;
        }
        let free = |p: u16| std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, p)).is_ok();
        if free(first) && free(first + 1) {
            return Ok((lock, (first, first + 1)));
        }
    }
    bail!("no free TCP port pair in 127.0.0.1:47100-47199")
}

/// Removes run dirs whose owning process is gone, keeping the two newest
/// (a kept failed run's logs survive the next run).
fn remove_stale_runs(runs: &Path) {
    let Ok(entries) = fs::read_dir(runs) else {
        return;
    };
    let mut dead: Vec<(std::time::SystemTime, PathBuf)> = entries
        .flatten()
        // Only the harness's own `<pid>-<n>` dirs: `deploy/local/rdma-rig/rig` keeps its
        // guests running after its shell has exited.
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.split_once('-')
                .is_some_and(|(a, b)| a.parse::<u32>().is_ok() && b.parse::<u32>().is_ok())
        })
        .filter(|e| {
            let owner = fs::read_to_string(e.path().join("owner.pid")).unwrap_or_default();
            match owner.trim().parse::<i32>() {
                // SAFETY: kill with signal 0 only checks that the pid exists.
                Ok(pid) => unsafe { libc::kill(pid, 0) != 0 },
                Err(_) => true,
            }
        })
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    dead.sort();
    let n = dead.len().saturating_sub(2);
    for (_, path) in dead.into_iter().take(n) {
        let _ = fs::remove_dir_all(path);
    }
}

/// Quotes `s` for bash.
pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Double-quotes `s` for bash: `$VAR` expands, nothing else is special.
fn shell_quote_expanding(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        if matches!(c, '"' | '\\' | '`') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

fn tail(s: &str, lines: usize) -> String {
    let all: Vec<&str> = s.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What bash makes of `words` (one word per line).
    fn bash_words(words: &str) -> Vec<String> {
        let out = Command::new("bash")
            .arg("-c")
            .arg(format!("for w in {words}; do echo \"$w\"; done"))
            .env("RIG_ADDR", "192.168.47.1")
            .output()
            .unwrap();
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn quoted_words_reach_bash_intact() {
        let tricky = [
            "a b",
            "it's",
            "$HOME",
            "\"q\"",
            "back\\slash",
            "`date`",
            "*",
        ];
        let quoted: Vec<String> = tricky.iter().map(|w| shell_quote(w)).collect();
        assert_eq!(bash_words(&quoted.join(" ")), tricky);
    }

    #[test]
    fn expanding_quotes_expand_variables_and_nothing_else() {
        let args = [
            "--lane-listen",
            "$RIG_ADDR:7471",
            "a b",
            "`date`",
            "\"q\"",
            "*",
        ];
        let quoted: Vec<String> = args.iter().map(|a| shell_quote_expanding(a)).collect();
        assert_eq!(
            bash_words(&quoted.join(" ")),
            [
                "--lane-listen",
                "192.168.47.1:7471",
                "a b",
                "`date`",
                "\"q\"",
                "*"
            ]
        );
    }

    #[test]
    fn node_numbering() {
        assert_eq!(underlay_addr(2), Ipv4Addr::new(192, 168, 47, 2));
        assert_eq!(pod_cidr(1), "10.47.1.0/24");
        assert_eq!(peer(1), 2);
        assert_eq!(peer(2), 1);
        assert!(std::panic::catch_unwind(|| peer(3)).is_err());
    }
}
