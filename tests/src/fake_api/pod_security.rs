//! Pod Security admission as the API server applies it (k8s.io/pod-security-admission,
//! policy version "latest", Linux pods), reimplemented over the pod's JSON: the
//! namespace label `pod-security.kubernetes.io/enforce` picks the level, every
//! check of that level runs in the library's order (baseline IDs sorted, then
//! restricted IDs sorted, a restricted check replacing the baseline check it
//! overrides) and a violation answers 403 with the library's reason and detail
//! strings. The API server runs it after the mutating webhooks, so it sees the
//! injected pod. Each check cites the Go file it follows (policy/check_*.go).

use std::collections::BTreeSet;

use serde_json::Value;

/// The namespace label that enforces a level.
pub const ENFORCE_LABEL: &str = "pod-security.kubernetes.io/enforce";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Privileged,
    Baseline,
    Restricted,
}

/// The level a namespace enforces: none, or an invalid value, is as the API
/// server treats it (no label: privileged; a value it cannot parse: restricted,
/// the safe default).
pub fn enforced_level(namespace: &Value) -> Level {
    match namespace["metadata"]["labels"][ENFORCE_LABEL].as_str() {
        None | Some("privileged") => Level::Privileged,
        Some("baseline") => Level::Baseline,
        _ => Level::Restricted,
    }
}

/// One failed check: the library's ForbiddenReason and ForbiddenDetail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub check: &'static str,
    pub reason: String,
    pub detail: String,
}

type CheckFn = fn(&Value, &Value) -> Option<(String, String)>;

/// Baseline checks, by ID (sorted as the registry sorts them).
const BASELINE: &[(&str, CheckFn)] = &[
    ("appArmorProfile", app_armor_profile),
    ("capabilities_baseline", capabilities_baseline),
    ("hostNamespaces", host_namespaces),
    ("hostPathVolumes", host_path_volumes),
    ("hostPorts", host_ports),
    ("hostProbesAndHostLifecycle", host_probes_and_lifecycle),
    ("privileged", privileged),
    ("procMount", proc_mount_baseline),
    ("seLinuxOptions", se_linux_options),
    ("seccompProfile_baseline", seccomp_baseline),
    ("sysctls", sysctls),
    ("windowsHostProcess", windows_host_process),
];

/// Restricted checks, by ID, with the baseline check each overrides.
const RESTRICTED: &[(&str, Option<&str>, CheckFn)] = &[
    ("allowPrivilegeEscalation", None, allow_privilege_escalation),
    (
        "capabilities_restricted",
        Some("capabilities_baseline"),
        capabilities_restricted,
    ),
    ("procMount_restricted", Some("procMount"), proc_mount),
    (
        "restrictedVolumes",
        Some("hostPathVolumes"),
        restricted_volumes,
    ),
    ("runAsNonRoot", None, run_as_non_root),
    ("runAsUser", None, run_as_user),
    (
        "seccompProfile_restricted",
        Some("seccompProfile_baseline"),
        seccomp_restricted,
    ),
];

/// Every violation of `level` by `pod` (metadata + spec), in the library's order.
pub fn evaluate(level: Level, pod: &Value) -> Vec<Violation> {
    let (meta, spec) = (&pod["metadata"], &pod["spec"]);
    let mut checks: Vec<(&'static str, CheckFn)> = Vec::new();
    if level == Level::Privileged {
        return vec![];
    }
    let overridden: Vec<&str> = if level == Level::Restricted {
        RESTRICTED.iter().filter_map(|c| c.1).collect()
    } else {
        vec![]
    };
    checks.extend(
        BASELINE
            .iter()
            .filter(|c| !overridden.contains(&c.0))
            .copied(),
    );
    if level == Level::Restricted {
        checks.extend(RESTRICTED.iter().map(|c| (c.0, c.2)));
    }
    checks
        .into_iter()
        .filter_map(|(id, f)| {
            f(meta, spec).map(|(reason, detail)| Violation {
                check: id,
                reason,
                detail,
            })
        })
        .collect()
}

/// The API server's message for a refused pod (AggregateCheckResult.ForbiddenDetail).
pub fn forbidden_message(name: &str, level: Level, violations: &[Violation]) -> String {
    let level = match level {
        Level::Privileged => "privileged",
        Level::Baseline => "baseline",
        Level::Restricted => "restricted",
    };
    let parts: Vec<String> = violations
        .iter()
        .map(|v| {
            if v.detail.is_empty() {
                v.reason.clone()
            } else {
                format!("{} ({})", v.reason, v.detail)
            }
        })
        .collect();
    format!(
        "pods \"{name}\" is forbidden: violates PodSecurity \"{level}:latest\": {}",
        parts.join(", ")
    )
}

// ---- helpers (policy/helpers.go, policy/visitor.go) ----

fn join_quote(items: &[String]) -> String {
    if items.is_empty() {
        return String::new();
    }
    format!("\"{}\"", items.join("\", \""))
}

fn pluralize<'a>(singular: &'a str, plural: &'a str, n: usize) -> &'a str {
    if n == 1 {
        singular
    } else {
        plural
    }
}

/// "container \"a\"" / "containers \"a\", \"b\"".
fn containers_phrase(names: &[String]) -> String {
    format!(
        "{} {}",
        pluralize("container", "containers", names.len()),
        join_quote(names)
    )
}

/// Init containers, containers, ephemeral containers, in that order.
fn containers(spec: &Value) -> impl Iterator<Item = &Value> {
    ["initContainers", "containers", "ephemeralContainers"]
        .into_iter()
        .flat_map(move |k| spec[k].as_array().into_iter().flatten())
}

fn name(c: &Value) -> String {
    c["name"].as_str().unwrap_or("").to_string()
}

fn is_windows(spec: &Value) -> bool {
    spec["os"]["name"] == "windows"
}

/// hostUsers: false relaxes runAsNonRoot, runAsUser and procMount (baseline).
fn user_namespaced(spec: &Value) -> bool {
    spec["hostUsers"] == Value::Bool(false)
}

/// Containers for which `bad(securityContext)` holds.
fn bad_containers(spec: &Value, mut bad: impl FnMut(&Value) -> bool) -> Vec<String> {
    containers(spec)
        .filter(|c| bad(&c["securityContext"]))
        .map(name)
        .collect()
}

fn fail(reason: &str, detail: String) -> Option<(String, String)> {
    Some((reason.to_string(), detail))
}

// ---- baseline ----

/// check_appArmorProfile.go
fn app_armor_profile(meta: &Value, spec: &Value) -> Option<(String, String)> {
    let allowed = |t: &Value| t == "RuntimeDefault" || t == "Localhost";
    let mut setters = Vec::new();
    let mut values = BTreeSet::new();
    let pod_profile = &spec["securityContext"]["appArmorProfile"];
    if pod_profile.is_object() && !allowed(&pod_profile["type"]) {
        setters.push("pod".to_string());
        values.insert(pod_profile["type"].as_str().unwrap_or("").to_string());
    }
    let bad: Vec<String> = containers(spec)
        .filter(|c| {
            let p = &c["securityContext"]["appArmorProfile"];
            let b = p.is_object() && !allowed(&p["type"]);
            if b {
                values.insert(p["type"].as_str().unwrap_or("").to_string());
            }
            b
        })
        .map(name)
        .collect();
    if !bad.is_empty() {
        setters.push(containers_phrase(&bad));
    }
    let mut values: Vec<String> = values.into_iter().collect();
    let mut annotations: Vec<String> = meta["annotations"]
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, _)| k.starts_with("container.apparmor.security.beta.kubernetes.io/"))
        .filter_map(|(k, v)| {
            let v = v.as_str().unwrap_or("");
            let ok = v.is_empty() || v == "runtime/default" || v.starts_with("localhost/");
            (!ok).then(|| format!("{k}={v:?}"))
        })
        .collect();
    if !annotations.is_empty() {
        annotations.sort();
        setters.push(pluralize("annotation", "annotations", annotations.len()).to_string());
        values.extend(annotations);
    }
    if setters.is_empty() {
        return None;
    }
    fail(
        pluralize(
            "forbidden AppArmor profile",
            "forbidden AppArmor profiles",
            values.len(),
        ),
        format!(
            "{} must not set AppArmor profile type to {}",
            setters.join(" and "),
            join_quote(&values)
        ),
    )
}

/// check_capabilities_baseline.go
fn capabilities_baseline(_: &Value, spec: &Value) -> Option<(String, String)> {
    const DEFAULT: &[&str] = &[
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    ];
    let mut caps = BTreeSet::new();
    let bad = bad_containers(spec, |sc| {
        let mut b = false;
        for c in sc["capabilities"]["add"].as_array().into_iter().flatten() {
            let c = c.as_str().unwrap_or("");
            if !DEFAULT.contains(&c) {
                caps.insert(c.to_string());
                b = true;
            }
        }
        b
    });
    if bad.is_empty() {
        return None;
    }
    let caps: Vec<String> = caps.into_iter().collect();
    fail(
        "non-default capabilities",
        format!(
            "{} must not include {} in securityContext.capabilities.add",
            containers_phrase(&bad),
            join_quote(&caps)
        ),
    )
}

/// check_hostNamespaces.go
fn host_namespaces(_: &Value, spec: &Value) -> Option<(String, String)> {
    let set: Vec<String> = ["hostNetwork", "hostPID", "hostIPC"]
        .into_iter()
        .filter(|k| spec[*k] == Value::Bool(true))
        .map(|k| format!("{k}=true"))
        .collect();
    (!set.is_empty()).then(|| ("host namespaces".to_string(), set.join(", ")))
}

fn volumes(spec: &Value) -> impl Iterator<Item = &Value> {
    spec["volumes"].as_array().into_iter().flatten()
}

/// check_hostPathVolumes.go
fn host_path_volumes(_: &Value, spec: &Value) -> Option<(String, String)> {
    let bad: Vec<String> = volumes(spec)
        .filter(|v| v["hostPath"].is_object())
        .map(name)
        .collect();
    if bad.is_empty() {
        return None;
    }
    fail(
        "hostPath volumes",
        format!(
            "{} {}",
            pluralize("volume", "volumes", bad.len()),
            join_quote(&bad)
        ),
    )
}

/// check_hostPorts.go
fn host_ports(_: &Value, spec: &Value) -> Option<(String, String)> {
    let mut ports = BTreeSet::new();
    let bad: Vec<String> = containers(spec)
        .filter(|c| {
            let mut b = false;
            for p in c["ports"].as_array().into_iter().flatten() {
                let hp = p["hostPort"].as_i64().unwrap_or(0);
                if hp != 0 {
                    ports.insert(hp.to_string());
                    b = true;
                }
            }
            b
        })
        .map(name)
        .collect();
    if bad.is_empty() {
        return None;
    }
    let ports: Vec<String> = ports.into_iter().collect();
    fail(
        "hostPort",
        format!(
            "{} {} {} {}",
            containers_phrase(&bad),
            pluralize("uses", "use", bad.len()),
            pluralize("hostPort", "hostPorts", ports.len()),
            ports.join(", ")
        ),
    )
}

/// check_hostProbesAndhostLifecycle.go
fn host_probes_and_lifecycle(_: &Value, spec: &Value) -> Option<(String, String)> {
    let mut bad = BTreeSet::new();
    let mut hosts = BTreeSet::new();
    for c in containers(spec) {
        let handlers = [
            &c["livenessProbe"],
            &c["readinessProbe"],
            &c["startupProbe"],
            &c["lifecycle"]["postStart"],
            &c["lifecycle"]["preStop"],
        ];
        for h in handlers {
            for kind in ["httpGet", "tcpSocket"] {
                if let Some(host) = h[kind]["host"].as_str().filter(|s| !s.is_empty()) {
                    bad.insert(name(c));
                    hosts.insert(host.to_string());
                }
            }
        }
    }
    if bad.is_empty() {
        return None;
    }
    let (bad, hosts): (Vec<String>, Vec<String>) =
        (bad.into_iter().collect(), hosts.into_iter().collect());
    fail(
        "probe or lifecycle host",
        format!(
            "{} {} {} {}",
            containers_phrase(&bad),
            pluralize("uses", "use", bad.len()),
            pluralize(
                "probe or lifecycle host",
                "probe or lifecycle hosts",
                hosts.len()
            ),
            join_quote(&hosts)
        ),
    )
}

/// check_privileged.go
fn privileged(_: &Value, spec: &Value) -> Option<(String, String)> {
    let bad = bad_containers(spec, |sc| sc["privileged"] == Value::Bool(true));
    (!bad.is_empty()).then(|| {
        (
            "privileged".to_string(),
            format!(
                "{} must not set securityContext.privileged=true",
                containers_phrase(&bad)
            ),
        )
    })
}

/// check_procMount_restricted.go (procMount_1_0)
fn proc_mount(_: &Value, spec: &Value) -> Option<(String, String)> {
    let mut types = BTreeSet::new();
    let bad = bad_containers(spec, |sc| match sc["procMount"].as_str() {
        Some(t) if t != "Default" => {
            types.insert(t.to_string());
            true
        }
        _ => false,
    });
    if bad.is_empty() {
        return None;
    }
    let types: Vec<String> = types.into_iter().collect();
    fail(
        "procMount",
        format!(
            "{} must not set securityContext.procMount to {}",
            containers_phrase(&bad),
            join_quote(&types)
        ),
    )
}

/// check_procMount_baseline.go (1.35: any value in a user namespace)
fn proc_mount_baseline(meta: &Value, spec: &Value) -> Option<(String, String)> {
    if user_namespaced(spec) {
        return None;
    }
    proc_mount(meta, spec)
}

/// check_seLinuxOptions.go (1.31's types)
fn se_linux_options(_: &Value, spec: &Value) -> Option<(String, String)> {
    const TYPES: &[&str] = &[
        "",
        "container_t",
        "container_init_t",
        "container_kvm_t",
        "container_engine_t",
    ];
    let mut bad_types = BTreeSet::new();
    let (mut set_user, mut set_role) = (false, false);
    let mut valid = |o: &Value| {
        let mut ok = true;
        let t = o["type"].as_str().unwrap_or("");
        if !TYPES.contains(&t) {
            ok = false;
            bad_types.insert(t.to_string());
        }
        if o["user"].as_str().is_some_and(|s| !s.is_empty()) {
            ok = false;
            set_user = true;
        }
        if o["role"].as_str().is_some_and(|s| !s.is_empty()) {
            ok = false;
            set_role = true;
        }
        ok
    };
    let mut setters = Vec::new();
    let pod_opts = &spec["securityContext"]["seLinuxOptions"];
    if pod_opts.is_object() && !valid(pod_opts) {
        setters.push("pod".to_string());
    }
    let bad: Vec<String> = containers(spec)
        .filter(|c| {
            let o = &c["securityContext"]["seLinuxOptions"];
            o.is_object() && !valid(o)
        })
        .map(name)
        .collect();
    if !bad.is_empty() {
        setters.push(containers_phrase(&bad));
    }
    if setters.is_empty() {
        return None;
    }
    let mut data = Vec::new();
    if !bad_types.is_empty() {
        let t: Vec<String> = bad_types.into_iter().collect();
        data.push(format!(
            "{} {}",
            pluralize("type", "types", t.len()),
            join_quote(&t)
        ));
    }
    if set_user {
        data.push("user may not be set".to_string());
    }
    if set_role {
        data.push("role may not be set".to_string());
    }
    fail(
        "seLinuxOptions",
        format!(
            "{} set forbidden securityContext.seLinuxOptions: {}",
            setters.join(" and "),
            data.join("; ")
        ),
    )
}

fn valid_seccomp(t: &Value) -> bool {
    t == "RuntimeDefault" || t == "Localhost"
}

/// The seccomp checks' shared part: who sets a bad type, which containers set
/// none, and the bad values.
fn seccomp_setters(spec: &Value) -> (Vec<String>, Vec<String>, Vec<String>) {
    let mut setters = Vec::new();
    let mut values = BTreeSet::new();
    let pod = &spec["securityContext"]["seccompProfile"];
    let pod_set = if pod.is_object() {
        if !valid_seccomp(&pod["type"]) {
            setters.push("pod".to_string());
            values.insert(pod["type"].as_str().unwrap_or("").to_string());
            false
        } else {
            true
        }
    } else {
        false
    };
    let mut explicit = Vec::new();
    let mut implicit = Vec::new();
    for c in containers(spec) {
        let p = &c["securityContext"]["seccompProfile"];
        if p.is_object() {
            if !valid_seccomp(&p["type"]) {
                explicit.push(name(c));
                values.insert(p["type"].as_str().unwrap_or("").to_string());
            }
        } else if !pod_set {
            implicit.push(name(c));
        }
    }
    if !explicit.is_empty() {
        setters.push(containers_phrase(&explicit));
    }
    (setters, implicit, values.into_iter().collect())
}

/// check_seccompProfile_baseline.go (1.19+: the fields, not the annotations)
fn seccomp_baseline(_: &Value, spec: &Value) -> Option<(String, String)> {
    let (setters, _, values) = seccomp_setters(spec);
    (!setters.is_empty()).then(|| {
        (
            "seccompProfile".to_string(),
            format!(
                "{} must not set securityContext.seccompProfile.type to {}",
                setters.join(" and "),
                join_quote(&values)
            ),
        )
    })
}

/// check_sysctls.go (1.37's safe set)
fn sysctls(_: &Value, spec: &Value) -> Option<(String, String)> {
    const SAFE: &[&str] = &[
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
        "net.ipv4.tcp_rmem",
        "net.ipv4.tcp_wmem",
        "net.ipv4.tcp_slow_start_after_idle",
        "net.ipv4.tcp_notsent_lowat",
    ];
    let bad: Vec<String> = spec["securityContext"]["sysctls"]
        .as_array()
        .into_iter()
        .flatten()
        .map(name)
        .filter(|n| !SAFE.contains(&n.as_str()))
        .collect();
    (!bad.is_empty()).then(|| ("forbidden sysctls".to_string(), bad.join(", ")))
}

/// check_windowsHostProcess.go
fn windows_host_process(_: &Value, spec: &Value) -> Option<(String, String)> {
    let hp = |sc: &Value| sc["windowsOptions"]["hostProcess"] == Value::Bool(true);
    let bad = bad_containers(spec, hp);
    let mut setters = Vec::new();
    if hp(&spec["securityContext"]) {
        setters.push("pod".to_string());
    }
    if !bad.is_empty() {
        setters.push(containers_phrase(&bad));
    }
    (!setters.is_empty()).then(|| {
        (
            "hostProcess".to_string(),
            format!(
                "{} must not set securityContext.windowsOptions.hostProcess=true",
                setters.join(" and ")
            ),
        )
    })
}

// ---- restricted ----

/// check_allowPrivilegeEscalation.go
fn allow_privilege_escalation(_: &Value, spec: &Value) -> Option<(String, String)> {
    if is_windows(spec) {
        return None;
    }
    let bad = bad_containers(spec, |sc| {
        sc["allowPrivilegeEscalation"] != Value::Bool(false)
    });
    (!bad.is_empty()).then(|| {
        (
            "allowPrivilegeEscalation != false".to_string(),
            format!(
                "{} must set securityContext.allowPrivilegeEscalation=false",
                containers_phrase(&bad)
            ),
        )
    })
}

/// check_capabilities_restricted.go
fn capabilities_restricted(_: &Value, spec: &Value) -> Option<(String, String)> {
    if is_windows(spec) {
        return None;
    }
    let mut missing_drop = Vec::new();
    let mut adding = Vec::new();
    let mut caps = BTreeSet::new();
    for c in containers(spec) {
        let cap = &c["securityContext"]["capabilities"];
        if !cap.is_object() {
            missing_drop.push(name(c));
            continue;
        }
        let drops = cap["drop"].as_array().into_iter().flatten();
        if !drops.into_iter().any(|d| d == "ALL") {
            missing_drop.push(name(c));
        }
        let mut bad = false;
        for a in cap["add"].as_array().into_iter().flatten() {
            if a != "NET_BIND_SERVICE" {
                bad = true;
                caps.insert(a.as_str().unwrap_or("").to_string());
            }
        }
        if bad {
            adding.push(name(c));
        }
    }
    let mut details = Vec::new();
    if !missing_drop.is_empty() {
        details.push(format!(
            "{} must set securityContext.capabilities.drop=[\"ALL\"]",
            containers_phrase(&missing_drop)
        ));
    }
    if !adding.is_empty() {
        let caps: Vec<String> = caps.into_iter().collect();
        details.push(format!(
            "{} must not include {} in securityContext.capabilities.add",
            containers_phrase(&adding),
            join_quote(&caps)
        ));
    }
    (!details.is_empty()).then(|| ("unrestricted capabilities".to_string(), details.join("; ")))
}

/// check_restrictedVolumes.go
fn restricted_volumes(_: &Value, spec: &Value) -> Option<(String, String)> {
    const ALLOWED: &[&str] = &[
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "image",
        "persistentVolumeClaim",
        "projected",
        "secret",
    ];
    const NAMED: &[&str] = &[
        "hostPath",
        "gcePersistentDisk",
        "awsElasticBlockStore",
        "gitRepo",
        "nfs",
        "iscsi",
        "glusterfs",
        "rbd",
        "flexVolume",
        "cinder",
        "cephfs",
        "flocker",
        "fc",
        "azureFile",
        "vsphereVolume",
        "quobyte",
        "azureDisk",
        "photonPersistentDisk",
        "portworxVolume",
        "scaleIO",
        "storageos",
    ];
    let has = |v: &Value, k: &str| v.get(k).is_some_and(|s| !s.is_null());
    let mut bad = Vec::new();
    let mut types = BTreeSet::new();
    for v in volumes(spec) {
        if ALLOWED.iter().any(|k| has(v, k)) {
            continue;
        }
        bad.push(name(v));
        let t = NAMED
            .iter()
            .find(|k| has(v, k))
            .copied()
            .unwrap_or("unknown");
        types.insert(t.to_string());
    }
    if bad.is_empty() {
        return None;
    }
    let types: Vec<String> = types.into_iter().collect();
    fail(
        "restricted volume types",
        format!(
            "{} {} {} {} {}",
            pluralize("volume", "volumes", bad.len()),
            join_quote(&bad),
            pluralize("uses", "use", bad.len()),
            pluralize(
                "restricted volume type",
                "restricted volume types",
                types.len()
            ),
            join_quote(&types)
        ),
    )
}

/// check_runAsNonRoot.go (1.35: any value in a user namespace)
fn run_as_non_root(_: &Value, spec: &Value) -> Option<(String, String)> {
    if user_namespaced(spec) {
        return None;
    }
    let mut setters = Vec::new();
    let pod_value = &spec["securityContext"]["runAsNonRoot"];
    if *pod_value == Value::Bool(false) {
        setters.push("pod".to_string());
    }
    let pod_true = *pod_value == Value::Bool(true);
    let mut explicit = Vec::new();
    let mut implicit = Vec::new();
    for c in containers(spec) {
        match c["securityContext"]["runAsNonRoot"].as_bool() {
            Some(false) => explicit.push(name(c)),
            Some(true) => {}
            None if !pod_true => implicit.push(name(c)),
            None => {}
        }
    }
    if !explicit.is_empty() {
        setters.push(containers_phrase(&explicit));
    }
    if !setters.is_empty() {
        return fail(
            "runAsNonRoot != true",
            format!(
                "{} must not set securityContext.runAsNonRoot=false",
                setters.join(" and ")
            ),
        );
    }
    (!implicit.is_empty()).then(|| {
        (
            "runAsNonRoot != true".to_string(),
            format!(
                "pod or {} must set securityContext.runAsNonRoot=true",
                containers_phrase(&implicit)
            ),
        )
    })
}

/// check_runAsUser.go (1.35: any value in a user namespace)
fn run_as_user(_: &Value, spec: &Value) -> Option<(String, String)> {
    if user_namespaced(spec) {
        return None;
    }
    let root = |sc: &Value| sc["runAsUser"].as_i64() == Some(0);
    let mut setters = Vec::new();
    if root(&spec["securityContext"]) {
        setters.push("pod".to_string());
    }
    let bad = bad_containers(spec, root);
    if !bad.is_empty() {
        setters.push(containers_phrase(&bad));
    }
    (!setters.is_empty()).then(|| {
        (
            "runAsUser=0".to_string(),
            format!("{} must not set runAsUser=0", setters.join(" and ")),
        )
    })
}

/// check_seccompProfile_restricted.go
fn seccomp_restricted(meta: &Value, spec: &Value) -> Option<(String, String)> {
    if is_windows(spec) {
        return None;
    }
    if let Some(v) = seccomp_baseline(meta, spec) {
        return Some(v);
    }
    let (_, implicit, _) = seccomp_setters(spec);
    (!implicit.is_empty()).then(|| {
        (
            "seccompProfile".to_string(),
            format!(
                "pod or {} must set securityContext.seccompProfile.type to \"RuntimeDefault\" or \"Localhost\"",
                containers_phrase(&implicit)
            ),
        )
    })
}

#[cfg(test)]
mod tests;
