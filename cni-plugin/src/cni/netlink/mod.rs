//! Kernel networking through rtnetlink only (no `ip` processes): links,
//! addresses and routes, on a socket per network namespace.

pub mod address;
pub mod link;
pub mod route;

pub use flowlane_netlink::{errno, RtNetlink};
