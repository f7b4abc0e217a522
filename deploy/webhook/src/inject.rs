//! The injection decision and the JSON patch for one pod: a pure function of the
//! AdmissionReview request, so every case is unit-testable with recorded requests.
//!
//! What an injected pod gets (nothing else changes):
//! - per distinct image of its injected containers, an init container
//!   `flowlane-probe-<k>` that runs IN THAT IMAGE the node's static probe
//!   (`deploy/probe/probe.c`, from the volume `flowlane-preload`, the node's
//!   `/opt/flowlane/lib`, mounted read-only at `/opt/flowlane/node`). The probe reads
//!   the image's dynamic loader and libraries and writes into the emptyDir volume
//!   `flowlane-lib` (subPath `p<k>`) either the preload library (the image's libraries
//!   define every symbol version it needs) or a no-op object (musl, no loader, glibc
//!   too old): never fatal, the app starts either way;
//! - in each injected container: `flowlane-lib` (subPath `p<k>` of its image's probe)
//!   at `/opt/flowlane/lib` and `flowlane-run` (the node's `/run/flowlane`, the daemon's
//!   socket directory) at `/run/flowlane`, both read-only;
//!   `LD_PRELOAD=/opt/flowlane/lib/libflowlane_preload.so` (appended with `:` to a
//!   value the container already sets) and `FLOWLANE_SOCKET=/run/flowlane/flowlaned.sock`.
//!
//! The node's two directories reach the pod as CSI ephemeral inline volumes of
//! flowlane's CSI node plugin (`deploy/csi/`, driver [`CSI_DRIVER`], attribute
//! `content: lib|run`), not hostPath: Pod Security "baseline" and "restricted"
//! forbid hostPath and allow `csi`, so an injected pod passes both when the pod
//! itself does (the probe's securityContext is what "restricted" asks).
//!
//! The patch is idempotent per container: a container that already has the mounts is
//! left alone, so a re-invocation (reinvocationPolicy IfNeeded) only touches containers
//! another webhook added since (a probe already there for the same image is reused).

use serde_json::{json, Value};

/// Pod label (the webhook's `objectSelector` matches it, so the API server calls the
/// webhook only for pods that asked) or annotation: `"true"` opts a pod in, `"false"`
/// opts it out (and wins over the namespace label `flowlane.io/inject=enabled`).
pub const INJECT_ANNOTATION: &str = "flowlane.io/inject";
/// The same key as a pod label (see [`INJECT_ANNOTATION`]).
pub const INJECT_LABEL: &str = INJECT_ANNOTATION;
/// Set on every pod the webhook changed.
pub const INJECTED_ANNOTATION: &str = "flowlane.io/injected";
/// Pod annotation: comma-separated container names to leave alone (sidecars, proxies).
pub const SKIP_CONTAINERS_ANNOTATION: &str = "flowlane.io/skip-containers";

/// Where app containers find the library (the pod's emptyDir, filled by the probe).
pub const PRELOAD_DIR: &str = flowlane_defaults::POD_LIB_DIR;
pub const PRELOAD_LIB: &str = flowlane_defaults::POD_PRELOAD_LIB;
/// The node's flowlane library directory (the DaemonSet installs the library, the
/// no-op object and the probe there; the CSI plugin publishes it as `content: lib`).
pub const HOST_LIB_DIR: &str = flowlane_defaults::HOST_LIB_DIR;
/// flowlane's CSI driver (the CSIDriver object; `deploy/csi`'s `DRIVER_NAME`).
pub const CSI_DRIVER: &str = "csi.flowlane.io";
/// The volume attribute that picks the node directory a CSI volume shows.
pub const CSI_CONTENT: &str = "content";
/// Where the probe containers see [`HOST_LIB_DIR`].
pub const NODE_LIB_DIR: &str = flowlane_defaults::PROBE_LIB_DIR;
/// The probe, as the init containers run it.
pub const PROBE: &str = flowlane_defaults::PROBE;
/// Name prefix of the probe init containers (`flowlane-probe-<k>`).
pub const PROBE_PREFIX: &str = "flowlane-probe-";
/// The daemon's socket directory, mounted at the same path in the pod.
pub const SOCKET_DIR: &str = flowlane_defaults::RUN_DIR;
/// The daemon's socket, as `FLOWLANE_SOCKET` names it in the pod.
pub const SOCKET_PATH: &str = flowlane_defaults::DAEMON_SOCKET;
const PRELOAD_VOLUME: &str = "flowlane-preload";
const LIB_VOLUME: &str = "flowlane-lib";
const SOCKET_VOLUME: &str = "flowlane-run";
/// More init containers than this (distinct images) and the rest is left alone.
const MAX_PROBES: usize = 32;

/// Why the API server sent the pod: the two webhook entries have disjoint namespace
/// selectors and distinct paths, because the AdmissionReview does not carry the
/// namespace's labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The namespace has `flowlane.io/inject=enabled`: inject unless the pod opts out.
    NamespaceOptIn,
    /// Any other namespace: inject only when the pod annotation says `"true"`.
    PodOptIn,
}

/// A request the webhook cannot answer (HTTP 400).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BadReview {
    #[error("body is not JSON: {0}")]
    NotJson(String),
    #[error("not an admission.k8s.io/v1 AdmissionReview with a request.uid")]
    NotAReview,
}

/// What the webhook decided for one pod.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// JSON Patch operations (RFC 6902); empty when nothing changes.
    pub patch: Vec<Value>,
    /// One line for the log: injected, or why not.
    pub reason: String,
}

/// Answers one AdmissionReview v1 request body with the AdmissionReview v1 response.
/// Pods are always allowed: the webhook only ever adds, never refuses.
pub fn review(body: &[u8], scope: Scope) -> Result<(Value, Decision), BadReview> {
    let review: Value =
        serde_json::from_slice(body).map_err(|e| BadReview::NotJson(e.to_string()))?;
    let request = &review["request"];
    let uid = request["uid"].as_str().ok_or(BadReview::NotAReview)?;
    if review["apiVersion"] != "admission.k8s.io/v1" || review["kind"] != "AdmissionReview" {
        return Err(BadReview::NotAReview);
    }
    let decision = if request["kind"]["kind"] != "Pod" || request["operation"] != "CREATE" {
        Decision {
            patch: vec![],
            reason: "not a pod creation".into(),
        }
    } else {
        decide(&request["object"], scope)
    };
    let mut response = json!({"uid": uid, "allowed": true});
    if !decision.patch.is_empty() {
        use base64::Engine as _;
        let patch = serde_json::to_vec(&decision.patch).expect("a Vec<Value> serialises");
        response["patchType"] = json!("JSONPatch");
        response["patch"] = json!(base64::engine::general_purpose::STANDARD.encode(patch));
    }
    let answer = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": response,
    });
    Ok((answer, decision))
}

/// The decision for one pod object (`request.object`).
pub fn decide(pod: &Value, scope: Scope) -> Decision {
    let skip = |reason: &str| Decision {
        patch: vec![],
        reason: reason.to_string(),
    };
    let annotations = &pod["metadata"]["annotations"];
    let labels = &pod["metadata"]["labels"];
    // The label is what the webhook's objectSelector sees; the annotation is the older
    // spelling. Either one saying "false" opts out.
    let says = |v: &str| {
        annotations[INJECT_ANNOTATION].as_str() == Some(v)
            || labels[INJECT_LABEL].as_str() == Some(v)
    };
    if says("false") {
        return skip("pod opts out (flowlane.io/inject: \"false\")");
    }
    if scope == Scope::PodOptIn && !says("true") {
        return skip("not opted in");
    }
    // A host-network pod is not wired by the CNI plugin: it has no pod netns the daemon
    // could recognise, so every connection would stay on TCP anyway.
    if pod["spec"]["hostNetwork"] == json!(true) {
        return skip("hostNetwork pod (not on the flowlane network)");
    }
    let skipped_names: Vec<&str> = annotations[SKIP_CONTAINERS_ANNOTATION]
        .as_str()
        .map(|s| {
            s.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .collect()
        })
        .unwrap_or_default();

    let mut probes = Probes::of(pod);
    let mut patch = Vec::new();
    let mut injected = Vec::new();
    let mut passed = Vec::new();
    // Only `containers`: init containers are set-up steps, and native sidecars
    // (restartPolicy Always init containers: service-mesh proxies, log shippers) are
    // exactly what should not get a preloaded library by surprise.
    let containers = pod["spec"]["containers"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for (i, container) in containers.iter().enumerate() {
        let name = container["name"].as_str().unwrap_or("");
        if skipped_names.contains(&name) {
            passed.push(format!("{name} (flowlane.io/skip-containers)"));
            continue;
        }
        match container_patch(i, container, &mut probes) {
            ContainerPatch::Inject(ops) => {
                patch.extend(ops);
                injected.push(name.to_string());
            }
            ContainerPatch::AlreadyInjected => {}
            ContainerPatch::Skip(why) => passed.push(format!("{name} ({why})")),
        }
    }
    if patch.is_empty() {
        let reason = if passed.is_empty() {
            "already injected".to_string()
        } else {
            format!("no container to inject; left alone: {}", passed.join(", "))
        };
        return skip(&reason);
    }

    let mut pod_ops = volume_ops(pod);
    pod_ops.extend(append_ops(
        "/spec/initContainers",
        pod["spec"]["initContainers"].is_array(),
        probes.new_init_containers(),
    ));
    if annotations.is_null() {
        pod_ops.push(json!({"op": "add", "path": "/metadata/annotations", "value": {}}));
    }
    if annotations[INJECTED_ANNOTATION] != json!("true") {
        pod_ops.push(json!({
            "op": "add",
            "path": format!("/metadata/annotations/{}", escape_pointer(INJECTED_ANNOTATION)),
            "value": "true",
        }));
    }
    pod_ops.extend(patch);
    let mut reason = format!("injected into {}", injected.join(", "));
    if !passed.is_empty() {
        reason += &format!("; left alone: {}", passed.join(", "));
    }
    Decision {
        patch: pod_ops,
        reason,
    }
}

/// The probe init containers of one pod: those it has (a re-invocation) and those
/// this decision adds, one per distinct image.
struct Probes {
    /// (k, image) of the probes the pod already has.
    existing: Vec<(usize, String)>,
    /// (k, image, imagePullPolicy, container names) of the probes to add.
    new: Vec<(usize, String, Option<String>, Vec<String>)>,
}

impl Probes {
    fn of(pod: &Value) -> Probes {
        let existing = pod["spec"]["initContainers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| {
                let k = c["name"]
                    .as_str()?
                    .strip_prefix(PROBE_PREFIX)?
                    .parse()
                    .ok()?;
                Some((k, c["image"].as_str()?.to_string()))
            })
            .collect();
        Probes {
            existing,
            new: Vec::new(),
        }
    }

    /// The probe (its k) that serves `container`'s image, added if needed; `None`
    /// when the pod has [`MAX_PROBES`] already.
    fn serve(&mut self, image: &str, container: &Value) -> Option<usize> {
        let name = container["name"].as_str().unwrap_or("").to_string();
        if let Some((k, _)) = self.existing.iter().find(|(_, i)| i == image) {
            return Some(*k);
        }
        if let Some(p) = self.new.iter_mut().find(|p| p.1 == image) {
            p.3.push(name);
            return Some(p.0);
        }
        if self.existing.len() + self.new.len() >= MAX_PROBES {
            return None;
        }
        let k = self
            .existing
            .iter()
            .map(|p| p.0 + 1)
            .chain(self.new.iter().map(|p| p.0 + 1))
            .max()
            .unwrap_or(0);
        let pull = container["imagePullPolicy"].as_str().map(str::to_string);
        self.new.push((k, image.to_string(), pull, vec![name]));
        Some(k)
    }

    fn new_init_containers(&self) -> Vec<Value> {
        self.new
            .iter()
            .map(|(k, image, pull, names)| probe_container(*k, image, pull.as_deref(), names))
            .collect()
    }
}

/// The init container that runs the probe in `image` for containers `names`.
pub fn probe_container(k: usize, image: &str, pull: Option<&str>, names: &[String]) -> Value {
    let mut command = vec![
        PROBE.to_string(),
        NODE_LIB_DIR.to_string(),
        PRELOAD_DIR.to_string(),
    ];
    command.extend(names.iter().cloned());
    let mut c = json!({
        "name": format!("{PROBE_PREFIX}{k}"),
        "image": image,
        "command": command,
        "env": [{"name": "FLOWLANE_SOCKET", "value": SOCKET_PATH}],
        "volumeMounts": [
            {"name": PRELOAD_VOLUME, "mountPath": NODE_LIB_DIR, "readOnly": true},
            {"name": LIB_VOLUME, "mountPath": PRELOAD_DIR, "subPath": format!("p{k}")},
            {"name": SOCKET_VOLUME, "mountPath": SOCKET_DIR, "readOnly": true},
        ],
        // Small and bounded: the probe reads a few ELF files and copies one.
        "resources": {
            "requests": {"cpu": "10m", "memory": "16Mi"},
            "limits": {"cpu": "200m", "memory": "64Mi"},
        },
        // What Pod Security "restricted" asks of a container; the probe needs no
        // privilege (the emptyDir is world-writable, the node's files world-readable).
        "securityContext": {
            "runAsNonRoot": true,
            "runAsUser": 65534,
            "runAsGroup": 65534,
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        // The probe writes its verdict there: the pod's status shows it.
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
    });
    if let Some(p) = pull {
        c["imagePullPolicy"] = json!(p);
    }
    c
}

enum ContainerPatch {
    Inject(Vec<Value>),
    AlreadyInjected,
    Skip(&'static str),
}

fn container_patch(index: usize, container: &Value, probes: &mut Probes) -> ContainerPatch {
    let base = format!("/spec/containers/{index}");
    let mounts = container["volumeMounts"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mounted_at = |path: &str| mounts.iter().find(|m| m["mountPath"] == path);
    match (mounted_at(PRELOAD_DIR), mounted_at(SOCKET_DIR)) {
        (Some(a), Some(b)) if a["name"] == LIB_VOLUME && b["name"] == SOCKET_VOLUME => {
            return ContainerPatch::AlreadyInjected
        }
        (None, None) => {}
        _ => return ContainerPatch::Skip("something else is mounted at a flowlane path"),
    }
    let env = container["env"].as_array().cloned().unwrap_or_default();
    let find_env = |name: &str| env.iter().position(|e| e["name"] == name);
    // Checked before a probe is added for the image.
    if find_env("LD_PRELOAD").is_some_and(|j| env[j].get("valueFrom").is_some()) {
        // A value from a ConfigMap/Secret/field cannot be extended in the pod spec.
        return ContainerPatch::Skip("LD_PRELOAD comes from valueFrom");
    }
    let Some(image) = container["image"].as_str().filter(|i| !i.is_empty()) else {
        return ContainerPatch::Skip("no image");
    };
    let Some(k) = probes.serve(image, container) else {
        return ContainerPatch::Skip("too many distinct images");
    };

    let mut ops = Vec::new();
    let mut new_env = Vec::new();
    match find_env("LD_PRELOAD") {
        None => new_env.push(json!({"name": "LD_PRELOAD", "value": PRELOAD_LIB})),
        Some(j) => {
            let existing = env[j]["value"].as_str().unwrap_or("");
            // ld.so takes a list separated by ':' or ' '; the application's own libraries
            // stay first, so their interposers see calls before ours.
            let value = if existing.trim().is_empty() {
                PRELOAD_LIB.to_string()
            } else {
                format!("{existing}:{PRELOAD_LIB}")
            };
            if !existing.split([':', ' ']).any(|l| l == PRELOAD_LIB) {
                ops.push(json!({"op": "replace", "path": format!("{base}/env/{j}/value"), "value": value}));
            }
        }
    }
    // A container that names its own socket (e.g. a test setup) keeps it.
    if find_env("FLOWLANE_SOCKET").is_none() {
        new_env.push(json!({"name": "FLOWLANE_SOCKET", "value": SOCKET_PATH}));
    }
    ops.extend(append_ops(
        &format!("{base}/env"),
        container["env"].is_array(),
        new_env,
    ));
    ops.extend(append_ops(
        &format!("{base}/volumeMounts"),
        container["volumeMounts"].is_array(),
        vec![
            json!({"name": LIB_VOLUME, "mountPath": PRELOAD_DIR, "subPath": format!("p{k}"), "readOnly": true}),
            json!({"name": SOCKET_VOLUME, "mountPath": SOCKET_DIR, "readOnly": true}),
        ],
    ));
    ContainerPatch::Inject(ops)
}

/// The pod-level volumes, added once: the node's library directory and the daemon's
/// socket directory (CSI ephemeral inline volumes of [`CSI_DRIVER`], read-only), and
/// the pod's own `flowlane-lib` emptyDir the probes fill.
fn volume_ops(pod: &Value) -> Vec<Value> {
    let volumes = pod["spec"]["volumes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let wanted = [
        (PRELOAD_VOLUME, csi_volume("lib")),
        (SOCKET_VOLUME, csi_volume("run")),
        // A few MiB: the library (or the no-op object) per distinct image.
        (LIB_VOLUME, json!({"emptyDir": {"sizeLimit": "256Mi"}})),
    ];
    let missing: Vec<Value> = wanted
        .into_iter()
        .filter(|(name, _)| !volumes.iter().any(|v| v["name"] == *name))
        .map(|(name, mut source)| {
            source["name"] = json!(name);
            source
        })
        .collect();
    append_ops("/spec/volumes", pod["spec"]["volumes"].is_array(), missing)
}

/// A read-only CSI ephemeral inline volume of flowlane's plugin showing `content`.
pub fn csi_volume(content: &str) -> Value {
    json!({"csi": {
        "driver": CSI_DRIVER,
        "readOnly": true,
        "volumeAttributes": {CSI_CONTENT: content},
    }})
}

/// JSON Patch ops that append `items` to the array at `path`, creating it if absent.
fn append_ops(path: &str, exists: bool, items: Vec<Value>) -> Vec<Value> {
    if items.is_empty() {
        vec![]
    } else if exists {
        items
            .into_iter()
            .map(|v| json!({"op": "add", "path": format!("{path}/-"), "value": v}))
            .collect()
    } else {
        vec![json!({"op": "add", "path": path, "value": items})]
    }
}

/// RFC 6901: `~` -> `~0`, `/` -> `~1`.
fn escape_pointer(token: &str) -> String {
    token.replace('~', "~0").replace('/', "~1")
}

#[cfg(test)]
mod tests;
