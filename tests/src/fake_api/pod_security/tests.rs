//! One violating and one passing pod per rule; the expected strings are the
//! library's (policy/check_*.go and its testdata).

use serde_json::json;

use super::*;

/// A pod that passes "restricted": every rule's passing case starts from it.
fn restricted_pod() -> Value {
    json!({
        "metadata": {"name": "p", "annotations": {}},
        "spec": {
            "securityContext": {"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}},
            "initContainers": [{"name": "init", "image": "i",
                "securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}}}],
            "containers": [{"name": "app", "image": "i",
                "securityContext": {"allowPrivilegeEscalation": false,
                    "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}}],
            "volumes": [
                {"name": "e", "emptyDir": {}},
                {"name": "c", "csi": {"driver": "csi.flowlane.io", "readOnly": true}},
                {"name": "s", "secret": {"secretName": "x"}},
                {"name": "pr", "projected": {"sources": []}},
            ],
        },
    })
}

/// (check id, level it belongs to, a change that violates it, the expected detail)
#[allow(clippy::type_complexity)]
fn cases() -> Vec<(&'static str, Level, fn(&mut Value), &'static str)> {
    vec![
        ("appArmorProfile", Level::Baseline,
            |p| p["spec"]["containers"][0]["securityContext"]["appArmorProfile"] = json!({"type": "Unconfined"}),
            "container \"app\" must not set AppArmor profile type to \"Unconfined\""),
        ("capabilities_baseline", Level::Baseline,
            |p| p["spec"]["containers"][0]["securityContext"]["capabilities"]["add"] = json!(["NET_RAW"]),
            "container \"app\" must not include \"NET_RAW\" in securityContext.capabilities.add"),
        ("hostNamespaces", Level::Baseline,
            |p| { p["spec"]["hostNetwork"] = json!(true); p["spec"]["hostPID"] = json!(true); },
            "hostNetwork=true, hostPID=true"),
        ("hostPathVolumes", Level::Baseline,
            |p| p["spec"]["volumes"][0] = json!({"name": "h", "hostPath": {"path": "/run/flowlane"}}),
            "volume \"h\""),
        ("hostPorts", Level::Baseline,
            |p| p["spec"]["containers"][0]["ports"] = json!([{"containerPort": 80, "hostPort": 8080}]),
            "container \"app\" uses hostPort 8080"),
        ("hostProbesAndHostLifecycle", Level::Baseline,
            |p| p["spec"]["containers"][0]["livenessProbe"] = json!({"httpGet": {"host": "10.0.0.1", "port": 80}}),
            "container \"app\" uses probe or lifecycle host \"10.0.0.1\""),
        ("privileged", Level::Baseline,
            |p| p["spec"]["initContainers"][0]["securityContext"]["privileged"] = json!(true),
            "container \"init\" must not set securityContext.privileged=true"),
        ("procMount", Level::Baseline,
            |p| p["spec"]["containers"][0]["securityContext"]["procMount"] = json!("Unmasked"),
            "container \"app\" must not set securityContext.procMount to \"Unmasked\""),
        ("seLinuxOptions", Level::Baseline,
            |p| p["spec"]["securityContext"]["seLinuxOptions"] = json!({"type": "spc_t", "user": "u"}),
            "pod set forbidden securityContext.seLinuxOptions: type \"spc_t\"; user may not be set"),
        ("seccompProfile_baseline", Level::Baseline,
            |p| p["spec"]["containers"][0]["securityContext"]["seccompProfile"] = json!({"type": "Unconfined"}),
            "container \"app\" must not set securityContext.seccompProfile.type to \"Unconfined\""),
        ("sysctls", Level::Baseline,
            |p| p["spec"]["securityContext"]["sysctls"] = json!([{"name": "kernel.msgmax", "value": "1"}, {"name": "net.ipv4.tcp_rmem", "value": "1 2 3"}]),
            "kernel.msgmax"),
        ("windowsHostProcess", Level::Baseline,
            |p| p["spec"]["securityContext"]["windowsOptions"] = json!({"hostProcess": true}),
            "pod must not set securityContext.windowsOptions.hostProcess=true"),
        ("allowPrivilegeEscalation", Level::Restricted,
            |p| { p["spec"]["containers"][0]["securityContext"].as_object_mut().unwrap().remove("allowPrivilegeEscalation"); },
            "container \"app\" must set securityContext.allowPrivilegeEscalation=false"),
        ("capabilities_restricted", Level::Restricted,
            |p| p["spec"]["initContainers"][0]["securityContext"]["capabilities"] = json!({"drop": ["NET_RAW"]}),
            "container \"init\" must set securityContext.capabilities.drop=[\"ALL\"]"),
        ("restrictedVolumes", Level::Restricted,
            |p| p["spec"]["volumes"][1] = json!({"name": "n", "nfs": {"server": "s", "path": "/"}}),
            "volume \"n\" uses restricted volume type \"nfs\""),
        ("runAsNonRoot", Level::Restricted,
            |p| { p["spec"]["securityContext"].as_object_mut().unwrap().remove("runAsNonRoot"); },
            "pod or containers \"init\", \"app\" must set securityContext.runAsNonRoot=true"),
        ("runAsUser", Level::Restricted,
            |p| p["spec"]["containers"][0]["securityContext"]["runAsUser"] = json!(0),
            "container \"app\" must not set runAsUser=0"),
        ("seccompProfile_restricted", Level::Restricted,
            |p| { p["spec"]["securityContext"].as_object_mut().unwrap().remove("seccompProfile"); },
            "pod or containers \"init\", \"app\" must set securityContext.seccompProfile.type to \"RuntimeDefault\" or \"Localhost\""),
    ]
}

#[test]
fn the_passing_pod_passes_every_level() {
    for level in [Level::Privileged, Level::Baseline, Level::Restricted] {
        assert_eq!(evaluate(level, &restricted_pod()), vec![], "{level:?}");
    }
}

#[test]
fn each_rule_refuses_its_violation_and_only_at_its_level() {
    for (check, level, break_it, detail) in cases() {
        let mut pod = restricted_pod();
        break_it(&mut pod);
        let own = evaluate(level, &pod);
        assert_eq!(own.len(), 1, "{check}: {own:?}");
        assert_eq!((own[0].check, own[0].detail.as_str()), (check, detail));
        // Under restricted, a baseline rule that a restricted one overrides is
        // reported under the restricted rule's id.
        let strict = evaluate(Level::Restricted, &pod);
        let overriding = RESTRICTED.iter().find(|r| r.1 == Some(check)).map(|r| r.0);
        assert_eq!(strict.len(), 1, "{check}: {strict:?}");
        assert_eq!(strict[0].check, overriding.unwrap_or(check));
        if level == Level::Restricted {
            assert_eq!(evaluate(Level::Baseline, &pod), vec![], "{check}");
        }
        assert!(evaluate(Level::Privileged, &pod).is_empty());
    }
}

#[test]
fn host_path_is_reported_as_the_library_reports_it() {
    let mut pod = restricted_pod();
    pod["spec"]["volumes"] = json!([
        {"name": "flowlane-preload", "hostPath": {"path": "/opt/flowlane/lib"}},
        {"name": "flowlane-run", "hostPath": {"path": "/run/flowlane"}},
    ]);
    let b = evaluate(Level::Baseline, &pod);
    assert_eq!(
        forbidden_message("p", Level::Baseline, &b),
        "pods \"p\" is forbidden: violates PodSecurity \"baseline:latest\": hostPath volumes (volumes \"flowlane-preload\", \"flowlane-run\")"
    );
    let r = evaluate(Level::Restricted, &pod);
    assert_eq!(
        forbidden_message("p", Level::Restricted, &r),
        "pods \"p\" is forbidden: violates PodSecurity \"restricted:latest\": restricted volume types (volumes \"flowlane-preload\", \"flowlane-run\" use restricted volume type \"hostPath\")"
    );
}

#[test]
fn a_bare_pod_fails_restricted_in_the_librarys_order() {
    let pod =
        json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "i"}]}});
    let got: Vec<&str> = evaluate(Level::Restricted, &pod)
        .iter()
        .map(|v| v.check)
        .collect();
    assert_eq!(
        got,
        [
            "allowPrivilegeEscalation",
            "capabilities_restricted",
            "runAsNonRoot",
            "seccompProfile_restricted"
        ]
    );
    assert!(evaluate(Level::Baseline, &pod).is_empty());
}

#[test]
fn user_namespaces_relax_the_user_rules() {
    let mut pod = restricted_pod();
    pod["spec"]["hostUsers"] = json!(false);
    pod["spec"]["securityContext"]["runAsNonRoot"] = json!(false);
    pod["spec"]["containers"][0]["securityContext"]["runAsUser"] = json!(0);
    assert!(evaluate(Level::Restricted, &pod).is_empty());
}

#[test]
fn namespace_labels_pick_the_level() {
    let ns = |v: Value| json!({"metadata": {"labels": v}});
    assert_eq!(enforced_level(&ns(json!({}))), Level::Privileged);
    assert_eq!(
        enforced_level(&ns(json!({ENFORCE_LABEL: "baseline"}))),
        Level::Baseline
    );
    assert_eq!(
        enforced_level(&ns(json!({ENFORCE_LABEL: "restricted"}))),
        Level::Restricted
    );
    assert_eq!(
        enforced_level(&ns(json!({ENFORCE_LABEL: "bogus"}))),
        Level::Restricted
    );
}
