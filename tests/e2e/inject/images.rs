//! Injection that is never fatal, under a real runtime: containerd's CRI
//! plugin runs pods whose spec is what the webhook makes of it (its own
//! mutation code, `flowlane_webhook::inject::decide`, applied to a pod spec
//! and translated to CRI container configs the way the kubelet does: env,
//! mounts with subPath, termination-message file, security context), init
//! containers (the probe, in the pod's own image) first, then the app.
//!
//! The images are real userlands built here from Debian packages
//! (`apt-get download` + `dpkg -x`): bookworm's glibc (2.36), bullseye's
//! (2.31), Debian's `musl` loader with a musl-linked client, and a static
//! binary alone. Each client talks to a server pod (bookworm) over TCP; the
//! daemon's counters say whether the connection took the shared-memory lane.
//!
//! A glibc older than the shipped library's floor (2.17) is not served by
//! any registry reachable here, so the "too old" case is the same mechanism
//! one step up: the build machine's library (it needs `GLIBC_2.34`) offered
//! to bullseye's glibc 2.31. The control run shows that without the probe
//! this exact pair fails at exec ("version `GLIBC_2.34' not found"), as the
//! shipped library would in a glibc 2.12 image.
//!
//! Every container starts and exits as its program does; the probes' verdicts
//! reach `flowlane status` (the daemon's stats) and the pod's status (the
//! termination message).
//!
//! The node's library and socket directories reach the pods as the webhook
//! injects them, CSI ephemeral inline volumes: before a pod's sandbox, each is
//! published by flowlane's CSI node plugin (the real `flowlane-csi`, registered
//! and called as the kubelet does, `flowlane_e2e::csi`), and the containers mount
//! the target path the plugin bind-mounted; after the pod is removed, each is
//! unpublished and no mount is left.

use std::collections::BTreeMap;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use flowlane_e2e::binaries::{self, reference_plugin};
use flowlane_e2e::cri::{self, Containerd, ContainerdConfig};
use flowlane_e2e::csi::{mounts_under, CsiPlugin, PodRef};
use flowlane_e2e::fsutil::TempDir;
use flowlane_e2e::host::LinkGuard;
use flowlane_e2e::process::{self, ChildGuard};
use flowlane_lane::client::DaemonClient;
use flowlane_lane::proto::{InjectionVerdict, Stats};
use flowlane_webhook::inject::{self, Scope};
use serde_json::{json, Value};

const PAUSE: &str = "docker.io/library/flt-inj-pause:1";
const BOOKWORM: &str = "docker.io/library/flt-inj-bookworm:1";
const BOOKWORM_ENV: &str = "docker.io/library/flt-inj-bookworm-env:1";
const BULLSEYE: &str = "docker.io/library/flt-inj-bullseye:1";
const MUSL: &str = "docker.io/library/flt-inj-musl:1";
const STATIC: &str = "docker.io/library/flt-inj-static:1";
const SUBNET: &str = "10.247.61.0/24";
const NAMESPACE: &str = "flt-inj";
const PORT: &str = "7461";
const BYTES: &str = "1048576";
const MARKER: &str = "/usr/local/lib/libmarker.so";
const ZIG: &str = "/opt/flowlane-zig/bin/python";

fn sh_in(dir: &Path, args: &[&str]) -> String {
    let mut cmd = Command::new(args[0]);
    cmd.args(&args[1..]).current_dir(dir);
    let out = process::run(&mut cmd, Duration::from_secs(300)).expect(args[0]);
    assert!(out.success(), "{args:?}: {}{}", out.stderr, out.stdout);
    out.stdout
}

/// `apt-get download` of `packages` into `dir`: the host's apt lists, or a
/// private apt state for `suite` (its own sources list, lists and an empty
/// dpkg status, so that the host's installed versions do not count).
fn download(dir: &Path, suite: Option<&str>, packages: &[&str]) -> Vec<PathBuf> {
    std::fs::create_dir_all(dir).unwrap();
    let mut opts: Vec<String> = Vec::new();
    if let Some(suite) = suite {
        let apt = dir.join("apt");
        for d in ["lists/partial", "cache/archives/partial"] {
            std::fs::create_dir_all(apt.join(d)).unwrap();
        }
        std::fs::write(
            apt.join("sources.list"),
            format!("deb http://deb.debian.org/debian {suite} main\n"),
        )
        .unwrap();
        std::fs::write(apt.join("status"), "").unwrap();
        let a = apt.display();
        opts = [
            format!("Dir::Etc::SourceList={a}/sources.list"),
            "Dir::Etc::SourceParts=/dev/null".into(),
            format!("Dir::State::Lists={a}/lists"),
            format!("Dir::Cache={a}/cache"),
            format!("Dir::State::status={a}/status"),
            "Acquire::Languages=none".into(),
        ]
        .into_iter()
        .flat_map(|o| ["-o".to_string(), o])
        .collect();
        let mut args = vec!["apt-get", "-q"];
        args.extend(opts.iter().map(String::as_str));
        args.push("update");
        sh_in(dir, &args);
    }
    let mut args = vec!["apt-get", "-q"];
    args.extend(opts.iter().map(String::as_str));
    args.push("download");
    args.extend(packages);
    sh_in(dir, &args);
    packages
        .iter()
        .map(|p| {
            std::fs::read_dir(dir)
                .unwrap()
                .map(|e| e.unwrap().path())
                .find(|f| {
                    f.file_name()
                        .unwrap()
                        .to_str()
                        .unwrap()
                        .starts_with(&format!("{p}_"))
                })
                .unwrap_or_else(|| panic!("{p} downloaded into {}", dir.display()))
        })
        .collect()
}

/// A root filesystem of the packages' files (`dpkg -x`) plus `files`
/// (source, path inside).
fn rootfs(root: &Path, debs: &[PathBuf], files: &[(&Path, &str)]) {
    for d in ["tmp", "proc", "sys", "dev", "etc"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    for deb in debs {
        sh_in(
            Path::new("/"),
            &[
                "dpkg",
                "-x",
                &deb.display().to_string(),
                &root.display().to_string(),
            ],
        );
    }
    for (src, dst) in files {
        let to = root.join(dst.trim_start_matches('/'));
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(src, &to).unwrap();
        std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
}

/// The workload and the application's own preload library, built for each
/// kind of image: glibc with 2.17 symbol versions (zig), musl dynamic
/// (Debian's musl-gcc), static (zig, musl).
struct Programs {
    glibc: PathBuf,
    musl: PathBuf,
    static_: PathBuf,
    marker: PathBuf,
}

fn build_programs(dir: &Path) -> Programs {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("cri/inject");
    let echo = src.join("tcpecho.c").display().to_string();
    let p = Programs {
        glibc: dir.join("tcpecho-glibc"),
        musl: dir.join("tcpecho-musl"),
        static_: dir.join("tcpecho-static"),
        marker: dir.join("libmarker.so"),
    };
    let zig = |target: &str, extra: &[&str], out: &Path, src: &str| {
        let mut args = vec![ZIG, "-m", "ziglang", "cc", "-target", target, "-O2"];
        args.extend(extra);
        let out = out.display().to_string();
        args.extend(["-o", &out, src]);
        sh_in(dir, &args);
    };
    zig("x86_64-linux-gnu.2.17", &[], &p.glibc, &echo);
    zig("x86_64-linux-musl", &["-static"], &p.static_, &echo);
    zig(
        "x86_64-linux-gnu.2.17",
        &["-shared", "-fPIC"],
        &p.marker,
        &src.join("marker.c").display().to_string(),
    );
    sh_in(
        dir,
        &[
            "musl-gcc",
            "-O2",
            "-o",
            &p.musl.display().to_string(),
            &echo,
        ],
    );
    p
}

/// One pod as the kubelet would run it after the webhook: its sandbox, and
/// what each container printed and how it ended.
struct PodRun {
    name: String,
    sandbox: String,
    ip: String,
    /// The probes' termination messages, by init container.
    verdicts: BTreeMap<String, String>,
    /// The app containers' ids, by name.
    apps: BTreeMap<String, String>,
    logs: PathBuf,
    /// The CSI volumes published for it: (pod uid, volume name).
    csi_volumes: Vec<(String, String)>,
}

struct Cluster {
    ctrd: Containerd,
    w: PathBuf,
    logs: PathBuf,
}

impl Cluster {
    /// The pod spec with the webhook's patch applied (pod opted in by label).
    fn mutate(&self, name: &str, containers: Value) -> Value {
        let mut pod = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE,
                         "labels": {"flowlane.io/inject": "true"}},
            "spec": {"containers": containers},
        });
        let decision = inject::decide(&pod, Scope::PodOptIn);
        assert!(!decision.patch.is_empty(), "{}", decision.reason);
        let patch: json_patch::Patch = serde_json::from_value(json!(decision.patch)).unwrap();
        json_patch::patch(&mut pod, &patch).expect("the webhook's patch applies");
        pod
    }

    /// The CRI config of container `c` of `pod` (what the kubelet makes of it).
    fn container_config(
        &self,
        c: &Value,
        volumes: &BTreeMap<String, (PathBuf, bool)>,
        pod_dir: &Path,
    ) -> Value {
        let name = c["name"].as_str().unwrap();
        let mut mounts = Vec::new();
        for m in c["volumeMounts"].as_array().into_iter().flatten() {
            let (host, empty_dir) = volumes
                .get(m["name"].as_str().unwrap())
                .unwrap_or_else(|| panic!("volume of {m}"))
                .clone();
            let mut host = host;
            if let Some(sub) = m["subPath"].as_str() {
                host = host.join(sub);
                // The kubelet makes a subPath with its volume's mode (an
                // emptyDir's is 0777).
                std::fs::create_dir_all(&host).unwrap();
                if empty_dir {
                    std::fs::set_permissions(&host, std::fs::Permissions::from_mode(0o777))
                        .unwrap();
                }
            }
            mounts.push(json!({
                "container_path": m["mountPath"], "host_path": host.display().to_string(),
                "readonly": m["readOnly"] == json!(true),
            }));
        }
        // terminationMessagePath: a host file the kubelet mounts and reads back.
        let term = pod_dir.join(format!("{name}.termination"));
        std::fs::write(&term, "").unwrap();
        std::fs::set_permissions(&term, std::fs::Permissions::from_mode(0o666)).unwrap();
        mounts.push(json!({
            "container_path": c["terminationMessagePath"].as_str().unwrap_or("/dev/termination-log"),
            "host_path": term.display().to_string(),
        }));
        let envs: Vec<Value> = c["env"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| json!({"key": e["name"], "value": e["value"]}))
            .collect();
        let sc = &c["securityContext"];
        let mut security = json!({"namespace_options": {"network": "POD"}});
        if let Some(u) = sc["runAsUser"].as_i64() {
            security["run_as_user"] = json!({"value": u});
        }
        if let Some(g) = sc["runAsGroup"].as_i64() {
            security["run_as_group"] = json!({"value": g});
        }
        if sc["readOnlyRootFilesystem"] == json!(true) {
            security["readonly_rootfs"] = json!(true);
        }
        if sc["allowPrivilegeEscalation"] == json!(false) {
            security["no_new_privs"] = json!(true);
        }
        if let Some(drop) = sc["capabilities"]["drop"].as_array() {
            security["capabilities"] = json!({"drop_capabilities": drop});
        }
        if sc["seccompProfile"]["type"] == json!("RuntimeDefault") {
            security["seccomp"] = json!({"profile_type": "RuntimeDefault"});
        }
        json!({
            "metadata": {"name": name},
            "image": {"image": c["image"]},
            "command": c["command"],
            "envs": envs,
            "mounts": mounts,
            "log_path": format!("{name}.log"),
            "linux": {"security_context": security},
        })
    }

    /// Runs `pod` (already mutated): its CSI volumes published by `csi` (the
    /// node's plugin: its library directory stands for the node's
    /// `/opt/flowlane/lib`), sandbox, each init container to its end (exit 0
    /// required, as the kubelet requires), then the app containers.
    fn run(&self, pod: &Value, csi: &CsiPlugin) -> PodRun {
        let name = pod["metadata"]["name"].as_str().unwrap().to_string();
        let pod_ref = PodRef {
            uid: format!("uid-{name}"),
            name: name.clone(),
            namespace: NAMESPACE.into(),
            service_account: "default".into(),
        };
        // Volumes first, as the kubelet mounts them before the sandbox.
        let pod_dir = self.w.join("pods").join(&name);
        std::fs::create_dir_all(&pod_dir).unwrap();
        let mut volumes = BTreeMap::new();
        let mut csi_volumes = Vec::new();
        for v in pod["spec"]["volumes"].as_array().unwrap() {
            let vname = v["name"].as_str().unwrap().to_string();
            assert!(v.get("hostPath").is_none(), "no hostPath is injected: {v}");
            let host = if v["csi"].is_object() {
                assert_eq!(v["csi"]["driver"], inject::CSI_DRIVER, "{v}");
                let target = csi
                    .publish(&pod_ref, v)
                    .unwrap_or_else(|e| panic!("NodePublishVolume {vname}: {e:?}"));
                csi_volumes.push((pod_ref.uid.clone(), vname.clone()));
                (target, false)
            } else {
                assert!(v["emptyDir"].is_object(), "{v}");
                let d = pod_dir.join("volumes").join(&vname);
                std::fs::create_dir_all(&d).unwrap();
                std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
                (d, true)
            };
            volumes.insert(vname, host);
        }
        let sandbox_config = cri::pod_sandbox_config(&name, NAMESPACE, &self.logs);
        let sandbox = self
            .ctrd
            .call("RunPodSandbox", &json!({"config": sandbox_config}))["pod_sandbox_id"]
            .as_str()
            .unwrap()
            .to_string();
        let status = self
            .ctrd
            .call("PodSandboxStatus", &json!({"pod_sandbox_id": sandbox}));
        let ip = status["status"]["network"]["ip"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(ip.starts_with("10.247.61."), "{name}: {status}");
        let create = |c: &Value| -> String {
            let req = json!({
                "pod_sandbox_id": sandbox,
                "config": self.container_config(c, &volumes, &pod_dir),
                "sandbox_config": sandbox_config,
            });
            let id = self.ctrd.call("CreateContainer", &req)["container_id"]
                .as_str()
                .unwrap()
                .to_string();
            self.ctrd
                .call("StartContainer", &json!({"container_id": id}));
            id
        };
        let logs = self.logs.join(&name);
        let mut verdicts = BTreeMap::new();
        for c in pod["spec"]["initContainers"].as_array().unwrap() {
            let cname = c["name"].as_str().unwrap().to_string();
            let id = create(c);
            let code = wait_exit(&self.ctrd, &id)
                .unwrap_or_else(|| panic!("init container {cname} of {name} did not end"));
            assert_eq!(
                code,
                0,
                "init container {cname} of {name}: {}",
                log_text(&logs.join(format!("{cname}.log")))
            );
            let msg =
                std::fs::read_to_string(pod_dir.join(format!("{cname}.termination"))).unwrap();
            verdicts.insert(cname, msg);
        }
        let mut apps = BTreeMap::new();
        for c in pod["spec"]["containers"].as_array().unwrap() {
            apps.insert(c["name"].as_str().unwrap().to_string(), create(c));
        }
        PodRun {
            name,
            sandbox,
            ip,
            verdicts,
            apps,
            logs,
            csi_volumes,
        }
    }
}

impl PodRun {
    fn log(&self, container: &str) -> String {
        log_text(&self.logs.join(format!("{container}.log")))
    }

    /// The one probe's verdict line.
    fn verdict(&self) -> &str {
        assert_eq!(self.verdicts.len(), 1, "{:?}", self.verdicts);
        self.verdicts.values().next().unwrap()
    }
}

/// The exit code of a container once it exited (None: still running after 60 s).
fn wait_exit(ctrd: &Containerd, id: &str) -> Option<i64> {
    flowlane_e2e::wait::for_some(Duration::from_secs(60), || {
        let s = ctrd.call("ContainerStatus", &json!({"container_id": id}));
        (s["status"]["state"] == "CONTAINER_EXITED")
            .then(|| s["status"]["exit_code"].as_i64().unwrap_or(0))
    })
}

/// The messages of a CRI log file (`<time> <stream> <tag> <message>` lines).
fn log_text(path: &Path) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| l.splitn(4, ' ').nth(3).unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

fn stats(socket: &Path) -> Stats {
    DaemonClient::connect(socket, Duration::from_secs(2))
        .expect("connect to flowlaned")
        .stats()
        .expect("stats")
}

fn shm_opened(socket: &Path) -> u64 {
    stats(socket)
        .lanes
        .get("shm")
        .map(|l| l.connections_opened)
        .unwrap_or(0)
}

/// The node's flowlane directory: `preload` as the library, the no-op object
/// and the probe as shipped.
fn node_lib(dir: &Path, preload: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let shipped = binaries::shipped_preload();
    let shipped = shipped.parent().unwrap();
    for (src, name) in [
        (preload.to_path_buf(), "libflowlane_preload.so"),
        (shipped.join("libflowlane_noop.so"), "libflowlane_noop.so"),
        (shipped.join("flowlane-probe"), "flowlane-probe"),
    ] {
        std::fs::copy(&src, dir.join(name))
            .unwrap_or_else(|e| panic!("{}: {e} (bash shm-proxy/preload/ship.sh)", src.display()));
    }
    dir.to_path_buf()
}

fn app(name: &str, image: &str, command: &[&str], env: Value) -> Value {
    json!({"name": name, "image": image, "command": command, "env": env,
           "imagePullPolicy": "Never"})
}

#[test]
fn every_image_starts_and_those_that_can_load_the_library_get_the_lane() {
    let _turn = crate::turn::take(module_path!());
    let w = TempDir::new("inject");
    let bridge = LinkGuard::fresh("inj");
    let net = bridge.name().to_string();

    // Images, built once per run in the test's own directory.
    let progs = build_programs(w.path());
    let bookworm = download(
        &w.join("debs-bookworm"),
        None,
        &["libc6", "libgcc-s1", "musl"],
    );
    let bullseye = download(
        &w.join("debs-bullseye"),
        Some("bullseye"),
        &["libc6", "libgcc-s1"],
    );
    let images = w.join("images");
    rootfs(
        &images.join("bookworm"),
        &bookworm[..2],
        &[(&progs.glibc, "/bin/tcpecho"), (&progs.marker, MARKER)],
    );
    rootfs(
        &images.join("bullseye"),
        &bullseye,
        &[(&progs.glibc, "/bin/tcpecho")],
    );
    rootfs(
        &images.join("musl"),
        &bookworm[2..],
        &[(&progs.musl, "/bin/tcpecho")],
    );
    rootfs(
        &images.join("static"),
        &[],
        &[(&progs.static_, "/bin/tcpecho")],
    );
    assert!(
        images.join("musl/lib/ld-musl-x86_64.so.1").exists(),
        "Debian's musl ships its loader"
    );
    let pause_root = w.join("pause-root");
    cri::busybox_rootfs(&pause_root).unwrap();
    let tars = [
        (pause_root.clone(), PAUSE, vec![]),
        (images.join("bookworm"), BOOKWORM, vec![]),
        (
            images.join("bookworm"),
            BOOKWORM_ENV,
            vec![format!("LD_PRELOAD={MARKER}")],
        ),
        (images.join("bullseye"), BULLSEYE, vec![]),
        (images.join("musl"), MUSL, vec![]),
        (images.join("static"), STATIC, vec![]),
    ];

    // The node: its flowlane directory (the shipped files; a second one with
    // the build machine's library for the "too old" case), the daemon, the
    // plugin under containerd.
    let lib = node_lib(&w.join("node-lib"), &binaries::shipped_preload());
    let newer_lib = node_lib(
        &w.join("node-lib-newer"),
        &binaries::build_dir().join("libflowlane_preload.so"),
    );
    let socket_dir = w.join("run");
    std::fs::create_dir_all(&socket_dir).unwrap();
    let socket = socket_dir.join("flowlaned.sock");
    assert_eq!(inject::SOCKET_PATH, "/run/flowlane/flowlaned.sock");
    let state = w.join("state");
    let daemon_log = std::fs::File::create(w.join("daemon.log")).unwrap();
    let mut daemon = ChildGuard::new(
        Command::new(binaries::build_dir().join("flowlaned"))
            .arg("--state-dir")
            .arg(&state)
            .arg("--socket")
            .arg(&socket)
            .arg("--log-level")
            .arg("debug")
            .stdout(daemon_log.try_clone().unwrap())
            .stderr(daemon_log)
            .spawn()
            .expect("start flowlaned"),
    );
    assert!(
        flowlane_e2e::wait::until(Duration::from_secs(20), || {
            DaemonClient::connect(&socket, Duration::from_secs(1))
                .is_ok_and(|mut c| c.stats().is_ok())
        }),
        "flowlaned did not come up"
    );
    let bin = w.join("cni-bin");
    let conf_dir = w.join("net.d");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(&conf_dir).unwrap();
    symlink(binaries::flowlane(), bin.join("flowlane")).unwrap();
    symlink(reference_plugin("loopback"), bin.join("loopback")).unwrap();
    let conflist = json!({
        "cniVersion": "1.0.0", "name": net,
        "plugins": [{
            "type": "flowlane", "bridge": net, "isGateway": true, "ipMasq": false,
            "stateDir": state.display().to_string(),
            "daemonSocket": socket.display().to_string(),
            "ipam": {"type": "flowlane", "ranges": [[{"subnet": SUBNET}]],
                     "dataDir": w.join("ipam").display().to_string()},
        }],
    });
    std::fs::write(conf_dir.join("10-flowlane.conflist"), conflist.to_string()).unwrap();
    let ctrd = Containerd::start(ContainerdConfig {
        dir: w.join("ctrd"),
        cni_bin_dir: bin,
        cni_conf_dir: conf_dir,
        sandbox_image: PAUSE.into(),
    });
    for (root, name, env) in &tars {
        let tar = w.join(format!("{}.tar", name.rsplit('/').next().unwrap()));
        let env: Vec<&str> = env.iter().map(String::as_str).collect();
        // The pause container only sleeps: StopPodSandbox SIGKILLs it.
        let cmd: &[&str] = if *name == PAUSE {
            &["/bin/sleep", "2147483647"]
        } else {
            &["/bin/tcpecho"]
        };
        cri::oci_image_tar_with_env(root, &tar, name, cmd, &env);
        ctrd.import_image(&tar);
    }
    let logs = w.join("logs");
    let cluster = Cluster {
        ctrd,
        w: w.path().to_path_buf(),
        logs,
    };
    // The node's CSI plugin, registered as the kubelet does; a second one (a
    // kubelet root of its own) offers the build machine's library.
    let csi = CsiPlugin::start(&w.join("kubelet"), &lib, &socket_dir, "csi-inject-node");
    let csi_newer = CsiPlugin::start(
        &w.join("kubelet-newer"),
        &newer_lib,
        &socket_dir,
        "csi-inject-node-newer",
    );

    // The server: bookworm, on the lane.
    let srv_name = flowlane_e2e::names::unique("isrv");
    let srv_pod = cluster.mutate(
        &srv_name,
        json!([app(
            "server",
            BOOKWORM,
            &["/bin/tcpecho", "serve", PORT],
            json!([])
        )]),
    );
    let srv = cluster.run(&srv_pod, &csi);
    assert!(
        srv.verdict().starts_with("flowlane: lane (glibc 2.36)"),
        "{}",
        srv.verdict()
    );
    let listening = flowlane_e2e::wait::until(Duration::from_secs(30), || {
        stats(&socket)
            .listeners
            .iter()
            .any(|l| l.addr.port().to_string() == PORT && l.pod.ends_with(&srv_name))
    });
    assert!(
        listening,
        "the server registered its listener: {}\n{:?}",
        srv.log("server"),
        stats(&socket).listeners
    );

    // One client pod per kind of image: what it should get.
    struct Case<'a> {
        kind: &'a str,
        image: &'a str,
        /// The node's CSI plugin, i.e. which library the node offers.
        csi: &'a CsiPlugin,
        env: Value,
        lane: bool,
        verdict: &'a str,
    }
    let cases = [
        Case {
            kind: "glibc 2.36 (bookworm)",
            image: BOOKWORM,
            csi: &csi,
            env: json!([]),
            lane: true,
            verdict: "flowlane: lane (glibc 2.36)",
        },
        Case {
            kind: "glibc 2.31 (bullseye)",
            image: BULLSEYE,
            csi: &csi,
            env: json!([]),
            lane: true,
            verdict: "flowlane: lane (glibc 2.31)",
        },
        Case {
            kind: "glibc 2.31 with a library that needs 2.34",
            image: BULLSEYE,
            csi: &csi_newer,
            env: json!([]),
            lane: false,
            verdict: "flowlane: tcp (glibc 2.31): the image's libc.so.6 lacks GLIBC_2.3",
        },
        Case {
            kind: "musl (Debian's musl loader, musl-linked client)",
            image: MUSL,
            csi: &csi,
            env: json!([]),
            lane: false,
            verdict: "flowlane: tcp (musl): musl cannot load a glibc library",
        },
        Case {
            kind: "static binary, no loader",
            image: STATIC,
            csi: &csi,
            env: json!([]),
            lane: false,
            verdict: "flowlane: tcp (none): no dynamic loader",
        },
        Case {
            kind: "own LD_PRELOAD in the pod spec",
            image: BOOKWORM,
            csi: &csi,
            env: json!([{"name": "LD_PRELOAD", "value": MARKER}]),
            lane: true,
            verdict: "flowlane: lane (glibc 2.36)",
        },
        Case {
            kind: "own LD_PRELOAD in the image's ENV",
            image: BOOKWORM_ENV,
            csi: &csi,
            env: json!([]),
            lane: true,
            verdict: "flowlane: lane (glibc 2.36)",
        },
    ];
    let mut pods = vec![srv];
    let mut table = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let name = flowlane_e2e::names::unique(&format!("icl{i}"));
        let pod = cluster.mutate(
            &name,
            json!([app(
                "client",
                case.image,
                &["/bin/tcpecho", "client", &pods[0].ip, PORT, BYTES],
                case.env.clone()
            )]),
        );
        if case.kind.starts_with("own LD_PRELOAD in the pod spec") {
            let env = &pod["spec"]["containers"][0]["env"];
            assert_eq!(
                env[0],
                json!({"name": "LD_PRELOAD", "value": format!("{MARKER}:{}", inject::PRELOAD_LIB)}),
                "the pod's own LD_PRELOAD is kept, first"
            );
        }
        let before = shm_opened(&socket);
        let run = cluster.run(&pod, case.csi);
        let code = wait_exit(&cluster.ctrd, &run.apps["client"])
            .unwrap_or_else(|| panic!("{}: the client did not end", case.kind));
        let out = run.log("client");
        assert_eq!(code, 0, "{}: the client exits 0: {out}", case.kind);
        assert!(out.contains(&format!("ok {BYTES}")), "{}: {out}", case.kind);
        let opened = shm_opened(&socket) - before;
        assert_eq!(
            opened,
            u64::from(case.lane),
            "{}: shared-memory connections opened (verdict {:?}, log {out})",
            case.kind,
            run.verdict()
        );
        assert!(
            run.verdict().starts_with(case.verdict),
            "{}: {}",
            case.kind,
            run.verdict()
        );
        match case.kind {
            "own LD_PRELOAD in the pod spec" => {
                assert!(out.contains("own-preload-loaded"), "kept: {out}")
            }
            "own LD_PRELOAD in the image's ENV" => {
                assert!(!out.contains("own-preload-loaded"), "{out}");
                assert!(
                    run.verdict()
                        .contains(&format!("the image's ENV sets LD_PRELOAD={MARKER}")),
                    "the probe names the replaced value: {}",
                    run.verdict()
                );
            }
            _ => {}
        }
        table.push(format!(
            "{:<50} {:<5} {}",
            case.kind,
            if opened > 0 { "lane" } else { "tcp" },
            run.verdict().trim()
        ));
        pods.push(run);
    }

    // flowlane status: every probe's verdict, by pod.
    let s = stats(&socket);
    let lanes = std::iter::once(true).chain(cases.iter().map(|c| c.lane));
    for (run, lane) in pods.iter().zip(lanes) {
        let v = s
            .injections
            .iter()
            .find(|v| v.pod.ends_with(&run.name))
            .unwrap_or_else(|| panic!("no verdict for {} in {:?}", run.name, s.injections));
        assert_eq!(
            v.verdict,
            if lane {
                InjectionVerdict::Lane
            } else {
                InjectionVerdict::Tcp
            },
            "{v:?}"
        );
        assert!(
            run.verdict().contains(&v.libc),
            "{v:?} vs {}",
            run.verdict()
        );
    }

    // The control: the "too old" pair without the probe (LD_PRELOAD naming
    // the library directly) fails at exec, as an old image did before.
    let name = flowlane_e2e::names::unique("ictl");
    let config = cri::pod_sandbox_config(&name, NAMESPACE, &cluster.logs);
    let sandbox = cluster
        .ctrd
        .call("RunPodSandbox", &json!({"config": config}))["pod_sandbox_id"]
        .as_str()
        .unwrap()
        .to_string();
    let req = json!({
        "pod_sandbox_id": sandbox,
        "config": {
            "metadata": {"name": "client"}, "image": {"image": BULLSEYE},
            "command": ["/bin/tcpecho", "client", &pods[0].ip, PORT, BYTES],
            "envs": [{"key": "LD_PRELOAD", "value": inject::PRELOAD_LIB}],
            "mounts": [{"container_path": inject::PRELOAD_DIR, "host_path": newer_lib.display().to_string(), "readonly": true}],
            "log_path": "client.log",
        },
        "sandbox_config": config,
    });
    let id = cluster.ctrd.call("CreateContainer", &req)["container_id"]
        .as_str()
        .unwrap()
        .to_string();
    cluster
        .ctrd
        .call("StartContainer", &json!({"container_id": id}));
    let code = wait_exit(&cluster.ctrd, &id).expect("the control ends");
    let out = log_text(&cluster.logs.join(&name).join("client.log"));
    assert_ne!(code, 0, "without the probe: {out}");
    assert!(
        out.contains("GLIBC_2.3") && out.contains("not found"),
        "fails at exec on the version: {out}"
    );

    println!("inject_images: what each image got");
    for line in &table {
        println!("  {line}");
    }
    println!(
        "  control, no probe: exit {code}: {}",
        out.lines().next().unwrap_or("")
    );

    // Pods removed, then their volumes unpublished (by whichever node's
    // plugin published them; unpublishing an absent target is a success).
    for p in &pods {
        let id = json!({"pod_sandbox_id": p.sandbox});
        cluster.ctrd.call("StopPodSandbox", &id);
        cluster.ctrd.call("RemovePodSandbox", &id);
        for (uid, vol) in &p.csi_volumes {
            for plugin in [&csi, &csi_newer] {
                plugin
                    .unpublish(uid, vol)
                    .unwrap_or_else(|e| panic!("NodeUnpublishVolume {vol}: {e:?}"));
            }
        }
    }
    for root in [w.join("kubelet"), w.join("kubelet-newer")] {
        assert_eq!(mounts_under(&root), Vec::<PathBuf>::new(), "no mount left");
    }
    drop((csi, csi_newer));
    let id = json!({"pod_sandbox_id": sandbox});
    cluster.ctrd.call("StopPodSandbox", &id);
    cluster.ctrd.call("RemovePodSandbox", &id);
    let mut cluster = cluster;
    cluster.ctrd.shutdown();
    daemon.terminate(Duration::from_secs(10));
    drop(bridge);
}
