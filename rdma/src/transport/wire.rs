//! The message format inside a link's receive slots.
//!
//! Every RDMA WRITE WITH IMMEDIATE carries exactly one message into one slot
//! of the peer's receive ring: a fixed 32-byte header, then the payload. The
//! immediate value is the link sequence number, which the header repeats, so
//! the receiver can check that slots arrive in order and that the slot it
//! reads is the one the completion announced.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use crate::lane_stream::StreamKey;

pub const HEADER_LEN: usize = 32;
const MAGIC: u16 = 0xF1A7;

/// What a message means. Every kind takes one slot of the peer's ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A new stream; the payload is its [`StreamKey`].
    Open = 1,
    /// Stream bytes.
    Data = 2,
    /// The sender will send no more bytes on this stream (half-close).
    Fin = 3,
    /// Abort the stream in both directions.
    Reset = 4,
    /// `arg` more bytes may be sent on this stream (the reader consumed them).
    Window = 5,
    /// Nothing but the link credits in the header.
    Credit = 6,
    /// Keep-alive: proves the link carries messages while streams are idle.
    Ping = 7,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Open,
            2 => Kind::Data,
            3 => Kind::Fin,
            4 => Kind::Reset,
            5 => Kind::Window,
            6 => Kind::Credit,
            7 => Kind::Ping,
            _ => return None,
        })
    }
}

/// Header flag: the sender has fewer than two credits left and cannot send
/// data until the receiver returns some; the receiver returns them at once.
pub const FLAG_NEED_CREDIT: u8 = 1;
/// Header flag: `checksum` holds the CRC-32 of the payload.
pub const FLAG_CHECKSUM: u8 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub flags: u8,
    pub stream: u32,
    pub len: u32,
    /// Link sequence number of this message (slot = seq % slots).
    pub seq: u32,
    /// Link credits (slots) the sender returns to the receiver.
    pub credits: u32,
    /// Kind-specific: Window = bytes granted.
    pub arg: u32,
    pub checksum: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("message of {0} bytes is shorter than the header")]
    Short(usize),
    #[error("bad magic {0:#06x}")]
    Magic(u16),
    #[error("unknown message kind {0}")]
    Kind(u8),
    #[error("header says {header} payload bytes, the slot holds {actual}")]
    Length { header: usize, actual: usize },
    #[error("sequence {got}, expected {expected}")]
    Sequence { got: u32, expected: u32 },
    #[error("payload checksum {got:#010x}, header says {expected:#010x}")]
    Checksum { got: u32, expected: u32 },
    #[error("bad stream key")]
    Key,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        b[2] = self.kind as u8;
        b[3] = self.flags;
        b[4..8].copy_from_slice(&self.stream.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..20].copy_from_slice(&self.credits.to_le_bytes());
        b[20..24].copy_from_slice(&self.arg.to_le_bytes());
        b[24..28].copy_from_slice(&self.checksum.to_le_bytes());
        b
    }

    /// Parses and checks a whole message (header + payload) against the
    /// sequence number the receiver expects; returns the header and payload.
    pub fn decode(msg: &[u8], expected_seq: u32) -> Result<(Header, &[u8]), WireError> {
        if msg.len() < HEADER_LEN {
            return Err(WireError::Short(msg.len()));
        }
        let u32_at = |i: usize| u32::from_le_bytes(msg[i..i + 4].try_into().unwrap());
        let magic = u16::from_le_bytes([msg[0], msg[1]]);
        if magic != MAGIC {
            return Err(WireError::Magic(magic));
        }
        let kind = Kind::from_u8(msg[2]).ok_or(WireError::Kind(msg[2]))?;
        let h = Header {
            kind,
            flags: msg[3],
            stream: u32_at(4),
            len: u32_at(8),
            seq: u32_at(12),
            credits: u32_at(16),
            arg: u32_at(20),
            checksum: u32_at(24),
        };
        let payload = &msg[HEADER_LEN..];
        if payload.len() != h.len as usize {
            return Err(WireError::Length {
                header: h.len as usize,
                actual: payload.len(),
            });
        }
        if h.seq != expected_seq {
            return Err(WireError::Sequence {
                got: h.seq,
                expected: expected_seq,
            });
        }
        if h.flags & FLAG_CHECKSUM != 0 {
            let got = crc32(payload);
            if got != h.checksum {
                return Err(WireError::Checksum {
                    got,
                    expected: h.checksum,
                });
            }
        }
        Ok((h, payload))
    }
}

/// A stream key as 2 × (16-byte address, 2-byte port, 1-byte family).
pub const KEY_LEN: usize = 38;

pub fn encode_key(key: &StreamKey) -> [u8; KEY_LEN] {
    let mut b = [0u8; KEY_LEN];
    for (i, a) in [key.client, key.server].iter().enumerate() {
        let o = i * 19;
        let (fam, oct) = match a.ip() {
            IpAddr::V4(v4) => (4u8, v4.to_ipv6_mapped().octets()),
            IpAddr::V6(v6) => (6u8, v6.octets()),
        };
        b[o..o + 16].copy_from_slice(&oct);
        b[o + 16..o + 18].copy_from_slice(&a.port().to_le_bytes());
        b[o + 18] = fam;
    }
    b
}

pub fn decode_key(b: &[u8]) -> Result<StreamKey, WireError> {
    if b.len() != KEY_LEN {
        return Err(WireError::Key);
    }
    let addr = |o: usize| -> Result<SocketAddr, WireError> {
        let oct: [u8; 16] = b[o..o + 16].try_into().unwrap();
        let port = u16::from_le_bytes([b[o + 16], b[o + 17]]);
        let v6 = Ipv6Addr::from(oct);
        let ip = match b[o + 18] {
            4 => IpAddr::V4(v6.to_ipv4_mapped().ok_or(WireError::Key)?),
            6 => IpAddr::V6(v6),
            _ => return Err(WireError::Key),
        };
        Ok(SocketAddr::new(ip, port))
    };
    Ok(StreamKey {
        client: addr(0)?,
        server: addr(19)?,
    })
}

/// CRC-32 (IEEE 802.3, the zlib one), table-driven.
pub fn crc32(data: &[u8]) -> u32 {
    crc32_parts(&[data])
}

/// CRC-32 of the concatenation of `parts` (bytes that wrap around a ring).
pub fn crc32_parts(parts: &[&[u8]]) -> u32 {
    let mut c = !0u32;
    for data in parts {
        for &b in *data {
            c = CRC_TABLE[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
        }
    }
    !c
}

const CRC_TABLE: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
};

#[cfg(test)]
mod tests {
    use super::*;

    fn header(kind: Kind, payload: &[u8], seq: u32, checksum: bool) -> Vec<u8> {
        let h = Header {
            kind,
            flags: if checksum { FLAG_CHECKSUM } else { 0 },
            stream: 7,
            len: payload.len() as u32,
            seq,
            credits: 3,
            arg: 99,
            checksum: if checksum { crc32(payload) } else { 0 },
        };
        let mut m = h.encode().to_vec();
        m.extend_from_slice(payload);
        m
    }

    #[test]
    fn round_trip() {
        let m = header(Kind::Data, b"hello", 41, true);
        let (h, p) = Header::decode(&m, 41).unwrap();
        assert_eq!(h.kind, Kind::Data);
        assert_eq!(
            (h.stream, h.len, h.seq, h.credits, h.arg),
            (7, 5, 41, 3, 99)
        );
        assert_eq!(p, b"hello");
    }

    #[test]
    fn out_of_order_slot_is_refused() {
        let m = header(Kind::Data, b"x", 5, false);
        assert_eq!(
            Header::decode(&m, 6).unwrap_err(),
            WireError::Sequence {
                got: 5,
                expected: 6
            }
        );
    }

    #[test]
    fn corrupted_payload_is_refused_when_checksummed() {
        let mut m = header(Kind::Data, b"payload bytes", 0, true);
        *m.last_mut().unwrap() ^= 1;
        assert!(matches!(
            Header::decode(&m, 0),
            Err(WireError::Checksum { .. })
        ));
        // Without the flag the receiver cannot tell (sequence checks only).
        let mut m = header(Kind::Data, b"payload bytes", 0, false);
        *m.last_mut().unwrap() ^= 1;
        assert!(Header::decode(&m, 0).is_ok());
    }

    #[test]
    fn truncated_and_garbage_messages_are_refused() {
        let m = header(Kind::Data, b"abcdef", 0, false);
        assert!(matches!(
            Header::decode(&m[..10], 0),
            Err(WireError::Short(10))
        ));
        assert!(matches!(
            Header::decode(&m[..m.len() - 1], 0),
            Err(WireError::Length {
                header: 6,
                actual: 5
            })
        ));
        let mut bad = m.clone();
        bad[0] = 0;
        assert!(matches!(Header::decode(&bad, 0), Err(WireError::Magic(_))));
        let mut bad = m;
        bad[2] = 200;
        assert_eq!(Header::decode(&bad, 0).unwrap_err(), WireError::Kind(200));
    }

    #[test]
    fn crc32_matches_the_standard_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
    }

    #[test]
    fn keys_round_trip_for_both_families() {
        let k = StreamKey {
            client: "10.204.1.5:40000".parse().unwrap(),
            server: "[fd00::2]:5201".parse().unwrap(),
        };
        assert_eq!(decode_key(&encode_key(&k)).unwrap(), k);
        assert_eq!(decode_key(&[0u8; 5]).unwrap_err(), WireError::Key);
        let mut b = encode_key(&k);
        b[18] = 9;
        assert_eq!(decode_key(&b).unwrap_err(), WireError::Key);
    }
}
