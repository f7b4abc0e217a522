//! flowlane's CSI node plugin (`flowlane-csi`, the real binary) driven exactly
//! as the kubelet drives it (`flowlane_e2e::csi`): the registration handshake
//! over its socket in a kubelet root of the test's own, NodePublishVolume and
//! NodeUnpublishVolume of the two volumes the webhook injects (real bind mounts
//! on real target paths), retried calls, hostile requests, a plugin restart with
//! live mounts, and no mount left behind (`/proc/self/mountinfo`).
//!
//! Needs root (mount(2)); a test that cannot run fails.

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use flowlane_csi::proto::csi::{
    identity_client::IdentityClient, GetPluginInfoRequest, NodeGetVolumeStatsRequest,
    NodePublishVolumeRequest, NodeStageVolumeRequest, NodeUnpublishVolumeRequest, ProbeRequest,
};
use flowlane_csi::tonic::Code;
use flowlane_e2e::csi::{is_mounted, mounts_under, CsiPlugin, PodRef};
use flowlane_e2e::fsutil::TempDir;
use flowlane_webhook::inject;
use serde_json::{json, Value};

/// A node of the test's own: a kubelet root, the node's library directory (the
/// shipped preload library in it) and the daemon's socket directory with a
/// listening socket, mode 0666 as flowlaned makes it.
struct Node {
    tmp: TempDir,
    daemon: UnixListener,
}

impl Node {
    fn new() -> Node {
        assert!(
            nix::unistd::geteuid().is_root(),
            "csi_node needs root (mount(2))"
        );
        let tmp = TempDir::new("csi");
        let lib = tmp.join("node/opt/flowlane/lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::copy(
            flowlane_e2e::binaries::shipped_preload(),
            lib.join("libflowlane_preload.so"),
        )
        .unwrap();
        let run = tmp.join("node/run/flowlane");
        std::fs::create_dir_all(&run).unwrap();
        let sock = run.join("flowlaned.sock");
        let daemon = UnixListener::bind(&sock).unwrap();
        std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666)).unwrap();
        Node { tmp, daemon }
    }
    fn root(&self) -> PathBuf {
        self.tmp.join("kubelet")
    }
    fn lib(&self) -> PathBuf {
        self.tmp.join("node/opt/flowlane/lib")
    }
    fn run(&self) -> PathBuf {
        self.tmp.join("node/run/flowlane")
    }
    fn plugin(&self) -> CsiPlugin {
        CsiPlugin::start(&self.root(), &self.lib(), &self.run(), "csi-node-1")
    }
}

fn pod(uid: &str) -> PodRef {
    PodRef {
        uid: uid.into(),
        name: "trainer-0".into(),
        namespace: "csi-ml".into(),
        service_account: "default".into(),
    }
}

/// The two volumes the webhook injects, as the pod spec carries them.
fn injected_volumes() -> [Value; 2] {
    let mut lib = inject::csi_volume("lib");
    lib["name"] = json!("flowlane-preload");
    let mut run = inject::csi_volume("run");
    run["name"] = json!("flowlane-run");
    [lib, run]
}

/// The mount options of the mount at `path` (mountinfo field 6).
fn mount_options(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.split(' ').nth(4) == Some(path.to_str().unwrap()))
        .collect();
    assert_eq!(lines.len(), 1, "exactly one mount at {}", path.display());
    lines[0]
        .split(' ')
        .nth(5)
        .unwrap()
        .split(',')
        .map(String::from)
        .collect()
}

#[test]
fn the_kubelet_registers_the_plugin_and_mounts_both_volumes() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new();
    let mut plugin = node.plugin();
    assert_eq!(plugin.info.name, flowlane_csi::DRIVER_NAME);
    assert_eq!(plugin.info.name, inject::CSI_DRIVER, "the webhook's driver");
    assert_eq!(plugin.node_id, "csi-node-1");
    let (info, ready) = plugin.block_on(async {
        let ch = flowlane_csi::client::connect(&plugin.endpoint)
            .await
            .unwrap();
        let mut id = IdentityClient::new(ch);
        let info = id.get_plugin_info(GetPluginInfoRequest {}).await.unwrap();
        let probe = id.probe(ProbeRequest {}).await.unwrap();
        (info.into_inner(), probe.into_inner().ready)
    });
    assert_eq!(info.name, inject::CSI_DRIVER);
    assert_eq!(ready, Some(true), "the library is installed: ready");

    let p = pod("0b6f4c52-7a3e-4d8e-9d1a-2f1c9e8b7a61");
    let [lib, run] = injected_volumes();
    let lib_target = plugin.publish(&p, &lib).expect("publish lib");
    let run_target = plugin.publish(&p, &run).expect("publish run");
    assert_eq!(
        lib_target,
        plugin.volume_dir(&p.uid, "flowlane-preload").join("mount")
    );

    // The library is there, byte for byte, read-only even for root.
    assert_eq!(
        std::fs::read(lib_target.join("libflowlane_preload.so")).unwrap(),
        std::fs::read(node.lib().join("libflowlane_preload.so")).unwrap()
    );
    let err = std::fs::write(lib_target.join("planted.so"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
    let lib_opts = mount_options(&lib_target);
    for o in ["ro", "nosuid", "nodev"] {
        assert!(lib_opts.iter().any(|x| x == o), "{o} in {lib_opts:?}");
    }
    assert!(
        !lib_opts.iter().any(|x| x == "noexec"),
        "the probe runs from there and the library is mapped executable: {lib_opts:?}"
    );
    let run_opts = mount_options(&run_target);
    for o in ["ro", "nosuid", "nodev", "noexec"] {
        assert!(run_opts.iter().any(|x| x == o), "{o} in {run_opts:?}");
    }

    // The daemon's socket answers through the volume, for root and for a pod's
    // non-root user, each in a mount namespace of its own where the volume is
    // bind-mounted at a path of its own, as the runtime does (the target path
    // itself is longer than a Unix socket address may be).
    let ctr = node.tmp.join("ctr-run");
    std::fs::create_dir_all(&ctr).unwrap();
    for (user, msg) in [
        ("", "root0000"),
        (
            "setpriv --reuid 65534 --regid 65534 --clear-groups --",
            "uid65534",
        ),
    ] {
        let script = format!(
            "mount --bind {} {} && exec {user} /usr/bin/python3 -c 'import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.sendall(sys.argv[2].encode())' {}/flowlaned.sock {msg}",
            run_target.display(),
            ctr.display(),
            ctr.display()
        );
        let out = Command::new("unshare")
            .args([
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                &script,
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{msg} connects: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (mut s, _) = node.daemon.accept().unwrap();
        let mut buf = [0u8; 8];
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, msg.as_bytes());
    }

    // A retried publish (the kubelet after a timeout) changes nothing.
    assert_eq!(plugin.publish(&p, &lib).unwrap(), lib_target);
    mount_options(&lib_target);
    // Two publishes of one target at once: one mount.
    let req = plugin.publish_request(&p, &run);
    let (a, b) = plugin.block_on(async {
        let (mut x, mut y) = (plugin.node(), plugin.node());
        tokio::join!(
            x.node_publish_volume(req.clone()),
            y.node_publish_volume(req.clone())
        )
    });
    a.unwrap();
    b.unwrap();
    mount_options(&run_target);

    // Teardown: nothing left mounted, the volume directories gone; a retried
    // unpublish (absent target) succeeds.
    plugin.unpublish(&p.uid, "flowlane-preload").unwrap();
    plugin.unpublish(&p.uid, "flowlane-run").unwrap();
    assert_eq!(
        mounts_under(&node.tmp.join("kubelet")),
        Vec::<PathBuf>::new()
    );
    assert!(!plugin.volume_dir(&p.uid, "flowlane-preload").exists());
    plugin.unpublish(&p.uid, "flowlane-run").unwrap();
    // The node's directories are untouched.
    assert!(node.lib().join("libflowlane_preload.so").is_file());
    assert!(node.run().join("flowlaned.sock").exists());

    // Stopped as the kubelet stops its container: it removes both sockets, so
    // the kubelet deregisters it.
    let status = plugin.stop();
    assert!(status.success(), "{status}");
    assert!(!plugin.registration_socket.exists());
    assert!(!plugin.endpoint.exists());
}

/// One way to spoil the kubelet's request.
type Change = Box<dyn Fn(&mut NodePublishVolumeRequest)>;

/// Every hostile or malformed request is refused with the gRPC status the CSI
/// spec names, and mounts nothing anywhere.
#[test]
fn hostile_requests_are_refused_and_mount_nothing() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new();
    let plugin = node.plugin();
    let p = pod("4a1d2f8e-0c3b-4e5a-9f6d-7b8c9d0e1f2a");
    let [lib, _] = injected_volumes();
    let good = plugin.publish_request(&p, &lib);
    let outside = node.tmp.join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    let before = mounts_under(node.tmp.path());

    let call = |req: NodePublishVolumeRequest| {
        plugin
            .block_on(plugin.node().node_publish_volume(req))
            .expect_err("refused")
    };
    let cases: Vec<(&str, Change, Code)> = vec![
        (
            "target outside the pods directory",
            Box::new(|r| r.target_path = "/etc".into()),
            Code::InvalidArgument,
        ),
        (
            "target under the pods directory but not a volume's",
            Box::new(|r| {
                r.target_path = r
                    .target_path
                    .replace("/volumes/kubernetes.io~csi/flowlane-preload/mount", "")
            }),
            Code::InvalidArgument,
        ),
        (
            "dot-dot out of the pods directory",
            Box::new(|r| {
                r.target_path = r
                    .target_path
                    .replace("flowlane-preload", "../../../../../outside")
            }),
            Code::InvalidArgument,
        ),
        (
            "writable",
            Box::new(|r| r.readonly = false),
            Code::InvalidArgument,
        ),
        (
            "not ephemeral",
            Box::new(|r| {
                r.volume_context.remove("csi.storage.k8s.io/ephemeral");
            }),
            Code::InvalidArgument,
        ),
        (
            "unknown content",
            Box::new(|r| {
                r.volume_context.insert("content".into(), "/etc".into());
            }),
            Code::InvalidArgument,
        ),
        (
            "another pod's uid",
            Box::new(|r| {
                r.volume_context
                    .insert("csi.storage.k8s.io/pod.uid".into(), "x".into());
            }),
            Code::InvalidArgument,
        ),
        (
            "oversized volume id",
            Box::new(|r| r.volume_id = "v".repeat(129)),
            Code::InvalidArgument,
        ),
        (
            "no capability",
            Box::new(|r| r.volume_capability = None),
            Code::InvalidArgument,
        ),
        (
            "mount flags",
            Box::new(|r| {
                if let Some(flowlane_csi::proto::csi::volume_capability::AccessType::Mount(m)) =
                    r.volume_capability.as_mut().unwrap().access_type.as_mut()
                {
                    m.mount_flags = vec!["exec".into()];
                }
            }),
            Code::InvalidArgument,
        ),
        (
            "a request over 64 KiB",
            Box::new(|r| {
                r.secrets.insert("k".into(), "v".repeat(70_000));
            }),
            Code::OutOfRange,
        ),
    ];
    for (what, change, code) in cases {
        let mut r = good.clone();
        change(&mut r);
        let st = call(r);
        assert_eq!(st.code(), code, "{what}: {st:?}");
    }

    // A symbolic link in the target's parent (pointing out of the pods
    // directory) is refused, and the link's target gets no mount.
    let evil = plugin.volume_dir(&p.uid, "evil");
    std::os::unix::fs::symlink(&outside, &evil).unwrap();
    let mut r = good.clone();
    r.target_path = evil.join("mount").display().to_string();
    assert_eq!(call(r).code(), Code::FailedPrecondition);
    assert!(
        !outside.join("mount").exists(),
        "nothing made through the link"
    );

    // The target exists and is a file: FAILED_PRECONDITION.
    let filed = plugin.volume_dir(&p.uid, "filed");
    std::fs::create_dir_all(&filed).unwrap();
    std::fs::write(filed.join("mount"), b"").unwrap();
    let mut r = good.clone();
    r.target_path = filed.join("mount").display().to_string();
    assert_eq!(call(r).code(), Code::FailedPrecondition);

    // Something else is mounted at the target: ALREADY_EXISTS, left as it is,
    // and the kubelet's unpublish then takes it off.
    let target = PathBuf::from(&good.target_path);
    std::fs::create_dir_all(&target).unwrap();
    nix::mount::mount(
        Some("tmpfs"),
        &target,
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        Some("size=1m"),
    )
    .unwrap();
    assert_eq!(call(good.clone()).code(), Code::AlreadyExists);
    assert!(is_mounted(&target));
    plugin.unpublish(&p.uid, "flowlane-preload").unwrap();
    assert!(!is_mounted(&target));

    // Unpublish is checked the same way.
    let st = plugin
        .block_on(
            plugin
                .node()
                .node_unpublish_volume(NodeUnpublishVolumeRequest {
                    volume_id: good.volume_id.clone(),
                    target_path: "/proc".into(),
                }),
        )
        .unwrap_err();
    assert_eq!(st.code(), Code::InvalidArgument);
    assert!(is_mounted(Path::new("/proc")));

    // What the plugin does not advertise is UNIMPLEMENTED.
    let st = plugin
        .block_on(
            plugin
                .node()
                .node_stage_volume(NodeStageVolumeRequest::default()),
        )
        .unwrap_err();
    assert_eq!(st.code(), Code::Unimplemented);
    let st = plugin
        .block_on(
            plugin
                .node()
                .node_get_volume_stats(NodeGetVolumeStatsRequest::default()),
        )
        .unwrap_err();
    assert_eq!(st.code(), Code::Unimplemented);

    // Nothing was mounted, and the plugin still serves.
    assert_eq!(mounts_under(node.tmp.path()), before);
    assert!(!is_mounted(Path::new("/etc")));
    plugin.publish(&p, &lib).unwrap();
    plugin.unpublish(&p.uid, "flowlane-preload").unwrap();
}

/// The kubelet refuses the registration (for example an unsupported version):
/// the plugin ends with an error, its sockets removed, as the
/// node-driver-registrar does (the container restarts and registers anew).
#[test]
fn a_refused_registration_ends_the_plugin() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new();
    let mut plugin = CsiPlugin::spawn(&node.root(), &node.lib(), &node.run(), "csi-node-1");
    plugin.register(false, "no supported CSI version");
    let status = flowlane_e2e::wait::for_some(Duration::from_secs(20), || plugin.exited())
        .expect("the plugin ends after a refused registration");
    assert!(!status.success(), "{status}");
    assert!(!plugin.registration_socket.exists());
}

/// The plugin restarts (a DaemonSet rollout) while pods hold its volumes: the
/// new one replaces the old sockets, reports the live mounts as published, and
/// unpublishes them.
#[test]
fn a_restarted_plugin_takes_over_live_mounts() {
    let _turn = crate::turn::take(module_path!());
    let node = Node::new();
    let p = pod("9c8b7a65-4321-4fed-8cba-987654321000");
    let [lib, run] = injected_volumes();
    let mut first = node.plugin();
    let target = first.publish(&p, &lib).unwrap();
    first.publish(&p, &run).unwrap();
    // Killed, not stopped: its sockets stay behind as stale files.
    let pid = nix::unistd::Pid::from_raw(first.pid() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).unwrap();
    flowlane_e2e::wait::for_some(Duration::from_secs(10), || first.exited()).unwrap();
    assert!(first.registration_socket.exists(), "a stale socket stays");
    assert!(is_mounted(&target), "the pod's mount outlives the plugin");

    let second = node.plugin();
    assert_eq!(second.publish(&p, &lib).unwrap(), target);
    second.unpublish(&p.uid, "flowlane-preload").unwrap();
    second.unpublish(&p.uid, "flowlane-run").unwrap();
    assert_eq!(mounts_under(&node.root()), Vec::<PathBuf>::new());
    // The first guard's Drop must not disturb the second's sockets: stop it first.
    drop(first);
    assert!(second.registration_socket.exists());
}
