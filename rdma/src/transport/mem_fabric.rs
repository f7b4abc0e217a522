//! An in-process [`Fabric`]: two halves in one process exchange messages
//! through memory, with the verbs' rules enforced (a write into a ring
//! without a posted receive is an error, as RNR would be, and so is a
//! message larger than a slot), so host tests catch credit bugs.

use std::{
    collections::{HashMap, VecDeque},
    io,
    sync::{
        atomic::{AtomicU32, AtomicU64, Ordering},
        Arc, Condvar, Mutex, OnceLock, Weak,
    },
    time::Duration,
};

use super::fabric::{Completion, Fabric, FabricProvider, Geometry, Registration, Write};

/// Halves waiting to be joined, by token.
fn registry() -> &'static Mutex<HashMap<u64, Weak<Endpoint>>> {
    static R: OnceLock<Mutex<HashMap<u64, Weak<Endpoint>>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

/// A registered range: address, length, whether peers may write into it.
type MemRegion = (usize, usize, bool);

/// Registered memory by key (lkey = rkey here), process-wide like a PD.
fn regions() -> &'static Mutex<HashMap<u32, MemRegion>> {
    static R: OnceLock<Mutex<HashMap<u32, MemRegion>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

struct MemRegistration {
    key: u32,
    addr: usize,
}

impl Registration for MemRegistration {
    fn addr(&self) -> u64 {
        self.addr as u64
    }
    fn lkey(&self) -> u32 {
        self.key
    }
    fn rkey(&self) -> u32 {
        self.key
    }
}

impl Drop for MemRegistration {
    fn drop(&mut self) {
        // Under the lock a write copies with: no copy into freed memory.
        regions().lock().unwrap().remove(&self.key);
    }
}

/// True when `[addr, addr + len)` lies in registration `key` (and that one
/// accepts remote writes when `remote`).
fn covered(table: &HashMap<u32, MemRegion>, key: u32, addr: u64, len: u32, remote: bool) -> bool {
    table.get(&key).is_some_and(|&(a, l, w)| {
        (!remote || w) && addr as usize >= a && addr as usize + len as usize <= a + l
    })
}

struct Endpoint {
    geometry: Geometry,
    ring: Vec<Mutex<Vec<u8>>>,
    state: Mutex<EndpointState>,
    cv: Condvar,
    peer: OnceLock<Weak<Endpoint>>,
}

#[derive(Default)]
struct EndpointState {
    completions: VecDeque<Completion>,
    posted_recvs: u32,
    broken: bool,
}

impl Endpoint {
    fn push(&self, c: Completion) {
        self.state.lock().unwrap().completions.push_back(c);
        self.cv.notify_all();
    }

    fn break_with(&self, why: &str) {
        let mut st = self.state.lock().unwrap();
        if !st.broken {
            st.broken = true;
            st.completions
                .push_back(Completion::Failed(why.to_string()));
        }
        self.cv.notify_all();
    }
}

/// Provider of in-process fabrics (for tests).
#[derive(Debug, Default, Clone, Copy)]
pub struct MemProvider;

pub struct MemHalf(Arc<Endpoint>);

impl FabricProvider for MemProvider {
    type Half = MemHalf;

    fn name(&self) -> &'static str {
        "mem"
    }

    fn prepare(&self, geometry: Geometry) -> io::Result<(MemHalf, serde_json::Value)> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let token = NEXT.fetch_add(1, Ordering::Relaxed);
        let ep = Arc::new(Endpoint {
            geometry,
            ring: (0..geometry.slots)
                .map(|_| Mutex::new(vec![0u8; geometry.slot_size as usize]))
                .collect(),
            state: Mutex::new(EndpointState {
                posted_recvs: geometry.slots,
                ..Default::default()
            }),
            cv: Condvar::new(),
            peer: OnceLock::new(),
        });
        registry()
            .lock()
            .unwrap()
            .insert(token, Arc::downgrade(&ep));
        Ok((MemHalf(ep), serde_json::json!({ "token": token })))
    }

    fn connect(&self, half: MemHalf, peer: &serde_json::Value) -> io::Result<Box<dyn Fabric>> {
        let token = peer["token"]
            .as_u64()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no mem fabric token"))?;
        let peer = registry()
            .lock()
            .unwrap()
            .remove(&token)
            .and_then(|w| w.upgrade())
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "peer half is gone"))?;
        if peer.geometry != half.0.geometry {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "geometry mismatch",
            ));
        }
        let _ = half.0.peer.set(Arc::downgrade(&peer));
        Ok(Box::new(MemFabric(half.0)))
    }
}

struct MemFabric(Arc<Endpoint>);

impl Drop for MemFabric {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Fabric for MemFabric {
    unsafe fn register(
        &self,
        ptr: *mut u8,
        len: usize,
        remote_write: bool,
    ) -> io::Result<Box<dyn Registration>> {
        static NEXT: AtomicU32 = AtomicU32::new(1);
        let key = NEXT.fetch_add(1, Ordering::Relaxed);
        regions()
            .lock()
            .unwrap()
            .insert(key, (ptr as usize, len, remote_write));
        Ok(Box::new(MemRegistration {
            key,
            addr: ptr as usize,
        }))
    }

    fn post(
        &self,
        slot: u32,
        header: &[u8],
        payload: &[u8],
        imm: u32,
        writes: &[Write],
    ) -> io::Result<()> {
        let me = &self.0;
        let len = header.len() + payload.len();
        if me.state.lock().unwrap().broken {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "fabric broken",
            ));
        }
        let Some(peer) = me.peer.get().and_then(Weak::upgrade) else {
            // Reported after the completions already queued (see below).
            me.push(Completion::Failed("peer gone".into()));
            return Ok(());
        };
        if slot >= me.geometry.slots || len > me.geometry.slot_size as usize {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "bad slot or length",
            ));
        }
        {
            let mut st = peer.state.lock().unwrap();
            if st.broken {
                // Like a write to a dead queue pair: accepted here, it fails
                // later, after the completions already queued.
                drop(st);
                me.push(Completion::Failed("peer broken".into()));
                return Ok(());
            }
            if st.posted_recvs == 0 {
                // What RNR retries exhausted would do on a real queue pair.
                drop(st);
                peer.break_with("write with no posted receive");
                me.break_with("receiver not ready");
                return Ok(());
            }
            if !writes.is_empty() {
                let table = regions().lock().unwrap();
                let bad = writes.iter().any(|w| {
                    !covered(&table, w.lkey, w.local, w.len, false)
                        || !covered(&table, w.rkey, w.remote, w.len, true)
                });
                if bad {
                    // What a real queue pair reports: a remote access error
                    // fails the connection on both sides.
                    drop(table);
                    drop(st);
                    peer.break_with("remote access error");
                    me.break_with("remote access error (write outside a registration)");
                    return Ok(());
                }
                for w in writes {
                    // SAFETY: both ranges lie in live registrations (checked
                    // under the table lock, which their drop takes first).
                    unsafe {
                        std::ptr::copy(w.local as *const u8, w.remote as *mut u8, w.len as usize)
                    };
                }
            }
            st.posted_recvs -= 1;
            let mut s = peer.ring[slot as usize].lock().unwrap();
            s[..header.len()].copy_from_slice(header);
            s[header.len()..len].copy_from_slice(payload);
            st.completions.push_back(Completion::Received {
                imm,
                len: len as u32,
            });
        }
        peer.cv.notify_all();
        me.push(Completion::Sent);
        Ok(())
    }

    fn read_slot(&self, slot: u32, len: usize, f: &mut dyn FnMut(&[u8])) {
        let s = self.0.ring[slot as usize].lock().unwrap();
        f(&s[..len]);
    }

    fn repost_recv(&self) -> io::Result<()> {
        let mut st = self.0.state.lock().unwrap();
        if st.posted_recvs >= self.0.geometry.slots {
            return Err(io::Error::other("more receives than slots"));
        }
        st.posted_recvs += 1;
        Ok(())
    }

    fn poll(&self, out: &mut Vec<Completion>, timeout: Duration) -> io::Result<()> {
        let st = self.0.state.lock().unwrap();
        let (mut st, _) = self
            .0
            .cv
            .wait_timeout_while(st, timeout, |s| s.completions.is_empty())
            .unwrap();
        out.extend(st.completions.drain(..));
        Ok(())
    }

    fn shutdown(&self) {
        self.0.break_with("shut down");
        // The peer learns it after what is already queued for it, as a real
        // queue pair reports a dead peer after the messages that arrived.
        if let Some(peer) = self.0.peer.get().and_then(Weak::upgrade) {
            peer.push(Completion::Failed("peer shut down".into()));
        }
    }
}
