//! Running programs with a deadline and captured output.

use std::io::{Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// What a finished program left behind.
#[derive(Debug, Clone)]
pub struct Output {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn success(&self) -> bool {
        self.status.success()
    }

    /// Panics with both streams unless the program exited 0.
    pub fn expect_ok(self, what: &str) -> Self {
        assert!(
            self.success(),
            "{what} failed ({}):\nstdout: {}\nstderr: {}",
            self.status,
            self.stdout,
            self.stderr
        );
        self
    }
}

/// Runs `cmd` with `stdin` fed to it, killing it after `timeout`.
pub fn run_with_input(
    cmd: &mut Command,
    stdin: &[u8],
    timeout: Duration,
) -> std::io::Result<Output> {
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn()?;
    let mut input = child.stdin.take().expect("piped stdin");
    let data = stdin.to_vec();
    // Feed stdin from a thread: a plugin may write before it finished reading.
    let writer = std::thread::spawn(move || {
        let _ = input.write_all(&data);
    });
    let mut out = child.stdout.take().expect("piped stdout");
    let mut err = child.stderr.take().expect("piped stderr");
    let out_reader = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = out.read_to_end(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = err.read_to_end(&mut s);
        s
    });
    let status = wait_deadline(child, timeout)?;
    let _ = writer.join();
    let stdout = out_reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    Ok(Output {
        status,
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
    })
}

/// Runs `cmd` (no stdin) with a deadline.
pub fn run(cmd: &mut Command, timeout: Duration) -> std::io::Result<Output> {
    run_with_input(cmd, b"", timeout)
}

/// Runs a program given as a list of words; panics if it cannot be started.
pub fn sh(args: &[&str]) -> Output {
    let mut cmd = Command::new(args[0]);
    cmd.args(&args[1..]);
    run(&mut cmd, Duration::from_secs(60)).unwrap_or_else(|e| panic!("spawn {args:?}: {e}"))
}

/// Waits for `child` without polling (a waiter thread blocks in `wait`, so
/// measured latencies are not quantised by a poll interval); kills it after
/// `timeout`.
fn wait_deadline(child: Child, timeout: Duration) -> std::io::Result<ExitStatus> {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let mut child = child;
        let _ = tx.send(child.wait());
    });
    match rx.recv_timeout(timeout) {
        Ok(status) => {
            let _ = waiter.join();
            status
        }
        Err(_) => {
            // Still running (the waiter has not reaped it, so the pid is ours).
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            let status = rx.recv().map_err(std::io::Error::other)??;
            let _ = waiter.join();
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("killed after {timeout:?} ({status})"),
            ))
        }
    }
}

/// A child process killed (SIGKILL) and reaped when dropped.
#[derive(Debug)]
pub struct ChildGuard {
    pub child: Child,
}

impl ChildGuard {
    pub fn new(child: Child) -> Self {
        ChildGuard { child }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM, then SIGKILL after `grace`; reaps the child.
    pub fn terminate(&mut self, grace: Duration) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}
