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

use flowlane_lane::proto::{
    ConnectionInfo, DaemonInfo, Endpoint, ErrorCode, LaneStats, ListenerInfo, NoChannelReason,
    Request, Response, Stats, PROTOCOL_VERSION,
};
use flowlane_registry::Registry;

use crate::channel_store::{ChannelRecord, ChannelStore};
use crate::counters::{reason, Counters};
use crate::identity::ProcessId;
use crate::listener_store::{ListenerRecord, ListenerStore};
use crate::memfd;
use crate::pods::{PodId, PodTable};
use crate::ring_watch::{Progress, RingWatch};
use crate::sockets;

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
/// DNAT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct IntentKey {
    src: SocketAddr,
    dst_port: u16,
}

#[derive(Debug)]
struct Pending {
    id: u64,
    memfd: OwnedFd,
    len: u64,
    client_pod: PodId,
    server_pod: PodId,
    key: IntentKey,
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
    /// The cross-node relay's lane counters (`relay/`), when it runs.
    relay_stats: Option<RelayStatsFn>,
    /// When each listener was last registered (see `LISTENER_GRACE`).
    listener_since: HashMap<(PodId, SocketAddr), Instant>,
    /// The cross-node view (`nodes.rs`) for stats answers, when it runs.
    nodes_view: Option<NodesViewFn>,
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
}

/// Reports the relay lane's name and counters for stats answers.
pub type RelayStatsFn = Box<dyn Fn() -> RelayStats + Send>;

/// The relay's lane name, counters, carried connections (their pod
/// fields empty: the broker names the local pod, the remote one is shown
/// as `remote`) and its transport's error counts by kind.
pub type RelayStats = (
    String,
    LaneStats,
    Vec<ConnectionInfo>,
    Vec<(&'static str, u64)>,
    flowlane_lane::proto::RelayMemory,
);

/// Reports the cross-node view (JSON) for stats answers.
pub type NodesViewFn = Box<dyn Fn() -> serde_json::Value + Send>;

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
            relay_stats: None,
            listener_since: HashMap::new(),
            nodes_view: None,
            node_netns: crate::identity::own_netns_inode()
                .into_iter()
                .chain([crate::identity::INIT_NETNS_INODE])
                .collect(),
            admin_gid: None,
            netns_check,
            inherited: HashMap::new(),
            channel_store: ChannelStore::new(&facts.state_dir),
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
            .filter(|p| !pods.contains(p.client_pod) || !pods.contains(p.server_pod))
            .map(|p| p.key)
            .collect();
        for key in gone {
            self.drop_pending(key, reason::INTENT_CANCELLED);
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
            Request::ReportClosed {
                channel_id,
                sent,
                received,
            } => self.report_closed(caller, channel_id, sent, received),
            Request::ReportFallback { reason } => match self.caller_pod(caller) {
                Ok(_) => {
                    self.counters.fallback(reason.as_str());
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
            Request::Stats => match self.node_caller(caller) {
                Ok(()) => Response::Stats {
                    stats: Box::new(self.stats()),
                }
                .into(),
                Err(a) => a,
            },
        }
    }

    /// Lets stats answers include the relay lane's counters.
    pub fn set_relay_stats(&mut self, f: RelayStatsFn) {
        self.relay_stats = Some(f);
    }

    /// Lets stats answers include the cross-node view.
    pub fn set_nodes_view(&mut self, f: NodesViewFn) {
        self.nodes_view = Some(f);
    }

    /// A fresh channel id (the relay's connections share the id space).
    pub fn next_channel_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Counts a fallback decided outside the broker (the relay).
    pub fn count_fallback(&mut self, reason: &'static str) {
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

    /// True when `dst` is a pod of this node with a live flowlane listener
    /// accepting it (the relay's server side asks before it registers a
    /// stream, so clients of pods without the library stay on TCP at once).
    pub fn has_flowlane_listener(&mut self, dst: SocketAddr) -> bool {
        let dst = canonical(dst);
        let pod = match self.pods.owner_of(dst.ip()) {
            Some(p) => p.id,
            None => {
                self.reload_if_changed();
                match self.pods.owner_of(dst.ip()) {
                    Some(p) => p.id,
                    None => return false,
                }
            }
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

    /// The relay's client-side checks (the same rules as an intent): the
    /// caller is a pod, owns `src` (or `src` is unspecified and the pod has
    /// an address facing `dst`), the region is within bounds. Returns the
    /// source address with the pod's IP filled in.
    pub fn relay_client_check(
        &mut self,
        caller: &Caller,
        src: SocketAddr,
        dst: SocketAddr,
        region_len: u64,
    ) -> Result<SocketAddr, Answer> {
        let pod = self.caller_pod(caller).inspect_err(|_| {
            self.counters.fallback(reason::AUTH_FAILED);
        })?;
        if src.port() == 0 || dst.port() == 0 {
            return Err(Response::error(ErrorCode::BadRequest, "port 0 in an intent").into());
        }
        if region_len < self.limits.min_region || region_len > self.limits.max_region {
            self.counters.fallback(reason::REGION_TOO_LARGE);
            return Err(Response::error(
                ErrorCode::TooLarge,
                format!("region of {region_len} bytes is out of bounds"),
            )
            .into());
        }
        let ip = if src.ip().is_unspecified() {
            self.pods.get(pod).and_then(|p| p.source_for(dst.ip()))
        } else {
            Some(src.ip()).filter(|ip| self.pod_owns(pod, *ip))
        };
        match ip {
            Some(ip) => Ok(SocketAddr::new(ip, src.port())),
            None => {
                self.counters.fallback(reason::AUTH_FAILED);
                Err(self.deny(
                    ErrorCode::Forbidden,
                    format!("{} is not an address of the calling pod", src.ip()),
                ))
            }
        }
    }

    /// The relay's server-side check: the caller is a pod that owns `local`.
    pub fn relay_server_check(&mut self, caller: &Caller, local: SocketAddr) -> Result<(), Answer> {
        let pod = self.caller_pod(caller).inspect_err(|_| {
            self.counters.fallback(reason::AUTH_FAILED);
        })?;
        if self.pod_owns(pod, local.ip()) {
            Ok(())
        } else {
            self.counters.fallback(reason::AUTH_FAILED);
            Err(self.deny(
                ErrorCode::Forbidden,
                format!("{} is not an address of the calling pod", local.ip()),
            ))
        }
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
        let client_pod = match self.caller_pod(caller) {
            Ok(p) => p,
            Err(a) => {
                self.counters.fallback(reason::AUTH_FAILED);
                return a;
            }
        };
        if src.port() == 0 || dst.port() == 0 {
            return Response::error(ErrorCode::BadRequest, "port 0 in an intent").into();
        }
        if region_len < self.limits.min_region {
            return Response::error(
                ErrorCode::BadRequest,
                format!(
                    "region of {region_len} bytes is below the minimum {}",
                    self.limits.min_region
                ),
            )
            .into();
        }
        if region_len > self.limits.max_region {
            self.counters.fallback(reason::REGION_TOO_LARGE);
            return Response::error(
                ErrorCode::TooLarge,
                format!(
                    "region of {region_len} bytes exceeds the maximum {}",
                    self.limits.max_region
                ),
            )
            .into();
        }
        let src_ip = if src.ip().is_unspecified() {
            match self
                .pods
                .get(client_pod)
                .and_then(|p| p.source_for(dst.ip()))
            {
                Some(ip) => ip,
                None => {
                    return self.no_channel(NoChannelReason::NotLocalPod, reason::NOT_LOCAL_POD)
                }
            }
        } else if self.pod_owns(client_pod, src.ip()) {
            src.ip()
        } else {
            self.counters.fallback(reason::AUTH_FAILED);
            return self.deny(
                ErrorCode::Forbidden,
                format!("{} is not an address of the calling pod", src.ip()),
            );
        };
        let server_pod = match self.pods.owner_of(dst.ip()) {
            Some(p) => p.id,
            None => {
                // A pod added a moment ago may not be in our view yet.
                self.reload_if_changed();
                match self.pods.owner_of(dst.ip()) {
                    Some(p) => p.id,
                    None => {
                        return self.no_channel(NoChannelReason::NotLocalPod, reason::NOT_LOCAL_POD)
                    }
                }
            }
        };
        if !self.has_listener(server_pod, dst) {
            return self.no_channel(NoChannelReason::NoListener, reason::NO_LISTENER);
        }
        let pending_of_pod = self
            .pending
            .values()
            .filter(|p| p.client_pod == client_pod)
            .count();
        if pending_of_pod >= self.limits.max_pending_per_pod {
            self.counters.fallback(reason::REGION_TOO_LARGE);
            return Response::error(
                ErrorCode::TooLarge,
                "too many pending channels for this pod",
            )
            .into();
        }
        let key = IntentKey {
            src: SocketAddr::new(src_ip, src.port()),
            dst_port: dst.port(),
        };
        // The same source port again means the earlier attempt is dead.
        self.drop_pending(key, reason::INTENT_CANCELLED);

        let id = self.next_id;
        self.next_id += 1;
        let created = memfd::create_sealed(&format!("flowlane-ch-{id}"), region_len)
            .and_then(|fd| Ok((fd.try_clone()?, fd)));
        let (client_copy, kept) = match created {
            Ok(fds) => fds,
            Err(e) => {
                tracing::warn!(error = %e, region_len, "cannot create a channel memfd");
                self.counters.fallback(reason::DAEMON_ERROR);
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

    fn no_channel(&mut self, why: NoChannelReason, counter: &'static str) -> Answer {
        self.counters.fallback(counter);
        Response::NoChannel { reason: why }.into()
    }

    fn drop_pending(&mut self, key: IntentKey, counter: &'static str) -> Option<Pending> {
        let p = self.pending.remove(&key)?;
        self.pending_ids.remove(&p.id);
        self.counters.fallback(counter);
        tracing::debug!(id = p.id, reason = counter, "pending channel dropped");
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
        self.drop_pending(key, reason::INTENT_CANCELLED);
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
            self.drop_pending(key, reason::INTENT_UNDELIVERED);
        }
    }

    fn claim_accepted(&mut self, caller: &Caller, local: SocketAddr, peer: SocketAddr) -> Answer {
        let pod = match self.caller_pod(caller) {
            Ok(p) => p,
            Err(a) => {
                self.counters.fallback(reason::AUTH_FAILED);
                return a;
            }
        };
        if !self.pod_owns(pod, local.ip()) {
            self.counters.fallback(reason::AUTH_FAILED);
            return self.deny(
                ErrorCode::Forbidden,
                format!("{} is not an address of the calling pod", local.ip()),
            );
        }
        let key = IntentKey {
            src: peer,
            dst_port: local.port(),
        };
        match self.pending.get(&key) {
            None => {
                return self.no_channel(NoChannelReason::NoIntent, reason::CLAIM_WITHOUT_INTENT)
            }
            Some(p) if p.server_pod != pod => {
                // Leave the channel for its real server.
                self.counters.fallback(reason::AUTH_FAILED);
                return self.deny(ErrorCode::Forbidden, "the channel belongs to another pod");
            }
            Some(_) => {}
        }
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
                server_pod: p.server_pod,
                client_addr: p.key.src,
                server_addr: p.dst,
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
            self.drop_pending(key, reason::INTENT_EXPIRED);
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

    /// A snapshot of counters, connections and listeners.
    pub fn stats(&self) -> Stats {
        let now = Instant::now();
        let mut lanes = BTreeMap::new();
        let [c2s, s2c] = self
            .active
            .values()
            .fold(self.counters.shm.bytes, |[a, b], c| {
                let (x, y) = c.bytes();
                [a.saturating_add(x), b.saturating_add(y)]
            });
        lanes.insert(
            SHM_LANE.to_string(),
            LaneStats {
                connections_opened: self.counters.shm.opened,
                connections_active: self.active.len() as u64,
                connections_closed: self.counters.shm.closed,
                bytes: c2s.saturating_add(s2c),
                channels_pending: self.pending.len() as u64,
                bytes_client_to_server: c2s,
                bytes_server_to_client: s2c,
            },
        );
        let mut relayed = Vec::new();
        let mut lane_errors = BTreeMap::new();
        let mut relay_memory = None;
        if let Some(relay) = &self.relay_stats {
            let (name, st, mut conns, errors, memory) = relay();
            relay_memory = Some(memory);
            if !errors.is_empty() {
                lane_errors.insert(
                    name.clone(),
                    errors
                        .into_iter()
                        .map(|(k, v)| (k.to_string(), v))
                        .collect(),
                );
            }
            lanes.insert(name, st);
            for c in &mut conns {
                for e in [&mut c.client, &mut c.server] {
                    e.pod = self
                        .pods
                        .owner_of(e.addr.ip())
                        .map(|p| self.pods.name_of(p.id))
                        .unwrap_or_else(|| "remote".to_string());
                }
            }
            relayed = conns;
        }
        let mut connections: Vec<ConnectionInfo> = self
            .active
            .values()
            .map(|c| {
                let (c2s, s2c) = c.bytes();
                ConnectionInfo {
                    id: c.id,
                    lane: SHM_LANE.to_string(),
                    client: Endpoint {
                        pod: self.pods.name_of(c.client_pod),
                        addr: c.client_addr,
                    },
                    server: Endpoint {
                        pod: self.pods.name_of(c.server_pod),
                        addr: c.server_addr,
                    },
                    region_len: c.len,
                    bytes_client_to_server: c2s,
                    bytes_server_to_client: s2c,
                    age_secs: now.saturating_duration_since(c.opened).as_secs(),
                }
            })
            .collect();
        connections.extend(relayed);
        let listeners = self
            .listeners
            .iter()
            .map(|((pod, addr), procs)| ListenerInfo {
                pod: self.pods.name_of(*pod),
                addr: *addr,
                processes: procs.len() as u32,
            })
            .collect();
        Stats {
            daemon: DaemonInfo {
                version: env!("CARGO_PKG_VERSION").to_string(),
                protocol: PROTOCOL_VERSION,
                pid: std::process::id(),
                uptime_secs: self.started.elapsed().as_secs(),
                state_dir: self.facts.state_dir.display().to_string(),
                socket: self.facts.socket.display().to_string(),
                pods: self.pods.len() as u64,
                registry_reloads: self.counters.registry_reloads,
            },
            lanes,
            fallbacks: self
                .counters
                .fallbacks
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect(),
            auth_failures: self.counters.auth_failures,
            channel_setup: self.counters.channel_setup.clone(),
            request_handling: self.counters.request_handling.clone(),
            bad_requests: self.counters.bad_requests,
            connections_refused: self.counters.connections_refused,
            requests: self
                .counters
                .requests
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect(),
            connections,
            listeners,
            nodes: self.nodes_view.as_ref().map(|f| f()),
            lane_errors,
            relay_memory,
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
mod tests {
    use super::*;
    use flowlane_lane::proto::FallbackReason;
    use flowlane_registry::Attachment;

    struct Node {
        dir: PathBuf,
        broker: Broker,
    }

    impl Drop for Node {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    /// Pods 1 (10.202.9.1), 2 (10.202.9.2), 3 (10.202.9.3); inodes are fake
    /// here (the real-netns checks are in tests/tests/daemon_*.rs).
    fn node(name: &str, limits: Limits) -> Node {
        let dir = std::env::temp_dir().join(format!("fld-broker-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let reg = Registry::new(&dir);
        for i in 1..=3u64 {
            reg.put(&Attachment {
                network: "n".into(),
                container_id: format!("c{i}"),
                ifname: "eth0".into(),
                netns: String::new(),
                netns_inode: i,
                ips: vec![format!("10.202.9.{i}/24")],
                mac: String::new(),
                pod_namespace: Some("default".into()),
                pod_name: Some(format!("pod{i}")),
                pod_uid: None,
                created_unix: 0,
            })
            .unwrap();
        }
        let broker = Broker::trusting_registry(
            DaemonFacts {
                state_dir: dir.clone(),
                socket: dir.join("s.sock"),
            },
            limits,
        );
        Node { dir, broker }
    }

    /// A root process of pod `i` (pods run as any uid, root included).
    fn pod(i: u64) -> Caller {
        Caller {
            netns: Some(i),
            process: Some(ProcessId::of(std::process::id()).unwrap()),
            uid: Some(0),
            gid: Some(0),
        }
    }

    /// A process of uid/gid in the daemon's own network namespace.
    fn on_node(uid: u32, gid: u32) -> Caller {
        Caller {
            netns: Some(crate::identity::own_netns_inode().unwrap()),
            process: Some(ProcessId::of(std::process::id()).unwrap()),
            uid: Some(uid),
            gid: Some(gid),
        }
    }

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    /// A TCP socket bound to 0.0.0.0:`port` (0: any), SO_REUSEPORT, not listening.
    fn bound_socket(port: u16) -> (std::os::fd::OwnedFd, u16) {
        crate::sockets::tests::bound_socket([0, 0, 0, 0], port)
    }

    /// A port that no socket without SO_REUSEPORT can bind, so no other
    /// test's listener takes it, while the returned socket (bound, never
    /// listening) lives. A port taken from a listener that was closed again
    /// can be handed to a concurrent test's bind(0) and be listening at the
    /// next sweep (1 in ~5700 pairs of binds here).
    fn reserved_port() -> (std::os::fd::OwnedFd, u16) {
        bound_socket(0)
    }

    /// A socket listening on a port from `reserved_port`.
    fn listen_on(port: u16) -> std::os::fd::OwnedFd {
        use nix::sys::socket::{listen, Backlog};
        let (fd, _) = bound_socket(port);
        listen(&fd, Backlog::new(16).unwrap()).unwrap();
        fd
    }

    #[test]
    fn intent_then_claim_hands_the_same_memfd_to_both() {
        let mut n = node("pair", Limits::default());
        let b = &mut n.broker;
        let r = b.handle(
            &pod(2),
            Request::RegisterListener {
                addr: sa("0.0.0.0:80"),
            },
        );
        assert_eq!(r.response, Response::Ok);
        let a = b.handle(
            &pod(1),
            Request::ConnectIntent {
                src: sa("0.0.0.0:40000"),
                dst: sa("10.202.9.2:80"),
                region_len: 8192,
            },
        );
        let Response::Channel { id, len: 8192 } = a.response else {
            panic!("{:?}", a.response)
        };
        let client_fd = a.fd.unwrap();
        // A third pod cannot claim it, even naming the right peer.
        let third = b.handle(
            &pod(3),
            Request::ClaimAccepted {
                local: sa("10.202.9.2:80"),
                peer: sa("10.202.9.1:40000"),
            },
        );
        assert!(matches!(
            third.response,
            Response::Error {
                code: ErrorCode::Forbidden,
                ..
            }
        ));
        let third = b.handle(
            &pod(3),
            Request::ClaimAccepted {
                local: sa("10.202.9.3:80"),
                peer: sa("10.202.9.1:40000"),
            },
        );
        assert!(matches!(
            third.response,
            Response::Error {
                code: ErrorCode::Forbidden,
                ..
            }
        ));
        assert!(third.fd.is_none());
        let s = b.handle(
            &pod(2),
            Request::ClaimAccepted {
                local: sa("10.202.9.2:80"),
                peer: sa("10.202.9.1:40000"),
            },
        );
        assert_eq!(s.response, Response::Channel { id, len: 8192 });
        let server_fd = s.fd.unwrap();
        // Same memfd: same inode.
        use std::os::unix::fs::MetadataExt;
        let ino = |fd: OwnedFd| std::fs::File::from(fd).metadata().unwrap().ino();
        assert_eq!(ino(client_fd), ino(server_fd));
        let st = b.stats();
        assert_eq!(st.lanes[SHM_LANE].connections_active, 1);
        assert_eq!(st.connections[0].client.pod, "default/pod1");
        assert_eq!(st.connections[0].client.addr, sa("10.202.9.1:40000"));
        // Second claim finds nothing.
        let again = b.handle(
            &pod(2),
            Request::ClaimAccepted {
                local: sa("10.202.9.2:80"),
                peer: sa("10.202.9.1:40000"),
            },
        );
        assert!(matches!(again.response, Response::NoChannel { .. }));
        // Both sides report; bytes add up once per direction.
        for (who, sent, recv) in [(1, 100, 7), (2, 7, 100)] {
            let r = b.handle(
                &pod(who),
                Request::ReportClosed {
                    channel_id: id,
                    sent,
                    received: recv,
                },
            );
            assert_eq!(r.response, Response::Ok);
        }
        let st = b.stats();
        assert_eq!(st.lanes[SHM_LANE].connections_closed, 1);
        assert_eq!(st.lanes[SHM_LANE].connections_active, 0);
        assert_eq!(st.lanes[SHM_LANE].bytes, 107);
        // Reports for ids this daemon never issued do not inflate counters.
        b.handle(
            &pod(1),
            Request::ReportClosed {
                channel_id: u64::MAX,
                sent: 1 << 40,
                received: 0,
            },
        );
        assert_eq!(b.stats().lanes[SHM_LANE].bytes, 107);
    }

    #[test]
    fn foreign_addresses_and_unknown_pods_are_refused() {
        let mut n = node("auth", Limits::default());
        let b = &mut n.broker;
        let r = b.handle(
            &pod(1),
            Request::RegisterListener {
                addr: sa("10.202.9.2:80"),
            },
        );
        assert!(matches!(
            r.response,
            Response::Error {
                code: ErrorCode::Forbidden,
                ..
            }
        ));
        let r = b.handle(
            &pod(99),
            Request::RegisterListener {
                addr: sa("0.0.0.0:80"),
            },
        );
        assert!(matches!(
            r.response,
            Response::Error {
                code: ErrorCode::UnknownPod,
                ..
            }
        ));
        let r = b.handle(
            &pod(1),
            Request::ConnectIntent {
                src: sa("10.202.9.3:4000"),
                dst: sa("10.202.9.2:80"),
                region_len: 8192,
            },
        );
        assert!(matches!(
            r.response,
            Response::Error {
                code: ErrorCode::Forbidden,
                ..
            }
        ));
        let r = b.handle(&pod(1), Request::Stats);
        assert!(matches!(
            r.response,
            Response::Error {
                code: ErrorCode::Forbidden,
                ..
            }
        ));
        let Response::Stats { stats } = b.handle(&on_node(0, 0), Request::Stats).response else {
            panic!()
        };
        assert_eq!(stats.auth_failures, 4);
    }

    #[test]
    fn no_listener_not_local_too_large_and_expiry() {
        let limits = Limits {
            intent_ttl: Duration::from_millis(0),
            ..Limits::default()
        };
        let mut n = node("misc", limits);
        let b = &mut n.broker;
        let intent = |b: &mut Broker, dst: &str, len: u64| {
            b.handle(
                &pod(1),
                Request::ConnectIntent {
                    src: sa("0.0.0.0:4000"),
                    dst: sa(dst),
                    region_len: len,
                },
            )
            .response
        };
        assert_eq!(
            intent(b, "10.202.9.2:80", 8192),
            Response::NoChannel {
                reason: NoChannelReason::NoListener
            }
        );
        assert_eq!(
            intent(b, "10.9.9.9:80", 8192),
            Response::NoChannel {
                reason: NoChannelReason::NotLocalPod
            }
        );
        b.handle(
            &pod(2),
            Request::RegisterListener {
                addr: sa("10.202.9.2:80"),
            },
        );
        assert!(matches!(
            intent(b, "10.202.9.2:80", 65 << 20),
            Response::Error {
                code: ErrorCode::TooLarge,
                ..
            }
        ));
        assert!(matches!(
            intent(b, "10.202.9.2:80", 8192),
            Response::Channel { .. }
        ));
        b.tick(Instant::now());
        let r = b.handle(
            &pod(2),
            Request::ClaimAccepted {
                local: sa("10.202.9.2:80"),
                peer: sa("10.202.9.1:4000"),
            },
        );
        assert!(matches!(r.response, Response::NoChannel { .. }));
        b.handle(
            &pod(1),
            Request::ReportFallback {
                reason: FallbackReason::Unsupported,
            },
        );
        let st = b.stats();
        assert_eq!(st.fallbacks["no-listener"], 1);
        assert_eq!(st.fallbacks["not-local-pod"], 1);
        assert_eq!(st.fallbacks["intent-expired"], 1);
        assert_eq!(st.fallbacks["region-too-large"], 1);
        assert_eq!(st.fallbacks["claim-without-intent"], 1);
        assert_eq!(st.fallbacks["unsupported"], 1);
        assert_eq!(st.lanes[SHM_LANE].channels_pending, 0);
    }

    #[test]
    fn live_bytes_come_from_the_rings_and_closed_rings_close_the_connection() {
        use flowlane_lane::ring::{self, Side};
        use std::os::fd::AsFd;
        let mut n = node("live", Limits::default());
        let b = &mut n.broker;
        b.handle(
            &pod(2),
            Request::RegisterListener {
                addr: sa("0.0.0.0:91"),
            },
        );
        let len = ring::region_len_for(8192);
        let a = b.handle(
            &pod(1),
            Request::ConnectIntent {
                src: sa("10.202.9.1:6000"),
                dst: sa("10.202.9.2:91"),
                region_len: len as u64,
            },
        );
        let Response::Channel { id, .. } = a.response else {
            panic!()
        };
        let s = b.handle(
            &pod(2),
            Request::ClaimAccepted {
                local: sa("10.202.9.2:91"),
                peer: sa("10.202.9.1:6000"),
            },
        );
        let fd = s.fd.unwrap();
        let region = flowlane_lane::region::Region::map_memfd(fd.as_fd(), len).unwrap();
        let (mut ctx, _) = region.endpoints(Side::Client);
        let (mut stx, _) = region.endpoints(Side::Server);
        ctx.write(&[1u8; 5000]);
        stx.write(&[2u8; 70]);
        let st = b.stats();
        assert_eq!(st.connections[0].bytes_client_to_server, 5000);
        assert_eq!(st.connections[0].bytes_server_to_client, 70);
        assert_eq!(st.lanes[SHM_LANE].bytes, 5070);
        // A pod writing an absurd position into its ring moves no counter,
        // and one moving its position back makes none dip.
        {
            use std::os::unix::fs::FileExt;
            let f = std::fs::File::from(fd.try_clone().unwrap());
            f.write_all_at(&(1u64 << 61).to_ne_bytes(), 512).unwrap();
            assert_eq!(b.stats().connections[0].bytes_client_to_server, 5000);
            assert_eq!(b.stats().lanes[SHM_LANE].bytes, 5070);
            f.write_all_at(&10u64.to_ne_bytes(), 512).unwrap();
            let st = b.stats();
            assert_eq!(st.lanes[SHM_LANE].bytes, 5070);
            assert_eq!(st.lanes[SHM_LANE].bytes_client_to_server, 5000);
            assert_eq!(st.lanes[SHM_LANE].bytes_server_to_client, 70);
            f.write_all_at(&5000u64.to_ne_bytes(), 512).unwrap();
        }
        ctx.close();
        stx.close();
        b.tick(Instant::now());
        let st = b.stats();
        assert_eq!(st.lanes[SHM_LANE].connections_closed, 1);
        assert_eq!(st.lanes[SHM_LANE].bytes, 5070);
        // Late reports of the closed connection change nothing.
        b.handle(
            &pod(1),
            Request::ReportClosed {
                channel_id: id,
                sent: 5000,
                received: 70,
            },
        );
        assert_eq!(b.stats().lanes[SHM_LANE].bytes, 5070);
    }

    #[test]
    fn dual_stack_sockets_with_ipv4_mapped_addresses_match() {
        let mut n = node("mapped", Limits::default());
        let b = &mut n.broker;
        let r = b.handle(
            &pod(2),
            Request::RegisterListener {
                addr: sa("[::]:93"),
            },
        );
        assert_eq!(r.response, Response::Ok);
        let a = b.handle(
            &pod(1),
            Request::ConnectIntent {
                src: sa("[::ffff:10.202.9.1]:7000"),
                dst: sa("[::ffff:10.202.9.2]:93"),
                region_len: 8192,
            },
        );
        let Response::Channel { id, .. } = a.response else {
            panic!("{:?}", a.response)
        };
        let s = b.handle(
            &pod(2),
            Request::ClaimAccepted {
                local: sa("[::ffff:10.202.9.2]:93"),
                peer: sa("10.202.9.1:7000"),
            },
        );
        assert_eq!(s.response, Response::Channel { id, len: 8192 });
    }

    #[test]
    fn a_claiming_process_keeps_the_listener_after_the_listening_one_exits() {
        let mut n = node("prefork", Limits::default());
        let b = &mut n.broker;
        // Registrations are checked against real listening sockets of the
        // pod's namespace (here: the test's own).
        let (_reserved, port) = reserved_port();
        let socket = listen_on(port);
        let listen_addr = SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port);
        let server_addr = SocketAddr::new("10.202.9.2".parse().unwrap(), port);
        let mut parent = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let as_parent = Caller {
            process: Some(ProcessId::of(parent.id()).unwrap()),
            ..pod(2)
        };
        let r = b.handle(&as_parent, Request::RegisterListener { addr: listen_addr });
        assert_eq!(r.response, Response::Ok);
        let intent = |b: &mut Broker, src_port: u16| {
            b.handle(
                &pod(1),
                Request::ConnectIntent {
                    src: sa(&format!("10.202.9.1:{src_port}")),
                    dst: server_addr,
                    region_len: 8192,
                },
            )
            .response
        };
        assert!(matches!(intent(b, 5000), Response::Channel { .. }));
        // A forked worker (another process of the pod) accepts and claims.
        let r = b.handle(
            &pod(2),
            Request::ClaimAccepted {
                local: server_addr,
                peer: sa("10.202.9.1:5000"),
            },
        );
        assert!(matches!(r.response, Response::Channel { .. }));
        parent.kill().unwrap();
        parent.wait().unwrap();
        b.tick(Instant::now());
        assert_eq!(b.stats().listeners.len(), 1);
        assert!(matches!(intent(b, 5001), Response::Channel { .. }));
        // The listening socket closes without an unregister: the next sweep
        // drops the registration.
        drop(socket);
        b.tick(Instant::now() + Duration::from_secs(10));
        assert!(b.stats().listeners.is_empty());
        assert!(matches!(intent(b, 5002), Response::NoChannel { .. }));
    }

    #[test]
    fn a_listener_registered_just_before_listen_survives_the_sweep() {
        let mut n = node("grace", Limits::default());
        let b = &mut n.broker;
        // The library registers before its real listen(): its socket is
        // bound, not listening, like this reservation.
        let (bound, port) = reserved_port();
        let addr = SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port);
        // Taken before the registration, so the registration is at most
        // 3 s old at `t0 + 3 s` however long the registering call took.
        let t0 = Instant::now();
        let r = b.handle(&pod(2), Request::RegisterListener { addr });
        assert_eq!(r.response, Response::Ok);
        let registered_by = Instant::now();
        b.tick(t0);
        b.tick(t0 + Duration::from_secs(3));
        assert_eq!(b.stats().listeners.len(), 1, "dropped within its grace");
        // Still not listening after the grace: gone.
        b.tick(registered_by + LISTENER_GRACE + Duration::from_secs(1));
        assert!(b.stats().listeners.is_empty());
        drop(bound);
    }

    #[test]
    fn listeners_survive_a_restart_and_leave_with_their_pod() {
        let mut n = node("restart", Limits::default());
        n.broker.handle(
            &pod(2),
            Request::RegisterListener {
                addr: sa("10.202.9.2:81"),
            },
        );
        let facts = n.broker.facts.clone();
        let mut again = Broker::trusting_registry(facts, Limits::default());
        assert_eq!(again.stats().listeners.len(), 1);
        Registry::new(&n.dir).remove("n", "c2", "eth0").unwrap();
        again.handle(&on_node(0, 0), Request::RegistryChanged);
        assert_eq!(again.stats().listeners.len(), 0);
        assert_eq!(again.pod_count(), 2);
    }

    fn forbidden(r: &Response) -> bool {
        matches!(
            r,
            Response::Error {
                code: ErrorCode::Forbidden,
                ..
            }
        )
    }

    #[test]
    fn node_requests_only_from_the_nodes_administrators() {
        let mut n = node("admin", Limits::default());
        let b = &mut n.broker;
        let ask = |b: &mut Broker, c: &Caller| {
            let st = b.handle(c, Request::Stats).response;
            let poke = b.handle(c, Request::RegistryChanged).response;
            assert_eq!(
                matches!(st, Response::Stats { .. }),
                poke == Response::Ok,
                "{st:?} / {poke:?}"
            );
            assert!(
                matches!(st, Response::Stats { .. }) || forbidden(&st),
                "{st:?}"
            );
            matches!(st, Response::Stats { .. })
        };
        // Root in the daemon's own (or the initial) network namespace.
        assert!(ask(b, &on_node(0, 0)));
        let init = Caller {
            netns: Some(crate::identity::INIT_NETNS_INODE),
            ..on_node(0, 0)
        };
        assert!(ask(b, &init));
        // Another uid of the node, unless in the admin group.
        assert!(!ask(b, &on_node(65534, 65534)));
        b.set_admin_gid(Some(4242));
        assert!(ask(b, &on_node(65534, 4242)));
        assert!(!ask(b, &on_node(65534, 65534)));
        // A supplementary group of the calling process counts too.
        let me = std::process::id();
        if let Some(g) = crate::identity::groups_of(me).unwrap().first() {
            b.set_admin_gid(Some(*g));
            assert!(ask(b, &on_node(65534, u32::MAX - 1)));
        }
        b.set_admin_gid(Some(4242));
        // Root in a namespace of its own making (`unshare -n`): nothing.
        let unshared = Caller {
            netns: Some(777_777),
            ..on_node(0, 0)
        };
        assert!(!ask(b, &unshared));
        let unshared_admin_group = Caller {
            netns: Some(777_777),
            ..on_node(65534, 4242)
        };
        assert!(!ask(b, &unshared_admin_group));
        // A pod, even as root; an unidentified caller.
        assert!(!ask(b, &pod(1)));
        assert!(!ask(b, &Caller::default()));
        let Response::Stats { stats } = b.handle(&on_node(0, 0), Request::Stats).response else {
            panic!()
        };
        // Two refusals (stats, poke) for each of the five refused callers
        // and the one refused twice.
        assert_eq!(stats.auth_failures, 12);
    }

    /// Channel pod 1 -> pod 2, claimed; returns its id.
    fn open_channel(b: &mut Broker, port: u16) -> u64 {
        let listen = sa(&format!("0.0.0.0:{port}"));
        assert_eq!(
            b.handle(&pod(2), Request::RegisterListener { addr: listen })
                .response,
            Response::Ok
        );
        let dst = sa(&format!("10.202.9.2:{port}"));
        let a = b.handle(
            &pod(1),
            Request::ConnectIntent {
                src: sa("10.202.9.1:41000"),
                dst,
                region_len: 8192,
            },
        );
        let Response::Channel { id, .. } = a.response else {
            panic!("{:?}", a.response)
        };
        let c = b.handle(
            &pod(2),
            Request::ClaimAccepted {
                local: dst,
                peer: sa("10.202.9.1:41000"),
            },
        );
        assert!(matches!(c.response, Response::Channel { .. }));
        id
    }

    fn closed(b: &mut Broker, who: u64, id: u64, sent: u64, received: u64) -> Response {
        b.handle(
            &pod(who),
            Request::ReportClosed {
                channel_id: id,
                sent,
                received,
            },
        )
        .response
    }

    #[test]
    fn close_reports_count_only_from_the_channels_pods_and_within_reason() {
        let mut n = node("report", Limits::default());
        let b = &mut n.broker;
        let id = open_channel(b, 95);
        let bytes = |b: &Broker| b.stats().lanes[SHM_LANE].bytes;
        let before = b.stats();
        // A third pod: refused, nothing recorded.
        assert!(forbidden(&closed(b, 3, id, 1 << 40, 1 << 40)));
        assert_eq!(b.stats().auth_failures, before.auth_failures + 1);
        // The channel's own pod with absurd counts: a bad request.
        for (sent, received) in [(u64::MAX, 0), (0, u64::MAX), (1 << 40, 0)] {
            let r = closed(b, 1, id, sent, received);
            assert!(
                matches!(
                    r,
                    Response::Error {
                        code: ErrorCode::BadRequest,
                        ..
                    }
                ),
                "{r:?}"
            );
        }
        assert_eq!(b.stats().bad_requests, before.bad_requests + 3);
        assert_eq!(bytes(b), 0);
        assert_eq!(b.stats().lanes[SHM_LANE].connections_active, 1);
        // Sane reports from both ends close it.
        assert_eq!(closed(b, 1, id, 1000, 10), Response::Ok);
        assert_eq!(closed(b, 2, id, 10, 1000), Response::Ok);
        assert_eq!(bytes(b), 1010);
        assert_eq!(b.stats().lanes[SHM_LANE].connections_closed, 1);
        assert!(plausible_bytes(100 << 30, Duration::ZERO));
        assert!(!plausible_bytes(1 << 40, Duration::ZERO));
    }

    #[test]
    fn a_successor_counts_a_handed_over_connection_once_per_side_from_its_pods() {
        let mut n = node("inherit", Limits::default());
        let id = open_channel(&mut n.broker, 96);
        // A second connection, the client's end already reported.
        let other = {
            let b = &mut n.broker;
            let a = b.handle(
                &pod(1),
                Request::ConnectIntent {
                    src: sa("10.202.9.1:41001"),
                    dst: sa("10.202.9.2:96"),
                    region_len: 8192,
                },
            );
            let Response::Channel { id, .. } = a.response else {
                panic!()
            };
            b.handle(
                &pod(2),
                Request::ClaimAccepted {
                    local: sa("10.202.9.2:96"),
                    peer: sa("10.202.9.1:41001"),
                },
            );
            assert_eq!(closed(b, 1, id, 5, 0), Response::Ok);
            id
        };
        n.broker.save_connections();
        // Ids are time-based: the successor's start after this one's ids.
        std::thread::sleep(Duration::from_millis(5));
        let facts = n.broker.facts.clone();
        let mut b = Broker::trusting_registry(facts.clone(), Limits::default());
        let bytes = |b: &Broker| b.stats().lanes[SHM_LANE].bytes;
        assert!(forbidden(&closed(&mut b, 3, id, 1 << 30, 0)));
        assert!(matches!(
            closed(&mut b, 1, id, u64::MAX, 0),
            Response::Error {
                code: ErrorCode::BadRequest,
                ..
            }
        ));
        assert_eq!(closed(&mut b, 1, id, 100, 7), Response::Ok);
        assert_eq!(bytes(&b), 100);
        // The same side again: counted once.
        assert_eq!(closed(&mut b, 1, id, 100, 7), Response::Ok);
        assert_eq!(bytes(&b), 100);
        assert_eq!(closed(&mut b, 2, id, 7, 100), Response::Ok);
        assert_eq!(bytes(&b), 107);
        assert_eq!(closed(&mut b, 2, id, 7, 100), Response::Ok);
        assert_eq!(bytes(&b), 107);
        // The other connection's client end reported to the predecessor.
        assert_eq!(closed(&mut b, 1, other, 5, 0), Response::Ok);
        assert_eq!(bytes(&b), 107);
        assert_eq!(closed(&mut b, 2, other, 3, 5), Response::Ok);
        assert_eq!(bytes(&b), 110);
        // Ids nobody handed over (a crashed predecessor's, made up): nothing.
        assert_eq!(closed(&mut b, 1, id - 1000, 1 << 30, 0), Response::Ok);
        assert_eq!(closed(&mut b, 1, 1, 1 << 30, 0), Response::Ok);
        assert_eq!(bytes(&b), 110);
        // The hand-over is taken by one successor only.
        let c = Broker::trusting_registry(facts, Limits::default());
        assert!(c.inherited.is_empty());
    }

    /// One real pod: `sleep`'s namespace (the test's own) recorded under
    /// its `/proc/PID/ns/net` path, checked like any entry.
    #[test]
    fn stale_registry_entries_lend_no_identity() {
        let dir = std::env::temp_dir().join(format!("fld-broker-{}-stale", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let own = crate::identity::own_netns_inode().unwrap();
        let mut sleeper = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let reg = Registry::new(&dir);
        let entry = |id: &str, netns: String, inode: u64, ip: &str| Attachment {
            network: "n".into(),
            container_id: id.into(),
            ifname: "eth0".into(),
            netns,
            netns_inode: inode,
            ips: vec![format!("{ip}/24")],
            mac: String::new(),
            pod_namespace: Some("default".into()),
            pod_name: Some(id.into()),
            pod_uid: None,
            created_unix: 0,
        };
        reg.put(&entry(
            "live",
            format!("/proc/{}/ns/net", sleeper.id()),
            own,
            "10.202.8.1",
        ))
        .unwrap();
        // A crashed runtime's pod: its pinned namespace is gone.
        reg.put(&entry(
            "gone",
            "/var/run/netns/fld-no-such-ns".into(),
            4242,
            "10.202.8.2",
        ))
        .unwrap();
        // No path recorded: cannot be checked, not trusted.
        reg.put(&entry("nopath", String::new(), 4343, "10.202.8.3"))
            .unwrap();
        let mut b = Broker::new(
            DaemonFacts {
                state_dir: dir.clone(),
                socket: dir.join("s.sock"),
            },
            Limits::default(),
        );
        assert_eq!(b.pod_count(), 1, "only the live entry is a pod");
        let as_ns = |netns| Caller {
            netns: Some(netns),
            ..pod(0)
        };
        let listen = |b: &mut Broker, c: &Caller| {
            b.handle(
                c,
                Request::RegisterListener {
                    addr: sa("0.0.0.0:97"),
                },
            )
            .response
        };
        let unknown = |r: &Response| {
            matches!(
                r,
                Response::Error {
                    code: ErrorCode::UnknownPod,
                    ..
                }
            )
        };
        assert!(unknown(&listen(&mut b, &as_ns(4242))));
        assert!(unknown(&listen(&mut b, &as_ns(4343))));
        assert_eq!(listen(&mut b, &as_ns(own)), Response::Ok);
        // The pod dies (its sandbox process; the path goes) and nothing
        // rereads the registry: a namespace with its inode is no one.
        sleeper.kill().unwrap();
        sleeper.wait().unwrap();
        assert!(unknown(&listen(&mut b, &as_ns(own))));
        let intent = b.handle(
            &as_ns(own),
            Request::ConnectIntent {
                src: sa("10.202.8.1:5000"),
                dst: sa("10.202.8.1:97"),
                region_len: 8192,
            },
        );
        assert!(unknown(&intent.response) && intent.fd.is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
