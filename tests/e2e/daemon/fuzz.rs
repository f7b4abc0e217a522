//! Garbage at the daemon's real socket: random bytes, random bodies behind
//! valid lengths, truncated frames, zero and oversized lengths — thousands
//! of them from a deterministic PRNG. Each gets an error answer or a closed
//! connection; the daemon never crashes, leaks no connection, and keeps
//! brokering channels for real pods afterwards.

use super::common as daemon_common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use daemon_common::Node;
use flowlane_lane::proto::{self, ErrorCode, Request, Response};

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

fn connect(node: &Node) -> UnixStream {
    let s = UnixStream::connect(&node.socket).expect("connect to daemon");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
    s
}

/// Everything the daemon sends until it closes (or the read times out).
fn read_to_end(s: &mut UnixStream) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    out
}

/// The answers contained in `buf` (complete frames only).
fn answers(mut buf: &[u8]) -> Vec<Response> {
    let mut out = Vec::new();
    while let Ok(Some((body, used))) = proto::split_frame(buf, proto::MAX_RESPONSE_FRAME) {
        out.push(proto::decode_response(body).expect("the daemon's answers always decode"));
        buf = &buf[used..];
    }
    out
}

fn is_bad_request(r: &Response) -> bool {
    matches!(
        r,
        Response::Error {
            code: ErrorCode::BadRequest,
            ..
        }
    )
}

#[test]
fn garbage_and_truncated_frames_never_hurt_the_daemon() {
    let _turn = crate::turn::take(module_path!());
    let mut node = Node::start("fuz", &[]);
    let fds_before = node.daemon_fds();
    let mut rng = XorShift(0x5DEE_CE66_D1CE_4E5B);
    let valid: Vec<Vec<u8>> = [
        Request::Stats,
        Request::RegisterListener {
            addr: "10.202.6.2:80".parse().unwrap(),
        },
        Request::ConnectIntent {
            src: "0.0.0.0:1000".parse().unwrap(),
            dst: "10.202.6.3:80".parse().unwrap(),
            region_len: 65536,
        },
        Request::ClaimAccepted {
            local: "10.202.6.3:80".parse().unwrap(),
            peer: "10.202.6.2:1000".parse().unwrap(),
        },
    ]
    .iter()
    .map(|r| proto::encode_frame(r, proto::MAX_REQUEST_FRAME).unwrap())
    .collect();

    let rounds = 3000;
    let mut error_answers = 0;
    for round in 0..rounds {
        let mut s = connect(&node);
        match round % 6 {
            // Random bytes, then EOF: an error answer or a silent close.
            0 => {
                let n = rng.below(200) as usize + 1;
                let _ = s.write_all(&rng.bytes(n));
                let _ = s.shutdown(std::net::Shutdown::Write);
                let got = answers(&read_to_end(&mut s));
                assert!(got.iter().all(is_bad_request), "round {round}: {got:?}");
            }
            // A valid length with a random (or mutated valid) body: an error
            // answer, and the connection still serves the next request.
            1 => {
                let mut body = if rng.below(2) == 0 {
                    let v = &valid[rng.below(valid.len() as u64) as usize];
                    v[4..].to_vec()
                } else {
                    let n = rng.below(300) as usize + 1;
                    rng.bytes(n)
                };
                let flips = rng.below(4) + 1;
                for _ in 0..flips {
                    let at = rng.below(body.len() as u64) as usize;
                    body[at] = rng.next() as u8;
                }
                let mut frame = (body.len() as u32).to_le_bytes().to_vec();
                frame.extend_from_slice(&body);
                frame.extend_from_slice(&valid[0]);
                s.write_all(&frame).unwrap();
                s.shutdown(std::net::Shutdown::Write).unwrap();
                let got = answers(&read_to_end(&mut s));
                assert_eq!(got.len(), 2, "round {round}: {got:?}");
                // A flip can leave a valid request; then it gets a real answer.
                if is_bad_request(&got[0]) {
                    error_answers += 1;
                }
                assert!(
                    matches!(got[1], Response::Stats { .. }),
                    "round {round}: {got:?}"
                );
            }
            // A truncated valid frame, then EOF: closed without an answer.
            2 => {
                let v = &valid[rng.below(valid.len() as u64) as usize];
                let cut = rng.below(v.len() as u64 - 1) as usize + 1;
                s.write_all(&v[..cut]).unwrap();
                s.shutdown(std::net::Shutdown::Write).unwrap();
                assert!(answers(&read_to_end(&mut s)).is_empty(), "round {round}");
            }
            // Oversized length: an error answer, then the daemon hangs up.
            3 => {
                let len =
                    proto::MAX_REQUEST_FRAME as u32 + 1 + rng.below(u32::MAX as u64 / 2) as u32;
                s.write_all(&len.to_le_bytes()).unwrap();
                let got = answers(&read_to_end(&mut s));
                assert_eq!(got.len(), 1, "round {round}");
                assert!(is_bad_request(&got[0]));
                error_answers += 1;
            }
            // Zero length.
            4 => {
                s.write_all(&[0, 0, 0, 0]).unwrap();
                let got = answers(&read_to_end(&mut s));
                assert!(got.len() == 1 && is_bad_request(&got[0]), "round {round}");
                error_answers += 1;
            }
            // Valid JSON of the wrong shape.
            _ => {
                let bodies: [&[u8]; 5] = [
                    b"{}",
                    b"[1,2,3]",
                    b"{\"op\":\"connect-intent\",\"src\":\"x\",\"dst\":1}",
                    b"{\"op\":\"report-closed\",\"channel_id\":-5,\"sent\":0,\"received\":0}",
                    b"{\"op\":\"stats\",\"op\":\"stats\"}",
                ];
                let body = bodies[rng.below(bodies.len() as u64) as usize];
                let mut frame = (body.len() as u32).to_le_bytes().to_vec();
                frame.extend_from_slice(body);
                s.write_all(&frame).unwrap();
                s.shutdown(std::net::Shutdown::Write).unwrap();
                let got = answers(&read_to_end(&mut s));
                assert!(
                    got.len() == 1 && is_bad_request(&got[0]),
                    "round {round}: {got:?}"
                );
                error_answers += 1;
            }
        }
    }
    assert!(node.daemon_alive(), "flowlaned must survive the fuzzing");
    let st = node.stats();
    assert!(
        st.bad_requests >= error_answers,
        "{} < {error_answers}",
        st.bad_requests
    );
    assert!(
        error_answers > rounds / 2,
        "most rounds must have produced an error answer"
    );

    // Every fuzz connection is gone from the daemon.
    let settled =
        flowlane_e2e::wait::until(Duration::from_secs(20), || node.daemon_fds() <= fds_before);
    assert!(settled, "daemon fds {} > {fds_before}", node.daemon_fds());

    // Real pods still get channels.
    let a = node.add_pod("a", "10.202.6.2");
    let b = node.add_pod("b", "10.202.6.3");
    let (mut pa, mut pb) = (a.agent(), b.agent());
    assert_eq!(pb.cmd("listen 0.0.0.0:80"), "ok");
    let id = pa.expect_channel("intent 0.0.0.0:1000 10.202.6.3:80 65536");
    assert_eq!(pb.expect_channel("claim 10.202.6.3:80 10.202.6.2:1000"), id);
}
