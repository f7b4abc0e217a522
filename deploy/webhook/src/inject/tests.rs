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
    for (name, path) in [("flowlane-lib", PRELOAD_DIR), ("flowlane-run", SOCKET_DIR)] {
        let m = mounts
            .iter()
            .find(|m| m["name"] == name)
            .expect("mount present");
        assert_eq!(m["mountPath"], path);
        assert_eq!(m["readOnly"], true, "{name} is read-only");
    }
    assert!(
        mounts.iter().all(|m| m["name"] != "flowlane-preload"),
        "the node's directory is the probe's, not the app's"
    );
}

/// The probe init container that serves `container` in the patched `pod`: same
/// image, writes the subPath the container reads.
fn probe_of<'a>(pod: &'a Value, container: &Value) -> &'a Value {
    let sub = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "flowlane-lib")
        .unwrap()["subPath"]
        .as_str()
        .unwrap()
        .to_string();
    let probe = pod["spec"]["initContainers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| {
            c["name"].as_str().unwrap().starts_with(PROBE_PREFIX)
                && c["volumeMounts"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|m| m["name"] == "flowlane-lib" && m["subPath"] == sub.as_str())
        })
        .expect("a probe writes the container's subPath");
    assert_eq!(
        probe["image"], container["image"],
        "the probe runs in the app's image"
    );
    assert_eq!(probe["command"][0], PROBE);
    assert_eq!(probe["command"][2], PRELOAD_DIR);
    let sc = &probe["securityContext"];
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["runAsNonRoot"], true);
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
    probe
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
    // init containers are set-up steps: untouched; the probes come after them
    let before_init = before["spec"]["initContainers"].as_array().unwrap();
    let after_init = after["spec"]["initContainers"].as_array().unwrap();
    assert_eq!(&after_init[..before_init.len()], &before_init[..]);
    let probes: Vec<&Value> = after_init[before_init.len()..].iter().collect();
    let images: std::collections::BTreeSet<&str> = after["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["image"].as_str().unwrap())
        .collect();
    assert_eq!(probes.len(), images.len(), "one probe per distinct image");
    for c in after["spec"]["containers"].as_array().unwrap() {
        let p = probe_of(&after, c);
        assert!(
            p["command"]
                .as_array()
                .unwrap()
                .contains(&c["name"].clone()),
            "the probe names the containers it serves"
        );
    }
    let volumes = after["spec"]["volumes"].as_array().unwrap();
    assert_eq!(volumes.len(), 4);
    // No hostPath: the node's directories come from flowlane's CSI plugin.
    assert_eq!(
        volumes[1],
        json!({"name": "flowlane-preload", "csi": {"driver": CSI_DRIVER, "readOnly": true,
            "volumeAttributes": {"content": "lib"}}})
    );
    assert_eq!(
        volumes[2],
        json!({"name": "flowlane-run", "csi": {"driver": CSI_DRIVER, "readOnly": true,
            "volumeAttributes": {"content": "run"}}})
    );
    assert!(volumes.iter().all(|v| v.get("hostPath").is_none()));
    assert_eq!(volumes[3]["name"], "flowlane-lib");
    assert!(volumes[3]["emptyDir"].is_object());
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
        4,
        "no duplicate volumes"
    );
    // a new image gets its own probe, an image already probed reuses it
    let probe = probe_of(&again, &again["spec"]["containers"][2]);
    assert_eq!(probe["command"].as_array().unwrap().last().unwrap(), "late");
    let mut same = pod.clone();
    let image = pod["spec"]["containers"][0]["image"].clone();
    same["spec"]["containers"][2]["image"] = image;
    let d = decide(&same, Scope::PodOptIn);
    apply(&mut same, &d.patch);
    assert_eq!(
        same["spec"]["initContainers"], pod["spec"]["initContainers"],
        "no second probe for the same image"
    );
    probe_of(&same, &same["spec"]["containers"][2]);
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

#[test]
fn the_pod_label_opts_in_and_out() {
    let body = fixture("pod-namespace-opt-in");
    let request: Value = serde_json::from_slice(&body).unwrap();
    let pod = request["request"]["object"].clone();
    // the label the objectSelector matches opts in outside a labelled namespace
    let mut labelled = pod.clone();
    labelled["metadata"]["labels"][INJECT_LABEL] = json!("true");
    let d = decide(&labelled, Scope::PodOptIn);
    let mut after = labelled.clone();
    apply(&mut after, &d.patch);
    assert_injected(&after["spec"]["containers"][0]);
    probe_of(&after, &after["spec"]["containers"][0]);
    // a pod without init containers gets the array
    assert_eq!(after["spec"]["initContainers"].as_array().unwrap().len(), 1);
    // "false" as a label or as an annotation wins over every opt-in
    for scope in [Scope::NamespaceOptIn, Scope::PodOptIn] {
        let mut out = labelled.clone();
        out["metadata"]["labels"][INJECT_LABEL] = json!("false");
        out["metadata"]["annotations"] = json!({INJECT_ANNOTATION: "true"});
        assert!(decide(&out, scope).patch.is_empty(), "{scope:?}");
        let mut out = labelled.clone();
        out["metadata"]["annotations"] = json!({INJECT_ANNOTATION: "false"});
        assert!(decide(&out, scope).patch.is_empty(), "{scope:?}");
    }
    // any other value opts nothing in
    let mut other = pod.clone();
    other["metadata"]["labels"][INJECT_LABEL] = json!("yes");
    assert!(decide(&other, Scope::PodOptIn).patch.is_empty());
}

#[test]
fn each_distinct_image_gets_one_probe_in_that_image() {
    let body = fixture("pod-namespace-opt-in");
    let request: Value = serde_json::from_slice(&body).unwrap();
    let mut pod = request["request"]["object"].clone();
    let first = pod["spec"]["containers"][0].clone();
    let mut musl = first.clone();
    musl["name"] = json!("alpine-tool");
    musl["image"] = json!("alpine:3.20");
    musl["imagePullPolicy"] = json!("Always");
    let mut twin = first.clone();
    twin["name"] = json!("twin");
    let mut no_image = first.clone();
    no_image["name"] = json!("broken");
    no_image["image"] = json!("");
    pod["spec"]["containers"] = json!([first, musl, twin, no_image]);
    let d = decide(&pod, Scope::NamespaceOptIn);
    let mut after = pod.clone();
    apply(&mut after, &d.patch);
    let init = after["spec"]["initContainers"].as_array().unwrap();
    assert_eq!(init.len(), 2, "{init:?}");
    let c = after["spec"]["containers"].as_array().unwrap();
    for container in &c[..3] {
        assert_injected(container);
    }
    assert_eq!(
        probe_of(&after, &c[0])["name"],
        probe_of(&after, &c[2])["name"]
    );
    let alpine = probe_of(&after, &c[1]);
    assert_ne!(alpine["name"], probe_of(&after, &c[0])["name"]);
    assert_eq!(alpine["imagePullPolicy"], "Always", "pulled as its app is");
    assert_eq!(
        alpine["command"].as_array().unwrap()[3..],
        [json!("alpine-tool")]
    );
    assert_eq!(
        probe_of(&after, &c[0])["command"].as_array().unwrap()[3..],
        [json!("trainer"), json!("twin")]
    );
    assert_eq!(c[3], pod["spec"]["containers"][3], "no image: left alone");
    assert!(d.reason.contains("broken (no image)"), "{}", d.reason);
    // every probe mounts the node's directory read-only, the pod's emptyDir writable
    for p in init {
        let mounts = p["volumeMounts"].as_array().unwrap();
        let node = mounts
            .iter()
            .find(|m| m["name"] == "flowlane-preload")
            .unwrap();
        assert_eq!(
            (&node["mountPath"], &node["readOnly"]),
            (&json!(NODE_LIB_DIR), &json!(true))
        );
        let lib = mounts.iter().find(|m| m["name"] == "flowlane-lib").unwrap();
        assert!(lib.get("readOnly").is_none_or(|r| r == false));
        assert_eq!(env_of(p, "FLOWLANE_SOCKET"), Some(SOCKET_PATH));
    }
}
