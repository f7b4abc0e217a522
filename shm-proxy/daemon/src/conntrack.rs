//! Where the node's conntrack table says a connection went: one ctnetlink
//! GET by the connection's original tuple (NETLINK_NETFILTER, hand-written:
//! the message is four nested attributes, and no maintained crate speaks
//! ctnetlink). Used for connections to Service IPs, which kube-proxy DNATs
//! to a backend in the node's PREROUTING: the entry's reply tuple names the
//! backend (its source) and whether the client was also source-NATed (its
//! destination is then not the client). See docs/shm-lane.md, "Service IPs".
//!
//! The kernel's answer is parsed as untrusted bytes: every length is
//! bounded by the buffer, only messages with our sequence number from the
//! kernel (port 0) count, and anything malformed is an error.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// What the table says about one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    /// Source of the reply direction: the backend the connection reaches.
    pub reply_src: SocketAddr,
    /// Destination of the reply direction: the client, unless the
    /// connection was source-NATed too.
    pub reply_dst: SocketAddr,
}

/// A conntrack table to ask (the kernel's; a double in unit tests).
pub trait Conntrack: Send {
    /// The entry whose original direction is `src` → `dst` (TCP), `None`
    /// when there is none.
    fn lookup(&mut self, src: SocketAddr, dst: SocketAddr) -> io::Result<Option<Mapping>>;

    /// The original direction (source, destination) of the entry whose
    /// reply direction is `reply_src` → `reply_dst` (TCP): what a client
    /// sent, seen from the server's side of a NATed connection.
    fn original_of(
        &mut self,
        reply_src: SocketAddr,
        reply_dst: SocketAddr,
    ) -> io::Result<Option<(SocketAddr, SocketAddr)>>;
}

const NETLINK_NETFILTER: libc::c_int = 12;
const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_NEW: u16 = 0;
const IPCTNL_MSG_CT_GET: u16 = 1;
const NLMSG_ERROR: u16 = 2;
const NLA_F_NESTED: u16 = 0x8000;
const NLA_TYPE_MASK: u16 = 0x3fff;

const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;

/// Longest the daemon waits for the kernel's answer.
const TIMEOUT: Duration = Duration::from_millis(200);
/// Receive buffer: an entry is a few hundred bytes.
const BUF_LEN: usize = 8192;

/// The kernel's table, in the daemon's network namespace (the node's).
pub struct Kernel {
    fd: OwnedFd,
    seq: u32,
}

impl Kernel {
    pub fn open() -> io::Result<Kernel> {
        // SAFETY: plain socket call; the result is checked.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                NETLINK_NETFILTER,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: TIMEOUT.as_micros() as libc::suseconds_t,
        };
        // SAFETY: setsockopt with a local timeval of the right size.
        let r = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Kernel { fd, seq: 0 })
    }

    fn send(&self, msg: &[u8]) -> io::Result<()> {
        // SAFETY: sockaddr_nl is plain old data; zero is the kernel.
        let mut to: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        to.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: valid buffer and address of the stated sizes.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                msg.as_ptr().cast(),
                msg.len(),
                0,
                (&to as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// One datagram from the kernel (others are dropped).
    fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            // SAFETY: as in `send`.
            let mut from: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t;
            // SAFETY: valid buffer and address of the stated sizes.
            let n = unsafe {
                libc::recvfrom(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    0,
                    (&mut from as *mut libc::sockaddr_nl).cast(),
                    &mut len,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if from.nl_pid == 0 {
                return Ok(n as usize);
            }
        }
    }
}

impl Kernel {
    /// The entry whose `by` tuple (orig or reply) is `src` → `dst`: its
    /// (original, reply) tuples.
    fn get(&mut self, by: u16, src: SocketAddr, dst: SocketAddr) -> io::Result<Option<Tuples>> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        self.send(&get_request_by(seq, by, src, dst)?)?;
        let mut buf = vec![0u8; BUF_LEN];
        loop {
            let n = self.recv(&mut buf)?;
            // Answers to earlier requests that timed out are skipped.
            if let Some(answer) = parse_answer(&buf[..n], seq)? {
                return answer;
            }
        }
    }
}

impl Conntrack for Kernel {
    fn lookup(&mut self, src: SocketAddr, dst: SocketAddr) -> io::Result<Option<Mapping>> {
        Ok(self.get(CTA_TUPLE_ORIG, src, dst)?.map(|t| Mapping {
            reply_src: t.reply.0,
            reply_dst: t.reply.1,
        }))
    }

    fn original_of(
        &mut self,
        reply_src: SocketAddr,
        reply_dst: SocketAddr,
    ) -> io::Result<Option<(SocketAddr, SocketAddr)>> {
        Ok(self
            .get(CTA_TUPLE_REPLY, reply_src, reply_dst)?
            .map(|t| t.orig))
    }
}

/// Both directions of one entry, (source, destination) each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Tuples {
    orig: (SocketAddr, SocketAddr),
    reply: (SocketAddr, SocketAddr),
}

fn push_attr(out: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    out.extend_from_slice(&(len as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(payload);
    out.resize(out.len() + (4 - len % 4) % 4, 0);
}

fn nested(kind: u16, body: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut inner = Vec::new();
    body(&mut inner);
    let mut out = Vec::new();
    push_attr(&mut out, kind | NLA_F_NESTED, &inner);
    out
}

/// The GET request for the entry whose original tuple is `src` → `dst`.
#[cfg(test)]
fn get_request(seq: u32, src: SocketAddr, dst: SocketAddr) -> io::Result<Vec<u8>> {
    get_request_by(seq, CTA_TUPLE_ORIG, src, dst)
}

/// The GET request for the entry whose `by` tuple (`CTA_TUPLE_ORIG` or
/// `CTA_TUPLE_REPLY`) is `src` → `dst`.
fn get_request_by(seq: u32, by: u16, src: SocketAddr, dst: SocketAddr) -> io::Result<Vec<u8>> {
    let (src, dst) = (canonical(src), canonical(dst));
    let family = match (src.ip(), dst.ip()) {
        (IpAddr::V4(_), IpAddr::V4(_)) => libc::AF_INET,
        (IpAddr::V6(_), IpAddr::V6(_)) => libc::AF_INET6,
        _ => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "source and destination of different families",
            ))
        }
    };
    let ips = nested(CTA_TUPLE_IP, |v| match (src.ip(), dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            push_attr(v, CTA_IP_V4_SRC, &s.octets());
            push_attr(v, CTA_IP_V4_DST, &d.octets());
        }
        (s, d) => {
            push_attr(v, CTA_IP_V6_SRC, &v6(s).octets());
            push_attr(v, CTA_IP_V6_DST, &v6(d).octets());
        }
    });
    let proto = nested(CTA_TUPLE_PROTO, |v| {
        push_attr(v, CTA_PROTO_NUM, &[libc::IPPROTO_TCP as u8]);
        push_attr(v, CTA_PROTO_SRC_PORT, &src.port().to_be_bytes());
        push_attr(v, CTA_PROTO_DST_PORT, &dst.port().to_be_bytes());
    });
    let tuple = nested(by, |v| {
        v.extend_from_slice(&ips);
        v.extend_from_slice(&proto);
    });
    let len = 16 + 4 + tuple.len();
    let mut msg = Vec::with_capacity(len);
    msg.extend_from_slice(&(len as u32).to_ne_bytes());
    msg.extend_from_slice(&((NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET).to_ne_bytes());
    msg.extend_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    msg.extend_from_slice(&seq.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes());
    // nfgenmsg: family, version 0, resource id 0 (big-endian).
    msg.extend_from_slice(&[family as u8, 0, 0, 0]);
    msg.extend_from_slice(&tuple);
    Ok(msg)
}

fn v6(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("ctnetlink: {what}"))
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// The attributes in `b`: (type without flags, payload). Stops with an
/// error at the first one whose length does not fit.
fn attrs(mut b: &[u8]) -> io::Result<Vec<(u16, &[u8])>> {
    let mut out = Vec::new();
    while b.len() >= 4 {
        let len = usize::from(u16_at(b, 0).ok_or_else(|| bad("attribute"))?);
        let kind = u16_at(b, 2).ok_or_else(|| bad("attribute"))? & NLA_TYPE_MASK;
        if len < 4 || len > b.len() {
            return Err(bad("attribute length out of bounds"));
        }
        out.push((kind, &b[4..len]));
        let next = (len + 3) & !3;
        b = b.get(next..).unwrap_or(&[]);
    }
    Ok(out)
}

/// The answer to request `seq` in one datagram: `None` when the datagram
/// holds no message of that request; `Some(Ok(None))` for "no such entry".
fn parse_answer(mut b: &[u8], seq: u32) -> io::Result<Option<io::Result<Option<Tuples>>>> {
    while b.len() >= 16 {
        let len = u32_at(b, 0).ok_or_else(|| bad("header"))? as usize;
        let kind = u16_at(b, 4).ok_or_else(|| bad("header"))?;
        let msg_seq = u32_at(b, 8).ok_or_else(|| bad("header"))?;
        if len < 16 || len > b.len() {
            return Err(bad("message length out of bounds"));
        }
        let body = &b[16..len];
        if msg_seq == seq {
            if kind == NLMSG_ERROR {
                let errno = u32_at(body, 0).ok_or_else(|| bad("short error message"))? as i32;
                return Ok(Some(match -errno {
                    0 => Err(bad("acknowledged without an entry")),
                    libc::ENOENT => Ok(None),
                    e => Err(io::Error::from_raw_os_error(e)),
                }));
            }
            if kind == (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW {
                return Ok(Some(parse_entry(body).map(Some)));
            }
        }
        b = b.get((len + 3) & !3..).unwrap_or(&[]);
    }
    Ok(None)
}

/// Both tuples of one entry (after the nfgenmsg header).
fn parse_entry(body: &[u8]) -> io::Result<Tuples> {
    let attrs_of_entry = attrs(body.get(4..).ok_or_else(|| bad("short entry"))?)?;
    let tuple = |kind: u16| {
        let payload = attrs_of_entry
            .iter()
            .find(|(k, _)| *k == kind)
            .ok_or_else(|| bad("entry without both tuples"))?
            .1;
        parse_tuple(payload)
    };
    Ok(Tuples {
        orig: tuple(CTA_TUPLE_ORIG)?,
        reply: tuple(CTA_TUPLE_REPLY)?,
    })
}

/// One tuple's (source, destination).
fn parse_tuple(tuple: &[u8]) -> io::Result<(SocketAddr, SocketAddr)> {
    let (mut src_ip, mut dst_ip, mut src_port, mut dst_port) = (None, None, None, None);
    for (kind, payload) in attrs(tuple)? {
        match kind {
            CTA_TUPLE_IP => {
                for (k, p) in attrs(payload)? {
                    let ip = match (k, p.len()) {
                        (CTA_IP_V4_SRC | CTA_IP_V4_DST, 4) => {
                            IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(p).unwrap_or_default()))
                        }
                        (CTA_IP_V6_SRC | CTA_IP_V6_DST, 16) => {
                            IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(p).unwrap_or_default()))
                        }
                        _ => continue,
                    };
                    if matches!(k, CTA_IP_V4_SRC | CTA_IP_V6_SRC) {
                        src_ip = Some(ip);
                    } else {
                        dst_ip = Some(ip);
                    }
                }
            }
            CTA_TUPLE_PROTO => {
                for (k, p) in attrs(payload)? {
                    let port = || Some(u16::from_be_bytes(p.try_into().ok()?));
                    match k {
                        CTA_PROTO_SRC_PORT => src_port = port(),
                        CTA_PROTO_DST_PORT => dst_port = port(),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    match (src_ip, dst_ip, src_port, dst_port) {
        (Some(si), Some(di), Some(sp), Some(dp)) => {
            Ok((SocketAddr::new(si, sp), SocketAddr::new(di, dp)))
        }
        _ => Err(bad("incomplete tuple")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    /// An entry as the kernel sends it: the request's tuple as the
    /// original, a reply tuple from the backend.
    fn entry_message(
        seq: u32,
        orig: (SocketAddr, SocketAddr),
        reply: (SocketAddr, SocketAddr),
    ) -> Vec<u8> {
        let mut req = get_request(seq, orig.0, orig.1).unwrap();
        // Reuse the request's layout: same tuple encoding, type CT_NEW.
        let tuple_reply = {
            let r = get_request(seq, reply.0, reply.1).unwrap();
            let mut t = r[20..].to_vec();
            // Turn CTA_TUPLE_ORIG into CTA_TUPLE_REPLY.
            t[2..4].copy_from_slice(&(CTA_TUPLE_REPLY | NLA_F_NESTED).to_ne_bytes());
            t
        };
        req.extend_from_slice(&tuple_reply);
        let len = req.len() as u32;
        req[0..4].copy_from_slice(&len.to_ne_bytes());
        req[4..6]
            .copy_from_slice(&((NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW).to_ne_bytes());
        req
    }

    #[test]
    fn the_reply_tuple_names_the_backend() {
        let client = sa("10.212.1.5:40000");
        let svc = sa("10.96.212.10:80");
        let backend = sa("10.212.1.7:8080");
        let msg = entry_message(7, (client, svc), (backend, client));
        let got = parse_answer(&msg, 7).unwrap().unwrap().unwrap().unwrap();
        assert_eq!(got.reply, (backend, client));
        assert_eq!(got.orig, (client, svc));
        // Another request's answer is skipped.
        assert!(parse_answer(&msg, 8).unwrap().is_none());
    }

    #[test]
    fn no_entry_and_errors() {
        let mut msg = vec![0u8; 36];
        msg[0..4].copy_from_slice(&36u32.to_ne_bytes());
        msg[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        msg[8..12].copy_from_slice(&3u32.to_ne_bytes());
        msg[16..20].copy_from_slice(&(-libc::ENOENT).to_ne_bytes());
        assert_eq!(parse_answer(&msg, 3).unwrap().unwrap().unwrap(), None);
        msg[16..20].copy_from_slice(&(-libc::EPERM).to_ne_bytes());
        assert!(parse_answer(&msg, 3).unwrap().unwrap().is_err());
    }

    #[test]
    fn malformed_answers_are_errors_never_panics() {
        let msg = entry_message(
            1,
            (sa("10.0.0.1:1"), sa("10.0.0.2:2")),
            (sa("10.0.0.3:3"), sa("10.0.0.1:1")),
        );
        // Every truncation, and every single-byte corruption.
        for cut in 0..msg.len() {
            let mut m = msg[..cut].to_vec();
            if m.len() >= 4 {
                let l = m.len() as u32;
                m[0..4].copy_from_slice(&l.to_ne_bytes());
            }
            let _ = parse_answer(&m, 1);
        }
        for i in 0..msg.len() {
            for v in [0u8, 1, 0x7f, 0xff] {
                let mut m = msg.clone();
                m[i] = v;
                let _ = parse_answer(&m, 1);
            }
        }
        // A length beyond the datagram.
        let mut m = msg.clone();
        m[0..4].copy_from_slice(&(msg.len() as u32 + 4).to_ne_bytes());
        assert!(parse_answer(&m, 1).is_err());
    }

    #[test]
    fn ipv6_tuples_round_trip() {
        let client = sa("[fd00::5]:40000");
        let svc = sa("[fd96::10]:80");
        let backend = sa("[fd00::7]:8080");
        let msg = entry_message(2, (client, svc), (backend, client));
        let got = parse_answer(&msg, 2).unwrap().unwrap().unwrap().unwrap();
        assert_eq!(got.reply.0, backend);
        assert!(get_request(1, sa("10.0.0.1:1"), svc).is_err());
    }
}
