//! The fake API server's Namespaces, Pods and their `log` and `proxy`
//! subresources (see the parent module for what it answers and how).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::Duration;

use serde_json::{json, Value};

use super::{pod_security, status_body, ApiState, Reply, Seen};

/// "namespace/name" of an object.
pub fn pod_key(p: &Value) -> String {
    format!(
        "{}/{}",
        p["metadata"]["namespace"].as_str().unwrap_or(""),
        p["metadata"]["name"].as_str().unwrap_or("")
    )
}

/// RFC 3339 time of now, in whole seconds (as the API server writes them).
pub fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil from days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// What the API server adds to a Namespace it stores.
pub fn namespace_defaults(mut ns: Value) -> Value {
    let name = ns["metadata"]["name"].as_str().unwrap_or("").to_string();
    ns["apiVersion"] = json!("v1");
    ns["kind"] = json!("Namespace");
    if !ns["metadata"]["labels"].is_object() {
        ns["metadata"]["labels"] = json!({});
    }
    ns["metadata"]["labels"]["kubernetes.io/metadata.name"] = json!(name);
    if ns["metadata"]["uid"].is_null() {
        ns["metadata"]["uid"] = json!(format!("uid-ns-{name}"));
    }
    if ns["status"]["phase"].is_null() {
        ns["status"] = json!({"phase": "Active"});
    }
    ns
}

fn next_rv(st: &mut ApiState) -> String {
    st.resource_version += 1;
    (10_000 + st.resource_version).to_string()
}

/// Bumps a stored object's resourceVersion (every change does).
pub fn touched(st: &mut ApiState, key: &str) {
    let rv = next_rv(st);
    if let Some(p) = st.pods.iter_mut().find(|p| pod_key(p) == key) {
        p["metadata"]["resourceVersion"] = json!(rv);
    }
}

fn not_found(kind: &str, name: &str) -> (u16, Reply) {
    (
        404,
        Reply::Json(status_body(
            404,
            "NotFound",
            &format!("{kind} \"{name}\" not found"),
        )),
    )
}

fn bad_request(message: &str) -> (u16, Reply) {
    (400, Reply::Json(status_body(400, "BadRequest", message)))
}

/// Percent-decoding of a query value (`+` is a space).
fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => match u8::from_str_radix(&s[i + 1..i + 3], 16) {
                Ok(v) => {
                    out.push(v);
                    i += 3;
                    continue;
                }
                Err(_) => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query_param(query: &str, key: &str) -> Option<String> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| decode(v))
}

/// Equality terms `k=v` / `k==v` / `k!=v` of a selector; `None` when it
/// has a term the fake does not implement (then 400, never a wrong list).
fn selector_terms(sel: &str) -> Option<Vec<(String, bool, String)>> {
    sel.split(',')
        .filter(|t| !t.trim().is_empty())
        .map(|t| {
            if let Some((k, v)) = t.split_once("!=") {
                Some((k.trim().to_string(), false, v.trim().to_string()))
            } else {
                let (k, v) = t.split_once("==").or_else(|| t.split_once('='))?;
                Some((k.trim().to_string(), true, v.trim().to_string()))
            }
        })
        .collect()
}

fn matches_terms(terms: &[(String, bool, String)], get: impl Fn(&str) -> Option<String>) -> bool {
    terms
        .iter()
        .all(|(k, eq, v)| (get(k).as_deref() == Some(v.as_str())) == *eq)
}

/// A label selector (`matchLabels`, `matchExpressions` In/NotIn/Exists/
/// DoesNotExist) against labels.
fn selector_matches(selector: &Value, labels: &Value) -> bool {
    if selector.is_null() {
        return true;
    }
    let ml = selector["matchLabels"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    if ml.iter().any(|(k, v)| labels[k] != *v) {
        return false;
    }
    selector["matchExpressions"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .all(|e| {
            let key = e["key"].as_str().unwrap_or("");
            let values: Vec<&str> = e["values"]
                .as_array()
                .map(|v| v.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let have = labels[key].as_str();
            match e["operator"].as_str() {
                Some("In") => have.is_some_and(|h| values.contains(&h)),
                Some("NotIn") => !have.is_some_and(|h| values.contains(&h)),
                Some("Exists") => have.is_some(),
                Some("DoesNotExist") => have.is_none(),
                _ => false,
            }
        })
}

/// Does a webhook's rule list cover CREATE of core/v1 pods?
fn rules_cover_pod_create(webhook: &Value) -> bool {
    let has = |v: &Value, want: &str| {
        v.as_array()
            .is_some_and(|a| a.iter().any(|x| x == want || x == "*"))
    };
    webhook["rules"].as_array().is_some_and(|rules| {
        rules.iter().any(|r| {
            has(&r["operations"], "CREATE")
                && has(&r["apiGroups"], "")
                && has(&r["apiVersions"], "v1")
                && has(&r["resources"], "pods")
        })
    })
}

/// The mutating admission of a pod being created in namespace `ns`: every
/// registered webhook whose rules and namespaceSelector match is called in
/// order with an AdmissionReview, and its JSON patch applied. The backend
/// is flowlane-webhook's own library, routed by the service path as
/// flowlane-webhook's server routes it.
fn admit(st: &ApiState, ns: &Value, pod: &mut Value) {
    use base64::Engine as _;
    let labels = &ns["metadata"]["labels"];
    for config in &st.mutating_webhooks {
        for wh in config["webhooks"].as_array().cloned().unwrap_or_default() {
            if !rules_cover_pod_create(&wh) || !selector_matches(&wh["namespaceSelector"], labels) {
                continue;
            }
            let scope = match wh["clientConfig"]["service"]["path"].as_str() {
                Some("/mutate/namespace") => flowlane_webhook::inject::Scope::NamespaceOptIn,
                Some("/mutate/pod") => flowlane_webhook::inject::Scope::PodOptIn,
                // failurePolicy Ignore: a webhook that cannot answer changes nothing
                _ => continue,
            };
            let review = json!({
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "request": {
                    "uid": format!("review-{}", pod_key(pod)),
                    "kind": {"group": "", "version": "v1", "kind": "Pod"},
                    "resource": {"group": "", "version": "v1", "resource": "pods"},
                    "namespace": ns["metadata"]["name"],
                    "operation": "CREATE",
                    "object": pod.clone(),
                }
            });
            let body = serde_json::to_vec(&review).unwrap();
            let Ok((answer, _)) = flowlane_webhook::inject::review(&body, scope) else {
                continue;
            };
            let Some(patch) = answer["response"]["patch"].as_str() else {
                continue;
            };
            let Ok(bytes) = base64::engine::general_purpose::STANDARD.decode(patch) else {
                continue;
            };
            let Ok(patch) = serde_json::from_slice::<json_patch::Patch>(&bytes) else {
                continue;
            };
            let mut patched = pod.clone();
            if json_patch::patch(&mut patched, &patch).is_ok() {
                *pod = patched;
            }
        }
    }
}

fn list_pods(st: &ApiState, ns: Option<&str>, query: &str) -> (u16, Reply) {
    let labels = selector_terms(&query_param(query, "labelSelector").unwrap_or_default());
    let fields = selector_terms(&query_param(query, "fieldSelector").unwrap_or_default());
    let (Some(labels), Some(fields)) = (labels, fields) else {
        return bad_request("unable to parse the selector");
    };
    if fields.iter().any(|(k, _, _)| {
        !["spec.nodeName", "metadata.name", "metadata.namespace"].contains(&k.as_str())
    }) {
        return bad_request("field label not supported");
    }
    let items: Vec<Value> = st
        .pods
        .iter()
        .filter(|p| ns.is_none_or(|ns| p["metadata"]["namespace"] == ns))
        .filter(|p| {
            matches_terms(&labels, |k| {
                p["metadata"]["labels"][k].as_str().map(String::from)
            })
        })
        .filter(|p| {
            matches_terms(&fields, |k| {
                let (a, b) = k.split_once('.').unwrap_or((k, ""));
                Some(p[a][b].as_str().unwrap_or("").to_string())
            })
        })
        .cloned()
        .collect();
    (
        200,
        Reply::Json(json!({"kind": "PodList", "apiVersion": "v1",
            "metadata": {"resourceVersion": (10_000 + st.resource_version).to_string()},
            "items": items})),
    )
}

fn create_pod(st: &mut ApiState, ns: &str, body: &Value) -> (u16, Reply) {
    let Some(namespace) = st
        .namespaces
        .iter()
        .find(|n| n["metadata"]["name"] == ns)
        .cloned()
    else {
        return not_found("namespaces", ns);
    };
    if namespace["status"]["phase"] == "Terminating" {
        return (
            403,
            Reply::Json(status_body(
                403,
                "Forbidden",
                &format!(
                    "unable to create new content in namespace {ns} because it is being terminated"
                ),
            )),
        );
    }
    let mut pod = body.clone();
    let Some(name) = pod["metadata"]["name"].as_str().map(String::from) else {
        return (
            422,
            Reply::Json(status_body(
                422,
                "Invalid",
                "Pod \"\" is invalid: metadata.name: Required value",
            )),
        );
    };
    if pod["spec"]["containers"]
        .as_array()
        .is_none_or(|c| c.is_empty())
    {
        return (
            422,
            Reply::Json(status_body(
                422,
                "Invalid",
                &format!("Pod \"{name}\" is invalid: spec.containers: Required value"),
            )),
        );
    }
    if st
        .pods
        .iter()
        .any(|p| p["metadata"]["namespace"] == ns && p["metadata"]["name"] == name.as_str())
    {
        return (
            409,
            Reply::Json(status_body(
                409,
                "AlreadyExists",
                &format!("pods \"{name}\" already exists"),
            )),
        );
    }
    pod["apiVersion"] = json!("v1");
    pod["kind"] = json!("Pod");
    pod["metadata"]["namespace"] = json!(ns);
    pod["metadata"]["uid"] = json!(format!("uid-pod-{ns}-{name}-{}", st.resource_version));
    pod["metadata"]["creationTimestamp"] = json!(now_rfc3339());
    if pod["spec"]["restartPolicy"].is_null() {
        pod["spec"]["restartPolicy"] = json!("Always");
    }
    if pod["spec"]["terminationGracePeriodSeconds"].is_null() {
        pod["spec"]["terminationGracePeriodSeconds"] = json!(30);
    }
    admit(st, &namespace, &mut pod);
    // Pod Security runs after the mutating webhooks, on the pod they produced.
    let level = pod_security::enforced_level(&namespace);
    let violations = pod_security::evaluate(level, &pod);
    if !violations.is_empty() {
        return (
            403,
            Reply::Json(status_body(
                403,
                "Forbidden",
                &pod_security::forbidden_message(&name, level, &violations),
            )),
        );
    }
    pod["metadata"]["resourceVersion"] = json!(next_rv(st));
    pod["status"] = json!({"phase": "Pending", "qosClass": "BestEffort"});
    st.pods.push(pod.clone());
    (201, Reply::Json(pod))
}

fn delete_pod(st: &mut ApiState, key: &str, body: &Value) -> (u16, Reply) {
    let Some(i) = st.pods.iter().position(|p| pod_key(p) == key) else {
        return not_found("pods", key.split('/').nth(1).unwrap_or(""));
    };
    let p = &st.pods[i];
    let terminal = matches!(p["status"]["phase"].as_str(), Some("Succeeded" | "Failed"));
    let grace = body["gracePeriodSeconds"]
        .as_i64()
        .or_else(|| p["spec"]["terminationGracePeriodSeconds"].as_i64())
        .unwrap_or(30);
    // The API server deletes at once what no kubelet has to stop.
    if p["spec"]["nodeName"].as_str().is_none() || terminal || grace == 0 {
        let gone = st.pods.remove(i);
        return (200, Reply::Json(gone));
    }
    if st.pods[i]["metadata"]["deletionTimestamp"].is_null() {
        st.pods[i]["metadata"]["deletionTimestamp"] = json!(now_rfc3339());
        st.pods[i]["metadata"]["deletionGracePeriodSeconds"] = json!(grace);
        touched(st, key);
    }
    (200, Reply::Json(st.pods[i].clone()))
}

/// The namespace controller: a Terminating namespace's pods are deleted,
/// and the namespace goes once none is left.
pub fn collect_namespaces(st: &mut ApiState) {
    let terminating: Vec<String> = st
        .namespaces
        .iter()
        .filter(|n| n["status"]["phase"] == "Terminating")
        .filter_map(|n| n["metadata"]["name"].as_str().map(String::from))
        .collect();
    for ns in terminating {
        let keys: Vec<String> = st
            .pods
            .iter()
            .filter(|p| p["metadata"]["namespace"] == ns.as_str())
            .map(pod_key)
            .collect();
        for k in &keys {
            let _ = delete_pod(st, k, &Value::Null);
        }
        if !st
            .pods
            .iter()
            .any(|p| p["metadata"]["namespace"] == ns.as_str())
        {
            st.namespaces
                .retain(|n| n["metadata"]["name"] != ns.as_str());
        }
    }
}

fn pod_log(st: &ApiState, key: &str) -> (u16, Reply) {
    let Some(p) = st.pods.iter().find(|p| pod_key(p) == key) else {
        return not_found("pods", key.split('/').nth(1).unwrap_or(""));
    };
    let container = p["spec"]["containers"][0]["name"].as_str().unwrap_or("");
    let started = p["status"]["containerStatuses"]
        .as_array()
        .and_then(|c| c.first())
        .is_some_and(|c| c["state"]["running"].is_object() || c["state"]["terminated"].is_object());
    let name = &p["metadata"]["name"];
    if !started {
        return bad_request(&format!(
            "container \"{container}\" in pod {name} is waiting to start: ContainerCreating"
        ));
    }
    let text = st
        .pod_logs
        .get(key)
        .and_then(|f| std::fs::read(f).ok())
        .unwrap_or_default();
    (200, Reply::Raw("text/plain".into(), text))
}

/// Namespaces, Pods and the log subresource; `None` for other paths.
pub fn answer(st: &mut ApiState, req: &Seen) -> Option<(u16, Reply)> {
    let path = req.path.as_str();
    let m = req.method.as_str();
    if path == "/api/v1/pods" && m == "GET" {
        return Some(list_pods(st, None, &req.query));
    }
    if path == "/api/v1/namespaces" {
        return Some(match m {
            "POST" => {
                let name = req.body["metadata"]["name"]
                    .as_str()
                    .unwrap_or("")
                    .to_string();
                if st
                    .namespaces
                    .iter()
                    .any(|n| n["metadata"]["name"] == name.as_str())
                {
                    (
                        409,
                        Reply::Json(status_body(
                            409,
                            "AlreadyExists",
                            &format!("namespaces \"{name}\" already exists"),
                        )),
                    )
                } else {
                    let ns = namespace_defaults(req.body.clone());
                    st.namespaces.push(ns.clone());
                    (201, Reply::Json(ns))
                }
            }
            _ => (
                200,
                Reply::Json(json!({"kind": "NamespaceList", "apiVersion": "v1",
                                   "metadata": {}, "items": st.namespaces})),
            ),
        });
    }
    let rest = path.strip_prefix("/api/v1/namespaces/")?;
    let parts: Vec<&str> = rest.split('/').collect();
    let ns = parts[0];
    Some(match (m, &parts[1..]) {
        ("GET", []) => match st.namespaces.iter().find(|n| n["metadata"]["name"] == ns) {
            Some(n) => (200, Reply::Json(n.clone())),
            None => not_found("namespaces", ns),
        },
        ("DELETE", []) => {
            match st
                .namespaces
                .iter_mut()
                .find(|n| n["metadata"]["name"] == ns)
            {
                Some(n) => {
                    n["status"]["phase"] = json!("Terminating");
                    n["metadata"]["deletionTimestamp"] = json!(now_rfc3339());
                    (200, Reply::Json(n.clone()))
                }
                None => not_found("namespaces", ns),
            }
        }
        ("GET", ["pods"]) => list_pods(st, Some(ns), &req.query),
        ("POST", ["pods"]) => create_pod(st, ns, &req.body),
        ("GET", ["pods", name]) => match st
            .pods
            .iter()
            .find(|p| pod_key(p) == format!("{ns}/{name}"))
        {
            Some(p) => (200, Reply::Json(p.clone())),
            None => not_found("pods", name),
        },
        ("DELETE", ["pods", name]) => delete_pod(st, &format!("{ns}/{name}"), &req.body),
        ("GET", ["pods", name, "log"]) => pod_log(st, &format!("{ns}/{name}")),
        _ => return None,
    })
}

/// `(namespace, pod, port, path)` of a proxy subresource request.
pub fn proxy_target(path: &str) -> Option<(String, String, Option<u16>, String)> {
    let rest = path.strip_prefix("/api/v1/namespaces/")?;
    let (ns, rest) = rest.split_once("/pods/")?;
    let (pod, rest) = rest.split_once('/')?;
    let rest = rest.strip_prefix("proxy")?;
    if !(rest.is_empty() || rest.starts_with('/')) {
        return None;
    }
    // NAME, NAME:PORT or SCHEME:NAME:PORT
    let parts: Vec<&str> = pod.split(':').collect();
    let (name, port) = match parts[..] {
        [n] => (n, None),
        [n, p] => (n, Some(p.parse().ok()?)),
        ["http", n, p] => (n, Some(p.parse().ok()?)),
        _ => return None,
    };
    let path = if rest.is_empty() { "/" } else { rest };
    Some((ns.to_string(), name.to_string(), port, path.to_string()))
}

/// Forwards a GET to the pod (HTTP/1.1, `Connection: close`) and passes the
/// pod's status, content type and body back.
pub fn proxy(
    state: &Mutex<ApiState>,
    target: &(String, String, Option<u16>, String),
    query: &str,
) -> (u16, Reply) {
    let (ns, name, port, path) = target;
    let (ip, port, dialer) = {
        let st = state.lock().unwrap();
        let Some(p) = st.pods.iter().find(|p| {
            p["metadata"]["namespace"] == ns.as_str() && p["metadata"]["name"] == name.as_str()
        }) else {
            return not_found("pods", name);
        };
        let ip: Option<IpAddr> = p["status"]["podIP"].as_str().and_then(|s| s.parse().ok());
        let port = port.or_else(|| {
            p["spec"]["containers"][0]["ports"][0]["containerPort"]
                .as_u64()
                .and_then(|p| u16::try_from(p).ok())
        });
        (ip, port.unwrap_or(80), st.pod_dialer.clone())
    };
    let unavailable = |msg: String| {
        (
            503,
            Reply::Json(status_body(503, "ServiceUnavailable", &msg)),
        )
    };
    let Some(ip) = ip else {
        return unavailable(format!("pod {name} has no IP"));
    };
    let addr = SocketAddr::new(ip, port);
    let conn = match &dialer {
        Some(d) => d(addr),
        None => TcpStream::connect_timeout(&addr, Duration::from_secs(5)),
    };
    let mut conn = match conn {
        Ok(c) => c,
        Err(e) => {
            return unavailable(format!(
                "error trying to reach service: dial tcp {addr}: {e}"
            ))
        }
    };
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let target = if query.is_empty() {
        path.clone()
    } else {
        format!("{path}?{query}")
    };
    // One write (a server may answer and close once it has the request line);
    // a failed write still leaves its answer to read.
    let request = format!(
        "GET {target} HTTP/1.1\r\nHost: {addr}\r\nAccept: */*\r\nConnection: close\r\n\r\n"
    );
    let _ = conn.write_all(request.as_bytes());
    let mut r = BufReader::new(conn);
    let mut status = String::new();
    if r.read_line(&mut status).unwrap_or(0) == 0 {
        return unavailable("error trying to reach service: no answer".into());
    }
    let code: u16 = status
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(502);
    let mut content_type = "text/plain".to_string();
    let mut length = None;
    let mut chunked = false;
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            match k.trim().to_ascii_lowercase().as_str() {
                "content-type" => content_type = v.trim().to_string(),
                "content-length" => length = v.trim().parse::<usize>().ok(),
                "transfer-encoding" => chunked = v.trim().eq_ignore_ascii_case("chunked"),
                _ => {}
            }
        }
    }
    let mut body = Vec::new();
    if chunked {
        loop {
            let mut size = String::new();
            if r.read_line(&mut size).unwrap_or(0) == 0 {
                break;
            }
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            let mut chunk = vec![0; n + 2];
            if n == 0 || r.read_exact(&mut chunk).is_err() {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    } else if let Some(n) = length {
        body.resize(n, 0);
        if r.read_exact(&mut body).is_err() {
            return unavailable("error trying to reach service: short body".into());
        }
    } else {
        let _ = r.read_to_end(&mut body);
    }
    (code, Reply::Raw(content_type, body))
}
