//! A small synchronous rtnetlink client: one socket per network namespace
//! (a netlink socket belongs to the netns of the thread that created it),
//! requests sent in batches so several changes cost one round trip.

use std::io;

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST,
};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

pub struct RtNetlink {
    sock: Socket,
    seq: u32,
    buf: Vec<u8>,
}

impl RtNetlink {
    /// Opens a socket in the calling thread's network namespace.
    pub fn open() -> io::Result<RtNetlink> {
        let mut sock = Socket::new(NETLINK_ROUTE)?;
        sock.bind_auto()?;
        // Kernel filters dumps by the header fields we set (ifindex, family).
        let _ = sock.set_netlink_get_strict_chk(true);
        let _ = sock.set_ext_ack(true);
        Ok(RtNetlink {
            sock,
            seq: 0,
            buf: Vec::with_capacity(64 * 1024),
        })
    }

    fn encode(&mut self, msg: RouteNetlinkMessage, flags: u16, out: &mut Vec<u8>) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | flags;
        header.sequence_number = self.seq;
        let mut nl = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(msg));
        nl.finalize();
        let start = out.len();
        out.resize(start + nl.buffer_len(), 0);
        nl.serialize(&mut out[start..]);
        self.seq
    }

    fn send(&self, bytes: &[u8]) -> io::Result<()> {
        self.sock
            .send_to(bytes, &SocketAddr::new(0, 0), 0)
            .map(drop)
    }

    /// Reads datagrams, handing each message to `f` until it returns true.
    fn recv_until(
        &mut self,
        mut f: impl FnMut(NetlinkMessage<RouteNetlinkMessage>) -> io::Result<bool>,
    ) -> io::Result<()> {
        loop {
            self.buf.clear();
            self.sock.recv(&mut self.buf, 0)?;
            let mut off = 0;
            while off + 16 <= self.buf.len() {
                let len = u32::from_ne_bytes(self.buf[off..off + 4].try_into().unwrap()) as usize;
                if len < 16 || off + len > self.buf.len() {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "truncated netlink message",
                    ));
                }
                let msg =
                    NetlinkMessage::<RouteNetlinkMessage>::deserialize(&self.buf[off..off + len])
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
                off += (len + 3) & !3;
                if f(msg)? {
                    return Ok(());
                }
            }
        }
    }

    /// Sends all requests in one datagram (the kernel runs them in order)
    /// and returns each one's outcome, in order.
    pub fn batch(
        &mut self,
        msgs: Vec<(RouteNetlinkMessage, u16)>,
    ) -> io::Result<Vec<io::Result<()>>> {
        let mut out = Vec::new();
        let mut seqs = Vec::new();
        for (m, flags) in msgs {
            seqs.push(self.encode(m, flags | NLM_F_ACK, &mut out));
        }
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        self.send(&out)?;
        let first = seqs[0];
        let mut results: Vec<Option<io::Result<()>>> = seqs.iter().map(|_| None).collect();
        let mut pending = seqs.len();
        self.recv_until(|m| {
            if let NetlinkPayload::Error(e) = m.payload {
                let i = m.header.sequence_number.wrapping_sub(first) as usize;
                if i < results.len() && results[i].is_none() {
                    results[i] = Some(match e.code {
                        None => Ok(()),
                        Some(_) => Err(e.to_io()),
                    });
                    pending -= 1;
                }
            }
            Ok(pending == 0)
        })?;
        Ok(results.into_iter().map(|r| r.unwrap()).collect())
    }

    /// One request, acknowledged.
    pub fn request(&mut self, msg: RouteNetlinkMessage, flags: u16) -> io::Result<()> {
        self.batch(vec![(msg, flags)])?.pop().unwrap()
    }

    /// A GET for one object: its answer, or the kernel's error (ENODEV...).
    pub fn get(&mut self, msg: RouteNetlinkMessage) -> io::Result<RouteNetlinkMessage> {
        let mut out = Vec::new();
        let seq = self.encode(msg, 0, &mut out);
        self.send(&out)?;
        let mut answer = None;
        self.recv_until(|m| {
            if m.header.sequence_number != seq {
                return Ok(false);
            }
            match m.payload {
                NetlinkPayload::InnerMessage(r) => {
                    answer = Some(r);
                    Ok(true)
                }
                NetlinkPayload::Error(e) if e.code.is_some() => Err(e.to_io()),
                _ => Ok(true),
            }
        })?;
        answer.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "empty netlink answer"))
    }

    /// A dump request: every object the kernel returns.
    pub fn dump(&mut self, msg: RouteNetlinkMessage) -> io::Result<Vec<RouteNetlinkMessage>> {
        let mut out = Vec::new();
        let seq = self.encode(msg, NLM_F_DUMP, &mut out);
        self.send(&out)?;
        let mut all = Vec::new();
        self.recv_until(|m| {
            if m.header.sequence_number != seq {
                return Ok(false);
            }
            match m.payload {
                NetlinkPayload::InnerMessage(r) => {
                    all.push(r);
                    Ok(false)
                }
                NetlinkPayload::Done(_) => Ok(true),
                NetlinkPayload::Error(e) if e.code.is_some() => Err(e.to_io()),
                _ => Ok(false),
            }
        })?;
        Ok(all)
    }
}
