use super::*;
use crate::proto::csi::{
    volume_capability::{AccessMode, BlockVolume, MountVolume},
    VolumeCapability,
};

const PODS: &str = "/var/lib/kubelet/pods";
const UID: &str = "0b6f4c52-7a3e-4d8e-9d1a-2f1c9e8b7a61";

fn target() -> String {
    format!("{PODS}/{UID}/volumes/kubernetes.io~csi/flowlane-run/mount")
}

/// What the kubelet sends for `csi: {driver: csi.flowlane.io, readOnly: true,
/// volumeAttributes: {content: run}}` with podInfoOnMount.
fn kubelet_request() -> NodePublishVolumeRequest {
    NodePublishVolumeRequest {
        volume_id: "csi-5f0e6f9c1b0b4a8e8d7c6b5a49382716".into(),
        target_path: target(),
        volume_capability: Some(VolumeCapability {
            access_mode: Some(AccessMode {
                mode: Mode::SingleNodeWriter as i32,
            }),
            access_type: Some(AccessType::Mount(MountVolume::default())),
        }),
        readonly: true,
        volume_context: [
            ("content", "run"),
            ("csi.storage.k8s.io/ephemeral", "true"),
            ("csi.storage.k8s.io/pod.name", "trainer-0"),
            ("csi.storage.k8s.io/pod.namespace", "ml"),
            ("csi.storage.k8s.io/pod.uid", UID),
            ("csi.storage.k8s.io/serviceAccount.name", "default"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect(),
        ..Default::default()
    }
}

fn refused(req: &NodePublishVolumeRequest, needle: &str) {
    let e = publish(req, Path::new(PODS)).expect_err("must be refused");
    assert!(e.0.contains(needle), "{e} should mention {needle:?}");
}

#[test]
fn the_kubelets_request_is_accepted() {
    let p = publish(&kubelet_request(), Path::new(PODS)).unwrap();
    assert_eq!(p.content, Content::Run);
    assert_eq!(p.target, PathBuf::from(target()));
    let mut lib = kubelet_request();
    lib.volume_context.insert("content".into(), "lib".into());
    assert_eq!(
        publish(&lib, Path::new(PODS)).unwrap().content,
        Content::Lib
    );
}

#[test]
fn target_paths_outside_the_kubelets_layout_are_refused() {
    for bad in [
        "".to_string(),
        "relative/mount".to_string(),
        "/etc".to_string(),
        format!("{PODS}/{UID}/volumes/kubernetes.io~csi/../../../../etc/mount"),
        format!("{PODS}/{UID}/volumes/kubernetes.io~csi/./mount"),
        format!("{PODS}/{UID}/volumes/kubernetes.io~csi/v/./mount"),
        format!("{PODS}/{UID}/volumes/kubernetes.io~csi/v/.."),
        format!("{PODS}/{UID}/volumes/kubernetes.io~csi/v/mount/"),
        format!("{PODS}//{UID}/volumes/kubernetes.io~csi/v/mount"),
        format!("{PODS}/{UID}/volumes/kubernetes.io~empty-dir/v/mount"),
        format!("{PODS}/{UID}/volumes/kubernetes.io~csi/v/mount/deeper"),
        format!("{PODS}/{UID}/volumes/kubernetes.io~csi/v"),
        format!("{PODS}/../{UID}/volumes/kubernetes.io~csi/v/mount"),
        format!("{PODS}/.hidden/volumes/kubernetes.io~csi/v/mount"),
        format!("{PODS}/{UID}/volumes/kubernetes.io~csi/a b/mount"),
        format!("/var/lib/kubelet/podsX/{UID}/volumes/kubernetes.io~csi/v/mount"),
        format!(
            "{PODS}/{}/volumes/kubernetes.io~csi/v/mount",
            "u".repeat(5000)
        ),
        format!("{PODS}/{UID}/volumes/kubernetes.io~csi/v\0/mount"),
    ] {
        let mut r = kubelet_request();
        r.target_path = bad.clone();
        r.volume_context.remove("csi.storage.k8s.io/pod.uid");
        assert!(publish(&r, Path::new(PODS)).is_err(), "{bad:?} accepted");
        let u = NodeUnpublishVolumeRequest {
            volume_id: "v".into(),
            target_path: bad.clone(),
        };
        assert!(
            unpublish(&u, Path::new(PODS)).is_err(),
            "{bad:?} accepted for unpublish"
        );
    }
}

#[test]
fn the_pod_uid_must_match_the_target() {
    let mut r = kubelet_request();
    r.volume_context
        .insert("csi.storage.k8s.io/pod.uid".into(), "another-pod".into());
    refused(&r, "pod.uid");
}

#[test]
fn only_read_only_ephemeral_mount_volumes_are_served() {
    let mut r = kubelet_request();
    r.readonly = false;
    refused(&r, "read-only");

    let mut r = kubelet_request();
    r.volume_context.remove(EPHEMERAL_KEY);
    refused(&r, "ephemeral");

    let mut r = kubelet_request();
    r.volume_capability.as_mut().unwrap().access_type = Some(AccessType::Block(BlockVolume {}));
    refused(&r, "block");

    let mut r = kubelet_request();
    r.volume_capability = None;
    refused(&r, "volume_capability");

    let mut r = kubelet_request();
    r.volume_capability.as_mut().unwrap().access_mode = None;
    refused(&r, "access_mode");

    let mut r = kubelet_request();
    r.volume_capability.as_mut().unwrap().access_type = Some(AccessType::Mount(MountVolume {
        mount_flags: vec!["rw".into()],
        ..Default::default()
    }));
    refused(&r, "mount_flags");

    let mut r = kubelet_request();
    r.staging_target_path = "/var/lib/kubelet/plugins/x".into();
    refused(&r, "staging");
}

#[test]
fn attributes_are_checked() {
    let mut r = kubelet_request();
    r.volume_context.remove(CONTENT_ATTRIBUTE);
    refused(&r, "missing");

    let mut r = kubelet_request();
    r.volume_context
        .insert(CONTENT_ATTRIBUTE.into(), "/etc".into());
    refused(&r, "expected");

    let mut r = kubelet_request();
    r.volume_context.insert("contnet".into(), "lib".into());
    refused(&r, "unknown volume attribute");

    let mut r = kubelet_request();
    r.volume_context
        .insert("csi.storage.k8s.io/x".into(), "v".repeat(2000));
    refused(&r, "value over");

    let mut r = kubelet_request();
    for i in 0..40 {
        r.volume_context
            .insert(format!("csi.storage.k8s.io/k{i}"), "v".into());
    }
    refused(&r, "entries");
}

#[test]
fn volume_ids_are_bounded() {
    let mut r = kubelet_request();
    r.volume_id = String::new();
    refused(&r, "volume_id");
    r.volume_id = "x".repeat(129);
    refused(&r, "volume_id");
    r.volume_id = "a\nb".into();
    refused(&r, "volume_id");
}
