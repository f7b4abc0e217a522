//! The DaemonSet's install.sh (taken from deploy/kubernetes/configmap.yaml, run with
//! /bin/sh as the init container runs it) against a fake API server over HTTPS that
//! serves recorded Node objects: it installs the real built binaries, runs the plugin,
//! and writes the conflist for this node's pod CIDRs without leaving temporary files.
//! The API server is the only fake (it cannot exist here); curl, jq and the files are real.

use serde_json::{json, Value};
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use tokio_rustls::rustls;

mod common;
use common::{config_data, install_tree, release_dir, TempDir};

/// A one-connection-at-a-time HTTPS server on 127.0.0.1 answering GET requests from
/// `nodes` (path -> Node JSON); records (path, authorization header) of each request.
struct FakeApi {
    port: u16,
    seen: Arc<Mutex<Vec<(String, String)>>>,
    ca_pem: String,
}

fn fake_api(nodes: Vec<(String, Value)>) -> FakeApi {
    let key = rcgen::KeyPair::generate().unwrap();
    let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
    let cert = params.self_signed(&key).unwrap();
    let ca_pem = cert.pem();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = Arc::new(
        rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                rustls_pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )
            .unwrap(),
    );
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    std::thread::spawn(move || {
        for tcp in listener.incoming() {
            let Ok(tcp) = tcp else { return };
            let _ = tcp.set_read_timeout(Some(std::time::Duration::from_secs(30)));
            let conn = rustls::ServerConnection::new(config.clone()).unwrap();
            let mut tls = rustls::StreamOwned::new(conn, tcp);
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                match tls.read(&mut byte) {
                    Ok(1) => head.push(byte[0]),
                    _ => break,
                }
            }
            let head = String::from_utf8_lossy(&head).to_string();
            let path = head.split_whitespace().nth(1).unwrap_or("").to_string();
            let auth = head
                .lines()
                .find_map(|l| {
                    l.strip_prefix("Authorization: ")
                        .or(l.strip_prefix("authorization: "))
                })
                .unwrap_or("")
                .to_string();
            log.lock().unwrap().push((path.clone(), auth));
            let (status, body) = match nodes.iter().find(|(p, _)| *p == path) {
                Some((_, node)) => ("200 OK", node.to_string()),
                None => (
                    "404 Not Found",
                    json!({"kind": "Status", "code": 404}).to_string(),
                ),
            };
            let _ = write!(
                tls,
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = tls.flush();
            tls.conn.send_close_notify();
            let _ = tls.flush();
        }
    });
    FakeApi { port, seen, ca_pem }
}

/// A node as the API server returns it (trimmed to what matters plus typical noise).
fn node(name: &str, spec: Value) -> (String, Value) {
    let n = json!({
        "kind": "Node", "apiVersion": "v1",
        "metadata": {"name": name, "uid": "3c6b1d2e-0000-4000-8000-000000000001",
                     "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"},
                     "annotations": {"flowlane.io/rdma-lane": "{}"}},
        "spec": spec,
        "status": {"addresses": [{"type": "InternalIP", "address": "192.168.10.11"}]}
    });
    (format!("/api/v1/nodes/{name}"), n)
}

struct Node {
    _root: TempDir,
    root: PathBuf,
}

/// Runs install.sh for `node_name`; returns (success, stderr, layout).
fn run_install(api: &FakeApi, node_name: &str, tag: &str) -> (bool, String, Node) {
    let root = TempDir::new(&format!("install-{tag}"));
    let r = root.0.clone();
    let data = config_data();
    install_tree(
        &r,
        &[
            "opt/cni/bin",
            "etc/cni/net.d",
            "opt/flowlane/lib",
            "sa",
            "etc/flowlane",
        ],
    );
    std::fs::write(r.join("sa/token"), "test-token-123").unwrap();
    std::fs::write(r.join("sa/ca.crt"), &api.ca_pem).unwrap();
    let template = r.join("etc/flowlane/10-flowlane.conflist.tmpl");
    std::fs::write(
        &template,
        data["10-flowlane.conflist.tmpl"].as_str().unwrap(),
    )
    .unwrap();
    std::fs::write(
        r.join("etc/flowlane/install.sh"),
        data["install.sh"].as_str().unwrap(),
    )
    .unwrap();
    let out = Command::new("/bin/sh")
        .arg(r.join("etc/flowlane/install.sh"))
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("NODE_NAME", node_name)
        .env("FLOWLANE_SRC_DIR", r.join("src"))
        .env("HOST_CNI_BIN_DIR", r.join("opt/cni/bin"))
        .env("HOST_CNI_NET_DIR", r.join("etc/cni/net.d"))
        .env("HOST_LIB_DIR", r.join("opt/flowlane/lib"))
        .env("CONFLIST_TEMPLATE", &template)
        .env("CONFLIST_NAME", data["CONFLIST_NAME"].as_str().unwrap())
        .env("SERVICE_ACCOUNT_DIR", r.join("sa"))
        .env("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        .env("KUBERNETES_SERVICE_PORT", api.port.to_string())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    eprintln!(
        "install.sh stderr: {stderr}\nstdout: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    (
        out.status.success(),
        stderr,
        Node {
            _root: root,
            root: r,
        },
    )
}

fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

#[test]
fn install_writes_binaries_and_the_conflist_for_this_nodes_pod_cidrs() {
    let api = fake_api(vec![
        node(
            "gpu-a",
            json!({"podCIDR": "10.244.3.0/24", "podCIDRs": ["10.244.3.0/24", "fd00:244:3::/64"]}),
        ),
        node("gpu-b", json!({"podCIDR": "10.244.4.0/24"})),
    ]);
    let (ok, _, n) = run_install(&api, "gpu-a", "dual");
    assert!(ok, "install.sh succeeds");
    let r = &n.root;
    assert_eq!(listing(&r.join("opt/cni/bin")), ["flowlane", "flowlaned"]);
    assert_eq!(
        listing(&r.join("opt/flowlane/lib")),
        [
            "flowlane-probe",
            "libflowlane_noop.so",
            "libflowlane_preload.so"
        ]
    );
    assert_eq!(
        listing(&r.join("etc/cni/net.d")),
        ["10-flowlane.conflist"],
        "no temporary file left"
    );
    use std::os::unix::fs::PermissionsExt as _;
    let mode = |p: &str| std::fs::metadata(r.join(p)).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode("opt/cni/bin/flowlane"), 0o755);
    assert_eq!(mode("opt/flowlane/lib/libflowlane_preload.so"), 0o644);
    assert_eq!(mode("opt/flowlane/lib/libflowlane_noop.so"), 0o644);
    assert_eq!(mode("opt/flowlane/lib/flowlane-probe"), 0o755);
    assert_eq!(mode("etc/cni/net.d/10-flowlane.conflist"), 0o644);
    assert_eq!(
        std::fs::read(r.join("opt/cni/bin/flowlane")).unwrap(),
        std::fs::read(release_dir().join("flowlane")).unwrap()
    );
    let conf: Value = serde_json::from_slice(
        &std::fs::read(r.join("etc/cni/net.d/10-flowlane.conflist")).unwrap(),
    )
    .unwrap();
    let ipam = &conf["plugins"][0]["ipam"];
    assert_eq!(
        ipam["ranges"],
        json!([[{"subnet": "10.244.3.0/24"}], [{"subnet": "fd00:244:3::/64"}]])
    );
    assert_eq!(
        ipam["routes"],
        json!([{"dst": "0.0.0.0/0"}, {"dst": "::/0"}])
    );
    assert_eq!(conf["plugins"][0]["type"], "flowlane");
    assert_eq!(
        conf["plugins"][1]["type"], "portmap",
        "rest of the template kept"
    );
    // the plugin accepts what was written: CNI VERSION answers for the conflist's version
    let version = Command::new(r.join("opt/cni/bin/flowlane"))
        .env("CNI_COMMAND", "VERSION")
        .stdin(std::fs::File::open(r.join("etc/cni/net.d/10-flowlane.conflist")).unwrap())
        .output()
        .unwrap();
    assert!(version.status.success());
    let seen = api.seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        [(
            "/api/v1/nodes/gpu-a".to_string(),
            "Bearer test-token-123".to_string()
        )]
    );

    // a node with only the older single spec.podCIDR
    let (ok, _, n) = run_install(&api, "gpu-b", "single");
    assert!(ok);
    let conf: Value = serde_json::from_slice(
        &std::fs::read(n.root.join("etc/cni/net.d/10-flowlane.conflist")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        conf["plugins"][0]["ipam"]["ranges"],
        json!([[{"subnet": "10.244.4.0/24"}]])
    );
    assert_eq!(
        conf["plugins"][0]["ipam"]["routes"],
        json!([{"dst": "0.0.0.0/0"}])
    );
}

#[test]
fn install_fails_clearly_without_pod_cidrs_and_writes_no_conflist() {
    let api = fake_api(vec![node(
        "cpu-c",
        json!({"taints": [{"key": "x", "effect": "NoSchedule"}]}),
    )]);
    let (ok, stderr, n) = run_install(&api, "cpu-c", "nocidr");
    assert!(!ok);
    assert!(
        stderr.contains("no spec.podCIDRs") && stderr.contains("--allocate-node-cidrs"),
        "{stderr}"
    );
    assert!(
        listing(&n.root.join("etc/cni/net.d")).is_empty(),
        "no conflist, no temporary file"
    );

    // a node the API does not know (wrong NODE_NAME): curl's error, nothing written
    let (ok, stderr, n) = run_install(&api, "missing-node", "missing");
    assert!(!ok);
    assert!(stderr.contains("404"), "{stderr}");
    assert!(listing(&n.root.join("etc/cni/net.d")).is_empty());
}
