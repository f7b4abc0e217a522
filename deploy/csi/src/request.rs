//! What the plugin accepts in a NodePublishVolume / NodeUnpublishVolume request.
//! The kubelet fills these from the pod spec (`volumeAttributes`, `readOnly`) and
//! from its own layout (target path, volume id), so every field is checked: a
//! malformed or hostile request is refused with INVALID_ARGUMENT before anything
//! touches the file system.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::proto::csi::{
    volume_capability::{access_mode::Mode, AccessType},
    NodePublishVolumeRequest, NodeUnpublishVolumeRequest,
};

/// The volume attribute that says which node directory a volume shows.
pub const CONTENT_ATTRIBUTE: &str = "content";
/// The kubelet sets this for a CSI ephemeral inline volume.
pub const EPHEMERAL_KEY: &str = "csi.storage.k8s.io/ephemeral";
/// Prefix of the keys the kubelet adds itself (podInfoOnMount, ephemeral).
const KUBELET_PREFIX: &str = "csi.storage.k8s.io/";
/// The kubelet's pod uid key (podInfoOnMount).
const POD_UID_KEY: &str = "csi.storage.k8s.io/pod.uid";
/// Where, under a pod's directory, the kubelet puts a CSI volume's target:
/// `<pods>/<uid>/volumes/kubernetes.io~csi/<volume name>/mount`.
const CSI_VOLUMES_DIR: &str = "kubernetes.io~csi";

/// The CSI spec's size limits (`volume_id` 128 bytes, map keys/values) and the
/// kernel's path limit.
const MAX_ID: usize = 128;
const MAX_PATH: usize = 4096;
const MAX_KEY: usize = 256;
const MAX_VALUE: usize = 1024;
const MAX_CONTEXT_ENTRIES: usize = 32;

/// Which node directory a volume shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Content {
    /// The node's flowlane library directory (library, no-op object, probe).
    Lib,
    /// The daemon's socket directory.
    Run,
}

impl Content {
    pub fn name(self) -> &'static str {
        match self {
            Content::Lib => "lib",
            Content::Run => "run",
        }
    }
}

/// A NodePublishVolume request that passed every check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Publish {
    pub volume_id: String,
    pub target: PathBuf,
    pub content: Content,
}

/// A NodeUnpublishVolume request that passed every check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unpublish {
    pub volume_id: String,
    pub target: PathBuf,
}

/// Why a request was refused (INVALID_ARGUMENT, with this text).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct Invalid(pub String);

fn invalid<T>(msg: impl Into<String>) -> Result<T, Invalid> {
    Err(Invalid(msg.into()))
}

/// Checks a publish request against the kubelet's pods directory `pods_dir`.
pub fn publish(req: &NodePublishVolumeRequest, pods_dir: &Path) -> Result<Publish, Invalid> {
    let volume_id = volume_id(&req.volume_id)?;
    let (target, pod_uid) = target_path(&req.target_path, pods_dir)?;
    if !req.staging_target_path.is_empty() {
        return invalid("staging_target_path given, but the plugin has no STAGE_UNSTAGE_VOLUME");
    }
    let Some(cap) = &req.volume_capability else {
        return invalid("volume_capability missing");
    };
    match &cap.access_type {
        Some(AccessType::Mount(m)) => {
            if !m.mount_flags.is_empty() {
                return invalid("mount_flags are not supported: flowlane volumes are always read-only bind mounts");
            }
            if m.fs_type.len() > MAX_KEY || m.volume_mount_group.len() > MAX_KEY {
                return invalid("fs_type or volume_mount_group too long");
            }
        }
        Some(AccessType::Block(_)) => return invalid("block access is not supported"),
        None => return invalid("volume_capability has no access_type"),
    }
    let mode = cap
        .access_mode
        .as_ref()
        .and_then(|m| Mode::try_from(m.mode).ok())
        .unwrap_or(Mode::Unknown);
    if mode == Mode::Unknown {
        return invalid("volume_capability.access_mode missing or unknown");
    }
    if !req.readonly {
        return invalid(
            "flowlane volumes are read-only: set readOnly: true in the pod's csi volume",
        );
    }
    bounded_map("publish_context", &req.publish_context)?;
    bounded_map("secrets", &req.secrets)?;
    bounded_map("volume_context", &req.volume_context)?;
    if req.volume_context.get(EPHEMERAL_KEY).map(String::as_str) != Some("true") {
        return invalid(format!(
            "only CSI ephemeral inline volumes are served ({EPHEMERAL_KEY} must be \"true\")"
        ));
    }
    if let Some(uid) = req.volume_context.get(POD_UID_KEY) {
        if uid != &pod_uid {
            return invalid(format!(
                "target_path is pod {pod_uid}'s but {POD_UID_KEY} says {uid}"
            ));
        }
    }
    let content = match req
        .volume_context
        .get(CONTENT_ATTRIBUTE)
        .map(String::as_str)
    {
        Some("lib") => Content::Lib,
        Some("run") => Content::Run,
        Some(other) => {
            return invalid(format!(
                "volumeAttributes.{CONTENT_ATTRIBUTE} is {other:?}: expected \"lib\" or \"run\""
            ))
        }
        None => {
            return invalid(format!(
                "volumeAttributes.{CONTENT_ATTRIBUTE} missing: \"lib\" or \"run\""
            ))
        }
    };
    // A misspelt attribute is an error, not silently ignored.
    if let Some(k) = req
        .volume_context
        .keys()
        .find(|k| *k != CONTENT_ATTRIBUTE && !k.starts_with(KUBELET_PREFIX))
    {
        return invalid(format!(
            "unknown volume attribute {k:?} (only {CONTENT_ATTRIBUTE:?})"
        ));
    }
    Ok(Publish {
        volume_id,
        target,
        content,
    })
}

/// Checks an unpublish request against the kubelet's pods directory `pods_dir`.
pub fn unpublish(req: &NodeUnpublishVolumeRequest, pods_dir: &Path) -> Result<Unpublish, Invalid> {
    Ok(Unpublish {
        volume_id: volume_id(&req.volume_id)?,
        target: target_path(&req.target_path, pods_dir)?.0,
    })
}

fn volume_id(id: &str) -> Result<String, Invalid> {
    if id.is_empty() {
        return invalid("volume_id missing");
    }
    if id.len() > MAX_ID || id.chars().any(|c| c.is_control()) {
        return invalid(format!(
            "volume_id longer than {MAX_ID} bytes or with control characters"
        ));
    }
    Ok(id.to_string())
}

/// The target path must be exactly where the kubelet puts a CSI volume of one pod:
/// `<pods_dir>/<pod uid>/volumes/kubernetes.io~csi/<volume name>/mount`, spelt
/// without `.`, `..`, repeated or trailing slashes. Returns it and the pod uid.
/// Symbolic links along it are refused when the plugin opens it ([`crate::mounts`]).
pub fn target_path(target: &str, pods_dir: &Path) -> Result<(PathBuf, String), Invalid> {
    if target.is_empty() {
        return invalid("target_path missing");
    }
    if target.len() > MAX_PATH || target.contains('\0') {
        return invalid("target_path too long or with a NUL byte");
    }
    // Checked as spelt: Path::components() would hide ".", "//" and a trailing "/".
    let mut segments = target.split('/');
    let normal =
        segments.next() == Some("") && segments.all(|s| !s.is_empty() && s != "." && s != "..");
    if !normal {
        return invalid(format!(
            "target_path {target:?} is not a normalised absolute path"
        ));
    }
    let path = Path::new(target);
    let Ok(rest) = path.strip_prefix(pods_dir) else {
        return invalid(format!(
            "target_path {target:?} is not under the kubelet's pods directory {}",
            pods_dir.display()
        ));
    };
    let parts: Vec<&str> = rest.to_str().unwrap_or("").split('/').collect();
    match parts.as_slice() {
        [uid, "volumes", CSI_VOLUMES_DIR, name, "mount"] if valid_name(uid) && valid_name(name) => {
            Ok((path.to_path_buf(), uid.to_string()))
        }
        _ => invalid(format!(
            "target_path {target:?} is not <pods>/<uid>/volumes/{CSI_VOLUMES_DIR}/<volume>/mount"
        )),
    }
}

/// A pod uid or a volume name (a DNS label): short, no hidden file, printable.
fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && !s.starts_with('.')
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
}

fn bounded_map(what: &str, m: &HashMap<String, String>) -> Result<(), Invalid> {
    if m.len() > MAX_CONTEXT_ENTRIES {
        return invalid(format!(
            "{what} has more than {MAX_CONTEXT_ENTRIES} entries"
        ));
    }
    if m.iter()
        .any(|(k, v)| k.len() > MAX_KEY || v.len() > MAX_VALUE)
    {
        return invalid(format!(
            "{what} has a key over {MAX_KEY} or a value over {MAX_VALUE} bytes"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
