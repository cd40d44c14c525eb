//! The admin listener's handler: the replica API (`/admin/replicas…`), `/metrics` and `/health`,
//! behind an optional bearer token.
//!
//! The admin API changes where traffic goes (drain, add an arbitrary upstream URL, remove), so it
//! is never served on the serving port: it has its own listener, loopback by default, and a
//! token when it is exposed (the router refuses to start with a non-loopback admin host and no
//! token). `/metrics` lives here too: it names every replica, its load and health, which is
//! operator information, and keeping the serving port to the OpenAI surface means nothing on it
//! reveals or changes the fleet.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use policies::ReplicaId;

use crate::body::RouterBody;
use crate::config::ReplicaSpec;
use crate::service::{error_response, health, json_response};
use crate::state::{Replica, Shared, start_replica_tasks};

/// The admin listener's access rule: an optional bearer token.
#[derive(Debug, Clone, Default)]
pub struct AdminAuth {
    token: Option<Vec<u8>>,
}

impl AdminAuth {
    /// Requires `Authorization: Bearer <token>` when `token` is given.
    pub fn new(token: Option<&str>) -> Self {
        AdminAuth {
            token: token.map(|t| t.as_bytes().to_vec()),
        }
    }

    /// Whether the request's `Authorization` header carries the token (always true without one).
    pub fn allows(&self, headers: &http::HeaderMap) -> bool {
        let Some(token) = &self.token else {
            return true;
        };
        headers
            .get_all(header::AUTHORIZATION)
            .iter()
            .filter_map(|v| bearer(v.as_bytes()))
            .any(|given| constant_time_eq(given, token))
    }
}

/// The credentials of a `Bearer` authorization value (scheme case-insensitive, RFC 6750).
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    Some(rest.trim_ascii())
}

/// The constant-time compare, shared with the API keys ([`crate::keys`]).
pub use crate::keys::constant_time_eq;

/// Entry point for every request on the admin listener.
pub async fn handle(
    shared: Arc<Shared>,
    auth: Arc<AdminAuth>,
    req: Request<Incoming>,
) -> Result<Response<RouterBody>, std::convert::Infallible> {
    if !auth.allows(req.headers()) {
        shared
            .metrics
            .admin_unauthorized
            .fetch_add(1, Ordering::Relaxed);
        let mut r = error_response(
            StatusCode::UNAUTHORIZED,
            "the admin API needs `Authorization: Bearer <token>` (the router's --admin-token-file)",
            None,
        );
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"kvroute-admin\""),
        );
        return Ok(r);
    }
    let path = req.uri().path();
    Ok(match (req.method(), path) {
        (&Method::GET, "/metrics") => metrics(&shared),
        (&Method::GET, "/health") => health(&shared),
        (_, "/metrics" | "/health") => error_response(
            StatusCode::METHOD_NOT_ALLOWED,
            &format!("method {} not allowed on {path}", req.method()),
            None,
        ),
        (_, p) if p == "/admin/replicas" || p.starts_with("/admin/replicas/") => {
            replicas_api(&shared, req).await
        }
        (_, p) => error_response(StatusCode::NOT_FOUND, &format!("no route for {p}"), None),
    })
}

/// The Prometheus exposition (router-wide counters, then per-replica series).
fn metrics(shared: &Shared) -> Response<RouterBody> {
    let mut out = String::with_capacity(4096);
    shared.metrics.render_into(&mut out, &shared.policy_name);
    shared.sharing.render_into(&mut out);
    if let Some(keys) = shared.keys() {
        keys.render_into(&mut out);
    }
    let reps = shared.replicas();
    let gauge =
        |out: &mut String, name: &str, help: &str, kind: &str, f: &dyn Fn(&Replica) -> u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for r in &reps {
                let _ = writeln!(out, "{name}{{replica=\"{}\"}} {}", r.id, f(r));
            }
        };
    gauge(
        &mut out,
        "kvroute_router_outstanding",
        "Requests in flight per replica.",
        "gauge",
        &|r| u64::from(r.outstanding.load(Ordering::Relaxed)),
    );
    gauge(
        &mut out,
        "kvroute_router_peer_outstanding",
        "Requests in flight per replica as the peer routers last reported them (--share-loads).",
        "gauge",
        &|r| u64::from(r.peer_outstanding.load(Ordering::Relaxed)),
    );
    gauge(
        &mut out,
        "kvroute_router_replica_healthy",
        "1 when the replica passes health checks.",
        "gauge",
        &|r| u64::from(r.healthy.load(Ordering::Relaxed)),
    );
    gauge(
        &mut out,
        "kvroute_router_replica_marked_down_total",
        "Times health (probes and request failures, with hysteresis) marked the replica down.",
        "counter",
        &|r| r.marked_down.load(Ordering::Relaxed),
    );
    gauge(
        &mut out,
        "kvroute_router_replica_marked_up_total",
        "Times passing probes marked the replica up again.",
        "counter",
        &|r| r.marked_up.load(Ordering::Relaxed),
    );
    gauge(
        &mut out,
        "kvroute_router_health_probes_ok_total",
        "Health probes that passed.",
        "counter",
        &|r| r.probes_ok.load(Ordering::Relaxed),
    );
    gauge(
        &mut out,
        "kvroute_router_health_probes_failed_total",
        "Health probes that failed (status, connection, or timeout).",
        "counter",
        &|r| r.probes_failed.load(Ordering::Relaxed),
    );
    gauge(
        &mut out,
        "kvroute_router_replica_draining",
        "1 while the replica is draining.",
        "gauge",
        &|r| u64::from(r.draining.load(Ordering::Relaxed)),
    );
    gauge(
        &mut out,
        "kvroute_router_served_total",
        "Requests served per replica.",
        "counter",
        &|r| r.served.load(Ordering::Relaxed),
    );
    gauge(
        &mut out,
        "kvroute_router_upstream_errors_total",
        "Failed upstream attempts and mid-stream failures.",
        "counter",
        &|r| r.upstream_errors.load(Ordering::Relaxed),
    );
    gauge(
        &mut out,
        "kvroute_router_kv_event_batches_total",
        "KV event batches applied.",
        "counter",
        &|r| r.events.batches.load(Ordering::Relaxed),
    );
    gauge(
        &mut out,
        "kvroute_router_kv_event_gaps_total",
        "KV event sequence gaps detected.",
        "counter",
        &|r| r.events.gaps.load(Ordering::Relaxed),
    );
    gauge(
        &mut out,
        "kvroute_router_kv_event_gaps_unrepaired_total",
        "Gaps not repaired by replay (replica treated as cleared).",
        "counter",
        &|r| r.events.gaps_unrepaired.load(Ordering::Relaxed),
    );
    gauge(
        &mut out,
        "kvroute_router_kv_event_decode_errors_total",
        "KV event batches that failed to decode.",
        "counter",
        &|r| r.events.decode_errors.load(Ordering::Relaxed),
    );
    gauge(
        &mut out,
        "kvroute_router_kv_event_other_tier_total",
        "KV events about a storage tier other than the GPU (skipped).",
        "counter",
        &|r| r.events.other_tier_events.load(Ordering::Relaxed),
    );
    gauge(
        &mut out,
        "kvroute_router_kv_event_restarts_total",
        "Engine restarts seen on the KV event stream (sequence back, or publisher connection lost): the replica's residency was dropped.",
        "counter",
        &|r| r.events.restarts.load(Ordering::Relaxed),
    );
    gauge(
        &mut out,
        "kvroute_router_kv_event_cleared_total",
        "AllBlocksCleared events from the engine (each drops the replica's residency).",
        "counter",
        &|r| r.events.cleared.load(Ordering::Relaxed),
    );
    let st = shared.rows.stats();
    let _ = writeln!(
        out,
        "# HELP kvroute_router_rows_written_total Router rows written.\n# TYPE kvroute_router_rows_written_total counter\nkvroute_router_rows_written_total {}\n# HELP kvroute_router_rows_dropped_total Router rows that could not be queued or written.\n# TYPE kvroute_router_rows_dropped_total counter\nkvroute_router_rows_dropped_total {}\n# HELP kvroute_router_rows_io_errors_total Failed flushes of router.csv.\n# TYPE kvroute_router_rows_io_errors_total counter\nkvroute_router_rows_io_errors_total {}",
        st.written.load(Ordering::Relaxed),
        st.dropped.load(Ordering::Relaxed),
        st.io_errors.load(Ordering::Relaxed)
    );
    let mut r = Response::new(RouterBody::full(out));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    r
}

/// One replica as the admin API lists it.
pub fn replica_json(r: &Replica) -> serde_json::Value {
    serde_json::json!({
        "id": r.id,
        "url": r.url,
        "kv_events": r.kv_events,
        "kv_replay": r.kv_replay,
        "healthy": r.healthy.load(Ordering::Relaxed),
        "marked_down": r.marked_down.load(Ordering::Relaxed),
        "draining": r.draining.load(Ordering::Relaxed),
        "outstanding": r.outstanding.load(Ordering::Relaxed),
        "peer_outstanding": r.peer_outstanding.load(Ordering::Relaxed),
        "served": r.served.load(Ordering::Relaxed),
        "upstream_errors": r.upstream_errors.load(Ordering::Relaxed),
        "kv_event_gaps": r.events.gaps.load(Ordering::Relaxed),
    })
}

async fn replicas_api(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<RouterBody> {
    let path = req.uri().path().to_string();
    let rest = path.strip_prefix("/admin/replicas").unwrap_or("");
    let segs: Vec<&str> = rest.split('/').filter(|s| !s.is_empty()).collect();
    let method = req.method().clone();
    match (&method, segs.as_slice()) {
        (&Method::GET, []) => {
            let list: Vec<serde_json::Value> =
                shared.replicas().iter().map(|r| replica_json(r)).collect();
            json_response(StatusCode::OK, serde_json::Value::Array(list).to_string())
        }
        (&Method::POST, []) => {
            let body = match Limited::new(req.into_body(), 64 << 10).collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => {
                    return error_response(
                        StatusCode::BAD_REQUEST,
                        &format!("failed to read body: {e}"),
                        None,
                    );
                }
            };
            let spec: ReplicaSpec = match serde_json::from_slice(&body) {
                Ok(s) => s,
                Err(e) => {
                    return error_response(
                        StatusCode::BAD_REQUEST,
                        &format!("invalid replica: {e}"),
                        None,
                    );
                }
            };
            let others = shared.replicas();
            match shared.add_replica(&spec) {
                Ok(r) => {
                    start_replica_tasks(shared, &r).await;
                    if let Err(e) = admitted_by_parity(shared, &r, &others).await {
                        r.stop_tasks();
                        shared.remove_replica(r.id);
                        return error_response(
                            StatusCode::UNPROCESSABLE_ENTITY,
                            &e.to_string(),
                            Some("url"),
                        );
                    }
                    json_response(StatusCode::CREATED, replica_json(&r).to_string())
                }
                Err(e) => error_response(StatusCode::BAD_REQUEST, &e, Some("url")),
            }
        }
        (&Method::DELETE, [id]) => match id
            .parse::<ReplicaId>()
            .ok()
            .and_then(|id| shared.remove_replica(id))
        {
            Some(r) => json_response(StatusCode::OK, replica_json(&r).to_string()),
            None => error_response(StatusCode::NOT_FOUND, &format!("no replica {id}"), None),
        },
        (&Method::POST, [id, action @ ("drain" | "undrain")]) => {
            match id
                .parse::<ReplicaId>()
                .ok()
                .and_then(|id| shared.replica(id))
            {
                Some(r) => {
                    r.draining.store(*action == "drain", Ordering::Relaxed);
                    json_response(StatusCode::OK, replica_json(&r).to_string())
                }
                None => error_response(StatusCode::NOT_FOUND, &format!("no replica {id}"), None),
            }
        }
        (_, [] | [_] | [_, "drain" | "undrain"]) => error_response(
            StatusCode::METHOD_NOT_ALLOWED,
            &format!("method {method} not allowed on {path}"),
            None,
        ),
        _ => error_response(StatusCode::NOT_FOUND, &format!("no route for {path}"), None),
    }
}

/// An added replica joins only if its token parity holds, with exact keys and the check on
/// ([`crate::parity`]): its own probes, and its `/tokenize` ids against a replica already
/// serving.
async fn admitted_by_parity(
    shared: &Arc<Shared>,
    added: &Arc<crate::state::Replica>,
    others: &[Arc<crate::state::Replica>],
) -> Result<(), crate::parity::ParityError> {
    if shared.keying != policies::Keying::ExactTokens || !shared.settings.token_parity_check {
        return Ok(());
    }
    let reference = crate::parity::reference_of(shared, others).await?;
    crate::parity::check_fleet(shared, std::slice::from_ref(added), reference)
        .await
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens() {
        let auth = AdminAuth::new(Some("tok"));
        let with = |v: &str| {
            let mut h = http::HeaderMap::new();
            h.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
            h
        };
        assert!(auth.allows(&with("Bearer tok")));
        assert!(auth.allows(&with("bearer tok")));
        assert!(auth.allows(&with("Bearer  tok ")));
        assert!(!auth.allows(&with("Bearer to")));
        assert!(!auth.allows(&with("Bearer tokk")));
        assert!(!auth.allows(&with("Basic tok")));
        assert!(!auth.allows(&with("tok")));
        assert!(!auth.allows(&http::HeaderMap::new()));
        assert!(AdminAuth::new(None).allows(&http::HeaderMap::new()));
    }
}
