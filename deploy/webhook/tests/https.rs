//! The real `flowlane-webhook` binary over HTTPS on 127.0.0.1, driven the way the API
//! server drives it: a throwaway CA signs the serving certificate for the Service's DNS
//! name, the client verifies the chain against that CA, POSTs recorded AdmissionReview v1
//! requests, decodes the JSONPatch and applies it to the pod.

use base64::Engine as _;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use rustls_pki_types::{CertificateDer, ServerName};
use serde_json::{json, Value};
use std::io::BufRead as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;
use tokio_rustls::rustls;

mod common;
use common::TempDir;

const SERVICE_DNS: &str = "flowlane-webhook.flowlane-system.svc";
const PRELOAD_LIB: &str = "/opt/flowlane/lib/libflowlane_preload.so";
const SOCKET: &str = "/run/flowlane/flowlaned.sock";

struct Ca {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
}

fn new_ca(name: &str) -> Ca {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    Ca {
        cert: params.self_signed(&key).unwrap(),
        key,
    }
}

/// (certificate PEM, key PEM) for the webhook Service, signed by `ca`.
fn serving_pair(ca: &Ca) -> (String, String) {
    let key = rcgen::KeyPair::generate().unwrap();
    let params = rcgen::CertificateParams::new(vec![SERVICE_DNS.to_string()]).unwrap();
    let cert = params.signed_by(&key, &ca.cert, &ca.key).unwrap();
    (cert.pem(), key.serialize_pem())
}

/// The running webhook, killed on drop.
struct Webhook {
    child: Child,
    port: u16,
}
impl Drop for Webhook {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_webhook(cert: &Path, key: &Path) -> Webhook {
    let mut child = Command::new(env!("CARGO_BIN_EXE_flowlane-webhook"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--log-level",
            "debug",
            "--tls-cert",
        ])
        .arg(cert)
        .arg("--tls-key")
        .arg(key)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start flowlane-webhook");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // keep draining (and echoing) the log so the webhook never blocks on a full pipe
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            eprintln!("webhook: {line}");
            if let Some(addr) = line.split("addr=").nth(1) {
                let port = addr
                    .split_whitespace()
                    .next()
                    .unwrap()
                    .rsplit(':')
                    .next()
                    .unwrap();
                let _ = tx.send(port.parse::<u16>().unwrap());
            }
        }
    });
    let mut webhook = Webhook { child, port: 0 };
    webhook.port = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the webhook logs its address");
    webhook
}

fn client_config(ca: &Ca) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from(ca.cert.der().to_vec()))
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Arc::new(config)
}

/// One HTTPS request on a fresh connection (as the API server may do): (status, body).
async fn request(
    port: u16,
    tls: Arc<rustls::ClientConfig>,
    method: &str,
    path: &str,
    body: Vec<u8>,
) -> Result<(u16, Vec<u8>), String> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let name = ServerName::try_from(SERVICE_DNS).unwrap();
    let stream = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", SERVICE_DNS)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(30), sender.send_request(req))
        .await
        .map_err(|_| "timeout".to_string())?
        .map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes()
        .to_vec();
    Ok((status, body))
}

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!(
        "{}/tests/fixtures/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
}

/// POSTs a fixture; returns (pod before, pod after applying the returned patch, had patch).
async fn admit(
    port: u16,
    tls: &Arc<rustls::ClientConfig>,
    path: &str,
    name: &str,
) -> (Value, Value, bool) {
    let body = fixture(name);
    let (status, answer) = request(port, tls.clone(), "POST", path, body.clone())
        .await
        .unwrap();
    assert_eq!(status, 200, "{name}: {}", String::from_utf8_lossy(&answer));
    let answer: Value = serde_json::from_slice(&answer).unwrap();
    let req: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(answer["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(answer["kind"], "AdmissionReview");
    let response = &answer["response"];
    assert_eq!(response["uid"], req["request"]["uid"]);
    assert_eq!(response["allowed"], true);
    let pod = req["request"]["object"].clone();
    let mut after = pod.clone();
    let had_patch = response.get("patch").is_some();
    if had_patch {
        assert_eq!(response["patchType"], "JSONPatch");
        let raw = base64::engine::general_purpose::STANDARD
            .decode(response["patch"].as_str().unwrap())
            .unwrap();
        let patch: json_patch::Patch = serde_json::from_slice(&raw).unwrap();
        json_patch::patch(&mut after, &patch).expect("patch applies");
    }
    (pod, after, had_patch)
}

fn env<'a>(c: &'a Value, name: &str) -> Option<&'a str> {
    c["env"].as_array()?.iter().find(|e| e["name"] == name)?["value"].as_str()
}

fn assert_injected(c: &Value, ld_preload: &str) {
    assert_eq!(env(c, "LD_PRELOAD"), Some(ld_preload), "{}", c["name"]);
    assert_eq!(env(c, "FLOWLANE_SOCKET"), Some(SOCKET));
    let mounts = c["volumeMounts"].as_array().unwrap();
    // the pod's emptyDir that its image's probe filled (subPath p<k>)
    assert!(
        mounts.iter().any(|m| m["name"] == "flowlane-lib"
            && m["mountPath"] == "/opt/flowlane/lib"
            && m["readOnly"] == true
            && m["subPath"].as_str().is_some_and(|s| s.starts_with('p'))),
        "{mounts:?}"
    );
    assert!(mounts.contains(
        &json!({"name": "flowlane-run", "mountPath": "/run/flowlane", "readOnly": true})
    ));
}

fn assert_pod_volumes(pod: &Value) {
    let volumes = pod["spec"]["volumes"].as_array().unwrap();
    assert!(volumes.contains(&json!({"name": "flowlane-preload", "csi": {"driver": "csi.flowlane.io", "readOnly": true, "volumeAttributes": {"content": "lib"}}})));
    assert!(volumes.contains(&json!({"name": "flowlane-run", "csi": {"driver": "csi.flowlane.io", "readOnly": true, "volumeAttributes": {"content": "run"}}})));
    assert!(volumes.contains(&json!({"name": "flowlane-lib", "emptyDir": {"sizeLimit": "256Mi"}})));
    // one probe per distinct image, in that image
    let images: std::collections::BTreeSet<&str> = pod["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["image"].as_str().unwrap())
        .collect();
    let probes: std::collections::BTreeSet<&str> = pod["spec"]["initContainers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["name"].as_str().unwrap().starts_with("flowlane-probe-"))
        .map(|c| c["image"].as_str().unwrap())
        .collect();
    assert_eq!(images, probes);
    assert_eq!(
        pod["metadata"]["annotations"]["flowlane.io/injected"],
        "true"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_reviews_over_https_are_patched_as_expected() {
    let dir = TempDir::new("webhook-reviews");
    let ca = new_ca("flowlane test CA");
    let (cert, key) = serving_pair(&ca);
    std::fs::write(dir.0.join("tls.crt"), cert).unwrap();
    std::fs::write(dir.0.join("tls.key"), key).unwrap();
    let hook = start_webhook(&dir.0.join("tls.crt"), &dir.0.join("tls.key"));
    let tls = client_config(&ca);

    let (status, body) = request(hook.port, tls.clone(), "GET", "/healthz", vec![])
        .await
        .unwrap();
    assert_eq!((status, body.as_slice()), (200, &b"ok\n"[..]));

    // pod annotation opt-in, from a namespace without the label
    let (before, after, patched) =
        admit(hook.port, &tls, "/mutate/pod", "pod-annotation-opt-in").await;
    assert!(patched);
    assert_injected(&after["spec"]["containers"][0], PRELOAD_LIB);
    assert_injected(&after["spec"]["containers"][1], PRELOAD_LIB);
    assert_eq!(env(&after["spec"]["containers"][0], "RANK"), Some("0"));
    // the pod's own init containers stay first and unchanged
    assert_eq!(
        after["spec"]["initContainers"][0],
        before["spec"]["initContainers"][0]
    );
    assert_pod_volumes(&after);

    // opt-out annotation in a labelled namespace: untouched
    let (before, after, patched) = admit(hook.port, &tls, "/mutate/namespace", "pod-opt-out").await;
    assert!(!patched);
    assert_eq!(before, after);

    // namespace label opt-in (a ReplicaSet's pod: generateName, no annotations yet)
    let (_, after, patched) =
        admit(hook.port, &tls, "/mutate/namespace", "pod-namespace-opt-in").await;
    assert!(patched);
    assert_injected(&after["spec"]["containers"][0], PRELOAD_LIB);
    assert_pod_volumes(&after);
    // ... and the same pod outside such a namespace is not
    let (_, _, patched) = admit(hook.port, &tls, "/mutate/pod", "pod-namespace-opt-in").await;
    assert!(!patched);

    // an existing LD_PRELOAD keeps its library, ours is appended
    let (_, after, _) = admit(hook.port, &tls, "/mutate/pod", "pod-existing-ld-preload").await;
    assert_injected(
        &after["spec"]["containers"][0],
        &format!("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2:{PRELOAD_LIB}"),
    );
    assert_eq!(
        env(&after["spec"]["containers"][0], "MALLOC_CONF"),
        Some("background_thread:true")
    );

    // already injected: no patch at all
    for path in ["/mutate/pod", "/mutate/namespace"] {
        let (before, after, patched) = admit(hook.port, &tls, path, "pod-already-injected").await;
        assert!(!patched, "{path}");
        assert_eq!(before, after);
    }

    // garbage: 400 with a reason, and the webhook keeps serving
    for garbage in [
        &b"\x00\xffnot json"[..],
        b"{}",
        b"[1,2",
        br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#,
    ] {
        let (status, body) = request(
            hook.port,
            tls.clone(),
            "POST",
            "/mutate/pod",
            garbage.to_vec(),
        )
        .await
        .unwrap();
        assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
        assert!(!body.is_empty());
    }
    let (status, _) = request(hook.port, tls.clone(), "GET", "/mutate/pod", vec![])
        .await
        .unwrap();
    assert_eq!(status, 405);
    let (status, _) = request(hook.port, tls.clone(), "POST", "/elsewhere", vec![])
        .await
        .unwrap();
    assert_eq!(status, 404);
    // a client that speaks no TLS at all gets nothing and changes nothing
    {
        use tokio::io::AsyncWriteExt as _;
        let mut raw = tokio::net::TcpStream::connect(("127.0.0.1", hook.port))
            .await
            .unwrap();
        raw.write_all(b"POST /mutate/pod HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
    }
    let (_, after, _) = admit(hook.port, &tls, "/mutate/namespace", "pod-namespace-opt-in").await;
    assert_injected(&after["spec"]["containers"][0], PRELOAD_LIB);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_certificate_is_verified_and_a_rotation_is_picked_up() {
    let dir = TempDir::new("webhook-rotate");
    let (ca1, ca2) = (new_ca("first CA"), new_ca("second CA"));
    let (cert, key) = serving_pair(&ca1);
    std::fs::write(dir.0.join("tls.crt"), cert).unwrap();
    std::fs::write(dir.0.join("tls.key"), key).unwrap();
    let hook = start_webhook(&dir.0.join("tls.crt"), &dir.0.join("tls.key"));

    assert_eq!(
        request(hook.port, client_config(&ca1), "GET", "/healthz", vec![])
            .await
            .unwrap()
            .0,
        200
    );
    let refused = request(hook.port, client_config(&ca2), "GET", "/healthz", vec![]).await;
    assert!(
        refused.as_ref().is_err_and(|e| e.contains("certificate")),
        "{refused:?}"
    );

    // rotate: key first, then the certificate (its change triggers the reload), as a
    // Secret volume update swaps both at once
    let (cert, key) = serving_pair(&ca2);
    std::fs::write(dir.0.join("tls.key.new"), key).unwrap();
    std::fs::write(dir.0.join("tls.crt.new"), cert).unwrap();
    std::fs::rename(dir.0.join("tls.key.new"), dir.0.join("tls.key")).unwrap();
    std::fs::rename(dir.0.join("tls.crt.new"), dir.0.join("tls.crt")).unwrap();
    assert_eq!(
        request(hook.port, client_config(&ca2), "GET", "/healthz", vec![])
            .await
            .unwrap()
            .0,
        200
    );
    assert!(
        request(hook.port, client_config(&ca1), "GET", "/healthz", vec![])
            .await
            .is_err()
    );

    // a broken rotation keeps the last good certificate
    std::fs::write(dir.0.join("tls.crt"), "not a certificate").unwrap();
    assert_eq!(
        request(hook.port, client_config(&ca2), "GET", "/healthz", vec![])
            .await
            .unwrap()
            .0,
        200
    );
}

#[test]
fn bad_certificate_files_stop_the_webhook_at_start_with_a_reason() {
    let dir = TempDir::new("webhook-badcert");
    std::fs::write(dir.0.join("tls.crt"), "garbage").unwrap();
    std::fs::write(dir.0.join("tls.key"), "garbage").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_flowlane-webhook"))
        .args(["--listen", "127.0.0.1:0", "--tls-cert"])
        .arg(dir.0.join("tls.crt"))
        .arg("--tls-key")
        .arg(dir.0.join("tls.key"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tls.crt"), "{err}");
}
