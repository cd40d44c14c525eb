//! Drivers against the scripted local server: timings, rows, errors, schedules.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use driver::testserver::{MODEL, Reply, ScriptUsage, ScriptedServer, StreamScript};
use driver::{ClientRow, DriverError, ProgressMode, RunConfig, read_rows, run_closed, run_open};
use workload::{ArrivalSpec, Plan, Schedule, Sharing, Sizing, Step, WorkloadSpec};

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

/// A per-test output directory, removed when it drops.
fn out_dir(name: &str) -> test_support::TempDir {
    test_support::temp_dir(&format!("driver-{name}"))
}

fn small_spec(conversations: u32) -> WorkloadSpec {
    WorkloadSpec {
        sizing: Sizing::Conversations(conversations),
        prefix_tokens: 64,
        user_tokens: 16,
        output_tokens: 8,
        turns: 3,
        ..WorkloadSpec::default()
    }
}

fn closed_plan(conversations: u32, users: u32, think_mean_s: f64, requests_per_user: u32) -> Plan {
    Plan::build(
        &small_spec(conversations),
        &ArrivalSpec::Closed {
            users,
            think_mean_s,
            requests_per_user,
        },
    )
    .unwrap()
}

fn config(url: String, out: PathBuf) -> RunConfig {
    RunConfig {
        progress: ProgressMode::Off,
        timeout_s: 10.0,
        ..RunConfig::new(url, out)
    }
}

fn near(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol
}

/// Row values derived from the row's own timestamps must match exactly (up to the 6-decimal
/// rounding of `_s` columns: 1 µs each).
fn assert_consistent(r: &ClientRow) {
    let sent = r.sent_s.unwrap();
    let first = r.first_token_s.unwrap();
    let last = r.last_s.unwrap();
    assert!(
        near(r.ttft_ms.unwrap(), (first - sent) * 1e3, 0.003),
        "{r:?}"
    );
    let out = r.output_tokens.unwrap() as f64;
    assert!(
        near(
            r.tpot_ms.unwrap(),
            (last - first) * 1e3 / (out - 1.0),
            0.003
        ),
        "{r:?}"
    );
    assert!(r.e2el_ms.unwrap() >= (last - sent) * 1e3 - 0.003, "{r:?}");
    assert!(near(
        r.send_lag_ms.unwrap(),
        (sent - r.scheduled_s.unwrap()) * 1e3,
        0.003
    ));
}

#[tokio::test]
async fn ttft_and_itl_follow_the_scripted_chunks() {
    // Chunks carry 1, 4, 4, 4, 1 tokens, 40 ms apart except the last (10 ms): every per-token
    // gap is 10 ms, so the ITL p50 is 10 ms only if each gap is divided by its chunk's tokens.
    let script = StreamScript {
        first_token_delay: ms(60),
        gaps: vec![ms(40), ms(40), ms(40), ms(10)],
        chunk_tokens: Some(vec![1, 4, 4, 4, 1]),
        usage: Some(ScriptUsage {
            prompt_tokens: 100,
            completion_tokens: 14,
            cached_tokens: Some(48),
        }),
        error_event: None,
        done: true,
        stamp_content: None,
    };
    let server = ScriptedServer::start(move |_| Reply::Stream(script.clone()))
        .await
        .unwrap();
    let plan = closed_plan(2, 1, 0.0, 2);
    let dir = out_dir("timings");
    let out = dir.path().join("client.csv");
    let summary = run_closed(&plan, &config(server.url(), out.clone()))
        .await
        .unwrap();
    assert_eq!(summary.model, MODEL);
    assert_eq!((summary.requests, summary.ok, summary.errors), (2, 2, 0));
    assert!(out.exists() && !driver::rows::partial_path(&out).exists());

    let rows = read_rows(&out).unwrap();
    assert_eq!(rows.len(), 2);
    for r in &rows {
        assert!(r.is_ok(), "{r:?}");
        assert_eq!(r.status, 200);
        assert_eq!(r.chunks, 5);
        assert_eq!(r.output_tokens, Some(14));
        assert_eq!(r.prompt_tokens, Some(100));
        assert_eq!(r.cached_tokens, Some(48));
        assert_consistent(r);
        let ttft = r.ttft_ms.unwrap();
        let itl = r.itl_p50_ms.unwrap();
        // Sleeps never end early; the upper bounds only guard against gross errors.
        assert!((60.0..400.0).contains(&ttft), "ttft {ttft}");
        // Undivided gaps would give a median of 40 ms; jitter of a few ms either way is noise.
        assert!((7.0..30.0).contains(&itl), "itl p50 {itl}");
        // TPOT: 130 ms over 13 tokens.
        assert!((8.0..30.0).contains(&r.tpot_ms.unwrap()), "{r:?}");
    }

    // Headers and body as the contract says.
    let seen = server.seen();
    assert_eq!(seen.len(), 2);
    let Schedule::Closed { users, .. } = &plan.schedule else {
        unreachable!()
    };
    for (k, s) in seen.iter().enumerate() {
        assert_eq!(s.path, "/v1/chat/completions");
        assert_eq!(s.request_id.as_deref(), Some(rows[k].request_id.as_str()));
        assert_eq!(
            s.session_id.as_deref(),
            Some(plan.session_id(users[0][k].conversation).as_str())
        );
        assert_eq!(s.body["model"], MODEL);
        assert_eq!(s.body["stream"], true);
        assert_eq!(s.body["ignore_eos"], true);
        assert_eq!(s.body["max_tokens"], 8);
        assert_eq!(s.body["stream_options"]["include_usage"], true);
        let msgs = s.body["messages"].as_array().unwrap();
        assert_eq!(msgs.len(), 2 * users[0][k].turn as usize);
        assert_eq!(msgs[0]["role"], "system");
    }
}

#[tokio::test]
async fn every_failure_is_a_row_with_its_kind() {
    let sse = |s: &str| Bytes::from(s.to_owned());
    let one_chunk = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x\"}}]}\n\n";
    let replies: Vec<Reply> = vec![
        Reply::Status {
            status: 503,
            message: "overloaded".into(),
        },
        Reply::Raw {
            status: 200,
            content_type: "text/event-stream".into(),
            frames: vec![(ms(0), sse("data: {not json\n\n"))],
            abort: false,
        },
        Reply::Raw {
            status: 200,
            content_type: "text/event-stream".into(),
            frames: vec![(ms(0), sse(one_chunk)), (ms(30), sse("data: {\"cho"))],
            abort: true,
        },
        Reply::Raw {
            status: 200,
            content_type: "text/event-stream".into(),
            frames: vec![(ms(0), sse(one_chunk))],
            abort: false,
        },
        Reply::Stream(StreamScript {
            error_event: Some("engine died".into()),
            ..StreamScript::uniform(ms(1), ms(1), 2, 10)
        }),
        Reply::Raw {
            status: 200,
            content_type: "application/json".into(),
            frames: vec![(ms(0), sse("{\"id\":\"x\",\"choices\":[]}"))],
            abort: false,
        },
        Reply::Hang,
        Reply::Raw {
            status: 200,
            content_type: "text/event-stream".into(),
            frames: vec![(ms(0), sse(one_chunk)), (ms(60_000), sse(one_chunk))],
            abort: false,
        },
        Reply::Stream(StreamScript::uniform(ms(1), ms(1), 3, 10)),
    ];
    let expected = [
        "http", "sse", "stream", "stream", "upstream", "http", "timeout", "timeout", "",
    ];
    let n = replies.len();
    let counter = Arc::new(AtomicUsize::new(0));
    let c2 = counter.clone();
    let server =
        ScriptedServer::start(move |_| replies[c2.fetch_add(1, Ordering::SeqCst) % n].clone())
            .await
            .unwrap();
    let plan = closed_plan(3, 1, 0.0, n as u32);
    let tmp = out_dir("errors");
    let out = tmp.path().join("client.csv");
    let cfg = RunConfig {
        timeout_s: 0.5,
        ..config(server.url(), out.clone())
    };
    let summary = run_closed(&plan, &cfg).await.unwrap();
    assert_eq!(summary.requests, n as u64);
    assert_eq!(summary.errors, n as u64 - 1);
    let rows = read_rows(&out).unwrap();
    let kinds: Vec<&str> = rows.iter().map(|r| r.error_kind()).collect();
    assert_eq!(kinds, expected);
    assert_eq!(rows[0].status, 503);
    assert!(
        error(&rows[0]).contains("overloaded"),
        "{:?}",
        rows[0].error
    );
    assert!(error(&rows[4]).contains("engine died"));
    assert!(
        error(&rows[5]).contains("not an SSE stream"),
        "{:?}",
        rows[5].error
    );
    assert_eq!(rows[6].status, 0);
    // A stream that stalls after its head and one chunk: status 200, the chunk kept.
    assert_eq!(rows[7].status, 200);
    assert_eq!(rows[7].chunks, 1);
    assert!(
        error(&rows[7]).contains("stream unfinished"),
        "{:?}",
        rows[7].error
    );
    // A failed stream keeps what arrived before the failure.
    assert_eq!(rows[2].chunks, 1);
    assert!(rows[2].ttft_ms.is_some());
    let mut by_kind = BTreeMap::new();
    for k in &expected[..n - 1] {
        *by_kind.entry(k.to_string()).or_insert(0u64) += 1;
    }
    assert_eq!(summary.errors_by_kind, by_kind);
}

#[tokio::test]
async fn refused_connections_are_rows_and_unreachable_urls_are_clear_errors() {
    // A port that was just free: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let plan = closed_plan(2, 1, 0.0, 3);
    let tmp = out_dir("refused");
    let out = tmp.path().join("client.csv");
    let cfg = RunConfig {
        preflight: false,
        model: Some("m".into()),
        ..config(url.clone(), out.clone())
    };
    let summary = run_closed(&plan, &cfg).await.unwrap();
    assert_eq!(summary.errors, 3);
    let rows = read_rows(&out).unwrap();
    assert_eq!(rows.len(), 3);
    for r in rows {
        assert_eq!(r.status, 0);
        assert_eq!(r.error_kind(), "connect", "{:?}", r.error);
        assert!(
            error(&r).to_lowercase().contains("refused"),
            "{:?}",
            r.error
        );
    }

    let err = run_closed(&plan, &config(url, out.clone()))
        .await
        .unwrap_err();
    assert!(matches!(err, DriverError::Unreachable { .. }), "{err}");
    assert!(err.to_string().contains("cannot reach"), "{err}");
}

#[tokio::test]
async fn a_non_openai_server_is_a_clear_error() {
    let server = ScriptedServer::start(|_| Reply::Hang).await.unwrap();
    let plan = closed_plan(2, 1, 0.0, 1);
    let tmp = out_dir("not-openai");
    let out = tmp.path().join("client.csv");
    let err = run_closed(&plan, &config(format!("{}/elsewhere", server.url()), out))
        .await
        .unwrap_err();
    assert!(matches!(err, DriverError::NotOpenAi { .. }), "{err}");
    assert!(err.to_string().contains("404"), "{err}");
}

#[tokio::test]
async fn open_loop_sends_on_schedule_one_turn_per_conversation_at_a_time() {
    let server =
        ScriptedServer::start(|_| Reply::Stream(StreamScript::uniform(ms(5), ms(2), 4, 50)))
            .await
            .unwrap();
    let plan = Plan::build(
        &small_spec(4),
        &ArrivalSpec::Open {
            rate_rps: 60.0,
            duration_s: 2.0,
            start: workload::OpenStart::Fresh,
        },
    )
    .unwrap();
    let Schedule::Open { arrivals } = &plan.schedule else {
        unreachable!()
    };
    let tmp = out_dir("open");
    let out = tmp.path().join("client.csv");
    let cfg = RunConfig {
        warmup_s: 0.5,
        ..config(server.url(), out.clone())
    };
    let summary = run_open(&plan, &cfg).await.unwrap();
    assert_eq!(summary.requests, arrivals.len() as u64);
    assert_eq!(summary.errors, 0);
    let rows = read_rows(&out).unwrap();
    assert_eq!(rows.len(), arrivals.len());
    let mut lags = Vec::new();
    for r in &rows {
        let i: usize = r.request_id.strip_prefix('a').unwrap().parse().unwrap();
        let a = arrivals[i];
        assert_eq!(r.turn, a.turn);
        assert_eq!(r.session_id, Some(plan.session_id(a.conversation)));
        // The schedule is the plan's, never rescaled; lateness is recorded, never negative.
        assert!(
            near(r.scheduled_s.unwrap(), a.at_us as f64 / 1e6, 1e-6),
            "{r:?}"
        );
        assert!(r.sent_s.unwrap() >= r.scheduled_s.unwrap());
        assert_consistent(r);
        assert_eq!(r.warmup, r.sent_s.unwrap() < 0.5);
        lags.push(r.send_lag_ms.unwrap());
    }
    assert!(rows.iter().any(|r| r.warmup) && rows.iter().any(|r| !r.warmup));
    lags.sort_by(f64::total_cmp);
    let median_lag = lags[lags.len() / 2];
    assert!(median_lag < 50.0, "median send lag {median_lag} ms");
    assert_no_overlap_per_session(&rows);
}

/// No two turns of one conversation were in flight at once, and turns advance in plan order.
fn assert_no_overlap_per_session(rows: &[ClientRow]) {
    let mut by_session: BTreeMap<&str, Vec<&ClientRow>> = BTreeMap::new();
    for r in rows {
        by_session
            .entry(r.session_id.as_deref().unwrap_or_default())
            .or_default()
            .push(r);
    }
    for list in by_session.values_mut() {
        list.sort_by(|a, b| a.sent_s.unwrap().total_cmp(&b.sent_s.unwrap()));
        for w in list.windows(2) {
            let end = w[0].sent_s.unwrap() + w[0].e2el_ms.unwrap() / 1e3;
            assert!(
                w[1].sent_s.unwrap() >= end - 1e-6,
                "{:?} overlaps {:?}",
                w[1],
                w[0]
            );
        }
    }
}

#[tokio::test]
async fn closed_loop_users_share_conversations_without_overlap() {
    let server =
        ScriptedServer::start(|_| Reply::Stream(StreamScript::uniform(ms(3), ms(1), 4, 50)))
            .await
            .unwrap();
    // Two conversations and four users: users collide on conversations all the time.
    let plan = closed_plan(2, 4, 0.005, 6);
    let tmp = out_dir("closed");
    let out = tmp.path().join("client.csv");
    let summary = run_closed(&plan, &config(server.url(), out.clone()))
        .await
        .unwrap();
    assert_eq!((summary.requests, summary.errors), (24, 0));
    let rows = read_rows(&out).unwrap();
    assert_eq!(rows.len(), 24);
    for r in &rows {
        assert_consistent(r);
    }
    assert_no_overlap_per_session(&rows);
    // Each user sent every step of its script exactly once, one request at a time.
    let Schedule::Closed { users, .. } = &plan.schedule else {
        unreachable!()
    };
    for (u, script) in users.iter().enumerate() {
        let mut mine: Vec<&ClientRow> = rows
            .iter()
            .filter(|r| r.request_id.starts_with(&format!("u{u}-")))
            .collect();
        let mut ids: Vec<usize> = mine
            .iter()
            .map(|r| r.request_id[3..].parse::<usize>().unwrap())
            .collect();
        ids.sort_unstable();
        assert_eq!(ids, (0..script.len()).collect::<Vec<_>>());
        mine.sort_by(|a, b| a.sent_s.unwrap().total_cmp(&b.sent_s.unwrap()));
        for w in mine.windows(2) {
            let end = w[0].sent_s.unwrap() + w[0].e2el_ms.unwrap() / 1e3;
            assert!(w[1].sent_s.unwrap() >= end - 1e-6, "user {u} overlapped");
        }
    }
}

fn step(conversation: u32, turn: u32) -> Step {
    Step {
        conversation,
        turn,
        think_us: 0,
    }
}

#[tokio::test]
async fn a_user_skips_a_conversation_another_user_is_walking() {
    // Each response takes ~25 ms, so user 0's three-turn walk lasts ~75 ms.
    let server =
        ScriptedServer::start(|_| Reply::Stream(StreamScript::uniform(ms(20), ms(1), 4, 50)))
            .await
            .unwrap();
    let mut plan = closed_plan(2, 2, 0.0, 3);
    // Both users draw conversation 0 first; user 1's next draws are conversations 1 and 0.
    plan.schedule = Schedule::Closed {
        users: vec![
            vec![step(0, 1), step(0, 2), step(0, 3)],
            vec![
                step(0, 1),
                step(0, 2),
                step(0, 3),
                step(1, 1),
                step(1, 2),
                step(1, 3),
            ],
        ],
        spare_draws: vec![vec![], vec![0]],
    };
    plan.check().unwrap();
    let tmp = out_dir("closed-skip");
    let out = tmp.path().join("client.csv");
    let summary = run_closed(&plan, &config(server.url(), out.clone()))
        .await
        .unwrap();
    assert_eq!((summary.requests, summary.errors), (9, 0));
    assert_eq!(summary.skipped_draws, 1);
    let rows = read_rows(&out).unwrap();
    assert_no_overlap_per_session(&rows);
    let row = |id: &str| rows.iter().find(|r| r.request_id == id).unwrap();
    // User 1 skipped conversation 0 (user 0 owned it) and walked conversation 1 at once
    // instead of waiting; its slots keep their ids and turns.
    let c1 = plan.session_id(1);
    for (k, turn) in [(0, 1), (1, 2), (2, 3)] {
        let r = row(&format!("u1-{k}"));
        assert_eq!((r.session_id.as_deref(), r.turn), (Some(c1.as_str()), turn));
    }
    assert!(row("u1-0").send_lag_ms.unwrap() < 15.0);
    assert!(row("u1-0").sent_s.unwrap() < row("u0-0").sent_s.unwrap() + 0.015);
    // Its second walk took its next draw, conversation 0, once user 0 had released it.
    let c0 = plan.session_id(0);
    assert_eq!(row("u1-3").session_id, Some(c0));
    let end = |r: &ClientRow| r.sent_s.unwrap() + r.e2el_ms.unwrap() / 1e3;
    assert!(row("u1-3").sent_s.unwrap() >= end(row("u0-2")) - 1e-6);
}

/// Whether two rows of one session were in flight at the same time.
fn overlapping_turns(rows: &[ClientRow], session: &str) -> bool {
    let mine: Vec<&ClientRow> = rows
        .iter()
        .filter(|r| r.session_id.as_deref() == Some(session))
        .collect();
    let span = |r: &ClientRow| {
        (
            r.sent_s.unwrap(),
            r.sent_s.unwrap() + r.e2el_ms.unwrap() / 1e3,
        )
    };
    mine.iter().enumerate().any(|(i, a)| {
        mine[i + 1..].iter().any(|b| {
            let ((a0, a1), (b0, b1)) = (span(a), span(b));
            a0 < b1 && b0 < a1
        })
    })
}

#[tokio::test]
async fn shared_conversations_are_walked_by_two_users_at_once() {
    // Each response takes ~25 ms; both users' scripts walk conversation 0 from the start.
    let server =
        ScriptedServer::start(|_| Reply::Stream(StreamScript::uniform(ms(20), ms(1), 4, 50)))
            .await
            .unwrap();
    let spec = WorkloadSpec {
        sharing: Sharing::Shared,
        ..small_spec(2)
    };
    let mut plan = Plan::build(
        &spec,
        &ArrivalSpec::Closed {
            users: 2,
            think_mean_s: 0.0,
            requests_per_user: 3,
        },
    )
    .unwrap();
    let walk = vec![step(0, 1), step(0, 2), step(0, 3)];
    plan.schedule = Schedule::Closed {
        users: vec![walk.clone(), walk],
        spare_draws: vec![vec![], vec![]],
    };
    plan.check().unwrap();
    let tmp = out_dir("closed-shared");
    let out = tmp.path().join("client.csv");
    let summary = run_closed(&plan, &config(server.url(), out.clone()))
        .await
        .unwrap();
    assert_eq!((summary.requests, summary.errors), (6, 0));
    assert_eq!(summary.skipped_draws, 0);
    let rows = read_rows(&out).unwrap();
    // Both users sent their scripts as drawn, the same turns of conversation 0 side by side.
    let c0 = plan.session_id(0);
    assert!(
        rows.iter()
            .all(|r| r.session_id.as_deref() == Some(c0.as_str()))
    );
    let row = |id: &str| rows.iter().find(|r| r.request_id == id).unwrap();
    assert!(row("u1-0").sent_s.unwrap() < row("u0-0").sent_s.unwrap() + 0.015);
    assert!(overlapping_turns(&rows, &c0));
}

#[tokio::test]
async fn shared_open_loop_arrivals_are_sent_on_time_while_a_turn_is_in_flight() {
    // Responses take ~60 ms and one conversation gets every arrival (~40 req/s): exclusive,
    // each turn waits for the previous one; shared, each goes at its scheduled time.
    let server =
        ScriptedServer::start(|_| Reply::Stream(StreamScript::uniform(ms(50), ms(2), 4, 50)))
            .await
            .unwrap();
    let run = |sharing, name: &'static str| {
        let url = server.url();
        async move {
            let plan = Plan::build(
                &WorkloadSpec {
                    sharing,
                    ..small_spec(1)
                },
                &ArrivalSpec::Open {
                    rate_rps: 40.0,
                    duration_s: 1.0,
                    start: workload::OpenStart::Fresh,
                },
            )
            .unwrap();
            let tmp = out_dir(name);
            let out = tmp.path().join("client.csv");
            let summary = run_open(&plan, &config(url, out.clone())).await.unwrap();
            assert_eq!(summary.requests, plan.request_count() as u64);
            assert_eq!(summary.errors, 0);
            (plan, read_rows(&out).unwrap())
        }
    };
    let (plan, shared) = run(Sharing::Shared, "open-shared").await;
    let c0 = plan.session_id(0);
    assert!(overlapping_turns(&shared, &c0));
    let mut lags: Vec<f64> = shared.iter().map(|r| r.send_lag_ms.unwrap()).collect();
    lags.sort_by(f64::total_cmp);
    assert!(lags[lags.len() / 2] < 15.0, "median send lag {lags:?}");
    let (_, exclusive) = run(Sharing::Exclusive, "open-exclusive").await;
    assert_no_overlap_per_session(&exclusive);
}

#[tokio::test]
async fn duration_cap_stops_new_requests_and_wrong_driver_is_refused() {
    let server =
        ScriptedServer::start(|_| Reply::Stream(StreamScript::uniform(ms(1), ms(1), 2, 5)))
            .await
            .unwrap();
    let plan = closed_plan(2, 1, 0.05, 1_000);
    let tmp = out_dir("duration");
    let out = tmp.path().join("client.csv");
    let cfg = RunConfig {
        duration_s: Some(0.3),
        ..config(server.url(), out.clone())
    };
    let summary = run_closed(&plan, &cfg).await.unwrap();
    assert!(summary.requests > 0 && summary.requests < 1_000);
    assert_eq!(summary.requests + summary.not_sent, 1_000);
    assert_eq!(read_rows(&out).unwrap().len() as u64, summary.requests);

    let err = run_open(&plan, &cfg).await.unwrap_err();
    assert!(err.to_string().contains("driver closed"), "{err}");
}

/// `progress_file` gets the progress line even with the terminal line off (an orchestrator logs
/// the driver's stderr and shows this file instead), and it ends on the final count.
#[tokio::test]
async fn the_progress_file_ends_on_the_final_count() {
    let server =
        ScriptedServer::start(|_| Reply::Stream(StreamScript::uniform(ms(1), ms(1), 2, 50)))
            .await
            .unwrap();
    let plan = closed_plan(2, 2, 0.0, 3);
    let dir = out_dir("progress-file");
    let progress = dir.path().join("driver.progress");
    let cfg = RunConfig {
        progress_file: Some(progress.clone()),
        ..config(server.url(), dir.path().join("client.csv"))
    };
    let summary = run_closed(&plan, &cfg).await.unwrap();
    assert_eq!(summary.requests, 6);
    let text = std::fs::read_to_string(&progress).unwrap();
    assert!(text.starts_with("6/6 done"), "{text}");
}

/// An exclusive open loop whose one conversation gets every arrival builds a queue of turns in
/// the driver. After the run's stop time a queued turn that has waited past `abandon_after_s`
/// is not sent: it is a row with an `abandoned:` error and no send time, so the run does not
/// drain the backlog; turns that waited less are still sent. Every planned turn is a row.
#[tokio::test]
async fn queued_turns_past_the_bound_after_the_end_are_abandoned_not_sent() {
    let server =
        ScriptedServer::start(|_| Reply::Stream(StreamScript::uniform(ms(50), ms(2), 4, 50)))
            .await
            .unwrap();
    let plan = Plan::build(
        &small_spec(1),
        &ArrivalSpec::Open {
            rate_rps: 40.0,
            duration_s: 1.0,
            start: workload::OpenStart::Fresh,
        },
    )
    .unwrap();
    let tmp = out_dir("abandon");
    let out = tmp.path().join("client.csv");
    let cfg = RunConfig {
        duration_s: Some(1.0),
        abandon_after_s: Some(0.1),
        ..config(server.url(), out.clone())
    };
    let summary = run_open(&plan, &cfg).await.unwrap();
    let rows = read_rows(&out).unwrap();
    assert_eq!(rows.len() as u64, summary.requests);
    assert_eq!(
        summary.requests + summary.not_sent,
        plan.request_count() as u64
    );
    let abandoned: Vec<&ClientRow> = rows
        .iter()
        .filter(|r| error(r).starts_with("abandoned:"))
        .collect();
    // ~40 arrivals, each response ≥ 56 ms: at most ~18 served in the second, the rest queued.
    assert!(abandoned.len() >= 10, "{} abandoned", abandoned.len());
    assert_eq!(
        summary.errors_by_kind.get("abandoned").copied(),
        Some(abandoned.len() as u64)
    );
    for r in &abandoned {
        assert!(
            r.sent_s.is_none() && r.ttft_ms.is_none() && r.e2el_ms.is_none(),
            "{r:?}"
        );
        assert!(r.scheduled_s.unwrap() < 1.0, "{r:?}");
    }
    // What was sent after the end had waited at most the bound when it was let go.
    for r in rows.iter().filter(|r| r.sent_s.is_some_and(|s| s > 1.0)) {
        assert!(r.send_lag_ms.unwrap() < 100.0 + 50.0, "{r:?}");
    }
    let sent: Vec<ClientRow> = rows.into_iter().filter(|r| r.sent_s.is_some()).collect();
    assert_no_overlap_per_session(&sent);
}

/// A row's error message, empty on success.
fn error(r: &ClientRow) -> &str {
    r.error.as_deref().unwrap_or_default()
}

#[tokio::test]
async fn a_prime_asks_for_one_token_and_runs_in_the_warm_up() {
    let server =
        ScriptedServer::start(|_| Reply::Stream(StreamScript::uniform(ms(1), ms(1), 2, 50)))
            .await
            .unwrap();
    // Sized by conversations, so every conversation counts as held and is primed unless it
    // starts at turn 1.
    let plan = Plan::build(
        &small_spec(12),
        &ArrivalSpec::Open {
            rate_rps: 40.0,
            duration_s: 1.5,
            start: workload::OpenStart::Primed {
                tokens_per_s: 20_000,
            },
        },
    )
    .unwrap();
    let Schedule::Open { arrivals } = &plan.schedule else {
        unreachable!()
    };
    let primes: Vec<_> = arrivals.iter().filter(|a| a.prime).collect();
    assert!(!primes.is_empty(), "some conversation starts past turn 1");
    let prime_s = workload::prime_period_s(&plan.spec, plan_start(&plan)).unwrap();
    let tmp = out_dir("primes");
    let out = tmp.path().join("client.csv");
    let cfg = RunConfig {
        warmup_s: prime_s + 0.2,
        ..config(server.url(), out.clone())
    };
    let summary = run_open(&plan, &cfg).await.unwrap();
    assert_eq!(summary.requests, arrivals.len() as u64);
    let seen = server.seen();
    let max_tokens_of = |i: usize| {
        let id = workload::open_request_id(i);
        seen.iter()
            .find(|s| s.request_id.as_deref() == Some(id.as_str()))
            .map(|s| s.body["max_tokens"].as_u64())
            .unwrap_or_else(|| panic!("request {id} was not seen"))
    };
    for (i, a) in arrivals.iter().enumerate() {
        let want = if a.prime { 1 } else { 8 };
        assert_eq!(max_tokens_of(i), Some(want), "arrival {i}: {a:?}");
    }
    // Every prime's row is a warm-up row.
    let rows = read_rows(&out).unwrap();
    for (i, a) in arrivals.iter().enumerate().filter(|(_, a)| a.prime) {
        let id = workload::open_request_id(i);
        let row = rows.iter().find(|r| r.request_id == id).unwrap();
        assert!(row.warmup, "{a:?}");
    }
}

fn plan_start(plan: &Plan) -> workload::OpenStart {
    match plan.arrival {
        ArrivalSpec::Open { start, .. } => start,
        ArrivalSpec::Closed { .. } => unreachable!(),
    }
}
