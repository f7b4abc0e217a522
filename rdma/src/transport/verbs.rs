//! The verbs [`Fabric`]: one RC queue pair per link, messages moved with
//! RDMA WRITE WITH IMMEDIATE from a registered send ring into the peer's
//! registered receive ring, completions waited for on a completion channel.
//!
//! Through `sideway`, whose `rdma-mummy-sys` links a small static shim that
//! `dlopen`s `libibverbs.so.1` when the program starts: on a node without
//! rdma-core the program still starts, and [`VerbsProvider::open`] fails
//! with a clear error instead.

use std::{
    collections::hash_map::RandomState,
    hash::{BuildHasher, Hasher},
    io,
    net::Ipv6Addr,
    ptr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use memmap2::MmapMut;
use serde::{Deserialize, Serialize};
use sideway::ibverbs::{
    address::{AddressHandleAttribute, Gid},
    completion::{BasicCompletionQueue, CompletionChannel, CompletionQueue},
    device::{DeviceInfo, DeviceList},
    device_context::{DeviceContext, Mtu},
    memory_region::MemoryRegion,
    protection_domain::ProtectionDomain,
    queue_pair::{
        BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
        SetScatterGatherEntry, WorkRequestFlags,
    },
    AccessFlags,
};

use super::fabric::{Completion, Fabric, FabricProvider, Geometry, Registration, Write};
use crate::topology::RdmaLane;

const WR_SEND: u64 = 1;
const WR_RECV: u64 = 2;
/// Zero-copy writes: unsignaled (they complete with the message behind
/// them); only an error produces a completion for them.
const WR_PLACE: u64 = 3;
/// Writes one message may carry (a transfer cut at two ring wraps is 3).
const MAX_WRITES: u32 = 3;
/// Local ACK timeout exponent: a request unacknowledged for 4.096 µs x 2^18
/// (about 1.07 s) is retransmitted, `retry_cnt` times. NCCL's default
/// (NCCL_IB_TIMEOUT). The libibverbs examples' 14 (67 ms) retransmits
/// whenever the peer is briefly busy: on Soft-RoCE guests whose host was
/// loaded that meant thousands of duplicate requests per transfer, and this
/// kernel's rxe answered some of them by completing a write-with-immediate
/// twice or NAKing it as an invalid request, which fails the link. A dead
/// peer is found by the keep-alive and the control connection, not by this.
const ACK_TIMEOUT: u8 = 18;
/// Busy-poll this long after the last completion before sleeping on the
/// completion channel: back-to-back messages then cost no syscalls.
const SPIN: Duration = Duration::from_micros(50);

fn verr(what: &str, e: impl std::fmt::Display) -> io::Error {
    io::Error::other(format!("{what}: {e}"))
}

fn mtu_bytes(m: Mtu) -> u32 {
    match m {
        Mtu::Mtu256 => 256,
        Mtu::Mtu512 => 512,
        Mtu::Mtu1024 => 1024,
        Mtu::Mtu2048 => 2048,
        Mtu::Mtu4096 => 4096,
    }
}

fn mtu_from_bytes(b: u32) -> Mtu {
    match b {
        0..=256 => Mtu::Mtu256,
        257..=512 => Mtu::Mtu512,
        513..=1024 => Mtu::Mtu1024,
        1025..=2048 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    }
}

/// An opened RDMA device port with the GID the lane uses.
pub struct VerbsProvider {
    pd: Arc<ProtectionDomain>,
    ctx: Arc<DeviceContext>,
    device: String,
    port: u8,
    gid_index: u32,
    gid: Gid,
    lid: u16,
    mtu: Mtu,
}

impl VerbsProvider {
    /// Opens `device`, port `port`, and reads GID `gid_index`.
    pub fn open(device: &str, port: u32, gid_index: u32) -> io::Result<Self> {
        let port = u8::try_from(port).map_err(|_| verr("port", "out of range"))?;
        let list = DeviceList::new().map_err(|e| {
            verr(
                "listing RDMA devices (is rdma-core's libibverbs.so.1 installed?)",
                e,
            )
        })?;
        let dev = list.iter().find(|d| d.name() == device).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("RDMA device {device} not found"),
            )
        })?;
        let ctx = dev
            .open()
            .map_err(|e| verr(&format!("opening {device}"), e))?;
        let attr = ctx
            .query_port(port)
            .map_err(|e| verr(&format!("querying {device} port {port}"), e))?;
        let gid = ctx.query_gid(port, gid_index).map_err(|e| {
            verr(
                &format!("reading GID {gid_index} of {device} port {port}"),
                e,
            )
        })?;
        let pd = ctx
            .alloc_pd()
            .map_err(|e| verr("allocating a protection domain", e))?;
        Ok(VerbsProvider {
            pd,
            device: device.to_string(),
            port,
            gid_index,
            gid,
            lid: attr.lid(),
            mtu: attr.active_mtu(),
            ctx,
        })
    }

    /// Opens the device and GID that discovery chose, and checks the GID is
    /// still the one discovery saw (addresses can move).
    pub fn from_lane(lane: &RdmaLane) -> io::Result<Self> {
        let p = Self::open(&lane.device, lane.port, lane.gid_index)?;
        let have = Ipv6Addr::from(p.gid.raw);
        if have != lane.gid {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "GID {} of {} port {} is {have}, discovery chose {}",
                    lane.gid_index, lane.device, lane.port, lane.gid
                ),
            ));
        }
        Ok(p)
    }

    pub fn device(&self) -> &str {
        &self.device
    }

    /// The port's active MTU in bytes.
    pub fn active_mtu(&self) -> u32 {
        mtu_bytes(self.mtu)
    }
}

/// What a peer needs to reach our half.
#[derive(Debug, Serialize, Deserialize)]
struct HalfDesc {
    qpn: u32,
    psn: u32,
    gid: Ipv6Addr,
    lid: u16,
    mtu: u32,
    recv_addr: u64,
    rkey: u32,
}

/// Verbs resources of one link. Field order is drop order: the queue pair
/// goes before its completion queue, the queue before its channel, the
/// memory regions before the memory.
struct Resources {
    qp: Mutex<BasicQueuePair>,
    cq: Arc<BasicCompletionQueue>,
    channel: Arc<CompletionChannel>,
    send_mr: Arc<MemoryRegion>,
    recv_mr: Arc<MemoryRegion>,
    _send_mem: MmapMut,
    _recv_mem: MmapMut,
    /// Where zero-copy regions are registered (the provider's: one key
    /// works on every link of this device).
    pd: Arc<ProtectionDomain>,
}

pub struct VerbsHalf {
    res: Resources,
    psn: u32,
    geometry: Geometry,
}

fn random_psn() -> u32 {
    (RandomState::new().build_hasher().finish() & 0x00ff_ffff) as u32
}

impl FabricProvider for VerbsProvider {
    type Half = VerbsHalf;

    fn name(&self) -> &'static str {
        "rdma"
    }

    fn prepare(&self, g: Geometry) -> io::Result<(VerbsHalf, serde_json::Value)> {
        let ring = g.slots as usize * g.slot_size as usize;
        let mut send_mem = MmapMut::map_anon(ring)?;
        let mut recv_mem = MmapMut::map_anon(ring)?;
        // SAFETY: the mappings are `ring` bytes long and live in `Resources`
        // after the memory regions (dropped after them), so the NIC never
        // touches unmapped memory.
        let send_mr = unsafe {
            self.pd.reg_mr(
                send_mem.as_mut_ptr() as usize,
                ring,
                AccessFlags::LocalWrite,
            )
        }
        .map_err(|e| verr("registering the send ring", e))?;
        // SAFETY: as above.
        let recv_mr = unsafe {
            self.pd.reg_mr(
                recv_mem.as_mut_ptr() as usize,
                ring,
                AccessFlags::LocalWrite | AccessFlags::RemoteWrite,
            )
        }
        .map_err(|e| verr("registering the receive ring", e))?;
        let channel = self
            .ctx
            .create_comp_channel()
            .map_err(|e| verr("creating a completion channel", e))?;
        channel.set_nonblocking(true)?;
        let cq = self
            .ctx
            .create_cq_builder()
            .setup_cqe(2 * g.slots + 16)
            .setup_comp_channel(&channel, 0)
            .build()
            .map_err(|e| verr("creating a completion queue", e))?;
        let mut qp = self
            .pd
            .create_qp_builder()
            .setup_send_cq(Arc::clone(&cq))
            .setup_recv_cq(Arc::clone(&cq))
            .setup_max_send_wr((1 + MAX_WRITES) * g.slots + 8)
            .setup_max_recv_wr(g.slots + 8)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .build()
            .map_err(|e| verr("creating an RC queue pair", e))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(self.port)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
        qp.modify(&attr)
            .map_err(|e| verr("queue pair to INIT", e))?;
        // A write with immediate consumes one receive: one per slot.
        for _ in 0..g.slots {
            let mut guard = qp.start_post_recv();
            let _ = guard.construct_wr(WR_RECV);
            guard.post().map_err(|e| verr("posting a receive", e))?;
        }
        let psn = random_psn();
        let desc = HalfDesc {
            qpn: qp.qp_number(),
            psn,
            gid: Ipv6Addr::from(self.gid.raw),
            lid: self.lid,
            mtu: mtu_bytes(self.mtu),
            recv_addr: recv_mr.get_ptr() as u64,
            rkey: recv_mr.rkey(),
        };
        let res = Resources {
            qp: Mutex::new(qp),
            cq,
            channel,
            send_mr,
            recv_mr,
            _send_mem: send_mem,
            _recv_mem: recv_mem,
            pd: Arc::clone(&self.pd),
        };
        Ok((
            VerbsHalf {
                res,
                psn,
                geometry: g,
            },
            serde_json::to_value(desc).map_err(io::Error::other)?,
        ))
    }

    fn connect(&self, half: VerbsHalf, peer: &serde_json::Value) -> io::Result<Box<dyn Fabric>> {
        let peer: HalfDesc = serde_json::from_value(peer.clone())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        let mtu = mtu_from_bytes(peer.mtu.min(mtu_bytes(self.mtu)));
        {
            let mut qp = half.res.qp.lock().unwrap();
            let mut ah = AddressHandleAttribute::new();
            ah.setup_dest_lid(peer.lid)
                .setup_port(self.port)
                .setup_service_level(0)
                .setup_grh_src_gid_index(self.gid_index as u8)
                .setup_grh_dest_gid(&Gid::from(peer.gid))
                .setup_grh_hop_limit(64);
            let mut attr = QueuePairAttribute::new();
            attr.setup_state(QueuePairState::ReadyToReceive)
                .setup_path_mtu(mtu)
                .setup_dest_qp_num(peer.qpn)
                .setup_rq_psn(peer.psn)
                .setup_max_dest_read_atomic(1)
                .setup_min_rnr_timer(12)
                .setup_address_vector(&ah);
            qp.modify(&attr).map_err(|e| verr("queue pair to RTR", e))?;
            let mut attr = QueuePairAttribute::new();
            attr.setup_state(QueuePairState::ReadyToSend)
                .setup_sq_psn(half.psn)
                .setup_timeout(ACK_TIMEOUT)
                .setup_retry_cnt(7)
                .setup_rnr_retry(7)
                .setup_max_read_atomic(1);
            qp.modify(&attr).map_err(|e| verr("queue pair to RTS", e))?;
        }
        let res = half.res;
        let send_ptr = res.send_mr.get_ptr() as *mut u8;
        let recv_ptr = res.recv_mr.get_ptr() as *const u8;
        Ok(Box::new(VerbsFabric {
            send_ptr,
            recv_ptr,
            slot_size: half.geometry.slot_size as usize,
            slots: half.geometry.slots,
            remote_addr: peer.recv_addr,
            remote_rkey: peer.rkey,
            res,
        }))
    }
}

struct VerbsFabric {
    res: Resources,
    send_ptr: *mut u8,
    recv_ptr: *const u8,
    slot_size: usize,
    slots: u32,
    remote_addr: u64,
    remote_rkey: u32,
}

// SAFETY: the raw pointers point into the rings owned by `res` (alive as long
// as the fabric). The send ring is written only by `post`, which the link
// calls under its state lock, into a slot whose previous write completed
// (the credit accounting keeps fewer than `slots` messages in flight); the
// receive ring is read only by the link's poller, from a slot the peer will
// not write again until we return its credit. The verbs objects themselves
// are thread-safe (libibverbs locks internally); the queue pair is behind a
// mutex because sideway's posting API takes `&mut`.
unsafe impl Send for VerbsFabric {}
// SAFETY: see `Send` above.
unsafe impl Sync for VerbsFabric {}

fn status_name(s: u32) -> &'static str {
    match s {
        1 => "local length error",
        2 => "local QP operation error",
        4 => "local protection error",
        5 => "work request flushed",
        9 => "remote invalid request",
        10 => "remote access error",
        11 => "remote operation error",
        12 => "transport retry counter exceeded (peer unreachable)",
        13 => "RNR retry counter exceeded (peer not receiving)",
        _ => "error",
    }
}

impl VerbsFabric {
    /// Moves every available work completion into `out`.
    fn drain(&self, out: &mut Vec<Completion>) -> io::Result<usize> {
        let before = out.len();
        loop {
            let poller = match self.res.cq.start_poll() {
                Ok(p) => p,
                Err(
                    sideway::ibverbs::completion::PollCompletionQueueError::CompletionQueueEmpty,
                ) => break,
                Err(e) => return Err(verr("polling the completion queue", e)),
            };
            for wc in poller {
                let status = wc.status();
                if status != 0 {
                    out.push(Completion::Failed(format!(
                        "work completion status {status} ({}), vendor error {:#x}",
                        status_name(status),
                        wc.vendor_err()
                    )));
                    continue;
                }
                match wc.wr_id() {
                    WR_SEND => out.push(Completion::Sent),
                    WR_PLACE => {} // unsignaled; completes with its message
                    WR_RECV => out.push(Completion::Received {
                        imm: wc.imm_data(),
                        len: wc.byte_len(),
                    }),
                    other => out.push(Completion::Failed(format!(
                        "unknown work request id {other}"
                    ))),
                }
            }
        }
        Ok(out.len() - before)
    }

    /// Arms the completion notification: the next completion raises an
    /// event on the channel.
    fn arm(&self) -> io::Result<()> {
        // SAFETY: the CQ is alive (owned by `res`); arming it is allowed from
        // any thread.
        let rc = unsafe { rdma_mummy_sys::ibv_req_notify_cq(self.res.cq.cq().as_ptr(), 0) };
        if rc != 0 {
            return Err(verr(
                "arming completion notification",
                io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(())
    }

    fn wait_channel(&self, timeout: Duration) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let mut pfd = libc::pollfd {
            fd: self.res.channel.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: `pfd` is valid for the call; the fd belongs to the channel
        // owned by `res`.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted {
                Ok(())
            } else {
                Err(e)
            };
        }
        if n == 0 {
            return Ok(());
        }
        let mut cq: *mut rdma_mummy_sys::ibv_cq = ptr::null_mut();
        let mut ctx: *mut std::ffi::c_void = ptr::null_mut();
        // SAFETY: the channel is alive and non-blocking; on success the event
        // is acknowledged right away, as ibv_destroy_cq requires.
        unsafe {
            if rdma_mummy_sys::ibv_get_cq_event(
                self.res.channel.comp_channel().as_ptr(),
                &mut cq,
                &mut ctx,
            ) == 0
            {
                rdma_mummy_sys::ibv_ack_cq_events(cq, 1);
            }
        }
        Ok(())
    }
}

/// A registered zero-copy region.
struct VerbsRegistration(Arc<MemoryRegion>);

impl Registration for VerbsRegistration {
    fn addr(&self) -> u64 {
        self.0.get_ptr() as u64
    }
    fn lkey(&self) -> u32 {
        self.0.lkey()
    }
    fn rkey(&self) -> u32 {
        self.0.rkey()
    }
}

impl Fabric for VerbsFabric {
    unsafe fn register(
        &self,
        ptr: *mut u8,
        len: usize,
        remote_write: bool,
    ) -> io::Result<Box<dyn Registration>> {
        let access = if remote_write {
            AccessFlags::LocalWrite | AccessFlags::RemoteWrite
        } else {
            AccessFlags::none()
        };
        // SAFETY: the caller keeps the memory mapped until the registration
        // (which owns the MR) is dropped.
        let mr = unsafe { self.res.pd.reg_mr(ptr as usize, len, access) }.map_err(|e| {
            verr(
                "registering a ring with the NIC (memlock limit? the daemon needs RLIMIT_MEMLOCK unlimited or CAP_IPC_LOCK)",
                e,
            )
        })?;
        Ok(Box::new(VerbsRegistration(mr)))
    }

    fn post(
        &self,
        slot: u32,
        header: &[u8],
        payload: &[u8],
        imm: u32,
        writes: &[Write],
    ) -> io::Result<()> {
        let len = header.len() + payload.len();
        if writes.len() > MAX_WRITES as usize {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "too many writes for one message",
            ));
        }
        if slot >= self.slots || len > self.slot_size {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "bad slot or message length",
            ));
        }
        let off = slot as usize * self.slot_size;
        // SAFETY: `off + len` is within the send ring (checked above), and no
        // work request reads this slot now (see the `Send` impl).
        unsafe {
            let dst = self.send_ptr.add(off);
            ptr::copy_nonoverlapping(header.as_ptr(), dst, header.len());
            ptr::copy_nonoverlapping(payload.as_ptr(), dst.add(header.len()), payload.len());
        }
        let mut qp = self.res.qp.lock().unwrap();
        let mut guard = qp.start_post_send();
        for w in writes {
            let wr = guard
                .construct_wr(WR_PLACE, WorkRequestFlags::none())
                .setup_write(w.rkey, w.remote);
            // SAFETY: the SGE names registered memory whose owner keeps it
            // mapped and unchanged until this chain's message completes.
            unsafe { wr.setup_sge(w.lkey, w.local, w.len) };
        }
        let wr = guard
            .construct_wr(WR_SEND, WorkRequestFlags::Signaled)
            .setup_write_imm(self.remote_rkey, self.remote_addr + off as u64, imm);
        // SAFETY: the SGE names registered memory (the send MR) that stays
        // untouched until this request completes.
        unsafe {
            wr.setup_sge(
                self.res.send_mr.lkey(),
                self.send_ptr as u64 + off as u64,
                len as u32,
            )
        };
        guard.post().map_err(|e| verr("posting an RDMA write", e))
    }

    fn read_slot(&self, slot: u32, len: usize, f: &mut dyn FnMut(&[u8])) {
        let len = len.min(self.slot_size);
        let off = slot.min(self.slots - 1) as usize * self.slot_size;
        // SAFETY: within the receive ring; the peer does not write this slot
        // until its credit comes back, which happens after `f` returns.
        let bytes = unsafe { std::slice::from_raw_parts(self.recv_ptr.add(off), len) };
        f(bytes);
    }

    fn repost_recv(&self) -> io::Result<()> {
        let mut qp = self.res.qp.lock().unwrap();
        let mut guard = qp.start_post_recv();
        let _ = guard.construct_wr(WR_RECV);
        guard.post().map_err(|e| verr("posting a receive", e))
    }

    fn poll(&self, out: &mut Vec<Completion>, timeout: Duration) -> io::Result<()> {
        if self.drain(out)? > 0 {
            return Ok(());
        }
        let spin_until = Instant::now() + SPIN.min(timeout);
        while Instant::now() < spin_until {
            if self.drain(out)? > 0 {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        let deadline = Instant::now() + timeout;
        loop {
            self.arm()?;
            // Drain after arming, before sleeping: a completion that arrived
            // between the last drain and the arming raised no event, and
            // sleeping on the channel would leave it there for the whole
            // timeout (seen on the rig: placements completing after exactly
            // the poller's 100 ms). An event raised meanwhile only makes the
            // next sleep return at once.
            if self.drain(out)? > 0 {
                return Ok(());
            }
            self.wait_channel(deadline.saturating_duration_since(Instant::now()))?;
            if self.drain(out)? > 0 || Instant::now() >= deadline {
                return Ok(());
            }
        }
    }

    fn shutdown(&self) {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        if let Err(e) = self.res.qp.lock().unwrap().modify(&attr) {
            tracing::debug!(error = %e, "moving the queue pair to ERROR");
        }
    }
}
