//! The daemon's Unix socket: accepts clients, identifies each one by its
//! network namespace, reads framed requests, and writes framed answers
//! (with the memfds they name in one SCM_RIGHTS message, when there are
//! any).
//!
//! Bad input never takes the daemon down: an undecodable body gets an error
//! answer and the connection continues; an unusable length prefix gets an
//! error answer and the connection is closed (the stream cannot be
//! resynchronised); a stalled half-frame times out.

use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use flowlane_lane::proto::{self, ErrorCode, FallbackReason, Request, Response};
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;

use crate::broker::{Answer, Broker, Caller, Undelivered};
use crate::identity::{netns_inode_of_pid, ProcessId};
use crate::stats::Lanes;

/// How long the rest of a frame may take once its first byte arrived.
const FRAME_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a connection may sit idle between requests.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Most client connections served at once; more are closed right away
/// (those clients fall back to TCP).
pub const MAX_CONNECTIONS: usize = 8192;

/// Most connections one network namespace may hold at once, so that one
/// pod cannot take every slot from the others.
pub const MAX_CONNECTIONS_PER_NETNS: usize = 1024;

/// Open connections per network namespace.
#[derive(Clone, Default)]
struct PerNetns(Arc<Mutex<std::collections::HashMap<u64, usize>>>);

/// A connection's share of its namespace's budget, returned on drop.
struct NetnsSlot {
    table: PerNetns,
    netns: u64,
}

impl PerNetns {
    fn acquire(&self, netns: u64) -> Option<NetnsSlot> {
        let mut t = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = t.entry(netns).or_default();
        if *n >= MAX_CONNECTIONS_PER_NETNS {
            return None;
        }
        *n += 1;
        Some(NetnsSlot {
            table: self.clone(),
            netns,
        })
    }
}

impl Drop for NetnsSlot {
    fn drop(&mut self) {
        let mut t = self.table.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = t.get_mut(&self.netns) {
            *n -= 1;
            if *n == 0 {
                t.remove(&self.netns);
            }
        }
    }
}

/// The broker shared by all connection tasks. A std mutex: every critical
/// section is short and never awaits.
#[derive(Clone)]
pub struct Shared(Arc<Mutex<Broker>>);

impl Shared {
    pub fn new(b: Broker) -> Self {
        Shared(Arc::new(Mutex::new(b)))
    }

    pub fn lock(&self) -> MutexGuard<'_, Broker> {
        // A panic while holding the lock must not wedge the daemon.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Binds the daemon socket: creates its directory, replaces a stale socket
/// file (refusing if a live daemon answers on it), and opens it to every
/// uid (pods run as any uid: a pod's clients are authenticated by network
/// namespace; node requests by uid/gid and namespace, see `broker.rs`).
pub fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    use anyhow::Context;
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            anyhow::bail!("{} exists and is not a socket", path.display());
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            anyhow::bail!("another flowlaned is already serving {}", path.display());
        }
        std::fs::remove_file(path)
            .with_context(|| format!("removing stale socket {}", path.display()))?;
        tracing::info!(socket = %path.display(), "removed stale socket");
    }
    let listener =
        UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))
        .with_context(|| format!("chmod {}", path.display()))?;
    Ok(listener)
}

/// Accepts clients until `shutdown` resolves, then removes the socket file.
pub async fn serve(
    listener: UnixListener,
    socket_path: PathBuf,
    shared: Shared,
    lanes: Lanes,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let per_netns = PerNetns::default();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    // Refusals are counted, not logged one by one: a pod
                    // could otherwise flood the log.
                    let Ok(permit) = slots.clone().try_acquire_owned() else {
                        shared.lock().connection_refused();
                        continue;
                    };
                    let caller = identify(&stream);
                    // Unidentified callers share one budget (netns 0).
                    let Some(netns_slot) = per_netns.acquire(caller.netns.unwrap_or(0)) else {
                        tracing::debug!(netns = ?caller.netns, "connection budget of the namespace exhausted");
                        shared.lock().connection_refused();
                        continue;
                    };
                    let shared = shared.clone();
                    let lanes = lanes.clone();
                    tokio::spawn(async move {
                        serve_client(stream, caller, shared, lanes).await;
                        drop((permit, netns_slot));
                    });
                }
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
    drop(listener);
    match std::fs::remove_file(&socket_path) {
        Ok(()) => tracing::info!(socket = %socket_path.display(), "socket removed"),
        Err(e) => {
            tracing::warn!(socket = %socket_path.display(), error = %e, "cannot remove socket")
        }
    }
}

/// Identity of the peer, fixed when it connected (SO_PEERCRED records the
/// connecting process).
fn identify(stream: &UnixStream) -> Caller {
    let cred = stream.peer_cred().ok();
    let pid = cred
        .and_then(|c| c.pid())
        .and_then(|p| u32::try_from(p).ok())
        .filter(|p| *p > 0);
    let Some(pid) = pid else {
        return Caller::default();
    };
    // Read the start time first: if the pid is reused between the two
    // reads, the process id no longer matches and the caller is refused
    // later (its registrations count as dead).
    let process = ProcessId::of(pid).ok();
    let netns = netns_inode_of_pid(pid).ok();
    if process.is_some_and(|p| !p.is_alive()) {
        return Caller::default();
    }
    Caller {
        netns,
        process,
        uid: cred.map(|c| c.uid()),
        gid: cred.map(|c| c.gid()),
    }
}

/// Whether the process identified when the connection was made still
/// lives in the same network namespace (unidentified callers stay
/// unidentified: the broker refuses what needs an identity). A process
/// that is gone fails too (its /proc entry is gone); a later process that
/// got the same pid passes only inside the same namespace, i.e. the same
/// pod. One stat of /proc/PID/ns/net, cheaper than the start-time check
/// of `ProcessId::is_alive`, which reads /proc/PID/stat (slow for a process
/// with many threads) on every request; see
/// docs/benchmarks/2026-11-30-daemon-setup.md.
/// Whether the process identified when the connection was made has exited:
/// no namespace left to read (a zombie has a /proc entry, with its start
/// time, but no `ns/net`; a reaped process has neither), or another
/// process under its pid. A one-way
/// close report is written just before the application may exit, so it is
/// often read after its sender is gone; it is accepted then, for the pod
/// the connection was identified as (`still_the_caller` refuses only a
/// process that now lives in ANOTHER namespace). What such a report can
/// do is bounded: it settles one side of a connection of the caller's own
/// pod, with plausible byte counts, once (docs/daemon.md, "One-way
/// messages").
fn caller_exited(caller: &Caller) -> bool {
    caller
        .process
        .is_some_and(|p| netns_inode_of_pid(p.pid).is_err() || !p.is_alive())
}

fn still_the_caller(caller: &Caller) -> bool {
    let Some(process) = caller.process else {
        return true;
    };
    netns_inode_of_pid(process.pid).ok() == caller.netns
}

async fn serve_client(mut stream: UnixStream, caller: Caller, shared: Shared, lanes: Lanes) {
    tracing::trace!(?caller, "client connected");
    loop {
        let body = match read_frame(&mut stream).await {
            Ok(Some(body)) => body,
            Ok(None) => return,
            Err(FrameError::Io(e)) => {
                tracing::debug!(error = %e, "client connection ended mid-frame");
                shared.lock().bad_request();
                return;
            }
            Err(FrameError::Proto(e)) => {
                shared.lock().bad_request();
                let resp = Response::error(ErrorCode::BadRequest, e.to_string());
                let _ = send_answer(&mut stream, resp.into()).await;
                return;
            }
        };
        let mut intent = false;
        let answer = match proto::decode_request(&body) {
            // A one-way message is handled and never answered.
            Ok(req) if req.is_one_way() => {
                if still_the_caller(&caller) || caller_exited(&caller) {
                    tracing::trace!(op = req.op_name(), "one-way request");
                    drop(shared.lock().handle(&caller, req));
                    continue;
                }
                tracing::debug!(?caller, "one-way request from a moved caller; closing");
                shared.lock().count_fallback(FallbackReason::AuthFailed);
                return;
            }
            Ok(_) if !still_the_caller(&caller) => {
                // The identity was read when the client connected; clients
                // keep connections open between requests, so it is checked
                // again for each one. A process that moved to another
                // network namespace (or a connection that outlived its
                // process: inherited, passed on) speaks for nobody now.
                // Refused, then closed: a client reconnects and is
                // identified afresh.
                tracing::debug!(?caller, "caller changed namespace or exited; closing");
                shared.lock().count_fallback(FallbackReason::AuthFailed);
                let resp = Response::error(
                    ErrorCode::Forbidden,
                    "the calling process changed network namespace or exited; reconnect",
                );
                let _ = send_answer(&mut stream, resp.into()).await;
                return;
            }
            Ok(req) => {
                tracing::trace!(op = req.op_name(), "request");
                intent = matches!(
                    req,
                    Request::ConnectIntent { .. }
                        | Request::RelayableIntent { .. }
                        | Request::ServiceIntent { .. }
                        | Request::StockIntent { .. }
                        | Request::StockRefill { .. }
                );
                match lanes.relay.as_ref().filter(|r| r.takes(&req)) {
                    // Cross-node set-ups block (lane open, handshake with
                    // the peer daemon): off the runtime's thread.
                    Some(r) => {
                        let r = r.clone();
                        tokio::task::spawn_blocking(move || r.handle(&caller, req))
                            .await
                            .unwrap_or_else(|_| {
                                Response::error(ErrorCode::Internal, "relay task failed").into()
                            })
                    }
                    None => {
                        let mut broker = shared.lock();
                        let mut answer = broker.handle(&caller, req);
                        // A stats answer: the other lanes add theirs.
                        lanes.complete(&mut answer, &broker);
                        answer
                    }
                }
            }
            Err(e) => {
                shared.lock().bad_request();
                Response::error(ErrorCode::BadRequest, e.to_string()).into()
            }
        };
        let made = Undelivered::of(intent, &answer.response);
        if let Err(e) = send_answer(&mut stream, answer).await {
            tracing::debug!(error = %e, "cannot answer a client");
            if let Some(made) = made {
                shared.lock().answer_undelivered(&caller, made);
            }
            return;
        }
    }
}

enum FrameError {
    Io(io::Error),
    Proto(proto::ProtoError),
}

/// One request body; `None` on a clean EOF between frames.
async fn read_frame(stream: &mut UnixStream) -> Result<Option<Vec<u8>>, FrameError> {
    let mut header = [0u8; proto::HEADER_LEN];
    // Idle clients may wait a while for their next request (clients open a
    // connection per operation; an idle one only holds a slot)…
    let n = match tokio::time::timeout(IDLE_TIMEOUT, stream.read(&mut header[..1])).await {
        Ok(r) => r.map_err(FrameError::Io)?,
        Err(_) => return Ok(None),
    };
    if n == 0 {
        return Ok(None);
    }
    // …but once a frame started, all of it must arrive promptly.
    let rest = async {
        stream
            .read_exact(&mut header[1..])
            .await
            .map_err(FrameError::Io)?;
        let len = proto::frame_len(header, proto::MAX_REQUEST_FRAME).map_err(FrameError::Proto)?;
        let mut body = vec![0u8; len];
        stream.read_exact(&mut body).await.map_err(FrameError::Io)?;
        Ok(Some(body))
    };
    match tokio::time::timeout(FRAME_TIMEOUT, rest).await {
        Ok(r) => r,
        Err(_) => Err(FrameError::Io(io::Error::new(
            io::ErrorKind::TimedOut,
            "frame timed out",
        ))),
    }
}

async fn send_answer(stream: &mut UnixStream, answer: Answer) -> io::Result<()> {
    let frame = match proto::encode_frame(&answer.response, proto::MAX_RESPONSE_FRAME) {
        Ok(f) => f,
        Err(e) => {
            let resp = Response::error(ErrorCode::TooLarge, e.to_string());
            proto::encode_frame(&resp, proto::MAX_RESPONSE_FRAME).map_err(io::Error::other)?
        }
    };
    let mut sent = 0;
    if !answer.fds.is_empty() {
        sent = send_with_fds(stream, &frame, &answer.fds).await?;
    }
    stream.write_all(&frame[sent..]).await
    // `answer.fds` (the daemon's copy for a claim, dups for an intent and
    // for granted stock) are closed here: the receiver holds its own
    // references now.
}

/// Sends (a first part of) `frame` with `fds` attached, all in one
/// SCM_RIGHTS message (the receiver reads them with the frame's first
/// bytes); returns bytes sent.
async fn send_with_fds(stream: &UnixStream, frame: &[u8], fds: &[OwnedFd]) -> io::Result<usize> {
    let fds: Vec<std::os::fd::RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    loop {
        stream.writable().await?;
        let raw = stream.as_raw_fd();
        let result = stream.try_io(Interest::WRITABLE, || {
            sendmsg::<()>(
                raw,
                &[IoSlice::new(frame)],
                &[ControlMessage::ScmRights(&fds)],
                MsgFlags::MSG_NOSIGNAL,
                None,
            )
            .map_err(io::Error::from)
        });
        match result {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::ProcessId;

    #[test]
    fn a_caller_stays_itself_only_in_its_namespace_and_lifetime() {
        let me = ProcessId::of(std::process::id()).unwrap();
        let netns = netns_inode_of_pid(me.pid).ok();
        let caller = |netns, process| Caller {
            netns,
            process,
            ..Caller::default()
        };
        assert!(still_the_caller(&caller(netns, Some(me))));
        // Connected from another namespace than the one it is in now.
        assert!(!still_the_caller(&caller(netns.map(|n| n + 1), Some(me))));
        // The process that connected is gone.
        let gone = ProcessId {
            pid: u32::MAX - 7,
            start: me.start,
        };
        assert!(!still_the_caller(&caller(netns, Some(gone))));
        // Unidentified callers stay unidentified (the broker refuses them).
        assert!(still_the_caller(&caller(None, None)));
        // One-way reports: a process that exited, not one that moved.
        assert!(caller_exited(&caller(netns, Some(gone))));
        assert!(!caller_exited(&caller(netns.map(|n| n + 1), Some(me))));
        let mut zombie = std::process::Command::new("true").spawn().unwrap();
        let zpid = zombie.id();
        let z = ProcessId::of(zpid).unwrap();
        // Not reaped yet: a zombie as soon as it exits.
        let t0 = std::time::Instant::now();
        while netns_inode_of_pid(zpid).is_ok() {
            assert!(t0.elapsed() < Duration::from_secs(10), "child never exited");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(z.is_alive(), "a zombie keeps its start time");
        assert!(caller_exited(&caller(netns, Some(z))));
        zombie.wait().unwrap();
    }

    /// A daemon serving a socket in a fresh directory, with one pod: the
    /// test's own namespace, with a client and a server IP.
    struct TestDaemon {
        dir: std::path::PathBuf,
        socket: std::path::PathBuf,
        view: Shared,
        rt: tokio::runtime::Runtime,
        stop: tokio::sync::oneshot::Sender<()>,
        daemon: tokio::task::JoinHandle<()>,
    }

    impl TestDaemon {
        fn start(name: &str) -> TestDaemon {
            use crate::broker::{DaemonFacts, Limits};
            use flowlane_registry::{Attachment, Registry};

            let dir =
                std::env::temp_dir().join(format!("fld-server-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            Registry::new(&dir)
                .put(&Attachment {
                    network: "n".into(),
                    container_id: "c1".into(),
                    ifname: "eth0".into(),
                    // Checked like any entry: the test's own namespace.
                    netns: format!("/proc/{}/ns/net", std::process::id()),
                    netns_inode: crate::identity::own_netns_inode().unwrap(),
                    ips: vec!["10.202.9.1/24".into(), "10.202.9.2/24".into()],
                    mac: String::new(),
                    pod_namespace: Some("default".into()),
                    pod_name: Some("pod1".into()),
                    pod_uid: None,
                    created_unix: 0,
                })
                .unwrap();
            let socket = dir.join("d.sock");
            let facts = DaemonFacts {
                state_dir: dir.clone(),
                socket: socket.clone(),
            };
            let kernel = Box::new(crate::broker::RealKernel::new(&facts.state_dir));
            let shared = Shared::new(Broker::new(facts, Limits::default(), kernel));
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            let listener = {
                let _in_rt = rt.enter();
                bind(&socket).unwrap()
            };
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let view = shared.clone();
            let daemon = rt.spawn(serve(
                listener,
                socket.clone(),
                shared,
                Lanes::default(),
                async {
                    let _ = stopped.await;
                },
            ));
            TestDaemon {
                dir,
                socket,
                view,
                rt,
                stop,
                daemon,
            }
        }

        fn stop(self) {
            let _ = self.stop.send(());
            self.rt.block_on(self.daemon).unwrap();
            let _ = std::fs::remove_dir_all(&self.dir);
        }

        /// Polls the broker's stats (a node request: read from the broker
        /// itself) until `done`, for at most 20 s.
        fn until(&self, done: impl Fn(&proto::Stats) -> bool) -> proto::Stats {
            let t0 = std::time::Instant::now();
            loop {
                let st = self.view.lock().stats();
                if done(&st) {
                    return st;
                }
                assert!(t0.elapsed() < Duration::from_secs(20), "{st:?}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    /// A one-way close report gets no answer, keeps the connection's
    /// framing (the next request's answer is its own), and is applied as a
    /// `report-closed` is. (Both ends here are one process of one pod, so
    /// the broker files every report under one side; counting each side
    /// once across real processes is `shm_semantics`' leak test.)
    #[test]
    fn one_way_close_reports_are_unanswered_and_applied() {
        use flowlane_lane::client::DaemonClient;
        use std::net::SocketAddr;

        let t = TestDaemon::start("oneway");
        let server: SocketAddr = "10.202.9.2:80".parse().unwrap();
        let client: SocketAddr = "10.202.9.1:5001".parse().unwrap();
        let mut c = DaemonClient::connect(&t.socket, Duration::from_secs(10)).unwrap();
        let mut s = DaemonClient::connect(&t.socket, Duration::from_secs(10)).unwrap();
        s.register_listener(server).unwrap();
        let id = c.connect_intent(client, server, 8192).unwrap().unwrap().id;
        assert_eq!(s.claim_accepted(server, client).unwrap().unwrap().id, id);
        c.report_closed_one_way(id, 20, 300).unwrap();
        c.report_closed_one_way(id, 20, 300).unwrap();
        // The next answer on the same connection is the next request's.
        let other: SocketAddr = "10.202.9.1:5002".parse().unwrap();
        let id2 = c.connect_intent(other, server, 8192).unwrap().unwrap().id;
        assert_ne!(id2, id);
        assert!(!c.looks_closed(), "the daemon answered a one-way message");
        let st = t.until(|st| st.requests.get("report-closed-one-way") == Some(&2));
        let conn = st.connections.iter().find(|x| x.id == id).unwrap();
        assert_eq!(
            (conn.bytes_client_to_server, conn.bytes_server_to_client),
            (300, 20),
            "{st:?}"
        );
        // Checked as report-closed is: counts no connection could carry
        // change nothing, and still get no answer.
        s.report_closed_one_way(id, u64::MAX, 0).unwrap();
        let st = t.until(|st| st.bad_requests == 1);
        assert_eq!(
            st.connections
                .iter()
                .find(|x| x.id == id)
                .unwrap()
                .bytes_server_to_client,
            20
        );
        assert!(!s.looks_closed());
        // A request that expects an answer cannot go one way.
        assert!(c.send_one_way(&Request::Stats).is_err());
        assert!(!c.is_broken());
        drop((c, s));
        t.stop();
    }

    /// A `stocked` answer passes the channel's memfd and every grant's in
    /// one SCM_RIGHTS message, which the library reads and checks; the
    /// server's stock claim gets the same regions, and its `stock-taken`
    /// goes one way and opens the connection.
    #[test]
    fn stocked_answers_carry_every_memfd_and_stock_taken_goes_one_way() {
        use flowlane_lane::client::DaemonClient;
        use std::net::SocketAddr;
        use std::os::unix::fs::MetadataExt;

        let t = TestDaemon::start("stock");
        let server: SocketAddr = "10.202.9.2:80".parse().unwrap();
        let client: SocketAddr = "10.202.9.1:5001".parse().unwrap();
        let mut c = DaemonClient::connect(&t.socket, Duration::from_secs(10)).unwrap();
        let mut s = DaemonClient::connect(&t.socket, Duration::from_secs(10)).unwrap();
        s.register_listener(server).unwrap();
        // The server shows that it looks at stock; nothing to grant yet.
        let none = s
            .stock_claim(server, "10.202.9.1:1".parse().unwrap(), 3)
            .unwrap();
        assert!(none.channel.is_none() && none.stock.is_empty());
        let got = c.stock_intent(client, server, 8192, 3, 4).unwrap();
        let channel = got.channel.expect("the connection's channel");
        assert_eq!(got.stock.len(), 4);
        let claimed = s.stock_claim(server, client, 3).unwrap();
        assert_eq!(claimed.channel.map(|c| c.id), Some(channel.id));
        let ino = |fd: &OwnedFd| {
            std::fs::File::from(fd.try_clone().unwrap())
                .metadata()
                .unwrap()
                .ino()
        };
        assert_eq!(claimed.stock.len(), 4);
        for (a, b) in got.stock.iter().zip(&claimed.stock) {
            assert_eq!(a.channel.id, b.channel.id);
            assert_eq!(ino(&a.channel.memfd), ino(&b.channel.memfd));
        }
        let peer: SocketAddr = "10.202.9.1:5002".parse().unwrap();
        s.stock_taken(got.stock[0].channel.id, server, peer)
            .unwrap();
        let st = t.until(|st| st.lanes["shm"].connections_opened == 2);
        assert_eq!(st.lanes["shm"].channels_stocked, 3, "{st:?}");
        assert!(!s.looks_closed(), "the daemon answered a one-way message");
        drop((c, s));
        t.stop();
    }

    /// A `stocked` intent answer that cannot be sent leaves neither its
    /// channel nor its stock behind.
    #[test]
    fn a_stocked_answer_that_cannot_be_sent_drops_its_stock() {
        use flowlane_lane::client::DaemonClient;
        use std::io::Write;
        use std::net::SocketAddr;

        let t = TestDaemon::start("stock-late");
        let server: SocketAddr = "10.202.9.2:80".parse().unwrap();
        let client: SocketAddr = "10.202.9.1:5000".parse().unwrap();
        let mut d = DaemonClient::connect(&t.socket, Duration::from_secs(10)).unwrap();
        d.register_listener(server).unwrap();
        d.stock_claim(server, "10.202.9.1:1".parse().unwrap(), 3)
            .unwrap();
        let late = std::os::unix::net::UnixStream::connect(&t.socket).unwrap();
        late.shutdown(std::net::Shutdown::Read).unwrap();
        let intent = Request::StockIntent {
            src: client,
            dst: server,
            region_len: 8192,
            socket_fd: 3,
            want: 4,
        };
        (&late)
            .write_all(&proto::encode_frame(&intent, proto::MAX_REQUEST_FRAME).unwrap())
            .unwrap();
        let st = t.until(|st| st.fallbacks.get("intent-undelivered") == Some(&1));
        assert_eq!(st.lanes["shm"].channels_pending, 0, "{st:?}");
        assert_eq!(st.lanes["shm"].channels_stocked, 0, "{st:?}");
        drop(late);
        drop(d);
        t.stop();
    }

    /// A client that stopped waiting for its intent's answer (the library
    /// gives a request 500 ms, then keeps the connection on TCP) must not
    /// leave a channel behind that the server would claim and attach to.
    #[test]
    fn an_intent_whose_answer_cannot_be_sent_is_dropped() {
        use flowlane_lane::client::DaemonClient;
        use std::io::Write;
        use std::net::SocketAddr;

        let t = TestDaemon::start("late");
        let socket = &t.socket;
        let server: SocketAddr = "10.202.9.2:80".parse().unwrap();
        let client: SocketAddr = "10.202.9.1:5000".parse().unwrap();
        let mut d = DaemonClient::connect(socket, Duration::from_secs(10)).unwrap();
        d.register_listener(server).unwrap();
        // The client's connection reads nothing more (what a client that
        // gave up and closed it looks like to the daemon's send).
        let late = std::os::unix::net::UnixStream::connect(socket).unwrap();
        late.shutdown(std::net::Shutdown::Read).unwrap();
        let intent = Request::ConnectIntent {
            src: client,
            dst: server,
            region_len: 8192,
        };
        (&late)
            .write_all(&proto::encode_frame(&intent, proto::MAX_REQUEST_FRAME).unwrap())
            .unwrap();
        let st = t.until(|st| st.fallbacks.get("intent-undelivered") == Some(&1));
        assert_eq!(st.lanes["shm"].channels_pending, 0, "{st:?}");
        // The server's claim finds no channel: both ends stay on TCP.
        assert!(d.claim_accepted(server, client).unwrap().is_none());
        drop(late);
        drop(d);
        t.stop();
    }
}
