//! Kernel networking through rtnetlink only (no `ip` processes): links,
//! addresses and routes, on a socket per network namespace.

pub mod address;
pub mod link;
pub mod route;
pub mod socket;

pub use socket::RtNetlink;

/// The errno of a netlink failure, if it carries one.
pub fn errno(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}
