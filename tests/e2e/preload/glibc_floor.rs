//! The preload library flowlane ships loads in images with glibc 2.17 or
//! later: every glibc symbol version it needs is at most `GLIBC_2.17`
//! (`shm-proxy/preload/ship.sh` links it against zig's glibc 2.17 stubs).
//! A library built against the build machine's glibc needs that glibc's
//! versions (2.34 and later on Debian 12), and an image with an older one
//! then fails at exec: "version `GLIBC_2.34' not found".

use std::process::Command;

use flowlane_e2e::binaries;

const FLOOR: (u32, u32) = (2, 17);

/// `(GLIBC_x.y)` versions in `objdump -T` output, with the symbol of each.
fn glibc_versions(objdump: &str) -> Vec<((u32, u32), String)> {
    objdump
        .lines()
        .filter_map(|l| {
            let start = l.find("(GLIBC_")? + "(GLIBC_".len();
            let end = start + l[start..].find(')')?;
            let mut parts = l[start..end].split('.');
            let major = parts.next()?.parse().ok()?;
            let minor = parts.next()?.parse().ok()?;
            let symbol = l.split_whitespace().last()?.to_string();
            Some(((major, minor), symbol))
        })
        .collect()
}

fn objdump_t(path: &std::path::Path) -> String {
    let out = Command::new("objdump")
        .arg("-T")
        .arg(path)
        .output()
        .expect("objdump (binutils)");
    assert!(out.status.success(), "objdump -T {}", path.display());
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_shipped_preload_needs_no_glibc_newer_than_2_17() {
    let _turn = crate::turn::take(module_path!());
    let lib = binaries::shipped_preload();
    let dump = objdump_t(&lib);
    let versions = glibc_versions(&dump);
    assert!(
        versions.len() > 20,
        "no glibc symbol versions read from {}:\n{dump}",
        lib.display()
    );
    let newer: Vec<_> = versions.iter().filter(|(v, _)| *v > FLOOR).collect();
    assert!(
        newer.is_empty(),
        "{} needs glibc newer than {}.{}: {newer:?}",
        lib.display(),
        FLOOR.0,
        FLOOR.1
    );
    assert!(
        !dump.contains("GLIBC_PRIVATE"),
        "GLIBC_PRIVATE symbols change between glibc builds"
    );
    let floor = versions.iter().map(|(v, _)| *v).max().unwrap();
    println!(
        "shipped preload: glibc floor {}.{} ({} versioned glibc imports)",
        floor.0,
        floor.1,
        versions.len()
    );
    // It is the library, with the calls it interposes exported.
    for sym in [
        "connect",
        "accept4",
        "epoll_wait",
        "recv",
        "sendmsg",
        "close",
    ] {
        assert!(
            dump.lines()
                .any(|l| l.contains(" .text") && l.split_whitespace().last() == Some(sym)),
            "{sym} not exported by {}",
            lib.display()
        );
    }
    // And it loads (here: glibc of the build machine).
    let st = Command::new("/bin/true")
        .env("LD_PRELOAD", &lib)
        .status()
        .unwrap();
    assert!(st.success(), "/bin/true with the shipped preload: {st}");
}

#[test]
fn glibc_versions_are_read_from_objdump() {
    let _turn = crate::turn::take(module_path!());
    let sample = "\
0000000000000000      DF *UND*\t0000000000000000 (GLIBC_2.2.5) memcpy
0000000000000000      DF *UND*\t0000000000000000 (GLIBC_2.34) pthread_create
0000000000012340 g    DF .text\t0000000000000042  Base        connect
";
    assert_eq!(
        glibc_versions(sample),
        vec![
            ((2, 2), "memcpy".to_string()),
            ((2, 34), "pthread_create".to_string())
        ]
    );
}
