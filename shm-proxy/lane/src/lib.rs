//! What the preload library, `flowlaned` and the CNI plugin share: the
//! shared-memory ring format and the daemon's wire protocol.

pub mod client;
pub mod copy;
pub mod fallback;
pub mod notify;
pub mod offer;
pub mod peer_table;
pub mod proto;
pub mod region;
pub mod ring;
