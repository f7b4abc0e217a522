//! Reads a brokered connection's progress straight from its shared region:
//! the free-running `tail` of each direction is the number of bytes its
//! producer has written, and `producer_closed` says it will write no more
//! (layout: `flowlane_lane::ring`). The daemon keeps one fd of each live
//! channel for this and reads with `pread` — no mapping, nothing to unmap —
//! so `flowlane status` shows live byte counts, and a connection whose ends
//! both closed is counted closed even if a process never reported. A
//! stock channel's connection is read through the mapping the daemon keeps
//! of it anyway (its offer word): its ends send no close report at all.

use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use flowlane_lane::region::Region;

/// Offsets of the two control blocks (client→server, server→client).
const CTL_OFFSET: [u64; 2] = [512, 1024];
/// `tail` is the first field of a control block.
const TAIL: u64 = 0;
/// `producer_closed` in the flags line (third 128-byte line, third u32).
const PRODUCER_CLOSED: u64 = 256 + 8;

/// What the daemon can see of one connection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    pub client_to_server: u64,
    pub server_to_client: u64,
    /// Both ends closed their sending side: nothing more will move.
    pub both_closed: bool,
}

#[derive(Debug)]
pub enum RingWatch {
    /// The channel's memfd, read with `pread`.
    File(File),
    /// A mapping the daemon keeps anyway (a stock channel's, for its offer
    /// word): read from memory, no system call, so finished stock
    /// connections can be looked for at every tick.
    Mapped(Arc<Region>),
}

impl RingWatch {
    pub fn new(memfd: OwnedFd) -> Self {
        RingWatch::File(File::from(memfd))
    }

    /// Whether reading it costs no system call.
    pub fn is_mapped(&self) -> bool {
        matches!(self, RingWatch::Mapped(_))
    }

    pub fn progress(&self) -> io::Result<Progress> {
        match self {
            RingWatch::File(file) => Self::read(file),
            RingWatch::Mapped(view) => {
                let (client_to_server, server_to_client, both_closed) = view.observe();
                Ok(Progress {
                    client_to_server,
                    server_to_client,
                    both_closed,
                })
            }
        }
    }

    /// One `pread` of both control blocks (a sweep reads every live
    /// connection, so one system call each matters).
    fn read(file: &File) -> io::Result<Progress> {
        const START: u64 = CTL_OFFSET[0];
        const LEN: usize = (CTL_OFFSET[1] - START) as usize + PRODUCER_CLOSED as usize + 4;
        let mut buf = [0u8; LEN];
        file.read_exact_at(&mut buf, START)?;
        let at = |off: u64| (off - START) as usize;
        let u64_at = |off: u64| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&buf[at(off)..at(off) + 8]);
            u64::from_ne_bytes(b)
        };
        let u32_at = |off: u64| {
            let mut b = [0u8; 4];
            b.copy_from_slice(&buf[at(off)..at(off) + 4]);
            u32::from_ne_bytes(b)
        };
        Ok(Progress {
            client_to_server: u64_at(CTL_OFFSET[0] + TAIL),
            server_to_client: u64_at(CTL_OFFSET[1] + TAIL),
            both_closed: u32_at(CTL_OFFSET[0] + PRODUCER_CLOSED) != 0
                && u32_at(CTL_OFFSET[1] + PRODUCER_CLOSED) != 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flowlane_lane::ring::{self, Side};
    use std::os::fd::AsFd;

    /// Cross-checks the offsets above against the ring implementation.
    #[test]
    fn progress_follows_the_ring_layout() {
        let len = ring::region_len_for(8192);
        let fd = crate::memfd::create_sealed("ring-watch-test", len as u64).unwrap();
        let region = flowlane_lane::region::Region::map_memfd(fd.as_fd(), len).unwrap();
        let watch = RingWatch::new(fd.try_clone().unwrap());
        assert_eq!(watch.progress().unwrap(), Progress::default());
        {
            let (mut ctx, mut crx) = region.endpoints(Side::Client);
            let (mut stx, _srx) = region.endpoints(Side::Server);
            assert_eq!(ctx.write(&[7u8; 1000]), 1000);
            assert_eq!(stx.write(&[9u8; 300]), 300);
            let mut buf = [0u8; 100];
            assert_eq!(crx.read(&mut buf), 100);
            let p = watch.progress().unwrap();
            assert_eq!(
                (p.client_to_server, p.server_to_client, p.both_closed),
                (1000, 300, false)
            );
            ctx.close();
            assert!(!watch.progress().unwrap().both_closed);
            stx.close();
            assert!(watch.progress().unwrap().both_closed);
            // A mapping sees the same words.
            let mapped = RingWatch::Mapped(region.clone());
            assert_eq!(mapped.progress().unwrap(), watch.progress().unwrap());
        }
    }
}
