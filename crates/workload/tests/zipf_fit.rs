//! Fixed-seed chi-square goodness of fit of the Zipf sampler against its exact pmf.

use rand::SeedableRng;
use rand_pcg::Pcg64;
use statrs::distribution::{ChiSquared, ContinuousCDF};
use workload::{PrefixGroups, Sizing, WorkloadSpec, Zipf, layout};

/// Chi-square statistic and degrees of freedom of `counts` against `pmf`, merging the tail so
/// that every bin expects at least 5 draws (the usual validity condition).
fn chi_square(counts: &[u64], pmf: &[f64], draws: u64) -> (f64, f64) {
    let mut stat = 0.0;
    let mut bins = 0u32;
    let (mut obs, mut exp) = (0.0, 0.0);
    for (c, p) in counts.iter().zip(pmf) {
        obs += *c as f64;
        exp += p * draws as f64;
        if exp >= 5.0 {
            stat += (obs - exp) * (obs - exp) / exp;
            bins += 1;
            obs = 0.0;
            exp = 0.0;
        }
    }
    if exp > 0.0 {
        stat += (obs - exp) * (obs - exp) / exp;
        bins += 1;
    }
    (stat, f64::from(bins - 1))
}

fn sample_counts(z: &Zipf, seed: u64, draws: u64) -> Vec<u64> {
    let mut rng = Pcg64::seed_from_u64(seed);
    let mut counts = vec![0u64; z.len()];
    for _ in 0..draws {
        counts[z.sample(&mut rng)] += 1;
    }
    counts
}

#[test]
fn samples_fit_the_exact_pmf() {
    let draws = 200_000;
    for (n, s) in [(50usize, 0.0), (50, 1.0), (50, 1.4), (1_000, 1.0), (1, 1.4)] {
        let z = Zipf::new(n, s).unwrap();
        let pmf: Vec<f64> = (0..n).map(|k| z.pmf(k)).collect();
        let counts = sample_counts(&z, 12_345, draws);
        let (stat, dof) = chi_square(&counts, &pmf, draws);
        if dof == 0.0 {
            assert_eq!(counts[0], draws);
            continue;
        }
        let critical = ChiSquared::new(dof).unwrap().inverse_cdf(0.999);
        assert!(
            stat < critical,
            "n {n} s {s}: chi2 {stat} >= {critical} (dof {dof})"
        );
    }
}

#[test]
fn the_test_rejects_a_wrong_exponent() {
    // Power check: draws from s = 1.0 must fail against the s = 1.4 pmf, else the fit test
    // above would pass anything.
    let draws = 200_000;
    let truth = Zipf::new(50, 1.0).unwrap();
    let claimed = Zipf::new(50, 1.4).unwrap();
    let pmf: Vec<f64> = (0..50).map(|k| claimed.pmf(k)).collect();
    let (stat, dof) = chi_square(&sample_counts(&truth, 12_345, draws), &pmf, draws);
    let critical = ChiSquared::new(dof).unwrap().inverse_cdf(0.999);
    assert!(stat > critical);
}

/// Group membership counts of `conversations` conversations with `groups` groups at skew `s`.
fn group_counts(groups: u32, s: f64, conversations: u32) -> Vec<u64> {
    let spec = WorkloadSpec {
        sizing: Sizing::Conversations(conversations),
        prefix_groups: Some(PrefixGroups {
            count: groups,
            prefix_tokens: 64,
            zipf_s: s,
        }),
        ..WorkloadSpec::default()
    };
    let mut counts = vec![0u64; groups as usize];
    for g in layout(&spec).unwrap().groups {
        counts[g as usize] += 1;
    }
    counts
}

#[test]
fn group_membership_fits_its_own_skew() {
    // Conversations join groups by a Zipf law with the group skew, whatever the conversation
    // skew (which only orders their popularity).
    let draws = 200_000u32;
    for (g, s) in [(16u32, 0.0), (16, 1.0), (16, 1.4), (200, 1.0)] {
        let z = Zipf::new(g as usize, s).unwrap();
        let pmf: Vec<f64> = (0..g as usize).map(|k| z.pmf(k)).collect();
        let (stat, dof) = chi_square(&group_counts(g, s, draws), &pmf, u64::from(draws));
        let critical = ChiSquared::new(dof).unwrap().inverse_cdf(0.999);
        assert!(
            stat < critical,
            "groups {g} s {s}: chi2 {stat} >= {critical} (dof {dof})"
        );
    }
    // Power: membership drawn at s = 1 fails against the s = 1.4 pmf.
    let claimed = Zipf::new(16, 1.4).unwrap();
    let pmf: Vec<f64> = (0..16).map(|k| claimed.pmf(k)).collect();
    let (stat, dof) = chi_square(&group_counts(16, 1.0, draws), &pmf, u64::from(draws));
    assert!(stat > ChiSquared::new(dof).unwrap().inverse_cdf(0.999));
}
