//! Logs go to `logFile` (appended) or stderr; stdout belongs to the
//! protocol. Level from `FLOWLANE_LOG` (default "info").

use std::fs::OpenOptions;
use std::sync::Mutex;

use tracing_subscriber::EnvFilter;

pub fn init(log_file: Option<&str>) {
    let filter = EnvFilter::try_from_env("FLOWLANE_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false);
    let file = log_file.and_then(|p| {
        if let Some(dir) = std::path::Path::new(p).parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        OpenOptions::new().create(true).append(true).open(p).ok()
    });
    let _ = match file {
        Some(f) => builder.with_writer(Mutex::new(f)).try_init(),
        None => builder.with_writer(std::io::stderr).try_init(),
    };
}
