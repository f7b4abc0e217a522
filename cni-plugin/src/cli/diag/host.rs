//! What the node offers training jobs: locked-memory and file limits (of
//! the daemon when it runs, else of this shell), hugepages, GPUs.

use std::path::Path;

use super::report::Section;

/// RDMA registers the rings with the NIC, which pins them: the daemon
/// needs at least this much lockable memory for a useful number of lanes.
const MEMLOCK_NEEDED: u64 = 64 << 20;

pub fn check(daemon_pid: Option<i32>, rdma_present: bool) -> Section {
    let mut s = Section::new("host", "Limits, hugepages, GPUs");
    let (whose, memlock, nofile) = match daemon_pid.and_then(proc_limits) {
        Some((m, n)) => ("flowlaned", m, n),
        None => (
            "this shell",
            own_limit(libc::RLIMIT_MEMLOCK),
            own_limit(libc::RLIMIT_NOFILE),
        ),
    };
    let show = |v: Option<u64>| match v {
        None => "unlimited".to_string(),
        Some(b) if b >= 1 << 20 => format!("{} MiB", b >> 20),
        Some(b) => format!("{b}"),
    };
    let low = matches!(memlock, Some(m) if m < MEMLOCK_NEEDED);
    if rdma_present && low {
        s.warn(
            "host.memlock_low",
            format!(
                "memlock limit of {whose}: {} (RDMA pins ring memory)",
                show(memlock)
            ),
            "give flowlaned a higher RLIMIT_MEMLOCK (LimitMEMLOCK=infinity in its unit, or the \
             container's ulimit; pods need nothing)",
        );
    } else {
        s.info(
            "host.memlock",
            format!("memlock limit of {whose}: {}", show(memlock)),
        );
    }
    s.info(
        "host.nofile",
        format!(
            "open-files limit of {whose}: {}",
            nofile.map(|n| n.to_string()).unwrap_or("unlimited".into())
        ),
    );

    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |k: &str| {
        meminfo
            .lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    let (total, free, size) = (
        field("HugePages_Total:"),
        field("HugePages_Free:"),
        field("Hugepagesize:"),
    );
    s.info(
        "host.hugepages",
        format!(
            "hugepages: {} total, {} free, {} kB each",
            total.unwrap_or(0),
            free.unwrap_or(0),
            size.unwrap_or(0)
        ),
    );

    let gpus = gpu_devices(Path::new("/dev"));
    if gpus.is_empty() {
        s.info("host.gpus", "no NVIDIA GPUs (/dev/nvidia[0-9]*)");
    } else {
        s.info(
            "host.gpus",
            format!("{} NVIDIA GPU(s): {}", gpus.len(), gpus.join(", ")),
        );
    }
    s.data = serde_json::json!({
        "limits_of": whose,
        "memlock_bytes": memlock,
        "nofile": nofile,
        "hugepages_total": total,
        "hugepages_free": free,
        "hugepage_kb": size,
        "gpus": gpus,
    });
    s
}

/// Soft limit of this process; `None` = unlimited.
fn own_limit(resource: libc::__rlimit_resource_t) -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit for getrlimit to fill.
    let rc = unsafe { libc::getrlimit(resource, &mut lim) };
    if rc != 0 || lim.rlim_cur == libc::RLIM_INFINITY {
        None
    } else {
        Some(lim.rlim_cur)
    }
}

/// Soft memlock and nofile limits of another process from `/proc/PID/limits`.
fn proc_limits(pid: i32) -> Option<(Option<u64>, Option<u64>)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
    let soft = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let v = line[name.len()..].split_whitespace().next()?;
        v.parse().ok()
    };
    Some((soft("Max locked memory"), soft("Max open files")))
}

fn gpu_devices(dev: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dev)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| {
                    n.strip_prefix("nvidia")
                        .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}
