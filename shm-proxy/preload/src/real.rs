//! The real libc functions, found with `dlsym(RTLD_NEXT)` on first use.
//!
//! Every wrapper in this library calls these, never `libc::*` for an
//! interposed name (that would resolve back to the wrapper). Resolution is
//! lazy and race-free (a benign race stores the same pointer twice);
//! `dlsym` does not call any function this library interposes.

use libc::{
    c_int, c_long, c_uint, c_ulong, c_void, iovec, msghdr, off_t, size_t, sockaddr, socklen_t,
    ssize_t,
};
use std::sync::atomic::{AtomicPtr, Ordering};

fn resolve(name: &'static [u8]) -> *mut c_void {
    // SAFETY: `name` is a NUL-terminated literal; RTLD_NEXT is valid in a shared object.
    unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr().cast()) }
}

macro_rules! real_fns {
    ($( fn $name:ident ( $($arg:ident : $ty:ty),* ) -> $ret:ty; )*) => {
        $(
            /// The next definition of this libc function.
            ///
            /// # Safety
            /// Same contract as the libc function of this name.
            pub unsafe fn $name($($arg: $ty),*) -> $ret {
                static PTR: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
                let mut p = PTR.load(Ordering::Relaxed);
                if p.is_null() {
                    p = resolve(concat!(stringify!($name), "\0").as_bytes());
                    if p.is_null() {
                        // SAFETY: errno is thread-local and always valid.
                        unsafe { *libc::__errno_location() = libc::ENOSYS };
                        return -1 as $ret;
                    }
                    PTR.store(p, Ordering::Relaxed);
                }
                // SAFETY: dlsym returned the libc function with this exact C signature.
                let f: unsafe extern "C" fn($($ty),*) -> $ret = unsafe { std::mem::transmute(p) };
                // SAFETY: forwarded caller contract.
                unsafe { f($($arg),*) }
            }
        )*
    };
}

real_fns! {
    fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int;
    fn listen(fd: c_int, backlog: c_int) -> c_int;
    fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    fn accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int;
    fn close(fd: c_int) -> c_int;
    fn socket(domain: c_int, ty: c_int, proto: c_int) -> c_int;
    fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int;
    fn setns(fd: c_int, nstype: c_int) -> c_int;
    fn unshare(flags: c_int) -> c_int;
    fn shutdown(fd: c_int, how: c_int) -> c_int;
    fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t;
    fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t;
    fn readv(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t;
    fn writev(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t;
    fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t;
    fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t;
    fn recvfrom(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> ssize_t;
    fn sendto(fd: c_int, buf: *const c_void, n: size_t, flags: c_int, addr: *const sockaddr, len: socklen_t) -> ssize_t;
    fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t;
    fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t;
    fn __read_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t) -> ssize_t;
    fn __recv_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t, flags: c_int) -> ssize_t;
    fn __recvfrom_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t, flags: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> ssize_t;
    fn poll(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int) -> c_int;
    fn __poll_chk(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int, fdslen: size_t) -> c_int;
    fn ppoll(fds: *mut libc::pollfd, n: libc::nfds_t, ts: *const libc::timespec, mask: *const libc::sigset_t) -> c_int;
    fn select(n: c_int, r: *mut libc::fd_set, w: *mut libc::fd_set, e: *mut libc::fd_set, tv: *mut libc::timeval) -> c_int;
    fn pselect(n: c_int, r: *mut libc::fd_set, w: *mut libc::fd_set, e: *mut libc::fd_set, ts: *const libc::timespec, mask: *const libc::sigset_t) -> c_int;
    fn epoll_create(size: c_int) -> c_int;
    fn epoll_create1(flags: c_int) -> c_int;
    fn epoll_ctl(epfd: c_int, op: c_int, fd: c_int, ev: *mut libc::epoll_event) -> c_int;
    fn epoll_wait(epfd: c_int, ev: *mut libc::epoll_event, max: c_int, timeout: c_int) -> c_int;
    fn epoll_pwait(epfd: c_int, ev: *mut libc::epoll_event, max: c_int, timeout: c_int, mask: *const libc::sigset_t) -> c_int;
    fn epoll_pwait2(epfd: c_int, ev: *mut libc::epoll_event, max: c_int, ts: *const libc::timespec, mask: *const libc::sigset_t) -> c_int;
    fn fcntl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int;
    fn fcntl64(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int;
    fn ioctl(fd: c_int, req: c_ulong, arg: c_ulong) -> c_int;
    fn dup(fd: c_int) -> c_int;
    fn dup2(old: c_int, new: c_int) -> c_int;
    fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int;
    fn sendfile(out: c_int, inp: c_int, off: *mut off_t, n: size_t) -> ssize_t;
    fn sendfile64(out: c_int, inp: c_int, off: *mut off_t, n: size_t) -> ssize_t;
    fn splice(fd_in: c_int, off_in: *mut libc::loff_t, fd_out: c_int, off_out: *mut libc::loff_t, len: size_t, flags: c_uint) -> ssize_t;
    fn setsockopt(fd: c_int, level: c_int, name: c_int, val: *const c_void, len: socklen_t) -> c_int;
    fn getsockopt(fd: c_int, level: c_int, name: c_int, val: *mut c_void, len: *mut socklen_t) -> c_int;
    fn pwrite(fd: c_int, buf: *const c_void, n: size_t, off: off_t) -> ssize_t;
    fn pread(fd: c_int, buf: *mut c_void, n: size_t, off: off_t) -> ssize_t;
    // Variadic in C; on x86-64 and AArch64 Linux integer arguments travel in
    // the same registers either way, and glibc's `syscall` is assembly that
    // takes exactly these seven.
    fn syscall(n: c_long, a1: c_long, a2: c_long, a3: c_long, a4: c_long, a5: c_long, a6: c_long) -> c_long;
}
