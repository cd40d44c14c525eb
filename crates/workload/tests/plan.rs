//! Plan-level properties: sizing, determinism, serialization, names, schedules.

use workload::{ArrivalSpec, Plan, Role, Schedule, Sizing, WorkloadError, WorkloadSpec};

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
    let tokens: f64 = msgs.iter().map(|m| plan.estimate_tokens(m.content)).sum();
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
        },
        ArrivalSpec::Open {
            rate_rps: 50.0,
            duration_s: 11.0,
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
    let a = plan.messages(0, 1).unwrap()[0].content;
    let b = plan.messages(1, 1).unwrap()[0].content;
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
fn invalid_arrivals_are_errors() {
    let spec = WorkloadSpec::default();
    for a in [
        ArrivalSpec::Open {
            rate_rps: 0.0,
            duration_s: 1.0,
        },
        ArrivalSpec::Open {
            rate_rps: 1.0,
            duration_s: f64::INFINITY,
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
    use workload::{Sizing, WorkloadSpec, prefix_lengths};

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
        ) {
            let spec = WorkloadSpec {
                sizing: Sizing::WorkingSet { capacity_tokens: capacity, ratio },
                turns,
                prefix_tokens: prefix,
                user_tokens: user,
                output_tokens: output,
                ..WorkloadSpec::default()
            };
            match prefix_lengths(&spec) {
                Ok(prefixes) => {
                    let total: u64 = prefixes.iter().map(|&p| spec.last_turn_tokens(p)).sum();
                    let target = (ratio * capacity as f64).round();
                    prop_assert_eq!(total as f64, target);
                    prop_assert!(prefixes.iter().all(|&p| p >= u64::from(prefix / 2).max(1)));
                }
                Err(e) => prop_assert!(e.to_string().contains("too small"), "{}", e),
            }
        }
    }
}
