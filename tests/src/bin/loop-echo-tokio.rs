//! The event-loop conformance suite's tokio program (`tests/e2e/shm/event_loops.rs`):
//! the "echo and trailer" protocol of `flowlane_e2e::loop_scripts`, on
//! tokio's multi-threaded runtime (mio, epoll edge-triggered).
//!
//! `loop-echo-tokio server PORT CONNS` serves CONNS connections (each on its
//! own task, as they come) and exits; `loop-echo-tokio client IP PORT BYTES
//! SEED` runs one client (BYTES 0: stream until the connection breaks).

use flowlane_e2e::loop_scripts::{crc32_update, Stream, CHUNKS};
use std::process::exit;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn arg<T: std::str::FromStr>(args: &[String], i: usize) -> T {
    args.get(i).and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        eprintln!("usage: loop-echo-tokio server PORT CONNS | client IP PORT BYTES SEED");
        exit(64)
    })
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("server") => server(arg(&args, 2), arg(&args, 3)).await,
        Some("client") => {
            client(
                &args.get(2).cloned().unwrap_or_default(),
                arg(&args, 3),
                arg(&args, 4),
                arg(&args, 5),
            )
            .await
        }
        _ => {
            eprintln!("usage: loop-echo-tokio server PORT CONNS | client IP PORT BYTES SEED");
            exit(64)
        }
    }
}

/// One served connection: echo while it arrives, then the trailer.
async fn serve(mut s: TcpStream) -> std::io::Result<(u64, u32)> {
    let mut buf = vec![0u8; 1 << 16];
    let (mut n, mut crc) = (0u64, 0u32);
    loop {
        let k = s.read(&mut buf).await?;
        if k == 0 {
            break;
        }
        crc = crc32_update(crc, &buf[..k]);
        n += k as u64;
        s.write_all(&buf[..k]).await?;
    }
    s.write_all(format!("{n} {crc:08x}\n").as_bytes()).await?;
    s.shutdown().await?;
    Ok((n, crc))
}

async fn server(port: u16, conns: usize) {
    let l = TcpListener::bind(("0.0.0.0", port)).await.expect("bind");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let acceptor = tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            let tx = tx.clone();
            tokio::spawn(async move {
                let line = match serve(s).await {
                    Ok((n, crc)) => format!("conn {n} {crc:08x}"),
                    Err(e) => format!("conn error {e}"),
                };
                let _ = tx.send(line);
            });
        }
    });
    for _ in 0..conns {
        let line = rx.recv().await.expect("acceptor alive");
        println!("{line}");
    }
    acceptor.abort();
}

async fn client(ip: &str, port: u16, total: u64, seed: u32) {
    let s = match TcpStream::connect((ip, port)).await {
        Ok(s) => s,
        Err(e) => {
            println!("error connect {e}");
            exit(3)
        }
    };
    let (mut rd, mut wr) = s.into_split();
    let stream = Stream::new(seed);
    let sender = {
        let stream = stream.clone();
        tokio::spawn(async move {
            let (mut p, mut crc, mut i) = (0u64, 0u32, 0usize);
            let mut buf = Vec::new();
            while total == 0 || p < total {
                let mut n = CHUNKS[i % CHUNKS.len()] as u64;
                i += 1;
                if total != 0 {
                    n = n.min(total - p);
                }
                buf.clear();
                stream.span(p, n as usize, &mut buf);
                crc = crc32_update(crc, &buf);
                if let Err(e) = wr.write_all(&buf).await {
                    println!("error write {e} after {p}");
                    exit(3)
                }
                p += n;
            }
            if let Err(e) = wr.shutdown().await {
                println!("error shutdown {e}");
                exit(3)
            }
            crc
        })
    };
    let mut buf = vec![0u8; 1 << 16];
    let mut want = Vec::new();
    let (mut echoed, mut tail) = (0u64, Vec::new());
    loop {
        let k = match rd.read(&mut buf).await {
            Ok(0) => break,
            Ok(k) => k,
            Err(e) => {
                println!("error read {e} after {echoed}");
                exit(3)
            }
        };
        let mut d = &buf[..k];
        if total == 0 || echoed < total {
            let m = if total == 0 {
                d.len()
            } else {
                d.len().min((total - echoed) as usize)
            };
            want.clear();
            stream.span(echoed, m, &mut want);
            if let Some(i) = (0..m).find(|&i| d[i] != want[i]) {
                println!("wrong byte at {}", echoed + i as u64);
                exit(2)
            }
            echoed += m as u64;
            d = &d[m..];
        }
        tail.extend_from_slice(d);
    }
    if total == 0 || echoed < total {
        println!("eof after {echoed}");
        exit(3)
    }
    let crc = sender.await.expect("sender");
    let want = format!("{total} {crc:08x}\n");
    if tail != want.as_bytes() {
        println!(
            "short: echoed {echoed}, trailer {:?}",
            String::from_utf8_lossy(&tail)
        );
        exit(3)
    }
    println!("ok {total} {crc:08x}");
}
