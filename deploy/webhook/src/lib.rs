//! flowlane's pod injection webhook: a mutating admission webhook that gives pods which
//! opt in the preload library and the daemon socket (see `inject`), served over HTTPS
//! (see `server`).

pub mod inject;
pub mod server;
pub mod tls;
