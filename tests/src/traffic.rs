//! Real traffic between network namespaces: a TCP stream whose bytes are
//! checked end to end, and ping.

use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::Duration;

use crate::netns::Netns;

/// FNV-1a 64 over a byte stream, to compare what was sent with what arrived.
#[derive(Debug, Clone, Copy)]
pub struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    pub fn update(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }

    pub fn value(&self) -> u64 {
        self.0
    }
}

/// Deterministic pseudo-random payload of `len` bytes (xorshift).
pub fn payload(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// What [`tcp_echo`] observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EchoReport {
    pub sent: usize,
    pub received: usize,
    pub sent_hash: u64,
    pub server_hash: u64,
    pub echoed_hash: u64,
    /// The client address the server saw (source address of the pod).
    pub peer: IpAddr,
}

/// Runs an echo server in `server_ns` on `server_ip:port` and a client in
/// `client_ns` that streams `len` bytes through it and reads them back.
/// Returns hashes of the sent bytes, of what the server received and of what
/// came back.
pub fn tcp_echo(
    server_ns: &Netns,
    server_ip: IpAddr,
    port: u16,
    client_ns: &Netns,
    len: usize,
) -> std::io::Result<EchoReport> {
    let addr = SocketAddr::new(server_ip, port);
    let (ready_tx, ready_rx) = mpsc::channel();
    let server = server_ns.spawn(move || -> std::io::Result<(u64, IpAddr)> {
        let listener = TcpListener::bind(addr);
        let listener = match listener {
            Ok(l) => {
                let _ = ready_tx.send(Ok(()));
                l
            }
            Err(e) => {
                let _ = ready_tx.send(Err(e.to_string()));
                return Err(e);
            }
        };
        let (mut conn, peer) = listener.accept()?;
        conn.set_read_timeout(Some(Duration::from_secs(60)))?;
        let mut hash = Fnv::default();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = conn.read(&mut buf)?;
            if n == 0 {
                break;
            }
            hash.update(&buf[..n]);
            conn.write_all(&buf[..n])?;
        }
        conn.shutdown(Shutdown::Write)?;
        Ok((hash.value(), peer.ip()))
    });
    ready_rx
        .recv_timeout(Duration::from_secs(30))
        .map_err(|e| std::io::Error::other(format!("server not ready: {e}")))?
        .map_err(std::io::Error::other)?;
    let data = payload(len, u64::from(port));
    let mut sent_hash = Fnv::default();
    sent_hash.update(&data);
    let client = client_ns.spawn(move || -> std::io::Result<(usize, u64)> {
        let conn = TcpStream::connect_timeout(&addr, Duration::from_secs(30))?;
        conn.set_read_timeout(Some(Duration::from_secs(60)))?;
        let mut writer = conn.try_clone()?;
        let w = std::thread::spawn(move || -> std::io::Result<()> {
            for chunk in data.chunks(16 * 1024) {
                writer.write_all(chunk)?;
            }
            writer.shutdown(Shutdown::Write)
        });
        let mut reader = conn;
        let mut hash = Fnv::default();
        let mut got = 0usize;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = reader.read(&mut buf)?;
            if n == 0 {
                break;
            }
            got += n;
            hash.update(&buf[..n]);
        }
        w.join()
            .map_err(|_| std::io::Error::other("writer panicked"))??;
        Ok((got, hash.value()))
    });
    let (received, echoed_hash) = client
        .join()
        .map_err(|_| std::io::Error::other("client panicked"))??;
    let (server_hash, peer) = server
        .join()
        .map_err(|_| std::io::Error::other("server panicked"))??;
    Ok(EchoReport {
        sent: len,
        received,
        sent_hash: sent_hash.value(),
        server_hash,
        echoed_hash,
        peer,
    })
}

/// Pings `dst` from `ns` once (with up to `tries` attempts, to ride out IPv6
/// duplicate address detection and neighbour resolution).
pub fn ping(ns: &Netns, dst: IpAddr, tries: usize) -> bool {
    let dst = dst.to_string();
    (0..tries).any(|i| {
        if i > 0 {
            std::thread::sleep(Duration::from_millis(500));
        }
        // busybox's ping (iputils is not installed; busybox-static is).
        ns.exec(&["busybox", "ping", "-c", "1", "-W", "2", &dst])
            .success()
    })
}
