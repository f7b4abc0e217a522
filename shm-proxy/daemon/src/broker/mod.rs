//! The channel broker: flowlane listeners per pod, pending channels
//! (announced by a client, not yet claimed by the server), brokered
//! connections, and the authorisation of every request.
//!
//! Pure state machine over the pod table: it takes an authenticated caller
//! and a decoded request and returns the answer (and the memfd to pass, if
//! any). Sockets live in `server.rs`.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use flowlane_lane::proto::{ErrorCode, FallbackReason, NoChannelReason, Request, Response};
use flowlane_registry::Registry;

use crate::channel_store::{ChannelRecord, ChannelStore};
use crate::counters::Counters;
use crate::identity::ProcessId;
use crate::listener_store::{ListenerRecord, ListenerStore};
use crate::memfd;
use crate::pods::{PodId, PodTable};
use crate::ring_watch::{Progress, RingWatch};
use crate::sockets;

mod admission;
mod service;
mod snapshot;

pub use admission::Admitted;
pub use service::{RemoteService, Resolved};

/// A freshly registered listener is kept this long without checking that
/// its socket listens (the library registers it just before `listen()`).
const LISTENER_GRACE: Duration = Duration::from_secs(5);

/// The only lane this broker hands out today.
pub const SHM_LANE: &str = "shm";

/// Bounds the daemon enforces.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest channel region a client may request.
    pub max_region: u64,
    /// Smallest (anything below cannot hold the ring headers).
    pub min_region: u64,
    /// How long an announced channel waits for the server's claim.
    pub intent_ttl: Duration,
    /// Pending channels one pod may have at a time.
    pub max_pending_per_pod: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            // 64 MiB of rings plus the control page: FLOWLANE_RING_SIZE up
            // to 32 MiB per direction fits.
            max_region: (64 << 20) + 4096,
            min_region: 4096,
            intent_ttl: Duration::from_secs(30),
            max_pending_per_pod: 4096,
        }
    }
}

/// Who sent a request, as far as the kernel and `/proc` tell.
#[derive(Debug, Clone, Copy, Default)]
pub struct Caller {
    /// Inode of the caller's network namespace (None: unknown process).
    pub netns: Option<u64>,
    pub process: Option<ProcessId>,
    /// Effective uid and gid when it connected (SO_PEERCRED, in the
    /// daemon's user namespace): they decide node requests only.
    pub uid: Option<u32>,
    pub gid: Option<u32>,
}

/// Most bytes per second one direction of a connection is believed to
/// carry (128 GiB/s: above any memory copy). A close report claiming more
/// than that over the connection's life is refused as a bad request, so a
/// pod cannot blow up the node's byte counters with its own reports.
const MAX_REPORTED_BYTES_PER_SEC: u64 = 1 << 37;

/// Whether `bytes` could have crossed one direction of a connection that
/// has been open for `age` (plus slack for clocks and rounding).
fn plausible_bytes(bytes: u64, age: Duration) -> bool {
    bytes
        <= age
            .as_secs()
            .saturating_add(2)
            .saturating_mul(MAX_REPORTED_BYTES_PER_SEC)
}

/// How the broker decides that a registry entry still describes a live pod.
#[derive(Debug, Clone, Copy)]
enum NetnsCheck {
    /// The entry's namespace path must be a namespace file (device
    /// `nsfs_dev`) with the recorded inode.
    Verify { nsfs_dev: u64 },
    /// Unit tests with made-up inodes.
    #[cfg(test)]
    Off,
}

/// The name of channel `id`'s memfd (`/memfd:NAME` in a mapping process's
/// maps).
fn channel_memfd_name(id: u64) -> String {
    format!("flowlane-ch-{id}")
}

/// The answer to one request.
#[derive(Debug)]
pub struct Answer {
    pub response: Response,
    /// The channel's memfd, passed with SCM_RIGHTS.
    pub fd: Option<OwnedFd>,
}

impl From<Response> for Answer {
    fn from(response: Response) -> Self {
        Answer { response, fd: None }
    }
}

/// Pending channels are found again by the client's source address and the
/// destination port: exactly what the server sees after accept, even behind
/// DNAT. A connection to a Service IP is keyed by its source alone
/// (`service`, `dst_port` 0): the Service's port is not the backend's. Only
/// the pod that owns `src` can make either key (`admit_intent`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct IntentKey {
    src: SocketAddr,
    dst_port: u16,
    service: bool,
}

#[derive(Debug)]
struct Pending {
    id: u64,
    memfd: OwnedFd,
    len: u64,
    client_pod: PodId,
    /// The server's pod; for a Service connection, its backend's once the
    /// client resolved it (`service.rs`).
    server_pod: Option<PodId>,
    key: IntentKey,
    /// The destination the client named (a Service IP for a Service key).
    dst: SocketAddr,
    client_process: Option<ProcessId>,
    created: Instant,
}

#[derive(Debug, Clone, Copy, Default)]
struct SideReport {
    sent: u64,
    received: u64,
}

#[derive(Debug)]
struct Active {
    id: u64,
    client_pod: PodId,
    server_pod: PodId,
    client_addr: SocketAddr,
    server_addr: SocketAddr,
    len: u64,
    opened: Instant,
    client_process: Option<ProcessId>,
    server_process: Option<ProcessId>,
    client_report: Option<SideReport>,
    server_report: Option<SideReport>,
    /// The daemon's view into the region (live bytes, both ends closed).
    watch: Option<RingWatch>,
    /// The most bytes per direction `bytes` ever returned: the ring words
    /// are the pods', and one that moves back must not make the node's
    /// byte counters dip (counters are monotonic).
    seen: std::cell::Cell<[u64; 2]>,
}

impl Active {
    /// Bytes per direction: the larger of what the ends reported, what the
    /// ring's counters show, and what this returned before.
    fn bytes(&self) -> (u64, u64) {
        let (c2s, s2c) = self.bytes_now();
        let [a, b] = self.seen.get();
        let seen = [a.max(c2s), b.max(s2c)];
        self.seen.set(seen);
        (seen[0], seen[1])
    }

    fn bytes_now(&self) -> (u64, u64) {
        let c = self.client_report.unwrap_or_default();
        let s = self.server_report.unwrap_or_default();
        let live = self.progress();
        // The ring positions are the pods' words: one no connection could
        // have reached (as for close reports) counts nothing.
        let age = self.opened.elapsed();
        let plausible = |v: u64| if plausible_bytes(v, age) { v } else { 0 };
        (
            c.sent.max(s.received).max(plausible(live.client_to_server)),
            s.sent.max(c.received).max(plausible(live.server_to_client)),
        )
    }

    fn progress(&self) -> Progress {
        self.watch
            .as_ref()
            .and_then(|w| w.progress().ok())
            .unwrap_or_default()
    }
}

/// Static facts for stats answers.
#[derive(Debug, Clone)]
pub struct DaemonFacts {
    pub state_dir: PathBuf,
    pub socket: PathBuf,
}

pub struct Broker {
    registry: Registry,
    registry_stamp: Vec<(PathBuf, u64)>,
    pods: PodTable,
    listeners: BTreeMap<(PodId, SocketAddr), Vec<ProcessId>>,
    store: ListenerStore,
    pending: HashMap<IntentKey, Pending>,
    pending_ids: HashMap<u64, IntentKey>,
    active: BTreeMap<u64, Active>,
    /// Ids of recently closed connections, so a late close report is not
    /// mistaken for one of a connection brokered by an earlier daemon.
    recently_closed: (HashSet<u64>, VecDeque<u64>),
    /// When `tick` last swept connections and listeners.
    last_sweep: Option<Instant>,
    /// The first channel id this daemon issued (earlier ones are a
    /// predecessor's).
    first_id: u64,
    next_id: u64,
    counters: Counters,
    limits: Limits,
    facts: DaemonFacts,
    started: Instant,
    /// When each listener was last registered (see `LISTENER_GRACE`).
    listener_since: HashMap<(PodId, SocketAddr), Instant>,
    /// Network namespaces whose root (or admin-group) processes are the
    /// node's administrators: the daemon's own and the initial one.
    node_netns: Vec<u64>,
    /// A group whose members (in `node_netns`) are administrators too.
    admin_gid: Option<u32>,
    netns_check: NetnsCheck,
    /// Connections a predecessor brokered (saved at its graceful stop):
    /// whose pods may report their close, and which sides did.
    inherited: HashMap<u64, ChannelRecord>,
    channel_store: ChannelStore,
    /// The injection probes' verdicts for this node's pods.
    injections: crate::injections::Injections,
    /// The cluster's Service CIDRs and the node's conntrack table that
    /// says where a connection to one went (`service.rs`).
    services: service::Services,
}

impl Broker {
    /// A broker for the node whose registry lives in `facts.state_dir`;
    /// reads the registry and the saved listeners.
    pub fn new(facts: DaemonFacts, limits: Limits) -> Self {
        let nsfs_dev = crate::identity::nsfs_dev().unwrap_or_else(|e| {
            // No pod can be verified: every client stays on TCP.
            tracing::error!(error = %e, "cannot stat /proc/self/ns/net; no pod will be trusted");
            u64::MAX
        });
        Self::with_check(facts, limits, NetnsCheck::Verify { nsfs_dev })
    }

    /// A broker that takes the registry's inodes at their word (unit tests
    /// with made-up inodes).
    #[cfg(test)]
    fn trusting_registry(facts: DaemonFacts, limits: Limits) -> Self {
        Self::with_check(facts, limits, NetnsCheck::Off)
    }

    fn with_check(facts: DaemonFacts, limits: Limits, netns_check: NetnsCheck) -> Self {
        // Channel ids stay unique across restarts: connections brokered by
        // an earlier daemon still report their ids when they close.
        let now_ms = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let mut b = Broker {
            registry: Registry::new(&facts.state_dir),
            registry_stamp: Vec::new(),
            pods: PodTable::default(),
            listeners: BTreeMap::new(),
            store: ListenerStore::new(&facts.state_dir),
            pending: HashMap::new(),
            pending_ids: HashMap::new(),
            active: BTreeMap::new(),
            recently_closed: (HashSet::new(), VecDeque::new()),
            last_sweep: None,
            first_id: (now_ms << 16).max(1),
            next_id: (now_ms << 16).max(1),
            counters: Counters::default(),
            limits,
            started: Instant::now(),
            listener_since: HashMap::new(),
            node_netns: crate::identity::own_netns_inode()
                .into_iter()
                .chain([crate::identity::INIT_NETNS_INODE])
                .collect(),
            admin_gid: None,
            netns_check,
            inherited: HashMap::new(),
            channel_store: ChannelStore::new(&facts.state_dir),
            injections: Default::default(),
            services: Default::default(),
            facts,
        };
        b.reload_registry();
        // Taken, not read: after a crash the next start must not find the
        // records of a stop before it.
        b.inherited = b
            .channel_store
            .take()
            .into_iter()
            .filter(|r| {
                r.id < b.first_id && b.pods.contains(r.client_pod) && b.pods.contains(r.server_pod)
            })
            .map(|r| (r.id, r))
            .collect();
        let mut restored = 0;
        for rec in b.store.load() {
            if b.pods.contains(rec.pod) && rec.process.is_alive() {
                b.add_listener(rec.pod, rec.addr, rec.process);
                restored += 1;
            }
        }
        tracing::info!(
            pods = b.pods.len(),
            listeners = restored,
            inherited_connections = b.inherited.len(),
            "state rebuilt from the registry"
        );
        b.save_listeners();
        b
    }

    pub fn pod_count(&self) -> usize {
        self.pods.len()
    }

    /// Every address of the node's pods, after rereading the registry if
    /// it changed (what the peer table lists).
    pub fn pod_ips(&mut self) -> Vec<std::net::IpAddr> {
        self.reload_if_changed();
        self.pods.ips().collect()
    }

    /// Members of group `gid` (primary or supplementary) in the node's
    /// network namespace may ask node requests too (`--admin-gid`).
    pub fn set_admin_gid(&mut self, gid: Option<u32>) {
        self.admin_gid = gid;
    }

    /// Whether a registry entry still names a live namespace.
    fn entry_is_live(&self, path: &str, inode: u64) -> bool {
        match self.netns_check {
            NetnsCheck::Verify { nsfs_dev } => crate::pods::netns_is_live(path, inode, nsfs_dev),
            #[cfg(test)]
            NetnsCheck::Off => true,
        }
    }

    /// Whether pod `pod` is in the table and its namespace is still the
    /// one its entry recorded (checked on every request that needs the
    /// caller's pod: one stat).
    fn pod_is_live(&self, pod: PodId) -> bool {
        match self.netns_check {
            NetnsCheck::Verify { nsfs_dev } => self.pods.get(pod).is_some_and(|p| {
                p.netns_paths
                    .iter()
                    .any(|path| crate::pods::netns_is_live(path, pod, nsfs_dev))
            }),
            #[cfg(test)]
            NetnsCheck::Off => self.pods.contains(pod),
        }
    }

    /// Rereads the pod registry and forgets listeners and pending channels
    /// of pods that left.
    pub fn reload_registry(&mut self) {
        let attachments = match self.registry.list() {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the pod registry; keeping the old view");
                return;
            }
        };
        self.registry_stamp = registry_stamp(self.registry.root());
        // A runtime that crashed before CNI DEL leaves entries whose
        // namespace is gone; the kernel may give their inodes to new
        // namespaces, which must not become those pods.
        let (live, stale): (Vec<_>, Vec<_>) = attachments
            .into_iter()
            .partition(|a| self.entry_is_live(&a.netns, a.netns_inode));
        for a in &stale {
            tracing::warn!(
                entry = %a.container_id,
                netns = %a.netns,
                inode = a.netns_inode,
                "registry entry names a namespace that is gone (or is another one now): not trusted"
            );
        }
        self.pods = PodTable::from_attachments(&live);
        crate::peer_table::pods_changed(&self.pods.ips().collect::<Vec<_>>());
        self.counters.registry_reloads += 1;
        let pods = &self.pods;
        let before = self.listeners.len();
        self.listeners.retain(|(pod, _), _| pods.contains(*pod));
        self.inherited
            .retain(|_, r| pods.contains(r.client_pod) && pods.contains(r.server_pod));
        let gone: Vec<IntentKey> = self
            .pending
            .values()
            .filter(|p| {
                !pods.contains(p.client_pod) || p.server_pod.is_some_and(|s| !pods.contains(s))
            })
            .map(|p| p.key)
            .collect();
        for key in gone {
            self.drop_pending(key, FallbackReason::IntentCancelled);
        }
        if self.listeners.len() != before {
            self.save_listeners();
        }
        tracing::debug!(pods = self.pods.len(), "pod registry loaded");
    }

    /// Rereads the registry only if its directories changed since the last
    /// read (cheap: a few stat calls), so unknown callers cannot make the
    /// daemon parse the registry over and over.
    fn reload_if_changed(&mut self) -> bool {
        if registry_stamp(self.registry.root()) != self.registry_stamp {
            self.reload_registry();
            true
        } else {
            false
        }
    }

    /// Serves one request.
    pub fn handle(&mut self, caller: &Caller, req: Request) -> Answer {
        let started = Instant::now();
        let answer = self.dispatch(caller, req);
        self.counters.request_handling.observe(started.elapsed());
        answer
    }

    fn dispatch(&mut self, caller: &Caller, req: Request) -> Answer {
        self.counters.request(req.op_name());
        let req = canonical_request(req);
        match req {
            Request::RegisterListener { addr } => self.register_listener(caller, addr),
            Request::UnregisterListener { addr } => self.unregister_listener(caller, addr),
            Request::ConnectIntent {
                src,
                dst,
                region_len,
            } => self.connect_intent(caller, src, dst, region_len),
            Request::CancelIntent { channel_id } => self.cancel_intent(caller, channel_id),
            Request::ClaimAccepted { local, peer } => self.claim_accepted(caller, local, peer),
            // The relay (`relay/`) takes these first when the peer is on
            // another node; here they are ordinary intents and claims.
            Request::RelayableIntent {
                src,
                dst,
                region_len,
                ..
            } => self.connect_intent(caller, src, dst, region_len),
            Request::RelayableClaim { local, peer, .. } => self.claim_accepted(caller, local, peer),
            Request::ServiceIntent {
                src,
                dst,
                region_len,
            } => self.service_intent(caller, src, dst, region_len),
            Request::ResolveService { channel_id, .. } => self.resolve_service(caller, channel_id),
            Request::ReportClosed {
                channel_id,
                sent,
                received,
            } => self.report_closed(caller, channel_id, sent, received),
            // The same report; the server sends no answer to it.
            Request::ReportClosedOneWay {
                channel_id,
                sent,
                received,
            } => self.report_closed(caller, channel_id, sent, received),
            Request::ReportFallback { reason } => match self.caller_pod(caller) {
                Ok(_) => {
                    self.counters.fallback(reason);
                    Response::Ok.into()
                }
                Err(a) => a,
            },
            Request::RegistryChanged => match self.node_caller(caller) {
                Ok(()) => {
                    self.reload_registry();
                    Response::Ok.into()
                }
                Err(a) => a,
            },
            Request::ReportInjection {
                verdict,
                libc,
                reason,
                containers,
            } => match self.caller_pod(caller) {
                Ok(pod) => {
                    tracing::info!(pod = %self.pods.name_of(pod), ?containers, ?verdict, %libc, %reason, "injection probe");
                    // Pods that left take their verdicts with them.
                    let pods = &self.pods;
                    self.injections.retain(|p| pods.contains(p));
                    if self
                        .injections
                        .record(pod, &containers, verdict, &libc, &reason)
                    {
                        Response::Ok.into()
                    } else {
                        self.refuse(ErrorCode::TooLarge, "too many injection verdicts")
                    }
                }
                Err(a) => a,
            },
            Request::Stats => match self.node_caller(caller) {
                Ok(()) => Response::Stats {
                    stats: Box::new(self.stats()),
                }
                .into(),
                Err(a) => a,
            },
        }
    }

    /// The name of the local pod that owns `ip` (stats of the relay's
    /// connections).
    pub fn pod_name_at(&self, ip: IpAddr) -> Option<String> {
        self.pods
            .owner_of(ip.to_canonical())
            .map(|p| self.pods.name_of(p.id))
    }

    /// A fresh channel id (the relay's connections share the id space).
    pub fn next_channel_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Counts a fallback decided outside the broker (the relay).
    pub fn count_fallback(&mut self, reason: FallbackReason) {
        self.counters.fallback(reason);
    }

    /// Counts a request served outside the broker (the relay).
    pub fn count_request(&mut self, op: &'static str) {
        self.counters.request(op);
    }

    /// True when `ip` belongs to a pod of this node.
    pub fn is_local_pod_ip(&mut self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.pods.owner_of(ip).is_some()
            || (self.reload_if_changed() && self.pods.owner_of(ip).is_some())
    }

    /// The pod of this node that owns `ip`, rereading the registry once
    /// if none does (a pod added a moment ago may not be in our view yet).
    fn local_pod_of(&mut self, ip: IpAddr) -> Option<PodId> {
        match self.pods.owner_of(ip) {
            Some(p) => Some(p.id),
            None => {
                self.reload_if_changed();
                self.pods.owner_of(ip).map(|p| p.id)
            }
        }
    }

    /// True when `dst` is a pod of this node with a live flowlane listener
    /// accepting it (the relay's server side asks before it registers a
    /// stream, so clients of pods without the library stay on TCP at once).
    pub fn has_flowlane_listener(&mut self, dst: SocketAddr) -> bool {
        let dst = canonical(dst);
        let Some(pod) = self.local_pod_of(dst.ip()) else {
            return false;
        };
        let found = self.has_listener(pod, dst);
        if !found {
            let mine: Vec<SocketAddr> = self
                .listeners
                .keys()
                .filter(|(p, _)| *p == pod)
                .map(|(_, a)| *a)
                .collect();
            tracing::debug!(%dst, pod, listeners = ?mine, "no flowlane listener for a relayed stream");
        }
        found
    }

    /// Counts an undecodable frame.
    pub fn bad_request(&mut self) {
        self.counters.bad_requests += 1;
    }

    /// Counts a client connection closed for lack of budget.
    pub fn connection_refused(&mut self) {
        self.counters.connections_refused += 1;
    }

    /// The caller's pod, rereading the registry once if it is unknown.
    fn caller_pod(&mut self, caller: &Caller) -> Result<PodId, Answer> {
        let Some(netns) = caller.netns else {
            return Err(self.deny(ErrorCode::UnknownPod, "cannot identify the calling process"));
        };
        if !(self.pods.contains(netns) || (self.reload_if_changed() && self.pods.contains(netns))) {
            return Err(self.deny(
                ErrorCode::UnknownPod,
                format!("network namespace {netns} is not a pod of this node"),
            ));
        }
        // The entry was live at the last reread; the pod may have died
        // since and its inode gone to a new namespace (the caller's).
        if !self.pod_is_live(netns) {
            return Err(self.deny(
                ErrorCode::UnknownPod,
                format!("the registry entry of network namespace {netns} is stale"),
            ));
        }
        Ok(netns)
    }

    /// Node-level requests (stats: every connection, pod names, byte
    /// counts; the registry poke) come only from the node's administrators:
    /// uid 0, or a member of `--admin-gid`, in the daemon's own or the
    /// initial network namespace. Not from a pod (a pod must not learn
    /// about other pods' connections), not from a namespace a process
    /// made for itself (`unshare -n`: root in a pod can do that), not from
    /// other uids of the node.
    fn node_caller(&mut self, caller: &Caller) -> Result<(), Answer> {
        let (Some(netns), Some(_)) = (caller.netns, caller.process) else {
            return Err(self.deny(ErrorCode::Forbidden, "cannot identify the calling process"));
        };
        if self.pods.contains(netns) {
            return Err(self.deny(
                ErrorCode::Forbidden,
                "node requests are not allowed from a pod",
            ));
        }
        if !self.node_netns.contains(&netns) {
            return Err(self.deny(
                ErrorCode::Forbidden,
                "node requests are answered only in the node's network namespace",
            ));
        }
        if caller.uid == Some(0) || self.in_admin_group(caller) {
            return Ok(());
        }
        Err(self.deny(
            ErrorCode::Forbidden,
            "node requests need uid 0 or the daemon's admin group (--admin-gid)",
        ))
    }

    /// Whether the caller's effective gid, or one of its supplementary
    /// groups (read from /proc, then the process checked to be the same),
    /// is the admin group.
    fn in_admin_group(&self, caller: &Caller) -> bool {
        let Some(admin) = self.admin_gid else {
            return false;
        };
        if caller.gid == Some(admin) {
            return true;
        }
        caller.process.is_some_and(|p| {
            crate::identity::groups_of(p.pid).is_ok_and(|g| g.contains(&admin)) && p.is_alive()
        })
    }

    /// Refuses a request served outside the broker (the relay), counted
    /// as an auth failure.
    pub fn refuse(&mut self, code: ErrorCode, message: impl Into<String>) -> Answer {
        self.deny(code, message)
    }

    fn deny(&mut self, code: ErrorCode, message: impl Into<String>) -> Answer {
        self.counters.auth_failures += 1;
        let message = message.into();
        tracing::debug!(?code, %message, "request refused");
        Response::error(code, message).into()
    }

    fn register_listener(&mut self, caller: &Caller, addr: SocketAddr) -> Answer {
        let pod = match self.caller_pod(caller) {
            Ok(p) => p,
            Err(a) => return a,
        };
        if addr.port() == 0 {
            return Response::error(ErrorCode::BadRequest, "listener port 0").into();
        }
        if !addr.ip().is_unspecified() && !self.pod_owns(pod, addr.ip()) {
            return self.deny(
                ErrorCode::Forbidden,
                format!("{} is not an address of the calling pod", addr.ip()),
            );
        }
        let Some(process) = caller.process else {
            return self.deny(ErrorCode::UnknownPod, "cannot identify the calling process");
        };
        self.add_listener(pod, addr, process);
        self.save_listeners();
        tracing::debug!(pod = %self.pods.name_of(pod), %addr, "listener registered");
        Response::Ok.into()
    }

    fn add_listener(&mut self, pod: PodId, addr: SocketAddr, process: ProcessId) {
        let procs = self.listeners.entry((pod, addr)).or_default();
        if !procs.contains(&process) {
            procs.push(process);
        }
        self.listener_since.insert((pod, addr), Instant::now());
    }

    fn unregister_listener(&mut self, caller: &Caller, addr: SocketAddr) -> Answer {
        let pod = match self.caller_pod(caller) {
            Ok(p) => p,
            Err(a) => return a,
        };
        if let Some(procs) = self.listeners.get_mut(&(pod, addr)) {
            // Only the caller's own registration goes; another process of
            // the pod (e.g. a forked worker) may still listen.
            procs.retain(|p| Some(*p) != caller.process);
            if procs.is_empty() {
                self.listeners.remove(&(pod, addr));
            }
            self.save_listeners();
        }
        Response::Ok.into()
    }

    fn pod_owns(&self, pod: PodId, ip: IpAddr) -> bool {
        self.pods.get(pod).is_some_and(|p| p.owns(ip))
    }

    /// Addresses a listener accepting `dst` may be registered on.
    fn listener_candidates(dst: SocketAddr) -> impl Iterator<Item = SocketAddr> {
        let port = dst.port();
        [
            dst,
            SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port),
            // A dual-stack `::` socket also accepts IPv4.
            SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port),
        ]
        .into_iter()
        .filter(move |a| !(a.is_ipv4() && dst.is_ipv6()))
    }

    /// The registered listener of `pod` that accepts `dst`, if any.
    fn listener_key(&self, pod: PodId, dst: SocketAddr) -> Option<(PodId, SocketAddr)> {
        Self::listener_candidates(dst)
            .map(|a| (pod, a))
            .find(|k| self.listeners.contains_key(k))
    }

    /// True when `pod` has a live flowlane listener accepting `dst`.
    fn has_listener(&mut self, pod: PodId, dst: SocketAddr) -> bool {
        let mut found = false;
        let mut pruned = false;
        for addr in Self::listener_candidates(dst) {
            if let Some(procs) = self.listeners.get_mut(&(pod, addr)) {
                let before = procs.len();
                procs.retain(ProcessId::is_alive);
                pruned |= procs.len() != before;
                if procs.is_empty() {
                    self.listeners.remove(&(pod, addr));
                } else {
                    found = true;
                    break;
                }
            }
        }
        if pruned {
            self.save_listeners();
        }
        found
    }

    fn connect_intent(
        &mut self,
        caller: &Caller,
        src: SocketAddr,
        dst: SocketAddr,
        region_len: u64,
    ) -> Answer {
        let Admitted {
            client_pod,
            src: client_addr,
        } = match self.admit_intent(caller, src, dst, region_len) {
            Ok(admitted) => admitted,
            Err(refused) => return refused,
        };
        let Some(server_pod) = self.local_pod_of(dst.ip()) else {
            return self.no_channel(NoChannelReason::NotLocalPod, FallbackReason::NotLocalPod);
        };
        if !self.has_listener(server_pod, dst) {
            return self.no_channel(NoChannelReason::NoListener, FallbackReason::NoListener);
        }
        let key = IntentKey {
            src: client_addr,
            dst_port: dst.port(),
            service: false,
        };
        self.announce(caller, key, client_pod, Some(server_pod), dst, region_len)
    }

    /// Records a pending channel under `key` and answers it to the client.
    fn announce(
        &mut self,
        caller: &Caller,
        key: IntentKey,
        client_pod: PodId,
        server_pod: Option<PodId>,
        dst: SocketAddr,
        region_len: u64,
    ) -> Answer {
        let pending_of_pod = self
            .pending
            .values()
            .filter(|p| p.client_pod == client_pod)
            .count();
        if pending_of_pod >= self.limits.max_pending_per_pod {
            self.counters.fallback(FallbackReason::TooManyPending);
            return Response::error(
                ErrorCode::TooLarge,
                "too many pending channels for this pod",
            )
            .into();
        }
        // The same source port again means the earlier attempt is dead.
        self.drop_pending(key, FallbackReason::IntentCancelled);

        let id = self.next_id;
        self.next_id += 1;
        let created = memfd::create_sealed(&channel_memfd_name(id), region_len)
            .and_then(|fd| Ok((fd.try_clone()?, fd)));
        let (client_copy, kept) = match created {
            Ok(fds) => fds,
            Err(e) => {
                tracing::warn!(error = %e, region_len, "cannot create a channel memfd");
                self.counters.fallback(FallbackReason::DaemonError);
                return Response::error(ErrorCode::Internal, format!("memfd: {e}")).into();
            }
        };
        tracing::debug!(id, src = %key.src, %dst, region_len, "channel announced");
        self.pending_ids.insert(id, key);
        self.pending.insert(
            key,
            Pending {
                id,
                memfd: kept,
                len: region_len,
                client_pod,
                server_pod,
                key,
                dst,
                client_process: caller.process,
                created: Instant::now(),
            },
        );
        Answer {
            response: Response::Channel {
                id,
                len: region_len,
            },
            fd: Some(client_copy),
        }
    }

    fn no_channel(&mut self, why: NoChannelReason, counter: FallbackReason) -> Answer {
        self.counters.fallback(counter);
        Response::NoChannel { reason: why }.into()
    }

    fn drop_pending(&mut self, key: IntentKey, counter: FallbackReason) -> Option<Pending> {
        let p = self.pending.remove(&key)?;
        self.pending_ids.remove(&p.id);
        self.counters.fallback(counter);
        tracing::debug!(id = p.id, reason = %counter, "pending channel dropped");
        Some(p)
    }

    fn cancel_intent(&mut self, caller: &Caller, channel_id: u64) -> Answer {
        let pod = match self.caller_pod(caller) {
            Ok(p) => p,
            Err(a) => return a,
        };
        let Some(&key) = self.pending_ids.get(&channel_id) else {
            return Response::Ok.into();
        };
        if self.pending.get(&key).map(|p| p.client_pod) != Some(pod) {
            return self.deny(
                ErrorCode::Forbidden,
                "the channel was announced by another pod",
            );
        }
        self.drop_pending(key, FallbackReason::IntentCancelled);
        Response::Ok.into()
    }

    /// The answer to intent `channel_id` could not be sent: its client
    /// gave up waiting (the library's 500 ms budget) and closed the
    /// connection, so it runs that TCP connection without the ring. A
    /// server claiming the channel would attach to a ring nobody writes
    /// and read the client's bytes as doorbells: drop it, and the claim
    /// keeps both ends on TCP.
    pub fn intent_undelivered(&mut self, channel_id: u64) {
        if let Some(&key) = self.pending_ids.get(&channel_id) {
            self.drop_pending(key, FallbackReason::IntentUndelivered);
        }
    }

    fn claim_accepted(&mut self, caller: &Caller, local: SocketAddr, peer: SocketAddr) -> Answer {
        let pod = match self.admit_claim(caller, local) {
            Ok(p) => p,
            Err(refused) => return refused,
        };
        let direct = IntentKey {
            src: peer,
            dst_port: local.port(),
            service: false,
        };
        let key = match self.pending.get(&direct) {
            Some(p) if p.server_pod != Some(pod) => {
                // Leave the channel for its real server.
                self.counters.fallback(FallbackReason::AuthFailed);
                return self.deny(ErrorCode::Forbidden, "the channel belongs to another pod");
            }
            Some(_) => direct,
            // A connection to a Service IP, if conntrack says that it
            // reached `local` (`service.rs`).
            None => match self.service_claim(pod, local, peer) {
                Ok(key) => key,
                Err(refused) => return refused,
            },
        };
        let Some(p) = self.pending.remove(&key) else {
            return Response::error(ErrorCode::Internal, "pending channel vanished").into();
        };
        self.pending_ids.remove(&p.id);
        self.counters.shm.opened += 1;
        self.counters.channel_setup.observe(p.created.elapsed());
        // The claimer accepts on the listener: it keeps the listener alive
        // even when the process that called listen() exits (pre-fork
        // servers whose parent leaves).
        if let (Some(process), Some(key)) = (caller.process, self.listener_key(pod, local)) {
            let procs = self.listeners.entry(key).or_default();
            if !procs.contains(&process) {
                procs.push(process);
                self.save_listeners();
            }
        }
        tracing::debug!(id = p.id, client = %p.key.src, server = %local, "channel claimed");
        let watch = match p.memfd.try_clone() {
            Ok(fd) => Some(RingWatch::new(fd)),
            Err(e) => {
                tracing::warn!(error = %e, "cannot keep a view of the channel; no live counters");
                None
            }
        };
        self.active.insert(
            p.id,
            Active {
                id: p.id,
                client_pod: p.client_pod,
                server_pod: pod,
                client_addr: p.key.src,
                // A Service connection's server is its backend.
                server_addr: if p.key.service { local } else { p.dst },
                len: p.len,
                opened: Instant::now(),
                client_process: p.client_process,
                server_process: caller.process,
                client_report: None,
                server_report: None,
                watch,
                seen: Default::default(),
            },
        );
        Answer {
            response: Response::Channel {
                id: p.id,
                len: p.len,
            },
            fd: Some(p.memfd),
        }
    }

    fn report_closed(
        &mut self,
        caller: &Caller,
        channel_id: u64,
        sent: u64,
        received: u64,
    ) -> Answer {
        let pod = match self.caller_pod(caller) {
            Ok(p) => p,
            Err(a) => return a,
        };
        let report = SideReport { sent, received };
        if self.recently_closed.0.contains(&channel_id) {
            return Response::Ok.into();
        }
        let Some(conn) = self.active.get(&channel_id) else {
            return self.report_inherited(caller, pod, channel_id, report);
        };
        if pod != conn.client_pod && pod != conn.server_pod {
            return self.deny(ErrorCode::Forbidden, "the channel belongs to other pods");
        }
        let age = conn.opened.elapsed();
        let is_client = Self::reporting_client(
            pod,
            caller,
            (conn.client_pod, conn.server_pod),
            (conn.client_process, conn.server_process),
            conn.client_report.is_some(),
        );
        if !(plausible_bytes(sent, age) && plausible_bytes(received, age)) {
            return self.implausible(channel_id, report, age);
        }
        let Some(conn) = self.active.get_mut(&channel_id) else {
            return Response::Ok.into();
        };
        if is_client {
            conn.client_report = Some(report);
        } else {
            conn.server_report = Some(report);
        }
        if conn.client_report.is_some() && conn.server_report.is_some() {
            self.close_active(channel_id);
        }
        Response::Ok.into()
    }

    /// Which side of a connection `pod` reports for: by process when both
    /// ends are one pod, else by pod.
    fn reporting_client(
        pod: PodId,
        caller: &Caller,
        (client_pod, server_pod): (PodId, PodId),
        (client_process, server_process): (Option<ProcessId>, Option<ProcessId>),
        client_reported: bool,
    ) -> bool {
        if client_pod == server_pod {
            if caller.process.is_some() && caller.process == server_process {
                false
            } else if caller.process.is_some() && caller.process == client_process {
                true
            } else {
                !client_reported
            }
        } else {
            pod == client_pod
        }
    }

    /// A close report whose byte counts the connection could not have
    /// carried: refused and counted as a bad request.
    fn implausible(&mut self, channel_id: u64, report: SideReport, age: Duration) -> Answer {
        self.counters.bad_requests += 1;
        tracing::debug!(
            channel_id,
            sent = report.sent,
            received = report.received,
            age_secs = age.as_secs(),
            "close report with implausible byte counts refused"
        );
        Response::error(
            ErrorCode::BadRequest,
            "byte counts exceed what the connection could have carried",
        )
        .into()
    }

    /// A close report for a connection this daemon did not broker. Only a
    /// predecessor's connection handed over at its graceful stop counts
    /// (once per side, from its own pods, bounded by its age); any other id
    /// (a predecessor that crashed, an id nobody issued) changes nothing.
    fn report_inherited(
        &mut self,
        caller: &Caller,
        pod: PodId,
        channel_id: u64,
        report: SideReport,
    ) -> Answer {
        let Some(rec) = self.inherited.get(&channel_id) else {
            tracing::debug!(channel_id, "close report for an unknown connection ignored");
            return Response::Ok.into();
        };
        if pod != rec.client_pod && pod != rec.server_pod {
            return self.deny(ErrorCode::Forbidden, "the channel belongs to other pods");
        }
        let age = Duration::from_millis(unix_ms().saturating_sub(rec.opened_unix_ms));
        let is_client = Self::reporting_client(
            pod,
            caller,
            (rec.client_pod, rec.server_pod),
            (rec.client_process, rec.server_process),
            rec.client_reported,
        );
        if !(plausible_bytes(report.sent, age) && plausible_bytes(report.received, age)) {
            return self.implausible(channel_id, report, age);
        }
        let Some(rec) = self.inherited.get_mut(&channel_id) else {
            return Response::Ok.into();
        };
        let side = if is_client {
            &mut rec.client_reported
        } else {
            &mut rec.server_reported
        };
        if std::mem::replace(side, true) {
            // That side reported already.
            return Response::Ok.into();
        }
        // Each side counts what it sent: together, both directions.
        let dir = usize::from(!is_client);
        self.counters.shm.bytes[dir] = self.counters.shm.bytes[dir].saturating_add(report.sent);
        if rec.client_reported && rec.server_reported {
            self.inherited.remove(&channel_id);
            self.remember_closed(channel_id);
        }
        Response::Ok.into()
    }

    /// The live connections (and those still inherited), for the next
    /// daemon: called when this one stops gracefully.
    pub fn save_connections(&self) {
        let now = Instant::now();
        let now_ms = unix_ms();
        let records: Vec<ChannelRecord> = self
            .active
            .values()
            .map(|c| ChannelRecord {
                id: c.id,
                client_pod: c.client_pod,
                server_pod: c.server_pod,
                opened_unix_ms: now_ms
                    .saturating_sub(now.saturating_duration_since(c.opened).as_millis() as u64),
                client_process: c.client_process,
                server_process: c.server_process,
                client_reported: c.client_report.is_some(),
                server_reported: c.server_report.is_some(),
            })
            .chain(self.inherited.values().cloned())
            .collect();
        match self.channel_store.save(&records) {
            Ok(()) => tracing::info!(
                connections = records.len(),
                "live connections saved for the next daemon"
            ),
            Err(e) => tracing::warn!(error = %e, "cannot save the live connections"),
        }
    }

    fn remember_closed(&mut self, id: u64) {
        const REMEMBER: usize = 65536;
        let (set, order) = &mut self.recently_closed;
        set.insert(id);
        order.push_back(id);
        if order.len() > REMEMBER {
            if let Some(old) = order.pop_front() {
                set.remove(&old);
            }
        }
    }

    fn close_active(&mut self, id: u64) {
        if let Some(conn) = self.active.remove(&id) {
            let (c2s, s2c) = conn.bytes();
            self.counters.shm.closed += 1;
            self.remember_closed(id);
            let total = &mut self.counters.shm.bytes;
            total[0] = total[0].saturating_add(c2s);
            total[1] = total[1].saturating_add(s2c);
            tracing::debug!(id, c2s, s2c, "connection closed");
        }
    }

    /// Periodic upkeep: expires unclaimed channels, closes connections whose
    /// processes are all gone, forgets listeners of dead processes.
    pub fn tick(&mut self, now: Instant) {
        let ttl = self.limits.intent_ttl;
        let expired: Vec<IntentKey> = self
            .pending
            .values()
            .filter(|p| now.saturating_duration_since(p.created) >= ttl)
            .map(|p| p.key)
            .collect();
        for key in expired {
            self.drop_pending(key, FallbackReason::IntentExpired);
        }
        // The sweep below reads /proc and the rings of every connection:
        // at most every SWEEP_EVERY, and each process's liveness once.
        const SWEEP_EVERY: Duration = Duration::from_secs(2);
        if self
            .last_sweep
            .is_some_and(|t| now.saturating_duration_since(t) < SWEEP_EVERY)
        {
            return;
        }
        self.last_sweep = Some(now);
        let mut alive: HashMap<ProcessId, bool> = HashMap::new();
        let mut is_alive = |p: &ProcessId| *alive.entry(*p).or_insert_with(|| p.is_alive());
        let dead: Vec<u64> = self
            .active
            .values()
            .filter(|c| {
                let mut gone = |p: Option<ProcessId>| p.is_none_or(|p| !is_alive(&p));
                c.progress().both_closed || (gone(c.client_process) && gone(c.server_process))
            })
            .map(|c| c.id)
            .collect();
        for id in dead {
            self.close_active(id);
        }
        // Inherited connections whose processes are all gone will not
        // report any more.
        self.inherited.retain(|_, r| {
            let mut gone = |p: Option<ProcessId>| p.is_none_or(|p| !is_alive(&p));
            !(gone(r.client_process) && gone(r.server_process))
        });
        let before: usize = self.listeners.values().map(Vec::len).sum();
        for procs in self.listeners.values_mut() {
            procs.retain(&mut is_alive);
        }
        let since = &self.listener_since;
        self.listeners.retain(|key, procs| {
            // The library registers a listener just BEFORE its real
            // listen(): a socket that is not listening yet is not gone.
            let young = since
                .get(key)
                .is_some_and(|t| now.saturating_duration_since(*t) < LISTENER_GRACE);
            // The pod's namespace must still have the listening socket
            // (checked through a process of it; unreadable = keep).
            !procs.is_empty()
                && (young
                    || procs.first().is_some_and(|p| {
                        sockets::netns_listens_on(p.pid, key.1.port()).unwrap_or(true)
                    }))
        });
        let listeners = &self.listeners;
        self.listener_since
            .retain(|key, _| listeners.contains_key(key));
        let after: usize = self.listeners.values().map(Vec::len).sum();
        if before != after {
            self.save_listeners();
        }
    }

    fn save_listeners(&self) {
        let records: Vec<ListenerRecord> = self
            .listeners
            .iter()
            .flat_map(|((pod, addr), procs)| {
                procs.iter().map(|process| ListenerRecord {
                    pod: *pod,
                    addr: *addr,
                    process: *process,
                })
            })
            .collect();
        if let Err(e) = self.store.save(&records) {
            tracing::warn!(error = %e, "cannot save the listener table");
        }
    }
}

/// Milliseconds since the Unix epoch.
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A dual-stack (`::`) socket sees IPv4 peers as IPv4-mapped IPv6
/// addresses (`::ffff:10.0.0.2`); the registry holds plain IPv4. Compare in
/// one form.
fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

fn canonical_request(req: Request) -> Request {
    match req {
        Request::RegisterListener { addr } => Request::RegisterListener {
            addr: canonical(addr),
        },
        Request::UnregisterListener { addr } => Request::UnregisterListener {
            addr: canonical(addr),
        },
        Request::ConnectIntent {
            src,
            dst,
            region_len,
        } => Request::ConnectIntent {
            src: canonical(src),
            dst: canonical(dst),
            region_len,
        },
        Request::ClaimAccepted { local, peer } => Request::ClaimAccepted {
            local: canonical(local),
            peer: canonical(peer),
        },
        Request::RelayableIntent {
            src,
            dst,
            region_len,
            socket_fd,
        } => Request::RelayableIntent {
            src: canonical(src),
            dst: canonical(dst),
            region_len,
            socket_fd,
        },
        Request::RelayableClaim {
            local,
            peer,
            socket_fd,
        } => Request::RelayableClaim {
            local: canonical(local),
            peer: canonical(peer),
            socket_fd,
        },
        Request::ServiceIntent {
            src,
            dst,
            region_len,
        } => Request::ServiceIntent {
            src: canonical(src),
            dst: canonical(dst),
            region_len,
        },
        other => other,
    }
}

/// The registry's entries as (path, inode) pairs: an added, removed or
/// replaced entry (the registry renames a new file into place) changes it.
/// Directory mtimes would be cheaper but have coarse (jiffy) resolution, so
/// two changes within a few milliseconds could look like one.
fn registry_stamp(root: &Path) -> Vec<(PathBuf, u64)> {
    use std::os::unix::fs::DirEntryExt;
    let mut out = Vec::new();
    let Ok(networks) = std::fs::read_dir(root) else {
        return out;
    };
    for net in networks.flatten() {
        let Ok(entries) = std::fs::read_dir(net.path()) else {
            continue;
        };
        out.extend(entries.flatten().map(|e| (e.path(), e.ino())));
    }
    out.sort();
    out
}

#[cfg(test)]
mod service_tests;
#[cfg(test)]
mod tests;
