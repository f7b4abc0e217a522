//! End to end through the kubelet's own path: containerd's CRI plugin
//! creates two pod sandboxes (CNI ADD through flowlane), the pods talk over
//! HTTP, then StopPodSandbox + RemovePodSandbox (CNI DEL twice, the second
//! without netns) leave nothing behind: no lease, veth, registry entry,
//! netns, or containerd process.

use std::os::unix::fs::symlink;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use flowlane_e2e::binaries::{reference_plugin, PluginUnderTest};
use flowlane_e2e::cri::{self, Containerd, ContainerdConfig};
use flowlane_e2e::fsutil::{lease_files, TempDir};
use flowlane_e2e::host::{bridge_ports, LinkGuard};

const PAUSE: &str = "docker.io/library/flt-pause:1";
const APP: &str = "docker.io/library/flt-app:1";
const SUBNET: &str = "10.201.200.0/24";
const SUBNET6: &str = "fd00:201:200::/64";

struct Pod {
    id: String,
    ip: String,
    /// The second address CRI reports (dual stack).
    ip6: String,
    config: Value,
}

fn run_pod(ctrd: &Containerd, name: &str, logs: &Path) -> Pod {
    let config = cri::pod_sandbox_config(name, "flt-cri", logs);
    let id = ctrd.call("RunPodSandbox", &json!({"config": config}))["pod_sandbox_id"]
        .as_str()
        .expect("sandbox id")
        .to_string();
    let status = ctrd.call("PodSandboxStatus", &json!({"pod_sandbox_id": id}));
    let ip = status["status"]["network"]["ip"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        ip.starts_with("10.201.200."),
        "pod {name} got {ip:?} from CNI: {status}"
    );
    let ip6 = status["status"]["network"]["additional_ips"][0]["ip"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        ip6.starts_with("fd00:201:200:"),
        "pod {name} v6 {ip6:?}: {status}"
    );
    Pod {
        id,
        ip,
        ip6,
        config,
    }
}

fn start_container(ctrd: &Containerd, pod: &Pod, name: &str, command: &[&str]) -> String {
    let req = json!({
        "pod_sandbox_id": pod.id,
        "config": {"metadata": {"name": name}, "image": {"image": APP}, "command": command,
                   "log_path": format!("{name}.log")},
        "sandbox_config": pod.config,
    });
    let id = ctrd.call("CreateContainer", &req)["container_id"]
        .as_str()
        .unwrap()
        .to_string();
    ctrd.call("StartContainer", &json!({"container_id": id}));
    id
}

fn exec(ctrd: &Containerd, container: &str, cmd: &[&str]) -> Value {
    ctrd.call(
        "ExecSync",
        &json!({"container_id": container, "cmd": cmd, "timeout": 30}),
    )
}

#[test]
fn containerd_cri_pods_talk_through_flowlane_and_leave_nothing() {
    let _turn = crate::turn::take(module_path!());
    let plugin = PluginUnderTest::from_env();
    let w = TempDir::new("cri");
    let bridge = LinkGuard::fresh("cri");
    let net = bridge.name().to_string();

    // CRI's CNI bin dir holds every plugin it may exec: ours and loopback.
    let bin = w.join("cni-bin");
    let conf_dir = w.join("net.d");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(&conf_dir).unwrap();
    symlink(plugin.binary(), bin.join(plugin.type_name())).unwrap();
    symlink(reference_plugin("loopback"), bin.join("loopback")).unwrap();
    if plugin == PluginUnderTest::Reference {
        symlink(reference_plugin("host-local"), bin.join("host-local")).unwrap();
    }
    let state = w.join("state");
    let ipam = w.join("ipam");
    let conflist = json!({
        "cniVersion": "1.0.0", "name": net,
        "plugins": [{
            "type": plugin.type_name(), "bridge": net, "isGateway": true, "ipMasq": false,
            "stateDir": state.display().to_string(),
            "ipam": {"type": plugin.builtin_ipam(), "ranges": [[{"subnet": SUBNET}], [{"subnet": SUBNET6}]],
                     "dataDir": ipam.display().to_string()},
        }],
    });
    std::fs::write(conf_dir.join("10-flowlane.conflist"), conflist.to_string()).unwrap();

    let rootfs = w.join("rootfs");
    cri::busybox_rootfs(&rootfs).unwrap();
    // The pause container only sleeps: StopPodSandbox SIGKILLs it.
    cri::oci_image_tar(
        &rootfs,
        &w.join("pause.tar"),
        PAUSE,
        &["/bin/sleep", "2147483647"],
    );
    cri::oci_image_tar(&rootfs, &w.join("app.tar"), APP, &["/bin/sh"]);

    let mut ctrd = Containerd::start(ContainerdConfig {
        dir: w.join("ctrd"),
        cni_bin_dir: bin.clone(),
        cni_conf_dir: conf_dir.clone(),
        sandbox_image: PAUSE.into(),
    });
    let ctrd_pid = ctrd.pid().unwrap();
    ctrd.import_image(&w.join("pause.tar"));
    ctrd.import_image(&w.join("app.tar"));

    let logs = w.join("logs");
    let web_name = flowlane_e2e::names::unique("web");
    let cli_name = flowlane_e2e::names::unique("cli");
    let web = run_pod(&ctrd, &web_name, &logs);
    let cli = run_pod(&ctrd, &cli_name, &logs);
    assert_ne!(web.ip, cli.ip);

    // The registry knows both pods, with the identity CRI passed in CNI_ARGS.
    let mut netns_paths = Vec::new();
    if plugin == PluginUnderTest::Flowlane {
        let entries = flowlane_registry::Registry::new(&state)
            .list_network(&net)
            .unwrap();
        assert_eq!(entries.len(), 2, "{entries:?}");
        for (pod, name) in [(&web, &web_name), (&cli, &cli_name)] {
            let e = entries
                .iter()
                .find(|e| e.pod_name.as_deref() == Some(name.as_str()))
                .unwrap_or_else(|| panic!("no registry entry for {name}: {entries:?}"));
            assert_eq!(e.pod_namespace.as_deref(), Some("flt-cri"));
            assert_eq!(e.pod_uid.as_deref(), Some(format!("uid-{name}").as_str()));
            assert_eq!(
                e.ips,
                vec![format!("{}/24", pod.ip), format!("{}/64", pod.ip6)]
            );
            assert!(e.netns.starts_with("/var/run/netns/cni-"), "{}", e.netns);
            let ino = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&e.netns).unwrap());
            assert_eq!(e.netns_inode, ino, "registry inode of {}", e.netns);
            netns_paths.push(e.netns.clone());
        }
    }

    let web_c = start_container(
        &ctrd,
        &web,
        "web",
        &["/bin/httpd", "-f", "-p", "8080", "-h", "/www"],
    );
    let cli_c = start_container(&ctrd, &cli, "cli", &["/bin/sleep", "3600"]);
    let url = format!("http://{}:8080/index.html", web.ip);
    let got = flowlane_e2e::wait::for_some(Duration::from_secs(30), || {
        let r = exec(&ctrd, &cli_c, &["/bin/wget", "-qO-", &url]);
        (r["exit_code"] == 0).then(|| r["stdout"].as_str().unwrap_or_default().to_string())
    })
    .expect("cli pod fetches from web pod over HTTP");
    assert_eq!(got, "flowlane-cri-ok\n");
    let url6 = format!("http://[{}]:8080/index.html", web.ip6);
    // Retried: the IPv6 addresses may still be in duplicate address detection.
    let got6 = flowlane_e2e::wait::for_some(Duration::from_secs(30), || {
        let r = exec(&ctrd, &cli_c, &["/bin/wget", "-qO-", &url6]);
        (r["exit_code"] == 0).then(|| r["stdout"].as_str().unwrap_or_default().to_string())
    })
    .expect("cli pod fetches from web pod over IPv6");
    assert_eq!(got6, "flowlane-cri-ok\n");
    let ping = exec(&ctrd, &web_c, &["/bin/ping", "-c", "1", "-W", "5", &cli.ip]);
    assert_eq!(ping["exit_code"], 0, "web pings cli: {ping}");

    for pod in [&web, &cli] {
        let id = json!({"pod_sandbox_id": pod.id});
        ctrd.call("StopPodSandbox", &id);
        ctrd.call("RemovePodSandbox", &id);
    }
    assert!(
        ctrd.call("ListPodSandbox", &json!({}))["items"]
            .as_array()
            .is_none_or(|a| a.is_empty()),
        "pods remain"
    );

    // Nothing leaked.
    assert_eq!(
        lease_files(&ipam),
        Vec::<std::path::PathBuf>::new(),
        "leases leaked"
    );
    assert!(
        flowlane_e2e::wait::until(Duration::from_secs(10), || bridge_ports(&net).is_empty()),
        "veths leaked: {:?}",
        bridge_ports(&net)
            .iter()
            .map(|l| &l.ifname)
            .collect::<Vec<_>>()
    );
    if plugin == PluginUnderTest::Flowlane {
        let left = flowlane_registry::Registry::new(&state)
            .list_network(&net)
            .unwrap();
        assert!(left.is_empty(), "registry entries leaked: {left:?}");
    }
    // libcni's result cache (containerd's copy of each ADD result) is gone too.
    let cached: Vec<_> = flowlane_e2e::fsutil::files_below(Path::new("/var/lib/cni"))
        .into_iter()
        .filter(|p| p.display().to_string().contains(&net))
        .collect();
    assert!(cached.is_empty(), "libcni cache entries left: {cached:?}");
    for p in &netns_paths {
        assert!(!Path::new(p).exists(), "netns {p} leaked");
    }
    ctrd.shutdown();
    assert!(
        !Path::new(&format!("/proc/{ctrd_pid}")).exists(),
        "containerd still running"
    );
    assert!(
        ctrd.shim_pids().is_empty(),
        "shims left: {:?}",
        ctrd.shim_pids()
    );
    drop(ctrd);
    drop(bridge);
}
