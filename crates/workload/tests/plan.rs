//! Plan-level properties: sizing, determinism, serialization, names, schedules.

use workload::{
    ArrivalSpec, PLAN_FORMAT, Plan, PrefixGroups, Role, Schedule, Sharing, Sizing, WorkloadError,
    WorkloadSpec, layout,
};

fn closed() -> ArrivalSpec {
    ArrivalSpec::Closed {
        users: 4,
        think_mean_s: 0.5,
        requests_per_user: 20,
    }
}

fn open() -> ArrivalSpec {
    ArrivalSpec::Open {
        rate_rps: 50.0,
        duration_s: 10.0,
        start: workload::OpenStart::Fresh,
    }
}

fn ws(capacity_tokens: u64, ratio: f64) -> WorkloadSpec {
    WorkloadSpec {
        sizing: Sizing::WorkingSet {
            capacity_tokens,
            ratio,
        },
        ..WorkloadSpec::default()
    }
}

/// The grouped workload (the pressure grid's default shape) sized against `capacity_tokens`.
fn grouped(capacity_tokens: u64, ratio: f64) -> WorkloadSpec {
    WorkloadSpec {
        prefix_groups: Some(PrefixGroups::DEFAULT),
        prefix_tokens: workload::spec::DEFAULT_PRIVATE_CONTEXT_TOKENS,
        ..ws(capacity_tokens, ratio)
    }
}

#[test]
fn sizing_hits_the_ratio_within_one_percent() {
    // 5 replicas of a 3090-class card hold on the order of 10^5 tokens each; also a small fleet.
    for capacity in [40_000u64, 266_240, 1_000_000] {
        for ratio in [0.25, 1.0, 3.0, 8.0] {
            let spec = ws(capacity, ratio);
            let plan = Plan::build(&spec, &closed()).unwrap();
            let got = plan.working_set_tokens() / capacity as f64;
            assert!(
                (got / ratio - 1.0).abs() < 0.01,
                "capacity {capacity} ratio {ratio}: got {got} with {} conversations",
                plan.conversations.len()
            );
        }
    }
}

#[test]
fn grouped_sizing_counts_each_shared_prefix_once_exact_to_the_token() {
    // The quick and full fleets' capacities (3 × 4096 and 5 × 8192 blocks of 16 tokens).
    for capacity in [196_608u64, 655_360] {
        for ratio in [0.25, 1.0, 3.0, 8.0] {
            let spec = grouped(capacity, ratio);
            let plan = Plan::build(&spec, &closed()).unwrap();
            let target = (ratio * capacity as f64).round();
            // Bytes counted on the built texts: every conversation's whole last-turn prompt,
            // less the shared prefix of all but one conversation per group.
            assert_eq!(plan.working_set_tokens(), target, "{capacity} × {ratio}");
            let l = layout(&spec).unwrap();
            assert_eq!(l.working_set_tokens(&spec) as f64, target);
            let shared_once = l.used_groups() as f64 * 2_048.0;
            let per_conversation: f64 = (0..plan.conversations.len() as u32)
                .map(|c| {
                    plan.messages(c, 6)
                        .unwrap()
                        .iter()
                        .map(|m| plan.estimate_tokens(&m.content))
                        .sum::<f64>()
                        - 2_048.0
                })
                .sum();
            assert_eq!(per_conversation + shared_once, target);
            // Counting the prefix per conversation would overshoot by this much.
            assert!(plan.conversations.len() > l.used_groups());
        }
    }
}

#[test]
fn group_prefixes_are_shared_within_a_group_and_distinct_across_groups() {
    let spec = WorkloadSpec {
        sizing: Sizing::Conversations(200),
        ..grouped(1, 1.0)
    };
    let plan = Plan::build(&spec, &closed()).unwrap();
    let shared_bytes = 2_048 * 4;
    // The system message each conversation sends (the same at every turn).
    let systems: Vec<String> = (0..200)
        .map(|c| plan.messages(c, 1).unwrap()[0].content.to_string())
        .collect();
    let mut prefixes: Vec<(u32, &str)> = Vec::new();
    for (c, conv) in plan.conversations.iter().enumerate() {
        let g = conv.group.expect("every conversation has a group");
        let prefix = plan.group_prefix(g).unwrap();
        assert_eq!(prefix.len(), shared_bytes);
        // Exactly the group's bytes, then the conversation's own line.
        let system = &systems[c];
        assert_eq!(system.len(), (2_048 + 512) * 4);
        assert_eq!(&system[..shared_bytes], prefix, "conversation {c}");
        assert!(
            system[shared_bytes..].starts_with(&format!("Conversation {c} context. ")),
            "conversation {c}"
        );
        if !prefixes.iter().any(|&(h, _)| h == g) {
            prefixes.push((g, prefix));
        }
    }
    assert_eq!(prefixes.len(), 16, "200 conversations use all 16 groups");
    // Two groups never share a first block: they differ within the first 32 bytes.
    for (i, (g, a)) in prefixes.iter().enumerate() {
        for (h, b) in &prefixes[i + 1..] {
            assert_ne!(a[..32], b[..32], "groups {g} and {h}");
        }
    }
    // Two conversations of one group share exactly the group prefix: they differ right after
    // it, in the number of their opening line.
    let same: Vec<usize> = (0..200)
        .filter(|&c| plan.conversations[c].group == Some(prefixes[0].0))
        .take(2)
        .collect();
    let (a, b) = (&systems[same[0]], &systems[same[1]]);
    let common = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
    let (x, y) = (same[0].to_string(), same[1].to_string());
    let digits = x.bytes().zip(y.bytes()).take_while(|(p, q)| p == q).count();
    assert_eq!(
        common,
        shared_bytes + "Conversation ".len() + digits,
        "conversations {same:?}"
    );
}

#[test]
fn adding_conversations_keeps_the_existing_ones_and_their_groups() {
    let spec = |n| WorkloadSpec {
        sizing: Sizing::Conversations(n),
        ..grouped(1, 1.0)
    };
    let small = Plan::build(&spec(10), &closed()).unwrap();
    let large = Plan::build(&spec(40), &closed()).unwrap();
    assert_eq!(small.conversations[..], large.conversations[..10]);
}

#[test]
fn shared_closed_plans_keep_the_scripts_and_need_no_spares() {
    let spec = WorkloadSpec {
        sharing: Sharing::Shared,
        ..WorkloadSpec::default()
    };
    let shared = Plan::build(&spec, &closed()).unwrap();
    let exclusive = Plan::build(&WorkloadSpec::default(), &closed()).unwrap();
    let (
        Schedule::Closed {
            users: a,
            spare_draws: spare_a,
        },
        Schedule::Closed { users: b, .. },
    ) = (&shared.schedule, &exclusive.schedule)
    else {
        panic!("closed plans expected")
    };
    assert_eq!(a, b);
    assert!(spare_a.iter().all(Vec::is_empty));
    assert_eq!(shared.conversations, exclusive.conversations);
}

#[test]
fn a_plan_of_an_older_format_is_refused_by_its_format() {
    // Written by `driver plan` of format 2 (before prefix groups and sharing) and of format 4
    // (the last bincode format): both refused as written by an older kvroute, naming the format.
    for (old, format) in [
        (&include_bytes!("fixtures/plan-format2.bin")[..], 2),
        (&include_bytes!("fixtures/plan-format4.bin")[..], 4),
    ] {
        let e = Plan::from_bytes(old).unwrap_err().to_string();
        assert!(
            e.contains(&format!("plan format {format} "))
                && e.contains(&format!("supported format {PLAN_FORMAT}")),
            "{e}"
        );
        assert!(e.contains("older version of kvroute"), "{e}");
        assert!(e.contains("build it again"), "{e}");
    }
}

#[test]
fn the_plan_bytes_lead_with_the_format_and_refuse_unknown_ones() {
    let plan = Plan::build(&WorkloadSpec::default(), &closed()).unwrap();
    let mut bytes = plan.to_bytes().unwrap();
    assert_eq!(bytes[0], PLAN_FORMAT);
    bytes[0] = PLAN_FORMAT + 1;
    let e = Plan::from_bytes(&bytes).unwrap_err().to_string();
    assert!(
        e.contains(&format!("plan format {}", PLAN_FORMAT + 1)),
        "{e}"
    );
    assert!(e.contains("another version of kvroute"), "{e}");
    assert!(Plan::from_bytes(&[]).is_err());
}

#[test]
fn sizing_too_small_is_an_error_not_a_panic() {
    let e = Plan::build(&ws(1_000, 0.25), &closed()).unwrap_err();
    assert!(matches!(e, WorkloadError::InvalidSpec(_)), "{e}");
    assert!(e.to_string().contains("too small"), "{e}");
}

#[test]
fn first_turn_prefix_is_about_1100_tokens() {
    let plan = Plan::build(&WorkloadSpec::default(), &closed()).unwrap();
    let msgs = plan.messages(0, 1).unwrap();
    assert_eq!(msgs.len(), 2);
    let tokens: f64 = msgs.iter().map(|m| plan.estimate_tokens(&m.content)).sum();
    assert_eq!(tokens, 1_100.0 + 150.0);
}

#[test]
fn same_seed_gives_byte_identical_plans() {
    for arrival in [closed(), open()] {
        let spec = ws(266_240, 1.0);
        let a = Plan::build(&spec, &arrival).unwrap().to_bytes().unwrap();
        let b = Plan::build(&spec, &arrival).unwrap().to_bytes().unwrap();
        assert_eq!(a, b);
        let other = WorkloadSpec { seed: 8, ..spec };
        let c = Plan::build(&other, &arrival).unwrap().to_bytes().unwrap();
        assert_ne!(a, c);
    }
}

#[test]
fn plan_round_trips_and_corruption_is_an_error() {
    for arrival in [closed(), open()] {
        let plan = Plan::build(&WorkloadSpec::default(), &arrival).unwrap();
        let bytes = plan.to_bytes().unwrap();
        let back = Plan::from_bytes(&bytes).unwrap();
        assert_eq!(back, plan);
        assert_eq!(back.fingerprint().unwrap(), plan.fingerprint().unwrap());
        assert!(Plan::from_bytes(&bytes[..bytes.len() / 2]).is_err());
        assert!(Plan::from_bytes(b"definitely not a plan").is_err());
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(Plan::from_bytes(&longer).is_err());
    }
}

#[test]
fn names_and_fingerprints_change_with_every_parameter() {
    let base = ws(266_240, 1.0);
    let variants = [
        WorkloadSpec { seed: 9, ..base },
        ws(266_241, 1.0),
        ws(266_240, 3.0),
        WorkloadSpec {
            sizing: Sizing::Conversations(10),
            ..base
        },
        WorkloadSpec {
            zipf_s: 1.0,
            ..base
        },
        WorkloadSpec { turns: 4, ..base },
        WorkloadSpec {
            prefix_tokens: 2_000,
            ..base
        },
        WorkloadSpec {
            user_tokens: 100,
            ..base
        },
        WorkloadSpec {
            output_tokens: 64,
            ..base
        },
        WorkloadSpec {
            bytes_per_token: 3,
            ..base
        },
        WorkloadSpec {
            prefix_groups: Some(PrefixGroups::DEFAULT),
            ..base
        },
        WorkloadSpec {
            prefix_groups: Some(PrefixGroups {
                count: 8,
                ..PrefixGroups::DEFAULT
            }),
            ..base
        },
        WorkloadSpec {
            prefix_groups: Some(PrefixGroups {
                prefix_tokens: 1_024,
                ..PrefixGroups::DEFAULT
            }),
            ..base
        },
        WorkloadSpec {
            prefix_groups: Some(PrefixGroups {
                zipf_s: 0.0,
                ..PrefixGroups::DEFAULT
            }),
            ..base
        },
        WorkloadSpec {
            sharing: Sharing::Shared,
            ..base
        },
        WorkloadSpec {
            prefix_groups: Some(PrefixGroups::DEFAULT),
            sharing: Sharing::Shared,
            ..base
        },
    ];
    let base_plan = Plan::build(&base, &closed()).unwrap();
    let mut names = vec![base_plan.name()];
    let mut prints = vec![base_plan.fingerprint().unwrap()];
    for v in &variants {
        let p = Plan::build(v, &closed()).unwrap();
        names.push(p.name());
        prints.push(p.fingerprint().unwrap());
    }
    let arrivals = [
        ArrivalSpec::Closed {
            users: 5,
            think_mean_s: 0.5,
            requests_per_user: 20,
        },
        ArrivalSpec::Closed {
            users: 4,
            think_mean_s: 0.25,
            requests_per_user: 20,
        },
        ArrivalSpec::Closed {
            users: 4,
            think_mean_s: 0.5,
            requests_per_user: 21,
        },
        open(),
        ArrivalSpec::Open {
            rate_rps: 51.0,
            duration_s: 10.0,
            start: workload::OpenStart::Fresh,
        },
        ArrivalSpec::Open {
            rate_rps: 50.0,
            duration_s: 11.0,
            start: workload::OpenStart::Fresh,
        },
    ];
    for a in &arrivals {
        let p = Plan::build(&base, a).unwrap();
        names.push(p.name());
        prints.push(p.fingerprint().unwrap());
    }
    let mut unique_names = names.clone();
    unique_names.sort();
    unique_names.dedup();
    assert_eq!(unique_names.len(), names.len(), "{names:#?}");
    prints.sort_unstable();
    prints.dedup();
    assert_eq!(prints.len(), names.len());
    // Open-loop plans: sharing changes the fingerprint though the arrivals are the same draws.
    let open_print = |sharing| {
        let spec = WorkloadSpec { sharing, ..base };
        Plan::build(&spec, &open()).unwrap().fingerprint().unwrap()
    };
    assert_ne!(open_print(Sharing::Exclusive), open_print(Sharing::Shared));
}

#[test]
fn without_groups_and_sharing_the_name_is_the_old_one() {
    // The name measurements recorded before prefix groups existed.
    let spec = ws(266_240, 1.0);
    assert_eq!(
        spec.name(),
        "chat-ws1-cap266240-s0-t6-p1100-u150-o128-seed7"
    );
    let plan = Plan::build(&spec, &closed()).unwrap();
    assert_eq!(
        plan.name(),
        "chat-ws1-cap266240-s0-t6-p1100-u150-o128-seed7-closed-u4-th0.5-r20"
    );
    assert!(plan.conversations.iter().all(|c| c.group.is_none()));
}

#[test]
fn workload_fingerprint_ignores_the_schedule() {
    let spec = WorkloadSpec::default();
    let a = Plan::build(&spec, &closed()).unwrap();
    let b = Plan::build(&spec, &open()).unwrap();
    assert_eq!(
        a.workload_fingerprint_hex().unwrap(),
        b.workload_fingerprint_hex().unwrap()
    );
    assert_ne!(a.fingerprint_hex().unwrap(), b.fingerprint_hex().unwrap());
}

#[test]
fn messages_alternate_and_grow_by_whole_turns() {
    let plan = Plan::build(&WorkloadSpec::default(), &closed()).unwrap();
    let t3 = plan.messages(5, 3).unwrap();
    let roles: Vec<Role> = t3.iter().map(|m| m.role).collect();
    assert_eq!(
        roles,
        [
            Role::System,
            Role::User,
            Role::Assistant,
            Role::User,
            Role::Assistant,
            Role::User
        ]
    );
    // Turn 3's prompt extends turn 2's: the prefix a cache can reuse.
    let t2 = plan.messages(5, 2).unwrap();
    assert_eq!(&t3[..t2.len()], &t2[..]);
    assert_eq!(t3[2].content.len(), 128 * 4);
    assert!(plan.messages(5, 0).is_err());
    assert!(plan.messages(5, 7).is_err());
    assert!(plan.messages(64, 1).is_err());
    // Distinct conversations differ from their first bytes on.
    let a = plan.messages(0, 1).unwrap()[0].content.to_string();
    let b = plan.messages(1, 1).unwrap()[0].content.to_string();
    assert_ne!(a[..32], b[..32]);
}

#[test]
fn closed_scripts_walk_each_conversation_in_order() {
    let plan = Plan::build(&WorkloadSpec::default(), &closed()).unwrap();
    let Schedule::Closed { users, spare_draws } = &plan.schedule else {
        panic!("closed plan expected")
    };
    assert_eq!(users.len(), 4);
    // 20 requests of 6 turns are 4 walks; each may skip a full window.
    assert_eq!(spare_draws.len(), 4);
    for spare in spare_draws {
        assert_eq!(spare.len(), 4 * (workload::SKIP_WINDOW_DRAWS - 1));
        assert!(
            spare
                .iter()
                .all(|&c| (c as usize) < plan.conversations.len())
        );
    }
    assert_ne!(
        spare_draws[0], spare_draws[1],
        "each user has its own stream"
    );
    for script in users {
        assert_eq!(script.len(), 20);
        // A new conversation always starts at turn 1 and its turns follow one by one.
        for w in script.windows(2) {
            if w[1].turn == 1 {
                assert_eq!(
                    w[0].turn, 6,
                    "a user finishes a conversation before the next"
                );
            } else {
                assert_eq!(w[1].turn, w[0].turn + 1);
                assert_eq!(w[1].conversation, w[0].conversation);
            }
        }
        assert_eq!(script[0].turn, 1);
    }
    // Mean think time is close to its parameter (80 draws; loose bound).
    let mean_s = users
        .iter()
        .flatten()
        .map(|s| s.think_us as f64)
        .sum::<f64>()
        / 80.0
        / 1e6;
    assert!((0.25..1.0).contains(&mean_s), "{mean_s}");
}

#[test]
fn open_arrivals_are_poisson_and_turns_advance_per_conversation() {
    let plan = Plan::build(&WorkloadSpec::default(), &open()).unwrap();
    let Schedule::Open { arrivals } = &plan.schedule else {
        panic!("open plan expected")
    };
    // 500 expected; a Poisson count has sd ≈ 22.
    assert!((400..600).contains(&arrivals.len()), "{}", arrivals.len());
    assert!(arrivals.last().unwrap().at_us < 10_000_000);
    let mut next = vec![1u32; 64];
    for a in arrivals {
        let c = a.conversation as usize;
        assert_eq!(a.turn, next[c]);
        next[c] = a.turn % 6 + 1;
    }
    assert_eq!(plan.request_count(), arrivals.len());
}

#[test]
fn a_stationary_open_loop_starts_each_conversation_at_a_drawn_turn_and_keeps_the_arrivals() {
    let fresh = Plan::build(&WorkloadSpec::default(), &open()).unwrap();
    let steady_arrival = ArrivalSpec::Open {
        rate_rps: 50.0,
        duration_s: 10.0,
        start: workload::OpenStart::Stationary,
    };
    let steady = Plan::build(&WorkloadSpec::default(), &steady_arrival).unwrap();
    let (Schedule::Open { arrivals: a }, Schedule::Open { arrivals: b }) =
        (&fresh.schedule, &steady.schedule)
    else {
        panic!("open plans expected")
    };
    // The same Poisson times and conversation draws: only the turns differ.
    assert_eq!(a.len(), b.len());
    assert!(
        a.iter()
            .zip(b)
            .all(|(x, y)| x.at_us == y.at_us && x.conversation == y.conversation)
    );
    // Each conversation still walks its turns in order, from wherever it started.
    let mut next: Vec<Option<u32>> = vec![None; 64];
    let mut first_turns = Vec::new();
    for x in b {
        let c = x.conversation as usize;
        match next[c] {
            Some(t) => assert_eq!(x.turn, t),
            None => first_turns.push(x.turn),
        }
        next[c] = Some(x.turn % 6 + 1);
    }
    // The turn mix is the steady state's from the start: the first arrivals' turns spread over
    // all six (64 conversations; a fresh start sends turn 1 every time).
    let mut seen = [0u32; 6];
    for t in &first_turns {
        seen[*t as usize - 1] += 1;
    }
    assert!(seen.iter().all(|&n| n >= 3), "{seen:?}");
    let fresh_first_turn_sum: u32 = {
        let mut started = [false; 64];
        a.iter()
            .filter(|x| !std::mem::replace(&mut started[x.conversation as usize], true))
            .map(|x| x.turn)
            .sum()
    };
    assert_eq!(fresh_first_turn_sum as usize, first_turns.len());
    // The start is in the arrival's name, so the fingerprints differ; a fresh start keeps the
    // name it always had.
    assert_eq!(open().name(), "open-l50-d10");
    assert_eq!(steady_arrival.name(), "open-l50-d10-steady");
    assert_ne!(
        fresh.fingerprint_hex().unwrap(),
        steady.fingerprint_hex().unwrap()
    );
    assert_eq!(
        fresh.workload_fingerprint_hex().unwrap(),
        steady.workload_fingerprint_hex().unwrap()
    );
    // Deterministic, and round-trips.
    let again = Plan::build(&WorkloadSpec::default(), &steady_arrival).unwrap();
    assert_eq!(again.to_bytes().unwrap(), steady.to_bytes().unwrap());
    assert_eq!(
        Plan::from_bytes(&steady.to_bytes().unwrap()).unwrap(),
        steady
    );
}

#[test]
fn invalid_arrivals_are_errors() {
    let spec = WorkloadSpec::default();
    for a in [
        ArrivalSpec::Open {
            rate_rps: 0.0,
            duration_s: 1.0,
            start: workload::OpenStart::Fresh,
        },
        ArrivalSpec::Open {
            rate_rps: 1.0,
            duration_s: f64::INFINITY,
            start: workload::OpenStart::Fresh,
        },
        ArrivalSpec::Closed {
            users: 0,
            think_mean_s: 1.0,
            requests_per_user: 1,
        },
        ArrivalSpec::Closed {
            users: 1,
            think_mean_s: -1.0,
            requests_per_user: 1,
        },
    ] {
        assert!(matches!(
            Plan::build(&spec, &a),
            Err(WorkloadError::InvalidSpec(_))
        ));
    }
}

mod sizing_props {
    use proptest::prelude::*;
    use workload::{PrefixGroups, Sizing, WorkloadSpec, layout};

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]

        /// Either the sizing hits the target to the token, or it refuses with an error (never
        /// a silent miss), for any capacity, ratio and conversation shape.
        #[test]
        fn sizing_is_exact_or_refused(
            capacity in 10_000u64..5_000_000,
            ratio in 0.05f64..10.0,
            turns in 1u32..12,
            prefix in 16u32..4_000,
            user in 1u32..400,
            output in 1u32..300,
            groups in prop::option::of((1u32..64, 8u32..4_000, 0.0f64..2.0)),
        ) {
            let spec = WorkloadSpec {
                sizing: Sizing::WorkingSet { capacity_tokens: capacity, ratio },
                turns,
                prefix_tokens: prefix,
                user_tokens: user,
                output_tokens: output,
                prefix_groups: groups.map(|(count, prefix_tokens, zipf_s)| PrefixGroups {
                    count,
                    prefix_tokens,
                    zipf_s,
                }),
                ..WorkloadSpec::default()
            };
            match layout(&spec) {
                Ok(l) => {
                    let prefixes = &l.private_tokens;
                    // Every conversation's own tokens, plus each used group's prefix once.
                    let own: u64 = prefixes.iter().map(|&p| spec.last_turn_tokens(p)).sum();
                    let mut used = l.groups.clone();
                    used.sort_unstable();
                    used.dedup();
                    let total = own + used.len() as u64 * spec.group_prefix_tokens();
                    let target = (ratio * capacity as f64).round();
                    prop_assert_eq!(total as f64, target);
                    prop_assert!(prefixes.iter().all(|&p| p >= u64::from(prefix / 2).max(1)));
                    prop_assert_eq!(l.groups.len(), if groups.is_some() { prefixes.len() } else { 0 });
                }
                Err(e) => prop_assert!(e.to_string().contains("too small"), "{}", e),
            }
        }
    }
}

#[test]
fn cold_resumes_are_first_visits_after_turn_one_and_thin_out_as_the_window_starts_later() {
    let arrival = |start| ArrivalSpec::Open {
        rate_rps: 50.0,
        duration_s: 60.0,
        start,
    };
    let steady = Plan::build(
        &WorkloadSpec::default(),
        &arrival(workload::OpenStart::Stationary),
    )
    .unwrap();
    let Schedule::Open { arrivals } = &steady.schedule else {
        panic!("an open plan")
    };
    // Counted by hand over the whole run: first arrivals of a conversation at a turn > 1.
    let mut seen = std::collections::HashSet::new();
    let cold = arrivals
        .iter()
        .filter(|a| seen.insert(a.conversation) && a.turn > 1)
        .count();
    let all = steady.cold_resume_share(0, u64::MAX).unwrap();
    assert!((all - cold as f64 / arrivals.len() as f64).abs() < 1e-12);
    assert!(cold > 0, "a stationary start resumes conversations cold");
    let early = steady.cold_resume_share(0, 10_000_000).unwrap();
    let late = steady.cold_resume_share(50_000_000, 60_000_000).unwrap();
    assert!(late < early / 2.0, "early {early}, late {late}");
    // A fresh start sends every conversation from turn 1: nothing is resumed cold.
    let fresh = Plan::build(
        &WorkloadSpec::default(),
        &arrival(workload::OpenStart::Fresh),
    )
    .unwrap();
    assert_eq!(fresh.cold_resume_share(0, u64::MAX), Some(0.0));
    // A window without arrivals, or a closed loop, has no share.
    assert_eq!(steady.cold_resume_share(70_000_000, 80_000_000), None);
    let closed_plan = Plan::build(&WorkloadSpec::default(), &closed()).unwrap();
    assert_eq!(closed_plan.cold_resume_share(0, u64::MAX), None);
}

#[test]
fn the_steady_state_warm_up_doubles_until_the_window_is_nearly_free_of_cold_resumes() {
    let spec = WorkloadSpec::default();
    let start = workload::OpenStart::Stationary;
    let (warmup_s, share) =
        workload::steady_state_warmup_s(&spec, 50.0, start, 1.0, 10.0, 0.01, 12).unwrap();
    assert!(share <= 0.01, "share {share}");
    assert!(
        warmup_s > 1.0,
        "a 1-s warm-up leaves cold resumes in the window"
    );
    // The rule's share is the plan's own: the plan of that length has the same arrivals.
    let plan = Plan::build(
        &spec,
        &ArrivalSpec::Open {
            rate_rps: 50.0,
            duration_s: warmup_s + 10.0,
            start,
        },
    )
    .unwrap();
    let us = |s: f64| (s * 1e6).round() as u64;
    assert_eq!(
        plan.cold_resume_share(us(warmup_s), us(warmup_s + 10.0)),
        Some(share)
    );
    // The warm-up before it did not meet the bound.
    let halved = Plan::build(
        &spec,
        &ArrivalSpec::Open {
            rate_rps: 50.0,
            duration_s: warmup_s / 2.0 + 10.0,
            start,
        },
    )
    .unwrap();
    assert!(
        halved
            .cold_resume_share(us(warmup_s / 2.0), us(warmup_s / 2.0 + 10.0))
            .unwrap()
            > 0.01
    );
    // Out of doublings: the last warm-up and its share, for the caller to report.
    let (w, s) = workload::steady_state_warmup_s(&spec, 50.0, start, 1.0, 10.0, 0.0, 0).unwrap();
    assert_eq!(w, 1.0);
    assert!(s > 0.0);
}

#[test]
fn only_conversations_the_steady_state_would_hold_count_as_cold_resumes() {
    let sized = |zipf_s: f64| WorkloadSpec {
        zipf_s,
        sizing: workload::Sizing::WorkingSet {
            capacity_tokens: 196_608,
            ratio: 1.0,
        },
        ..WorkloadSpec::default()
    };
    let held = |spec: &WorkloadSpec| {
        let n = workload::layout(spec).unwrap().private_tokens.len();
        let zipf = workload::Zipf::new(n, spec.zipf_s).unwrap();
        (n, workload::steadily_cached(spec, &zipf))
    };
    // Without skew every conversation returns before a cache's worth of turns has passed.
    let (n, uniform) = held(&sized(0.0));
    assert!(uniform.iter().all(|&h| h), "{n} conversations");
    // At skew 1.4 the head is held and the tail is not: its returns are cold in the steady state
    // too, so they are not an artefact of the run's start.
    let skewed = sized(1.4);
    let (n, held_skewed) = held(&skewed);
    let kept = held_skewed.iter().filter(|&&h| h).count();
    assert!(held_skewed[0] && !held_skewed[n - 1], "{kept} of {n}");
    // The default sizes: 53 of 74 conversations held.
    assert!(kept < n, "{kept} of {n}");
    // The warm-up that clears the held conversations' cold resumes would not clear every
    // conversation's: the quick grid's ws3-s1.4 (51 of 223 held), at 6 req/s.
    let skewed = WorkloadSpec {
        prefix_tokens: 1100,
        user_tokens: 150,
        output_tokens: 128,
        turns: 6,
        sizing: workload::Sizing::WorkingSet {
            capacity_tokens: 196_608,
            ratio: 3.0,
        },
        zipf_s: 1.4,
        ..WorkloadSpec::default()
    };
    let (n, held_ws3) = held(&skewed);
    assert_eq!((held_ws3.iter().filter(|&&h| h).count(), n), (51, 223));
    let start = workload::OpenStart::Stationary;
    let (warmup_s, share) =
        workload::steady_state_warmup_s(&skewed, 6.0, start, 5.0, 10.0, 0.01, 16).unwrap();
    assert!(share <= 0.01, "share {share}");
    let plan = Plan::build(
        &skewed,
        &ArrivalSpec::Open {
            rate_rps: 6.0,
            duration_s: warmup_s + 10.0,
            start,
        },
    )
    .unwrap();
    let Schedule::Open { arrivals } = &plan.schedule else {
        panic!("an open plan")
    };
    let us = |s: f64| (s * 1e6).round() as u64;
    assert_eq!(
        plan.cold_resume_share(us(warmup_s), us(warmup_s + 10.0)),
        Some(share)
    );
    let every = vec![true; n];
    let counting_all =
        workload::cold_resume_share(arrivals, &every, us(warmup_s), us(warmup_s + 10.0)).unwrap();
    assert!(
        counting_all > 0.01,
        "counting every conversation, the {warmup_s}-s warm-up would not do ({counting_all})"
    );
}

/// The quick grid's ws3-s0 at the quick fleet's size: 3 × the KV capacity, no skew.
fn ws3_quick() -> WorkloadSpec {
    WorkloadSpec {
        prefix_tokens: 1100,
        user_tokens: 150,
        output_tokens: 128,
        turns: 6,
        sizing: workload::Sizing::WorkingSet {
            capacity_tokens: 196_608,
            ratio: 3.0,
        },
        zipf_s: 0.0,
        ..WorkloadSpec::default()
    }
}

#[test]
fn primes_send_each_held_conversations_previous_turn_first_then_the_stationary_arrivals() {
    let spec = ws3_quick();
    let pace = 30_000;
    let primed = workload::OpenStart::Primed { tokens_per_s: pace };
    let open = |start| ArrivalSpec::Open {
        rate_rps: 6.0,
        duration_s: 60.0,
        start,
    };
    let plan = Plan::build(&spec, &open(primed)).unwrap();
    let steady = Plan::build(&spec, &open(workload::OpenStart::Stationary)).unwrap();
    assert!(plan.arrival.name().ends_with("-primed30000"));
    let (
        Schedule::Open { arrivals },
        Schedule::Open {
            arrivals: stationary,
        },
    ) = (&plan.schedule, &steady.schedule)
    else {
        panic!("open plans")
    };
    let primes: Vec<_> = arrivals.iter().filter(|a| a.prime).collect();
    let prime_s = workload::prime_period_s(&spec, primed).unwrap();
    // Every prime comes before the first Poisson arrival, which comes after the primes' period.
    let first_run = arrivals.iter().position(|a| !a.prime).unwrap();
    assert_eq!(first_run, primes.len());
    assert!(arrivals[first_run].at_us as f64 >= prime_s * 1e6);
    assert!(primes.iter().all(|p| (p.at_us as f64) < prime_s * 1e6));
    // One prime per conversation, at the turn before the one its first run arrival sends.
    let mut seen = std::collections::HashSet::new();
    for p in &primes {
        assert!(seen.insert(p.conversation), "one prime per conversation");
        assert!(p.turn >= 1);
        let first = arrivals[first_run..]
            .iter()
            .find(|a| a.conversation == p.conversation);
        if let Some(first) = first {
            assert_eq!(first.turn, p.turn % spec.turns + 1, "{p:?} then {first:?}");
        }
    }
    // Without skew every conversation is held, and those starting past turn 1 are primed: about
    // five in six (turns 2–6 of 6).
    let n = plan.conversations.len();
    assert!(
        primes.len() * 6 > n * 4 && primes.len() < n,
        "{} primes of {n}",
        primes.len()
    );
    // The pace: the primes' estimated prompt tokens ÷ the period is the pace given.
    let layout = workload::layout(&spec).unwrap();
    let tokens: u64 = primes
        .iter()
        .map(|p| spec.turn_tokens(layout.private_tokens[p.conversation as usize], p.turn))
        .sum();
    assert!((tokens as f64 / prime_s - f64::from(pace)).abs() < 1.0);
    // The run's arrivals are the stationary plan's draws, begun after the primes.
    for (a, b) in arrivals[first_run..].iter().zip(stationary.iter()).take(50) {
        assert_eq!(
            (a.conversation, a.turn, a.prime),
            (b.conversation, b.turn, false)
        );
        let shifted = b.at_us as f64 + prime_s * 1e6;
        assert!((a.at_us as f64 - shifted).abs() <= 1.0, "{a:?} vs {b:?}");
    }
    // The bytes round-trip with the flags.
    let back = Plan::from_bytes(&plan.to_bytes().unwrap()).unwrap();
    assert_eq!(back, plan);
    // A zero pace is refused.
    let err = Plan::build(
        &spec,
        &open(workload::OpenStart::Primed { tokens_per_s: 0 }),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("pace"), "{err}");
}

#[test]
fn primed_runs_need_only_the_primes_period_and_the_base_warm_up() {
    // At ws3-s0 of the quick fleet at 6 req/s, the stationary start needs its 5-s base warm-up
    // doubled several times (a KV-cache turnover) before the window is free of cold resumes; a
    // primed start is free of them after the primes and the base.
    let spec = ws3_quick();
    let stationary = workload::OpenStart::Stationary;
    let (w_stationary, _) =
        workload::steady_state_warmup_s(&spec, 6.0, stationary, 5.0, 10.0, 0.01, 16).unwrap();
    let primed = workload::OpenStart::Primed {
        tokens_per_s: 30_000,
    };
    let prime_s = workload::prime_period_s(&spec, primed).unwrap();
    let (w_primed, share) =
        workload::steady_state_warmup_s(&spec, 6.0, primed, 5.0, 10.0, 0.01, 16).unwrap();
    assert_eq!(share, 0.0);
    assert!(
        (w_primed - (prime_s + 5.0)).abs() < 1e-9,
        "{w_primed} vs {prime_s} + 5"
    );
    assert!(
        w_stationary >= 4.0 * w_primed,
        "stationary {w_stationary} s, primed {w_primed} s"
    );
    // Without primes the period is 0.
    assert_eq!(workload::prime_period_s(&spec, stationary).unwrap(), 0.0);
}
