//! Stock channels (docs/shm-lane.md, "Pre-created channels"): regions the
//! daemon made ahead, so that a connection between a client process and a
//! listener it already reached needs no round trip to the daemon at all.
//!
//! - A **client** keeps the stock it was granted per destination. A
//!   connect takes one region, marks its offer word "connecting", and after
//!   `connect` writes its source port there (`flowlane_lane::offer`).
//! - A **server** keeps the stock its claims were granted per listener
//!   address and client address. After `accept` it looks for an offer
//!   naming the peer's port among the stock made for the peer's address,
//!   and takes it with a compare-and-swap.
//!
//! The tables live in `state::Tables` (its spin lock, its fork handling):
//! nothing here maps, unmaps or makes a system call under that lock;
//! regions leave the tables first and are dropped outside.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flowlane_lane::client::Granted;
use flowlane_lane::offer::Offer;
use flowlane_lane::region::Region;

use crate::state;

/// Most stock a client asks for with one round trip to a destination.
const BATCH: u32 = 8;

/// A client that has this many channels left for a destination after a
/// take asks for more ahead (`stock-refill`), and a server that holds this
/// many for a listener and client address after a take fetches what it
/// does not hold yet (`stock-fetch`): the answers arrive while the
/// remaining ones are used, and no connection waits for the daemon.
pub const ASK_AHEAD_AT: usize = BATCH as usize / 2;

/// Whether a client sends `stock-refill` ahead (and so whether its server
/// fetches): a build-time switch, for measuring without it.
pub const REFILL_AHEAD: bool = true;

/// Destinations whose next batch size a client remembers.
const MAX_ASKED: usize = 64;

/// Most stock a client keeps per destination (the daemon's bound too).
const MAX_PER_DESTINATION: usize = 16;

/// Most stock a server keeps in all; the oldest go first.
const MAX_HELD: usize = 256;

/// A client uses stock at most this long after it got it; the daemon keeps
/// its copy longer, so every channel a client uses is still known there
/// when a server process that does not hold it yet asks.
const CLIENT_TTL: Duration = Duration::from_secs(30);

/// A server forgets stock it holds after this long (the daemon's TTL: no
/// client uses it later).
const SERVER_TTL: Duration = Duration::from_secs(60);

/// How long a server waits, per accepted connection, for a client that has
/// taken a stock channel to write its source port.
pub const OFFER_WAIT: Duration = Duration::from_millis(20);

/// Longest sleep on one connecting channel's word before the held stock
/// is looked through again.
const OFFER_WAIT_SLICE: Duration = Duration::from_millis(1);

/// The spinner of this process's waits for a connecting offer.
static OFFER_WAITS: crate::spin::Spinner = crate::spin::Spinner::new();

struct ClientEntry {
    dst: SocketAddr,
    id: u64,
    region: Arc<Region>,
    got: Instant,
}

struct HeldEntry {
    local: SocketAddr,
    client: IpAddr,
    id: u64,
    region: Arc<Region>,
    got: Instant,
    /// An accept waited for this channel's port in vain (its client's
    /// connect is stuck, or it died half way): not waited for again.
    waited_out: bool,
}

/// This process's stock (kept in `state::Tables`).
#[derive(Default)]
pub struct Stock {
    client: Vec<ClientEntry>,
    held: Vec<HeldEntry>,
    /// Per destination asked before: the batch to ask for next.
    asked: Vec<(SocketAddr, u32)>,
}

/// A stock channel taken for one connection.
pub struct Taken {
    pub id: u64,
    pub region: Arc<Region>,
    /// Stock of the same kind left after this take (a client's for the
    /// destination; a server's for the listener and the peer's address),
    /// counted under the same lock: below `ASK_AHEAD_AT`, ask for more.
    pub left: usize,
}

/// Maps granted channels (outside the lock); those that fail the region's
/// checks are dropped.
fn map_all(grants: Vec<Granted>) -> Vec<(u64, IpAddr, Arc<Region>)> {
    use std::os::fd::AsFd;
    grants
        .into_iter()
        .filter_map(|g| {
            let region = Region::map_memfd(g.channel.memfd.as_fd(), g.channel.len).ok()?;
            Some((g.channel.id, g.client, region))
        })
        .collect()
}

/// Client: how much stock to ask for with this intent to `dst`: none the
/// first time (a process that connects once, a command-line tool, costs
/// no stock at either end), then 1, 2, 4, up to a batch: a process gets
/// about as much as it has used.
pub fn want_for(dst: SocketAddr) -> u32 {
    state::with(|t| {
        let asked = &mut t.stock.asked;
        match asked.iter_mut().find(|(d, _)| *d == dst) {
            Some((_, next)) => {
                let want = *next;
                *next = (want * 2).min(BATCH);
                want
            }
            None => {
                if asked.len() >= MAX_ASKED {
                    asked.remove(0);
                }
                asked.push((dst, 1));
                0
            }
        }
    })
}

/// Client: keeps `grants` as stock for `dst`.
pub fn add_client(dst: SocketAddr, grants: Vec<Granted>) {
    if grants.is_empty() {
        return;
    }
    let mapped = map_all(grants);
    let now = Instant::now();
    let extra: Vec<Arc<Region>> = state::with(|t| {
        let s = &mut t.stock;
        let mut extra = Vec::new();
        for (id, _, region) in mapped {
            if s.client.iter().filter(|e| e.dst == dst).count() >= MAX_PER_DESTINATION {
                extra.push(region);
                continue;
            }
            s.client.push(ClientEntry {
                dst,
                id,
                region,
                got: now,
            });
        }
        extra
    });
    drop(extra);
}

/// Client: a stock channel for `dst`, taken for a connect (its offer word
/// says "connecting"). `None`: no stock left (ask the daemon).
pub fn take_for(dst: SocketAddr) -> Option<Taken> {
    let now = Instant::now();
    loop {
        let (found, expired) = state::with(|t| {
            let s = &mut t.stock;
            let mut expired = Vec::new();
            let mut i = 0;
            while i < s.client.len() {
                if now.saturating_duration_since(s.client[i].got) >= CLIENT_TTL {
                    expired.push(s.client.swap_remove(i).region);
                } else {
                    i += 1;
                }
            }
            let found = s
                .client
                .iter()
                .position(|e| e.dst == dst)
                .map(|i| s.client.swap_remove(i));
            let left = s.client.iter().filter(|e| e.dst == dst).count();
            (found.map(|e| (e, left)), expired)
        });
        drop(expired);
        let (e, left) = found?;
        // Not free: the daemon revoked it (its listener went away), or a
        // forked copy of this process took it. Either way not ours now.
        if e.region.offer_begin() {
            return Some(Taken {
                id: e.id,
                region: e.region,
                left,
            });
        }
    }
}

/// Server: keeps `grants` (answered to a claim on `local`).
pub fn add_held(local: SocketAddr, grants: Vec<Granted>) {
    if grants.is_empty() {
        return;
    }
    let mapped = map_all(grants);
    let now = Instant::now();
    let dropped: Vec<HeldEntry> = state::with(|t| {
        let s = &mut t.stock;
        for (id, client, region) in mapped {
            s.held.push(HeldEntry {
                local,
                client,
                id,
                region,
                got: now,
                waited_out: false,
            });
        }
        let over = s.held.len().saturating_sub(MAX_HELD);
        s.held.drain(..over).collect()
    });
    drop(dropped);
}

/// Server: what one look through the held stock found.
enum Look {
    Found(Taken),
    /// Nothing offered for this connection yet, but a client from the
    /// peer's address is between taking a channel and writing its port.
    Wait(u64, Arc<Region>),
    Nothing,
}

fn look(local: SocketAddr, peer: SocketAddr) -> Look {
    let now = Instant::now();
    let (look, spent) = state::with(|t| {
        let held = &mut t.stock.held;
        let mut spent = Vec::new();
        let mut waiting = None;
        let mut i = 0;
        while i < held.len() {
            let e = &held[i];
            if now.saturating_duration_since(e.got) >= SERVER_TTL {
                spent.push(held.swap_remove(i));
                continue;
            }
            if e.local != local || e.client != peer.ip() {
                i += 1;
                continue;
            }
            match e.region.offer() {
                Offer::Offered(port) if port == peer.port() && e.region.offer_take(port) => {
                    let e = held.swap_remove(i);
                    let left = held
                        .iter()
                        .filter(|h| h.local == local && h.client == peer.ip())
                        .count();
                    return (
                        Look::Found(Taken {
                            id: e.id,
                            region: e.region,
                            left,
                        }),
                        spent,
                    );
                }
                // Used, given up, or written out of protocol: never again.
                Offer::Taken | Offer::Dead | Offer::Invalid => {
                    spent.push(held.swap_remove(i));
                    continue;
                }
                Offer::Connecting { fresh: true } if waiting.is_none() && !e.waited_out => {
                    waiting = Some((e.id, e.region.clone()));
                }
                _ => {}
            }
            i += 1;
        }
        let look = match waiting {
            Some((id, region)) => Look::Wait(id, region),
            None => Look::Nothing,
        };
        (look, spent)
    });
    drop(spent);
    look
}

/// Server: the stock channel a client offered for the connection accepted
/// on `local` from `peer`, waiting (at most `OFFER_WAIT` in all) for
/// clients from that address that have taken a channel but not written
/// their port yet.
pub fn take_offer(local: SocketAddr, peer: SocketAddr) -> Option<Taken> {
    let deadline = Instant::now() + OFFER_WAIT;
    loop {
        match look(local, peer) {
            Look::Found(t) => return Some(t),
            Look::Nothing => return None,
            Look::Wait(id, region) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    waited_out(id);
                    return None;
                }
                // The accept usually returns while the client's connect is
                // still returning: its port follows within microseconds,
                // sooner than a futex sleep and wake-up (the process's
                // spinner stops spinning where that does not pay). The
                // sleep is in slices: the word waited on may be another
                // connection's, and this one's is written elsewhere.
                let offered = || !matches!(region.offer(), Offer::Connecting { .. });
                if !OFFER_WAITS.spin(offered) {
                    region.offer_wait(left.min(OFFER_WAIT_SLICE));
                }
            }
        }
    }
}

fn waited_out(id: u64) {
    state::with(|t| {
        if let Some(e) = t.stock.held.iter_mut().find(|e| e.id == id) {
            e.waited_out = true;
        }
    })
}

/// Server: whether this process holds any stock for `local` (a process
/// without any skips the look).
pub fn holds_for(local: SocketAddr) -> bool {
    state::with(|t| t.stock.held.iter().any(|e| e.local == local))
}

impl Stock {
    /// In a forked child (from the fork handler, which may neither unmap
    /// nor free): the parent's stock is the parent's. The child forgets
    /// its copies of the mappings (they stay mapped in the child, unused)
    /// rather than share offers with the parent.
    pub fn forget_after_fork(&mut self) {
        std::mem::forget(std::mem::take(&mut self.client));
        std::mem::forget(std::mem::take(&mut self.held));
        std::mem::forget(std::mem::take(&mut self.asked));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flowlane_lane::client::Channel;
    use flowlane_lane::region::sealed_memfd;
    use flowlane_lane::ring::region_len_for;
    use std::os::fd::AsFd;

    /// A grant as a claim answers it, and the client's own mapping of it.
    fn grant(id: u64, client: &str) -> (Granted, Arc<Region>) {
        let len = region_len_for(4096);
        let memfd = sealed_memfd(len).unwrap();
        let client_view = Region::map_memfd(memfd.as_fd(), len).unwrap();
        let g = Granted {
            channel: Channel { id, memfd, len },
            client: client.parse().unwrap(),
        };
        (g, client_view)
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_client_asks_for_no_stock_the_first_time_then_for_more_and_more() {
        let dst = addr("10.9.0.1:443");
        let wants: Vec<u32> = (0..6).map(|_| want_for(dst)).collect();
        assert_eq!(wants, [0, 1, 2, 4, 8, 8]);
        assert_eq!(want_for(addr("10.9.0.1:444")), 0, "per destination");
    }

    // One test: the tables are process-wide.
    #[test]
    fn a_server_takes_only_the_offer_for_the_connection_it_accepted() {
        let local = addr("10.1.0.2:80");
        let (g1, c1) = grant(1, "10.1.0.3");
        let (g2, c2) = grant(2, "10.1.0.3");
        let (g3, c3) = grant(3, "10.1.0.4");
        add_held(local, vec![g1, g2, g3]);
        assert!(holds_for(local));
        assert!(!holds_for(addr("10.1.0.2:81")));
        // Nothing offered: no channel, no wait.
        assert!(take_offer(local, addr("10.1.0.3:5000")).is_none());
        // Pod .4 offers port 5000: a connection from .3:5000 is not its.
        assert!(c3.offer_begin());
        c3.offer_port(5000);
        assert!(take_offer(local, addr("10.1.0.3:5000")).is_none());
        // Another listener's connection from .4:5000 is not its either.
        assert!(take_offer(addr("10.1.0.2:81"), addr("10.1.0.4:5000")).is_none());
        assert_eq!(
            take_offer(local, addr("10.1.0.4:5000")).map(|t| t.id),
            Some(3)
        );
        assert_eq!(c3.offer(), Offer::Taken);
        // A word out of protocol drops the channel; a fresh "connecting"
        // one is waited for until the port arrives.
        assert!(c1.offer_begin());
        c1.offer_abandon();
        assert!(c2.offer_begin());
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            c2.offer_port(6000);
            c2
        });
        let got = take_offer(local, addr("10.1.0.3:6000")).map(|t| t.id);
        let c2 = writer.join().unwrap();
        assert_eq!(got, Some(2));
        assert_eq!(c2.offer(), Offer::Taken);
        assert!(!holds_for(local), "every channel used or dropped");
        // A client that took a channel and never wrote its port costs at
        // most the wait, once.
        let (g4, c4) = grant(4, "10.1.0.3");
        add_held(local, vec![g4]);
        assert!(c4.offer_begin());
        let t0 = Instant::now();
        assert!(take_offer(local, addr("10.1.0.3:7000")).is_none());
        assert!(t0.elapsed() >= OFFER_WAIT);
        let t1 = Instant::now();
        assert!(take_offer(local, addr("10.1.0.3:7001")).is_none());
        assert!(
            t1.elapsed() < OFFER_WAIT,
            "waited for the same channel twice"
        );
        // Two clients connecting at once: the wait is on the first one's
        // word (stuck), the port arrives in the second one's. The accept
        // finds it all the same (within a slice of its wait).
        let (g5, c5) = grant(5, "10.1.0.3");
        let (g6, c6) = grant(6, "10.1.0.3");
        add_held(local, vec![g5, g6]);
        assert!(c5.offer_begin());
        assert!(c6.offer_begin());
        let t2 = Instant::now();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(2));
            c6.offer_port(8000);
            (c6, Instant::now())
        });
        let got = take_offer(local, addr("10.1.0.3:8000")).map(|t| t.id);
        let (c6, written) = writer.join().unwrap();
        // Only a writer held up past the whole wait (a stalled machine)
        // excuses a miss.
        if written < t2 + OFFER_WAIT {
            assert_eq!(got, Some(6), "the port written in another word was missed");
            assert_eq!(c6.offer(), Offer::Taken);
        }
        drop(c5);
    }
}
