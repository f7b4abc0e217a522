//! flowlane's kernel networking over netlink, shared by the CNI plugin and
//! `flowlaned`: a small synchronous rtnetlink client ([`rt`]) and just
//! enough of nf_tables ([`nft`]) for flowlane's masquerade rules. No `ip`,
//! `nft` or `iptables` processes.

pub mod exempt;
pub mod nft;
pub mod route;
pub mod rt;

pub use rt::RtNetlink;

/// The errno of a netlink failure, if it carries one.
pub fn errno(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}
