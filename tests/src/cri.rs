//! A private containerd with its CRI plugin (the kubelet's path to CNI),
//! driven over its gRPC socket, with images built locally (no registry is
//! reachable here): a busybox root filesystem packed as an OCI image tarball.
//!
//! The CRI v1 proto is vendored in `tests/cri/api.proto`; the client is
//! `tests/cri/cri_client.py` (Debian's python3-grpcio), whose protobuf module
//! is generated with `protoc` when [`Containerd::start`] runs.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use crate::process::{self, ChildGuard};

/// Directory of the vendored proto and the client.
pub fn cri_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("cri")
}

/// Python with Debian's grpcio/protobuf (not a pyenv one on PATH).
pub const PYTHON: &str = "/usr/bin/python3";

/// Builds a minimal root filesystem at `root`: busybox-static with its applets,
/// `/etc/passwd`, and `lib`/`lib64` pointing into `/usr` so that binaries of
/// the host run when the host's `/usr` is bind-mounted.
pub fn busybox_rootfs(root: &Path) -> std::io::Result<()> {
    for d in [
        "bin", "usr", "etc", "proc", "sys", "dev", "tmp", "run", "var", "root", "www",
    ] {
        fs::create_dir_all(root.join(d))?;
    }
    symlink("usr/lib", root.join("lib"))?;
    symlink("usr/lib64", root.join("lib64"))?;
    symlink("bin", root.join("sbin"))?;
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("busybox-static installed");
    fs::copy(busybox, root.join("bin/busybox"))?;
    let list = process::sh(&[busybox, "--list"])
        .expect_ok("busybox --list")
        .stdout;
    for applet in list.lines().filter(|a| !a.is_empty() && *a != "busybox") {
        let link = root.join("bin").join(applet);
        if !link.exists() {
            symlink("busybox", link)?;
        }
    }
    fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n")?;
    fs::write(root.join("etc/group"), "root:x:0:\n")?;
    fs::write(root.join("www/index.html"), "flowlane-cri-ok\n")?;
    Ok(())
}

fn sha256_file(path: &Path) -> String {
    let out = process::sh(&["sha256sum", &path.display().to_string()]).expect_ok("sha256sum");
    out.stdout.split_whitespace().next().unwrap().to_string()
}

/// Moves `file` into `blobs/sha256/<digest>`; returns (digest, size).
fn add_blob(layout: &Path, file: &Path) -> (String, u64) {
    let digest = sha256_file(file);
    let size = fs::metadata(file).unwrap().len();
    fs::rename(file, layout.join("blobs/sha256").join(&digest)).unwrap();
    (digest, size)
}

/// Writes an OCI image layout tarball (one uncompressed layer of `rootfs`)
/// named `name` (e.g. `docker.io/library/flt-pause:1`) with `cmd` as its
/// command, importable with `ctr image import`.
pub fn oci_image_tar(rootfs: &Path, out: &Path, name: &str, cmd: &[&str]) {
    oci_image_tar_with_env(rootfs, out, name, cmd, &[]);
}

/// As [`oci_image_tar`], with `env` (`NAME=value`) added to the image
/// config's `Env` (an image's own `ENV` lines).
pub fn oci_image_tar_with_env(rootfs: &Path, out: &Path, name: &str, cmd: &[&str], env: &[&str]) {
    let layout = out.with_extension("layout");
    fs::create_dir_all(layout.join("blobs/sha256")).unwrap();
    let layer = layout.join("layer.tar");
    process::sh(&[
        "tar",
        "-C",
        &rootfs.display().to_string(),
        "--numeric-owner",
        "--owner=0",
        "--group=0",
        "-cf",
        &layer.display().to_string(),
        ".",
    ])
    .expect_ok("tar layer");
    let (layer_digest, layer_size) = add_blob(&layout, &layer);
    let mut image_env =
        vec!["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string()];
    image_env.extend(env.iter().map(|e| e.to_string()));
    let config = json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": image_env, "Cmd": cmd},
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{layer_digest}")]},
    });
    let cfile = layout.join("config.json");
    fs::write(&cfile, serde_json::to_vec(&config).unwrap()).unwrap();
    let (cdigest, csize) = add_blob(&layout, &cfile);
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": format!("sha256:{cdigest}"), "size": csize},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": format!("sha256:{layer_digest}"), "size": layer_size}],
    });
    let mfile = layout.join("manifest.json");
    fs::write(&mfile, serde_json::to_vec(&manifest).unwrap()).unwrap();
    let (mdigest, msize) = add_blob(&layout, &mfile);
    let tag = name.rsplit(':').next().unwrap();
    let index = json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": format!("sha256:{mdigest}"), "size": msize,
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": tag},
        }],
    });
    fs::write(
        layout.join("index.json"),
        serde_json::to_vec(&index).unwrap(),
    )
    .unwrap();
    fs::write(
        layout.join("oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .unwrap();
    process::sh(&[
        "tar",
        "-C",
        &layout.display().to_string(),
        "-cf",
        &out.display().to_string(),
        "oci-layout",
        "index.json",
        "blobs",
    ])
    .expect_ok("tar image");
    let _ = fs::remove_dir_all(&layout);
}

/// Settings of a private containerd.
#[derive(Debug, Clone)]
pub struct ContainerdConfig {
    /// Everything (root, state, socket, config, logs) lives below this directory.
    pub dir: PathBuf,
    /// CRI's CNI `bin_dir` (one directory: the plugin, its IPAM, `loopback`).
    pub cni_bin_dir: PathBuf,
    /// CRI's CNI `conf_dir`.
    pub cni_conf_dir: PathBuf,
    /// Image used as the pod sandbox ("pause") container.
    pub sandbox_image: String,
}

/// A running private containerd (killed, with its shims, on drop).
pub struct Containerd {
    pub config: ContainerdConfig,
    pub socket: PathBuf,
    pb_dir: PathBuf,
    child: Option<ChildGuard>,
}

impl Containerd {
    /// Writes the config, generates the client's protobuf module, starts
    /// containerd and waits until its CRI plugin answers.
    pub fn start(config: ContainerdConfig) -> Self {
        let dir = &config.dir;
        let socket = dir.join("containerd.sock");
        let pb_dir = dir.join("pb");
        fs::create_dir_all(&pb_dir).unwrap();
        let proto_dir = cri_dir();
        process::sh(&[
            "protoc",
            "-I",
            &proto_dir.display().to_string(),
            &format!("--python_out={}", pb_dir.display()),
            &proto_dir.join("api.proto").display().to_string(),
        ])
        .expect_ok("protoc (protobuf-compiler) on the CRI proto");
        // restrict_oom_score_adj: this machine's root lacks CAP_SYS_RESOURCE and
        // runc fails to lower the pause container's oom_score_adj without it.
        let toml = format!(
            r#"version = 2
root = "{d}/root"
state = "{d}/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[debug]
  level = "info"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{bin}"
    conf_dir = "{conf}"
    max_conf_num = 1
"#,
            d = dir.display(),
            sock = socket.display(),
            pause = config.sandbox_image,
            bin = config.cni_bin_dir.display(),
            conf = config.cni_conf_dir.display(),
        );
        let cfg = dir.join("containerd.toml");
        fs::write(&cfg, toml).unwrap();
        let log = fs::File::create(dir.join("containerd.log")).unwrap();
        let child = Command::new("containerd")
            .arg("--config")
            .arg(&cfg)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start containerd (package containerd)");
        let mut me = Containerd {
            config,
            socket,
            pb_dir,
            child: Some(ChildGuard::new(child)),
        };
        let ready = crate::wait::until(Duration::from_secs(60), || {
            me.try_call("Status", &json!({}))
                .map(|v| {
                    v["status"]["conditions"]
                        .as_array()
                        .is_some_and(|c| c.iter().all(|c| c["status"] == true))
                })
                .unwrap_or(false)
        });
        if !ready {
            let log = fs::read_to_string(me.config.dir.join("containerd.log")).unwrap_or_default();
            me.shutdown();
            panic!("containerd CRI not ready (runtime + network) within 60 s; log:\n{log}");
        }
        me
    }

    /// containerd's pid.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.pid())
    }

    /// Calls a CRI method; `Err` carries the gRPC error text.
    pub fn try_call(&self, method: &str, request: &Value) -> Result<Value, String> {
        let mut cmd = Command::new(PYTHON);
        cmd.arg(cri_dir().join("cri_client.py"))
            .arg(&self.socket)
            .arg(method)
            .arg(request.to_string())
            .env("CRI_PB_DIR", &self.pb_dir);
        let out = process::run(&mut cmd, Duration::from_secs(120)).map_err(|e| e.to_string())?;
        if !out.success() {
            return Err(format!("{method}: {}{}", out.stderr, out.stdout));
        }
        serde_json::from_str(out.stdout.trim())
            .map_err(|e| format!("{method}: bad JSON {e}: {}", out.stdout))
    }

    /// Calls a CRI method; panics on error.
    pub fn call(&self, method: &str, request: &Value) -> Value {
        self.try_call(method, request).unwrap_or_else(|e| {
            panic!(
                "CRI {e}\ncontainerd log tail:\n{}",
                tail(&self.config.dir.join("containerd.log"), 40)
            )
        })
    }

    /// Imports an OCI image tarball into the CRI namespace (`k8s.io`).
    pub fn import_image(&self, tar: &Path) {
        process::sh(&[
            "ctr",
            "--address",
            &self.socket.display().to_string(),
            "-n",
            "k8s.io",
            "image",
            "import",
            &tar.display().to_string(),
        ])
        .expect_ok("ctr image import");
    }

    /// Stops and removes every pod sandbox (best effort).
    pub fn remove_all_pods(&self) {
        if let Ok(list) = self.try_call("ListPodSandbox", &json!({})) {
            for p in list["items"].as_array().cloned().unwrap_or_default() {
                let id = json!({"pod_sandbox_id": p["id"]});
                let _ = self.try_call("StopPodSandbox", &id);
                let _ = self.try_call("RemovePodSandbox", &id);
            }
        }
    }

    /// Pids of containerd shims serving this instance (their command line
    /// names our socket).
    pub fn shim_pids(&self) -> Vec<u32> {
        let needle = self.socket.display().to_string();
        let mut pids = Vec::new();
        for e in fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            if Some(pid) == self.pid() {
                continue;
            }
            if let Ok(cmd) = fs::read(e.path().join("cmdline")) {
                let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
                if cmd.contains("containerd-shim") && cmd.contains(&needle) {
                    pids.push(pid);
                }
            }
        }
        pids
    }

    /// Stops containerd (SIGTERM, then SIGKILL) and kills any shim it left.
    pub fn shutdown(&mut self) {
        let shims = self.shim_pids();
        if let Some(mut c) = self.child.take() {
            c.terminate(Duration::from_secs(10));
        }
        for pid in shims {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        unmount_below(&self.config.dir);
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.remove_all_pods();
            self.shutdown();
        }
    }
}

/// Lazily unmounts every mount point below `dir` (deepest first).
pub fn unmount_below(dir: &Path) {
    let prefix = format!("{}/", dir.display());
    let mounts = fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mut points: Vec<&str> = mounts
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter(|p| p.starts_with(&prefix))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for p in points {
        let _ = process::sh(&["umount", "-l", p]);
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let s = fs::read_to_string(path).unwrap_or_default();
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// A sandbox config for a pod named `name` in k8s namespace `namespace`
/// (CRI turns these into `K8S_POD_NAME`/`K8S_POD_NAMESPACE`/`K8S_POD_UID`).
pub fn pod_sandbox_config(name: &str, namespace: &str, log_dir: &Path) -> Value {
    json!({
        "metadata": {"name": name, "uid": format!("uid-{name}"), "namespace": namespace, "attempt": 0},
        "hostname": name,
        "log_directory": log_dir.join(name).display().to_string(),
        "linux": {"security_context": {"namespace_options": {"network": "POD"}}},
    })
}
