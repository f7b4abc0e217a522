//! `flowlane cluster probe serve PORT | send ADDR BYTES`: the two programs
//! of the connectivity check ([`crate::check`]), run inside pods with the
//! preload library. The server reads one connection to its end and answers
//! with the count and FNV-1a hash of what it read; the client sends a
//! deterministic pattern and checks that answer, so a lost, duplicated or
//! corrupted byte on any lane fails the check.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// FNV-1a over a byte stream, fed in pieces.
#[derive(Debug, Clone, Copy)]
pub struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    pub fn feed(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// The i-th 64 KiB block the client sends: differs per block, so a block
/// delivered twice or out of order changes the hash.
fn block(i: u64) -> Vec<u8> {
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..65_536)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Serves one connection; prints `listening` once it accepts connections,
/// then `peer <address:port>` of the client it accepted.
pub fn serve(port: u16) -> Result<(), String> {
    let listener = TcpListener::bind(("0.0.0.0", port)).map_err(|e| format!("bind {port}: {e}"))?;
    println!("listening");
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    let (mut conn, peer) = listener.accept().map_err(|e| format!("accept: {e}"))?;
    // The address the server sees: a test checks that no NAT sat between.
    // Best effort: nobody may be reading any more, and the bytes matter more.
    let mut stdout = std::io::stdout();
    let _ = writeln!(stdout, "peer {peer}").and_then(|()| stdout.flush());
    conn.set_read_timeout(Some(IO_TIMEOUT))
        .map_err(|e| e.to_string())?;
    let (mut count, mut hash) = (0u64, Fnv::default());
    let mut buf = vec![0u8; 65_536];
    loop {
        let n = conn.read(&mut buf).map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            break;
        }
        hash.feed(&buf[..n]);
        count += n as u64;
    }
    writeln!(conn, "{count} {:016x}", hash.0).map_err(|e| format!("answer: {e}"))
}

/// Sends `bytes` bytes to `addr` and checks the server's count and hash.
pub fn send(addr: SocketAddr, bytes: u64) -> Result<(), String> {
    let mut conn = TcpStream::connect_timeout(&addr, Duration::from_secs(10))
        .map_err(|e| format!("connect {addr}: {e}"))?;
    conn.set_read_timeout(Some(IO_TIMEOUT))
        .map_err(|e| e.to_string())?;
    conn.set_write_timeout(Some(IO_TIMEOUT))
        .map_err(|e| e.to_string())?;
    let mut hash = Fnv::default();
    let (mut sent, mut i) = (0u64, 0u64);
    while sent < bytes {
        let b = block(i);
        let take = (bytes - sent).min(b.len() as u64) as usize;
        conn.write_all(&b[..take])
            .map_err(|e| format!("write: {e}"))?;
        hash.feed(&b[..take]);
        sent += take as u64;
        i += 1;
    }
    conn.shutdown(Shutdown::Write)
        .map_err(|e| format!("shutdown: {e}"))?;
    let mut answer = String::new();
    BufReader::new(&conn)
        .read_line(&mut answer)
        .map_err(|e| format!("read the answer: {e}"))?;
    let expected = format!("{sent} {:016x}", hash.0);
    if answer.trim() != expected {
        return Err(format!(
            "the server read {:?}, the client sent {expected:?}",
            answer.trim()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_differ_and_the_hash_sees_order() {
        assert_ne!(block(0), block(1));
        let (mut a, mut b) = (Fnv::default(), Fnv::default());
        a.feed(&block(0));
        a.feed(&block(1));
        b.feed(&block(1));
        b.feed(&block(0));
        assert_ne!(a.0, b.0);
    }

    #[test]
    fn a_send_to_a_server_checks_out() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        drop(l);
        let server = std::thread::spawn(move || serve(addr.port()));
        let mut sent = Err(String::new());
        for _ in 0..100 {
            sent = send(addr, 300_000);
            if sent.is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        sent.unwrap();
        server.join().unwrap().unwrap();
    }
}
