//! Injected pods pass Pod Security admission as the API server applies it:
//! the fake API server (`flowlane_e2e::fake_api`) creates a pod as the real one
//! does, mutating admission first (the webhook's MutatingWebhookConfiguration
//! from deploy/kubernetes/webhook.yaml, answered by the webhook's own code),
//! then Pod Security at the namespace's `pod-security.kubernetes.io/enforce`
//! level (`fake_api::pod_security`, the policy library's checks reimplemented).
//!
//! A pod that passes "restricted" by itself still passes once injected; the
//! injection as it was before the CSI plugin (hostPath volumes) is refused at
//! "baseline" and "restricted", so the check is not vacuous; a root image's pod
//! in a "baseline" namespace is injected and admitted (the probe runs as 65534
//! on its own, whatever the image's user).

use std::collections::BTreeMap;
use std::path::Path;

use flowlane_e2e::fake_api::core_v1::{answer, namespace_defaults};
use flowlane_e2e::fake_api::pod_security::ENFORCE_LABEL;
use flowlane_e2e::fake_api::{ApiState, Reply, Seen};
use serde::Deserialize as _;
use serde_json::{json, Value};

fn api() -> ApiState {
    let mut st = ApiState::default();
    let docs = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/webhook.yaml"),
    )
    .unwrap();
    for doc in serde_yaml::Deserializer::from_str(&docs) {
        let v: Value = serde_json::to_value(serde_yaml::Value::deserialize(doc).unwrap()).unwrap();
        if v["kind"] == "MutatingWebhookConfiguration" {
            st.mutating_webhooks.push(v);
        }
    }
    for level in ["restricted", "baseline", "privileged"] {
        st.namespaces.push(namespace_defaults(json!({"metadata": {
            "name": format!("csi-{level}"),
            "labels": {ENFORCE_LABEL: level, "flowlane.io/inject": "enabled"},
        }})));
    }
    st
}

/// POST the pod, as `kubectl apply` would: (status code, body).
fn create(st: &mut ApiState, ns: &str, pod: &Value) -> (u16, Value) {
    let req = Seen {
        method: "POST".into(),
        path: format!("/api/v1/namespaces/{ns}/pods"),
        query: String::new(),
        headers: BTreeMap::new(),
        body: pod.clone(),
        code: 0,
    };
    match answer(st, &req).expect("a pods path") {
        (code, Reply::Json(v)) => (code, v),
        (code, Reply::Raw(..)) => panic!("{code}: not JSON"),
    }
}

/// A training pod written for a "restricted" namespace.
fn restricted_pod(name: &str) -> Value {
    json!({
        "metadata": {"name": name},
        "spec": {
            "securityContext": {"runAsNonRoot": true, "runAsUser": 1000,
                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "trainer", "image": "pytorch/pytorch:2.4.0-cuda12.1-cudnn9-runtime",
                "command": ["python", "train.py"],
                "securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}}}],
        },
    })
}

#[test]
fn an_injected_pod_is_admitted_in_a_restricted_namespace() {
    let _turn = crate::turn::take(module_path!());
    let mut st = api();
    let (code, pod) = create(&mut st, "csi-restricted", &restricted_pod("trainer-0"));
    assert_eq!(code, 201, "{pod}");
    assert_eq!(
        pod["metadata"]["annotations"]["flowlane.io/injected"],
        "true"
    );
    let volumes = pod["spec"]["volumes"].as_array().unwrap();
    assert!(
        volumes.iter().all(|v| v.get("hostPath").is_none()),
        "{volumes:?}"
    );
    let csi: Vec<&Value> = volumes.iter().filter(|v| v["csi"].is_object()).collect();
    assert_eq!(csi.len(), 2, "{volumes:?}");
    for v in csi {
        assert_eq!(v["csi"]["driver"], "csi.flowlane.io");
    }
    let probe = &pod["spec"]["initContainers"][0];
    assert!(probe["name"]
        .as_str()
        .unwrap()
        .starts_with("flowlane-probe-"));
    assert!(pod["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["name"] == "LD_PRELOAD"));
}

#[test]
fn the_hostpath_injection_would_be_refused() {
    let _turn = crate::turn::take(module_path!());
    let mut st = api();
    let (_, injected) = create(&mut st, "csi-privileged", &restricted_pod("old-0"));
    // What the webhook injected before the CSI plugin: the same pod with the two
    // node directories as hostPath volumes.
    let mut old = injected.clone();
    for v in old["spec"]["volumes"].as_array_mut().unwrap() {
        match v["csi"]["volumeAttributes"]["content"].as_str() {
            Some("lib") => {
                *v = json!({"name": v["name"], "hostPath": {"path": "/opt/flowlane/lib", "type": "DirectoryOrCreate"}})
            }
            Some("run") => {
                *v = json!({"name": v["name"], "hostPath": {"path": "/run/flowlane", "type": "DirectoryOrCreate"}})
            }
            _ => {}
        }
    }
    for key in ["uid", "resourceVersion", "creationTimestamp", "namespace"] {
        old["metadata"].as_object_mut().unwrap().remove(key);
    }
    old["metadata"]["name"] = json!("old-1");
    let (code, status) = create(&mut st, "csi-restricted", &old);
    assert_eq!(code, 403, "{status}");
    assert_eq!(status["reason"], "Forbidden");
    assert_eq!(
        status["message"],
        "pods \"old-1\" is forbidden: violates PodSecurity \"restricted:latest\": restricted volume types (volumes \"flowlane-preload\", \"flowlane-run\" use restricted volume type \"hostPath\")"
    );
    let (code, status) = create(&mut st, "csi-baseline", &old);
    assert_eq!(code, 403, "{status}");
    assert_eq!(
        status["message"],
        "pods \"old-1\" is forbidden: violates PodSecurity \"baseline:latest\": hostPath volumes (volumes \"flowlane-preload\", \"flowlane-run\")"
    );
    // The same pod with the CSI volumes is admitted at both levels.
    let mut new = injected;
    for key in ["uid", "resourceVersion", "creationTimestamp", "namespace"] {
        new["metadata"].as_object_mut().unwrap().remove(key);
    }
    new["metadata"]["name"] = json!("new-1");
    for ns in ["csi-restricted", "csi-baseline"] {
        let (code, body) = create(&mut st, ns, &new);
        assert_eq!(code, 201, "{ns}: {body}");
    }
}

#[test]
fn a_root_image_pod_is_injected_where_it_was_admitted_before() {
    let _turn = crate::turn::take(module_path!());
    let mut st = api();
    // No securityContext at all: an image that runs as root.
    let root = json!({"metadata": {"name": "legacy-0"},
        "spec": {"containers": [{"name": "app", "image": "debian:12", "command": ["sleep", "1"]}]}});
    for ns in ["csi-baseline", "csi-privileged"] {
        let (code, pod) = create(&mut st, ns, &root);
        assert_eq!(code, 201, "{ns}: {pod}");
        assert_eq!(
            pod["metadata"]["annotations"]["flowlane.io/injected"],
            "true"
        );
        assert!(
            pod["spec"]["containers"][0]
                .get("securityContext")
                .is_none(),
            "the app is left as it is"
        );
    }
    // In a restricted namespace the pod is refused for its own container only:
    // the injection adds no violation.
    let (code, status) = create(&mut st, "csi-restricted", &root);
    assert_eq!(code, 403);
    let msg = status["message"].as_str().unwrap();
    assert!(msg.contains("container \"app\""), "{msg}");
    assert!(!msg.contains("flowlane"), "{msg}");
}
