//! The kubelet's side of CSI, driving flowlane's node plugin (`flowlane-csi`, the
//! real binary) exactly as the kubelet does:
//!
//! - plugin registration: the kubelet's plugin watcher sees
//!   `<root>/plugins_registry/csi.flowlane.io-reg.sock` appear, calls GetInfo,
//!   checks the type (`CSIPlugin`), the name and that a 1.x version is offered,
//!   dials the endpoint it names, asks NodeGetInfo (the node id it writes into
//!   CSINode) and answers NotifyRegistrationStatus;
//! - a pod's CSI ephemeral inline volume (csi_mounter.go, SetUpAt/TearDownAt):
//!   NodeGetCapabilities, then NodePublishVolume with the volume handle
//!   `csi-<sha256(pod uid + volume name)>`, the target
//!   `<root>/pods/<uid>/volumes/kubernetes.io~csi/<volume>/mount` (the kubelet
//!   makes its parent), access mode SINGLE_NODE_WRITER, `readonly` and `fsType`
//!   from the pod's `csi` source, and the volume attributes plus, for a driver
//!   with podInfoOnMount, the pod's name, namespace, uid, service account and
//!   `csi.storage.k8s.io/ephemeral: "true"`; on teardown NodeUnpublishVolume,
//!   then the kubelet removes what is left of the volume's directory.
//!
//! The plugin runs in the test's mount namespace, or in a node's
//! ([`CsiPlugin::spawn_in`]: the one-machine cluster's nodes have private mount
//! namespaces, and the plugin's mounts are made, and checked, there).
//! [`CsiPlugin`]'s `Drop` stops the plugin and takes off any mount left under
//! its kubelet root, so a failing test leaves no mount behind.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use flowlane_csi::proto::csi::{
    node_client::NodeClient, volume_capability::access_mode::Mode, volume_capability::AccessMode,
    volume_capability::AccessType, volume_capability::MountVolume, NodeGetCapabilitiesRequest,
    NodeGetInfoRequest, NodePublishVolumeRequest, NodeUnpublishVolumeRequest, VolumeCapability,
};
use flowlane_csi::proto::registration::{
    registration_client::RegistrationClient, InfoRequest, PluginInfo, RegistrationStatus,
};
use flowlane_csi::tonic::{transport::Channel, Status};
use serde_json::Value;

use crate::process::ChildGuard;

/// A running `flowlane-csi`, registered with this kubelet double.
pub struct CsiPlugin {
    pub root: PathBuf,
    pub registration_socket: PathBuf,
    pub endpoint: PathBuf,
    /// What GetInfo answered and NodeGetInfo's node id.
    pub info: PluginInfo,
    pub node_id: String,
    rt: tokio::runtime::Runtime,
    node: NodeClient<Channel>,
    child: ChildGuard,
    /// The process whose mount namespace the plugin runs in (None: the test's).
    mount_ns: Option<u32>,
}

/// The pod a volume belongs to (what the kubelet passes with podInfoOnMount).
#[derive(Debug, Clone)]
pub struct PodRef {
    pub uid: String,
    pub name: String,
    pub namespace: String,
    pub service_account: String,
}

impl PodRef {
    /// From a pod object (uid, name, namespace, serviceAccountName or "default").
    pub fn of(pod: &Value) -> PodRef {
        let s = |v: &Value| v.as_str().unwrap_or("").to_string();
        PodRef {
            uid: s(&pod["metadata"]["uid"]),
            name: s(&pod["metadata"]["name"]),
            namespace: s(&pod["metadata"]["namespace"]),
            service_account: pod["spec"]["serviceAccountName"]
                .as_str()
                .unwrap_or("default")
                .to_string(),
        }
    }
}

/// The kubelet's volume handle for an inline volume: `csi-<sha256(uid + name)>`.
pub fn volume_handle(pod_uid: &str, volume: &str) -> String {
    let d = ring::digest::digest(
        &ring::digest::SHA256,
        format!("{pod_uid}{volume}").as_bytes(),
    );
    let hex: String = d.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!("csi-{hex}")
}

impl CsiPlugin {
    /// Starts the plugin with kubelet root `root` (made here: `pods/`,
    /// `plugins_registry/`, `plugins/csi.flowlane.io/`) publishing `lib_dir` and
    /// `run_dir`, and registers it as the kubelet's plugin watcher does.
    pub fn start(root: &Path, lib_dir: &Path, run_dir: &Path, node_id: &str) -> CsiPlugin {
        let mut plugin = Self::spawn(root, lib_dir, run_dir, node_id);
        plugin.register(true, "");
        plugin
    }

    /// Starts the plugin and waits for its registration socket, without
    /// registering it (for tests of the registration itself).
    pub fn spawn(root: &Path, lib_dir: &Path, run_dir: &Path, node_id: &str) -> CsiPlugin {
        Self::spawn_in(None, root, lib_dir, run_dir, node_id)
    }

    /// [`CsiPlugin::spawn`] in the mount namespace of process `mount_ns` (a
    /// node's holder), as the DaemonSet's container runs on its node: `lib_dir`
    /// and `run_dir` are that namespace's paths. `root` must be a directory both
    /// namespaces share (the sockets are dialled from here).
    pub fn spawn_in(
        mount_ns: Option<u32>,
        root: &Path,
        lib_dir: &Path,
        run_dir: &Path,
        node_id: &str,
    ) -> CsiPlugin {
        for d in ["pods", "plugins_registry", "plugins/csi.flowlane.io"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        let registration_socket = root
            .join("plugins_registry")
            .join(flowlane_csi::serve::registration_socket_name());
        let endpoint = root.join("plugins/csi.flowlane.io/csi.sock");
        let binary = crate::binaries::workspace_artifact("flowlane-csi");
        let mut cmd = match mount_ns {
            // nsenter execs the plugin itself: the child's pid is the plugin's.
            Some(pid) => {
                let mut c = Command::new("nsenter");
                c.args(["-t", &pid.to_string(), "--mount", "--"])
                    .arg(&binary);
                c
            }
            None => Command::new(&binary),
        };
        let child = cmd
            .arg(format!("--node-id={node_id}"))
            .arg(format!("--kubelet-dir={}", root.display()))
            .arg(format!("--lib-dir={}", lib_dir.display()))
            .arg(format!("--run-dir={}", run_dir.display()))
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .spawn()
            .expect("flowlane-csi starts");
        let mut child = ChildGuard::new(child);
        // The plugin watcher acts on the socket's creation (inotify); polling it
        // stands for that. Polled by connecting: a killed predecessor's stale
        // socket file may still be there until the plugin replaces it.
        let seen = crate::wait::for_some(Duration::from_secs(20), || {
            if let Ok(Some(status)) = child.child.try_wait() {
                panic!("flowlane-csi exited before registering: {status}");
            }
            std::os::unix::net::UnixStream::connect(&registration_socket).ok()
        });
        assert!(seen.is_some(), "no registration socket after 20 s");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let channel = rt
            .block_on(flowlane_csi::client::connect(&endpoint))
            .expect("the CSI endpoint answers");
        CsiPlugin {
            root: root.to_path_buf(),
            registration_socket,
            endpoint,
            info: PluginInfo::default(),
            node_id: String::new(),
            rt,
            node: NodeClient::new(channel),
            child,
            mount_ns,
        }
    }

    /// The mount points of the plugin's mount namespace.
    pub fn mount_points(&self) -> Vec<PathBuf> {
        let info = match self.mount_ns {
            Some(pid) => PathBuf::from(format!("/proc/{pid}/mountinfo")),
            None => PathBuf::from("/proc/self/mountinfo"),
        };
        // A node's namespace may be gone already (its holder stopped first):
        // then nothing is mounted there any more.
        flowlane_csi::mounts::mount_points_in(&info).unwrap_or_default()
    }

    /// Mount points at or under `dir`, in the plugin's mount namespace.
    pub fn mounts_under(&self, dir: &Path) -> Vec<PathBuf> {
        let mut m: Vec<PathBuf> = self
            .mount_points()
            .into_iter()
            .filter(|m| m.starts_with(dir))
            .collect();
        m.sort();
        m
    }

    /// The registration handshake; `accept` false refuses it with `error`, as the
    /// kubelet does when validation fails.
    pub fn register(&mut self, accept: bool, error: &str) {
        let reg = self.rt.block_on(async {
            let ch = flowlane_csi::client::connect(&self.registration_socket)
                .await
                .expect("the registration socket answers");
            let mut reg = RegistrationClient::new(ch);
            let info = reg
                .get_info(InfoRequest {})
                .await
                .expect("GetInfo")
                .into_inner();
            (reg, info)
        });
        let (mut reg, info) = reg;
        // pluginwatcher + csi_plugin.go ValidatePlugin: the type, a name, a
        // supported major version, an endpoint it can dial.
        assert_eq!(info.r#type, "CSIPlugin");
        assert!(!info.name.is_empty());
        assert!(
            info.supported_versions.iter().any(|v| v.starts_with("1.")),
            "{info:?}"
        );
        assert_eq!(Path::new(&info.endpoint), self.endpoint);
        if accept {
            let node = self
                .rt
                .block_on(self.node.node_get_info(NodeGetInfoRequest {}))
                .expect("NodeGetInfo")
                .into_inner();
            self.node_id = node.node_id;
        }
        self.rt
            .block_on(reg.notify_registration_status(RegistrationStatus {
                plugin_registered: accept,
                error: error.to_string(),
            }))
            .expect("NotifyRegistrationStatus");
        self.info = info;
    }

    /// The Node client, for requests the kubelet would not make.
    pub fn node(&self) -> NodeClient<Channel> {
        self.node.clone()
    }

    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    /// The directory the kubelet makes for volume `volume` of pod `uid`.
    pub fn volume_dir(&self, uid: &str, volume: &str) -> PathBuf {
        self.root
            .join("pods")
            .join(uid)
            .join("volumes/kubernetes.io~csi")
            .join(volume)
    }

    /// The NodePublishVolume the kubelet sends for `volume` (the pod's volume
    /// object with a `csi` source) of `pod`, its parent directory made first.
    pub fn publish_request(&self, pod: &PodRef, volume: &Value) -> NodePublishVolumeRequest {
        let name = volume["name"].as_str().unwrap_or("");
        let src = &volume["csi"];
        let dir = self.volume_dir(&pod.uid, name);
        std::fs::create_dir_all(&dir).unwrap();
        let mut context: HashMap<String, String> = src["volumeAttributes"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_string()))
            .collect();
        for (k, v) in [
            ("csi.storage.k8s.io/pod.name", &pod.name),
            ("csi.storage.k8s.io/pod.namespace", &pod.namespace),
            ("csi.storage.k8s.io/pod.uid", &pod.uid),
            (
                "csi.storage.k8s.io/serviceAccount.name",
                &pod.service_account,
            ),
        ] {
            context.insert(k.to_string(), v.clone());
        }
        context.insert("csi.storage.k8s.io/ephemeral".into(), "true".into());
        NodePublishVolumeRequest {
            volume_id: volume_handle(&pod.uid, name),
            target_path: dir.join("mount").display().to_string(),
            volume_capability: Some(VolumeCapability {
                access_mode: Some(AccessMode {
                    mode: Mode::SingleNodeWriter as i32,
                }),
                access_type: Some(AccessType::Mount(MountVolume {
                    fs_type: src["fsType"].as_str().unwrap_or("").to_string(),
                    ..Default::default()
                })),
            }),
            readonly: src["readOnly"] == Value::Bool(true),
            volume_context: context,
            ..Default::default()
        }
    }

    /// SetUp of one inline volume: the target path the containers mount.
    pub fn publish(&self, pod: &PodRef, volume: &Value) -> Result<PathBuf, Status> {
        let caps = self
            .block_on(
                self.node()
                    .node_get_capabilities(NodeGetCapabilitiesRequest {}),
            )?
            .into_inner();
        assert!(
            caps.capabilities.is_empty(),
            "the kubelet would stage first: {caps:?}"
        );
        let req = self.publish_request(pod, volume);
        let target = PathBuf::from(&req.target_path);
        self.block_on(self.node().node_publish_volume(req))?;
        Ok(target)
    }

    /// TearDown of one inline volume: NodeUnpublishVolume, then the kubelet's
    /// removeMountDir (the target if not a mount point, vol_data.json, the
    /// volume's directory).
    pub fn unpublish(&self, pod_uid: &str, volume: &str) -> Result<(), Status> {
        let dir = self.volume_dir(pod_uid, volume);
        let target = dir.join("mount");
        self.block_on(
            self.node()
                .node_unpublish_volume(NodeUnpublishVolumeRequest {
                    volume_id: volume_handle(pod_uid, volume),
                    target_path: target.display().to_string(),
                }),
        )?;
        if !self.mount_points().contains(&target) {
            let _ = std::fs::remove_dir(&target);
            let _ = std::fs::remove_file(dir.join("vol_data.json"));
            let _ = std::fs::remove_dir(&dir);
        }
        Ok(())
    }

    /// Stops the plugin (SIGTERM, as the kubelet stops its container).
    pub fn stop(&mut self) -> std::process::ExitStatus {
        self.child.terminate(Duration::from_secs(10));
        self.child.child.wait().unwrap()
    }

    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// Whether the plugin process has exited, and how.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.child.try_wait().ok().flatten()
    }
}

/// Mount points at or under `dir` (this mount namespace), sorted.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let mut m: Vec<PathBuf> = flowlane_csi::mounts::mount_points()
        .unwrap()
        .into_iter()
        .filter(|m| m.starts_with(dir))
        .collect();
    m.sort();
    m
}

pub fn is_mounted(path: &Path) -> bool {
    flowlane_csi::mounts::is_mount_point(path).unwrap_or(false)
}

impl Drop for CsiPlugin {
    fn drop(&mut self) {
        self.child.terminate(Duration::from_secs(10));
        // Whatever a failed test left mounted under the kubelet root, deepest first.
        let mut left = self.mounts_under(&self.root);
        left.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for m in left {
            match self.mount_ns {
                Some(pid) => {
                    let _ = Command::new("nsenter")
                        .args(["-t", &pid.to_string(), "--mount", "--", "umount", "-l"])
                        .arg(&m)
                        .status();
                }
                None => {
                    let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
                }
            }
        }
    }
}
