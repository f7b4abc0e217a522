//! The kernel calls the relay needs beyond the broker's: a process's fd by
//! number (`pidfd_open` + `pidfd_getfd`, so a pod never has to pass its
//! socket over the daemon socket), process exit as a pollable fd, and a few
//! socket queries on the pod's TCP socket.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

fn check(r: libc::c_long) -> io::Result<libc::c_long> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// A pidfd for `pid` (readable once the process exits).
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: plain syscall with integer arguments.
    let fd = check(unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) })?;
    // SAFETY: the kernel returned a fresh fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Our own reference to fd number `target` of the process behind `pidfd`
/// (needs ptrace access to it: the daemon runs as root on the node).
pub fn pidfd_getfd(pidfd: &OwnedFd, target: i32) -> io::Result<OwnedFd> {
    // SAFETY: plain syscall with integer arguments.
    let fd = check(unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), target, 0) })?;
    // SAFETY: the kernel returned a fresh fd (close-on-exec) that we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// True once the process behind `pidfd` has exited; waits up to `timeout_ms`.
pub fn process_exited(pidfd: &OwnedFd, timeout_ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let r = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    r > 0 && p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
}

fn sockopt_int(fd: &OwnedFd, level: i32, opt: i32) -> Option<i32> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt into a local int of the given length.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            level,
            opt,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    (r == 0).then_some(v)
}

/// True when `fd` is an IPv4/IPv6 TCP socket.
pub fn is_tcp_socket(fd: &OwnedFd) -> bool {
    matches!(
        sockopt_int(fd, libc::SOL_SOCKET, libc::SO_DOMAIN),
        Some(libc::AF_INET | libc::AF_INET6)
    ) && sockopt_int(fd, libc::SOL_SOCKET, libc::SO_TYPE) == Some(libc::SOCK_STREAM)
        && sockopt_int(fd, libc::SOL_SOCKET, libc::SO_PROTOCOL) == Some(libc::IPPROTO_TCP)
}

/// The socket's local (`peer == false`) or remote address, IPv4-mapped
/// IPv6 addresses shown as IPv4.
pub fn socket_name(fd: &OwnedFd, peer: bool) -> Option<SocketAddr> {
    // SAFETY: sockaddr_storage is plain old data.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let p = (&mut ss as *mut libc::sockaddr_storage).cast();
    // SAFETY: the buffer and its length are valid.
    let r = unsafe {
        if peer {
            libc::getpeername(fd.as_raw_fd(), p, &mut len)
        } else {
            libc::getsockname(fd.as_raw_fd(), p, &mut len)
        }
    };
    if r != 0 {
        return None;
    }
    match ss.ss_family as i32 {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let a: libc::sockaddr_in = unsafe { std::ptr::read(&ss as *const _ as *const _) };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                u16::from_be(a.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let a: libc::sockaddr_in6 = unsafe { std::ptr::read(&ss as *const _ as *const _) };
            let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
            let port = u16::from_be(a.sin6_port);
            Some(match ip.to_ipv4_mapped() {
                Some(v4) => SocketAddr::V4(SocketAddrV4::new(v4, port)),
                None => SocketAddr::V6(SocketAddrV6::new(ip, port, 0, a.sin6_scope_id)),
            })
        }
        _ => None,
    }
}

/// Our own reference to process `process`'s TCP socket `fd` (through
/// `pidfd_getfd`), and the pidfd it came through. The pidfd names the
/// process that had the pid when it was opened: checked to be `process`
/// itself, not a later one with its pid. Used by the relay (doorbells,
/// liveness) and by the broker (a portless intent's addresses).
pub fn take_tcp_socket(
    process: &crate::identity::ProcessId,
    fd: i32,
) -> io::Result<(OwnedFd, OwnedFd)> {
    let pidfd = pidfd_open(process.pid)?;
    if !process.is_alive() {
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    }
    let sock = pidfd_getfd(&pidfd, fd)?;
    if !is_tcp_socket(&sock) {
        return Err(io::Error::from_raw_os_error(libc::ENOTSOCK));
    }
    Ok((sock, pidfd))
}

/// Binds the unbound socket `fd` to `ip`, port 0 (the kernel picks the
/// port), in the socket's own family: a portless relayed intent, whose
/// stream key needs the client's port before its `connect`.
pub fn bind_to_ip(fd: &OwnedFd, ip: IpAddr) -> io::Result<()> {
    // SAFETY: sockaddr_storage is plain old data.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match (sockopt_int(fd, libc::SOL_SOCKET, libc::SO_DOMAIN), ip) {
        (Some(libc::AF_INET), IpAddr::V4(v4)) => {
            // SAFETY: sockaddr_storage is large enough for a sockaddr_in.
            let a = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in) };
            a.sin_family = libc::AF_INET as libc::sa_family_t;
            a.sin_addr.s_addr = u32::from(v4).to_be();
            std::mem::size_of::<libc::sockaddr_in>()
        }
        (Some(libc::AF_INET6), ip) => {
            let v6 = match ip {
                IpAddr::V4(v4) => v4.to_ipv6_mapped(),
                IpAddr::V6(v6) => v6,
            };
            // SAFETY: sockaddr_storage is large enough for a sockaddr_in6.
            let a = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in6) };
            a.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            a.sin6_addr.s6_addr = v6.octets();
            std::mem::size_of::<libc::sockaddr_in6>()
        }
        _ => return Err(io::Error::from_raw_os_error(libc::EAFNOSUPPORT)),
    };
    // SAFETY: a valid sockaddr of `len` bytes.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&ss as *const libc::sockaddr_storage).cast(),
            len as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Sends one doorbell byte on the pod's socket (to the pod at the other
/// end); never blocks. A full send buffer already holds doorbells.
pub fn ring_doorbell(fd: &OwnedFd) {
    let b = 0u8;
    // SAFETY: one byte from a local.
    unsafe {
        libc::send(
            fd.as_raw_fd(),
            (&b as *const u8).cast(),
            1,
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
}

/// Ends the pod's TCP connection abortively for both pods, as a TCP reset
/// does (a relay failure must never look like a clean end: a transfer cut
/// by it would look complete). `connect(AF_UNSPEC)` on our reference
/// disconnects the socket itself (the kernel's `tcp_disconnect`): it sends
/// an RST to the remote pod (`ECONNRESET` there) and leaves `ECONNRESET`,
/// then `ENOTCONN`, on the local pod's socket, and wakes both pods' poll
/// and epoll sleepers (`POLLERR | POLLHUP`). `SO_LINGER` 0 and a close of
/// our reference would do nothing while the pod holds the socket: ours is
/// not the last reference. If the disconnect fails, `shutdown(SHUT_RDWR)`
/// still ends the connection (end-of-stream, never a hang).
pub fn abort_connection(fd: &OwnedFd) {
    if let Err(e) = disconnect(fd) {
        tracing::warn!(error = %e, "relay: could not reset the pod's connection; shutting it down instead");
        // SAFETY: shutdown on a socket we hold a reference to.
        unsafe { libc::shutdown(fd.as_raw_fd(), libc::SHUT_RDWR) };
    }
}

/// `connect(fd, AF_UNSPEC)`: the socket's connection is reset (see
/// [`abort_connection`]).
fn disconnect(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: sockaddr is plain old data; zeroed is AF_UNSPEC.
    let mut sa: libc::sockaddr = unsafe { std::mem::zeroed() };
    sa.sa_family = libc::AF_UNSPEC as libc::sa_family_t;
    // SAFETY: connect with a local sockaddr of its size.
    let r = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            &sa,
            std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
        )
    };
    check(r as libc::c_long).map(|_| ())
}

/// True when `pid` maps the memfd named `name` (the library maps its
/// channel right after the daemon's answer; a client that timed out before
/// reading the answer never does).
pub fn process_maps_memfd(pid: u32, name: &str) -> bool {
    // A mapping line ends in "/memfd:NAME (deleted)".
    let needle = format!("/memfd:{name} ");
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map(|maps| maps.lines().any(|l| l.contains(&needle)))
        .unwrap_or(false)
}

/// A process other than `except` that maps memfd `name` (a child the pod
/// forked inherits its parent's mappings), if any. Reads every process's
/// maps: used once, when the process that set a connection up exited.
pub fn process_mapping_memfd(name: &str, except: u32) -> Option<u32> {
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != except)
        .find(|&pid| process_maps_memfd(pid, name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{ErrorKind, Read, Write};
    use std::net::{TcpListener, TcpStream};

    /// A connected loopback pair: (the "pod's" end, the remote end).
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    fn read_err(s: &mut TcpStream) -> io::Result<usize> {
        s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        s.read(&mut [0u8; 16])
    }

    /// Our reference is a second fd of the socket, as `pidfd_getfd` gives:
    /// aborting through it resets the connection for both ends while the
    /// "pod" still holds its own fd, and neither sees a clean end.
    #[test]
    fn abort_through_a_second_reference_resets_both_ends() {
        let (mut a, mut b) = pair();
        let ours = OwnedFd::from(a.try_clone().unwrap());
        abort_connection(&ours);
        assert_eq!(
            read_err(&mut b).unwrap_err().kind(),
            ErrorKind::ConnectionReset
        );
        assert_eq!(
            read_err(&mut a).unwrap_err().kind(),
            ErrorKind::ConnectionReset
        );
        // The local end stays failed (ENOTCONN), never end-of-stream.
        assert!(read_err(&mut a).is_err());
        assert!(a.write_all(&[0u8; 4]).is_err());
        drop(ours);
    }

    /// A remote that already closed its side (FIN) still gets the reset:
    /// its unconfirmed bytes did not all arrive.
    #[test]
    fn abort_after_the_remote_closed_its_side_still_resets_it() {
        let (mut a, mut b) = pair();
        b.shutdown(std::net::Shutdown::Write).unwrap();
        assert_eq!(read_err(&mut a).unwrap(), 0);
        let ours = OwnedFd::from(a.try_clone().unwrap());
        abort_connection(&ours);
        assert_eq!(
            read_err(&mut b).unwrap_err().kind(),
            ErrorKind::ConnectionReset
        );
    }

    /// `SO_LINGER` 0 and a close of a second reference do nothing while the
    /// socket's other fd is open: why the relay disconnects instead.
    #[test]
    fn linger_zero_close_of_a_second_reference_resets_nothing() {
        let (mut a, mut b) = pair();
        let ours = OwnedFd::from(a.try_clone().unwrap());
        let l = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        // SAFETY: setsockopt with a local linger struct.
        unsafe {
            libc::setsockopt(
                ours.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&l as *const libc::linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            )
        };
        drop(ours);
        a.write_all(b"still").unwrap();
        let mut got = [0u8; 5];
        b.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"still");
    }
}
