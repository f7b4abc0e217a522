//! The peer table: which destinations can be lane peers at all, published
//! by `flowlaned` in a small file next to its socket and read by the
//! preload library on every `connect` without a system call.
//!
//! A destination outside the table (another node without a lane, an
//! address outside every pod network) stays on TCP without a daemon round
//! trip; one inside it is asked about as before. The daemon lists its
//! node's pods' addresses (one per entry, full prefix) and, when its relay
//! runs, the pod CIDRs of the other nodes that offer a lane. After those
//! entries come the cluster's Service CIDRs (`--service-cidr`): a
//! destination in one of them is a Service IP ([`Verdict::Service`]), whose
//! backend only the node's conntrack table names once the connection is
//! made (docs/shm-lane.md, "Service IPs").
//!
//! Layout (little-endian 32-bit words, all read and written atomically):
//!
//! | word | meaning |
//! |---|---|
//! | 0 | [`MAGIC`] |
//! | 1 | [`VERSION`] |
//! | 2 | generation: a seqlock, odd while the daemon rewrites the table |
//! | 3 | number of entries |
//! | 4 | flags: [`FLAG_INCOMPLETE`] |
//! | 5 | number of Service entries, stored right after the entries (a reader that predates them ignores the word: Service IPs stay "not a peer" for it, as they were) |
//! | 16.. | entries of [`ENTRY_WORDS`] words: the address as IPv6 (IPv4 mapped to `::ffff:a.b.c.d`) in four big-endian words, then the prefix length (0..=128, of the IPv6 form) |
//!
//! The file is hostile input for its readers only in the sense that it is
//! never trusted to be well formed: a reader bounds the entry count by the
//! length it mapped, checks every prefix, and answers [`Verdict::Unknown`]
//! ("ask the daemon") for a torn, bad or unknown page, never reading out of
//! the mapping. The daemon never shrinks the file (a mapped file cut short
//! would raise SIGBUS in its readers); see docs/shm-lane.md, "The peer
//! table".

use std::io;
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicU32, Ordering};

/// "FLPT".
pub const MAGIC: u32 = 0x464c_5054;
/// The layout's version.
pub const VERSION: u32 = 1;
/// Bytes the daemon makes the file (the largest table it can publish).
pub const FILE_LEN: usize = 64 << 10;
/// Words of the header.
const HEADER_WORDS: usize = 16;
/// Words per entry.
pub const ENTRY_WORDS: usize = 5;
/// The daemon had more entries than fit: a destination not found is
/// "ask the daemon", not "TCP".
pub const FLAG_INCOMPLETE: u32 = 1;

const W_MAGIC: usize = 0;
const W_VERSION: usize = 1;
const W_GEN: usize = 2;
const W_COUNT: usize = 3;
const W_FLAGS: usize = 4;
const W_SERVICES: usize = 5;

/// How often a reader retries a table the daemon was rewriting.
const READ_ATTEMPTS: usize = 4;

/// The table's path for the daemon socket at `socket`.
pub fn path_for(socket: &Path) -> PathBuf {
    let mut p = socket.as_os_str().to_owned();
    p.push(".peers");
    PathBuf::from(p)
}

/// One destination prefix that can be a lane peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Entry {
    /// The address in IPv6 form (IPv4 mapped).
    pub addr: u128,
    /// Prefix length of the IPv6 form, 0..=128.
    pub prefix: u8,
}

impl Entry {
    /// `ip/prefix` (IPv4 prefixes 0..=32, IPv6 0..=128; longer ones are cut).
    pub fn new(ip: IpAddr, prefix: u8) -> Entry {
        let (addr, prefix) = match ip.to_canonical() {
            IpAddr::V4(v4) => (u128::from(v4.to_ipv6_mapped()), 96 + prefix.min(32)),
            IpAddr::V6(v6) => (u128::from(v6), prefix.min(128)),
        };
        Entry {
            addr: addr & mask(prefix),
            prefix,
        }
    }

    /// One address.
    pub fn host(ip: IpAddr) -> Entry {
        Entry::new(ip, 128)
    }

    /// Whether `ip` is inside this prefix.
    pub fn holds(&self, ip: IpAddr) -> bool {
        self.contains(ipv6_form(ip))
    }

    fn contains(&self, addr: u128) -> bool {
        addr & mask(self.prefix) == self.addr & mask(self.prefix)
    }
}

fn mask(prefix: u8) -> u128 {
    match prefix {
        0 => 0,
        p => u128::MAX << (128 - u32::from(p.min(128))),
    }
}

fn ipv6_form(ip: IpAddr) -> u128 {
    match ip.to_canonical() {
        IpAddr::V4(v4) => u128::from(v4.to_ipv6_mapped()),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

/// The most entries a table of `len` bytes holds.
pub fn capacity(len: usize) -> usize {
    (len / 4).saturating_sub(HEADER_WORDS) / ENTRY_WORDS
}

/// What the table says about a destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// It may be a lane peer: ask the daemon.
    Candidate,
    /// It cannot be one: plain TCP, nothing else to do.
    NotPeer,
    /// The table cannot say (being rewritten, malformed, another version):
    /// ask the daemon.
    Unknown,
    /// A Service IP (a cluster Service CIDR): ask the daemon with a service
    /// intent, and resolve the backend after connect.
    Service,
}

/// A table in memory: the words of a mapping (shared with the daemon).
#[derive(Clone, Copy)]
pub struct Table<'a> {
    words: &'a [AtomicU32],
}

impl<'a> Table<'a> {
    /// A table over `words` (the whole mapping).
    pub fn new(words: &'a [AtomicU32]) -> Table<'a> {
        Table { words }
    }

    fn word(&self, i: usize) -> Option<u32> {
        self.words.get(i).map(|w| w.load(Ordering::Relaxed))
    }

    /// Whether `ip` can be a lane peer. Lock-free, no system call; any
    /// inconsistency answers [`Verdict::Unknown`].
    pub fn lookup(&self, ip: IpAddr) -> Verdict {
        let addr = ipv6_form(ip);
        for _ in 0..READ_ATTEMPTS {
            let Some(gen) = self.words.get(W_GEN).map(|w| w.load(Ordering::Acquire)) else {
                return Verdict::Unknown;
            };
            if gen & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let verdict = self.scan(addr);
            // Seqlock: the words read above count only if the generation
            // did not move while they were read.
            fence(Ordering::Acquire);
            if self.word(W_GEN) == Some(gen) {
                return verdict.unwrap_or(Verdict::Unknown);
            }
        }
        Verdict::Unknown
    }

    /// One pass over the entries (`None`: the page is not a table this
    /// reader understands).
    fn scan(&self, addr: u128) -> Option<Verdict> {
        if self.word(W_MAGIC)? != MAGIC || self.word(W_VERSION)? != VERSION {
            return None;
        }
        let count = usize::try_from(self.word(W_COUNT)?).ok()?;
        let services = usize::try_from(self.word(W_SERVICES)?).ok()?;
        if count.checked_add(services)? > capacity(self.words.len() * 4) {
            return None;
        }
        // Service ranges first: they never hold a pod.
        if self.any_contains(count, services, addr)? {
            return Some(Verdict::Service);
        }
        if self.any_contains(0, count, addr)? {
            return Some(Verdict::Candidate);
        }
        if self.word(W_FLAGS)? & FLAG_INCOMPLETE != 0 {
            return Some(Verdict::Unknown);
        }
        Some(Verdict::NotPeer)
    }

    /// Whether one of the `n` entries from index `first` holds `addr`
    /// (`None`: a malformed entry).
    fn any_contains(&self, first: usize, n: usize, addr: u128) -> Option<bool> {
        for i in first..first + n {
            let base = HEADER_WORDS + i * ENTRY_WORDS;
            let mut a: u128 = 0;
            for k in 0..4 {
                a = (a << 32) | u128::from(self.word(base + k)?);
            }
            let prefix = u8::try_from(self.word(base + 4)?).ok()?;
            if prefix > 128 {
                return None;
            }
            if (Entry { addr: a, prefix }).contains(addr) {
                return Some(true);
            }
        }
        Some(false)
    }

    /// Rewrites the table (the daemon, the only writer) without Service
    /// ranges.
    pub fn publish(&self, entries: &[Entry]) {
        self.publish_with_services(entries, &[]);
    }

    /// Rewrites the table: `entries` (possible lane peers) and `services`
    /// (Service CIDRs). Services are written first (they are few and a
    /// missing one would cost a Service connection its lane); entries
    /// beyond the capacity are left out and the table marked incomplete.
    pub fn publish_with_services(&self, entries: &[Entry], services: &[Entry]) {
        let cap = capacity(self.words.len() * 4);
        if self.words.len() < HEADER_WORDS {
            return;
        }
        let s = services.len().min(cap);
        let n = entries.len().min(cap - s);
        let gen = self.words[W_GEN].load(Ordering::Relaxed);
        // Odd: readers that see it (or see it change) retry.
        let odd = gen | 1;
        let odd = if odd == gen { gen.wrapping_add(2) } else { odd };
        self.words[W_GEN].store(odd, Ordering::Relaxed);
        fence(Ordering::Release);
        self.words[W_MAGIC].store(MAGIC, Ordering::Relaxed);
        self.words[W_VERSION].store(VERSION, Ordering::Relaxed);
        self.words[W_COUNT].store(n as u32, Ordering::Relaxed);
        self.words[W_SERVICES].store(s as u32, Ordering::Relaxed);
        let flags = if n < entries.len() || s < services.len() {
            FLAG_INCOMPLETE
        } else {
            0
        };
        self.words[W_FLAGS].store(flags, Ordering::Relaxed);
        for (i, e) in entries[..n].iter().chain(&services[..s]).enumerate() {
            let base = HEADER_WORDS + i * ENTRY_WORDS;
            for k in 0..4 {
                let w = (e.addr >> (96 - 32 * k)) as u32;
                self.words[base + k].store(w, Ordering::Relaxed);
            }
            self.words[base + 4].store(u32::from(e.prefix.min(128)), Ordering::Relaxed);
        }
        self.words[W_GEN].store(odd.wrapping_add(1), Ordering::Release);
    }

    /// The table's generation (even when stable).
    pub fn generation(&self) -> u32 {
        self.word(W_GEN).unwrap_or(0)
    }
}

/// A shared mapping of a table file, read-only for the library,
/// read-write for the daemon. Never unmapped before it is dropped.
pub struct Mapped {
    ptr: *mut libc::c_void,
    len: usize,
}

// SAFETY: the mapping is only ever accessed through atomics (`Table`).
unsafe impl Send for Mapped {}
// SAFETY: as above.
unsafe impl Sync for Mapped {}

impl Mapped {
    /// The library's view: maps the table file read-only (at most
    /// [`FILE_LEN`] bytes of it, at least its header). The daemon never
    /// shrinks the file, so the mapping stays backed.
    pub fn open_read_only(path: &Path) -> io::Result<Mapped> {
        let f = std::fs::File::open(path)?;
        let len = usize::try_from(f.metadata()?.len())
            .unwrap_or(usize::MAX)
            .min(FILE_LEN);
        Self::map(&f, len, libc::PROT_READ)
    }

    /// The daemon's view: creates the file (mode 0644) or opens the one a
    /// previous daemon left, grows it to [`FILE_LEN`] if it is shorter
    /// (never shrinks it: readers may map it), and maps it read-write.
    pub fn create(path: &Path) -> io::Result<Mapped> {
        use std::os::unix::fs::OpenOptionsExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .open(path)?;
        if f.metadata()?.len() < FILE_LEN as u64 {
            f.set_len(FILE_LEN as u64)?;
        }
        Self::map(&f, FILE_LEN, libc::PROT_READ | libc::PROT_WRITE)
    }

    fn map(f: &std::fs::File, len: usize, prot: libc::c_int) -> io::Result<Mapped> {
        if len < HEADER_WORDS * 4 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "peer table file too short",
            ));
        }
        // SAFETY: a fresh shared mapping of an open file; the kernel picks
        // the address; the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapped { ptr, len })
    }

    /// The table in this mapping.
    pub fn table(&self) -> Table<'_> {
        // SAFETY: the mapping is `len` bytes, page aligned (so aligned for
        // u32), lives as long as `self`, and is only accessed atomically.
        let words =
            unsafe { std::slice::from_raw_parts(self.ptr as *const AtomicU32, self.len / 4) };
        Table::new(words)
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `map` mapped; no reference into it
        // outlives `self` (`table` borrows it).
        unsafe { libc::munmap(self.ptr, self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(n: usize) -> Vec<AtomicU32> {
        (0..n).map(|_| AtomicU32::new(0)).collect()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn hosts_and_prefixes_of_both_families() {
        let w = words(FILE_LEN / 4);
        let t = Table::new(&w);
        assert_eq!(t.lookup(ip("10.1.0.5")), Verdict::Unknown, "empty page");
        t.publish(&[
            Entry::host(ip("10.1.0.5")),
            Entry::new(ip("10.2.0.0"), 16),
            Entry::new(ip("fd00:1::"), 64),
        ]);
        assert_eq!(t.lookup(ip("10.1.0.5")), Verdict::Candidate);
        assert_eq!(t.lookup(ip("::ffff:10.1.0.5")), Verdict::Candidate);
        assert_eq!(t.lookup(ip("10.1.0.6")), Verdict::NotPeer);
        assert_eq!(t.lookup(ip("10.2.255.1")), Verdict::Candidate);
        assert_eq!(t.lookup(ip("10.3.0.1")), Verdict::NotPeer);
        assert_eq!(t.lookup(ip("fd00:1::9")), Verdict::Candidate);
        assert_eq!(t.lookup(ip("fd00:2::9")), Verdict::NotPeer);
        assert_eq!(t.lookup(ip("127.0.0.1")), Verdict::NotPeer);
        let g = t.generation();
        assert_eq!(g & 1, 0);
        t.publish(&[]);
        assert_eq!(t.generation(), g + 2);
        assert_eq!(t.lookup(ip("10.1.0.5")), Verdict::NotPeer);
    }

    #[test]
    fn a_torn_or_malformed_page_means_ask_the_daemon() {
        let w = words(FILE_LEN / 4);
        let t = Table::new(&w);
        t.publish(&[Entry::host(ip("10.1.0.5"))]);
        // Being rewritten.
        w[W_GEN].fetch_add(1, Ordering::Relaxed);
        assert_eq!(t.lookup(ip("10.9.9.9")), Verdict::Unknown);
        w[W_GEN].fetch_add(1, Ordering::Relaxed);
        assert_eq!(t.lookup(ip("10.9.9.9")), Verdict::NotPeer);
        // A count beyond the mapping.
        w[W_COUNT].store(u32::MAX, Ordering::Relaxed);
        assert_eq!(t.lookup(ip("10.9.9.9")), Verdict::Unknown);
        w[W_COUNT].store(1, Ordering::Relaxed);
        // A prefix no address has.
        w[HEADER_WORDS + 4].store(129, Ordering::Relaxed);
        assert_eq!(t.lookup(ip("10.9.9.9")), Verdict::Unknown);
        w[HEADER_WORDS + 4].store(128, Ordering::Relaxed);
        // Another layout.
        w[W_VERSION].store(VERSION + 1, Ordering::Relaxed);
        assert_eq!(t.lookup(ip("10.1.0.5")), Verdict::Unknown);
        // A mapping shorter than its header.
        let short = words(3);
        assert_eq!(Table::new(&short).lookup(ip("10.1.0.5")), Verdict::Unknown);
        Table::new(&short).publish(&[Entry::host(ip("10.1.0.5"))]);
        // Random words never panic.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..2000 {
            for w in w.iter().take(64) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                w.store(x as u32, Ordering::Relaxed);
            }
            w[W_MAGIC].store(MAGIC, Ordering::Relaxed);
            w[W_VERSION].store(VERSION, Ordering::Relaxed);
            let _ = t.lookup(ip("10.1.0.5"));
        }
    }

    #[test]
    fn service_ranges_follow_the_entries_and_older_readers_skip_them() {
        let w = words(FILE_LEN / 4);
        let t = Table::new(&w);
        t.publish_with_services(
            &[Entry::host(ip("10.1.0.5"))],
            &[Entry::new(ip("10.96.0.0"), 12)],
        );
        assert_eq!(t.lookup(ip("10.96.3.4")), Verdict::Service);
        assert_eq!(t.lookup(ip("10.1.0.5")), Verdict::Candidate);
        assert_eq!(t.lookup(ip("10.112.0.1")), Verdict::NotPeer);
        // What a reader without word 5 sees: the same table, no Services.
        let services = w[W_SERVICES].swap(0, Ordering::Relaxed);
        assert_eq!(t.lookup(ip("10.96.3.4")), Verdict::NotPeer);
        assert_eq!(t.lookup(ip("10.1.0.5")), Verdict::Candidate);
        // A Service count beyond the mapping is a page not understood.
        w[W_SERVICES].store(u32::MAX, Ordering::Relaxed);
        assert_eq!(t.lookup(ip("10.96.3.4")), Verdict::Unknown);
        w[W_SERVICES].store(services, Ordering::Relaxed);
        // Republished without Services.
        t.publish(&[Entry::host(ip("10.1.0.5"))]);
        assert_eq!(t.lookup(ip("10.96.3.4")), Verdict::NotPeer);
    }

    #[test]
    fn too_many_entries_mark_the_table_incomplete() {
        let w = words(HEADER_WORDS + 2 * ENTRY_WORDS);
        let t = Table::new(&w);
        t.publish(&[
            Entry::host(ip("10.0.0.1")),
            Entry::host(ip("10.0.0.2")),
            Entry::host(ip("10.0.0.3")),
        ]);
        assert_eq!(t.lookup(ip("10.0.0.2")), Verdict::Candidate);
        assert_eq!(t.lookup(ip("10.0.0.3")), Verdict::Unknown);
    }

    #[test]
    fn a_reader_never_sees_a_half_written_table() {
        let w = words(FILE_LEN / 4);
        let t = Table::new(&w);
        // Two tables of different lengths whose last entry is the same: a
        // torn read (count of one, entries of the other) could miss it.
        let both = Entry::host(ip("10.9.0.1"));
        let mut a: Vec<Entry> = (1..=199u8)
            .map(|i| Entry::host(ip(&format!("10.1.0.{i}"))))
            .collect();
        a.push(both);
        let mut b: Vec<Entry> = (1..=50u8)
            .map(|i| Entry::host(ip(&format!("10.2.0.{i}"))))
            .collect();
        b.push(both);
        t.publish(&a);
        std::thread::scope(|s| {
            s.spawn(|| {
                for i in 0..20_000 {
                    t.publish(if i % 2 == 0 { &b } else { &a });
                }
            });
            for _ in 0..20_000 {
                assert_ne!(t.lookup(ip("10.9.0.1")), Verdict::NotPeer);
                assert_ne!(t.lookup(ip("10.3.0.1")), Verdict::Candidate);
            }
        });
    }

    #[test]
    fn the_file_is_grown_never_shrunk_and_shared() {
        let dir = std::env::temp_dir().join(format!("peer-table-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = path_for(&dir.join("d.sock"));
        std::fs::write(&path, vec![0u8; FILE_LEN * 2]).unwrap();
        let w = Mapped::create(&path).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), FILE_LEN as u64 * 2);
        let r = Mapped::open_read_only(&path).unwrap();
        assert_eq!(r.table().lookup(ip("10.1.0.5")), Verdict::Unknown);
        w.table().publish(&[Entry::host(ip("10.1.0.5"))]);
        assert_eq!(r.table().lookup(ip("10.1.0.5")), Verdict::Candidate);
        assert_eq!(r.table().lookup(ip("10.1.0.6")), Verdict::NotPeer);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
