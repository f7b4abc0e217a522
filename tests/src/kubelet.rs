//! A kubelet double for the one-machine cluster's nodes (the second and
//! last faked boundary, with [`crate::fake_api`]): it runs the pods the fake
//! API server binds to its node (`spec.nodeName`) the way a kubelet and its
//! container runtime do, with the node's real parts:
//!
//! - the pod's network namespace, wired by the node's INSTALLED conflist
//!   (every plugin in order with prevResult, `CNI_ARGS` as containerd passes
//!   them), and unwired by DEL in reverse order on teardown;
//! - each container's `command` + `args` (`$(VAR)` expanded from its env, as
//!   the kubelet does) run in the pod's namespace with exactly the
//!   container's env (values only), in a private mount namespace of the
//!   node where the image's `/usr/local/lib/flowlane` (the release build, as
//!   the Dockerfile's COPY lays it out) is mounted, and each `hostPath`,
//!   `emptyDir` (a world-writable directory of the pod's; `subPath`
//!   honoured) or `csi` volume of flowlane's driver (published before the
//!   sandbox by the node's CSI plugin, the real `flowlane-csi` running in the
//!   node's mount namespace and registered at start, as the kubelet drives it:
//!   [`crate::csi`]; unpublished after teardown) at its `mountPath` (read-only
//!   when the mount says so), as
//!   the securityContext's `runAsUser`/`runAsGroup` when it names them;
//!   init containers first, each to completion (the injection's probe);
//! - the pod's status (Pending, then Running with podIP/hostIP and container
//!   states, then Succeeded/Failed with exit codes: restartPolicy Never; a
//!   container that cannot start leaves the pod Pending with the waiting
//!   reason, as a kubelet does), stdout+stderr captured for the `log`
//!   subresource;
//! - a pod with `deletionTimestamp` stopped (SIGTERM, SIGKILL after its
//!   grace), its network torn down, then removed from the API (the kubelet's
//!   final delete); a pod deleted at once (terminal, or force) torn down.
//!
//! Pods it did not start (e.g. the DaemonSet's, put in Running by the test
//! that runs those daemons itself) are left alone. It reads and writes the
//! fake API server's objects in process (no watch over HTTPS).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::csi::{CsiPlugin, PodRef};
use crate::fake_api::{core_v1::now_rfc3339, ApiState};
use crate::process;

/// A node of the one-machine cluster: a process that holds its mount and
/// network namespaces.
#[derive(Debug, Clone)]
pub struct NodeHost {
    pub name: String,
    pub ip: String,
    pub holder_pid: u32,
}

impl NodeHost {
    /// `nsenter` into the node's mount and network namespaces.
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new("nsenter");
        c.args(["-t", &self.holder_pid.to_string(), "--mount", "--net", "--"])
            .arg(program)
            .env_remove("CNI_COMMAND");
        c
    }

    pub fn sh(&self, script: &str) -> process::Output {
        let mut c = self.command("sh");
        c.args(["-c", script]);
        process::run(&mut c, Duration::from_secs(60)).unwrap()
    }

    /// The conflist the runtime uses: the lexically first config file.
    pub fn conflist(&self) -> Result<Value, String> {
        let out = self.sh("cat \"$(ls /etc/cni/net.d/*.conflist | sort | head -n1)\"");
        if !out.success() {
            return Err(format!("no conflist: {}", out.stderr));
        }
        serde_json::from_str(&out.stdout).map_err(|e| format!("conflist: {e}"))
    }

    /// Runs the installed conflist as libcni does: ADD through every plugin
    /// in order, each given the previous result (returns the last result);
    /// DEL in reverse order, each given `prev` (the cached ADD result).
    pub fn cni(
        &self,
        command: &str,
        netns: &str,
        container_id: &str,
        cni_args: &str,
        prev: Option<&Value>,
    ) -> Result<Value, String> {
        let conflist = self.conflist()?;
        let mut plugins = conflist["plugins"].as_array().cloned().unwrap_or_default();
        let add = command == "ADD";
        if !add {
            plugins.reverse();
        }
        let mut prev = prev.cloned();
        for plugin in plugins {
            let mut conf = plugin.clone();
            conf["cniVersion"] = conflist["cniVersion"].clone();
            conf["name"] = conflist["name"].clone();
            if let Some(p) = &prev {
                conf["prevResult"] = p.clone();
            }
            let ty = plugin["type"].as_str().unwrap_or("");
            let mut c = self.command(&format!("/opt/cni/bin/{ty}"));
            c.env("CNI_COMMAND", command)
                .env("CNI_CONTAINERID", container_id)
                .env("CNI_NETNS", netns)
                .env("CNI_IFNAME", "eth0")
                .env("CNI_PATH", "/opt/cni/bin")
                .env("CNI_ARGS", cni_args);
            let out = process::run_with_input(
                &mut c,
                conf.to_string().as_bytes(),
                Duration::from_secs(60),
            )
            .map_err(|e| format!("CNI {command} {ty}: {e}"))?;
            if !out.success() {
                return Err(format!(
                    "CNI {command} {ty} on {}: {} {}",
                    self.name, out.stdout, out.stderr
                ));
            }
            if add {
                prev = Some(
                    serde_json::from_str(&out.stdout)
                        .map_err(|e| format!("CNI ADD {ty}: result: {e}"))?,
                );
            }
        }
        Ok(prev.unwrap_or(Value::Null))
    }
}

/// `$(VAR)` expanded as the kubelet expands container command and args
/// (a reference to an unknown variable stays as written).
pub fn kubelet_expand(s: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find("$(") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        match after.find(')') {
            Some(j) if env.contains_key(&after[..j]) => {
                out.push_str(&env[&after[..j]]);
                rest = &after[j + 1..];
            }
            _ => {
                out.push_str("$(");
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// Mounts the image, then each volume, then enters the pod's network
/// namespace and executes the container's process with its env only.
const CONTAINER_SCRIPT: &str = r#"set -e
img="$1"; ns="$2"; shift 2
mount -t tmpfs -o mode=0755 image /usr/local/lib
mkdir /usr/local/lib/flowlane
mount --bind "$img" /usr/local/lib/flowlane
while [ "$1" != -- ]; do
  mkdir -p "$1"
  [ -d "$2" ] || mkdir -p "$2" || { echo "kubelet: cannot make mount point $2" >&2; exit 127; }
  mount --bind "$1" "$2"
  if [ "$3" = ro ]; then mount -o remount,bind,ro "$2"; fi
  shift 3
done
shift
exec nsenter --net="$ns" -- "$@"
"#;

/// A directory every container user may write (mode 0777), as the kubelet
/// makes emptyDir volumes and their subPath directories.
fn world_writable_dir(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777))
}

/// What one container runs (checked before the pod's sandbox is made).
struct ContainerPlan {
    name: String,
    env: BTreeMap<String, String>,
    argv: Vec<String>,
    /// (host path, mount path, read-only)
    mounts: Vec<(String, String, bool)>,
    /// securityContext's runAsUser and runAsGroup.
    ids: Option<(u64, u64)>,
}

/// A pod this kubelet runs.
struct PodRun {
    key: String,
    netns: String,
    container_id: String,
    cni_args: String,
    /// The ADD result (libcni's cache), given to DEL.
    result: Value,
    containers: Vec<(String, Child)>,
    exits: Vec<Option<i32>>,
    finished: bool,
    /// The CSI volumes published for it: (pod uid, volume name).
    csi_volumes: Vec<(String, String)>,
}

pub struct Kubelet {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Pods it runs now ("ns/name").
    runs: Arc<Mutex<Vec<String>>>,
}

impl Kubelet {
    /// Starts the kubelet of `node`: `image_dir` is what the image's
    /// `/usr/local/lib/flowlane` holds; logs go to `log_dir`.
    pub fn start(
        api: Arc<Mutex<ApiState>>,
        node: NodeHost,
        image_dir: PathBuf,
        log_dir: PathBuf,
    ) -> Kubelet {
        let stop = Arc::new(AtomicBool::new(false));
        let runs_seen = Arc::new(Mutex::new(Vec::new()));
        // The node's CSI plugin (the DaemonSet's "csi" container), in the
        // node's mount namespace, publishing the node's own directories.
        let mut csi = CsiPlugin::spawn_in(
            Some(node.holder_pid),
            &log_dir.join(format!("{}-kubelet-root", node.name)),
            std::path::Path::new(flowlane_webhook::inject::HOST_LIB_DIR),
            std::path::Path::new(flowlane_webhook::inject::SOCKET_DIR),
            &node.name,
        );
        csi.register(true, "");
        let thread = {
            let (stop, runs_seen) = (stop.clone(), runs_seen.clone());
            std::thread::spawn(move || {
                let mut k = Loop {
                    api,
                    node,
                    image_dir,
                    log_dir,
                    runs: Vec::new(),
                    tried: Vec::new(),
                    counter: 0,
                    csi,
                };
                while !stop.load(Ordering::SeqCst) {
                    k.sync();
                    *runs_seen.lock().unwrap() = k.runs.iter().map(|r| r.key.clone()).collect();
                    std::thread::sleep(Duration::from_millis(150));
                }
                for r in std::mem::take(&mut k.runs) {
                    k.teardown(r, Duration::from_millis(500));
                }
                runs_seen.lock().unwrap().clear();
            })
        };
        Kubelet {
            stop,
            thread: Some(thread),
            runs: runs_seen,
        }
    }

    /// The pods ("ns/name") whose sandbox it holds now.
    pub fn running(&self) -> Vec<String> {
        self.runs.lock().unwrap().clone()
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Loop {
    api: Arc<Mutex<ApiState>>,
    node: NodeHost,
    image_dir: PathBuf,
    log_dir: PathBuf,
    runs: Vec<PodRun>,
    /// Pods it tried and could not start (left Pending with the reason).
    tried: Vec<String>,
    counter: u32,
    /// The node's CSI plugin.
    csi: CsiPlugin,
}

fn key_of(p: &Value) -> String {
    crate::fake_api::core_v1::pod_key(p)
}

impl Loop {
    fn my_pods(&self) -> Vec<Value> {
        self.api
            .lock()
            .unwrap()
            .pods
            .iter()
            .filter(|p| p["spec"]["nodeName"] == self.node.name.as_str())
            .cloned()
            .collect()
    }

    fn update_status(&self, key: &str, f: impl FnOnce(&mut Value)) {
        let mut st = self.api.lock().unwrap();
        if let Some(p) = st.pods.iter_mut().find(|p| key_of(p) == key) {
            f(&mut p["status"]);
        }
        crate::fake_api::core_v1::touched(&mut st, key);
    }

    fn sync(&mut self) {
        let pods = self.my_pods();
        // Start what is new.
        for p in &pods {
            let key = key_of(p);
            if p["status"]["phase"] != "Pending"
                || !p["metadata"]["deletionTimestamp"].is_null()
                || self.runs.iter().any(|r| r.key == key)
                || self.tried.contains(&key)
            {
                continue;
            }
            match self.start(p) {
                Ok(run) => self.runs.push(run),
                Err((reason, message)) => {
                    self.tried.push(key.clone());
                    let name = p["spec"]["containers"][0]["name"].clone();
                    self.update_status(&key, |s| {
                        s["containerStatuses"] = json!([{"name": name, "ready": false,
                            "restartCount": 0, "state": {"waiting": {"reason": reason, "message": message}}}]);
                    });
                }
            }
        }
        // Containers that ended.
        for i in 0..self.runs.len() {
            let r = &mut self.runs[i];
            if r.finished {
                continue;
            }
            for (j, (_, child)) in r.containers.iter_mut().enumerate() {
                if r.exits[j].is_none() {
                    if let Ok(Some(status)) = child.try_wait() {
                        use std::os::unix::process::ExitStatusExt;
                        r.exits[j] = Some(
                            status
                                .code()
                                .unwrap_or_else(|| 128 + status.signal().unwrap_or(0)),
                        );
                    }
                }
            }
            if r.exits.iter().all(Option::is_some) {
                r.finished = true;
                let codes: Vec<i32> = r.exits.iter().map(|c| c.unwrap_or(1)).collect();
                let names: Vec<String> = r.containers.iter().map(|(n, _)| n.clone()).collect();
                let key = r.key.clone();
                self.update_status(&key, |s| {
                    let ok = codes.iter().all(|c| *c == 0);
                    s["phase"] = json!(if ok { "Succeeded" } else { "Failed" });
                    s["conditions"] =
                        json!([{"type": "Ready", "status": "False", "reason": "PodCompleted"}]);
                    s["containerStatuses"] = json!(names
                        .iter()
                        .zip(&codes)
                        .map(
                            |(n, c)| json!({"name": n, "ready": false, "restartCount": 0,
                            "state": {"terminated": {"exitCode": c,
                                "reason": if *c == 0 { "Completed" } else { "Error" },
                                "finishedAt": now_rfc3339()}}})
                        )
                        .collect::<Vec<_>>());
                });
            }
        }
        // Pods being deleted, or gone.
        let mut keep = Vec::new();
        for r in std::mem::take(&mut self.runs) {
            let pod = pods.iter().find(|p| key_of(p) == r.key);
            match pod {
                None => self.teardown(r, Duration::from_millis(500)),
                Some(p) if !p["metadata"]["deletionTimestamp"].is_null() => {
                    let grace = p["metadata"]["deletionGracePeriodSeconds"]
                        .as_u64()
                        .unwrap_or(30);
                    let key = r.key.clone();
                    self.teardown(r, Duration::from_secs(grace));
                    // The kubelet's final delete (grace 0).
                    let mut st = self.api.lock().unwrap();
                    st.pods.retain(|p| key_of(p) != key);
                    st.pod_logs.remove(&key);
                }
                Some(_) => keep.push(r),
            }
        }
        self.runs = keep;
        self.tried.retain(|k| pods.iter().any(|p| key_of(p) == *k));
    }

    fn start(&mut self, pod: &Value) -> Result<PodRun, (String, String)> {
        let key = key_of(pod);
        let config_error = |m: String| ("CreateContainerConfigError".to_string(), m);
        self.counter += 1;
        let tag = format!("kl{}", self.counter);
        // What each container runs, checked before anything is made.
        let volumes = pod["spec"]["volumes"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        // emptyDir volumes: a directory of the pod's on the node, world
        // writable as the kubelet makes them, gone with the test's files.
        let mut empty_dirs = BTreeMap::new();
        // CSI volumes: where the plugin will mount each (published below,
        // once every container's plan holds).
        let pod_ref = PodRef::of(pod);
        let mut csi_targets = BTreeMap::new();
        for v in &volumes {
            if v["csi"].is_object() {
                let name = v["name"].as_str().unwrap_or("");
                if v["csi"]["driver"] != flowlane_webhook::inject::CSI_DRIVER {
                    return Err(config_error(format!(
                        "volume {name}: CSI driver {} is not registered on this node",
                        v["csi"]["driver"]
                    )));
                }
                let target = self.csi.volume_dir(&pod_ref.uid, name).join("mount");
                csi_targets.insert(name.to_string(), (target, v.clone()));
            }
        }
        for v in &volumes {
            if v.get("emptyDir").is_some() {
                let name = v["name"].as_str().unwrap_or("");
                let dir = self.log_dir.join(format!("{tag}-vol-{name}"));
                world_writable_dir(&dir)
                    .map_err(|e| config_error(format!("emptyDir {name}: {e}")))?;
                empty_dirs.insert(name.to_string(), dir);
            }
        }
        let plan = |c: &Value| -> Result<ContainerPlan, (String, String)> {
            let name = c["name"].as_str().unwrap_or("").to_string();
            let mut env = BTreeMap::new();
            for e in c["env"].as_array().cloned().unwrap_or_default() {
                if e.get("valueFrom").is_some() {
                    return Err(config_error(format!(
                        "container {name}: env {} from valueFrom: not supported by the kubelet double",
                        e["name"]
                    )));
                }
                env.insert(
                    e["name"].as_str().unwrap_or("").to_string(),
                    e["value"].as_str().unwrap_or("").to_string(),
                );
            }
            let mut argv: Vec<String> = Vec::new();
            for part in ["command", "args"] {
                for a in c[part].as_array().cloned().unwrap_or_default() {
                    argv.push(kubelet_expand(a.as_str().unwrap_or(""), &env));
                }
            }
            if argv.is_empty() {
                return Err(config_error(format!(
                    "container {name}: no command (the double does not know the image's entrypoint)"
                )));
            }
            let mut mounts = Vec::new();
            for m in c["volumeMounts"].as_array().cloned().unwrap_or_default() {
                let vname = m["name"].as_str().unwrap_or("");
                let v = volumes
                    .iter()
                    .find(|v| v["name"] == m["name"])
                    .ok_or_else(|| config_error(format!("volume {vname} not found")))?;
                let mut host = if let Some(dir) = empty_dirs.get(vname) {
                    dir.display().to_string()
                } else if let Some((target, _)) = csi_targets.get(vname) {
                    target.display().to_string()
                } else {
                    v["hostPath"]["path"].as_str().map(str::to_string).ok_or_else(|| {
                        config_error(format!(
                            "volume {vname}: only hostPath, emptyDir and csi volumes are supported by the kubelet double"
                        ))
                    })?
                };
                // subPath: a directory inside the volume, made when missing
                // (as the kubelet does); no `..` or absolute paths.
                if let Some(sub) = m["subPath"].as_str().filter(|s| !s.is_empty()) {
                    if sub.starts_with('/') || sub.split('/').any(|p| p == "..") {
                        return Err(config_error(format!("volume {vname}: bad subPath {sub}")));
                    }
                    let dir = PathBuf::from(&host).join(sub);
                    world_writable_dir(&dir)
                        .map_err(|e| config_error(format!("subPath {sub}: {e}")))?;
                    host = dir.display().to_string();
                }
                mounts.push((
                    host,
                    m["mountPath"].as_str().unwrap_or("").to_string(),
                    m["readOnly"] == json!(true),
                ));
            }
            // securityContext.runAsUser/runAsGroup: the process's ids.
            let sc = &c["securityContext"];
            let ids = sc["runAsUser"]
                .as_u64()
                .map(|u| (u, sc["runAsGroup"].as_u64().unwrap_or(u)));
            Ok(ContainerPlan {
                name,
                env,
                argv,
                mounts,
                ids,
            })
        };
        let plan_all = |list: &Value| {
            list.as_array()
                .map(|cs| cs.iter().map(plan).collect::<Result<Vec<_>, _>>())
                .unwrap_or(Ok(Vec::new()))
        };
        let inits = plan_all(&pod["spec"]["initContainers"])?;
        let plans = plan_all(&pod["spec"]["containers"])?;
        // The kubelet mounts the volumes before it makes the sandbox.
        let mut csi_volumes = Vec::new();
        for (name, (_, v)) in &csi_targets {
            if let Err(e) = self.csi.publish(&pod_ref, v) {
                self.unpublish_all(&csi_volumes);
                return Err((
                    "ContainerCreating".into(),
                    format!(
                        "MountVolume.SetUp failed for volume {name}: {}",
                        e.message()
                    ),
                ));
            }
            csi_volumes.push((pod_ref.uid.clone(), name.clone()));
        }

        let netns = format!("/run/netns/{tag}");
        let container_id = format!("kubelet{}{}", std::process::id(), self.counter);
        let cni_args = format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={container_id};K8S_POD_UID={}",
            pod["metadata"]["namespace"].as_str().unwrap_or(""),
            pod["metadata"]["name"].as_str().unwrap_or(""),
            pod["metadata"]["uid"].as_str().unwrap_or("")
        );
        let sandbox_error = |m: String| ("FailedCreatePodSandBox".to_string(), m);
        let made = self
            .node
            .sh(&format!("touch {netns} && unshare --net={netns} true"));
        if !made.success() {
            self.unpublish_all(&csi_volumes);
            return Err(sandbox_error(format!("pod netns: {}", made.stderr)));
        }
        let result = match self.node.cni("ADD", &netns, &container_id, &cni_args, None) {
            Ok(r) => r,
            Err(e) => {
                self.node.sh(&format!("umount {netns}; rm -f {netns}"));
                self.unpublish_all(&csi_volumes);
                return Err(sandbox_error(e));
            }
        };
        let pod_ip = result["ips"][0]["address"]
            .as_str()
            .and_then(|a| a.split('/').next())
            .unwrap_or("")
            .to_string();
        let log = self
            .log_dir
            .join(format!("{}-{tag}.log", key.replace('/', "_")));
        let mut run = PodRun {
            key: key.clone(),
            netns: netns.clone(),
            container_id,
            cni_args,
            result,
            containers: Vec::new(),
            exits: Vec::new(),
            finished: false,
            csi_volumes,
        };
        let names: Vec<String> = plans.iter().map(|p| p.name.clone()).collect();
        let hostname = pod["metadata"]["name"].as_str().unwrap_or("").to_string();
        // Init containers first, each to completion, in order; one that
        // fails leaves the pod failed to start, as a kubelet reports it.
        for init in &inits {
            let mut c = self
                .container_command(init, &netns, &hostname, &log)
                .map_err(sandbox_error)?;
            let ok = c.status().map(|st| st.success()).unwrap_or(false);
            if !ok {
                self.teardown(run, Duration::ZERO);
                return Err((
                    "Init:Error".into(),
                    format!("init container {} failed", init.name),
                ));
            }
        }
        for p in plans {
            let mut c = self
                .container_command(&p, &netns, &hostname, &log)
                .map_err(sandbox_error)?;
            let name = p.name;
            match c.spawn() {
                Ok(child) => {
                    run.containers.push((name, child));
                    run.exits.push(None);
                }
                Err(e) => {
                    self.teardown(run, Duration::ZERO);
                    return Err(("RunContainerError".into(), e.to_string()));
                }
            }
        }
        self.api.lock().unwrap().pod_logs.insert(key.clone(), log);
        let (host_ip, started) = (self.node.ip.clone(), now_rfc3339());
        let image = pod["spec"]["containers"][0]["image"].clone();
        self.update_status(&key, |s| {
            s["phase"] = json!("Running");
            s["podIP"] = json!(pod_ip);
            s["podIPs"] = json!([{"ip": pod_ip}]);
            s["hostIP"] = json!(host_ip);
            s["startTime"] = json!(started);
            s["conditions"] = json!([{"type": "Ready", "status": "True"}]);
            s["containerStatuses"] = json!(names
                .iter()
                .map(
                    |n| json!({"name": n, "ready": true, "restartCount": 0, "image": image,
                                "started": true, "state": {"running": {"startedAt": started}}})
                )
                .collect::<Vec<_>>());
        });
        Ok(run)
    }

    /// One container's process as the runtime starts it: a private mount
    /// namespace with the image's files and the container's volumes, the
    /// pod's network namespace, exactly the container's env, its user and
    /// group when its securityContext names them; output to the pod's log.
    fn container_command(
        &self,
        p: &ContainerPlan,
        netns: &str,
        hostname: &str,
        log: &std::path::Path,
    ) -> Result<Command, String> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|e| format!("log: {e}"))?;
        let mut c = self.node.command("unshare");
        c.args(["--mount", "--propagation", "private", "--", "sh", "-c"])
            .arg(CONTAINER_SCRIPT)
            .arg("sh")
            .arg(&self.image_dir)
            .arg(netns);
        for (host, path, ro) in &p.mounts {
            c.args([host.as_str(), path.as_str(), if *ro { "ro" } else { "rw" }]);
        }
        c.arg("--");
        if let Some((uid, gid)) = p.ids {
            c.args([
                "setpriv",
                "--reuid",
                &uid.to_string(),
                "--regid",
                &gid.to_string(),
            ])
            .args(["--clear-groups", "--"]);
        }
        c.args(["env", "-i"])
            .arg("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
            .arg(format!("HOSTNAME={hostname}"))
            .args(p.env.iter().map(|(k, v)| format!("{k}={v}")))
            .args(&p.argv)
            .stdin(Stdio::null())
            .stdout(file.try_clone().map_err(|e| e.to_string())?)
            .stderr(file);
        Ok(c)
    }

    /// Stops the containers (SIGTERM, SIGKILL after `grace`), then DEL
    /// through the conflist and the netns removed.
    fn teardown(&self, mut r: PodRun, grace: Duration) {
        for (_, child) in &mut r.containers {
            if let Ok(None) = child.try_wait() {
                let pid = nix::unistd::Pid::from_raw(child.id() as i32);
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            }
        }
        let deadline = Instant::now() + grace.min(Duration::from_secs(30));
        for (_, child) in &mut r.containers {
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = self.node.cni(
            "DEL",
            &r.netns,
            &r.container_id,
            &r.cni_args,
            Some(&r.result),
        );
        self.node.sh(&format!("umount {0}; rm -f {0}", r.netns));
        self.unpublish_all(&r.csi_volumes);
    }

    /// NodeUnpublishVolume of each (pod uid, volume), as the kubelet's
    /// volume manager does once the pod's containers are gone.
    fn unpublish_all(&self, volumes: &[(String, String)]) {
        for (uid, name) in volumes {
            if let Err(e) = self.csi.unpublish(uid, name) {
                eprintln!("kubelet: NodeUnpublishVolume {uid}/{name}: {e:?}");
            }
        }
    }
}
