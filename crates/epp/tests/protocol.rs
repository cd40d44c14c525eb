//! The endpoint-picker protocol at the gRPC level, without Envoy: a tonic client plays the
//! proxy's side of `ext_proc` message by message, so what Envoy's configuration in the other
//! tests never sends is covered too — the subset hint, request trailers, a header-only request,
//! a body split in chunks, the 400 and 413 refusals, a served endpoint other than the pick.

use std::path::Path;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse, body_mutation,
    processing_request, processing_response,
};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
use epp::{Epp, EppConfig};

const WAIT: Duration = Duration::from_secs(10);

/// Replica URLs nobody serves (the picker only decides here; health probes are far apart).
const REPLICAS: [&str; 3] = [
    "http://127.0.0.1:1001",
    "http://127.0.0.1:1002",
    "http://127.0.0.1:1003",
];

async fn start(dir: &Path, policy: &str, max_body_bytes: usize) -> Epp {
    let mut p = policies::PolicySpec::named(policy);
    p.seed = 7;
    let mut rc = proxy::RouterConfig::new(
        REPLICAS
            .iter()
            .map(|u| proxy::ReplicaSpec::new(*u))
            .collect(),
        p,
    );
    rc.rows = Some(dir.join("router.csv"));
    rc.health_interval_ms = 600_000;
    rc.max_body_bytes = max_body_bytes;
    Epp::start(EppConfig::new(rc)).await.expect("epp starts")
}

fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> processing_request::Request {
    processing_request::Request::RequestHeaders(HttpHeaders {
        headers: Some(HeaderMap {
            headers: pairs
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: (*k).into(),
                    raw_value: v.as_bytes().to_vec(),
                    ..HeaderValue::default()
                })
                .collect(),
        }),
        end_of_stream,
        ..HttpHeaders::default()
    })
}

fn body(bytes: &[u8], end_of_stream: bool) -> processing_request::Request {
    processing_request::Request::RequestBody(HttpBody {
        body: bytes.to_vec(),
        end_of_stream,
        ..HttpBody::default()
    })
}

fn msg(r: processing_request::Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(r),
        ..ProcessingRequest::default()
    }
}

fn with_metadata(mut m: ProcessingRequest, ns: &str, key: &str, v: Kind) -> ProcessingRequest {
    let mut inner = Struct::default();
    inner.fields.insert(key.into(), Value { kind: Some(v) });
    let mut md = Metadata::default();
    md.filter_metadata.insert(ns.into(), inner);
    m.metadata_context = Some(md);
    m
}

/// One exchange: sends `msgs`, reads `expect` answers.
async fn exchange(
    epp: &Epp,
    msgs: Vec<ProcessingRequest>,
    expect: usize,
) -> Vec<ProcessingResponse> {
    let mut client = ExternalProcessorClient::connect(format!("http://{}", epp.local_addr()))
        .await
        .expect("connect");
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    for m in msgs {
        tx.send(m).await.unwrap();
    }
    let mut stream = client
        .process(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("process")
        .into_inner();
    let mut out = Vec::new();
    while out.len() < expect {
        let next = tokio::time::timeout(WAIT, stream.message())
            .await
            .expect("answer in time")
            .expect("stream ok");
        match next {
            Some(r) => out.push(r),
            None => break,
        }
    }
    drop(tx);
    out
}

fn set_header(r: &ProcessingResponse, name: &str) -> Option<String> {
    let common = match r.response.as_ref()? {
        processing_response::Response::RequestHeaders(h)
        | processing_response::Response::ResponseHeaders(h) => h.response.as_ref()?,
        _ => return None,
    };
    common
        .header_mutation
        .as_ref()?
        .set_headers
        .iter()
        .find_map(|o| {
            let h = o.header.as_ref()?;
            (h.key == name).then(|| String::from_utf8_lossy(&h.raw_value).into_owned())
        })
}

fn streamed_body(r: &ProcessingResponse) -> (Vec<u8>, bool) {
    let Some(
        processing_response::Response::RequestBody(b)
        | processing_response::Response::ResponseBody(b),
    ) = &r.response
    else {
        panic!("not a body answer: {r:?}");
    };
    match b
        .response
        .as_ref()
        .and_then(|c| c.body_mutation.as_ref())
        .and_then(|m| m.mutation.as_ref())
    {
        Some(body_mutation::Mutation::StreamedResponse(s)) => (s.body.clone(), s.end_of_stream),
        other => panic!("not streamed: {other:?}"),
    }
}

fn immediate_status(r: &ProcessingResponse) -> i32 {
    match &r.response {
        Some(processing_response::Response::ImmediateResponse(i)) => {
            i.status.as_ref().unwrap().code
        }
        other => panic!("not immediate: {other:?}"),
    }
}

fn chat(user: &str) -> String {
    serde_json::json!({"model":"m","messages":[{"role":"user","content":user}],"stream":true})
        .to_string()
}

/// Waits until `n` rows were written, shuts the picker down (flushing them) and reads them.
async fn rows(epp: Epp, dir: &Path, n: u64) -> Vec<std::collections::HashMap<String, String>> {
    let deadline = Instant::now() + WAIT;
    while epp
        .shared()
        .rows
        .stats()
        .written
        .load(std::sync::atomic::Ordering::Relaxed)
        < n
    {
        assert!(Instant::now() < deadline, "rows not written");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    epp.shutdown(Duration::from_secs(1)).await;
    let mut rd = csv::Reader::from_path(dir.join("router.csv")).unwrap();
    let cols: Vec<String> = rd.headers().unwrap().iter().map(str::to_string).collect();
    rd.records()
        .map(|r| {
            cols.iter()
                .cloned()
                .zip(r.unwrap().iter().map(str::to_string))
                .collect()
        })
        .collect()
}

const POST_CHAT: [(&str, &str); 3] = [
    (":method", "POST"),
    (":path", "/v1/chat/completions"),
    ("x-session-id", "s1"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_come_back_in_order_after_the_pick_and_the_served_endpoint_is_read_back() {
    let dir = test_support::temp_dir("epp-protocol");
    let epp = start(dir.path(), "session-affinity", 1 << 20).await;
    let text = chat("where is my parcel?");
    let (a, b) = text.as_bytes().split_at(10);
    let (b, c) = b.split_at(7);
    let out = exchange(
        &epp,
        vec![
            msg(headers(&POST_CHAT, false)),
            msg(body(a, false)),
            msg(body(b, false)),
            msg(body(c, true)),
        ],
        4,
    )
    .await;
    assert_eq!(out.len(), 4, "{out:?}");
    let list = set_header(&out[0], "x-gateway-destination-endpoint").expect("destination");
    let endpoints: Vec<&str> = list.split(',').collect();
    assert_eq!(endpoints.len(), 3, "picked + 2 fallbacks: {list}");
    assert_eq!(
        set_header(&out[0], "content-length").as_deref(),
        Some(text.len().to_string().as_str())
    );
    let lb = &out[0].dynamic_metadata.as_ref().unwrap().fields["envoy.lb"];
    let Some(Kind::StructValue(lb)) = &lb.kind else {
        panic!("{lb:?}")
    };
    assert_eq!(
        lb.fields["x-gateway-destination-endpoint"].kind,
        Some(Kind::StringValue(list.clone())),
        "header and metadata agree"
    );
    let chunks: Vec<(Vec<u8>, bool)> = out[1..].iter().map(streamed_body).collect();
    assert_eq!(chunks[0], (a.to_vec(), false));
    assert_eq!(chunks[1], (b.to_vec(), false));
    assert_eq!(chunks[2], (c.to_vec(), true));

    // The response, served by the last fallback: the row follows what the proxy reports.
    let served = endpoints[2].to_string();
    let picked_id = REPLICAS
        .iter()
        .position(|u| u.ends_with(endpoints[0]))
        .unwrap();
    let served_id = REPLICAS.iter().position(|u| u.ends_with(&served)).unwrap();
    let sse = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\ndata: [DONE]\n\n";
    let resp_headers = with_metadata(
        msg(processing_request::Request::ResponseHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    HeaderValue {
                        key: ":status".into(),
                        raw_value: b"200".to_vec(),
                        ..HeaderValue::default()
                    },
                    HeaderValue {
                        key: "content-type".into(),
                        raw_value: b"text/event-stream".to_vec(),
                        ..HeaderValue::default()
                    },
                ],
            }),
            ..HttpHeaders::default()
        })),
        "envoy.lb",
        "x-gateway-destination-endpoint-served",
        Kind::StringValue(served.clone()),
    );
    let out = exchange(
        &epp,
        vec![
            msg(headers(&POST_CHAT, false)),
            msg(body(text.as_bytes(), true)),
            resp_headers,
            msg(processing_request::Request::ResponseBody(HttpBody {
                body: sse.as_bytes().to_vec(),
                end_of_stream: true,
                ..HttpBody::default()
            })),
        ],
        4,
    )
    .await;
    assert_eq!(
        set_header(&out[2], "x-kvroute-replica").as_deref(),
        Some(served_id.to_string().as_str())
    );
    assert_eq!(streamed_body(&out[3]), (sse.as_bytes().to_vec(), true));
    let picked = epp.shared().replica(picked_id as u32).unwrap();
    assert_eq!(
        picked
            .upstream_errors
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    let r = rows(epp, dir.path(), 2).await;
    let t = |r: &std::collections::HashMap<String, String>| r["arrival_s"].parse::<f64>().unwrap();
    let second = r.iter().max_by(|x, y| t(x).total_cmp(&t(y))).unwrap();
    assert_eq!(second["replica"], served_id.to_string(), "{second:?}");
    assert_ne!(served_id, picked_id);
    assert_eq!(second["attempts"], "2");
    assert_eq!(second["upstream_status"], "200");
    assert_eq!(second["cached_tokens"], "8");
    assert_eq!(second["prompt_tokens"], "12");
    assert_eq!(second["session_id"], "s1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subset_trailers_header_only_and_refusals() {
    let dir = test_support::temp_dir("epp-protocol");
    let epp = start(dir.path(), "round-robin", 256).await;
    let only = REPLICAS[2].trim_start_matches("http://");

    // The proxy's subset: the pick and the fallbacks stay inside it.
    let subset = Kind::ListValue(ListValue {
        values: vec![Value {
            kind: Some(Kind::StringValue(only.into())),
        }],
    });
    for _ in 0..3 {
        let out = exchange(
            &epp,
            vec![
                with_metadata(
                    msg(headers(&POST_CHAT, false)),
                    "envoy.lb.subset_hint",
                    "x-gateway-destination-endpoint-subset",
                    subset.clone(),
                ),
                msg(body(chat("hi").as_bytes(), true)),
            ],
            2,
        )
        .await;
        assert_eq!(
            set_header(&out[0], "x-gateway-destination-endpoint").as_deref(),
            Some(only)
        );
    }

    // Trailers after the body: the last chunk does not end the stream, the trailers answer does.
    let out = exchange(
        &epp,
        vec![
            msg(headers(&POST_CHAT, false)),
            msg(body(chat("trailers").as_bytes(), false)),
            msg(processing_request::Request::RequestTrailers(
                HttpTrailers::default(),
            )),
        ],
        3,
    )
    .await;
    assert!(set_header(&out[0], "x-gateway-destination-endpoint").is_some());
    assert!(!streamed_body(&out[1]).1);
    assert!(matches!(
        out[2].response,
        Some(processing_response::Response::RequestTrailers(_))
    ));

    // A header-only GET: routed, no body answers, no row.
    let out = exchange(
        &epp,
        vec![msg(headers(
            &[(":method", "GET"), (":path", "/v1/models")],
            true,
        ))],
        1,
    )
    .await;
    assert!(set_header(&out[0], "x-gateway-destination-endpoint").is_some());
    assert!(set_header(&out[0], "content-length").is_none());

    // A malformed body: 400; past --max-body-bytes: 413; both with rows.
    let out = exchange(
        &epp,
        vec![
            msg(headers(&POST_CHAT, false)),
            msg(body(b"{not json", true)),
        ],
        1,
    )
    .await;
    assert_eq!(immediate_status(&out[0]), 400);
    let big = vec![b'x'; 300];
    let out = exchange(
        &epp,
        vec![msg(headers(&POST_CHAT, false)), msg(body(&big, false))],
        1,
    )
    .await;
    assert_eq!(immediate_status(&out[0]), 413);
    let r = rows(epp, dir.path(), 6).await;
    let errors: Vec<&str> = r.iter().map(|r| r["error"].as_str()).collect();
    assert!(
        errors.iter().any(|e| e.starts_with("bad_request: ")),
        "{errors:?}"
    );
    assert!(
        errors.iter().any(|e| e.starts_with("too_large: ")),
        "{errors:?}"
    );
    // Four LLM exchanges ended before a response (no proxy answer came): rows all the same.
    assert_eq!(r.len(), 6, "{r:?}");
}
