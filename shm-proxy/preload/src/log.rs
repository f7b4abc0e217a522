//! Diagnostics to stderr, only when `FLOWLANE_LOG` is set.
//!
//! Not `tracing`: this code runs inside arbitrary application processes; a
//! global subscriber there would be a second logging system in someone
//! else's program. The library writes one line per event straight to fd 2
//! with the real `write`, and nothing at all unless asked to.

use crate::{config, real};

/// Writes one line if `level` is enabled.
pub fn emit(level: u8, args: std::fmt::Arguments<'_>) {
    if config::get().log_level < level {
        return;
    }
    let tag = ["", "ERROR", "WARN", "INFO", "DEBUG"][level.min(4) as usize];
    // SAFETY: getpid has no preconditions.
    let line = format!("flowlane[{}] {tag}: {args}\n", unsafe { libc::getpid() });
    // SAFETY: writing a live buffer of the given length to stderr.
    unsafe { real::write(2, line.as_ptr().cast(), line.len()) };
}

macro_rules! log_at {
    ($lvl:expr, $($arg:tt)*) => {
        if $crate::config::get().log_level >= $lvl {
            $crate::log::emit($lvl, format_args!($($arg)*));
        }
    };
}
pub(crate) use log_at;
