//! One test (or property) per policy rule.

use kv_index::KvEvent;
use kv_index::hash::{byte_block_keys, token_block_keys};
use policies::{
    Branch, Decision, Keying, POLICY_NAMES, Policy, PolicySpec, ReplicaView, RouteError,
    RouteRequest, build,
};
use proptest::prelude::*;
use std::collections::HashMap;

fn fleet(n: u32) -> Vec<ReplicaView> {
    (0..n).map(ReplicaView::idle).collect()
}

fn policy(name: &str) -> Box<dyn Policy> {
    build(&PolicySpec::named(name)).unwrap()
}

fn req<'a>(session: Option<&'a str>, keys: &'a [u64], now_us: u64) -> RouteRequest<'a> {
    RouteRequest {
        session_id: session,
        block_keys: keys,
        tokens_per_block: 16.0,
        now_us,
    }
}

fn prompt(seed: u8, blocks: usize) -> Vec<u64> {
    let bytes: Vec<u8> = (0..blocks * 64)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect();
    byte_block_keys(b"model", &bytes, 64)
}

/// A prompt of `blocks` blocks whose first `shared` blocks are the same for every `seed`.
fn sharing(shared: usize, seed: u8, blocks: usize) -> Vec<u64> {
    let mut bytes: Vec<u8> = (0..shared * 64)
        .map(|i| (i as u8).wrapping_mul(31) ^ 1)
        .collect();
    bytes.extend((0..(blocks - shared) * 64).map(|i| (i as u8).wrapping_mul(7) ^ seed));
    byte_block_keys(b"model", &bytes, 64)
}

#[test]
fn every_name_builds_and_reports_itself() {
    for name in POLICY_NAMES {
        let p = build(&PolicySpec::named(name)).unwrap();
        assert_eq!(p.name(), name);
    }
    // The switches and the arm names agree.
    let off = build(&PolicySpec {
        spill: false,
        ..PolicySpec::named("prefix-affinity")
    })
    .unwrap();
    assert_eq!(off.name(), "prefix-affinity-spill-off");
    let spec = build(&PolicySpec {
        speculative: true,
        ..PolicySpec::named("exact-residency")
    })
    .unwrap();
    assert_eq!(spec.name(), "exact-residency-spec");
    assert_eq!(policy("round-robin").keying(), Keying::None);
    assert_eq!(policy("prefix-hash").keying(), Keying::BeliefBytes);
    assert_eq!(policy("prefix-affinity").keying(), Keying::BeliefBytes);
    assert_eq!(policy("exact-residency").keying(), Keying::ExactTokens);
    assert_eq!(policy("exact-residency-spec").keying(), Keying::ExactTokens);
}

#[test]
fn bad_specs_are_clear_errors() {
    let cases: Vec<(PolicySpec, &str)> = vec![
        (PolicySpec::named("nope"), "unknown policy"),
        (
            PolicySpec {
                load_factor: 0.9,
                ..PolicySpec::named("session-bounded")
            },
            "load factor",
        ),
        (
            PolicySpec {
                virtual_nodes: 0,
                ..PolicySpec::default()
            },
            "virtual nodes",
        ),
        (
            PolicySpec {
                spill_ratio: f64::NAN,
                ..PolicySpec::default()
            },
            "spill ratio",
        ),
        (
            PolicySpec {
                index_node_cap: 0,
                ..PolicySpec::default()
            },
            "node cap",
        ),
        (
            PolicySpec {
                residency_kv_usage: 1.5,
                ..PolicySpec::default()
            },
            "KV-usage",
        ),
        (
            PolicySpec {
                index_ttl_us: 0,
                ..PolicySpec::default()
            },
            "TTL",
        ),
    ];
    for (spec, needle) in cases {
        let err = build(&spec).err().expect("must fail");
        assert!(err.contains(needle), "{err:?} should mention {needle:?}");
    }
}

#[test]
fn no_eligible_replica_is_an_error_for_every_policy() {
    let mut down = fleet(3);
    down[0].healthy = false;
    down[1].draining = true;
    down[2].healthy = false;
    let keys = prompt(1, 4);
    for name in POLICY_NAMES {
        let mut p = policy(name);
        for f in [&down[..], &[][..]] {
            for s in [Some("s"), None] {
                assert_eq!(
                    p.decide(&req(s, &keys, 0), f),
                    Err(RouteError::NoEligibleReplica),
                    "{name}"
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Draining or unhealthy replicas never receive a request, under any policy.
    #[test]
    fn ineligible_replicas_are_never_chosen(
        states in prop::collection::vec((0u32..20, any::<bool>(), any::<bool>()), 1..12),
        sessions in prop::collection::vec(0u8..30, 1..20),
    ) {
        let f: Vec<ReplicaView> = states
            .iter()
            .enumerate()
            .map(|(i, &(o, h, d))| ReplicaView { id: i as u32 * 3, outstanding: o, healthy: h, draining: d, kv_usage: Some(0.99) })
            .collect();
        let any_eligible = f.iter().any(|r| r.eligible());
        for name in POLICY_NAMES {
            let mut spec = PolicySpec::named(name);
            spec.residency_branch = true;
            let mut p = build(&spec).unwrap();
            for &s in &sessions {
                let keys = prompt(s, 3);
                let sid = format!("s{s}");
                match p.decide(&req(Some(&sid), &keys, 0), &f) {
                    Ok(d) => {
                        prop_assert!(any_eligible);
                        let r = f.iter().find(|r| r.id == d.replica).unwrap();
                        prop_assert!(r.eligible(), "{} chose ineligible {:?}", name, r);
                    }
                    Err(e) => {
                        prop_assert!(!any_eligible);
                        prop_assert_eq!(e, RouteError::NoEligibleReplica);
                    }
                }
            }
        }
    }
}

#[test]
fn round_robin_cycles_over_eligible_replicas() {
    let mut p = policy("round-robin");
    let mut f = fleet(4);
    let picks: Vec<u32> = (0..8)
        .map(|_| p.decide(&req(None, &[], 0), &f).unwrap().replica)
        .collect();
    assert_eq!(picks, vec![0, 1, 2, 3, 0, 1, 2, 3]);
    f[2].draining = true;
    let picks: Vec<u32> = (0..6)
        .map(|_| p.decide(&req(None, &[], 0), &f).unwrap().replica)
        .collect();
    assert_eq!(picks, vec![0, 1, 3, 0, 1, 3]);
    assert_eq!(p.decide(&req(None, &[], 0), &f).unwrap().branch, Branch::Rr);
}

#[test]
fn random_draws_uniformly_over_eligible_replicas_from_its_seed() {
    let mut p = policy("random");
    let mut f = fleet(4);
    f[2].draining = true;
    // Load does not move it.
    f[0].outstanding = 50;
    let mut seen = HashMap::new();
    for _ in 0..3_000 {
        let d = p.decide(&req(None, &[], 0), &f).unwrap();
        assert_eq!(d.branch, Branch::Random);
        *seen.entry(d.replica).or_insert(0) += 1;
    }
    // Three eligible replicas, 1,000 expected each (binomial sd ≈ 26): within ±10%.
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(!seen.contains_key(&2));
    assert!(
        seen.values().all(|&c| (900..=1_100).contains(&c)),
        "{seen:?}"
    );
    let run = |seed| {
        let mut p = build(&PolicySpec {
            seed,
            ..PolicySpec::named("random")
        })
        .unwrap();
        let f = fleet(8);
        (0..64)
            .map(|_| p.decide(&req(None, &[], 0), &f).unwrap().replica)
            .collect::<Vec<_>>()
    };
    assert_eq!(run(1), run(1));
    assert_ne!(run(1), run(2));
}

#[test]
fn a_cyclic_prompt_order_locks_round_robin_but_not_random() {
    // 8 replicas, 16 prompts cycled in order: round-robin sends prompt k to replica k mod 8 on
    // every pass (a cache-affine placement by accident); a random draw does not.
    let f = fleet(8);
    let passes = |name: &str| {
        let mut p = policy(name);
        let mut homes: HashMap<usize, std::collections::HashSet<u32>> = HashMap::new();
        for _ in 0..4 {
            for prompt in 0..16 {
                let d = p.decide(&req(None, &[], 0), &f).unwrap();
                homes.entry(prompt).or_default().insert(d.replica);
            }
        }
        homes.values().map(|h| h.len()).max().unwrap()
    };
    assert_eq!(passes("round-robin"), 1);
    assert!(passes("random") > 1);
}

#[test]
fn least_outstanding_picks_the_minimum_and_spreads_seeded_ties() {
    let mut p = policy("least-outstanding");
    let mut f = fleet(5);
    for (r, o) in f.iter_mut().zip([3, 1, 4, 1, 5]) {
        r.outstanding = o;
    }
    let mut seen = HashMap::new();
    for _ in 0..1_000 {
        let d = p.decide(&req(None, &[], 0), &f).unwrap();
        assert_eq!(d.branch, Branch::Least);
        assert_eq!((d.outstanding_chosen, d.outstanding_min), (1, 1));
        *seen.entry(d.replica).or_insert(0) += 1;
    }
    // Both tied replicas are used, about evenly — never "the first one".
    assert_eq!(seen.len(), 2);
    assert!(seen.values().all(|&c| (400..=600).contains(&c)), "{seen:?}");
    // Same seed, same sequence; another seed, another sequence.
    let run = |seed| {
        let mut p = build(&PolicySpec {
            seed,
            ..PolicySpec::named("least-outstanding")
        })
        .unwrap();
        let f = fleet(5);
        (0..64)
            .map(|_| p.decide(&req(None, &[], 0), &f).unwrap().replica)
            .collect::<Vec<_>>()
    };
    assert_eq!(run(1), run(1));
    assert_ne!(run(1), run(2));
}

#[test]
fn session_affinity_is_sticky_and_ignores_load() {
    let mut p = policy("session-affinity");
    let mut f = fleet(5);
    let first = p.decide(&req(Some("alice"), &[], 0), &f).unwrap();
    assert_eq!(first.branch, Branch::Ring);
    f[first.replica as usize].outstanding = 1_000;
    for _ in 0..10 {
        assert_eq!(
            p.decide(&req(Some("alice"), &[], 0), &f).unwrap().replica,
            first.replica
        );
    }
    // Draining its replica walks the ring; undraining brings the session back.
    f[first.replica as usize].draining = true;
    let moved = p.decide(&req(Some("alice"), &[], 0), &f).unwrap();
    assert_ne!(moved.replica, first.replica);
    assert_eq!(moved.branch, Branch::RingWalk);
    f[first.replica as usize].draining = false;
    assert_eq!(
        p.decide(&req(Some("alice"), &[], 0), &f).unwrap().replica,
        first.replica
    );
    // No session id: least outstanding.
    assert_eq!(
        p.decide(&req(None, &[], 0), &f).unwrap().branch,
        Branch::Least
    );
}

fn owners(p: &mut dyn Policy, f: &[ReplicaView], sessions: usize) -> Vec<u32> {
    (0..sessions)
        .map(|s| {
            p.decide(&req(Some(&format!("session-{s}")), &[], 0), f)
                .unwrap()
                .replica
        })
        .collect()
}

#[test]
fn removing_one_of_n_replicas_moves_about_one_nth_of_sessions() {
    let sessions = 10_000;
    for n in [5u32, 8] {
        let mut p = policy("session-affinity");
        let all = fleet(n);
        let before = owners(p.as_mut(), &all, sessions);
        // Spread: every replica owns a fair-ish share (150 virtual nodes each).
        for r in 0..n {
            let share = before.iter().filter(|&&o| o == r).count() as f64 / sessions as f64;
            assert!(
                (share - 1.0 / n as f64).abs() < 0.35 / n as f64,
                "replica {r} owns {share}"
            );
        }
        let gone = 2;
        let rest: Vec<ReplicaView> = all.iter().copied().filter(|r| r.id != gone).collect();
        p.on_replica_removed(gone);
        let after = owners(p.as_mut(), &rest, sessions);
        let moved: Vec<usize> = (0..sessions).filter(|&s| before[s] != after[s]).collect();
        // Only the removed replica's sessions move.
        assert!(moved.iter().all(|&s| before[s] == gone));
        let frac = moved.len() as f64 / sessions as f64;
        assert!(
            (frac - 1.0 / n as f64).abs() < 0.35 / n as f64,
            "n={n}: moved {frac}"
        );
        // Adding it back restores the original owners.
        let back = owners(p.as_mut(), &all, sessions);
        assert_eq!(back, before);
    }
}

/// ⌈c·(total+1)/n⌉ with c = 5/4 in exact integer arithmetic.
fn exact_bound(total: u64, n: u64) -> u64 {
    (5 * (total + 1)).div_ceil(4 * n)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Session-bounded never lets the chosen replica exceed ⌈c·(total+1)/n⌉.
    #[test]
    fn session_bounded_respects_the_bound(
        loads in prop::collection::vec(0u32..40, 1..16),
        sessions in prop::collection::vec(any::<u16>(), 1..40),
    ) {
        let mut p = policy("session-bounded");
        let mut f: Vec<ReplicaView> = loads.iter().enumerate()
            .map(|(i, &o)| ReplicaView { outstanding: o, ..ReplicaView::idle(i as u32) })
            .collect();
        for s in sessions {
            let total: u64 = f.iter().map(|r| r.outstanding as u64).sum();
            let bound = exact_bound(total, f.len() as u64);
            let d = p.decide(&req(Some(&format!("u{s}")), &[], 0), &f).unwrap();
            let r = &mut f[d.replica as usize];
            prop_assert!(u64::from(r.outstanding) < bound, "{} + 1 > {}", r.outstanding, bound);
            // The request is now outstanding there.
            r.outstanding += 1;
            prop_assert!(u64::from(r.outstanding) <= bound);
        }
    }

    /// Prefix-hash, with the same bound.
    #[test]
    fn prefix_hash_respects_the_bound(
        loads in prop::collection::vec(0u32..40, 1..16),
        prompts in prop::collection::vec(any::<u8>(), 1..40),
    ) {
        let mut p = policy("prefix-hash");
        let mut f: Vec<ReplicaView> = loads.iter().enumerate()
            .map(|(i, &o)| ReplicaView { outstanding: o, ..ReplicaView::idle(i as u32) })
            .collect();
        for s in prompts {
            let total: u64 = f.iter().map(|r| r.outstanding as u64).sum();
            let bound = exact_bound(total, f.len() as u64);
            let keys = prompt(s, 20);
            let d = p.decide(&req(None, &keys, 0), &f).unwrap();
            let r = &mut f[d.replica as usize];
            prop_assert!(u64::from(r.outstanding) < bound);
            r.outstanding += 1;
        }
    }
}

#[test]
fn session_bounded_stays_sticky_below_the_bound() {
    let mut p = policy("session-bounded");
    let mut f = fleet(5);
    for r in f.iter_mut() {
        r.outstanding = 4;
    }
    let home = p.decide(&req(Some("bob"), &[], 0), &f).unwrap();
    assert_eq!(home.branch, Branch::Ring);
    // total 20 → bound ⌈1.25·21/5⌉ = 6: at 5 outstanding bob still goes home, at 6 he walks.
    f[home.replica as usize].outstanding = 5;
    assert_eq!(
        p.decide(&req(Some("bob"), &[], 0), &f).unwrap().replica,
        home.replica
    );
    f[home.replica as usize].outstanding = 6;
    let walked = p.decide(&req(Some("bob"), &[], 0), &f).unwrap();
    assert_ne!(walked.replica, home.replica);
    assert_eq!(walked.branch, Branch::RingWalk);
}

#[test]
fn prefix_hash_keeps_a_prefix_on_one_replica_until_the_bound_is_hit() {
    let mut p = policy("prefix-hash");
    let mut f = fleet(5);
    // Different tails after the 16 leading blocks do not matter.
    let a = sharing(16, 1, 20);
    let b = sharing(16, 2, 24);
    assert_ne!(a[16], b[16]);
    let da = p.decide(&req(None, &a, 0), &f).unwrap();
    let db = p.decide(&req(None, &b, 0), &f).unwrap();
    assert_eq!(da.replica, db.replica);
    assert_eq!(da.branch, Branch::Ring);
    // Keep sending the prefix, counting it outstanding: it stays until ⌈1.25(total+1)/5⌉.
    let home = da.replica;
    let mut stayed = 0;
    loop {
        let d = p.decide(&req(None, &a, 0), &f).unwrap();
        if d.replica != home {
            assert_eq!(d.branch, Branch::RingWalk);
            break;
        }
        f[home as usize].outstanding += 1;
        stayed += 1;
    }
    let total: u64 = f.iter().map(|r| r.outstanding as u64).sum();
    assert_eq!(
        u64::from(f[home as usize].outstanding),
        exact_bound(total, 5)
    );
    assert_eq!(stayed, 1, "with an idle fleet the bound is ⌈1.25/5⌉ = 1");
    // With every replica busy the allowance is larger and the prefix stays longer.
    let mut f = fleet(5);
    for r in f.iter_mut() {
        r.outstanding = 8;
    }
    let mut stayed = 0;
    while p.decide(&req(None, &a, 0), &f).unwrap().replica == home {
        f[home as usize].outstanding += 1;
        stayed += 1;
    }
    assert_eq!(stayed, 3, "⌈1.25·(40+k+1)/5⌉ allows 11 at home");
    // Short prompts (no full block) go to the least loaded.
    assert_eq!(
        p.decide(&req(None, &[], 0), &f).unwrap().branch,
        Branch::Least
    );
}

fn served(p: &mut dyn Policy, keys: &[u64], f: &[ReplicaView], now: u64) -> Decision {
    let d = p.decide(&req(None, keys, now), f).unwrap();
    p.on_served(&req(None, keys, now), d.replica);
    d
}

#[test]
fn belief_predictions_convert_bytes_to_engine_tokens() {
    // The router's 64-byte blocks at ~3.88 canonical bytes per engine token: 10 matched blocks
    // are 640 bytes ≈ 164.9 tokens, predicted as the 10 whole engine blocks (160) they cover;
    // 4 bytes/token would have said the same here but 1,248 instead of 1,280 at 78 blocks.
    let mut p = policy("prefix-affinity");
    let f = fleet(3);
    let first = prompt(5, 10);
    let tpb = policies::belief_tokens_per_block(64, policies::DEFAULT_BELIEF_BYTES_PER_TOKEN);
    fn at(keys: &[u64], now_us: u64, tpb: f64) -> RouteRequest<'_> {
        RouteRequest {
            tokens_per_block: tpb,
            ..req(None, keys, now_us)
        }
    }
    let d = p.decide(&at(&first, 0, tpb), &f).unwrap();
    p.on_served(&at(&first, 0, tpb), d.replica);
    let mut longer = first.clone();
    longer.extend(prompt(6, 70));
    let d2 = p.decide(&at(&longer, 1, tpb), &f).unwrap();
    assert_eq!((d2.replica, d2.branch), (d.replica, Branch::Match));
    assert_eq!(
        (d2.predicted_match_blocks, d2.predicted_match_tokens),
        (10, 160)
    );
    p.on_served(&at(&longer, 1, tpb), d2.replica);
    let d3 = p.decide(&at(&longer, 2, tpb), &f).unwrap();
    assert_eq!(
        (d3.predicted_match_blocks, d3.predicted_match_tokens),
        (80, 1312)
    );
    assert_eq!(d3.predicted_match_tokens % 16, 0);
}

#[test]
fn prefix_affinity_follows_the_longest_believed_match() {
    let mut p = policy("prefix-affinity");
    let mut f = fleet(5);
    let first = prompt(3, 10);
    let d = served(p.as_mut(), &first, &f, 0);
    assert_eq!((d.branch, d.predicted_match_blocks), (Branch::Miss, 0));
    let home = d.replica;
    // The next turn extends the prompt: it goes home, with the matched length predicted.
    f[home as usize].outstanding = 2;
    let mut longer = first.clone();
    longer.extend(prompt(4, 3)); // keys need not be chained for the index to match a prefix
    let d = served(p.as_mut(), &longer, &f, 1);
    assert_eq!(d.replica, home);
    assert_eq!(d.branch, Branch::Match);
    assert_eq!(
        (d.predicted_match_blocks, d.predicted_match_tokens),
        (10, 160)
    );
    assert_eq!((d.outstanding_chosen, d.outstanding_min), (2, 0));
    let check = d.spill.expect("spill rule ran");
    assert!(!check.spilled);
    assert_eq!(check.matched_replica, home);
    // Another replica that holds a longer match wins over the shorter one.
    let other = (home + 1) % 5;
    let mut longest = longer.clone();
    longest.extend(prompt(5, 2));
    p.on_served(&req(None, &longest, 2), other);
    let d = p.decide(&req(None, &longest, 3), &f).unwrap();
    assert_eq!((d.replica, d.predicted_match_blocks), (other, 15));
}

#[test]
fn prefix_affinity_ties_go_to_the_least_loaded_holder() {
    let mut p = policy("prefix-affinity");
    let mut f = fleet(5);
    let keys = prompt(6, 8);
    p.on_served(&req(None, &keys, 0), 1);
    p.on_served(&req(None, &keys, 0), 3);
    f[1].outstanding = 3;
    f[3].outstanding = 2;
    let d = p.decide(&req(None, &keys, 1), &f).unwrap();
    assert_eq!((d.replica, d.branch), (3, Branch::Tie));
    // Equal loads: the seeded tie-break uses both holders.
    f[1].outstanding = 2;
    let mut seen = [0; 5];
    for i in 0..200 {
        seen[p.decide(&req(None, &keys, 2 + i), &f).unwrap().replica as usize] += 1;
    }
    assert!(
        seen[1] > 50 && seen[3] > 50 && seen[0] + seen[2] + seen[4] == 0,
        "{seen:?}"
    );
}

#[test]
fn prefix_affinity_spills_exactly_when_the_margin_is_exceeded() {
    // Defaults: spill when matched − least > 4 and matched > 1.5 × least.
    let keys = prompt(7, 8);
    let case = |matched: u32, least: u32| {
        let mut p = policy("prefix-affinity");
        let mut f = fleet(3);
        p.on_served(&req(None, &keys, 0), 0);
        f[0].outstanding = matched;
        f[1].outstanding = least;
        f[2].outstanding = least + 100;
        p.decide(&req(None, &keys, 1), &f).unwrap()
    };
    let d = case(4, 0);
    assert_eq!(
        (d.replica, d.branch),
        (0, Branch::Match),
        "difference 4 is not > 4"
    );
    let d = case(5, 0);
    assert_eq!((d.replica, d.branch), (1, Branch::SpillLoad));
    let check = d.spill.unwrap();
    assert!(check.spilled);
    assert_eq!((check.matched_outstanding, check.least_outstanding), (5, 0));
    assert_eq!(
        d.predicted_match_blocks, 0,
        "the spill target holds none of it"
    );
    // Ratio half: 16 vs 11 differs by 5 but 16 ≤ 1.5 × 11.
    assert_eq!(case(16, 11).branch, Branch::Match);
    assert_eq!(case(17, 11).branch, Branch::SpillLoad);
    // Spill off pins.
    let mut p = policy("prefix-affinity-spill-off");
    let mut f = fleet(3);
    p.on_served(&req(None, &keys, 0), 0);
    f[0].outstanding = 100;
    let d = p.decide(&req(None, &keys, 1), &f).unwrap();
    assert_eq!((d.replica, d.branch, d.spill), (0, Branch::Match, None));
}

#[test]
fn prefix_affinity_inserts_whatever_replica_served() {
    let mut p = policy("prefix-affinity");
    let f = fleet(4);
    let keys = prompt(8, 6);
    let d = p.decide(&req(None, &keys, 0), &f).unwrap();
    // A retry sent it elsewhere: the serving replica is believed to hold it.
    let server = (d.replica + 1) % 4;
    p.on_served(&req(None, &keys, 0), server);
    let mut f2 = fleet(4);
    f2[d.replica as usize].healthy = false;
    let again = p.decide(&req(None, &keys, 1), &f2).unwrap();
    assert_eq!((again.replica, again.predicted_match_blocks), (server, 6));
}

#[test]
fn prefix_affinity_beliefs_expire_after_the_ttl() {
    let spec = PolicySpec {
        index_ttl_us: 1_000,
        ..PolicySpec::default()
    };
    let mut p = build(&spec).unwrap();
    let f = fleet(3);
    let keys = prompt(10, 4);
    served(p.as_mut(), &keys, &f, 0);
    assert_eq!(
        p.decide(&req(None, &keys, 900), &f).unwrap().branch,
        Branch::Match
    );
    // That decision re-inserted it at 900 (sliding TTL): still believed at 1_900, not at 3_000.
    assert_eq!(
        p.decide(&req(None, &keys, 1_900), &f).unwrap().branch,
        Branch::Match
    );
    assert_eq!(
        p.decide(&req(None, &keys, 3_000), &f).unwrap().branch,
        Branch::Miss
    );
}

#[test]
fn residency_branch_declines_a_replica_believed_to_be_evicting() {
    let keys = prompt(11, 6);
    let spec = PolicySpec {
        residency_branch: true,
        ..PolicySpec::default()
    };
    let mut p = build(&spec).unwrap();
    let mut f = fleet(3);
    p.on_served(&req(None, &keys, 0), 2);
    f[2].kv_usage = Some(0.90);
    assert_eq!(
        p.decide(&req(None, &keys, 1), &f).unwrap().branch,
        Branch::Match
    );
    f[2].kv_usage = Some(0.99);
    let d = p.decide(&req(None, &keys, 2), &f).unwrap();
    assert_eq!(d.branch, Branch::SpillResidency);
    assert_ne!(d.replica, 2);
    assert_eq!(d.spill.unwrap().matched_kv_usage, Some(0.99));
    // Off by default.
    let mut p = policy("prefix-affinity");
    p.on_served(&req(None, &keys, 0), 2);
    assert_eq!(p.decide(&req(None, &keys, 3), &f).unwrap().replica, 2);
}

fn exact_keys(tokens: &[u32]) -> Vec<u64> {
    token_block_keys(b"model-x", tokens, 16)
}

fn exact_spec(name: &str) -> PolicySpec {
    PolicySpec {
        salt: "model-x".into(),
        ..PolicySpec::named(name)
    }
}

#[test]
fn exact_residency_learns_only_from_events() {
    let mut p = build(&exact_spec("exact-residency")).unwrap();
    let f = fleet(3);
    let tokens: Vec<u32> = (0..64).collect();
    let keys = exact_keys(&tokens);
    // Routing alone teaches it nothing.
    let d = p.decide(&req(None, &keys, 0), &f).unwrap();
    assert_eq!(d.branch, Branch::Miss);
    p.on_served(&req(None, &keys, 0), d.replica);
    assert_eq!(
        p.decide(&req(None, &keys, 1), &f).unwrap().branch,
        Branch::Miss
    );
    // Replica 1 reports the first three blocks, with its own hashes.
    let ev = KvEvent::Stored {
        block_hashes: vec![11, 12, 13],
        parent_block_hash: None,
        token_ids: tokens[..48].to_vec(),
        block_size: 16,
        cache_salt: None,
    };
    p.on_kv_event(1, &ev, 2);
    let d = p.decide(&req(None, &keys, u64::MAX / 4), &f).unwrap();
    assert_eq!(
        (d.replica, d.branch, d.predicted_match_tokens),
        (1, Branch::Match, 48)
    );
    p.on_kv_event(
        1,
        &KvEvent::Removed {
            block_hashes: vec![12],
        },
        3,
    );
    assert_eq!(
        p.decide(&req(None, &keys, 4), &f)
            .unwrap()
            .predicted_match_blocks,
        1
    );
    p.on_kv_event(1, &KvEvent::AllCleared, 5);
    assert_eq!(
        p.decide(&req(None, &keys, 6), &f).unwrap().branch,
        Branch::Miss
    );
}

#[test]
fn exact_residency_speculative_layer_bridges_until_events_arrive() {
    let mut p = build(&exact_spec("exact-residency-spec")).unwrap();
    let f = fleet(3);
    let tokens: Vec<u32> = (100..164).collect();
    let keys = exact_keys(&tokens);
    let d = served(p.as_mut(), &keys, &f, 0);
    assert_eq!(d.branch, Branch::Miss);
    // Within the speculative TTL (2 s) the routed replica is believed to hold it all.
    let again = p.decide(&req(None, &keys, 1_000_000), &f).unwrap();
    assert_eq!(
        (again.replica, again.predicted_match_blocks),
        (d.replica, 4)
    );
    // The engine confirms two blocks; the rest lapses after the speculative TTL.
    let ev = KvEvent::Stored {
        block_hashes: vec![1, 2],
        parent_block_hash: None,
        token_ids: tokens[..32].to_vec(),
        block_size: 16,
        cache_salt: None,
    };
    p.on_kv_event(d.replica, &ev, 1_500_000);
    let later = p.decide(&req(None, &keys, 10_000_000), &f).unwrap();
    assert_eq!(
        (later.replica, later.predicted_match_blocks),
        (d.replica, 2)
    );
}

#[test]
fn ring_copes_with_replicas_joining_and_ids_out_of_order() {
    let mut p = policy("session-affinity");
    let f: Vec<ReplicaView> = [7u32, 3, 11].into_iter().map(ReplicaView::idle).collect();
    let a = owners(p.as_mut(), &f, 500);
    // Same ids in another order: same owners.
    let g: Vec<ReplicaView> = [11u32, 7, 3].into_iter().map(ReplicaView::idle).collect();
    assert_eq!(owners(p.as_mut(), &g, 500), a);
    // A replica joins: only sessions that move to it move.
    let mut h = f.clone();
    h.push(ReplicaView::idle(12));
    let b = owners(p.as_mut(), &h, 500);
    assert!(a.iter().zip(&b).all(|(x, y)| x == y || *y == 12));
    assert!(b.contains(&12));
}

/// `served_needs` is a promise: the router skips `on_served` (and its lock) when it says so.
/// Differential check per policy: one instance gets every `on_served`, its twin only the calls
/// `served_needs` asks for; over seeded decisions, some served elsewhere (a retry), events and
/// load changes, both must decide the same every time.
#[test]
fn skipping_the_calls_served_needs_waives_changes_no_decision() {
    use rand::{Rng, SeedableRng};
    for name in POLICY_NAMES {
        let mut all = policy(name);
        let mut needed = policy(name);
        let needs = needed.served_needs();
        let exact = all.keying() == Keying::ExactTokens;
        let mut rng = rand_pcg::Pcg64Mcg::seed_from_u64(11);
        let mut f = fleet(4);
        for step in 0..3000u64 {
            for r in f.iter_mut() {
                r.outstanding = rng.random_range(0..6);
            }
            let session = format!("s{}", rng.random_range(0..40));
            let keys = if exact {
                let tokens: Vec<u32> = (0..rng.random_range(16..160u32))
                    .map(|t| t % 50 + rng.random_range(0..2))
                    .collect();
                token_block_keys(b"", &tokens, 16)
            } else {
                sharing(rng.random_range(0..4), rng.random_range(0..8), 6)
            };
            let now = step * 1_000;
            let r = req(Some(&session), &keys, now);
            let a = all.decide(&r, &f).unwrap();
            let b = needed.decide(&r, &f).unwrap();
            assert_eq!(a, b, "{name}: step {step}");
            // One request in eight is served by another replica than decided (a retry).
            let served = if rng.random_range(0..8) == 0 {
                (a.replica + 1 + rng.random_range(0..3)) % 4
            } else {
                a.replica
            };
            all.on_served(&r, served);
            if needs.call(a.replica, served) {
                needed.on_served(&r, served);
            }
            if exact && step % 5 == 0 {
                let tokens: Vec<u32> = (0..32).map(|t| t % 50).collect();
                let ev = KvEvent::Stored {
                    block_hashes: vec![step, step + 1],
                    parent_block_hash: None,
                    token_ids: tokens,
                    block_size: 16,
                    cache_salt: None,
                };
                all.on_kv_event((step % 4) as u32, &ev, now);
                needed.on_kv_event((step % 4) as u32, &ev, now);
            }
        }
    }
}
