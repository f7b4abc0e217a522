//! The patch logic against recorded AdmissionReview v1 requests (tests/fixtures): each
//! test applies the returned JSON Patch to the pod and checks the pod that results.

use super::*;

fn fixture(name: &str) -> Vec<u8> {
    let path = format!("{}/tests/fixtures/{name}.json", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Runs the review and returns (response, pod before, pod after the patch).
fn run(name: &str, scope: Scope) -> (Value, Value, Value) {
    let body = fixture(name);
    let (answer, _) = review(&body, scope).expect("a valid review");
    let request: Value = serde_json::from_slice(&body).unwrap();
    let pod = request["request"]["object"].clone();
    let response = answer["response"].clone();
    assert_eq!(answer["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(answer["kind"], "AdmissionReview");
    assert_eq!(response["uid"], request["request"]["uid"], "uid echoed");
    assert_eq!(response["allowed"], true);
    let mut patched = pod.clone();
    if let Some(b64) = response["patch"].as_str() {
        use base64::Engine as _;
        assert_eq!(response["patchType"], "JSONPatch");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
        let ops: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
        json_patch::patch(&mut patched, &ops).expect("the patch applies to the pod");
    } else {
        assert!(response.get("patchType").is_none());
    }
    (response, pod, patched)
}

fn apply(pod: &mut Value, ops: &[Value]) {
    let patch: json_patch::Patch = serde_json::from_value(json!(ops)).unwrap();
    json_patch::patch(pod, &patch).expect("the patch applies");
}

fn env_of<'a>(container: &'a Value, name: &str) -> Option<&'a str> {
    container["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)?["value"]
        .as_str()
}

fn assert_injected(container: &Value) {
    assert_eq!(
        env_of(container, "LD_PRELOAD").map(|v| v.ends_with(PRELOAD_LIB)),
        Some(true)
    );
    assert_eq!(env_of(container, "FLOWLANE_SOCKET"), Some(SOCKET_PATH));
    let mounts = container["volumeMounts"].as_array().unwrap();
    for (name, path) in [
        ("flowlane-preload", PRELOAD_DIR),
        ("flowlane-run", SOCKET_DIR),
    ] {
        let m = mounts
            .iter()
            .find(|m| m["name"] == name)
            .expect("mount present");
        assert_eq!(m["mountPath"], path);
        assert_eq!(m["readOnly"], true, "{name} is read-only");
    }
}

#[test]
fn annotation_opt_in_injects_every_container_and_keeps_the_rest() {
    let (_, before, after) = run("pod-annotation-opt-in", Scope::PodOptIn);
    for c in after["spec"]["containers"].as_array().unwrap() {
        assert_injected(c);
    }
    let trainer = &after["spec"]["containers"][0];
    assert_eq!(
        env_of(trainer, "WORLD_SIZE"),
        Some("4"),
        "existing env kept"
    );
    assert_eq!(env_of(trainer, "LD_PRELOAD"), Some(PRELOAD_LIB));
    assert_eq!(
        trainer["volumeMounts"][0],
        before["spec"]["containers"][0]["volumeMounts"][0]
    );
    // init containers are set-up steps: untouched
    assert_eq!(
        after["spec"]["initContainers"],
        before["spec"]["initContainers"]
    );
    let volumes = after["spec"]["volumes"].as_array().unwrap();
    assert_eq!(volumes.len(), 3);
    assert_eq!(
        volumes[1]["hostPath"],
        json!({"path": PRELOAD_DIR, "type": "DirectoryOrCreate"})
    );
    assert_eq!(
        volumes[2]["hostPath"],
        json!({"path": SOCKET_DIR, "type": "DirectoryOrCreate"})
    );
    assert_eq!(
        after["metadata"]["annotations"][INJECTED_ANNOTATION],
        "true"
    );
    assert_eq!(after["metadata"]["annotations"][INJECT_ANNOTATION], "true");
}

#[test]
fn opt_out_wins_over_the_namespace_label() {
    for scope in [Scope::NamespaceOptIn, Scope::PodOptIn] {
        let (response, before, after) = run("pod-opt-out", scope);
        assert!(response.get("patch").is_none());
        assert_eq!(before, after);
    }
}

#[test]
fn namespace_label_injects_a_pod_without_annotations() {
    let (_, _, after) = run("pod-namespace-opt-in", Scope::NamespaceOptIn);
    assert_injected(&after["spec"]["containers"][0]);
    assert_eq!(
        after["metadata"]["annotations"],
        json!({INJECTED_ANNOTATION: "true"})
    );
    // the same pod outside an opted-in namespace is left alone
    let (response, before, after) = run("pod-namespace-opt-in", Scope::PodOptIn);
    assert!(response.get("patch").is_none());
    assert_eq!(before, after);
}

#[test]
fn an_existing_ld_preload_keeps_its_library_first() {
    let (_, _, after) = run("pod-existing-ld-preload", Scope::PodOptIn);
    let c = &after["spec"]["containers"][0];
    assert_injected(c);
    assert_eq!(
        env_of(c, "LD_PRELOAD"),
        Some(format!("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2:{PRELOAD_LIB}").as_str())
    );
    let names: Vec<&str> = c["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["LD_PRELOAD", "MALLOC_CONF", "FLOWLANE_SOCKET"],
        "one LD_PRELOAD only"
    );
}

#[test]
fn an_injected_pod_is_unchanged() {
    for scope in [Scope::NamespaceOptIn, Scope::PodOptIn] {
        let (response, before, after) = run("pod-already-injected", scope);
        assert!(response.get("patch").is_none(), "no patch for {scope:?}");
        assert_eq!(before, after);
    }
    // and injecting twice gives the same pod as injecting once
    let (_, _, once) = run("pod-annotation-opt-in", Scope::PodOptIn);
    assert!(decide(&once, Scope::PodOptIn).patch.is_empty());
}

#[test]
fn a_container_added_later_is_injected_alone() {
    let (_, _, mut pod) = run("pod-annotation-opt-in", Scope::PodOptIn);
    let sidecar = json!({"name": "late", "image": "x"});
    pod["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .push(sidecar);
    let decision = decide(&pod, Scope::PodOptIn);
    let mut again = pod.clone();
    apply(&mut again, &decision.patch);
    assert_injected(&again["spec"]["containers"][2]);
    assert_eq!(
        again["spec"]["volumes"].as_array().unwrap().len(),
        3,
        "no duplicate volumes"
    );
    assert_eq!(again["spec"]["containers"][0], pod["spec"]["containers"][0]);
}

#[test]
fn skipped_containers_host_network_and_value_from_are_left_alone() {
    let body = fixture("pod-annotation-opt-in");
    let request: Value = serde_json::from_slice(&body).unwrap();
    let mut pod = request["request"]["object"].clone();
    pod["metadata"]["annotations"][SKIP_CONTAINERS_ANNOTATION] = json!("metrics-exporter");
    let decision = decide(&pod, Scope::PodOptIn);
    let mut after = pod.clone();
    apply(&mut after, &decision.patch);
    assert_injected(&after["spec"]["containers"][0]);
    assert_eq!(after["spec"]["containers"][1], pod["spec"]["containers"][1]);
    assert!(
        decision.reason.contains("metrics-exporter"),
        "{}",
        decision.reason
    );

    let mut host = pod.clone();
    host["spec"]["hostNetwork"] = json!(true);
    assert!(decide(&host, Scope::NamespaceOptIn).patch.is_empty());

    let mut from = pod.clone();
    from["metadata"]["annotations"][SKIP_CONTAINERS_ANNOTATION] = json!("");
    from["spec"]["containers"][0]["env"] = json!([{"name": "LD_PRELOAD", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}]);
    let decision = decide(&from, Scope::PodOptIn);
    assert!(decision.reason.contains("valueFrom"), "{}", decision.reason);
    assert!(decision.patch.iter().all(|op| !op["path"]
        .as_str()
        .unwrap()
        .starts_with("/spec/containers/0")));
}

#[test]
fn bad_bodies_are_refused_with_a_reason() {
    assert!(matches!(
        review(b"{not json", Scope::PodOptIn),
        Err(BadReview::NotJson(_))
    ));
    assert_eq!(
        review(b"{}", Scope::PodOptIn).unwrap_err(),
        BadReview::NotAReview
    );
    let v1beta1 = br#"{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview","request":{"uid":"u"}}"#;
    assert_eq!(
        review(v1beta1, Scope::PodOptIn).unwrap_err(),
        BadReview::NotAReview
    );
    // a review that is not a pod creation is allowed untouched
    let update = br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"u","operation":"UPDATE","kind":{"kind":"Pod"},"object":{}}}"#;
    let (answer, _) = review(update, Scope::NamespaceOptIn).unwrap();
    assert_eq!(answer["response"], json!({"uid": "u", "allowed": true}));
}
