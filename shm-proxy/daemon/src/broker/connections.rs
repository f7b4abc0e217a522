//! Brokered connections: their byte counts (the ends' reports and the
//! rings), close reports (bounded by what a connection could carry), the
//! connections a predecessor handed over, and the hand-over to a successor.

use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime};

use flowlane_lane::proto::{ErrorCode, Response};

use super::{Answer, Broker, Caller};
use crate::channel_store::ChannelRecord;
use crate::identity::ProcessId;
use crate::pods::PodId;
use crate::ring_watch::{Progress, RingWatch};

/// Most bytes per second one direction of a connection is believed to
/// carry (128 GiB/s: above any memory copy). A close report claiming more
/// than that over the connection's life is refused as a bad request, so a
/// pod cannot blow up the node's byte counters with its own reports.
const MAX_REPORTED_BYTES_PER_SEC: u64 = 1 << 37;

/// Whether `bytes` could have crossed one direction of a connection that
/// has been open for `age` (plus slack for clocks and rounding).
pub(super) fn plausible_bytes(bytes: u64, age: Duration) -> bool {
    bytes
        <= age
            .as_secs()
            .saturating_add(2)
            .saturating_mul(MAX_REPORTED_BYTES_PER_SEC)
}

#[derive(Debug, Clone, Copy, Default)]
pub(super) struct SideReport {
    pub(super) sent: u64,
    pub(super) received: u64,
}

#[derive(Debug)]
pub(super) struct Active {
    pub(super) id: u64,
    pub(super) client_pod: PodId,
    pub(super) server_pod: PodId,
    pub(super) client_addr: SocketAddr,
    pub(super) server_addr: SocketAddr,
    pub(super) len: u64,
    pub(super) opened: Instant,
    pub(super) client_process: Option<ProcessId>,
    pub(super) server_process: Option<ProcessId>,
    pub(super) client_report: Option<SideReport>,
    pub(super) server_report: Option<SideReport>,
    /// The daemon's view into the region (live bytes, both ends closed).
    pub(super) watch: Option<RingWatch>,
    /// The most bytes per direction `bytes` ever returned: the ring words
    /// are the pods', and one that moves back must not make the node's
    /// byte counters dip (counters are monotonic).
    pub(super) seen: std::cell::Cell<[u64; 2]>,
}

impl Active {
    /// Bytes per direction: the larger of what the ends reported, what the
    /// ring's counters show, and what this returned before.
    pub(super) fn bytes(&self) -> (u64, u64) {
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

    pub(super) fn progress(&self) -> Progress {
        self.watch
            .as_ref()
            .and_then(|w| w.progress().ok())
            .unwrap_or_default()
    }
}

/// Milliseconds since the Unix epoch.
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Broker {
    pub(super) fn report_closed(
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
        // The client's report may overtake its server's `stock-taken`.
        self.open_stock_reported(pod, channel_id);
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

    /// Closes the connections read through a mapping (stock: their ends
    /// send no close report) whose producers both closed. Memory reads
    /// only: called at every tick and before stats are read.
    pub(super) fn close_finished_mapped(&mut self) {
        let done: Vec<u64> = self
            .active
            .values()
            .filter(|c| c.watch.as_ref().is_some_and(|w| w.is_mapped()) && c.progress().both_closed)
            .map(|c| c.id)
            .collect();
        for id in done {
            self.close_active(id);
        }
    }

    pub(super) fn close_active(&mut self, id: u64) {
        if let Some(conn) = self.active.remove(&id) {
            self.stock_early.remove(&id);
            let (c2s, s2c) = conn.bytes();
            self.counters.shm.closed += 1;
            self.remember_closed(id);
            let total = &mut self.counters.shm.bytes;
            total[0] = total[0].saturating_add(c2s);
            total[1] = total[1].saturating_add(s2c);
            tracing::debug!(id, c2s, s2c, "connection closed");
        }
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
        match self.kernel.save_connections(&records) {
            Ok(()) => tracing::info!(
                connections = records.len(),
                "live connections saved for the next daemon"
            ),
            Err(e) => tracing::warn!(error = %e, "cannot save the live connections"),
        }
    }
}
