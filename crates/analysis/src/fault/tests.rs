//! The analysis of one repetition and of a summary, on rows built here.

use super::*;
use crate::meta::Slo;
use crate::rows::{ClientRow, RouterRow};

fn client(id: &str, sent: f64, ttft: Option<f64>, error: Option<&str>) -> ClientRow {
    ClientRow {
        request_id: id.into(),
        session_id: Some("s".into()),
        turn: 0,
        scheduled_s: Some(sent),
        sent_s: Some(sent),
        first_token_s: ttft.map(|t| sent + t / 1e3),
        last_s: Some(sent + 0.2),
        ttft_ms: ttft,
        itl_p50_ms: Some(1.0),
        tpot_ms: Some(1.0),
        e2el_ms: Some(200.0),
        prompt_tokens: Some(100),
        output_tokens: Some(32),
        cached_tokens: None,
        status: if error.is_some() { 0 } else { 200 },
        error: error.map(str::to_string),
        warmup: false,
        send_lag_ms: Some(0.0),
        chunks: 32,
    }
}

fn routed(id: &str, arrival: f64, replica: Option<u32>) -> RouterRow {
    RouterRow {
        request_id: id.into(),
        session_id: Some("s".into()),
        arrival_s: arrival,
        policy: "p".into(),
        replica,
        branch: Some("ring".into()),
        predicted_match_tokens: None,
        outstanding_chosen: Some(0),
        outstanding_min: Some(0),
        decide_ns: Some(100),
        overhead_us: Some(50),
        tokenize_ms: None,
        upstream_status: Some(200),
        cached_tokens: None,
        prompt_tokens: None,
        error: None,
        attempts: 1,
    }
}

/// Router clock = driver clock + 100 s; xtask clock = router clock − 50 s. Kill at driver
/// 10 s, up again at driver 13 s, the load ends at 20 s.
fn events(kind: FaultKind) -> FaultEvents {
    FaultEvents {
        kind,
        victim: 1,
        victim_url: "http://127.0.0.1:1".into(),
        replicas: 3,
        router_minus_xtask_s: 50.0,
        clock_uncertainty_s: 0.001,
        router_minus_driver_s: 100.0,
        xtask: Instants {
            fault_s: 60.0,
            drained_s: None,
            down_s: 60.0,
            restart_s: 62.9,
            up_s: 63.0,
            undrain_s: None,
        },
        outstanding_at_fault: Some(2),
        waited_for_inflight_s: 0.0,
        run_end_s: 20.0,
        warmup_s: 1.0,
    }
}

fn probe(id: &str, sent_s: f64, answered_s: f64) -> ClockProbe {
    ClockProbe {
        request_id: id.into(),
        sent_s,
        answered_s,
    }
}

fn slo() -> Slo {
    Slo {
        ttft_ms: 100.0,
        itl_ms: 5.0,
    }
}

#[test]
fn clocks_map_between_the_three() {
    let e = events(FaultKind::Kill);
    assert!((e.driver().fault_s - 10.0).abs() < 1e-9);
    assert!((e.router().fault_s - 110.0).abs() < 1e-9);
    assert!((e.driver().up_s - 13.0).abs() < 1e-9);
    let c = vec![
        client("a", 1.0, Some(10.0), None),
        client("b", 2.0, Some(10.0), None),
    ];
    let r = vec![
        routed("a", 101.0004, Some(0)),
        routed("b", 102.0002, Some(0)),
    ];
    let off = router_minus_driver(&c, &r).unwrap();
    assert!(
        (off - 100.0002).abs() < 1e-9,
        "the smallest gap wins: {off}"
    );
    let probes = vec![
        probe("fault-clock-probe-0", 1.0, 1.01),
        probe("fault-clock-probe-1", 2.0, 2.002),
    ];
    let rows = vec![
        routed("fault-clock-probe-0", 51.004, None),
        routed("fault-clock-probe-1", 52.0008, None),
    ];
    let (offset, half) = probe_offset(&probes, &rows).unwrap();
    assert!((half - 0.001).abs() < 1e-9, "the shortest round trip wins");
    assert!((offset - 49.9998).abs() < 1e-9);
    assert!(probe_offset(&probes, &[]).is_none());
}

#[test]
fn kill_loses_only_what_was_in_flight_on_the_victim() {
    let e = events(FaultKind::Kill);
    let mut c: Vec<ClientRow> = (0..20)
        .map(|i| client(&format!("ok{i}"), f64::from(i), Some(20.0), None))
        .collect();
    let mut r: Vec<RouterRow> = (0..20)
        .map(|i| routed(&format!("ok{i}"), 100.0 + f64::from(i), Some(i % 3)))
        .collect();
    // In flight on the victim at the kill: sent 9.9, arrived 109.9.
    c.push(client("inflight", 9.9, None, Some("stream: reset")));
    r.push(routed("inflight", 109.9, Some(1)));
    // Handed to the victim as it died (arrived at the kill, before it was seen down): the
    // router's own 502 says the request was sent and so not retried: in flight there too.
    let mut dying = client("dying", 10.0, None, Some("http: 502"));
    dying.status = 502;
    c.push(dying);
    let mut dying_row = routed("dying", 110.0, Some(1));
    dying_row.upstream_status = Some(502);
    dying_row.error = Some(format!(
        "upstream: replica 1 failed: client error (SendRequest) {}; attempt 1)",
        schema::rows::SENT_NOT_RETRIED
    ));
    r.push(dying_row);
    let out = analyse_rep("p", 1, &e, &c, &r, &slo());
    assert!(out.violations.is_empty(), "{:?}", out.violations);
    assert_eq!(out.lost.len(), 2);
    assert!(out.lost.iter().all(|l| l.allowed));

    // Sent after the kill and lost: a request not in flight at it.
    let mut c2 = c.clone();
    let mut r2 = r.clone();
    c2.push(client("late", 11.0, None, Some("upstream: refused")));
    r2.push(routed("late", 111.0, Some(1)));
    // Lost on a replica that was never killed.
    c2.push(client("other", 9.95, None, Some("stream: reset")));
    r2.push(routed("other", 109.95, Some(2)));
    // Never dispatched.
    c2.push(client("nowhere", 10.5, None, Some("http: 503")));
    r2.push(routed("nowhere", 110.5, None));
    // The router gave up on it (502) after trying the dead victim: never in flight.
    let mut gave_up = client("gave-up", 9.8, None, Some("http: 502"));
    gave_up.status = 502;
    c2.push(gave_up);
    r2.push(routed("gave-up", 109.8, Some(1)));
    // No router row at all.
    c2.push(client("unseen", 12.0, None, Some("connect: refused")));
    // A probe row is not a request.
    r2.push(routed("fault-clock-probe-0", 99.0, None));
    // The same answer from a replica that was never killed is outside the bound.
    let mut sent_other = client("sent-other", 9.9, None, Some("http: 502"));
    sent_other.status = 502;
    c2.push(sent_other);
    let mut sent_other_row = routed("sent-other", 109.9, Some(2));
    sent_other_row.error = Some(format!(
        "upstream: replica 2 failed {}; attempt 1)",
        schema::rows::SENT_NOT_RETRIED
    ));
    r2.push(sent_other_row);
    let out = analyse_rep("p", 1, &e, &c2, &r2, &slo());
    assert_eq!(out.lost.len(), 8);
    assert_eq!(out.violations.len(), 6, "{:?}", out.violations);
    assert!(
        out.violations
            .iter()
            .any(|v| v.starts_with("sent-other:") && v.contains("not in flight on the killed"))
    );
    assert!(
        out.violations
            .iter()
            .any(|v| v.starts_with("gave-up:") && v.contains("502"))
    );
    assert!(
        out.violations
            .iter()
            .any(|v| v.starts_with("late:") && v.contains("after the kill"))
    );
    assert!(
        out.violations
            .iter()
            .any(|v| v.starts_with("other:") && v.contains("replica 2"))
    );
    assert!(out.violations.iter().any(|v| v.starts_with("nowhere:")));
    assert!(
        out.violations
            .iter()
            .any(|v| v.starts_with("unseen:") && v.contains("not dispatched"))
    );
}

#[test]
fn a_client_gone_before_the_head_is_judged_by_where_the_router_sent_it() {
    // The router writes a row for a request whose client hung up before the response head
    // (`client: disconnected before the response head`, no upstream status): the request is
    // judged by what the router did with it, never as "not dispatched".
    let e = events(FaultKind::Kill);
    let gone = |id: &str, arrival: f64, replica: u32| RouterRow {
        upstream_status: None,
        overhead_us: None,
        error: Some("client: disconnected before the response head".into()),
        ..routed(id, arrival, Some(replica))
    };
    let c = vec![
        client("ok", 5.0, Some(20.0), None),
        // Timed out while waiting on the victim across the kill: in flight there, allowed.
        client(
            "on-victim",
            9.9,
            None,
            Some("timeout: no response within 30s"),
        ),
        // Timed out while waiting on a replica that was never killed.
        client(
            "elsewhere",
            9.95,
            None,
            Some("timeout: no response within 30s"),
        ),
    ];
    let r = vec![
        routed("ok", 105.0, Some(0)),
        gone("on-victim", 109.9, 1),
        gone("elsewhere", 109.95, 2),
    ];
    let out = analyse_rep("p", 1, &e, &c, &r, &slo());
    assert_eq!(out.lost.len(), 2);
    let on_victim = out
        .lost
        .iter()
        .find(|l| l.request_id == "on-victim")
        .unwrap();
    assert!(on_victim.allowed, "{on_victim:?}");
    assert_eq!(on_victim.replica, Some(1));
    let elsewhere = out
        .lost
        .iter()
        .find(|l| l.request_id == "elsewhere")
        .unwrap();
    assert!(!elsewhere.allowed);
    assert_eq!(elsewhere.replica, Some(2));
    assert_eq!(out.violations.len(), 1, "{:?}", out.violations);
    assert!(
        out.violations[0].starts_with("elsewhere:")
            && out.violations[0].contains("dispatched to replica 2")
            && !out.violations[0].contains("not dispatched"),
        "{:?}",
        out.violations
    );
    // Both count in the share of their replica: the router did send them there.
    let before = out.shares.iter().find(|w| w.window == "before").unwrap();
    assert_eq!(before.requests, 3);
}

#[test]
fn a_drain_may_lose_nothing() {
    let mut e = events(FaultKind::Drain);
    e.xtask.drained_s = Some(60.5);
    e.xtask.down_s = 60.6;
    let c = vec![
        client("a", 5.0, Some(10.0), None),
        client("b", 9.0, None, Some("stream: reset")),
    ];
    let r = vec![routed("a", 105.0, Some(0)), routed("b", 109.0, Some(1))];
    let out = analyse_rep("p", 1, &e, &c, &r, &slo());
    assert_eq!(out.violations.len(), 1);
    assert!(out.violations[0].contains("drain"));
    assert!(out.shares.iter().any(|w| w.window == "draining"));
}

#[test]
fn shares_ttft_goodput_and_recovery() {
    let e = events(FaultKind::Kill);
    let mut c = Vec::new();
    let mut r = Vec::new();
    // Four requests a second for 20 s; during the outage (10..13) TTFT breaks the SLO, and
    // the victim gets nothing.
    for i in 0..80 {
        let t = f64::from(i) * 0.25;
        let id = format!("q{i}");
        let ttft = if (10.0..13.0).contains(&t) {
            500.0
        } else {
            20.0
        };
        c.push(client(&id, t, Some(ttft), None));
        let replica = if (10.0..13.0).contains(&t) {
            2 * (i % 2)
        } else {
            i % 3
        };
        // During the outage every other decision spills to a cold replica (nothing cached);
        // otherwise every decision matches with 80 of 100 prompt tokens cached.
        let spill = (10.0..13.0).contains(&t) && i % 2 == 0;
        let mut row = routed(&id, 100.0 + t, Some(replica));
        row.branch = Some(if spill { "spill-load" } else { "match" }.into());
        row.prompt_tokens = Some(100);
        row.cached_tokens = Some(if spill { 0 } else { 80 });
        r.push(row);
    }
    let out = analyse_rep("p", 1, &e, &c, &r, &slo());
    assert!(out.violations.is_empty());
    let outage = out.shares.iter().find(|w| w.window == "outage").unwrap();
    assert_eq!(outage.share[1], 0.0, "the victim served nothing while down");
    assert_eq!(outage.requests, 12);
    assert_eq!(outage.spill_rate, Some(0.5));
    assert_eq!(outage.prefix_hit_rate, Some(0.4));
    let steady = out.shares.iter().find(|w| w.window == "before").unwrap();
    assert_eq!(
        (steady.spill_rate, steady.prefix_hit_rate),
        (Some(0.0), Some(0.8))
    );
    let before = out.ttft.iter().find(|w| w.window == "before").unwrap();
    assert_eq!(before.p50_ms, Some(20.0));
    let during = out.ttft.iter().find(|w| w.window == "outage").unwrap();
    assert_eq!(during.p50_ms, Some(500.0));
    assert_eq!(out.goodput.len(), 20);
    assert_eq!(out.goodput_before_rps, Some(4.0));
    assert_eq!(out.goodput_outage_rps, Some(0.0));
    assert_eq!(out.recovery_s, Some(0.0));
    assert_eq!(out.attainment, [Some(1.0), Some(0.0), Some(1.0)]);

    let tl = timeline(&[
        out.clone(),
        RepOutcome {
            rep: 2,
            ..out.clone()
        },
    ]);
    assert_eq!(tl.len(), 20);
    assert!(tl[9].replica_alive && !tl[10].replica_alive && !tl[12].replica_alive);
    assert!(tl[13].replica_alive);
    let csv = timeline_csv(&tl);
    // 4 req/s before the kill at 10 s and 0 during the 3-s outage: the centred 5-s mean is 4 up
    // to 7 s, falls through 8 (3.2) and 9 (2.4), bottoms at 1.6 over the outage and is back at
    // 4 from 15 s.
    assert!(csv.starts_with(
        "policy,t_s,goodput_rps,replica_alive,goodput_min_rps,goodput_max_rps,rolling_s\np,0.000,4.000,1,4.000,4.000,5\n"
    ));
    assert!(csv.contains("p,8.000,3.200,1,3.200,3.200,5\n"), "{csv}");
    assert!(csv.contains("p,11.000,1.600,0,1.600,1.600,5\n"), "{csv}");
    assert!(csv.contains("p,15.000,4.000,1,4.000,4.000,5\n"), "{csv}");
}

#[test]
fn the_rolling_mean_is_centred_and_cut_at_the_ends() {
    assert_eq!(
        rolling_mean(&[0.0, 3.0, 6.0, 9.0, 12.0], 3),
        [1.5, 3.0, 6.0, 9.0, 10.5]
    );
    assert_eq!(rolling_mean(&[2.0, 4.0], 5), [3.0, 3.0]);
    assert!(rolling_mean(&[], 5).is_empty());
}

#[test]
fn summary_markdown_names_the_verdict() {
    let e = events(FaultKind::Kill);
    let c = vec![client("a", 5.0, Some(10.0), None)];
    let r = vec![routed("a", 105.0, Some(0))];
    let out = analyse_rep("session-affinity", 1, &e, &c, &r, &slo());
    let s = Summary {
        rules: crate::RULES_VERSION.to_string(),
        kind: FaultKind::Kill,
        point: "ws1-s0-rate2.4".into(),
        reps: vec![out],
        violations: vec![],
        gates: vec![],
        drift_rule: DRIFT_WINDOW_RULE.into(),
        comparisons: vec![],
        refused: None,
    };
    let md = markdown(&s);
    assert!(md.contains("Loss bounds hold"));
    assert!(md.contains("| session-affinity | 1 | 1 | 0 |"));
}

#[test]
fn one_line_says_what_the_rep_showed() {
    let e = events(FaultKind::Kill);
    let c = vec![
        client("a", 5.0, Some(10.0), None),
        client("b", 9.9, None, Some("stream: reset")),
    ];
    let r = vec![routed("a", 105.0, Some(0)), routed("b", 109.9, Some(1))];
    let out = analyse_rep("p", 1, &e, &c, &r, &slo());
    assert_eq!(
        out.one_line(),
        "2 sent, 1 lost (1 in flight on the victim, outstanding 2 at the fault), 0 violations; goodput 0.1 before, 0.0 during, 0.0 after; recovered not within the run"
    );
}

#[test]
fn drift_is_tested_before_the_fault_and_not_across_it() {
    use crate::drift::{DriftConfig, check_rows};
    let e = events(FaultKind::Kill);
    let w = drift_window(&e);
    // Warm-up 1 s on the driver's clock, the kill at driver 10 s.
    assert_eq!((w.measured_start_s, w.measured_end_s), (1.0, 10.0));
    // Steady before the fault, then the fault's own trend: TTFT high in the outage and falling
    // back over the recovery.
    let mut rows: Vec<ClientRow> = (0..80)
        .map(|i| {
            let t = f64::from(i) * 0.25;
            let ttft = if t < 10.0 {
                20.0 + f64::from(i % 3)
            } else {
                90.0 - 3.0 * (t - 10.0)
            };
            client(&format!("q{i}"), t, Some(ttft), None)
        })
        .collect();
    let cfg = DriftConfig::default();
    let whole = schema::Window {
        warmup_s: 1.0,
        measured_start_s: 1.0,
        measured_end_s: 20.0,
        clock: schema::WindowClock::Sent,
    };
    assert!(
        check_rows(&rows, &slo(), &whole, &cfg).trending(),
        "across the fault the test sees the fault's own trend"
    );
    let pre = check_rows(&rows, &slo(), &w, &cfg);
    assert!(!pre.warming && pre.skipped.is_none(), "{pre:?}");
    assert_eq!(GateStatus::of_drift(&pre), GateStatus::Passed);
    // Still warming before the fault: TTFT falling over the steady load is flagged.
    for (i, r) in rows.iter_mut().enumerate().take(40) {
        r.ttft_ms = Some(90.0 - 1.5 * i as f64);
    }
    let warming = check_rows(&rows, &slo(), &w, &cfg);
    assert!(warming.warming);
    assert!(
        matches!(GateStatus::of_drift(&warming), GateStatus::Failed(why) if why.contains("TTFT"))
    );
    // A fault before the warm-up ended leaves nothing to test, and says so.
    let mut early = events(FaultKind::Kill);
    early.warmup_s = 12.0;
    let w = drift_window(&early);
    assert_eq!(w.measured_end_s, w.measured_start_s);
    let v = check_rows(&rows, &slo(), &w, &cfg);
    assert!(matches!(GateStatus::of_drift(&v), GateStatus::NotRun(_)));
}

#[test]
fn the_run_records_its_gates_and_a_run_before_gating_reads_as_not_recorded() {
    let e = events(FaultKind::Kill);
    let c: Vec<ClientRow> = (0..40)
        .map(|i| client(&format!("q{i}"), f64::from(i) * 0.25, Some(20.0), None))
        .collect();
    let w = drift_window(&e);
    let v = crate::drift::check_rows(&c, &slo(), &w, &crate::drift::DriftConfig::default());
    let rec = RecordedGates::new(GateStatus::Failed("lateness".into()), &v, w);
    let run = serde_json::json!({"plan": "p", "gates": rec});
    assert_eq!(
        run["gates"]["evidence"],
        serde_json::json!({"status": "failed", "reason": "lateness"})
    );
    assert_eq!(
        run["gates"]["drift"],
        serde_json::json!({"status": "passed"})
    );
    assert_eq!(RecordedGates::from_run(&run), Some(rec));
    assert_eq!(
        RecordedGates::from_run(&serde_json::json!({"plan": "p"})),
        None
    );
    assert_eq!(GateStatus::NotRecorded.text(), "not recorded");
}

#[test]
fn policies_are_compared_by_the_sweep_reports_verdict() {
    use crate::compare::{Basis, Verdict};
    let e = events(FaultKind::Kill);
    let base = analyse_rep("p", 1, &e, &[], &[], &slo());
    let rep = |policy: &str, rep: u32, outage: f64, recovery: Option<f64>| RepOutcome {
        policy: policy.into(),
        rep,
        goodput_before_rps: Some(24.0),
        goodput_outage_rps: Some(outage),
        goodput_after_rps: Some(23.0 + f64::from(rep) / 10.0),
        recovery_s: recovery,
        ..base.clone()
    };
    let reps = [
        rep("session-affinity", 1, 52.0, Some(2.0)),
        rep("session-affinity", 2, 51.9, Some(2.0)),
        rep("prefix-affinity", 1, 40.0, Some(4.0)),
        rep("prefix-affinity", 2, 45.2, None),
        rep("spill-off", 1, 55.2, Some(0.0)),
        rep("spill-off", 2, 55.9, Some(0.0)),
    ];
    let refs: Vec<&RepOutcome> = reps.iter().collect();
    let cmp = compare(&refs, Basis::Measured);
    let outage = cmp
        .iter()
        .find(|c| c.figure == "goodput_outage_rps")
        .unwrap();
    let order: Vec<&str> = outage.policies.iter().map(|p| p.policy.as_str()).collect();
    assert_eq!(order, ["session-affinity", "prefix-affinity", "spill-off"]);
    let diff = |c: &Comparison, a: &str, b: &str| {
        c.differences
            .iter()
            .find(|d| d.policy == a && d.baseline == b)
            .cloned()
    };
    let pa_sa = diff(outage, "prefix-affinity", "session-affinity").unwrap();
    assert_eq!(pa_sa.verdict, Verdict::Separates);
    assert!((pa_sa.difference - (42.6 - 51.95)).abs() < 1e-9);
    assert_eq!(
        diff(outage, "spill-off", "prefix-affinity")
            .unwrap()
            .verdict,
        Verdict::Separates
    );
    // Overlapping ranges: within spread.
    let after = cmp
        .iter()
        .find(|c| c.figure == "goodput_after_rps")
        .unwrap();
    assert_eq!(
        diff(after, "spill-off", "session-affinity")
            .unwrap()
            .verdict,
        Verdict::WithinSpread
    );
    // A recovery not within the run has no value, and no bound stands in: no spread, no verdict.
    let recovery = cmp.iter().find(|c| c.figure == "recovery_s").unwrap();
    let pa = &recovery.policies[1];
    assert_eq!((pa.spread, pa.missing.as_slice()), (None, &[2][..]));
    assert!(diff(recovery, "prefix-affinity", "session-affinity").is_none());
    assert_eq!(
        diff(recovery, "spill-off", "session-affinity")
            .unwrap()
            .verdict,
        Verdict::Separates
    );
    // One repetition a side: too few reps, never a verdict by eye.
    let one: Vec<&RepOutcome> = vec![&reps[0], &reps[2]];
    let cmp = compare(&one, Basis::Measured);
    assert_eq!(cmp[1].differences[0].verdict, Verdict::TooFewReps);
}
