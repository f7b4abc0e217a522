//! A fake Kubernetes API server for the e2e tests (Kubernetes cannot run
//! here; this is the one boundary that is faked, with the kubelet
//! ([`crate::kubelet`])): HTTP/1.1 over TLS (a certificate for its IP, signed
//! by a throwaway CA), one request per connection (it answers `Connection:
//! close`), objects held in memory, answering as the API server does (its
//! status codes, `Status` bodies and list shapes):
//!
//! - Nodes: list, get, merge patch;
//! - Namespaces: create (with the `kubernetes.io/metadata.name` label), get,
//!   delete (Terminating until its pods are gone, which it deletes);
//! - Pods: create (defaults, 409 when the name is taken, 404 without the
//!   namespace, then the mutating admission webhooks registered with
//!   [`FakeApi::set_mutating_webhooks`], matched by their rules and
//!   namespaceSelector and answered by flowlane-webhook's own library as its
//!   service routes them, the JSON patch applied; failurePolicy Ignore; then
//!   Pod Security admission at the namespace's `pod-security.kubernetes.io/enforce`
//!   level, [`pod_security`], 403 on a violation),
//!   get, list (all or per namespace, `labelSelector` with `k=v`,
//!   `fieldSelector` with `spec.nodeName=` / `metadata.name=`), delete
//!   (graceful for a bound, non-terminal pod: `deletionTimestamp` set and
//!   the kubelet removes it; otherwise at once);
//! - `pods/NAME/log`: the container's output the kubelet captured (400 while
//!   it waits to start);
//! - `pods/NAME[:PORT]/proxy/PATH`: the request forwarded over HTTP to the
//!   pod's IP (through [`FakeApi::set_pod_dialer`] when the pods live in
//!   another network namespace), the pod's answer passed back (503 when it
//!   cannot be reached).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

pub mod core_v1;
pub mod pod_security;
use core_v1::{collect_namespaces, namespace_defaults, pod_key, proxy, proxy_target};

/// The annotation a node's daemon publishes its RDMA lane in.
pub const ANNOTATION: &str = "flowlane.io/rdma-lane";

/// One request the fake received.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub query: String,
    pub headers: BTreeMap<String, String>,
    pub body: Value,
    /// The status code the fake answered.
    pub code: u16,
}

/// Opens a TCP connection to a pod's address (the proxy subresource).
pub type PodDialer = Arc<dyn Fn(SocketAddr) -> std::io::Result<TcpStream> + Send + Sync>;

#[derive(Default)]
pub struct ApiState {
    pub nodes: Vec<Value>,
    pub namespaces: Vec<Value>,
    pub pods: Vec<Value>,
    /// MutatingWebhookConfiguration objects, called on pod creation.
    pub mutating_webhooks: Vec<Value>,
    /// Where the kubelet captures a pod's container output: "ns/name".
    pub pod_logs: BTreeMap<String, PathBuf>,
    pub pod_dialer: Option<PodDialer>,
    pub resource_version: u64,
    /// The next N node lists answer 500.
    pub fail_lists: usize,
    /// The next N patches answer 500.
    pub fail_patches: usize,
    pub seen: Vec<Seen>,
}

pub struct FakeApi {
    pub addr: SocketAddr,
    /// The CA that signed the server's certificate (PEM).
    pub ca_pem: String,
    pub state: Arc<Mutex<ApiState>>,
    stop: Arc<AtomicBool>,
    /// The listening socket (a duplicate): shut down on drop to wake the
    /// accept loop, wherever the listener was bound (a connect to wake it
    /// would have to come from the listener's own network namespace).
    listener: TcpListener,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn status_body(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

/// RFC 7386 JSON merge patch.
fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = json!({});
            }
            let t = target.as_object_mut().unwrap();
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        other => *target = other.clone(),
    }
}

impl FakeApi {
    /// On 127.0.0.1.
    pub fn start(nodes: Vec<Value>) -> FakeApi {
        FakeApi::serve(TcpListener::bind("127.0.0.1:0").unwrap(), nodes)
    }

    /// On `listener`, which may be bound in any network namespace (its
    /// address goes into the certificate).
    pub fn serve(listener: TcpListener, nodes: Vec<Value>) -> FakeApi {
        let addr = listener.local_addr().unwrap();
        let (tls, ca_pem) = tls_config(&addr.ip().to_string());
        let waker = listener.try_clone().unwrap();
        let state = Arc::new(Mutex::new(ApiState {
            nodes,
            ..ApiState::default()
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (state, stop) = (state.clone(), stop.clone());
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(conn) = conn else {
                        std::thread::sleep(Duration::from_millis(10));
                        continue;
                    };
                    let state = state.clone();
                    let tls = tls.clone();
                    std::thread::spawn(move || {
                        let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
                        let Ok(server) = rustls::ServerConnection::new(tls) else {
                            return;
                        };
                        let _ = serve_one(rustls::StreamOwned::new(server, conn), &state);
                    });
                }
            })
        };
        FakeApi {
            addr,
            ca_pem,
            state,
            stop,
            listener: waker,
            thread: Some(thread),
        }
    }

    /// Adds or replaces a Node (by name), as the API server would after a
    /// kubelet registers or updates it.
    pub fn put_node(&self, node: Value) {
        let mut st = self.state.lock().unwrap();
        let name = node["metadata"]["name"].clone();
        st.nodes.retain(|n| n["metadata"]["name"] != name);
        st.nodes.push(node);
    }

    /// Adds or replaces a Namespace, as `kubectl apply` would.
    pub fn put_namespace(&self, ns: Value) {
        let mut st = self.state.lock().unwrap();
        let ns = namespace_defaults(ns);
        let name = ns["metadata"]["name"].clone();
        st.namespaces.retain(|n| n["metadata"]["name"] != name);
        st.namespaces.push(ns);
    }

    /// Adds or replaces a Pod as it is (no admission): what a controller
    /// and a kubelet already made, e.g. a DaemonSet's running pod.
    pub fn put_pod(&self, pod: Value) {
        let mut st = self.state.lock().unwrap();
        let key = pod_key(&pod);
        st.pods.retain(|p| pod_key(p) != key);
        st.pods.push(pod);
    }

    /// The Pods as the fake holds them now.
    pub fn pods(&self) -> Vec<Value> {
        self.state.lock().unwrap().pods.clone()
    }

    pub fn namespaces(&self) -> Vec<Value> {
        self.state.lock().unwrap().namespaces.clone()
    }

    /// Registers a MutatingWebhookConfiguration (as parsed from YAML).
    pub fn set_mutating_webhooks(&self, config: Value) {
        self.state.lock().unwrap().mutating_webhooks.push(config);
    }

    /// How the proxy subresource reaches pods' addresses.
    pub fn set_pod_dialer(&self, dialer: PodDialer) {
        self.state.lock().unwrap().pod_dialer = Some(dialer);
    }

    /// The Node objects as the fake holds them now.
    pub fn nodes(&self) -> Vec<Value> {
        self.state.lock().unwrap().nodes.clone()
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.state.lock().unwrap().seen.clone()
    }

    /// The patches of `node` the fake applied (answered 200).
    pub fn patches_of(&self, node: &str) -> Vec<Seen> {
        let path = format!("/api/v1/nodes/{node}");
        self.seen()
            .into_iter()
            .filter(|s| s.method == "PATCH" && s.path == path && s.code == 200)
            .collect()
    }

    pub fn lists(&self) -> usize {
        self.seen()
            .iter()
            .filter(|s| s.method == "GET" && s.path == "/api/v1/nodes")
            .count()
    }

    /// A kubeconfig (and the CA it names) written in `dir`.
    pub fn kubeconfig(&self, dir: &Path) -> PathBuf {
        let path = dir.join("kubeconfig");
        let ca = dir.join("ca.pem");
        std::fs::write(&ca, &self.ca_pem).unwrap();
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: https://{}\n    certificate-authority: {}\n\
                 contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: flowlane-node\n\
                 current-context: fake\nusers:\n- name: flowlane-node\n  user:\n    token: kb-test-token\n",
                self.addr,
                ca.display()
            ),
        )
        .unwrap();
        path
    }
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // shutdown(2) of a listening socket wakes a blocked accept (EINVAL).
        let _ =
            nix::sys::socket::shutdown(self.listener.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A server certificate for `ip` signed by a fresh CA: the TLS config and
/// the CA's PEM (for the kubeconfig).
pub fn tls_config(ip: &str) -> (Arc<rustls::ServerConfig>, String) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "kb fake apiserver CA");
    ca_params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec![ip.to_string()])
        .unwrap()
        .signed_by(&key, &ca, &ca_key)
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .unwrap();
    (Arc::new(config), ca.pem())
}

fn serve_one(
    conn: rustls::StreamOwned<rustls::ServerConnection, TcpStream>,
    state: &Mutex<ApiState>,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn);
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Ok(());
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let target = parts.next().unwrap_or("").to_string();
    let mut headers = BTreeMap::new();
    loop {
        let mut h = String::new();
        reader.read_line(&mut h)?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let body = if let Some(len) = headers.get("content-length") {
        let mut b = vec![0; len.parse().unwrap_or(0)];
        reader.read_exact(&mut b)?;
        b
    } else if headers.get("transfer-encoding").map(String::as_str) == Some("chunked") {
        let mut b = Vec::new();
        loop {
            let mut size = String::new();
            reader.read_line(&mut size)?;
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            let mut chunk = vec![0; n + 2];
            reader.read_exact(&mut chunk)?;
            if n == 0 {
                break;
            }
            b.extend_from_slice(&chunk[..n]);
        }
        b
    } else {
        Vec::new()
    };
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p.to_string(), q.to_string()),
        None => (target.clone(), String::new()),
    };
    let seen = Seen {
        method: method.clone(),
        path: path.clone(),
        query,
        headers,
        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
        code: 0,
    };
    // The proxy subresource talks to the pod outside the state's lock.
    let (code, reply) = match proxy_target(&seen.path) {
        Some(target) if seen.method == "GET" => {
            let (code, reply) = proxy(state, &target, &seen.query);
            state.lock().unwrap().seen.push(Seen {
                code,
                ..seen.clone()
            });
            (code, reply)
        }
        _ => {
            let mut st = state.lock().unwrap();
            let (code, reply) = answer(&mut st, &seen);
            collect_namespaces(&mut st);
            st.seen.push(Seen { code, ..seen });
            (code, reply)
        }
    };
    let (content_type, body) = match reply {
        Reply::Json(v) => (
            "application/json".to_string(),
            serde_json::to_vec(&v).unwrap(),
        ),
        Reply::Raw(t, b) => (t, b),
    };
    let reason = match code {
        200 => "OK",
        201 => "Created",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        409 => "Conflict",
        422 => "Unprocessable Entity",
        503 => "Service Unavailable",
        _ => "Internal Server Error",
    };
    let out = reader.get_mut();
    write!(
        out,
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    out.write_all(&body)?;
    out.conn.send_close_notify();
    out.flush()
}

/// An answer's body: a JSON object, or raw bytes with their content type
/// (logs, proxied responses).
pub enum Reply {
    Json(Value),
    Raw(String, Vec<u8>),
}

fn answer(st: &mut ApiState, req: &Seen) -> (u16, Reply) {
    if let Some(r) = core_v1::answer(st, req) {
        return r;
    }
    let (code, v) = answer_nodes(st, req);
    (code, Reply::Json(v))
}

fn answer_nodes(st: &mut ApiState, req: &Seen) -> (u16, Value) {
    if req.method == "GET" && req.path == "/api/v1/nodes" {
        if st.fail_lists > 0 {
            st.fail_lists -= 1;
            return (
                500,
                status_body(500, "InternalError", "etcdserver: request timed out"),
            );
        }
        return (
            200,
            json!({"kind": "NodeList", "apiVersion": "v1",
                   "metadata": {"resourceVersion": "5000"}, "items": st.nodes}),
        );
    }
    if let (true, Some(name)) = (req.method == "GET", req.path.strip_prefix("/api/v1/nodes/")) {
        return match st.nodes.iter().find(|n| n["metadata"]["name"] == name) {
            Some(node) => (200, node.clone()),
            None => (
                404,
                status_body(404, "NotFound", &format!("nodes \"{name}\" not found")),
            ),
        };
    }
    if let (true, Some(name)) = (
        req.method == "PATCH",
        req.path.strip_prefix("/api/v1/nodes/"),
    ) {
        if st.fail_patches > 0 {
            st.fail_patches -= 1;
            return (
                500,
                status_body(500, "InternalError", "etcdserver: leader changed"),
            );
        }
        let Some(node) = st.nodes.iter_mut().find(|n| n["metadata"]["name"] == name) else {
            return (
                404,
                status_body(404, "NotFound", &format!("nodes \"{name}\" not found")),
            );
        };
        merge_patch(node, &req.body);
        return (200, node.clone());
    }
    (
        404,
        status_body(
            404,
            "NotFound",
            "the server could not find the requested resource",
        ),
    )
}

/// A Node as `GET /api/v1/nodes` lists it.
pub fn node_object(name: &str, cidrs: &[&str], ip: &str, lane: Option<Value>) -> Value {
    let mut node = json!({
        "metadata": {"name": name, "uid": format!("uid-{name}"), "resourceVersion": "4000",
                     "labels": {"kubernetes.io/hostname": name}, "annotations": {
                        "node.alpha.kubernetes.io/ttl": "0"}},
        "spec": {},
        "status": {"addresses": [{"type": "InternalIP", "address": ip},
                                 {"type": "Hostname", "address": name}],
                   "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}
    });
    if !cidrs.is_empty() {
        node["spec"]["podCIDR"] = cidrs[0].into();
        node["spec"]["podCIDRs"] = json!(cidrs);
    }
    if let Some(l) = lane {
        node["metadata"]["annotations"][ANNOTATION] = l.to_string().into();
    }
    node
}
