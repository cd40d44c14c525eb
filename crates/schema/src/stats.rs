//! The one percentile definition: linear interpolation between closest ranks (Hyndman & Fan
//! type 7; R's and NumPy's default). With `n` values sorted, `q` in [0, 1] falls at rank
//! `h = (n − 1)·q`; the quantile is `v[⌊h⌋] + (h − ⌊h⌋)·(v[⌈h⌉] − v[⌊h⌋])`. So p50 of an even count is
//! the mean of the two middle values (the per-request ITL p50 of docs/ARCHITECTURE.md,
//! "Metrics"), p0 is the minimum and p100 the maximum.
//!
//! Every crate that reports a percentile uses it — the analysis (published reports), the
//! driver (per-request ITL p50 in `client.csv`, the run summary), the simulator (the same rows,
//! its cell summary) — so a number computed in two places agrees by construction. Why type 7
//! and not nearest rank: crates/schema/README.md.

/// Quantile `q` (clamped to [0, 1]) of `values` by linear interpolation (type 7). `None` when
/// empty. `values` is left as it was; see [`quantile_in_place`] to avoid the copy.
pub fn quantile(values: &[f64], q: f64) -> Option<f64> {
    quantile_in_place(&mut values.to_vec(), q)
}

/// Median of `values` (see [`quantile`]): the mean of the middle two for an even count.
pub fn median(values: &[f64]) -> Option<f64> {
    quantile(values, 0.5)
}

/// [`quantile`] without the copy: `values` is reordered (a partial selection, `O(n)`), its
/// content unchanged, so several quantiles can be taken from one slice.
pub fn quantile_in_place(values: &mut [f64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let h = (values.len() - 1) as f64 * q.clamp(0.0, 1.0);
    let lo = h.floor() as usize;
    let hi = h.ceil() as usize;
    let (_, &mut lo_v, above) = values.select_nth_unstable_by(lo, f64::total_cmp);
    // Everything above rank `lo` sorts at or after it: the smallest of it is rank `lo + 1`.
    let hi_v = if hi == lo {
        lo_v
    } else {
        above.iter().copied().min_by(f64::total_cmp)?
    };
    Some(lo_v + (h - lo as f64) * (hi_v - lo_v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn quantile_interpolates_between_ranks() {
        assert_eq!(quantile(&[4.0, 1.0, 3.0, 2.0], 0.5), Some(2.5));
        assert_eq!(quantile(&[1.0, 2.0, 3.0], 0.5), Some(2.0));
        assert_eq!(quantile(&[10.0], 0.99), Some(10.0));
        let v: Vec<f64> = (1..=101).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.99), Some(100.0));
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), Some(50.5));
        let p90 = quantile(&v, 0.9).unwrap();
        assert!((p90 - 90.1).abs() < 1e-9, "{p90}");
        assert_eq!(quantile(&v, 0.0), Some(1.0));
        assert_eq!(quantile(&v, 1.0), Some(100.0));
        assert_eq!(quantile(&v, 2.0), Some(100.0), "q is clamped");
        assert_eq!(quantile(&[], 0.5), None);
        assert_eq!(median(&[5.0, 5.0, 9.0, 1.0]), Some(5.0));
    }

    /// The definition as written: sort, then interpolate.
    fn by_sorting(values: &[f64], q: f64) -> Option<f64> {
        if values.is_empty() {
            return None;
        }
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let h = (v.len() - 1) as f64 * q.clamp(0.0, 1.0);
        let (lo, hi) = (h.floor() as usize, h.ceil() as usize);
        Some(v[lo] + (h - lo as f64) * (v[hi] - v[lo]))
    }

    proptest! {
        #[test]
        fn selection_gives_the_sorted_definition_bit_for_bit(
            values in prop::collection::vec(-1e6f64..1e6, 0..64),
            q in 0.0f64..=1.0,
        ) {
            let want = by_sorting(&values, q).map(f64::to_bits);
            prop_assert_eq!(quantile(&values, q).map(f64::to_bits), want);
            let mut scratch = values.clone();
            prop_assert_eq!(quantile_in_place(&mut scratch, q).map(f64::to_bits), want);
            scratch.sort_by(f64::total_cmp);
            let mut sorted = values.clone();
            sorted.sort_by(f64::total_cmp);
            prop_assert_eq!(scratch, sorted, "the content is unchanged");
        }

        #[test]
        fn integer_medians_are_exact(gaps in prop::collection::vec(0u32..5_000_000, 1..64)) {
            // The simulator's ITL gaps are whole µs: the median is a whole or half µs, exactly.
            let mut v: Vec<f64> = gaps.iter().map(|&g| f64::from(g)).collect();
            let m = quantile_in_place(&mut v, 0.5).unwrap();
            let mut s = gaps.clone();
            s.sort_unstable();
            let n = s.len();
            let twice = if n % 2 == 1 {
                2 * u64::from(s[n / 2])
            } else {
                u64::from(s[n / 2 - 1]) + u64::from(s[n / 2])
            };
            prop_assert_eq!(m * 2.0, twice as f64);
        }
    }
}
