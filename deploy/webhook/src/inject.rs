//! The injection decision and the JSON patch for one pod: a pure function of the
//! AdmissionReview request, so every case is unit-testable with recorded requests.
//!
//! What an injected container gets (all read-only, nothing else changes):
//! - volume `flowlane-preload` (hostPath `/opt/flowlane/lib`) mounted at the same path,
//! - volume `flowlane-run` (hostPath `/run/flowlane`, the daemon's socket directory),
//! - `LD_PRELOAD=/opt/flowlane/lib/libflowlane_preload.so` (appended with `:` to a
//!   value the container already sets) and `FLOWLANE_SOCKET=/run/flowlane/flowlaned.sock`.
//!
//! The patch is idempotent per container: a container that already has the mounts is
//! left alone, so a re-invocation (reinvocationPolicy IfNeeded) only touches containers
//! another webhook added since.

use serde_json::{json, Value};

/// Pod annotation: `"true"` opts a pod in, `"false"` opts it out (and wins over the
/// namespace label `flowlane.io/inject=enabled`).
pub const INJECT_ANNOTATION: &str = "flowlane.io/inject";
/// Set on every pod the webhook changed.
pub const INJECTED_ANNOTATION: &str = "flowlane.io/injected";
/// Pod annotation: comma-separated container names to leave alone (sidecars, proxies).
pub const SKIP_CONTAINERS_ANNOTATION: &str = "flowlane.io/skip-containers";

pub const PRELOAD_DIR: &str = "/opt/flowlane/lib";
pub const PRELOAD_LIB: &str = "/opt/flowlane/lib/libflowlane_preload.so";
pub const SOCKET_DIR: &str = "/run/flowlane";
pub const SOCKET_PATH: &str = "/run/flowlane/flowlaned.sock";
const PRELOAD_VOLUME: &str = "flowlane-preload";
const SOCKET_VOLUME: &str = "flowlane-run";

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
    match (annotations[INJECT_ANNOTATION].as_str(), scope) {
        (Some("false"), _) => return skip("pod opts out (flowlane.io/inject: \"false\")"),
        (Some("true"), _) | (_, Scope::NamespaceOptIn) => {}
        (_, Scope::PodOptIn) => return skip("not opted in"),
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
        match container_patch(i, container) {
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

enum ContainerPatch {
    Inject(Vec<Value>),
    AlreadyInjected,
    Skip(&'static str),
}

fn container_patch(index: usize, container: &Value) -> ContainerPatch {
    let base = format!("/spec/containers/{index}");
    let mounts = container["volumeMounts"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mounted_at = |path: &str| mounts.iter().find(|m| m["mountPath"] == path);
    match (mounted_at(PRELOAD_DIR), mounted_at(SOCKET_DIR)) {
        (Some(a), Some(b)) if a["name"] == PRELOAD_VOLUME && b["name"] == SOCKET_VOLUME => {
            return ContainerPatch::AlreadyInjected
        }
        (None, None) => {}
        _ => return ContainerPatch::Skip("something else is mounted at a flowlane path"),
    }
    let env = container["env"].as_array().cloned().unwrap_or_default();
    let find_env = |name: &str| env.iter().position(|e| e["name"] == name);

    let mut ops = Vec::new();
    let mut new_env = Vec::new();
    match find_env("LD_PRELOAD") {
        None => new_env.push(json!({"name": "LD_PRELOAD", "value": PRELOAD_LIB})),
        Some(j) => {
            // A value from a ConfigMap/Secret/field cannot be extended in the pod spec.
            if env[j].get("valueFrom").is_some() {
                return ContainerPatch::Skip("LD_PRELOAD comes from valueFrom");
            }
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
            json!({"name": PRELOAD_VOLUME, "mountPath": PRELOAD_DIR, "readOnly": true}),
            json!({"name": SOCKET_VOLUME, "mountPath": SOCKET_DIR, "readOnly": true}),
        ],
    ));
    ContainerPatch::Inject(ops)
}

/// The pod-level volumes, added once. `DirectoryOrCreate`: on a node where flowlane is
/// not (yet) installed the pod still starts; ld.so then warns that the library cannot be
/// preloaded and the program runs on plain TCP.
fn volume_ops(pod: &Value) -> Vec<Value> {
    let volumes = pod["spec"]["volumes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let wanted = [(PRELOAD_VOLUME, PRELOAD_DIR), (SOCKET_VOLUME, SOCKET_DIR)];
    let missing: Vec<Value> = wanted
        .iter()
        .filter(|(name, _)| !volumes.iter().any(|v| v["name"] == *name))
        .map(|(name, path)| json!({"name": name, "hostPath": {"path": path, "type": "DirectoryOrCreate"}}))
        .collect();
    append_ops("/spec/volumes", pod["spec"]["volumes"].is_array(), missing)
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
