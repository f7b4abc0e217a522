//! One carried pod connection: the stream state both the link's poller
//! (arrivals) and the relay's pump threads (send/recv) touch.
//!
//! Lock order: a link's state lock may be held while a stream's lock is
//! taken, never the other way round, so stream code calls into the link only
//! after dropping its own lock.

use std::{
    collections::VecDeque,
    io,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Condvar, Mutex, Weak,
    },
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

use super::credit::{RecvWindow, WindowOverrun};
use super::fabric::{Registration, Write};
use super::link::{Link, Outgoing};
use super::wire::Kind;
use crate::lane_stream::{DirectLane, LaneStream, Piece, RingArea};

pub(crate) struct StreamShared {
    pub(crate) id: u32,
    link: Weak<Link>,
    st: Mutex<StreamState>,
    cv: Condvar,
    direct: Mutex<DirectState>,
    /// Bytes of our placements posted and not yet completed.
    placing: AtomicU64,
}

/// Zero copy: our registered sending area, the peer's receiving area.
#[derive(Default)]
struct DirectState {
    /// (address, lkey, length)
    tx: Option<(u64, u32, usize)>,
    /// (address, rkey, length)
    peer: Option<(u64, u32, usize)>,
    on_placed: Option<Box<dyn Fn(u64) + Send + Sync>>,
}

/// What the peer needs to write into our receiving area.
#[derive(Debug, Serialize, Deserialize)]
struct AreaDesc {
    addr: u64,
    rkey: u32,
    len: u64,
}

/// Keeps a stream's rings registered (see `DirectLane::register_rings`).
struct RingsRegistration {
    shared: Arc<StreamShared>,
    _regs: Vec<Box<dyn Registration>>,
}

/// How long unregistering waits for placements in flight.
const UNREGISTER_WAIT: Duration = Duration::from_secs(5);

impl Drop for RingsRegistration {
    fn drop(&mut self) {
        // The NIC may still read the area for placements in flight: wait for
        // their completions, unless the link failed (its queue pair is in
        // ERROR and touches no memory any more).
        let deadline = Instant::now() + UNREGISTER_WAIT;
        while self.shared.placing.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
            if self.shared.link.upgrade().is_none_or(|l| l.is_failed()) {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut d = self.shared.direct.lock().unwrap();
        d.on_placed = None;
        d.tx = None;
    }
}

struct StreamState {
    rx: VecDeque<Vec<u8>>,
    /// Bytes of `rx[0]` already read.
    rx_off: usize,
    window: RecvWindow,
    rx_eof: bool,
    /// Bytes the peer's window still lets us send.
    tx_window: u64,
    tx_shut: bool,
    /// Why the stream is dead in both directions (peer reset, local reset,
    /// link failure).
    reset: Option<String>,
    /// Why sending is impossible while received bytes stay readable (the
    /// link failed after the peer's FIN arrived).
    tx_error: Option<String>,
}

fn reset_error(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionReset, why.to_string())
}

impl StreamShared {
    pub(crate) fn new(id: u32, link: Weak<Link>, recv_window: u32, send_window: u32) -> Arc<Self> {
        Arc::new(StreamShared {
            id,
            link,
            st: Mutex::new(StreamState {
                rx: VecDeque::new(),
                rx_off: 0,
                window: RecvWindow::new(recv_window),
                rx_eof: false,
                tx_window: send_window as u64,
                tx_shut: false,
                reset: None,
                tx_error: None,
            }),
            cv: Condvar::new(),
            direct: Mutex::default(),
            placing: AtomicU64::new(0),
        })
    }

    /// `n` bytes of our placements completed.
    pub(crate) fn on_placed(&self, n: u64) {
        if let Some(f) = &self.direct.lock().unwrap().on_placed {
            f(n);
        }
        self.placing.fetch_sub(n, Ordering::AcqRel);
    }

    /// Bytes arrived. An overrun is the peer breaking the protocol: the
    /// caller fails the whole link.
    pub(crate) fn on_data(&self, payload: Vec<u8>) -> Result<(), WindowOverrun> {
        let mut st = self.st.lock().unwrap();
        if st.reset.is_some() || st.rx_eof {
            return Ok(()); // a reset stream drops late bytes, as TCP does
        }
        st.window.on_data(payload.len() as u64)?;
        if !payload.is_empty() {
            st.rx.push_back(payload);
        }
        self.cv.notify_all();
        Ok(())
    }

    /// The peer half-closed; returns whether both directions are now done.
    pub(crate) fn on_fin(&self) -> bool {
        let mut st = self.st.lock().unwrap();
        st.rx_eof = true;
        self.cv.notify_all();
        st.tx_shut
    }

    pub(crate) fn on_window(&self, n: u32) {
        let mut st = self.st.lock().unwrap();
        st.tx_window += n as u64;
        self.cv.notify_all();
    }

    /// The peer reset the stream or the link failed.
    pub(crate) fn on_reset(&self, why: &str) {
        let mut st = self.st.lock().unwrap();
        if st.reset.is_none() {
            st.reset = Some(why.to_string());
        }
        st.rx.clear();
        self.cv.notify_all();
    }

    /// The link failed. A stream whose peer already half-closed keeps what
    /// it received (the peer finished sending: those bytes and the EOF are
    /// complete); only sending fails. Any other stream is reset.
    pub(crate) fn on_link_failed(&self, why: &str) {
        let mut st = self.st.lock().unwrap();
        if st.rx_eof && st.reset.is_none() {
            st.tx_error = Some(why.to_string());
            self.cv.notify_all();
            return;
        }
        drop(st);
        self.on_reset(why);
    }

    fn link(&self) -> io::Result<Arc<Link>> {
        self.link
            .upgrade()
            .ok_or_else(|| reset_error("the RDMA link is gone"))
    }
}

/// The [`LaneStream`] handed to the relay.
pub(crate) struct RdmaStream {
    pub(crate) shared: Arc<StreamShared>,
    pub(crate) max_payload: usize,
    /// The peer daemon's address (its link's control connection).
    pub(crate) peer: std::net::IpAddr,
}

/// How long a blocked call sleeps before re-checking (wake-ups normally
/// come from the condition variable; this only bounds a missed one).
const RECHECK: Duration = Duration::from_secs(1);

impl LaneStream for RdmaStream {
    fn peer_node(&self) -> Option<std::net::IpAddr> {
        Some(self.peer)
    }

    fn send(&self, buf: &[u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let s = &self.shared;
        let link = s.link()?;
        let mut done = 0;
        while done < buf.len() {
            // Reserve window for one message.
            let n = {
                let mut st = s.st.lock().unwrap();
                loop {
                    if let Some(why) = st.reset.as_ref().or(st.tx_error.as_ref()) {
                        return if done > 0 {
                            Ok(done)
                        } else {
                            Err(reset_error(why))
                        };
                    }
                    if st.tx_shut {
                        return Err(io::Error::new(
                            io::ErrorKind::BrokenPipe,
                            "send after shutdown_send",
                        ));
                    }
                    let n = (st.tx_window as usize)
                        .min(buf.len() - done)
                        .min(self.max_payload);
                    if n > 0 {
                        st.tx_window -= n as u64;
                        break n;
                    }
                    if done > 0 {
                        return Ok(done);
                    }
                    st = s.cv.wait_timeout(st, RECHECK).unwrap().0;
                }
            };
            match link.send_data(s.id, &buf[done..done + n], done == 0) {
                Ok(true) => done += n,
                Ok(false) => {
                    s.st.lock().unwrap().tx_window += n as u64;
                    return Ok(done);
                }
                Err(e) => {
                    s.st.lock().unwrap().tx_window += n as u64;
                    return if done > 0 { Ok(done) } else { Err(e) };
                }
            }
        }
        Ok(done)
    }

    fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let s = &self.shared;
        let (n, grant) = {
            let mut st = s.st.lock().unwrap();
            loop {
                if let Some(why) = &st.reset {
                    return Err(reset_error(why));
                }
                if !st.rx.is_empty() {
                    let mut n = 0;
                    while n < buf.len() {
                        let off = st.rx_off;
                        let Some(front) = st.rx.front() else { break };
                        let k = (front.len() - off).min(buf.len() - n);
                        buf[n..n + k].copy_from_slice(&front[off..off + k]);
                        n += k;
                        if off + k == front.len() {
                            st.rx.pop_front();
                            st.rx_off = 0;
                        } else {
                            st.rx_off += k;
                        }
                    }
                    let grant = st.window.on_consumed(n as u64);
                    break (n, grant);
                }
                if st.rx_eof {
                    return Ok(0);
                }
                st = s.cv.wait_timeout(st, RECHECK).unwrap().0;
            }
        };
        if grant > 0 {
            if let Ok(link) = s.link() {
                link.post_control(Outgoing::new(Kind::Window, s.id, grant));
            }
        }
        Ok(n)
    }

    fn shutdown_send(&self) -> io::Result<()> {
        let s = &self.shared;
        let both_done = {
            let mut st = s.st.lock().unwrap();
            if st.tx_shut {
                return Ok(());
            }
            if let Some(why) = st.reset.as_ref().or(st.tx_error.as_ref()) {
                return Err(reset_error(why));
            }
            if st.tx_shut {
                return Ok(());
            }
            st.tx_shut = true;
            st.rx_eof
        };
        let link = s.link()?;
        link.post_control(Outgoing::new(Kind::Fin, s.id, 0));
        if both_done {
            link.forget(s.id);
        }
        Ok(())
    }

    fn direct(&self) -> Option<&dyn DirectLane> {
        Some(self)
    }

    fn reset(&self) {
        let s = &self.shared;
        {
            let mut st = s.st.lock().unwrap();
            if st.reset.is_some() {
                return;
            }
            st.reset = Some("stream reset locally".into());
            st.rx.clear();
            s.cv.notify_all();
        }
        if let Ok(link) = s.link() {
            link.post_control(Outgoing::new(Kind::Reset, s.id, 0));
            link.forget(s.id);
        }
    }
}

fn bad_input(m: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, m.to_string())
}

impl DirectLane for RdmaStream {
    unsafe fn register_rings(
        &self,
        tx: RingArea,
        rx: RingArea,
        on_placed: Box<dyn Fn(u64) + Send + Sync>,
    ) -> io::Result<(Vec<u8>, Box<dyn Send + Sync>)> {
        let s = &self.shared;
        let link = s.link()?;
        // SAFETY: the caller keeps both areas mapped until the returned
        // guard (which owns the registrations) is dropped.
        let (txr, rxr) = unsafe {
            (
                link.fabric().register(tx.ptr, tx.len, false)?,
                link.fabric().register(rx.ptr, rx.len, true)?,
            )
        };
        let desc = AreaDesc {
            addr: rxr.addr(),
            rkey: rxr.rkey(),
            len: rx.len as u64,
        };
        {
            let mut d = s.direct.lock().unwrap();
            d.tx = Some((txr.addr(), txr.lkey(), tx.len));
            d.on_placed = Some(on_placed);
        }
        let guard = RingsRegistration {
            shared: Arc::clone(s),
            _regs: vec![txr, rxr],
        };
        Ok((
            serde_json::to_vec(&desc).map_err(io::Error::other)?,
            Box::new(guard),
        ))
    }

    fn set_peer_ring(&self, desc: &[u8]) -> io::Result<usize> {
        let a: AreaDesc = serde_json::from_slice(desc)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        let len = usize::try_from(a.len).map_err(|_| bad_input("peer ring too large"))?;
        self.shared.direct.lock().unwrap().peer = Some((a.addr, a.rkey, len));
        Ok(len)
    }

    fn place(&self, pieces: &[Piece], notify: &[u8]) -> io::Result<()> {
        let s = &self.shared;
        let link = s.link()?;
        let writes = {
            let d = s.direct.lock().unwrap();
            let (Some((taddr, lkey, tlen)), Some((paddr, rkey, plen))) = (d.tx, d.peer) else {
                return Err(io::Error::new(
                    io::ErrorKind::NotConnected,
                    "rings not registered or peer ring unknown",
                ));
            };
            pieces
                .iter()
                .map(|p| {
                    if p.src + p.len > tlen || p.dst + p.len > plen || p.len > u32::MAX as usize {
                        return Err(bad_input("piece outside a ring"));
                    }
                    Ok(Write {
                        local: taddr + p.src as u64,
                        lkey,
                        remote: paddr + p.dst as u64,
                        rkey,
                        len: p.len as u32,
                    })
                })
                .collect::<io::Result<Vec<_>>>()?
        };
        if notify.len() > self.max_payload {
            return Err(bad_input("notification larger than a message"));
        }
        // The notification is stream bytes: it takes window like `send`.
        let n = notify.len() as u64;
        {
            let mut st = s.st.lock().unwrap();
            loop {
                if let Some(why) = st.reset.as_ref().or(st.tx_error.as_ref()) {
                    return Err(reset_error(why));
                }
                if st.tx_shut {
                    return Err(io::Error::new(
                        io::ErrorKind::BrokenPipe,
                        "place after shutdown_send",
                    ));
                }
                if st.tx_window >= n {
                    st.tx_window -= n;
                    break;
                }
                st = s.cv.wait_timeout(st, RECHECK).unwrap().0;
            }
        }
        let total: u64 = pieces.iter().map(|p| p.len as u64).sum();
        s.placing.fetch_add(total, Ordering::AcqRel);
        link.send_placed(s, &writes, notify, total)
            .inspect_err(|_| {
                s.placing.fetch_sub(total, Ordering::AcqRel);
                s.st.lock().unwrap().tx_window += n;
            })
    }

    fn checksums(&self) -> bool {
        self.shared.link().is_ok_and(|l| l.checksums())
    }
}

impl Drop for RdmaStream {
    /// Dropping a stream that is not closed both ways aborts it, so the peer
    /// never waits for bytes that will not come.
    fn drop(&mut self) {
        let clean = {
            let st = self.shared.st.lock().unwrap();
            st.reset.is_some() || (st.tx_shut && st.rx_eof)
        };
        if !clean {
            self.reset();
        } else if let Ok(link) = self.shared.link() {
            link.forget(self.shared.id);
        }
    }
}
