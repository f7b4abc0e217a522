//! Whether a pod still has a listening TCP socket on a port, read from
//! `/proc/PID/net/tcp{,6}` of one of its processes (those files show the
//! sockets of the process's network namespace). A listener registration
//! whose socket is gone (closed without the library seeing it, e.g. by a
//! raw syscall) is dropped, so its port cannot be mistaken for a flowlane
//! listener if another program binds it later.

use std::io;

/// TCP state LISTEN in `/proc/net/tcp`.
const LISTEN: &str = "0A";

/// True when the network namespace of `pid` has a TCP socket listening on
/// `port` (any address, either family).
pub fn netns_listens_on(pid: u32, port: u16) -> io::Result<bool> {
    each_tcp_table(pid, |mut table| {
        let mut text = String::new();
        io::Read::read_to_string(&mut table, &mut text)?;
        Ok(table_listens_on(&text, port))
    })
}

/// Calls `f` on `/proc/PID/net/tcp`, then `tcp6`, until it answers true
/// (the answer); false when neither did, NotFound when neither exists (a
/// kernel without IPv6 has only the first).
pub fn each_tcp_table(
    pid: u32,
    mut f: impl FnMut(std::fs::File) -> io::Result<bool>,
) -> io::Result<bool> {
    let mut found_any_file = false;
    for file in ["tcp", "tcp6"] {
        match std::fs::File::open(format!("/proc/{pid}/net/{file}")) {
            Ok(table) => {
                found_any_file = true;
                if f(table)? {
                    return Ok(true);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    if found_any_file {
        Ok(false)
    } else {
        Err(io::ErrorKind::NotFound.into())
    }
}

fn table_listens_on(table: &str, port: u16) -> bool {
    table.lines().skip(1).any(|line| {
        let mut f = line.split_whitespace();
        let local = f.nth(1);
        let state = f.nth(1);
        let local_port = local
            .and_then(|l| l.rsplit_once(':'))
            .and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
        state == Some(LISTEN) && local_port == Some(port)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_proc_table() {
        let t = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0\n   1: 0200CA0A:A410 0300CA0A:0050 01 00000000:00000000 00:00000000 00000000     0        0 2 1 0 20 4 30 10 -1\n";
        assert!(table_listens_on(t, 8080));
        assert!(
            !table_listens_on(t, 42000),
            "an established socket is no listener"
        );
        assert!(!table_listens_on(t, 80));
        assert!(!table_listens_on("garbage\nmore garbage", 80));
    }

    /// A TCP socket of the test's namespace bound to `ip`:`port` (0: any)
    /// with SO_REUSEPORT only, not listening: while it lives, no socket
    /// without SO_REUSEPORT (another test's bind(0) listener) can take the
    /// port.
    fn bound_socket(ip: [u8; 4], port: u16) -> (std::os::fd::OwnedFd, u16) {
        use nix::sys::socket::{bind, getsockname, setsockopt, socket, sockopt};
        use nix::sys::socket::{AddressFamily, SockFlag, SockType, SockaddrIn};
        use std::os::fd::AsRawFd;
        let fd = socket(
            AddressFamily::Inet,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        setsockopt(&fd, sockopt::ReusePort, &true).unwrap();
        let [a, b, c, d] = ip;
        bind(fd.as_raw_fd(), &SockaddrIn::new(a, b, c, d, port)).unwrap();
        let port = getsockname::<SockaddrIn>(fd.as_raw_fd()).unwrap().port();
        (fd, port)
    }

    #[test]
    fn sees_a_real_listener_come_and_go() {
        use nix::sys::socket::{listen, Backlog};
        // The port stays bound (not listening) by `_reserved` after the
        // listener closes: a port freed by closing could go to another
        // test's bind(0) listener before the second look.
        let (_reserved, port) = bound_socket([127, 0, 0, 1], 0);
        let (l, _) = bound_socket([127, 0, 0, 1], port);
        listen(&l, Backlog::new(16).unwrap()).unwrap();
        assert!(netns_listens_on(std::process::id(), port).unwrap());
        drop(l);
        assert!(!netns_listens_on(std::process::id(), port).unwrap());
    }
}
