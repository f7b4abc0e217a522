//! The interposed libc symbols. Each one is a thin shell: calls on fds the
//! library does not manage go straight to the real function after one bit
//! test; the rest is delegated to `setup`, `conn` and `wait`. Every body
//! runs under `catch_unwind`, so no panic crosses into C.

use crate::conn::{errno, set_errno, Conn, Settle};
use crate::state::{self, CONN_FDS, EPOLL_FDS, EPOLL_SEEN, LISTEN_FDS, UNCONNECTED};
use crate::{config, real, setup, wait};
use libc::{
    c_int, c_uint, c_ulong, c_void, iovec, msghdr, off_t, size_t, sockaddr, socklen_t, ssize_t,
};
use std::io::IoSlice;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// Runs `body`; a panic becomes `-1`/`EIO`.
fn guard<R: From<i8>>(body: impl FnOnce() -> R) -> R {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|_| {
        set_errno(libc::EIO);
        R::from(-1)
    })
}

/// Converts a ring result to the C convention; EPIPE raises SIGPIPE like
/// the kernel does unless MSG_NOSIGNAL.
fn ret(r: Result<usize, c_int>, flags: c_int, sigpipe: bool) -> ssize_t {
    match r {
        Ok(n) => n as ssize_t,
        Err(e) => {
            if e == libc::EPIPE && sigpipe && flags & libc::MSG_NOSIGNAL == 0 {
                // SAFETY: signalling the calling thread, as the kernel would.
                unsafe { libc::pthread_kill(libc::pthread_self(), libc::SIGPIPE) };
            }
            set_errno(e);
            -1
        }
    }
}

/// # Safety
/// `buf` valid for `n` bytes (or n == 0).
unsafe fn buf_mut<'a>(buf: *mut c_void, n: size_t) -> Option<&'a mut [u8]> {
    if n == 0 {
        return Some(&mut []);
    }
    // SAFETY: caller contract.
    (!buf.is_null()).then(|| unsafe { std::slice::from_raw_parts_mut(buf.cast(), n) })
}

/// # Safety
/// `buf` valid for `n` bytes (or n == 0).
unsafe fn buf_ref<'a>(buf: *const c_void, n: size_t) -> Option<&'a [u8]> {
    if n == 0 {
        return Some(&[]);
    }
    // SAFETY: caller contract.
    (!buf.is_null()).then(|| unsafe { std::slice::from_raw_parts(buf.cast(), n) })
}

/// The entries of an iovec array, or `None` for a count the kernel would
/// refuse (or a null array with entries).
///
/// # Safety
/// `iov` valid for `n` entries.
unsafe fn iov_list<'a>(iov: *const iovec, n: c_int) -> Option<&'a [iovec]> {
    if !(0..=libc::UIO_MAXIOV).contains(&n) || (n > 0 && iov.is_null()) {
        return None;
    }
    if n == 0 {
        return Some(&[]);
    }
    // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
    Some(unsafe { std::slice::from_raw_parts(iov, n as usize) })
}

/// # Safety
/// `iov` valid for `n` entries, each valid for its length.
unsafe fn iov_mut<'a>(iov: *const iovec, n: c_int) -> Option<Vec<&'a mut [u8]>> {
    // SAFETY: caller contract for the array and for each entry.
    unsafe { iov_list(iov, n)? }
        .iter()
        // SAFETY: each entry of the caller's array describes its buffer (caller contract).
        .map(|v| unsafe { buf_mut(v.iov_base, v.iov_len) })
        .collect()
}

/// # Safety
/// As `iov_mut`.
unsafe fn iov_ref<'a>(iov: *const iovec, n: c_int) -> Option<Vec<IoSlice<'a>>> {
    // SAFETY: caller contract for the array and for each entry.
    unsafe { iov_list(iov, n)? }
        .iter()
        // SAFETY: each entry of the caller's array describes its buffer (caller contract).
        .map(|v| unsafe { buf_ref(v.iov_base, v.iov_len) }.map(IoSlice::new))
        .collect()
}

fn efault() -> ssize_t {
    set_errno(libc::EFAULT);
    -1
}

/// One-buffer receive (read/recv/recvfrom): no allocation on the hot path.
fn conn_recv1(c: &Conn, fd: c_int, buf: Option<&mut [u8]>, flags: c_int) -> ssize_t {
    match buf {
        Some(b) => ret(c.recv(fd, &mut [b], flags), flags, false),
        None => efault(),
    }
}

/// One-buffer send (write/send/sendto): no allocation on the hot path.
fn conn_send1(c: &Conn, fd: c_int, buf: Option<&[u8]>, flags: c_int) -> ssize_t {
    match buf {
        Some(b) => ret(c.send(fd, &[IoSlice::new(b)], flags), flags, true),
        None => efault(),
    }
}

fn conn_recv(c: &Conn, fd: c_int, bufs: Option<Vec<&mut [u8]>>, flags: c_int) -> ssize_t {
    match bufs {
        Some(mut b) => ret(c.recv(fd, &mut b, flags), flags, false),
        None => efault(),
    }
}

fn conn_send(c: &Conn, fd: c_int, bufs: Option<Vec<IoSlice<'_>>>, flags: c_int) -> ssize_t {
    match bufs {
        Some(b) => ret(c.send(fd, &b, flags), flags, true),
        None => efault(),
    }
}

/// The ring connection on `fd` for a data call with `flags`, or `None` when
/// the fd is (now) plain TCP. A client whose server has not attached yet is
/// settled here: blocking callers wait for the decision.
fn active(fd: c_int, flags: c_int) -> Option<Arc<Conn>> {
    settled(state::conn(fd)?, fd, flags)
}

/// `active` for a connection already looked up.
fn settled(c: Arc<Conn>, fd: c_int, flags: c_int) -> Option<Arc<Conn>> {
    let block =
        flags & libc::MSG_DONTWAIT == 0 && !c.nonblock.load(std::sync::atomic::Ordering::Relaxed);
    match c.settle(fd, block) {
        Settle::Ring | Settle::Pending => Some(c),
        Settle::Tcp => {
            setup::to_tcp(&c);
            None
        }
    }
}

/// The shape of the calls on a connection's fd: an fd the library never
/// managed goes to the real function (`pass`) after one bit test; the rest
/// runs under `guard`: the ring connection serves it (`ring`), or `pass`
/// when the fd is (now) plain TCP. `flags` are the call's MSG_* flags (for
/// `active`).
#[inline(always)]
fn dispatch<R: From<i8>>(
    fd: c_int,
    flags: c_int,
    pass: impl Fn() -> R,
    ring: impl FnOnce(&Conn) -> R,
) -> R {
    if !CONN_FDS.get(fd) {
        return pass();
    }
    guard(|| match active(fd, flags) {
        Some(c) => ring(&c),
        None => pass(),
    })
}

/// `dispatch` for a one-buffer send: a stock client whose server has not
/// attached yet writes into the ring without waiting for the attach when
/// the bytes fit (`Conn::send_before_attach`).
#[inline(always)]
fn dispatch_send(
    fd: c_int,
    buf: Option<&[u8]>,
    flags: c_int,
    pass: impl Fn() -> ssize_t,
) -> ssize_t {
    if !CONN_FDS.get(fd) {
        return pass();
    }
    guard(|| {
        let Some(c) = state::conn(fd) else {
            return pass();
        };
        if let Some(b) = buf {
            if let Some(r) = c.send_before_attach(&[IoSlice::new(b)], flags) {
                return ret(r, flags, true);
            }
        }
        match settled(c, fd, flags) {
            Some(c) => conn_send1(&c, fd, buf, flags),
            None => pass(),
        }
    })
}

// ------------------------------------------------------------ data path

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    dispatch(
        fd,
        0,
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        || unsafe { real::read(fd, buf, n) },
        // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
        |c| conn_recv1(c, fd, unsafe { buf_mut(buf, n) }, 0),
    )
}

#[no_mangle]
pub unsafe extern "C" fn __read_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
) -> ssize_t {
    if !CONN_FDS.get(fd) || n > buflen {
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        return unsafe { real::__read_chk(fd, buf, n, buflen) };
    }
    // SAFETY: the caller's arguments, checked against buflen above.
    unsafe { read(fd, buf, n) }
}

#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    dispatch(
        fd,
        flags,
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        || unsafe { real::recv(fd, buf, n, flags) },
        // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
        |c| conn_recv1(c, fd, unsafe { buf_mut(buf, n) }, flags),
    )
}

#[no_mangle]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
) -> ssize_t {
    if !CONN_FDS.get(fd) || n > buflen {
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        return unsafe { real::__recv_chk(fd, buf, n, buflen, flags) };
    }
    // SAFETY: the caller's arguments, checked against buflen above.
    unsafe { recv(fd, buf, n, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    dispatch(
        fd,
        flags,
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        || unsafe { real::recvfrom(fd, buf, n, flags, addr, len) },
        |c| {
            // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
            let r = conn_recv1(c, fd, unsafe { buf_mut(buf, n) }, flags);
            if r >= 0 && !len.is_null() {
                // TCP does not report a source address.
                // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
                unsafe { *len = 0 };
            }
            r
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    if !CONN_FDS.get(fd) || n > buflen {
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        return unsafe { real::__recvfrom_chk(fd, buf, n, buflen, flags, addr, len) };
    }
    // SAFETY: the caller's arguments, checked against buflen above.
    unsafe { recvfrom(fd, buf, n, flags, addr, len) }
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t {
    dispatch(
        fd,
        0,
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        || unsafe { real::readv(fd, iov, n) },
        // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
        |c| conn_recv(c, fd, unsafe { iov_mut(iov, n) }, 0),
    )
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    dispatch(
        fd,
        flags,
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        || unsafe { real::recvmsg(fd, msg, flags) },
        |c| {
            // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
            let Some(m) = (unsafe { msg.as_mut() }) else {
                return efault();
            };
            let r = conn_recv(
                c,
                fd,
                // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
                unsafe { iov_mut(m.msg_iov, m.msg_iovlen as c_int) },
                flags,
            );
            if r >= 0 {
                m.msg_namelen = 0;
                m.msg_controllen = 0;
                m.msg_flags = 0;
            }
            r
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    dispatch_send(
        fd,
        // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
        unsafe { buf_ref(buf, n) },
        0,
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        || unsafe { real::write(fd, buf, n) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    dispatch_send(
        fd,
        // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
        unsafe { buf_ref(buf, n) },
        flags,
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        || unsafe { real::send(fd, buf, n, flags) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const sockaddr,
    len: socklen_t,
) -> ssize_t {
    // A connected TCP socket ignores the address.
    dispatch_send(
        fd,
        // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
        unsafe { buf_ref(buf, n) },
        flags,
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        || unsafe { real::sendto(fd, buf, n, flags, addr, len) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t {
    dispatch(
        fd,
        0,
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        || unsafe { real::writev(fd, iov, n) },
        // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
        |c| conn_send(c, fd, unsafe { iov_ref(iov, n) }, 0),
    )
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    dispatch(
        fd,
        flags,
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        || unsafe { real::sendmsg(fd, msg, flags) },
        |c| {
            // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
            let Some(m) = (unsafe { msg.as_ref() }) else {
                return efault();
            };
            conn_send(
                c,
                fd,
                // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
                unsafe { iov_ref(m.msg_iov, m.msg_iovlen as c_int) },
                flags,
            )
        },
    )
}

fn sendfile_any(out: c_int, inp: c_int, off: *mut off_t, n: size_t, large: bool) -> ssize_t {
    // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
    let pass = || unsafe {
        if large {
            real::sendfile64(out, inp, off, n)
        } else {
            real::sendfile(out, inp, off, n)
        }
    };
    dispatch(out, 0, pass, |c| {
        let off = if off.is_null() {
            None
        } else {
            // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
            Some(unsafe { &mut *off })
        };
        ret(c.sendfile(out, inp, off, n), 0, true)
    })
}

#[no_mangle]
pub unsafe extern "C" fn sendfile(out: c_int, inp: c_int, off: *mut off_t, n: size_t) -> ssize_t {
    sendfile_any(out, inp, off, n, false)
}

#[no_mangle]
pub unsafe extern "C" fn sendfile64(out: c_int, inp: c_int, off: *mut off_t, n: size_t) -> ssize_t {
    sendfile_any(out, inp, off, n, true)
}

#[no_mangle]
pub unsafe extern "C" fn splice(
    fd_in: c_int,
    off_in: *mut libc::loff_t,
    fd_out: c_int,
    off_out: *mut libc::loff_t,
    len: size_t,
    flags: c_uint,
) -> ssize_t {
    if !CONN_FDS.get(fd_in) && !CONN_FDS.get(fd_out) {
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        return unsafe { real::splice(fd_in, off_in, fd_out, off_out, len, flags) };
    }
    // The bytes of a ring connection are not in the kernel socket: emulate.
    let nonblock = flags & libc::SPLICE_F_NONBLOCK != 0;
    guard(|| {
        if let Some(c) = active(fd_out, 0) {
            // pipe/file -> ring: the sendfile path reads straight into the ring.
            // SAFETY: off_in is null or points to the caller's offset.
            let off = if off_in.is_null() {
                None
            } else {
                // SAFETY: non-null: the caller's offset (see above).
                Some(unsafe { &mut *off_in })
            };
            return ret(c.sendfile(fd_out, fd_in, off, len), 0, true);
        }
        if let Some(c) = active(fd_in, if nonblock { libc::MSG_DONTWAIT } else { 0 }) {
            // ring -> pipe/file: peek, write, then consume what was written.
            let mut buf = vec![0u8; len.min(1 << 16)];
            let peek = libc::MSG_PEEK | if nonblock { libc::MSG_DONTWAIT } else { 0 };
            let n = match c.recv(fd_in, &mut [&mut buf[..]], peek) {
                Ok(n) => n,
                Err(e) => return ret(Err(e), 0, false),
            };
            if n == 0 {
                return 0;
            }
            // SAFETY: writing from our own buffer; off_out is null or the caller's offset.
            let w = unsafe {
                if off_out.is_null() {
                    real::write(fd_out, buf.as_ptr().cast(), n)
                } else {
                    let w = real::pwrite(fd_out, buf.as_ptr().cast(), n, *off_out);
                    if w > 0 {
                        *off_out += w as libc::loff_t;
                    }
                    w
                }
            };
            if w > 0 {
                let _ = c.recv(fd_in, &mut [&mut buf[..w as usize]], libc::MSG_DONTWAIT);
            }
            return w;
        }
        // Both fds turned out to be plain TCP (the attach was abandoned).
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        unsafe { real::splice(fd_in, off_in, fd_out, off_out, len, flags) }
    })
}

// ------------------------------------------------------------ connection life

#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    if setup::in_lib() || config::get().disabled {
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        return unsafe { real::connect(fd, addr, len) };
    }
    guard(|| {
        if CONN_FDS.get(fd) {
            // A repeated connect on a non-blocking socket: pass, note completion.
            // SAFETY: forwards the caller's arguments unchanged (same C contract).
            let r = unsafe { real::connect(fd, addr, len) };
            let e = errno();
            if r == 0 || e == libc::EISCONN {
                if let Some(c) = state::conn(fd) {
                    c.connecting
                        .store(false, std::sync::atomic::Ordering::Release);
                }
            }
            set_errno(e);
            return r;
        }
        let intent =
            // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
            unsafe { setup::decode(addr, len) }.and_then(|dst| setup::client_intent(fd, dst));
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        let r = unsafe { real::connect(fd, addr, len) };
        let e = errno();
        if let Some(i) = intent {
            setup::client_finish(fd, i, r, e);
        }
        // Still recorded: the socket did not take the ring.
        wait::plain_done(fd, false);
        set_errno(e);
        r
    })
}

#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    let ours = !setup::in_lib();
    // Register a bound socket BEFORE the kernel starts accepting: a client
    // that connects the moment listen() returns (workers retrying against a
    // parameter server that is starting) must already find the listener,
    // or its connection would stay on TCP. An unbound socket gets its port
    // from listen() itself, so it is registered afterwards.
    let registered_before = LISTEN_FDS.get(fd);
    if ours && !registered_before {
        guard(|| {
            setup::listener(fd);
            0
        });
    }
    // SAFETY: forwards the caller's arguments unchanged (same C contract).
    let r = unsafe { real::listen(fd, backlog) };
    if ours {
        let e = errno();
        guard(|| {
            if r == 0 {
                setup::listener(fd);
            } else if !registered_before {
                // listen() failed: withdraw what we announced above.
                setup::listener_closed(fd);
            }
            0
        });
        set_errno(e);
    }
    r
}

fn after_accept(listen_fd: c_int, r: c_int, flags: c_int) -> c_int {
    if r >= 0 && !setup::in_lib() {
        let e = errno();
        fresh_fd(r);
        set_errno(e);
    }
    if r >= 0 && LISTEN_FDS.get(listen_fd) && !setup::in_lib() {
        let e = errno();
        guard(|| {
            setup::accepted(listen_fd, r, flags);
            0
        });
        set_errno(e);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: forwards the caller's arguments unchanged (same C contract).
    let r = unsafe { real::accept(fd, addr, len) };
    after_accept(fd, r, 0)
}

#[no_mangle]
pub unsafe extern "C" fn accept4(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    // SAFETY: forwards the caller's arguments unchanged (same C contract).
    let r = unsafe { real::accept4(fd, addr, len, flags) };
    after_accept(fd, r, flags)
}

/// Everything the library tracks about `fd` is dropped, as for a close
/// (without the real close).
fn forget(fd: c_int) {
    forget_as(fd, true);
}

/// The kernel has just handed out `fd` for a new socket (accept, socket):
/// anything the library still tracks under that number belongs to a file
/// that was closed behind its back (a raw `close` system call, e.g. from
/// inline assembly or io_uring) and is dropped without touching the fd,
/// which is now the new socket. Without this the new socket would inherit
/// the old one's ring connection, listener or epoll registrations.
fn fresh_fd(fd: c_int) {
    if fd >= 0 && tracked(fd) {
        guard(|| {
            crate::log::log_at!(
                3,
                "fd {fd}: reused after a close the library did not see; stale state dropped"
            );
            forget_as(fd, false);
            0
        });
    }
}

/// `forget`; `live`: the fd still refers to the tracked file (a close in
/// progress), so the connection's doorbells may be drained through it.
fn forget_as(fd: c_int, live: bool) {
    EPOLL_SEEN.set(fd, false);
    wait::plain_done(fd, true);
    setup::listener_closed(fd);
    state::forget_waker(fd);
    let (regs, waker) = state::remove_epoll(fd);
    drop(regs);
    if let Some(w) = waker {
        // SAFETY: closing the wake eventfd the library made for this set.
        unsafe { real::close(w) };
    }
    let (c, regs) = state::remove(fd);
    drop(regs);
    if let Some(c) = c {
        if c.aliases.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
            c.finish(live.then_some(fd));
            setup::closed(&c);
        }
    }
}

fn tracked(fd: c_int) -> bool {
    CONN_FDS.get(fd)
        || LISTEN_FDS.get(fd)
        || EPOLL_FDS.get(fd)
        || EPOLL_SEEN.get(fd)
        || UNCONNECTED.get(fd)
        || state::EPOLL_INSTANCES.get(fd)
        || state::WAKE_FDS.get(fd)
}

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    if !tracked(fd) || setup::in_lib() {
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        return unsafe { real::close(fd) };
    }
    let saved = errno();
    guard(|| {
        forget(fd);
        0
    });
    set_errno(saved);
    // SAFETY: forwards the caller's arguments unchanged (same C contract).
    unsafe { real::close(fd) }
}

#[no_mangle]
pub unsafe extern "C" fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    if flags & libc::CLOSE_RANGE_CLOEXEC as c_int == 0 && !setup::in_lib() {
        let saved = errno();
        guard(|| {
            forget_range(first, last);
            0
        });
        set_errno(saved);
    }
    // SAFETY: forwards the caller's arguments unchanged (same C contract).
    unsafe { real::close_range(first, last, flags) }
}

/// A thread that enters another network namespace must not use the
/// process's daemon connection (made in the old one): the kept
/// connection's check reads the thread's namespace again after these.
#[no_mangle]
pub unsafe extern "C" fn setns(fd: c_int, nstype: c_int) -> c_int {
    // SAFETY: forwards the caller's arguments unchanged (same C contract).
    let r = unsafe { real::setns(fd, nstype) };
    crate::daemon_conn::netns_may_have_changed();
    r
}

#[no_mangle]
pub unsafe extern "C" fn unshare(flags: c_int) -> c_int {
    // SAFETY: forwards the caller's arguments unchanged (same C contract).
    let r = unsafe { real::unshare(flags) };
    crate::daemon_conn::netns_may_have_changed();
    r
}

#[no_mangle]
pub unsafe extern "C" fn socket(domain: c_int, ty: c_int, proto: c_int) -> c_int {
    // SAFETY: forwards the caller's arguments unchanged (same C contract).
    let r = unsafe { real::socket(domain, ty, proto) };
    if r >= 0 && !setup::in_lib() {
        let e = errno();
        fresh_fd(r);
        wait::new_socket(r, domain, ty, proto);
        set_errno(e);
    }
    r
}

/// `syscall(2)`: programs that close fds with `syscall(SYS_close, fd)`
/// rather than `close` (libuv does, to avoid glibc's cancellation point:
/// Node.js, uvloop) are seen closing them, exactly as through `close` and
/// `close_range`; every other call goes straight through.
///
/// Declared with six fixed arguments: on x86-64 and AArch64 Linux a
/// variadic caller passes integer arguments in the same registers, and
/// extra ones are read as the real `syscall` would read them.
#[cfg(all(
    target_os = "linux",
    any(target_arch = "x86_64", target_arch = "aarch64")
))]
#[no_mangle]
pub unsafe extern "C" fn syscall(
    n: libc::c_long,
    a1: libc::c_long,
    a2: libc::c_long,
    a3: libc::c_long,
    a4: libc::c_long,
    a5: libc::c_long,
    a6: libc::c_long,
) -> libc::c_long {
    if (n == libc::SYS_close || n == libc::SYS_close_range) && !setup::in_lib() {
        let saved = errno();
        guard(|| {
            if n == libc::SYS_close {
                if tracked(a1 as c_int) {
                    forget(a1 as c_int);
                }
            } else if (a3 as c_int) & libc::CLOSE_RANGE_CLOEXEC as c_int == 0 {
                forget_range(a1 as c_uint, a2 as c_uint);
            }
            0
        });
        set_errno(saved);
    }
    // SAFETY: forwards the caller's arguments unchanged (same C contract).
    unsafe { real::syscall(n, a1, a2, a3, a4, a5, a6) }
}

/// Forgets every tracked fd in `first..=last` (a close_range).
fn forget_range(first: c_uint, last: c_uint) {
    let hi = (last as usize).min(state::MAX_FD - 1);
    for fd in (first as usize)..=hi {
        if tracked(fd as c_int) {
            forget(fd as c_int);
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    dispatch(
        fd,
        0,
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        || unsafe { real::shutdown(fd, how) },
        |c| {
            if !matches!(how, libc::SHUT_RD | libc::SHUT_WR | libc::SHUT_RDWR) {
                set_errno(libc::EINVAL);
                return -1;
            }
            c.shutdown(fd, how);
            0
        },
    )
}

/// `new` now refers to the same open file description as `old`.
fn alias(old: c_int, new: c_int) {
    if let Some(c) = state::conn(old) {
        c.aliases.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        drop(state::install(new, c));
    }
    if LISTEN_FDS.get(old) {
        if let Some(addr) = state::with(|t| t.listeners.get(&old).map(|l| l.addr)) {
            state::add_listener(new, addr);
        }
    }
    if EPOLL_SEEN.get(old) {
        EPOLL_SEEN.set(new, true);
    }
    if state::EPOLL_INSTANCES.get(old) {
        state::epoll_dup(old, new);
    }
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // SAFETY: forwards the caller's arguments unchanged (same C contract).
    let r = unsafe { real::dup(fd) };
    if r >= 0 && tracked(fd) {
        guard(|| {
            alias(fd, r);
            0
        });
    }
    r
}

fn dup_to(old: c_int, new: c_int, f: impl FnOnce() -> c_int) -> c_int {
    if old == new || (!tracked(old) && !tracked(new)) {
        return f();
    }
    guard(|| {
        // Check `old` first: dup2 onto a valid fd closes it only if `old` is valid.
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        if unsafe { real::fcntl(old, libc::F_GETFD, 0) } < 0 {
            set_errno(libc::EBADF);
            return -1;
        }
        if tracked(new) {
            forget(new);
        }
        let r = f();
        if r >= 0 {
            let e = errno();
            alias(old, r);
            set_errno(e);
        }
        r
    })
}

#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    // SAFETY: forwards the caller's arguments unchanged (same C contract).
    dup_to(old, new, || unsafe { real::dup2(old, new) })
}

#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    // SAFETY: forwards the caller's arguments unchanged (same C contract).
    dup_to(old, new, || unsafe { real::dup3(old, new, flags) })
}

fn fcntl_any(fd: c_int, cmd: c_int, arg: c_ulong, large: bool) -> c_int {
    // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
    let call = || unsafe {
        if large {
            real::fcntl64(fd, cmd, arg)
        } else {
            real::fcntl(fd, cmd, arg)
        }
    };
    if !tracked(fd) {
        return call();
    }
    guard(|| {
        let r = call();
        if r >= 0 {
            let e = errno();
            match cmd {
                libc::F_SETFL => {
                    if let Some(c) = state::conn(fd) {
                        c.nonblock.store(
                            arg as c_int & libc::O_NONBLOCK != 0,
                            std::sync::atomic::Ordering::Relaxed,
                        );
                    }
                }
                libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => alias(fd, r),
                _ => {}
            }
            set_errno(e);
        }
        r
    })
}

#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    fcntl_any(fd, cmd, arg, false)
}

#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    fcntl_any(fd, cmd, arg, true)
}

#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, req: c_ulong, arg: c_ulong) -> c_int {
    if !CONN_FDS.get(fd) {
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        return unsafe { real::ioctl(fd, req, arg) };
    }
    guard(|| match (state::conn(fd), req) {
        (Some(c), libc::FIONREAD) => {
            if arg == 0 {
                set_errno(libc::EFAULT);
                return -1;
            }
            // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
            unsafe { *(arg as *mut c_int) = c.readable_bytes().min(c_int::MAX as usize) as c_int };
            0
        }
        (Some(c), libc::FIONBIO) => {
            // SAFETY: forwards the caller's arguments unchanged (same C contract).
            let r = unsafe { real::ioctl(fd, req, arg) };
            if r == 0 && arg != 0 {
                c.nonblock.store(
                    // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
                    unsafe { *(arg as *const c_int) } != 0,
                    std::sync::atomic::Ordering::Relaxed,
                );
            }
            r
        }
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        _ => unsafe { real::ioctl(fd, req, arg) },
    })
}

/// TCP_NODELAY/TCP_CORK on a ring connection: remembered for getsockopt,
/// not applied (the socket only carries doorbells, which must not wait).
fn tcp_option(fd: c_int, level: c_int, name: c_int) -> Option<(Arc<Conn>, bool)> {
    if level != libc::IPPROTO_TCP
        || !(name == libc::TCP_NODELAY || name == libc::TCP_CORK)
        || !CONN_FDS.get(fd)
    {
        return None;
    }
    state::conn(fd).map(|c| (c, name == libc::TCP_NODELAY))
}

#[no_mangle]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    guard(|| match tcp_option(fd, level, name) {
        Some((c, nodelay)) if !val.is_null() && len as usize >= std::mem::size_of::<c_int>() => {
            // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
            let v = unsafe { std::ptr::read_unaligned(val as *const c_int) };
            let slot = if nodelay { &c.app_nodelay } else { &c.app_cork };
            slot.store((v != 0) as c_int, std::sync::atomic::Ordering::Relaxed);
            0
        }
        _ => {
            // SAFETY: forwards the caller's arguments unchanged (same C contract).
            let r = unsafe { real::setsockopt(fd, level, name, val, len) };
            if r == 0 && is_taken_over_option(level, name) {
                state::DEFAULT_OPTIONS.set(fd, false);
            }
            if r == 0 {
                // SAFETY: the kernel accepted `val` as this option's value.
                unsafe { note_timeout(fd, level, name, val, len) };
            }
            r
        }
    })
}

/// The options a ring connection takes over from its socket (see
/// `Conn::take_tcp_options`).
fn is_taken_over_option(level: c_int, name: c_int) -> bool {
    use crate::conn::{SO_RCVTIMEO_NEW, SO_SNDTIMEO_NEW};
    match level {
        libc::SOL_SOCKET => matches!(
            name,
            libc::SO_RCVTIMEO | libc::SO_SNDTIMEO | SO_RCVTIMEO_NEW | SO_SNDTIMEO_NEW
        ),
        libc::IPPROTO_TCP => matches!(name, libc::TCP_NODELAY | libc::TCP_CORK),
        _ => false,
    }
}

/// SO_RCVTIMEO/SO_SNDTIMEO the kernel accepted for a ring connection: the
/// library's blocking read/write honour them (getsockopt stays native).
///
/// # Safety
/// `val` must be valid for `len` bytes when the option is one of these.
unsafe fn note_timeout(fd: c_int, level: c_int, name: c_int, val: *const c_void, len: socklen_t) {
    use crate::conn::{SO_RCVTIMEO_NEW, SO_SNDTIMEO_NEW};
    if level != libc::SOL_SOCKET
        || !CONN_FDS.get(fd)
        || val.is_null()
        || (len as usize) < std::mem::size_of::<libc::timeval>()
    {
        return;
    }
    let Some(c) = state::conn(fd) else {
        return;
    };
    let slot = match name {
        libc::SO_RCVTIMEO | SO_RCVTIMEO_NEW => &c.rcv_timeout_us,
        libc::SO_SNDTIMEO | SO_SNDTIMEO_NEW => &c.snd_timeout_us,
        _ => return,
    };
    // SAFETY: caller contract; read unaligned from the caller's buffer.
    let tv = unsafe { std::ptr::read_unaligned(val as *const libc::timeval) };
    slot.store(
        crate::conn::timeval_us(&tv),
        std::sync::atomic::Ordering::Relaxed,
    );
}

#[no_mangle]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    guard(|| match tcp_option(fd, level, name) {
        Some((c, nodelay))
            if !val.is_null()
                && !len.is_null()
                // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
                && unsafe { *len } as usize >= std::mem::size_of::<c_int>() =>
        {
            let slot = if nodelay { &c.app_nodelay } else { &c.app_cork };
            // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
            unsafe {
                std::ptr::write_unaligned(
                    val as *mut c_int,
                    slot.load(std::sync::atomic::Ordering::Relaxed),
                );
                *len = std::mem::size_of::<c_int>() as socklen_t;
            }
            0
        }
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        _ => unsafe { real::getsockopt(fd, level, name, val, len) },
    })
}

// ------------------------------------------------------------ readiness

fn ts_ms(ts: *const libc::timespec) -> c_int {
    if ts.is_null() {
        return -1;
    }
    // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
    let t = unsafe { *ts };
    let ms = t
        .tv_sec
        .saturating_mul(1000)
        .saturating_add((t.tv_nsec + 999_999) / 1_000_000);
    ms.clamp(0, c_int::MAX as i64) as c_int
}

#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int) -> c_int {
    if state::LIVE.load(std::sync::atomic::Ordering::Relaxed) == 0 {
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        return unsafe { real::poll(fds, n, timeout) };
    }
    // SAFETY: the caller's pollfd array of n entries (same C contract).
    guard(|| unsafe { wait::poll(fds, n, timeout, None) })
}

#[no_mangle]
pub unsafe extern "C" fn __poll_chk(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    timeout: c_int,
    fdslen: size_t,
) -> c_int {
    if (n as usize).saturating_mul(std::mem::size_of::<libc::pollfd>()) > fdslen {
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        return unsafe { real::__poll_chk(fds, n, timeout, fdslen) };
    }
    // SAFETY: the caller's arguments, checked against fdslen above.
    unsafe { poll(fds, n, timeout) }
}

#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    if state::LIVE.load(std::sync::atomic::Ordering::Relaxed) == 0 {
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        return unsafe { real::ppoll(fds, n, ts, mask) };
    }
    // SAFETY: the caller's pollfd array of n entries (same C contract).
    guard(|| unsafe { wait::poll(fds, n, ts_ms(ts), Some(mask)) })
}

#[no_mangle]
pub unsafe extern "C" fn select(
    n: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    tv: *mut libc::timeval,
) -> c_int {
    if state::LIVE.load(std::sync::atomic::Ordering::Relaxed) == 0 {
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        return unsafe { real::select(n, r, w, e, tv) };
    }
    guard(|| {
        let ms = if tv.is_null() {
            -1
        } else {
            // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
            let t = unsafe { *tv };
            (t.tv_sec * 1000 + (t.tv_usec + 999) / 1000).clamp(0, c_int::MAX as i64) as c_int
        };
        // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
        match unsafe { wait::select(n, r, w, e, ms, None) } {
            Some(rc) => rc,
            // SAFETY: forwards the caller's arguments unchanged (same C contract).
            None => unsafe { real::select(n, r, w, e, tv) },
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn pselect(
    n: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    if state::LIVE.load(std::sync::atomic::Ordering::Relaxed) == 0 {
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        return unsafe { real::pselect(n, r, w, e, ts, mask) };
    }
    guard(
        // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
        || match unsafe { wait::select(n, r, w, e, ts_ms(ts), Some(mask)) } {
            Some(rc) => rc,
            // SAFETY: forwards the caller's arguments unchanged (same C contract).
            None => unsafe { real::pselect(n, r, w, e, ts, mask) },
        },
    )
}

/// A new epoll fd of the application: remembered so that its duplicates
/// are known to be the same set (see `state::epoll_key`).
fn new_epoll(r: c_int) -> c_int {
    if r >= 0 && !setup::in_lib() {
        let e = errno();
        fresh_fd(r);
        state::EPOLL_INSTANCES.set(r, true);
        set_errno(e);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn epoll_create(size: c_int) -> c_int {
    // SAFETY: forwards the caller's arguments unchanged (same C contract).
    new_epoll(unsafe { real::epoll_create(size) })
}

#[no_mangle]
pub unsafe extern "C" fn epoll_create1(flags: c_int) -> c_int {
    // SAFETY: forwards the caller's arguments unchanged (same C contract).
    new_epoll(unsafe { real::epoll_create1(flags) })
}

#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    ev: *mut libc::epoll_event,
) -> c_int {
    if !CONN_FDS.get(fd) {
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        let r = unsafe { real::epoll_ctl(epfd, op, fd, ev) };
        if r == 0 && (op == libc::EPOLL_CTL_ADD || UNCONNECTED.get(fd)) && !setup::in_lib() {
            let e = errno();
            guard(|| {
                // SAFETY: the caller's event, which the kernel just accepted.
                unsafe { wait::plain_ctl(epfd, op, fd, ev) };
                0
            });
            set_errno(e);
        }
        return r;
    }
    guard(|| match state::conn(fd) {
        // SAFETY: pointers come from the caller under this function's C contract (checked non-null where C would).
        Some(c) => unsafe { wait::epoll_ctl_conn(epfd, op, fd, ev, c) },
        // SAFETY: forwards the caller's arguments unchanged (same C contract).
        None => unsafe { real::epoll_ctl(epfd, op, fd, ev) },
    })
}

#[no_mangle]
pub unsafe extern "C" fn epoll_wait(
    epfd: c_int,
    ev: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
) -> c_int {
    // SAFETY: forwards the caller's arguments (same C contract).
    guard(|| unsafe {
        wait::epoll_entry(epfd, ev, max, timeout, None, || {
            real::epoll_wait(epfd, ev, max, timeout)
        })
    })
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait(
    epfd: c_int,
    ev: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: forwards the caller's arguments (same C contract).
    guard(|| unsafe {
        wait::epoll_entry(epfd, ev, max, timeout, Some(mask), || {
            real::epoll_pwait(epfd, ev, max, timeout, mask)
        })
    })
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait2(
    epfd: c_int,
    ev: *mut libc::epoll_event,
    max: c_int,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: forwards the caller's arguments (same C contract); the
    // library's loop works in milliseconds (rounded up).
    guard(|| unsafe {
        wait::epoll_entry(epfd, ev, max, ts_ms(ts), Some(mask), || {
            real::epoll_pwait2(epfd, ev, max, ts, mask)
        })
    })
}
