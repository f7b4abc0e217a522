//! The channel broker: flowlane listeners per pod, pending channels
//! (announced by a client, not yet claimed by the server), brokered
//! connections, and the authorisation of every request.
//!
//! Pure state machine over the pod table: it takes an authenticated caller
//! and a decoded request and returns the answer (and the memfd to pass, if
//! any). Sockets live in `server.rs`; whatever it asks of the kernel and of
//! the node's files (the registry, `/proc`, memfds, the state files, the
//! peer table) goes through one trait, `kernel::Kernel`, so its unit tests
//! run on a double (`fake_kernel.rs`) without sockets, processes or files.
//! (Only the clock, and the `pread` of a live channel's ring counters
//! through the memfd it keeps, `RingWatch`, are its own.)
//!
//! One concern per module, all on the one type `Broker`: this file has the
//! types, construction (state rebuilt from the registry and the files a
//! predecessor left) and the dispatch of a request; `registry` (the pods),
//! `callers` (who may ask what), `admission` (intents and claims, shared
//! with the relay), `listeners`, `channels` (pending: intent, claim),
//! `connections` (active: bytes, close reports, the hand-over),
//! `stock` (pre-created channels: stock intents and claims, `stock-taken`,
//! their bounds), `service` (Service IPs), `upkeep` (`tick`), `snapshot`
//! (stats), `kernel` (the seam).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use flowlane_lane::proto::{ErrorCode, FallbackReason, Request, Response};

use crate::channel_store::ChannelRecord;
use crate::counters::Counters;
use crate::identity::ProcessId;
use crate::pods::{PodId, PodTable};

mod admission;
mod callers;
mod channels;
mod connections;
mod kernel;
mod listeners;
mod registry;
mod service;
mod snapshot;
mod stock;
mod upkeep;

pub use admission::Admitted;
pub use kernel::{Kernel, RealKernel};
pub use service::{RemoteService, Resolved};
pub use stock::Undelivered;

use channels::{IntentKey, Pending};
use connections::Active;

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
    /// Pending channels one pod may have at a time (its stock counts
    /// too: `stock.rs`).
    pub max_pending_per_pod: usize,
    /// How long the daemon keeps a stock channel nobody took: longer than
    /// the library keeps its own, so the daemon's copy outlives every use.
    pub stock_ttl: Duration,
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
            stock_ttl: Duration::from_secs(60),
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

/// The name of channel `id`'s memfd (`/memfd:NAME` in a mapping process's
/// maps).
fn channel_memfd_name(id: u64) -> String {
    format!("flowlane-ch-{id}")
}

/// The answer to one request.
#[derive(Debug)]
pub struct Answer {
    pub response: Response,
    /// The memfds the answer names, in its order (a channel's; a
    /// `stocked` answer's channel, then its grants), passed with
    /// SCM_RIGHTS in one message.
    pub fds: Vec<OwnedFd>,
}

impl Answer {
    /// An answer that passes one memfd (a channel's).
    pub fn with_fd(response: Response, fd: OwnedFd) -> Self {
        Answer {
            response,
            fds: vec![fd],
        }
    }
}

impl From<Response> for Answer {
    fn from(response: Response) -> Self {
        Answer {
            response,
            fds: Vec::new(),
        }
    }
}

/// Static facts for stats answers.
#[derive(Debug, Clone)]
pub struct DaemonFacts {
    pub state_dir: PathBuf,
    pub socket: PathBuf,
}

pub struct Broker {
    /// The kernel and the node's files (`kernel.rs`).
    kernel: Box<dyn Kernel>,
    registry_stamp: kernel::RegistryStamp,
    pods: PodTable,
    listeners: BTreeMap<(PodId, SocketAddr), Vec<ProcessId>>,
    pending: HashMap<IntentKey, Pending>,
    pending_ids: HashMap<u64, IntentKey>,
    active: BTreeMap<u64, Active>,
    /// Channels made ahead for later connections, by id (`stock.rs`).
    stock: BTreeMap<u64, stock::Stock>,
    /// Listeners whose server showed that it looks at stock (a stock
    /// claim was served for them): only their clients get stock.
    takes_stock: HashSet<(PodId, SocketAddr)>,
    /// Stock made active by its client's close report before the server's
    /// `stock-taken` arrived, and since when (`stock.rs`).
    stock_early: HashMap<u64, Instant>,
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
    /// Connections a predecessor brokered (saved at its graceful stop):
    /// whose pods may report their close, and which sides did.
    inherited: HashMap<u64, ChannelRecord>,
    /// The injection probes' verdicts for this node's pods.
    injections: crate::injections::Injections,
    /// The cluster's Service CIDRs and the node's conntrack table that
    /// says where a connection to one went (`service.rs`).
    services: service::Services,
}

impl Broker {
    /// A broker for the node `kernel` shows (the daemon's: `RealKernel`
    /// over `facts.state_dir`); reads the registry and the saved
    /// listeners.
    pub fn new(facts: DaemonFacts, limits: Limits, kernel: Box<dyn Kernel>) -> Self {
        // Channel ids stay unique across restarts: connections brokered by
        // an earlier daemon still report their ids when they close.
        let now_ms = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let mut b = Broker {
            registry_stamp: Vec::new(),
            pods: PodTable::default(),
            listeners: BTreeMap::new(),
            pending: HashMap::new(),
            pending_ids: HashMap::new(),
            active: BTreeMap::new(),
            stock: BTreeMap::new(),
            takes_stock: HashSet::new(),
            stock_early: HashMap::new(),
            recently_closed: (HashSet::new(), VecDeque::new()),
            last_sweep: None,
            first_id: (now_ms << 16).max(1),
            next_id: (now_ms << 16).max(1),
            counters: Counters::default(),
            limits,
            started: Instant::now(),
            listener_since: HashMap::new(),
            node_netns: kernel.node_netns(),
            admin_gid: None,
            inherited: HashMap::new(),
            kernel,
            injections: Default::default(),
            services: Default::default(),
            facts,
        };
        b.reload_registry();
        // Taken, not read: after a crash the next start must not find the
        // records of a stop before it.
        b.inherited = b
            .kernel
            .take_connections()
            .into_iter()
            .filter(|r| {
                r.id < b.first_id && b.pods.contains(r.client_pod) && b.pods.contains(r.server_pod)
            })
            .map(|r| (r.id, r))
            .collect();
        let mut restored = 0;
        for rec in b.kernel.load_listeners() {
            if b.pods.contains(rec.pod) && b.kernel.is_alive(&rec.process) {
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

    /// Members of group `gid` (primary or supplementary) in the node's
    /// network namespace may ask node requests too (`--admin-gid`).
    pub fn set_admin_gid(&mut self, gid: Option<u32>) {
        self.admin_gid = gid;
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
            } => self.connect_intent(caller, src, dst, region_len, None),
            Request::CancelIntent { channel_id } => self.cancel_intent(caller, channel_id),
            Request::ClaimAccepted { local, peer } => self.claim_accepted(caller, local, peer),
            // The relay (`relay/`) takes these first when the peer is on
            // another node; here they are ordinary intents and claims.
            Request::RelayableIntent {
                src,
                dst,
                region_len,
                socket_fd,
            } => self.connect_intent(caller, src, dst, region_len, Some(socket_fd)),
            Request::RelayableClaim { local, peer, .. } => self.claim_accepted(caller, local, peer),
            // The relayable ops, and stock with them (`stock.rs`).
            Request::StockIntent {
                src,
                dst,
                region_len,
                socket_fd,
                want,
            } => self.stock_intent(caller, src, dst, region_len, socket_fd, want),
            Request::StockClaim { local, peer, .. } => self.stock_claim(caller, local, peer),
            // Sent ahead by a library about to run out (`stock.rs`).
            Request::StockRefill { dst, want } => self.stock_refill(caller, dst, want),
            Request::StockFetch { local } => self.stock_fetch(caller, local),
            // One way: whatever it yields is dropped unsent.
            Request::StockTaken {
                channel_id,
                local,
                peer,
            } => self.stock_taken(caller, channel_id, local, peer),
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
                Ok(()) => {
                    self.refresh_connections();
                    Response::Stats {
                        stats: Box::new(self.stats()),
                    }
                    .into()
                }
                Err(a) => a,
            },
        }
    }

    /// Brings the connections read from mappings up to date (stock: its
    /// ends send no message per connection): those whose offer word says
    /// taken are opened, those whose producers both closed are closed.
    /// Memory reads only; before every stats answer and at every tick.
    pub fn refresh_connections(&mut self) {
        self.open_taken_stock();
        self.close_finished_mapped();
    }

    /// Counts a fallback decided outside the broker (the relay).
    pub fn count_fallback(&mut self, reason: FallbackReason) {
        self.counters.fallback(reason);
    }

    /// Counts a request served outside the broker (the relay).
    pub fn count_request(&mut self, op: &'static str) {
        self.counters.request(op);
    }

    /// Counts an undecodable frame.
    pub fn bad_request(&mut self) {
        self.counters.bad_requests += 1;
    }

    /// Counts a client connection closed for lack of budget.
    pub fn connection_refused(&mut self) {
        self.counters.connections_refused += 1;
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
        Request::StockIntent {
            src,
            dst,
            region_len,
            socket_fd,
            want,
        } => Request::StockIntent {
            src: canonical(src),
            dst: canonical(dst),
            region_len,
            socket_fd,
            want,
        },
        Request::StockClaim {
            local,
            peer,
            socket_fd,
        } => Request::StockClaim {
            local: canonical(local),
            peer: canonical(peer),
            socket_fd,
        },
        Request::StockRefill { dst, want } => Request::StockRefill {
            dst: canonical(dst),
            want,
        },
        Request::StockFetch { local } => Request::StockFetch {
            local: canonical(local),
        },
        Request::StockTaken {
            channel_id,
            local,
            peer,
        } => Request::StockTaken {
            channel_id,
            local: canonical(local),
            peer: canonical(peer),
        },
        other => other,
    }
}

#[cfg(test)]
mod fake_kernel;
#[cfg(test)]
mod service_tests;
#[cfg(test)]
mod stock_tests;
#[cfg(test)]
mod tests;
