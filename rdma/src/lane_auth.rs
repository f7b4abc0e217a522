//! Who may speak on the lane port: only daemons of this cluster's nodes.
//!
//! Both transports (the relay's `tcp-test` double: one TCP connection per
//! stream; RDMA: the TCP set-up connection of a link) run this module on a
//! fresh TCP connection before any byte of their own protocol:
//!
//! 1. **Node table** ([`LaneAuth::admit`]): the accepting side checks the
//!    connection's source address against the node table (a [`PeerFilter`]:
//!    the daemon's static `--nodes-file` or Kubernetes view) before reading
//!    a single byte. A stranger's connection is closed unread.
//! 2. **Shared-key challenge/response**, mutual, with nonces from both
//!    sides (32 bytes each, from the OS RNG); the initiator proves first, so
//!    the listening side never computes a MAC for a party that has not
//!    shown the key:
//!
//! ```text
//! initiator -> responder   "FLA1" nonce_i[32]        (36 bytes)
//! responder -> initiator   "FLA1" nonce_r[32]        (36 bytes)
//! initiator -> responder   mac_i[32]                 HMAC-SHA256(key, T("initiator"))
//! responder -> initiator   mac_r[32]                 HMAC-SHA256(key, T("responder")),
//!                                                    only after mac_i checked out
//! T(role) = "flowlane lane auth v1 " role || nonce_i || nonce_r
//!           || initiator address || responder address    (each: 16-byte IPv6 form, u16-be port)
//! ```
//!
//! The MAC binds both nonces (a recorded transcript fails against a fresh
//! nonce: no replay), the role (a side's own proof sent back to it fails:
//! no reflection) and both TCP endpoints as each side sees them (a proof
//! made for one connection fails on another). MACs are compared in constant
//! time (`ring::hmac::verify`). Every message has a fixed length, so no
//! length from the peer is ever trusted; the whole exchange runs under one
//! deadline ([`AUTH_TIMEOUT`]), so a peer that trickles bytes or stalls is
//! cut off, and a failure answers nothing (the connection is just closed).
//!
//! What this does not give: confidentiality or integrity of what follows on
//! the wire. After the handshake the transports' bytes (pod payload, stream
//! keys, RDMA queue-pair parameters) travel in the clear; see
//! `docs/security.md`.

use std::fmt;
use std::fs;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

/// Shortest key accepted: 32 bytes (256 bits when random).
pub const MIN_KEY_LEN: usize = 32;
/// Longest key file accepted.
pub const MAX_KEY_LEN: usize = 4096;
/// The whole handshake must finish within this.
pub const AUTH_TIMEOUT: Duration = Duration::from_secs(2);

const MAGIC: &[u8; 4] = b"FLA1";
const NONCE_LEN: usize = 32;
const HELLO_LEN: usize = MAGIC.len() + NONCE_LEN;
const MAC_LEN: usize = 32;
const LABEL: &[u8] = b"flowlane lane auth v1 ";

/// Why a key could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("lane key file {path}: {source}")]
    Read { path: String, source: io::Error },
    #[error("lane key file {path} is not a regular file")]
    NotAFile { path: String },
    #[error("lane key file {path} is readable or writable by group or others (mode {mode:o}); it must be 0400 or 0600 (Kubernetes: the Secret volume's defaultMode: 0400)")]
    TooOpen { path: String, mode: u32 },
    #[error("lane key{at} is empty")]
    Empty { at: String },
    #[error("lane key{at} is too short ({len} bytes, at least {MIN_KEY_LEN}: e.g. `head -c 32 /dev/urandom | base64`)")]
    TooShort { at: String, len: usize },
    #[error("lane key{at} is too long ({len} bytes, at most {MAX_KEY_LEN})")]
    TooLong { at: String, len: usize },
}

/// The cluster's shared lane key. Its bytes are never printed.
#[derive(Clone)]
pub struct LaneKey(hmac::Key);

impl fmt::Debug for LaneKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LaneKey(..)")
    }
}

impl LaneKey {
    /// A key from its bytes (trailing whitespace, e.g. a newline, is not
    /// part of it), at least [`MIN_KEY_LEN`] long.
    pub fn from_bytes(bytes: &[u8]) -> Result<LaneKey, KeyError> {
        Self::checked(bytes, String::new())
    }

    fn checked(bytes: &[u8], at: String) -> Result<LaneKey, KeyError> {
        let end = bytes
            .iter()
            .rposition(|b| !b.is_ascii_whitespace())
            .map_or(0, |i| i + 1);
        let key = &bytes[..end];
        match key.len() {
            0 => Err(KeyError::Empty { at }),
            n if n < MIN_KEY_LEN => Err(KeyError::TooShort { at, len: n }),
            n if n > MAX_KEY_LEN => Err(KeyError::TooLong { at, len: n }),
            _ => Ok(LaneKey(hmac::Key::new(hmac::HMAC_SHA256, key))),
        }
    }

    /// Reads the key from `path` (a mounted Kubernetes Secret follows its
    /// symlinks): a regular file, not accessible to group or others, holding
    /// [`MIN_KEY_LEN`]..=[`MAX_KEY_LEN`] bytes.
    pub fn from_file(path: &Path) -> Result<LaneKey, KeyError> {
        let shown = path.display().to_string();
        let read_err = |source| KeyError::Read {
            path: shown.clone(),
            source,
        };
        let meta = fs::metadata(path).map_err(read_err)?;
        if !meta.is_file() {
            return Err(KeyError::NotAFile { path: shown });
        }
        let mode = meta.permissions().mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(KeyError::TooOpen { path: shown, mode });
        }
        let mut bytes = Vec::new();
        fs::File::open(path)
            .and_then(|f| f.take(MAX_KEY_LEN as u64 + 64).read_to_end(&mut bytes))
            .map_err(read_err)?;
        Self::checked(&bytes, format!(" in {shown}"))
    }
}

/// Which source addresses are daemons of this cluster's nodes (the node
/// table's underlay addresses).
pub trait PeerFilter: Send + Sync {
    fn is_node(&self, ip: IpAddr) -> bool;
}

impl<F: Fn(IpAddr) -> bool + Send + Sync> PeerFilter for F {
    fn is_node(&self, ip: IpAddr) -> bool {
        self(ip)
    }
}

/// Why a peer was refused.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The connection's source is not a node of the node table.
    #[error("{0} is not a node of the node table")]
    NotANode(IpAddr),
    /// The peer did not prove it holds the key (wrong key, replayed or
    /// reflected transcript, not a lane peer at all).
    #[error("the peer did not prove the lane key: {0}")]
    BadProof(&'static str),
    /// The connection failed, ended or stalled during the handshake.
    #[error("lane handshake: {0}")]
    Io(#[from] io::Error),
}

impl AuthError {
    /// The counter this refusal goes to: `peer_unknown` (not in the node
    /// table) or `peer_auth_failed` (everything else).
    pub fn counter(&self) -> &'static str {
        match self {
            AuthError::NotANode(_) => PEER_UNKNOWN,
            _ => PEER_AUTH_FAILED,
        }
    }
}

impl From<AuthError> for io::Error {
    fn from(e: AuthError) -> io::Error {
        match e {
            AuthError::Io(e) => e,
            other => io::Error::new(io::ErrorKind::PermissionDenied, other.to_string()),
        }
    }
}

/// Error counter names the transports report ([`crate::LaneTransport::error_counts`]).
pub const PEER_UNKNOWN: &str = "peer_unknown";
pub const PEER_AUTH_FAILED: &str = "peer_auth_failed";

/// The lane's admission policy: the key and the node table.
#[derive(Clone)]
pub struct LaneAuth {
    key: LaneKey,
    peers: Arc<dyn PeerFilter>,
    timeout: Duration,
}

impl fmt::Debug for LaneAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LaneAuth")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// Connects to a peer's lane port from `listen`'s address when that is a
/// specific one (the node's underlay address, which the peer checks against
/// its node table), so a multi-homed node's route cannot pick another
/// source; from any address otherwise.
pub fn connect_from(
    listen: SocketAddr,
    peer: SocketAddr,
    timeout: Duration,
) -> io::Result<TcpStream> {
    let ip = listen.ip();
    if ip.is_unspecified() || ip.is_ipv4() != peer.ip().is_ipv4() {
        return TcpStream::connect_timeout(&peer, timeout);
    }
    let sock = socket2::Socket::new(
        socket2::Domain::for_address(peer),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    sock.bind(&SocketAddr::new(ip, 0).into())?;
    sock.connect_timeout(&peer.into(), timeout)?;
    Ok(sock.into())
}

/// Canonical (IPv4-mapped) address in 16 bytes, then the port.
fn encode_addr(out: &mut Vec<u8>, a: SocketAddr) {
    let v6 = match a.ip().to_canonical() {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    out.extend_from_slice(&v6.octets());
    out.extend_from_slice(&a.port().to_be_bytes());
}

/// Reads exactly `buf.len()` bytes by `deadline` (each read gets only the
/// time left, so trickled bytes cannot stretch the wait).
fn read_exact_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the peer stalled in the lane handshake",
            ));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the peer closed inside the lane handshake",
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the peer stalled in the lane handshake",
                ))
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn write_all_by(s: &mut TcpStream, buf: &[u8], deadline: Instant) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    s.set_write_timeout(Some(left.max(Duration::from_millis(1))))?;
    s.write_all(buf)
}

impl LaneAuth {
    pub fn new(key: LaneKey, peers: Arc<dyn PeerFilter>) -> LaneAuth {
        LaneAuth {
            key,
            peers,
            timeout: AUTH_TIMEOUT,
        }
    }

    /// The same with another handshake deadline (tests).
    pub fn with_timeout(mut self, timeout: Duration) -> LaneAuth {
        self.timeout = timeout;
        self
    }

    /// Step 1 on the accepting side: `from` (the connection's source
    /// address) must be a node of the node table.
    pub fn admit(&self, from: SocketAddr) -> Result<(), AuthError> {
        let ip = from.ip().to_canonical();
        if self.peers.is_node(ip) {
            Ok(())
        } else {
            Err(AuthError::NotANode(ip))
        }
    }

    fn transcript(
        &self,
        role: &[u8],
        ni: &[u8],
        nr: &[u8],
        initiator: SocketAddr,
        responder: SocketAddr,
    ) -> Vec<u8> {
        let mut t = Vec::with_capacity(LABEL.len() + role.len() + 2 * NONCE_LEN + 36);
        t.extend_from_slice(LABEL);
        t.extend_from_slice(role);
        t.extend_from_slice(ni);
        t.extend_from_slice(nr);
        encode_addr(&mut t, initiator);
        encode_addr(&mut t, responder);
        t
    }

    fn mac(&self, transcript: &[u8]) -> hmac::Tag {
        hmac::sign(&self.key.0, transcript)
    }

    fn verify(&self, transcript: &[u8], tag: &[u8]) -> Result<(), AuthError> {
        hmac::verify(&self.key.0, transcript, tag)
            .map_err(|_| AuthError::BadProof("its proof does not match"))
    }

    fn nonce() -> Result<[u8; NONCE_LEN], AuthError> {
        let mut n = [0u8; NONCE_LEN];
        SystemRandom::new().fill(&mut n).map_err(|_| {
            AuthError::Io(io::Error::other("the OS random number generator failed"))
        })?;
        Ok(n)
    }

    /// The side that opened `sock`: proves the key, then checks the peer's
    /// proof. Leaves the socket's timeouts unset.
    pub fn initiate(&self, sock: &mut TcpStream) -> Result<(), AuthError> {
        let deadline = Instant::now() + self.timeout;
        let (me, peer) = (sock.local_addr()?, sock.peer_addr()?);
        let ni = Self::nonce()?;
        let mut hello = [0u8; HELLO_LEN];
        hello[..4].copy_from_slice(MAGIC);
        hello[4..].copy_from_slice(&ni);
        write_all_by(sock, &hello, deadline)?;
        let mut challenge = [0u8; HELLO_LEN];
        read_exact_by(sock, &mut challenge, deadline)?;
        if &challenge[..4] != MAGIC {
            return Err(AuthError::BadProof("not a lane peer (bad magic)"));
        }
        let nr = &challenge[4..];
        if nr == ni {
            return Err(AuthError::BadProof("the peer echoed our nonce"));
        }
        let proof = self.mac(&self.transcript(b"initiator", &ni, nr, me, peer));
        write_all_by(sock, proof.as_ref(), deadline)?;
        let mut theirs = [0u8; MAC_LEN];
        read_exact_by(sock, &mut theirs, deadline)?;
        self.verify(&self.transcript(b"responder", &ni, nr, me, peer), &theirs)?;
        sock.set_read_timeout(None)?;
        sock.set_write_timeout(None)?;
        Ok(())
    }

    /// The accepting side, after [`LaneAuth::admit`]: checks the peer's
    /// proof, then proves the key. Leaves the socket's timeouts unset.
    pub fn respond(&self, sock: &mut TcpStream) -> Result<(), AuthError> {
        let deadline = Instant::now() + self.timeout;
        let (me, peer) = (sock.local_addr()?, sock.peer_addr()?);
        let mut hello = [0u8; HELLO_LEN];
        read_exact_by(sock, &mut hello, deadline)?;
        if &hello[..4] != MAGIC {
            return Err(AuthError::BadProof("not a lane peer (bad magic)"));
        }
        let ni = &hello[4..];
        let nr = Self::nonce()?;
        let mut challenge = [0u8; HELLO_LEN];
        challenge[..4].copy_from_slice(MAGIC);
        challenge[4..].copy_from_slice(&nr);
        write_all_by(sock, &challenge, deadline)?;
        let mut theirs = [0u8; MAC_LEN];
        read_exact_by(sock, &mut theirs, deadline)?;
        self.verify(&self.transcript(b"initiator", ni, &nr, peer, me), &theirs)?;
        let proof = self.mac(&self.transcript(b"responder", ni, &nr, peer, me));
        write_all_by(sock, proof.as_ref(), deadline)?;
        sock.set_read_timeout(None)?;
        sock.set_write_timeout(None)?;
        Ok(())
    }

    /// The accepting side in full: [`LaneAuth::admit`] on the source
    /// address, then [`LaneAuth::respond`].
    pub fn accept(&self, sock: &mut TcpStream) -> Result<(), AuthError> {
        self.admit(sock.peer_addr()?)?;
        self.respond(sock)
    }

    /// For attack tests: the initiator's proof for a connection from
    /// `initiator` to `responder` with these nonces (what a peer holding
    /// the key would send).
    #[doc(hidden)]
    pub fn initiator_proof(
        &self,
        ni: &[u8],
        nr: &[u8],
        initiator: SocketAddr,
        responder: SocketAddr,
    ) -> Vec<u8> {
        self.mac(&self.transcript(b"initiator", ni, nr, initiator, responder))
            .as_ref()
            .to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    const KEY: &[u8] = b"0123456789abcdef0123456789abcdef-test-key";

    fn auth(key: &[u8]) -> LaneAuth {
        LaneAuth::new(
            LaneKey::from_bytes(key).unwrap(),
            Arc::new(|ip: IpAddr| ip.is_loopback()),
        )
        .with_timeout(Duration::from_millis(500))
    }

    /// A connected pair over loopback: (client, server).
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (c, s)
    }

    fn run(ik: &[u8], rk: &[u8]) -> (Result<(), AuthError>, Result<(), AuthError>) {
        let (mut c, mut s) = pair();
        let rk = rk.to_vec();
        let r = std::thread::spawn(move || auth(&rk).accept(&mut s));
        let i = auth(ik).initiate(&mut c);
        drop(c);
        (i, r.join().unwrap())
    }

    #[test]
    fn the_same_key_on_both_sides_passes() {
        let (i, r) = run(KEY, KEY);
        assert!(i.is_ok() && r.is_ok(), "{i:?} {r:?}");
    }

    #[test]
    fn a_wrong_key_fails_on_both_sides() {
        let (i, r) = run(KEY, b"another key, also 32 bytes or more!!");
        assert!(matches!(r, Err(AuthError::BadProof(_))), "{r:?}");
        // The responder answers nothing: the initiator sees the close.
        assert!(matches!(i, Err(AuthError::Io(_))), "{i:?}");
    }

    #[test]
    fn a_source_outside_the_node_table_is_refused_before_any_byte() {
        let a = LaneAuth::new(
            LaneKey::from_bytes(KEY).unwrap(),
            Arc::new(|_: IpAddr| false),
        );
        let (_c, mut s) = pair();
        let t0 = Instant::now();
        assert!(matches!(a.accept(&mut s), Err(AuthError::NotANode(_))));
        assert!(t0.elapsed() < Duration::from_millis(100), "read nothing");
    }

    /// A recorded good transcript replayed on a new connection: the
    /// responder's fresh nonce makes the old proof worthless.
    #[test]
    fn a_replayed_transcript_fails() {
        let a = auth(KEY);
        // Record: a real exchange, as an eavesdropper sees it.
        let (mut c, mut s) = pair();
        let (ci, si) = (c.local_addr().unwrap(), s.local_addr().unwrap());
        let ni = [7u8; NONCE_LEN];
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&ni);
        let r = std::thread::spawn(move || auth(KEY).accept(&mut s));
        c.write_all(&hello).unwrap();
        let mut ch = [0u8; HELLO_LEN];
        c.read_exact(&mut ch).unwrap();
        let proof = a.initiator_proof(&ni, &ch[4..], ci, si);
        c.write_all(&proof).unwrap();
        let mut theirs = [0u8; MAC_LEN];
        c.read_exact(&mut theirs).unwrap();
        assert!(r.join().unwrap().is_ok());
        // Replay the initiator's half on a new connection (same port: the
        // eavesdropper cannot, but even then the nonce differs).
        let (mut c2, mut s2) = pair();
        let r = std::thread::spawn(move || auth(KEY).accept(&mut s2));
        c2.write_all(&hello).unwrap();
        let mut ch2 = [0u8; HELLO_LEN];
        c2.read_exact(&mut ch2).unwrap();
        assert_ne!(ch2[4..], ch[4..], "a fresh nonce");
        c2.write_all(&proof).unwrap();
        assert!(matches!(r.join().unwrap(), Err(AuthError::BadProof(_))));
        let mut b = [0u8; 1];
        assert_eq!(c2.read(&mut b).unwrap_or(0), 0, "nothing answered");
    }

    /// A proof made for one connection, presented on another (relayed by a
    /// machine in the middle): the addresses differ, the proof fails.
    #[test]
    fn a_proof_for_another_connection_fails() {
        let a = auth(KEY);
        let (mut c, mut s) = pair();
        let si = s.local_addr().unwrap();
        let r = std::thread::spawn(move || auth(KEY).accept(&mut s));
        let ni = [9u8; NONCE_LEN];
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&ni);
        c.write_all(&hello).unwrap();
        let mut ch = [0u8; HELLO_LEN];
        c.read_exact(&mut ch).unwrap();
        let elsewhere: SocketAddr = "127.0.0.9:40000".parse().unwrap();
        c.write_all(&a.initiator_proof(&ni, &ch[4..], elsewhere, si))
            .unwrap();
        assert!(matches!(r.join().unwrap(), Err(AuthError::BadProof(_))));
    }

    /// A fake responder that sends the initiator's own nonce and proof back
    /// (reflection) gets nowhere: the roles are in the MAC.
    #[test]
    fn a_reflected_proof_fails() {
        let (mut c, mut s) = pair();
        let mirror = std::thread::spawn(move || {
            let mut hello = [0u8; HELLO_LEN];
            s.read_exact(&mut hello).unwrap();
            // Echo the nonce: refused at once.
            s.write_all(&hello).unwrap();
            let mut b = [0u8; 1];
            let _ = s.read(&mut b);
        });
        let got = auth(KEY).initiate(&mut c);
        assert!(matches!(got, Err(AuthError::BadProof(_))), "{got:?}");
        drop(c);
        mirror.join().unwrap();

        let (mut c, mut s) = pair();
        let mirror = std::thread::spawn(move || {
            let mut hello = [0u8; HELLO_LEN];
            s.read_exact(&mut hello).unwrap();
            let mut ch = MAGIC.to_vec();
            ch.extend_from_slice(&[1u8; NONCE_LEN]);
            s.write_all(&ch).unwrap();
            let mut proof = [0u8; MAC_LEN];
            s.read_exact(&mut proof).unwrap();
            // Reflect the initiator's proof as ours.
            s.write_all(&proof).unwrap();
        });
        let got = auth(KEY).initiate(&mut c);
        assert!(matches!(got, Err(AuthError::BadProof(_))), "{got:?}");
        mirror.join().unwrap();
    }

    #[test]
    fn truncated_garbage_and_stalled_peers_are_cut_off() {
        // Truncated: half a hello, then the close.
        let (mut c, mut s) = pair();
        c.write_all(&MAGIC[..]).unwrap();
        c.write_all(&[0u8; 6]).unwrap();
        drop(c);
        assert!(matches!(auth(KEY).accept(&mut s), Err(AuthError::Io(_))));
        // Oversized garbage: a megabyte of it; at most one hello is read.
        let (mut c, mut s) = pair();
        let w = std::thread::spawn(move || {
            let _ = c.write_all(&vec![0xAB; 1 << 20]);
        });
        assert!(matches!(
            auth(KEY).accept(&mut s),
            Err(AuthError::BadProof(_))
        ));
        drop(s);
        w.join().unwrap();
        // Right magic, then a flood of proof bytes: read 32, refuse.
        let (mut c, mut s) = pair();
        let w = std::thread::spawn(move || {
            let mut h = MAGIC.to_vec();
            h.extend_from_slice(&[3u8; NONCE_LEN]);
            let _ = c.write_all(&h);
            let _ = c.write_all(&vec![0xCD; 1 << 20]);
        });
        assert!(matches!(
            auth(KEY).accept(&mut s),
            Err(AuthError::BadProof(_))
        ));
        drop(s);
        w.join().unwrap();
        // Stalled: one byte every 100 ms never finishes within the deadline.
        let (mut c, mut s) = pair();
        let w = std::thread::spawn(move || {
            for b in MAGIC.iter().chain(&[0u8; NONCE_LEN]) {
                if c.write_all(&[*b]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let t0 = Instant::now();
        let got = auth(KEY).accept(&mut s);
        assert!(
            matches!(&got, Err(AuthError::Io(e)) if e.kind() == io::ErrorKind::TimedOut),
            "{got:?}"
        );
        assert!(
            t0.elapsed() < Duration::from_millis(900),
            "{:?}",
            t0.elapsed()
        );
        drop(s);
        w.join().unwrap();
        // Silent: nothing at all.
        let (_c, mut s) = pair();
        let t0 = Instant::now();
        assert!(auth(KEY).accept(&mut s).is_err());
        assert!(t0.elapsed() < Duration::from_millis(900));
    }

    #[test]
    fn connections_leave_from_the_lane_address() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let peer = l.local_addr().unwrap();
        let c = connect_from("127.0.0.3:7471".parse().unwrap(), peer, AUTH_TIMEOUT).unwrap();
        assert_eq!(c.local_addr().unwrap().ip().to_string(), "127.0.0.3");
        let c = connect_from("0.0.0.0:7471".parse().unwrap(), peer, AUTH_TIMEOUT).unwrap();
        assert_eq!(c.local_addr().unwrap().ip().to_string(), "127.0.0.1");
    }

    #[test]
    fn keys_are_checked_when_loaded() {
        assert!(matches!(
            LaneKey::from_bytes(b""),
            Err(KeyError::Empty { .. })
        ));
        assert!(matches!(
            LaneKey::from_bytes(b" \n"),
            Err(KeyError::Empty { .. })
        ));
        assert!(matches!(
            LaneKey::from_bytes(b"short\n"),
            Err(KeyError::TooShort { len: 5, .. })
        ));
        assert!(matches!(
            LaneKey::from_bytes(&[b'k'; MAX_KEY_LEN + 1]),
            Err(KeyError::TooLong { .. })
        ));
        // A trailing newline is not part of the key.
        let (i, r) = run(KEY, &[KEY, b"\n"].concat());
        assert!(i.is_ok() && r.is_ok());
        let dir = std::env::temp_dir().join(format!("fl-lane-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("key");
        let err = LaneKey::from_file(&f).unwrap_err().to_string();
        assert!(err.contains("lane key file"), "{err}");
        std::fs::write(&f, KEY).unwrap();
        std::fs::set_permissions(&f, fs::Permissions::from_mode(0o644)).unwrap();
        let err = LaneKey::from_file(&f).unwrap_err().to_string();
        assert!(err.contains("group or others"), "{err}");
        std::fs::set_permissions(&f, fs::Permissions::from_mode(0o400)).unwrap();
        assert!(LaneKey::from_file(&f).is_ok());
        std::fs::set_permissions(&f, fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&f, b"").unwrap();
        assert!(matches!(
            LaneKey::from_file(&f),
            Err(KeyError::Empty { .. })
        ));
        assert!(matches!(
            LaneKey::from_file(&dir),
            Err(KeyError::NotAFile { .. })
        ));
        assert!(!format!("{:?}", LaneKey::from_bytes(KEY).unwrap()).contains("0123"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
