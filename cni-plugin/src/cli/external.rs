//! `flowlane cluster ...` and `flowlane demo ...`: run by the
//! `flowlane-cluster` binary (`deploy/local/`), which this one executes with
//! the same arguments, the way `git` runs its subcommands. The plugin binary
//! stays small: it does not link the local cluster or the workloads.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The binary that carries the heavy commands.
pub const BINARY: &str = "flowlane-cluster";

/// Replaces this process with `flowlane-cluster COMMAND ARGS` (`cluster` or
/// `demo`, and the rest of the command line as the person typed it: that
/// binary parses it). Returns only on failure, with the exit code.
pub fn exec(command: &str, args: &[OsString]) -> i32 {
    let Some(exe) = find(
        std::env::current_exe().ok().as_deref(),
        std::env::var_os("PATH"),
    ) else {
        eprintln!(
            "flowlane {command}: needs the {BINARY} binary, beside flowlane or on PATH; \
             `cargo build --release --workspace` builds it beside flowlane"
        );
        return 127;
    };
    let err = Command::new(&exe).arg(command).args(args).exec();
    eprintln!("flowlane {command}: running {}: {err}", exe.display());
    126
}

/// `flowlane-cluster` beside the running executable, else the first on `path`.
fn find(current_exe: Option<&Path>, path: Option<OsString>) -> Option<PathBuf> {
    let beside = current_exe
        .and_then(Path::parent)
        .map(|dir| dir.join(BINARY));
    let on_path = path
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(BINARY))
        .collect::<Vec<_>>();
    beside.into_iter().chain(on_path).find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn executable(dir: &Path) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = dir.join(BINARY);
        std::fs::write(&p, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("cg-external-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn beside_the_executable_first_then_path() {
        let here = temp_dir("here");
        let there = temp_dir("there");
        let on_path = executable(&there);
        let path = Some(OsString::from(there.as_os_str()));
        let exe = here.join("flowlane");
        assert_eq!(find(Some(&exe), path.clone()), Some(on_path));
        let beside = executable(&here);
        assert_eq!(find(Some(&exe), path), Some(beside));
        let _ = std::fs::remove_dir_all(&here);
        let _ = std::fs::remove_dir_all(&there);
    }

    #[test]
    fn absent_or_not_executable_is_none() {
        let d = temp_dir("none");
        std::fs::write(d.join(BINARY), "not executable").unwrap();
        let path = Some(OsString::from(d.as_os_str()));
        assert_eq!(find(Some(&d.join("flowlane")), path), None);
        let _ = std::fs::remove_dir_all(&d);
    }
}
