//! `libflowlane_preload.so`: loaded into unmodified programs with
//! `LD_PRELOAD`, it moves TCP connections between co-located pods onto
//! shared-memory rings brokered by `flowlaned`, and leaves everything else
//! on TCP. See docs/shm-lane.md for the design, settings and limits.
//!
//! Modules: `exports` (the interposed C symbols, thin), `setup` (daemon
//! round trips at listen/connect/accept), `conn` (one ring connection's
//! read/write/close semantics), `wait` (poll/select/epoll readiness),
//! `state` (fd tables, fork safety), `real` (the next libc definitions),
//! `config` and `log`.

mod config;
mod conn;
mod daemon_conn;
mod endlock;
mod exports;
mod log;
mod peer_table;
mod real;
mod setup;
mod sleepers;
mod spin;
mod state;
mod stock;
mod wait;

/// Runs when the library is loaded: reads the settings, registers the
/// fork handlers, and keeps panics of this library quiet unless logging is
/// on (every exported function catches them and answers like libc would).
extern "C" fn init() {
    let cfg = config::get();
    flowlane_lane::copy::set_streaming_stores(cfg.nt_stores);
    state::install_fork_handlers();
    std::panic::set_hook(Box::new(|info| {
        log::emit(1, format_args!("internal error (contained): {info}"));
    }));
    log::log_at!(
        3,
        "loaded (disabled={}, ring={} bytes (starting at {}), spin={} us, nt stores={}, socket={})",
        cfg.disabled,
        cfg.ring_size,
        cfg.ring_initial,
        cfg.spin_us,
        cfg.nt_stores,
        cfg.socket.display()
    );
}

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;
