//! The Kubernetes node directory against a fake API server: kube-rs's
//! `Client` runs over a `tower_test` mock service, and the fake answers each
//! request with a recorded API response from `tests/fixtures/kube/`
//! (written as the API server answers: `NodeList`, `Node`, `Status`).
//! Each test checks the requests the client sends, too.

use std::net::IpAddr;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use flowlane_nodes::kubernetes::{list_cluster_view, publish_rdma_lane, FIELD_MANAGER};
use flowlane_nodes::node_object::PublishedLane;
use flowlane_nodes::TopologyError;
use flowlane_nodes::{KubeNodeDirectory, NodeDirectory, RdmaLane};
use flowlane_rdma_discovery::LinkLayer;
use http::{Method, Request, Response, StatusCode};
use kube::client::Body;
use kube::Client;
use tower_test::mock;

/// A recorded API response.
fn fixture(name: &str) -> Vec<u8> {
    let path = format!("{}/tests/fixtures/kube/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// What the fake API server saw.
#[derive(Debug)]
struct Seen {
    method: Method,
    path: String,
    query: String,
    content_type: Option<String>,
    body: serde_json::Value,
}

/// A client whose API server answers the i-th request with `answers[i]`
/// (status, fixture file) and reports the requests it received.
fn fake_api(
    answers: Vec<(StatusCode, &'static str)>,
) -> (Client, tokio::task::JoinHandle<Vec<Seen>>) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let server = tokio::spawn(async move {
        let mut handle = pin!(handle);
        let mut seen = Vec::new();
        for (status, file) in answers {
            let (req, send) = handle
                .next_request()
                .await
                .expect("the client sent fewer requests than expected");
            let (parts, body) = req.into_parts();
            let body = body.collect_bytes().await.unwrap();
            seen.push(Seen {
                method: parts.method,
                path: parts.uri.path().to_string(),
                query: parts.uri.query().unwrap_or("").to_string(),
                content_type: parts
                    .headers
                    .get(http::header::CONTENT_TYPE)
                    .map(|v| v.to_str().unwrap().to_string()),
                body: if body.is_empty() {
                    serde_json::Value::Null
                } else {
                    serde_json::from_slice(&body).unwrap()
                },
            });
            send.send_response(
                Response::builder()
                    .status(status)
                    .header(http::header::CONTENT_TYPE, "application/json")
                    .body(Body::from(fixture(file)))
                    .unwrap(),
            );
        }
        seen
    });
    (Client::new(service, "default"), server)
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[tokio::test]
async fn node_list_becomes_the_cluster_view() {
    let (client, server) = fake_api(vec![(StatusCode::OK, "nodelist.json")]);
    let dir = KubeNodeDirectory::connect(client).await.unwrap();
    let seen = server.await.unwrap();
    assert_eq!(seen[0].method, Method::GET);
    assert_eq!(seen[0].path, "/api/v1/nodes");
    assert!(
        seen[0].query.contains("resourceVersion=0"),
        "served from the watch cache: {}",
        seen[0].query
    );

    let view = dir.view().unwrap();
    let names: Vec<&str> = view.nodes().iter().map(|n| n.name.as_str()).collect();
    assert_eq!(
        names,
        vec!["gpu-a1", "gpu-a2", "cpu-b1"],
        "gpu-new has no pod CIDR yet and is left out"
    );
    assert_eq!(view.owner_of(ip("10.244.1.9")).unwrap().name, "gpu-a1");
    assert_eq!(
        view.owner_of(ip("fd00:10:244:1::9")).unwrap().name,
        "gpu-a1"
    );
    assert_eq!(view.owner_of(ip("10.244.2.17")).unwrap().name, "gpu-a2");
    assert_eq!(view.owner_of(ip("10.244.7.3")).unwrap().name, "cpu-b1");
    assert!(view.owner_of(ip("10.244.3.3")).is_none());
    let a1 = view.node("gpu-a1").unwrap();
    assert_eq!(a1.underlay, ip("172.16.0.11"));
    assert_eq!(a1.rdma.as_ref().unwrap().device, "mlx5_0");
    assert!(view.node("cpu-b1").unwrap().rdma.is_none());
    assert!(view.rdma_between("gpu-a1", "gpu-a2"));
    assert!(!view.rdma_between("gpu-a1", "cpu-b1"));
    assert!(
        Arc::ptr_eq(&view, &dir.view().unwrap()),
        "view() hands out the cached snapshot"
    );
}

#[tokio::test]
async fn refresh_picks_up_a_joined_node_and_keeps_the_view_on_errors() {
    let (client, server) = fake_api(vec![
        (StatusCode::OK, "nodelist.json"),
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            "status-internal-error.json",
        ),
        (StatusCode::OK, "nodelist-after-join.json"),
    ]);
    let dir = KubeNodeDirectory::connect(client).await.unwrap();
    let first = dir.view().unwrap();

    let err = dir.refresh().await.unwrap_err();
    assert!(matches!(err, TopologyError::Kubernetes(_)), "{err:?}");
    assert!(err.to_string().contains("etcdserver"), "{err}");
    assert!(
        Arc::ptr_eq(&first, &dir.view().unwrap()),
        "a failed refresh keeps the last good snapshot"
    );

    // The periodic refresher does the third list.
    let task = dir.spawn_refresh(Duration::from_millis(10));
    let seen = server.await.unwrap();
    assert_eq!(seen.len(), 3);
    let mut joined = None;
    for _ in 0..500 {
        let v = dir.view().unwrap();
        if v.node("gpu-new").is_some() {
            joined = Some(v);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let view = joined.expect("the refresher swapped in the new node table");
    assert_eq!(view.owner_of(ip("10.244.3.8")).unwrap().name, "gpu-new");
    assert!(view.rdma_between("gpu-new", "gpu-a1"));
    task.abort();
}

#[tokio::test]
async fn forbidden_list_is_a_clear_error() {
    let (client, server) = fake_api(vec![(StatusCode::FORBIDDEN, "status-forbidden.json")]);
    let err = match KubeNodeDirectory::connect(client).await {
        Ok(_) => panic!("a 403 must not give a directory"),
        Err(e) => e,
    };
    server.await.unwrap();
    let msg = err.to_string();
    assert!(msg.contains("listing nodes"), "{msg}");
    assert!(msg.contains("forbidden"), "{msg}");
    assert!(msg.contains("RBAC"), "says what to fix: {msg}");
    assert!(msg.contains("(403 Forbidden)"), "{msg}");

    let (client, server) = fake_api(vec![(StatusCode::FORBIDDEN, "status-forbidden.json")]);
    let err = list_cluster_view(&client).await.unwrap_err();
    server.await.unwrap();
    assert!(matches!(err, TopologyError::Kubernetes(_)));
}

#[tokio::test]
async fn publishing_patches_the_own_node_annotation() {
    let lane = RdmaLane {
        device: "mlx5_1".into(),
        port: 1,
        gid_index: 5,
        gid: "::ffff:172.16.0.12".parse().unwrap(),
        link_layer: LinkLayer::Ethernet,
        active_mtu: Some(4096),
    };
    let (client, server) = fake_api(vec![
        (StatusCode::OK, "node-patched.json"),
        (StatusCode::OK, "node-patched.json"),
        (StatusCode::FORBIDDEN, "status-forbidden.json"),
    ]);
    publish_rdma_lane(&client, "gpu-a2", Some(&lane), Some(7471))
        .await
        .unwrap();
    publish_rdma_lane(&client, "gpu-a2", None, Some(7471))
        .await
        .unwrap();
    let err = publish_rdma_lane(&client, "gpu-a2", Some(&lane), None)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("gpu-a2"), "{err}");
    let seen = server.await.unwrap();

    let set = &seen[0];
    assert_eq!(set.method, Method::PATCH);
    assert_eq!(set.path, "/api/v1/nodes/gpu-a2");
    assert_eq!(
        set.content_type.as_deref(),
        Some("application/merge-patch+json")
    );
    assert!(
        set.query.contains(&format!("fieldManager={FIELD_MANAGER}")),
        "{}",
        set.query
    );
    let published = set.body["metadata"]["annotations"]["flowlane.io/rdma-lane"]
        .as_str()
        .expect("the annotation is a JSON string");
    let back: RdmaLane = serde_json::from_str(published).unwrap();
    assert_eq!(back, lane, "peers read back exactly what was published");
    let back = PublishedLane::from_annotation(published).unwrap();
    assert_eq!(
        back.lane_port,
        Some(7471),
        "the lane port travels with the lane"
    );
    assert_eq!(
        set.body.as_object().unwrap().len(),
        1,
        "only metadata is patched: {}",
        set.body
    );

    let clear = &seen[1];
    assert_eq!(clear.method, Method::PATCH);
    assert!(
        clear.body["metadata"]["annotations"]["flowlane.io/rdma-lane"].is_null(),
        "null removes the annotation in a merge patch: {}",
        clear.body
    );
}
