//! deploy/kubernetes validates offline: every YAML document deserialises into its
//! k8s-openapi (v1_30) type without losing a field (a misspelt or misplaced key fails),
//! each kustomization lists exactly the files next to it, and the references between
//! objects (service accounts, config keys, volumes, webhook paths, ports, flags) hold.
//! The kustomize components under `components/` (JSON patches) are applied here as
//! kustomize would, and each variant is checked the same way. The node agent's arguments
//! are expanded as the kubelet does (`$(VAR)` from its env, downward API with sample
//! values) and checked by the real `flowlaned --check-config`.

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Namespace, PodSpec, Service, ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::api::storage::v1::CSIDriver;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

mod common;
use common::release_dir;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../kubernetes")
}

/// Every `*.yaml` under `dir`, recursively, sorted; kustomize components (JSON
/// patches, see [`render`]) are not objects and are left out.
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            if path.file_name().unwrap() != "components" {
                out.extend(yaml_files(&path));
            }
        } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            out.push(path);
        }
    }
    out.sort();
    out
}

/// The documents of one YAML file as JSON values.
fn documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| {
            let v = serde_yaml::Value::deserialize(doc)
                .unwrap_or_else(|e| panic!("{}: not YAML: {e}", path.display()));
            serde_json::to_value(v).unwrap()
        })
        .filter(|v| !v.is_null())
        .collect()
}
use serde::Deserialize as _;

/// Fails if `typed` (the document after a trip through its k8s-openapi type) lacks any
/// value of `orig`: k8s-openapi ignores unknown keys, so this is what catches a typo.
fn assert_nothing_dropped(orig: &Value, typed: &Value, at: &str, file: &Path) {
    match (orig, typed) {
        (Value::Object(o), Value::Object(t)) => {
            for (k, v) in o {
                let Some(tv) = t.get(k) else {
                    panic!(
                        "{}: {at}/{k} is not a field of the Kubernetes type",
                        file.display()
                    )
                };
                assert_nothing_dropped(v, tv, &format!("{at}/{k}"), file);
            }
        }
        (Value::Array(o), Value::Array(t)) => {
            assert_eq!(o.len(), t.len(), "{}: {at}", file.display());
            for (i, (a, b)) in o.iter().zip(t).enumerate() {
                assert_nothing_dropped(a, b, &format!("{at}/{i}"), file);
            }
        }
        _ => assert_eq!(
            orig,
            typed,
            "{}: {at} changed in the round trip",
            file.display()
        ),
    }
}

fn typed<T: DeserializeOwned + Serialize>(doc: &Value, file: &Path) -> T {
    let value: T = serde_json::from_value(doc.clone()).unwrap_or_else(|e| {
        panic!(
            "{}: {} {}: {e}",
            file.display(),
            doc["kind"],
            doc["metadata"]["name"]
        )
    });
    let back = serde_json::to_value(&value).unwrap();
    assert_nothing_dropped(doc, &back, "", file);
    value
}

/// All objects of the tree, typed, by kind.
#[derive(Default)]
struct Objects {
    namespaces: Vec<Namespace>,
    service_accounts: Vec<ServiceAccount>,
    cluster_roles: Vec<ClusterRole>,
    bindings: Vec<ClusterRoleBinding>,
    config_maps: Vec<ConfigMap>,
    daemon_sets: Vec<DaemonSet>,
    deployments: Vec<Deployment>,
    services: Vec<Service>,
    webhooks: Vec<MutatingWebhookConfiguration>,
    csi_drivers: Vec<CSIDriver>,
}

/// Every object document of the tree, with its file.
fn raw_objects(dir: &Path) -> Vec<(PathBuf, Value)> {
    yaml_files(dir)
        .into_iter()
        .filter(|f| f.file_name().unwrap() != "kustomization.yaml")
        .flat_map(|f| documents(&f).into_iter().map(move |d| (f.clone(), d)))
        .collect()
}

fn load(dir: &Path) -> Objects {
    load_documents(raw_objects(dir))
}

fn load_documents(docs: Vec<(PathBuf, Value)>) -> Objects {
    let mut objects = Objects::default();
    for (file, doc) in docs {
        let kind = format!(
            "{}/{}",
            doc["apiVersion"].as_str().unwrap_or("?"),
            doc["kind"].as_str().unwrap_or("?")
        );
        match kind.as_str() {
            "v1/Namespace" => objects.namespaces.push(typed(&doc, &file)),
            "v1/ServiceAccount" => objects.service_accounts.push(typed(&doc, &file)),
            "rbac.authorization.k8s.io/v1/ClusterRole" => {
                objects.cluster_roles.push(typed(&doc, &file))
            }
            "rbac.authorization.k8s.io/v1/ClusterRoleBinding" => {
                objects.bindings.push(typed(&doc, &file))
            }
            "v1/ConfigMap" => objects.config_maps.push(typed(&doc, &file)),
            "apps/v1/DaemonSet" => objects.daemon_sets.push(typed(&doc, &file)),
            "apps/v1/Deployment" => objects.deployments.push(typed(&doc, &file)),
            "v1/Service" => objects.services.push(typed(&doc, &file)),
            "admissionregistration.k8s.io/v1/MutatingWebhookConfiguration" => {
                objects.webhooks.push(typed(&doc, &file))
            }
            "storage.k8s.io/v1/CSIDriver" => objects.csi_drivers.push(typed(&doc, &file)),
            other => panic!(
                "{}: kind {other} is not checked by this test; add it",
                file.display()
            ),
        }
    }
    objects
}

#[test]
fn every_kustomization_lists_exactly_its_files() {
    let mut seen = 0;
    for file in yaml_files(&deploy_dir()) {
        if file.file_name().unwrap() != "kustomization.yaml" {
            continue;
        }
        seen += 1;
        let doc = &documents(&file)[0];
        assert_eq!(
            doc["apiVersion"],
            "kustomize.config.k8s.io/v1beta1",
            "{}",
            file.display()
        );
        assert_eq!(doc["kind"], "Kustomization");
        let listed: BTreeSet<String> = doc["resources"]
            .as_array()
            .expect("resources")
            .iter()
            .map(|r| r.as_str().unwrap().to_string())
            .collect();
        let dir = file.parent().unwrap();
        let present: BTreeSet<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
            .collect();
        assert_eq!(
            listed,
            present,
            "{}: resources vs the YAML files beside it",
            file.display()
        );
        // the image every workload uses is the one the kustomization rewrites
        let image = doc["images"][0]["name"].as_str().expect("images[0].name");
        for name in &present {
            for d in documents(&dir.join(name)) {
                let spec = &d["spec"]["template"]["spec"];
                for c in ["initContainers", "containers"]
                    .iter()
                    .flat_map(|k| spec[k].as_array().cloned().unwrap_or_default())
                {
                    let used = c["image"].as_str().unwrap();
                    assert_eq!(used.split(':').next(), Some(image), "{name}: {used}");
                }
            }
        }
    }
    assert_eq!(seen, 2, "deploy/kubernetes and deploy/kubernetes/uninstall");
}

fn container<'a>(spec: &'a PodSpec, name: &str) -> &'a Container {
    spec.init_containers
        .iter()
        .flatten()
        .chain(&spec.containers)
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

/// Volume mounts name volumes of the pod, config references name real keys.
fn check_pod_references(spec: &PodSpec, objects: &Objects, what: &str) {
    let volumes: BTreeSet<&str> = spec
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    let config: BTreeMap<&str, &ConfigMap> = objects
        .config_maps
        .iter()
        .map(|c| (c.metadata.name.as_deref().unwrap(), c))
        .collect();
    for c in spec
        .init_containers
        .iter()
        .flatten()
        .chain(&spec.containers)
    {
        for m in c.volume_mounts.iter().flatten() {
            assert!(
                volumes.contains(m.name.as_str()),
                "{what}/{}: mount of unknown volume {}",
                c.name,
                m.name
            );
        }
        for e in c.env.iter().flatten() {
            if let Some(r) = e
                .value_from
                .as_ref()
                .and_then(|f| f.config_map_key_ref.as_ref())
            {
                let cm = config
                    .get(r.name.as_str())
                    .unwrap_or_else(|| panic!("{what}: no ConfigMap {}", r.name));
                assert!(
                    cm.data.as_ref().unwrap().contains_key(&r.key),
                    "{what}: no key {}",
                    r.key
                );
            }
        }
        for f in c.env_from.iter().flatten() {
            if let Some(r) = &f.config_map_ref {
                assert!(
                    config.contains_key(r.name.as_str()),
                    "{what}: no ConfigMap {}",
                    r.name
                );
            }
        }
    }
    for v in spec.volumes.iter().flatten() {
        if let Some(cm) = &v.config_map {
            assert!(
                config.contains_key(cm.name.as_str()),
                "{what}: volume of unknown ConfigMap {}",
                cm.name
            );
        }
    }
    if let Some(sa) = &spec.service_account_name {
        assert!(
            objects
                .service_accounts
                .iter()
                .any(|s| s.metadata.name.as_ref() == Some(sa)),
            "{what}: no ServiceAccount {sa}"
        );
    }
}

/// Every `--flag=` in args is a flag the binary's --help lists.
fn assert_flags_exist(binary: &Path, args: &[String]) {
    let out = std::process::Command::new(binary)
        .arg("--help")
        .output()
        .unwrap_or_else(|e| panic!("{}: {e} (build the workspace first)", binary.display()));
    let help = String::from_utf8_lossy(&out.stdout);
    for a in args {
        let flag = a.split('=').next().unwrap();
        assert!(
            flag.starts_with("--") && help.contains(flag),
            "{}: unknown flag {flag}",
            binary.display()
        );
    }
}

/// The kustomize components (`deploy/kubernetes/components/<name>`).
fn component_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(deploy_dir().join("components"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs
}

/// The tree's objects with `component` applied as kustomize applies a
/// Component's `patches` (JSON 6902 patches, each on the objects its target
/// names): a failing `test` operation or a target that matches nothing fails.
fn render(component: Option<&str>) -> Objects {
    let mut docs = raw_objects(&deploy_dir());
    if let Some(name) = component {
        let dir = deploy_dir().join("components").join(name);
        let kz = &documents(&dir.join("kustomization.yaml"))[0];
        for patch in kz["patches"].as_array().expect("patches") {
            let file = dir.join(patch["path"].as_str().unwrap());
            let ops: json_patch::Patch = serde_json::from_value(Value::Array(
                documents(&file)[0].as_array().unwrap().clone(),
            ))
            .unwrap_or_else(|e| panic!("{}: not a JSON patch: {e}", file.display()));
            let (kind, name) = (&patch["target"]["kind"], &patch["target"]["name"]);
            let mut hits = 0;
            for (_, doc) in docs
                .iter_mut()
                .filter(|(_, d)| &d["kind"] == kind && &d["metadata"]["name"] == name)
            {
                json_patch::patch(doc, &ops).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
                hits += 1;
            }
            assert_eq!(hits, 1, "{}: target {kind} {name}", file.display());
        }
    }
    load_documents(docs)
}

/// The data of the ConfigMap flowlane-config.
fn flowlane_config(objects: &Objects) -> &BTreeMap<String, String> {
    let cm = objects
        .config_maps
        .iter()
        .find(|c| c.metadata.name.as_deref() == Some("flowlane-config"))
        .expect("ConfigMap flowlane-config");
    cm.data.as_ref().expect("flowlane-config has data")
}

fn node_agent(objects: &Objects) -> &PodSpec {
    let ds = objects
        .daemon_sets
        .iter()
        .find(|d| d.metadata.name.as_deref() == Some("flowlane-node"))
        .unwrap();
    ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap()
}

/// Sample values for the downward API fields the manifests use.
fn downward(field: &str) -> &'static str {
    match field {
        "spec.nodeName" => "node-a",
        "status.hostIP" => "192.0.2.10",
        other => panic!("downward API field {other}: add a sample value"),
    }
}

/// `$(VAR)` references expanded as the kubelet does: defined variables are
/// replaced, `$$` is a literal `$`, anything else stays as written.
fn kubelet_expand(s: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if let Some(t) = tail.strip_prefix("$$") {
            out.push('$');
            rest = t;
        } else if let Some((name, t)) = tail.strip_prefix("$(").and_then(|t| t.split_once(')')) {
            match env.get(name) {
                Some(v) => out.push_str(v),
                None => out.push_str(&tail[..name.len() + 3]),
            }
            rest = t;
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

/// The container's environment as the kubelet builds it: `envFrom` ConfigMaps,
/// then `env` in order (values expanded against what came before).
fn container_env(c: &Container, objects: &Objects) -> BTreeMap<String, String> {
    let config = |name: &str| -> BTreeMap<String, String> {
        objects
            .config_maps
            .iter()
            .find(|m| m.metadata.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no ConfigMap {name}"))
            .data
            .clone()
            .unwrap_or_default()
    };
    let mut env = BTreeMap::new();
    for f in c.env_from.iter().flatten() {
        let r = f.config_map_ref.as_ref().expect("envFrom a ConfigMap");
        for (k, v) in config(&r.name) {
            env.insert(format!("{}{k}", f.prefix.as_deref().unwrap_or("")), v);
        }
    }
    for e in c.env.iter().flatten() {
        let v = if let Some(v) = &e.value {
            kubelet_expand(v, &env)
        } else {
            let from = e.value_from.as_ref().expect("value or valueFrom");
            if let Some(f) = &from.field_ref {
                downward(&f.field_path).to_string()
            } else if let Some(r) = &from.config_map_key_ref {
                config(&r.name)[&r.key].clone()
            } else {
                panic!("{}: valueFrom kind not handled", e.name)
            }
        };
        env.insert(e.name.clone(), v);
    }
    env
}

/// `flowlaned --check-config` on the container's arguments as the kubelet
/// expands them, in its environment; returns the summary line.
fn flowlaned_accepts(daemon: &Container, objects: &Objects) -> String {
    let env = container_env(daemon, objects);
    let args: Vec<String> = daemon
        .args
        .iter()
        .flatten()
        .map(|a| kubelet_expand(a, &env))
        .collect();
    let binary = release_dir().join("flowlaned");
    let out = std::process::Command::new(&binary)
        .arg("--check-config")
        .args(&args)
        .env_clear()
        .envs(&env)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e} (build the workspace first)", binary.display()));
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "flowlaned rejects the DaemonSet's arguments {args:?}: {}{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn capabilities(c: &Container) -> (Option<Vec<String>>, Option<Vec<String>>) {
    let caps = c
        .security_context
        .as_ref()
        .and_then(|s| s.capabilities.clone())
        .unwrap_or_default();
    (caps.drop, caps.add)
}

fn mount_paths(c: &Container) -> BTreeSet<&str> {
    c.volume_mounts
        .iter()
        .flatten()
        .map(|m| m.mount_path.as_str())
        .collect()
}

/// The API server's rule (pod validation): a privileged container must not
/// set `allowPrivilegeEscalation: false`.
fn assert_valid_privilege(c: &Container) {
    let sc = c.security_context.as_ref().unwrap();
    if sc.privileged == Some(true) {
        assert_ne!(
            sc.allow_privilege_escalation,
            Some(false),
            "{}: the API server rejects privileged with allowPrivilegeEscalation: false",
            c.name
        );
    }
}

#[test]
fn the_node_agent_is_complete_and_runs_the_rdma_lane() {
    let objects = load(&deploy_dir());
    let spec = node_agent(&objects);
    check_pod_references(spec, &objects, "flowlane-node");
    assert_eq!(spec.host_network, Some(true));
    assert_eq!(spec.host_pid, Some(true));
    assert!(spec
        .tolerations
        .iter()
        .flatten()
        .any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none()));

    let daemon = container(spec, "flowlaned");
    for c in spec
        .init_containers
        .iter()
        .flatten()
        .chain(&spec.containers)
    {
        assert_valid_privilege(c);
    }
    // The RDMA lane's device: privileged (device cgroup; see daemonset.yaml),
    // which includes SYS_PTRACE and IPC_LOCK, and the host's /dev/infiniband, live.
    let sc = daemon.security_context.as_ref().unwrap();
    assert_eq!(
        sc.privileged,
        Some(true),
        "the lane opens /dev/infiniband/uverbs*"
    );
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    let dev = daemon
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == "/dev/infiniband")
        .expect("flowlaned mounts /dev/infiniband");
    let dev_volume = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == dev.name)
        .unwrap();
    let hp = dev_volume.host_path.as_ref().expect("a hostPath");
    assert_eq!(hp.path, "/dev/infiniband");
    assert_eq!(
        hp.type_.as_deref(),
        Some("DirectoryOrCreate"),
        "a node without RDMA has no /dev/infiniband: the pod must still start"
    );
    let mounts = mount_paths(daemon);
    for path in [
        "/run/flowlane",
        "/var/lib/flowlane",
        // the pods' pinned namespaces: registry entries are checked against them
        "/run/netns",
        "/etc/cni/net.d",
        "/opt/cni/bin",
    ] {
        assert!(mounts.contains(path), "flowlaned mounts {path}");
    }
    assert_flags_exist(
        &release_dir().join("flowlaned"),
        daemon.args.as_ref().unwrap(),
    );
    // The cross-node view: flowlaned reads the Nodes from the API and knows
    // which one it runs on from NODE_NAME = spec.nodeName (downward API).
    let args: Vec<&str> = daemon.args.iter().flatten().map(String::as_str).collect();
    assert!(
        args.contains(&"--kubernetes"),
        "flowlaned builds its node table from the API"
    );
    let field_of = |name: &str| {
        daemon
            .env
            .iter()
            .flatten()
            .find(|e| e.name == name)
            .and_then(|e| e.value_from.as_ref())
            .and_then(|v| v.field_ref.as_ref())
            .map(|f| f.field_path.clone())
    };
    assert_eq!(field_of("NODE_NAME").as_deref(), Some("spec.nodeName"));
    // The relay listens on the node's own address (status.hostIP: the address
    // the node table lists for it) and the lane port, over RDMA.
    assert_eq!(field_of("HOST_IP").as_deref(), Some("status.hostIP"));
    assert!(
        args.contains(&"--lane-listen=$(HOST_IP):$(FLOWLANE_LANE_PORT)"),
        "{args:?}"
    );
    assert!(
        args.contains(&"--lane-transport=$(FLOWLANE_LANE_TRANSPORT)"),
        "{args:?}"
    );
    let env = container_env(daemon, &objects);
    assert_eq!(env["FLOWLANE_LANE_TRANSPORT"], "rdma");
    // Pod routes (docs/daemon.md "Pod routes"): on by default, from the ConfigMap.
    assert!(
        args.contains(&"--pod-routes=$(FLOWLANE_POD_ROUTES)"),
        "{args:?}"
    );
    assert_eq!(env["FLOWLANE_POD_ROUTES"], "auto");
    let lane_port = daemon
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("lane"))
        .expect("a lane port");
    assert_eq!(
        lane_port.container_port.to_string(),
        env["FLOWLANE_LANE_PORT"]
    );
    // The lane key (docs/security.md): the Secret flowlane-lane-key
    // (deploy/kubernetes/lane-key.sh makes it), mounted read-only, mode 0400
    // (flowlaned refuses a key that group or others may read), optional only
    // so that the relay-off variant needs none.
    assert!(
        args.contains(&"--lane-key-file=/etc/flowlane-lane/key"),
        "{args:?}"
    );
    let key_volume = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "lane-key")
        .and_then(|v| v.secret.as_ref())
        .expect("a lane-key Secret volume");
    assert_eq!(key_volume.secret_name.as_deref(), Some("flowlane-lane-key"));
    assert_eq!(key_volume.default_mode, Some(0o400));
    let key_mount = daemon
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "lane-key")
        .expect("the lane key mounted in flowlaned");
    assert_eq!(key_mount.mount_path, "/etc/flowlane-lane");
    assert_eq!(key_mount.read_only, Some(true));
    let script = std::fs::read_to_string(deploy_dir().join("lane-key.sh")).unwrap();
    assert!(
        script.contains("flowlane-lane-key") && script.contains("--from-file=key="),
        "lane-key.sh makes the Secret the DaemonSet mounts"
    );
    // The real daemon accepts the arguments as the kubelet expands them.
    let summary = flowlaned_accepts(daemon, &objects);
    assert!(
        summary.contains("relay: rdma on 192.0.2.10:7471")
            && summary.contains("node table: kubernetes"),
        "{summary}"
    );
    // rdma-core in the image: the lane dlopen()s libibverbs and its providers.
    let dockerfile = std::fs::read_to_string(deploy_dir().join("image/Dockerfile")).unwrap();
    let install = dockerfile
        .split("\nRUN ")
        .find(|r| r.contains("apt-get install"))
        .expect("an apt-get install");
    for pkg in ["libibverbs1", "ibverbs-providers"] {
        assert!(
            install.split_whitespace().any(|w| w == pkg),
            "the image installs {pkg}"
        );
    }

    let install = container(spec, "install");
    let isc = install.security_context.as_ref().unwrap();
    assert_eq!(
        isc.capabilities.as_ref().unwrap().add,
        None,
        "install needs no capability"
    );
    // hostPaths: what the init container writes and where the injected pods read
    let host_paths: BTreeMap<&str, &str> = spec
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| Some((v.name.as_str(), v.host_path.as_ref()?.path.as_str())))
        .collect();
    let install_targets: BTreeSet<&str> = install
        .volume_mounts
        .iter()
        .flatten()
        .filter_map(|m| host_paths.get(m.name.as_str()).copied())
        .collect();
    assert_eq!(
        install_targets,
        BTreeSet::from(["/opt/cni/bin", "/etc/cni/net.d", "/opt/flowlane/lib"])
    );
    assert_eq!(
        host_paths["preload-lib"],
        flowlane_webhook::inject::HOST_LIB_DIR
    );
    assert_eq!(host_paths["run"], flowlane_webhook::inject::SOCKET_DIR);

    // RBAC: the DaemonSet's account is bound to a role that reads nodes and pods and
    // may patch nodes (the rdma-lane annotation), nothing else
    let sa = spec.service_account_name.as_deref().unwrap();
    let binding = objects
        .bindings
        .iter()
        .find(|b| {
            b.subjects
                .iter()
                .flatten()
                .any(|s| s.kind == "ServiceAccount" && s.name == sa)
        })
        .expect("a binding for the node agent");
    let role = objects
        .cluster_roles
        .iter()
        .find(|r| r.metadata.name.as_deref() == Some(&binding.role_ref.name))
        .unwrap();
    let mut granted = BTreeSet::new();
    for rule in role.rules.iter().flatten() {
        for res in rule.resources.iter().flatten() {
            for verb in &rule.verbs {
                granted.insert(format!("{verb} {res}"));
            }
        }
    }
    let expected: BTreeSet<String> = [
        "get nodes",
        "list nodes",
        "watch nodes",
        "patch nodes",
        "get pods",
        "list pods",
        "watch pods",
    ]
    .map(String::from)
    .into();
    assert_eq!(granted, expected);
}

#[test]
fn every_component_patches_exactly_its_files() {
    let dirs = component_dirs();
    let names: Vec<String> = dirs
        .iter()
        .map(|d| d.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        ["chained", "no-rdma-lane", "rdma-shared-device-plugin"]
    );
    for dir in &dirs {
        let kz = &documents(&dir.join("kustomization.yaml"))[0];
        assert_eq!(kz["apiVersion"], "kustomize.config.k8s.io/v1alpha1");
        assert_eq!(kz["kind"], "Component");
        let listed: BTreeSet<String> = kz["patches"]
            .as_array()
            .expect("patches")
            .iter()
            .map(|p| p["path"].as_str().unwrap().to_string())
            .collect();
        let present: BTreeSet<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
            .collect();
        assert_eq!(listed, present, "{}", dir.display());
    }
}

/// The two ways to run the node agent without privilege, applied as
/// kustomize applies them: what each grants, and that flowlaned accepts
/// the resulting arguments.
#[test]
fn the_components_drop_privilege_and_the_lane_as_documented() {
    // No relay: SYS_PTRACE (+ NET_ADMIN for the pod routes), no device, the daemon says the relay is off.
    let objects = render(Some("no-rdma-lane"));
    let spec = node_agent(&objects);
    check_pod_references(spec, &objects, "no-rdma-lane");
    let daemon = container(spec, "flowlaned");
    assert_valid_privilege(daemon);
    let sc = daemon.security_context.as_ref().unwrap();
    assert_eq!(sc.privileged, Some(false));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(
        capabilities(daemon),
        (
            Some(vec!["ALL".to_string()]),
            Some(vec!["SYS_PTRACE".to_string(), "NET_ADMIN".to_string()])
        ),
        "only SYS_PTRACE and NET_ADMIN"
    );
    assert!(!mount_paths(daemon).contains("/dev/infiniband"));
    assert!(!spec.volumes.iter().flatten().any(|v| v
        .host_path
        .as_ref()
        .is_some_and(|h| h.path == "/dev/infiniband")));
    assert_eq!(
        container_env(daemon, &objects)["FLOWLANE_LANE_TRANSPORT"],
        "off"
    );
    let summary = flowlaned_accepts(daemon, &objects);
    assert!(summary.contains("relay: off"), "{summary}");

    // The device from the RDMA shared device plugin: unprivileged, exactly
    // SYS_PTRACE + IPC_LOCK, one share of the plugin's resource.
    let objects = render(Some("rdma-shared-device-plugin"));
    let spec = node_agent(&objects);
    check_pod_references(spec, &objects, "rdma-shared-device-plugin");
    let daemon = container(spec, "flowlaned");
    assert_valid_privilege(daemon);
    let sc = daemon.security_context.as_ref().unwrap();
    assert_eq!(sc.privileged, Some(false));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    let (drop, add) = capabilities(daemon);
    assert_eq!(drop, Some(vec!["ALL".to_string()]));
    assert_eq!(
        add.unwrap_or_default().into_iter().collect::<BTreeSet<_>>(),
        BTreeSet::from([
            "SYS_PTRACE".to_string(),
            "IPC_LOCK".to_string(),
            "NET_ADMIN".to_string()
        ])
    );
    let limits = daemon
        .resources
        .as_ref()
        .and_then(|r| r.limits.clone())
        .unwrap_or_default();
    assert_eq!(
        limits.get("rdma/rdma_shared_device_a"),
        Some(&Quantity("1".into()))
    );
    assert!(
        limits.contains_key("memory"),
        "the patch adds to the limits, keeps the rest"
    );
    assert!(!mount_paths(daemon).contains("/dev/infiniband"));
    let summary = flowlaned_accepts(daemon, &objects);
    assert!(
        summary.contains("relay: rdma on 192.0.2.10:7471"),
        "{summary}"
    );

    // Chained: the init container runs install.sh in chained mode, every key
    // it references exists, flowlaned is the base's.
    let objects = render(Some("chained"));
    let spec = node_agent(&objects);
    check_pod_references(spec, &objects, "chained");
    let init = &spec.init_containers.as_ref().unwrap()[0];
    let env = container_env(init, &objects);
    assert_eq!(env["FLOWLANE_MODE"], "chained");
    assert_eq!(env["CHAINED_CONFLIST"], "");
    let data = flowlane_config(&objects);
    assert!(data["install.sh"].contains("/etc/flowlane/chain.sh"));
    let entry: serde_json::Value = serde_json::from_str(&data["chained-entry.json"]).unwrap();
    assert_eq!(entry["mode"], "chained");

    // The base is unchanged by rendering without a component.
    let base = render(None);
    let daemon = container(node_agent(&base), "flowlaned");
    assert_eq!(
        daemon.security_context.as_ref().unwrap().privileged,
        Some(true)
    );
}

#[test]
fn kubelet_expansion_follows_the_kubelet_rules() {
    let env = BTreeMap::from([
        ("A".to_string(), "1".to_string()),
        ("HOST_IP".to_string(), "192.0.2.10".to_string()),
    ]);
    assert_eq!(kubelet_expand("$(HOST_IP):$(A)", &env), "192.0.2.10:1");
    assert_eq!(kubelet_expand("$(NOPE)-$$(A)-$", &env), "$(NOPE)-$(A)-$");
}

#[test]
fn the_conflist_template_is_a_flowlane_network() {
    let objects = load(&deploy_dir());
    let data = flowlane_config(&objects);
    let conf: Value =
        serde_json::from_str(&data["10-flowlane.conflist.tmpl"]).expect("template is JSON");
    assert_eq!(conf["plugins"][0]["type"], "flowlane");
    assert_eq!(conf["plugins"][0]["ipam"]["type"], "flowlane");
    assert_eq!(
        conf["plugins"][0]["daemonSocket"],
        flowlane_webhook::inject::SOCKET_PATH
    );
    assert!(data["CONFLIST_NAME"].ends_with(".conflist"));
    assert!(data["install.sh"].starts_with("#!/bin/sh"));
}

#[test]
fn the_webhook_wiring_matches_the_server() {
    let objects = load(&deploy_dir());
    let config = &objects.webhooks[0];
    let hooks = config.webhooks.as_ref().unwrap();
    assert_eq!(hooks.len(), 2);
    let svc = &objects
        .services
        .iter()
        .find(|s| s.metadata.name.as_deref() == Some("flowlane-webhook"))
        .unwrap();
    let svc_port = &svc.spec.as_ref().unwrap().ports.as_ref().unwrap()[0];
    let deploy = objects
        .deployments
        .iter()
        .find(|d| d.metadata.name.as_deref() == Some("flowlane-webhook"))
        .unwrap();
    let pod = deploy
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    check_pod_references(pod, &objects, "flowlane-webhook");
    let c = container(pod, "webhook");
    // the Service's targetPort names the container's port
    let target = match svc_port.target_port.as_ref().unwrap() {
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(s) => s.clone(),
        other => panic!("targetPort {other:?}: use the port's name"),
    };
    let cport = c
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some(&target))
        .expect("named port");
    let listen = c
        .args
        .as_ref()
        .unwrap()
        .iter()
        .find_map(|a| a.strip_prefix("--listen="))
        .unwrap();
    assert!(
        listen.ends_with(&format!(":{}", cport.container_port)),
        "listens on the container port"
    );
    assert_flags_exist(
        Path::new(env!("CARGO_BIN_EXE_flowlane-webhook")),
        c.args.as_ref().unwrap(),
    );

    let mut paths = BTreeSet::new();
    for h in hooks {
        assert_eq!(h.failure_policy.as_deref(), Some("Ignore"), "{}", h.name);
        assert_eq!(h.side_effects, "None");
        assert_eq!(h.admission_review_versions, ["v1"]);
        let s = h.client_config.service.as_ref().unwrap();
        assert_eq!(Some(&s.name), svc.metadata.name.as_ref());
        assert_eq!(s.namespace, svc.metadata.namespace.clone().unwrap());
        assert_eq!(s.port, Some(svc_port.port));
        paths.insert(s.path.clone().unwrap());
        let rules = h.rules.as_ref().unwrap();
        assert_eq!(
            rules[0].operations.as_deref(),
            Some(&["CREATE".to_string()][..])
        );
        assert_eq!(
            rules[0].resources.as_deref(),
            Some(&["pods".to_string()][..])
        );
    }
    assert_eq!(
        paths,
        BTreeSet::from(["/mutate/namespace".to_string(), "/mutate/pod".to_string()])
    );

    // the two namespace selectors are disjoint on flowlane.io/inject: "enabled" goes to
    // /mutate/namespace only, and flowlane's own namespace reaches neither
    let selector = |path: &str| {
        let h = hooks
            .iter()
            .find(|h| h.client_config.service.as_ref().unwrap().path.as_deref() == Some(path))
            .unwrap();
        h.namespace_selector
            .as_ref()
            .unwrap()
            .match_expressions
            .clone()
            .unwrap()
    };
    let matches =
        |exprs: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement],
         labels: &BTreeMap<&str, &str>| {
            exprs.iter().all(|e| {
                let v = labels.get(e.key.as_str());
                let in_values = v.is_some_and(|v| e.values.iter().flatten().any(|x| x == v));
                match e.operator.as_str() {
                    "In" => in_values,
                    "NotIn" => !in_values,
                    op => panic!("operator {op} not modelled"),
                }
            })
        };
    let ns_sel = selector("/mutate/namespace");
    let pod_sel = selector("/mutate/pod");
    let ns_labels = |name: &'static str, inject: Option<&'static str>| {
        let mut l = BTreeMap::from([("kubernetes.io/metadata.name", name)]);
        if let Some(i) = inject {
            l.insert("flowlane.io/inject", i);
        }
        l
    };
    for (labels, to_ns, to_pod) in [
        (ns_labels("training", Some("enabled")), true, false),
        (ns_labels("default", None), false, true),
        (ns_labels("other", Some("disabled")), false, false),
        (ns_labels("kube-system", Some("enabled")), false, false),
    ] {
        assert_eq!(
            (matches(&ns_sel, &labels), matches(&pod_sel, &labels)),
            (to_ns, to_pod),
            "{labels:?}"
        );
    }
    // the objectSelectors: only pods that asked are sent, an opted-out one never
    let object_selector = |path: &str| {
        let h = hooks
            .iter()
            .find(|h| h.client_config.service.as_ref().unwrap().path.as_deref() == Some(path))
            .unwrap();
        let sel = h
            .object_selector
            .as_ref()
            .unwrap_or_else(|| panic!("{path}: an objectSelector (cheap admission)"));
        let mut exprs = sel.match_expressions.clone().unwrap_or_default();
        for (k, v) in sel.match_labels.iter().flatten() {
            exprs.push(
                k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement {
                    key: k.clone(),
                    operator: "In".into(),
                    values: Some(vec![v.clone()]),
                },
            );
        }
        exprs
    };
    let ns_obj = object_selector("/mutate/namespace");
    let pod_obj = object_selector("/mutate/pod");
    let sent = |ns: &BTreeMap<&str, &str>, pod: &BTreeMap<&str, &str>| {
        (
            matches(&ns_sel, ns) && matches(&ns_obj, pod),
            matches(&pod_sel, ns) && matches(&pod_obj, pod),
        )
    };
    let pod_labels = |inject: Option<&'static str>| {
        let mut l = BTreeMap::from([("app", "trainer")]);
        if let Some(i) = inject {
            l.insert("flowlane.io/inject", i);
        }
        l
    };
    for (ns, pod, expected) in [
        (
            ns_labels("training", Some("enabled")),
            pod_labels(None),
            (true, false),
        ),
        (
            ns_labels("training", Some("enabled")),
            pod_labels(Some("true")),
            (true, false),
        ),
        (
            ns_labels("training", Some("enabled")),
            pod_labels(Some("false")),
            (false, false),
        ),
        (ns_labels("default", None), pod_labels(None), (false, false)),
        (
            ns_labels("default", None),
            pod_labels(Some("true")),
            (false, true),
        ),
        (
            ns_labels("default", None),
            pod_labels(Some("false")),
            (false, false),
        ),
        (
            ns_labels("other", Some("disabled")),
            pod_labels(Some("true")),
            (false, false),
        ),
        (
            ns_labels("kube-system", None),
            pod_labels(Some("true")),
            (false, false),
        ),
    ] {
        assert_eq!(sent(&ns, &pod), expected, "namespace {ns:?}, pod {pod:?}");
    }
    for ns in &objects.namespaces {
        let labels: BTreeMap<&str, &str> = ns
            .metadata
            .labels
            .iter()
            .flatten()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .chain([(
                "kubernetes.io/metadata.name",
                ns.metadata.name.as_deref().unwrap(),
            )])
            .collect();
        assert!(
            !matches(&ns_sel, &labels) && !matches(&pod_sel, &labels),
            "{labels:?}"
        );
    }
}

#[test]
fn every_binary_a_manifest_runs_is_in_the_image() {
    let dockerfile = std::fs::read_to_string(deploy_dir().join("image/Dockerfile")).unwrap();
    // COPY target/release/a target/release/b ... /usr/local/lib/flowlane/
    let copy: String = dockerfile
        .split("\nCOPY ")
        .nth(1)
        .expect("a COPY line")
        .lines()
        .take_while(|l| !l.trim().is_empty() && !l.starts_with("RUN"))
        .collect::<Vec<_>>()
        .join(" ")
        .replace('\\', " ");
    let words: Vec<&str> = copy.split_whitespace().collect();
    let (dest, sources) = words.split_last().unwrap();
    let in_image: BTreeSet<String> = sources
        .iter()
        .map(|s| format!("{dest}{}", s.rsplit('/').next().unwrap()))
        .collect();
    for s in sources {
        let built = s
            .strip_prefix("target/release/")
            .expect("a release artifact");
        assert!(release_dir().join(built).exists(), "{s} is built");
    }
    let mut used = BTreeSet::new();
    for file in yaml_files(&deploy_dir()) {
        for doc in documents(&file) {
            let spec = &doc["spec"]["template"]["spec"];
            for c in ["initContainers", "containers"]
                .iter()
                .flat_map(|k| spec[k].as_array().cloned().unwrap_or_default())
            {
                let probes =
                    ["readinessProbe", "livenessProbe"].map(|p| c[p]["exec"]["command"][0].clone());
                for exe in std::iter::once(c["command"][0].clone()).chain(probes) {
                    if let Some(exe) = exe
                        .as_str()
                        .filter(|e| e.starts_with("/usr/local/lib/flowlane/"))
                    {
                        used.insert(exe.to_string());
                    }
                }
            }
        }
    }
    assert!(used.len() >= 2, "{used:?}");
    for exe in &used {
        assert!(
            in_image.contains(exe),
            "{exe} is not copied into the image ({in_image:?})"
        );
    }
    // install.sh copies from the same directory
    let objects = load(&deploy_dir());
    let cm = objects
        .config_maps
        .iter()
        .find(|c| c.metadata.name.as_deref() == Some("flowlane-config"))
        .unwrap();
    let script = &cm.data.as_ref().unwrap()["install.sh"];
    assert!(
        script.contains(&format!(
            "SRC=${{FLOWLANE_SRC_DIR:-{}}}",
            dest.trim_end_matches('/')
        )),
        "{script}"
    );
    for bin in [
        "flowlane",
        "flowlaned",
        "libflowlane_preload.so",
        "libflowlane_noop.so",
        "flowlane-probe",
    ] {
        assert!(
            in_image.contains(&format!("{dest}{bin}")),
            "{bin} in the image"
        );
    }
}

/// The CSI node plugin serves exactly the volumes the webhook injects: the
/// CSIDriver is the webhook's driver, inline (Ephemeral) only, no attach, pod
/// info on mount (the plugin checks the pod uid against the target path), no
/// fsGroup change; the DaemonSet's "csi" container registers where the kubelet
/// looks, mounts the kubelet's pods directory Bidirectional (privileged, as the
/// API server requires for that), and publishes the same node directories the
/// install step fills and flowlaned serves its socket in.
#[test]
fn the_csi_plugin_serves_the_injected_volumes() {
    use flowlane_webhook::inject;
    let objects = load(&deploy_dir());
    assert_eq!(objects.csi_drivers.len(), 1);
    let driver = &objects.csi_drivers[0];
    assert_eq!(driver.metadata.name.as_deref(), Some(inject::CSI_DRIVER));
    let spec = &driver.spec;
    assert_eq!(spec.attach_required, Some(false));
    assert_eq!(spec.pod_info_on_mount, Some(true));
    assert_eq!(
        spec.volume_lifecycle_modes.as_deref(),
        Some(&["Ephemeral".to_string()][..])
    );
    assert_eq!(spec.fs_group_policy.as_deref(), Some("None"));
    // every csi volume the webhook injects names this driver, read-only
    for content in ["lib", "run"] {
        let v = inject::csi_volume(content);
        assert_eq!(v["csi"]["driver"], inject::CSI_DRIVER);
        assert_eq!(v["csi"]["readOnly"], true);
    }

    let pod = node_agent(&objects);
    let csi = container(pod, "csi");
    assert_valid_privilege(csi);
    let sc = csi.security_context.as_ref().unwrap();
    assert_eq!(sc.privileged, Some(true), "Bidirectional needs privileged");
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(
        pod.containers[0].name, "flowlaned",
        "the components patch containers/0"
    );
    let host_of = |mount: &str| {
        let m = csi
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.mount_path == mount)
            .unwrap_or_else(|| panic!("csi mounts {mount}"));
        let v = pod
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == m.name)
            .unwrap();
        (
            v.host_path.as_ref().expect("a hostPath").path.clone(),
            m.clone(),
        )
    };
    let (pods_dir, m) = host_of("/var/lib/kubelet/pods");
    assert_eq!(pods_dir, "/var/lib/kubelet/pods");
    assert_eq!(m.mount_propagation.as_deref(), Some("Bidirectional"));
    assert_eq!(
        host_of("/var/lib/kubelet/plugins_registry").0,
        "/var/lib/kubelet/plugins_registry"
    );
    assert_eq!(
        host_of("/var/lib/kubelet/plugins/csi.flowlane.io").0,
        "/var/lib/kubelet/plugins/csi.flowlane.io"
    );
    let args: Vec<&str> = csi.args.iter().flatten().map(String::as_str).collect();
    let arg = |flag: &str| {
        args.iter()
            .find_map(|a| a.strip_prefix(&format!("--{flag}=")))
            .unwrap_or_else(|| panic!("--{flag} in {args:?}"))
    };
    assert_eq!(arg("kubelet-dir"), "/var/lib/kubelet");
    assert_eq!(arg("node-id"), "$(NODE_NAME)");
    let (lib, m) = host_of(arg("lib-dir"));
    assert_eq!(
        (lib.as_str(), m.read_only),
        (inject::HOST_LIB_DIR, Some(true))
    );
    let (run, m) = host_of(arg("run-dir"));
    assert_eq!(
        (run.as_str(), m.read_only),
        (inject::SOCKET_DIR, Some(true))
    );
    let node_name = csi
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "NODE_NAME")
        .and_then(|e| e.value_from.as_ref()?.field_ref.as_ref())
        .map(|f| f.field_path.as_str());
    assert_eq!(node_name, Some("spec.nodeName"));
    assert_flags_exist(
        &release_dir().join("flowlane-csi"),
        csi.args.as_ref().unwrap(),
    );
}
