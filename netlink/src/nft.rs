//! Just enough of the nf_tables netlink protocol to keep one masquerade
//! rule per pod address, built by hand: the Rust nftables crates either
//! shell out to `nft` (json) or are GPL and need libclang at build time.
//!
//! Kernel UAPI: include/uapi/linux/netfilter/nf_tables.h and nfnetlink.h.
//! Numbers inside nf_tables attributes are big-endian.

use std::io;

use netlink_sys::{protocols::NETLINK_NETFILTER, Socket, SocketAddr};

const NLA_F_NESTED: u16 = 0x8000;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLM_F_CREATE: u16 = 0x400;
const NLM_F_APPEND: u16 = 0x800;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 16;
const NFNL_MSG_BATCH_END: u16 = 17;
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_NEWRULE: u16 = 6;
const NFT_MSG_GETRULE: u16 = 7;
const NFT_MSG_DELRULE: u16 = 8;

const NFTA_TABLE_NAME: u16 = 1;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_HANDLE: u16 = 3;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_RULE_USERDATA: u16 = 7;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_DATA_VALUE: u16 = 1;
const NFT_REG_VERDICT: u32 = 0;
const NFT_REG_1: u32 = 1;
const NF_ACCEPT: u32 = 1;
const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
const NFT_CMP_EQ: u32 = 0;
const NFT_CMP_NEQ: u32 = 1;
const NF_INET_POST_ROUTING: u32 = 4;
/// `srcnat` priority.
const NF_IP_PRI_NAT_SRC: u32 = 100;
/// libnftnl's comment type in rule userdata (what `nft list` shows).
const NFTNL_UDATA_RULE_COMMENT: u8 = 0;

pub const NFPROTO_IPV4: u8 = 2;
pub const NFPROTO_IPV6: u8 = 10;

fn attr(out: &mut Vec<u8>, ty: u16, payload: &[u8]) {
    out.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
    out.extend_from_slice(&ty.to_ne_bytes());
    out.extend_from_slice(payload);
    while out.len() % 4 != 0 {
        out.push(0);
    }
}

fn attr_str(out: &mut Vec<u8>, ty: u16, s: &str) {
    let mut b = s.as_bytes().to_vec();
    b.push(0);
    attr(out, ty, &b);
}

fn attr_u32(out: &mut Vec<u8>, ty: u16, v: u32) {
    attr(out, ty, &v.to_be_bytes());
}

fn nested(out: &mut Vec<u8>, ty: u16, inner: impl FnOnce(&mut Vec<u8>)) {
    let mut b = Vec::new();
    inner(&mut b);
    attr(out, ty | NLA_F_NESTED, &b);
}

/// One nf_tables expression in a rule.
pub enum Expr<'a> {
    /// Load `len` bytes at `offset` of the network header into register 1.
    Payload {
        offset: u32,
        len: u32,
    },
    /// reg1 = reg1 & mask.
    Mask(&'a [u8]),
    /// Compare register 1 with `data`.
    Cmp {
        eq: bool,
        data: &'a [u8],
    },
    Masquerade,
    /// Verdict accept: the rest of this chain is skipped.
    Accept,
}

impl Expr<'_> {
    fn emit(&self, out: &mut Vec<u8>) {
        nested(out, NFTA_LIST_ELEM, |e| match self {
            Expr::Payload { offset, len } => {
                attr_str(e, NFTA_EXPR_NAME, "payload");
                nested(e, NFTA_EXPR_DATA, |d| {
                    attr_u32(d, 1, NFT_REG_1); // DREG
                    attr_u32(d, 2, NFT_PAYLOAD_NETWORK_HEADER); // BASE
                    attr_u32(d, 3, *offset);
                    attr_u32(d, 4, *len);
                });
            }
            Expr::Mask(mask) => {
                attr_str(e, NFTA_EXPR_NAME, "bitwise");
                nested(e, NFTA_EXPR_DATA, |d| {
                    attr_u32(d, 1, NFT_REG_1); // SREG
                    attr_u32(d, 2, NFT_REG_1); // DREG
                    attr_u32(d, 3, mask.len() as u32); // LEN
                    nested(d, 4, |m| attr(m, NFTA_DATA_VALUE, mask)); // MASK
                    nested(d, 5, |x| attr(x, NFTA_DATA_VALUE, &vec![0; mask.len()]));
                    // XOR
                });
            }
            Expr::Cmp { eq, data } => {
                attr_str(e, NFTA_EXPR_NAME, "cmp");
                nested(e, NFTA_EXPR_DATA, |d| {
                    attr_u32(d, 1, NFT_REG_1);
                    attr_u32(d, 2, if *eq { NFT_CMP_EQ } else { NFT_CMP_NEQ });
                    nested(d, 3, |v| attr(v, NFTA_DATA_VALUE, data));
                });
            }
            Expr::Masquerade => attr_str(e, NFTA_EXPR_NAME, "masq"),
            Expr::Accept => {
                attr_str(e, NFTA_EXPR_NAME, "immediate");
                nested(e, NFTA_EXPR_DATA, |d| {
                    attr_u32(d, 1, NFT_REG_VERDICT); // DREG
                    nested(d, 2, |data| {
                        // NFTA_DATA_VERDICT { NFTA_VERDICT_CODE }
                        nested(data, 2, |v| attr_u32(v, 1, NF_ACCEPT));
                    });
                });
            }
        });
    }
}

/// Where [`Nft::add_rules`] puts its rules in the chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum At {
    /// After every rule already there.
    Tail,
    /// Before every rule already there.
    Head,
}

/// A rule found by a dump.
#[derive(Debug, Clone)]
pub struct FoundRule {
    pub handle: u64,
    pub comment: String,
}

/// A netfilter netlink socket (host netns).
pub struct Nft {
    sock: Socket,
    seq: u32,
}

impl Nft {
    pub fn open() -> io::Result<Nft> {
        let mut sock = Socket::new(NETLINK_NETFILTER)?;
        sock.bind_auto()?;
        Ok(Nft { sock, seq: 0 })
    }

    fn header(
        &mut self,
        out: &mut Vec<u8>,
        ty: u16,
        flags: u16,
        family: u8,
        res_id: u16,
    ) -> (usize, u32) {
        self.seq = self.seq.wrapping_add(1);
        let start = out.len();
        out.extend_from_slice(&0u32.to_ne_bytes()); // length, patched
        out.extend_from_slice(&ty.to_ne_bytes());
        out.extend_from_slice(&flags.to_ne_bytes());
        out.extend_from_slice(&self.seq.to_ne_bytes());
        out.extend_from_slice(&0u32.to_ne_bytes());
        out.push(family);
        out.push(0); // NFNETLINK_V0
        out.extend_from_slice(&res_id.to_be_bytes());
        (start, self.seq)
    }

    fn finish(out: &mut [u8], start: usize) {
        let len = (out.len() - start) as u32;
        out[start..start + 4].copy_from_slice(&len.to_ne_bytes());
    }

    fn msg(
        &mut self,
        out: &mut Vec<u8>,
        cmd: u16,
        flags: u16,
        family: u8,
        body: impl FnOnce(&mut Vec<u8>),
    ) -> u32 {
        let (start, seq) = self.header(
            out,
            (NFNL_SUBSYS_NFTABLES << 8) | cmd,
            NLM_F_REQUEST | flags,
            family,
            0,
        );
        body(out);
        Self::finish(out, start);
        seq
    }

    /// A batch's begin or end message.
    fn batch_marker(&mut self, out: &mut Vec<u8>, ty: u16) {
        let (s, _) = self.header(out, ty, NLM_F_REQUEST, 0, NFNL_SUBSYS_NFTABLES);
        Self::finish(out, s);
    }

    /// Sends one transaction and waits for every message's ack.
    fn transaction(
        &mut self,
        build: impl FnOnce(&mut Self, &mut Vec<u8>) -> usize,
    ) -> io::Result<()> {
        let mut out = Vec::new();
        self.batch_marker(&mut out, NFNL_MSG_BATCH_BEGIN);
        let expected = build(self, &mut out);
        self.batch_marker(&mut out, NFNL_MSG_BATCH_END);
        self.sock.send_to(&out, &SocketAddr::new(0, 0), 0)?;
        let mut acks = 0;
        let mut first_err = None;
        let mut buf = Vec::with_capacity(64 * 1024);
        while acks < expected {
            buf.clear();
            self.sock.recv(&mut buf, 0)?;
            for (ty, payload) in messages(&buf) {
                if ty == NLMSG_ERROR && payload.len() >= 4 {
                    acks += 1;
                    let code = i32::from_ne_bytes(payload[..4].try_into().unwrap());
                    if code != 0 && first_err.is_none() {
                        first_err = Some(io::Error::from_raw_os_error(-code));
                    }
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Creates (if needed) `table` with a nat postrouting `chain` and adds
    /// one rule per entry of `rules` at its end or its head, atomically.
    pub fn add_rules(
        &mut self,
        family: u8,
        table: &str,
        chain: &str,
        rules: &[(Vec<Expr>, String)],
        at: At,
    ) -> io::Result<()> {
        let position = match at {
            At::Tail => NLM_F_APPEND,
            At::Head => 0,
        };
        self.transaction(|nft, out| {
            nft.msg(
                out,
                NFT_MSG_NEWTABLE,
                NLM_F_CREATE | NLM_F_ACK,
                family,
                |b| {
                    attr_str(b, NFTA_TABLE_NAME, table);
                },
            );
            nft.msg(
                out,
                NFT_MSG_NEWCHAIN,
                NLM_F_CREATE | NLM_F_ACK,
                family,
                |b| {
                    attr_str(b, NFTA_CHAIN_TABLE, table);
                    attr_str(b, NFTA_CHAIN_NAME, chain);
                    nested(b, NFTA_CHAIN_HOOK, |h| {
                        attr_u32(h, NFTA_HOOK_HOOKNUM, NF_INET_POST_ROUTING);
                        attr_u32(h, NFTA_HOOK_PRIORITY, NF_IP_PRI_NAT_SRC);
                    });
                    attr_str(b, NFTA_CHAIN_TYPE, "nat");
                },
            );
            for (exprs, comment) in rules {
                nft.msg(
                    out,
                    NFT_MSG_NEWRULE,
                    NLM_F_CREATE | position | NLM_F_ACK,
                    family,
                    |b| {
                        attr_str(b, NFTA_RULE_TABLE, table);
                        attr_str(b, NFTA_RULE_CHAIN, chain);
                        nested(b, NFTA_RULE_EXPRESSIONS, |l| {
                            for e in exprs {
                                e.emit(l);
                            }
                        });
                        let mut c = comment.as_bytes()[..comment.len().min(126)].to_vec();
                        c.push(0);
                        let mut ud = vec![NFTNL_UDATA_RULE_COMMENT, c.len() as u8];
                        ud.extend_from_slice(&c);
                        attr(b, NFTA_RULE_USERDATA, &ud);
                    },
                );
            }
            2 + rules.len()
        })
    }

    /// Deletes rules by handle, atomically.
    pub fn delete_rules(
        &mut self,
        family: u8,
        table: &str,
        chain: &str,
        handles: &[u64],
    ) -> io::Result<()> {
        if handles.is_empty() {
            return Ok(());
        }
        self.transaction(|nft, out| {
            for h in handles {
                nft.msg(out, NFT_MSG_DELRULE, NLM_F_ACK, family, |b| {
                    attr_str(b, NFTA_RULE_TABLE, table);
                    attr_str(b, NFTA_RULE_CHAIN, chain);
                    attr(b, NFTA_RULE_HANDLE, &h.to_be_bytes());
                });
            }
            handles.len()
        })
    }

    /// Rules of `table`/`chain` (none if the table does not exist).
    pub fn list_rules(
        &mut self,
        family: u8,
        table: &str,
        chain: &str,
    ) -> io::Result<Vec<FoundRule>> {
        let mut out = Vec::new();
        let seq = self.msg(&mut out, NFT_MSG_GETRULE, NLM_F_DUMP, family, |b| {
            attr_str(b, NFTA_RULE_TABLE, table);
            attr_str(b, NFTA_RULE_CHAIN, chain);
        });
        self.sock.send_to(&out, &SocketAddr::new(0, 0), 0)?;
        let mut rules = Vec::new();
        let mut buf = Vec::with_capacity(64 * 1024);
        loop {
            buf.clear();
            self.sock.recv(&mut buf, 0)?;
            for (ty, payload, mseq) in messages_seq(&buf) {
                if mseq != seq {
                    continue;
                }
                match ty {
                    NLMSG_DONE => return Ok(rules),
                    NLMSG_ERROR => {
                        let code = i32::from_ne_bytes(payload[..4].try_into().unwrap());
                        if code == -libc::ENOENT {
                            return Ok(rules);
                        }
                        if code != 0 {
                            return Err(io::Error::from_raw_os_error(-code));
                        }
                        return Ok(rules);
                    }
                    _ if ty == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWRULE
                        && payload.len() >= 4 =>
                    {
                        rules.push(parse_rule(&payload[4..]));
                    }
                    _ => {}
                }
            }
        }
    }
}

fn messages(buf: &[u8]) -> Vec<(u16, &[u8])> {
    messages_seq(buf)
        .into_iter()
        .map(|(t, p, _)| (t, p))
        .collect()
}

/// Splits a datagram into (type, payload, seq).
fn messages_seq(buf: &[u8]) -> Vec<(u16, &[u8], u32)> {
    let mut out = Vec::new();
    let mut off = 0;
    while off + 16 <= buf.len() {
        let len = u32::from_ne_bytes(buf[off..off + 4].try_into().unwrap()) as usize;
        if len < 16 || off + len > buf.len() {
            break;
        }
        let ty = u16::from_ne_bytes(buf[off + 4..off + 6].try_into().unwrap());
        let seq = u32::from_ne_bytes(buf[off + 8..off + 12].try_into().unwrap());
        out.push((ty, &buf[off + 16..off + len], seq));
        off += (len + 3) & !3;
    }
    out
}

fn parse_rule(mut attrs: &[u8]) -> FoundRule {
    let mut r = FoundRule {
        handle: 0,
        comment: String::new(),
    };
    while attrs.len() >= 4 {
        let len = u16::from_ne_bytes([attrs[0], attrs[1]]) as usize;
        let ty = u16::from_ne_bytes([attrs[2], attrs[3]]) & !NLA_F_NESTED;
        if len < 4 || len > attrs.len() {
            break;
        }
        let payload = &attrs[4..len];
        match ty {
            NFTA_RULE_HANDLE if payload.len() == 8 => {
                r.handle = u64::from_be_bytes(payload.try_into().unwrap());
            }
            NFTA_RULE_USERDATA => {
                let mut ud = payload;
                while ud.len() >= 2 {
                    let (t, l) = (ud[0], ud[1] as usize);
                    if 2 + l > ud.len() {
                        break;
                    }
                    if t == NFTNL_UDATA_RULE_COMMENT {
                        let v = &ud[2..2 + l];
                        let v = v.strip_suffix(&[0]).unwrap_or(v);
                        r.comment = String::from_utf8_lossy(v).into_owned();
                    }
                    ud = &ud[2 + l..];
                }
            }
            _ => {}
        }
        let adv = ((len + 3) & !3).min(attrs.len());
        attrs = &attrs[adv..];
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_padded_and_nested() {
        let mut b = Vec::new();
        attr_str(&mut b, 1, "abc");
        assert_eq!(b, [8, 0, 1, 0, b'a', b'b', b'c', 0]);
        let mut b = Vec::new();
        nested(&mut b, 4, |i| attr_u32(i, 1, 4));
        assert_eq!(&b[..4], &[12, 0, 4, 0x80]);
        assert_eq!(&b[8..12], &4u32.to_be_bytes());
    }

    #[test]
    fn rule_attributes_parse_back() {
        let mut b = Vec::new();
        attr(&mut b, NFTA_RULE_HANDLE, &42u64.to_be_bytes());
        attr(&mut b, NFTA_RULE_USERDATA, &[0, 4, b'a', b'b', b'c', 0]);
        let r = parse_rule(&b);
        assert_eq!(r.handle, 42);
        assert_eq!(r.comment, "abc");
    }
}
