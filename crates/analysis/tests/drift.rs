//! The drift check flags a synthetic cell still warming and passes steady ones.

mod common;

use analysis::{
    ClientRow, DriftClass, DriftConfig, Slo, Window, WindowClock, check_rep_dir, check_rows,
};

const SLO: Slo = Slo {
    ttft_ms: 990.0,
    itl_ms: 24.0,
};
const WINDOW: Window = Window {
    warmup_s: 10.0,
    measured_start_s: 10.0,
    measured_end_s: 110.0,
    clock: WindowClock::Sent,
};

/// The same window, of an open loop: rows placed by their scheduled time.
const OPEN: Window = Window {
    clock: WindowClock::Scheduled,
    ..WINDOW
};

/// Deterministic noise in [-1, 1) (xorshift64*, fixed seed): no RNG crate, same on every machine.
struct Noise(u64);
impl Noise {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11;
        x as f64 / (1u64 << 52) as f64 - 1.0
    }
}

fn row(i: usize, sent_s: f64, ttft_ms: f64, warmup: bool) -> ClientRow {
    ClientRow {
        request_id: format!("r{i}"),
        session_id: Some(format!("s{}", i % 16)),
        turn: (i / 16) as u32,
        scheduled_s: Some(sent_s),
        sent_s: Some(sent_s),
        first_token_s: Some(sent_s + ttft_ms / 1000.0),
        last_s: Some(sent_s + ttft_ms / 1000.0 + 1.0),
        ttft_ms: Some(ttft_ms),
        itl_p50_ms: Some(8.0),
        tpot_ms: Some(8.0),
        e2el_ms: Some(ttft_ms + 1000.0),
        prompt_tokens: Some(1100),
        output_tokens: Some(128),
        cached_tokens: Some(0),
        status: 200,
        error: None,
        warmup,
        send_lag_ms: Some(0.0),
        chunks: 128,
    }
}

/// 4 requests a second across warm-up and the 100 s window; `ttft(t)` gives the TTFT at
/// window-relative time t (s).
fn cell(ttft: impl Fn(f64) -> f64, seed: u64, noise_ms: f64) -> Vec<ClientRow> {
    let mut noise = Noise(seed);
    (0..440)
        .map(|i| {
            let sent = i as f64 * 0.25;
            let t = sent - WINDOW.measured_start_s;
            row(
                i,
                sent,
                ttft(t) + noise_ms * noise.next(),
                sent < WINDOW.warmup_s,
            )
        })
        .collect()
}

#[test]
fn a_warming_cell_is_flagged() {
    // The cache fills during the first half of the window: TTFT falls from 1.6 s to 0.4 s, so
    // early requests miss the SLO and goodput climbs.
    let rows = cell(|t| (1600.0 - 24.0 * t).max(400.0), 7, 80.0);
    let v = check_rows(&rows, &SLO, &WINDOW, &DriftConfig::default());
    assert!(v.warming, "{v:?}");
    let g = v.goodput.as_ref().unwrap();
    assert!(g.flagged && g.slope_per_s > 0.0, "{g:?}");
    let t = v.ttft.as_ref().unwrap();
    assert!(t.flagged && t.slope_per_s < 0.0, "{t:?}");
    assert!(t.t_stat.unwrap() < -3.0);
    let reason = v.reason.unwrap();
    assert!(
        reason.contains("goodput trends up") && reason.contains("TTFT trends down"),
        "{reason}"
    );
}

#[test]
fn a_steady_cell_passes() {
    let rows = cell(|_| 400.0, 11, 120.0);
    let v = check_rows(&rows, &SLO, &WINDOW, &DriftConfig::default());
    assert!(!v.warming, "{v:?}");
    assert_eq!(v.reason, None);
    assert_eq!(v.skipped, None);
    let t = v.ttft.unwrap();
    assert_eq!(t.n, 400);
    assert!(!t.flagged && t.t_stat.unwrap().abs() < 3.0, "{t:?}");
    assert!(!v.goodput.unwrap().flagged);
}

#[test]
fn a_steady_cell_with_failures_passes() {
    // A tenth of the requests miss the TTFT bound at random: goodput is noisy but flat.
    let mut coin = Noise(3);
    let rows = cell(|_| 400.0, 5, 50.0)
        .into_iter()
        .map(|mut r| {
            if coin.next() > 0.8 {
                r.ttft_ms = Some(1200.0);
            }
            r
        })
        .collect::<Vec<_>>();
    let v = check_rows(&rows, &SLO, &WINDOW, &DriftConfig::default());
    assert!(!v.warming, "{v:?}");
}

#[test]
fn a_real_but_small_trend_is_not_flagged() {
    // TTFT rises 5% across the window with little noise: the slope is real (|t| ≫ 3) but below
    // the 10% that matters.
    let rows = cell(|t| 400.0 + 0.2 * t, 13, 5.0);
    let v = check_rows(&rows, &SLO, &WINDOW, &DriftConfig::default());
    let t = v.ttft.as_ref().unwrap();
    assert!(t.t_stat.unwrap() > 3.0, "{t:?}");
    assert!(t.relative_change.unwrap() < 0.10);
    assert!(!v.warming);
    // a stricter threshold catches it (the 20-ms change is 2% of the 990-ms bound, TTFT's scale):
    // a rising TTFT is a trend for the worse, never warming
    let strict = DriftConfig {
        min_relative_change: 0.015,
        ..DriftConfig::default()
    };
    let v = check_rows(&rows, &SLO, &WINDOW, &strict);
    assert_eq!(v.class, DriftClass::Worsening, "{v:?}");
    assert!(v.drifting() && !v.warming && !v.overloaded);
}

#[test]
fn only_an_improving_trend_is_warming() {
    // The warming cell's mirror, closed loop: TTFT rises from 0.4 s to 1.6 s across the window
    // and goodput falls: the fleet is getting worse, which a longer warm-up would not settle.
    // (Open loop, the same rows grow the backlog, so they are overloaded; the engines' own TTFT
    // rising with no queue growing is worsening too, in
    // `a_ttft_trend_is_split_into_the_drivers_wait_and_the_engines_side`.)
    let rows = cell(|t| (400.0 + 24.0 * t).min(1600.0), 7, 80.0);
    assert_eq!(
        check_rows(&rows, &SLO, &OPEN, &DriftConfig::default()).class,
        DriftClass::Overloaded
    );
    {
        let v = check_rows(&rows, &SLO, &WINDOW, &DriftConfig::default());
        assert_eq!(v.class, DriftClass::Worsening, "{v:?}");
        assert!(!v.warming && !v.overloaded && v.worsening() && v.trending());
        let reason = v.reason.as_deref().unwrap();
        assert!(
            reason.starts_with("worsening (no queue grows): ") && reason.contains("TTFT trends up"),
            "{reason}"
        );
    }
    // The falling mirror is warming, by either clock.
    let falling = cell(|t| (1600.0 - 24.0 * t).max(400.0), 7, 80.0);
    for window in [WINDOW, OPEN] {
        let v = check_rows(&falling, &SLO, &window, &DriftConfig::default());
        assert_eq!(v.class, DriftClass::Warming, "{v:?}");
    }
    assert!(
        analysis::drift::CLASSIFICATION_RULE
            .contains("worsening = drifting with neither queue rising")
    );
}

#[test]
fn too_few_requests_skip_the_check() {
    let dir = common::fixtures().join("sweep-basic/ws1-s0/prefix-affinity/rep-1");
    let window = Window {
        warmup_s: 2.0,
        measured_start_s: 2.0,
        measured_end_s: 6.0,
        clock: WindowClock::Sent,
    };
    let v = check_rep_dir(&dir, &SLO, &window, &DriftConfig::default()).unwrap();
    assert!(!v.warming);
    assert!(v.skipped.unwrap().starts_with("9 measured requests"));
}

/// An open loop offered 4 requests a second that the fleet serves at 3⅓ (one at a time, 300 ms
/// each): each conversation's next turn waits in the driver until the fleet has finished the
/// one before, so turns are sent ever later after their scheduled time, and the backlog of
/// requests scheduled and not yet finished grows through the window.
fn overloaded_cell() -> Vec<ClientRow> {
    let mut free_s = 0.0f64;
    (0..440)
        .map(|i| {
            let scheduled = i as f64 * 0.25;
            let sent = scheduled.max(free_s);
            free_s = sent + 0.3;
            let mut r = row(i, sent, 100.0, sent < WINDOW.warmup_s);
            r.scheduled_s = Some(scheduled);
            r.send_lag_ms = Some((sent - scheduled) * 1e3);
            r.e2el_ms = Some(300.0);
            r.last_s = Some(sent + 0.3);
            r
        })
        .collect()
}

#[test]
fn an_open_loop_whose_backlog_grows_is_overloaded_not_warming() {
    let rows = overloaded_cell();
    let v = check_rows(&rows, &SLO, &OPEN, &DriftConfig::default());
    assert_eq!(v.class, DriftClass::Overloaded, "{v:?}");
    assert!(v.overloaded && !v.warming && v.drifting());
    let b = v.backlog.as_ref().unwrap();
    // 4 offered − 3⅓ served: the backlog grows by ⅔ request per second.
    assert!(
        b.flagged && (b.slope_per_s - 2.0 / 3.0).abs() < 0.05,
        "{b:?}"
    );
    assert!(b.t_stat.is_none_or(|t| t > 3.0), "{b:?}");
    let reason = v.reason.as_deref().unwrap();
    assert!(
        reason.starts_with("overloaded: the backlog grows 0.6"),
        "{reason}"
    );
    assert!(reason.contains("TTFT trends up"), "{reason}");
    assert!(v.rule.contains("overloaded = open loop and the backlog"));
    // By the send time the same rows look steady: every turn is served in 100 ms once sent,
    // at the rate the fleet sustains. The wait in the driver is what the scheduled clock sees.
    let by_send = check_rows(&rows, &SLO, &WINDOW, &DriftConfig::default());
    assert_eq!(by_send.class, DriftClass::Settled, "{by_send:?}");
    assert!(by_send.backlog.is_none());
}

#[test]
fn an_open_loop_warming_up_with_a_flat_or_falling_backlog_is_warming() {
    // The warming cell above, open loop and sent on time: its backlog (4/s × latency) falls as
    // the cache fills.
    let rows = cell(|t| (1600.0 - 24.0 * t).max(400.0), 7, 80.0);
    let v = check_rows(&rows, &SLO, &OPEN, &DriftConfig::default());
    assert_eq!(v.class, DriftClass::Warming, "{v:?}");
    assert!(v.warming && !v.overloaded);
    let b = v.backlog.as_ref().unwrap();
    assert!(b.slope_per_s < 0.0, "{b:?}");
    assert!(v.reason.as_deref().unwrap().starts_with("warming: "));
    // A steady open loop is settled, its flat backlog measured beside it.
    let steady = check_rows(
        &cell(|_| 400.0, 11, 120.0),
        &SLO,
        &OPEN,
        &DriftConfig::default(),
    );
    assert_eq!(steady.class, DriftClass::Settled, "{steady:?}");
    assert!(!steady.backlog.unwrap().flagged);
    // A closed loop has no backlog to grow: drifting is warming.
    let closed = check_rows(&rows, &SLO, &WINDOW, &DriftConfig::default());
    assert_eq!(closed.class, DriftClass::Warming);
    assert!(closed.backlog.is_none());
}

#[test]
fn a_growing_backlog_is_overloaded_even_when_attainment_and_ttft_do_not_trend() {
    // Sent on time, first token in 100 ms, but each request streams longer than the one before:
    // requests pile up in flight while attainment and TTFT stay flat.
    let rows: Vec<ClientRow> = (0..440)
        .map(|i| {
            let sent = i as f64 * 0.25;
            let mut r = row(i, sent, 100.0, sent < WINDOW.warmup_s);
            let e2el_ms = 1000.0 + 200.0 * sent;
            r.e2el_ms = Some(e2el_ms);
            r.last_s = Some(sent + e2el_ms / 1e3);
            r
        })
        .collect();
    let v = check_rows(&rows, &SLO, &OPEN, &DriftConfig::default());
    assert!(!v.attainment.as_ref().unwrap().flagged && !v.ttft.as_ref().unwrap().flagged);
    assert_eq!(v.class, DriftClass::Overloaded, "{v:?}");
    assert!(v.overloaded && !v.warming && v.drifting());
    let reason = v.reason.unwrap();
    assert!(
        reason.starts_with("overloaded: the backlog grows")
            && reason.ends_with("attainment and TTFT do not trend"),
        "{reason}"
    );
}

/// A skewed open loop: 4 requests a second sent on time, in flight for 0.5–8.5 s (deterministic
/// noise drawn per 10-s stretch, so the number in flight swings widely from bucket to bucket), and
/// one hot conversation whose turns are scheduled every 2 s but take 2.2 s each, so each waits in
/// the driver behind the one before. Only the driver's queue shows the growth clearly.
fn chain_bound_cell(seed: u64) -> Vec<ClientRow> {
    let mut noise = Noise(seed);
    let stretch_ms: Vec<f64> = (0..12).map(|_| 4500.0 + 4000.0 * noise.next()).collect();
    let mut rows: Vec<ClientRow> = (0..440)
        .map(|i| {
            let sent = i as f64 * 0.25;
            let mut r = row(i, sent, 100.0, sent < WINDOW.warmup_s);
            let e2el_ms = stretch_ms[(sent / 10.0) as usize];
            r.e2el_ms = Some(e2el_ms);
            r.last_s = Some(sent + e2el_ms / 1e3);
            r
        })
        .collect();
    let mut free_s = 0.0f64;
    for turn in 0..55 {
        let scheduled = turn as f64 * 2.0;
        let sent = scheduled.max(free_s);
        free_s = sent + 2.2;
        let mut r = row(1000 + turn, sent, 100.0, scheduled < WINDOW.warmup_s);
        r.session_id = Some("hot".into());
        r.scheduled_s = Some(scheduled);
        r.send_lag_ms = Some((sent - scheduled) * 1e3);
        r.e2el_ms = Some(2200.0);
        r.last_s = Some(sent + 2.2);
        rows.push(r);
    }
    rows
}

#[test]
fn a_driver_queue_that_grows_is_overloaded_when_the_whole_backlog_does_not_show_it() {
    let rows = chain_bound_cell(3);
    let window = Window {
        clock: WindowClock::Scheduled,
        ..WINDOW
    };
    let v = check_rows(&rows, &SLO, &window, &DriftConfig::default());
    let backlog = v.backlog.as_ref().unwrap();
    assert!(!backlog.flagged, "{backlog:?}");
    let unsent = v.unsent.as_ref().unwrap();
    // 0.5 turn/s offered, 1/2.2 served: the queue grows by 0.045 turn per second.
    assert!(
        unsent.flagged && (unsent.slope_per_s - (0.5 - 1.0 / 2.2)).abs() < 0.01,
        "{unsent:?}"
    );
    assert_eq!(v.class, DriftClass::Overloaded, "{v:?}");
    let reason = v.reason.as_deref().unwrap();
    assert!(
        reason.starts_with("overloaded: the driver's queue of unsent requests grows 0.0"),
        "{reason}"
    );
    assert!(v.rule.contains("or the driver's queue alone"));
    // The queue is measured from the rows' own times: a closed loop has none to test.
    let closed = check_rows(&rows, &SLO, &WINDOW, &DriftConfig::default());
    assert!(closed.unsent.is_none() && closed.unsent_mean.is_none());
    // Without the hot conversation, nothing queues in the driver and nothing is overloaded.
    let cold: Vec<ClientRow> = rows
        .iter()
        .filter(|r| r.session_id.as_deref() != Some("hot"))
        .cloned()
        .collect();
    let v = check_rows(&cold, &SLO, &window, &DriftConfig::default());
    assert_eq!(v.unsent_mean, Some(0.0));
    assert_ne!(v.class, DriftClass::Overloaded, "{v:?}");
}

#[test]
fn a_ttft_trend_is_split_into_the_drivers_wait_and_the_engines_side() {
    // TTFT from the send flat at 100 ms, but every request waits in the driver 4 ms longer per
    // second of window: the judged TTFT trend is all wait, so the drift is the driver's queue.
    let queued: Vec<ClientRow> = cell(|_| 100.0, 5, 20.0)
        .into_iter()
        .map(|mut r| {
            let scheduled = r.sent_s.unwrap();
            let wait_s = (scheduled - WINDOW.measured_start_s).max(0.0) * 0.004;
            r.scheduled_s = Some(scheduled);
            r.sent_s = Some(scheduled + wait_s);
            r.send_lag_ms = Some(wait_s * 1e3);
            r
        })
        .collect();
    let v = check_rows(&queued, &SLO, &OPEN, &DriftConfig::default());
    assert!(v.ttft.as_ref().unwrap().flagged, "{v:?}");
    let share = v.wait_share.unwrap();
    assert!((share - 1.0).abs() < 0.1, "{share}");
    assert_eq!(v.class, DriftClass::Overloaded, "{v:?}");
    assert!(
        v.reason
            .as_deref()
            .unwrap()
            .contains("the wait in the driver is 10"),
        "{:?}",
        v.reason
    );
    // The engines' own TTFT rising (each request still done in 2 s, so no backlog grows), every
    // request sent on time: none of the trend is the driver's.
    let engines: Vec<ClientRow> = cell(|t| 400.0 + 8.0 * t, 9, 40.0)
        .into_iter()
        .map(|mut r| {
            r.e2el_ms = Some(2000.0);
            r.last_s = Some(r.sent_s.unwrap() + 2.0);
            r
        })
        .collect();
    let v = check_rows(&engines, &SLO, &OPEN, &DriftConfig::default());
    assert!(v.ttft.as_ref().unwrap().flagged, "{v:?}");
    assert!(v.wait_share.unwrap().abs() < 0.05, "{v:?}");
    // Rising, it is a trend for the worse: worsening, not warming (only an improving trend is).
    assert_eq!(v.class, DriftClass::Worsening, "{v:?}");
    // A closed loop has no schedule to wait behind: no share.
    assert!(
        check_rows(&queued, &SLO, &WINDOW, &DriftConfig::default())
            .wait_share
            .is_none()
    );
}

/// Every request served in 400 ms, sent on time, but the arrivals thin out: 5 a second in the
/// window's first half, 3 in its second (a Poisson plan's draws can do this over 40 s).
fn thinning_cell() -> Vec<ClientRow> {
    let mut rows = Vec::new();
    let mut t = 0.0f64;
    while t < WINDOW.measured_end_s {
        let rate = if t < 60.0 { 5.0 } else { 3.0 };
        rows.push(row(rows.len(), t, 400.0, t < WINDOW.warmup_s));
        t += 1.0 / rate;
    }
    rows
}

#[test]
fn an_open_loops_outcome_is_judged_by_attainment_not_by_its_plans_arrivals() {
    let rows = thinning_cell();
    let v = check_rows(&rows, &SLO, &OPEN, &DriftConfig::default());
    // Every request met the SLO in every bucket: nothing the policy did trends.
    assert_eq!(v.class, DriftClass::Settled, "{v:?}");
    assert!(v.goodput.is_none());
    let a = v.attainment.as_ref().unwrap();
    assert!(!a.flagged && a.slope_per_s == 0.0, "{a:?}");
    // A closed loop's users send as fast as they are served, so there the same fall in goodput
    // is the system's own: a trend for the worse.
    let closed = check_rows(&rows, &SLO, &WINDOW, &DriftConfig::default());
    assert_eq!(closed.class, DriftClass::Worsening, "{closed:?}");
    assert!(closed.goodput.as_ref().unwrap().flagged && closed.attainment.is_none());
    assert!(closed.reason.unwrap().contains("goodput trends down"));
    // An open loop whose later requests miss the SLO is drifting by its attainment.
    let missing: Vec<ClientRow> = rows
        .into_iter()
        .enumerate()
        .map(|(i, mut r)| {
            if r.sent_s.unwrap() > 80.0 && i % 2 == 0 {
                r.ttft_ms = Some(1200.0);
            }
            r
        })
        .collect();
    let v = check_rows(&missing, &SLO, &OPEN, &DriftConfig::default());
    assert!(v.attainment.as_ref().unwrap().flagged, "{v:?}");
    assert!(v.reason.unwrap().contains("SLO attainment trends down"));
}

#[test]
fn a_ttft_trend_is_judged_on_the_scale_of_the_slo_bound() {
    // TTFT doubles across the window, from 10 to 20 ms, with little noise: a real trend of 67%
    // of its mean, but 1% of a 990-ms bound, so no request's verdict changes.
    let rows = cell(|t| 10.0 + 0.1 * t, 17, 1.0);
    let v = check_rows(&rows, &SLO, &OPEN, &DriftConfig::default());
    let t = v.ttft.as_ref().unwrap();
    assert!(
        t.t_stat.unwrap() > 3.0 && t.relative_change.unwrap() > 0.5,
        "{t:?}"
    );
    assert!(!t.flagged && v.class == DriftClass::Settled, "{v:?}");
    // Under a 15-ms bound the same trend crosses it: drifting.
    let tight = Slo {
        ttft_ms: 15.0,
        ..SLO
    };
    let v = check_rows(&rows, &tight, &OPEN, &DriftConfig::default());
    assert!(v.ttft.as_ref().unwrap().flagged, "{v:?}");
    assert!(v.drifting());
}
