//! HTTPS front: TLS (rustls) then HTTP/1.1 (hyper). Routes:
//! - `POST /mutate/namespace`: pods of namespaces labelled `flowlane.io/inject=enabled`
//! - `POST /mutate/pod`: pods of every other namespace (annotation opt-in only)
//! - `GET /healthz`
//!
//! A body that is not an AdmissionReview gets 400 with the reason; the server never
//! panics on input and one bad connection never affects another.

use crate::inject::{self, Scope};
use crate::tls::CertFiles;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// The API server sends at most 3 MiB objects; a review wraps one pod.
const MAX_BODY: usize = 4 << 20;
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection that sends no request head within this is closed (the API server
/// sends its request at once; anything slower is not the API server).
const HEADER_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves until the listener fails; each connection on its own task.
pub async fn serve(listener: TcpListener, certs: Arc<CertFiles>) -> std::io::Result<()> {
    loop {
        let (tcp, peer) = listener.accept().await?;
        let acceptor = tokio_rustls::TlsAcceptor::from(certs.config());
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => return tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                Err(_) => return tracing::debug!(%peer, "TLS handshake timed out"),
            };
            let io = hyper_util::rt::TokioIo::new(tls);
            let service = hyper::service::service_fn(|req| async {
                Ok::<_, hyper::Error>(handle(req).await)
            });
            let served = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(io, service)
                .await;
            if let Err(e) = served {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
}

async fn handle(req: Request<Incoming>) -> Response<Full<Bytes>> {
    let scope = match (req.method(), req.uri().path()) {
        (&Method::GET, "/healthz") => return text(StatusCode::OK, "ok\n".into()),
        (&Method::POST, "/mutate/namespace") => Scope::NamespaceOptIn,
        (&Method::POST, "/mutate/pod") => Scope::PodOptIn,
        (_, "/mutate/namespace" | "/mutate/pod") => {
            return text(
                StatusCode::METHOD_NOT_ALLOWED,
                "POST an AdmissionReview\n".into(),
            )
        }
        _ => return text(StatusCode::NOT_FOUND, "not found\n".into()),
    };
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(body) => body.to_bytes(),
        Err(e) => {
            return text(
                StatusCode::BAD_REQUEST,
                format!("cannot read the body: {e}\n"),
            )
        }
    };
    match inject::review(&body, scope) {
        Ok((answer, decision)) => {
            let request = serde_json::from_slice::<serde_json::Value>(&body).unwrap_or_default();
            let request = &request["request"];
            tracing::info!(
                namespace = request["namespace"].as_str().unwrap_or(""),
                pod = request["object"]["metadata"]["name"]
                    .as_str()
                    .or(request["object"]["metadata"]["generateName"].as_str())
                    .unwrap_or(""),
                ?scope,
                reason = %decision.reason,
                "admission review"
            );
            let mut response = Response::new(Full::new(Bytes::from(answer.to_string())));
            response.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("application/json"),
            );
            response
        }
        Err(e) => {
            tracing::warn!(error = %e, "bad admission review");
            text(StatusCode::BAD_REQUEST, format!("{e}\n"))
        }
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
}
