//! Bounded Zipf distribution over ranks `0..n`.
//!
//! Rank `k` (0-based) has weight `1 / (k + 1)^s`. With `s = 0` every rank is equally likely;
//! `s = 1` and `s = 1.4` are the skews of the pressure grid. Because the support is finite, any
//! `s ≥ 0` is a proper distribution (no `s > 1` restriction as for the unbounded law).

use crate::WorkloadError;

/// A bounded Zipf law sampled by inverting its cumulative distribution with a binary search.
#[derive(Debug, Clone, PartialEq)]
pub struct Zipf {
    /// `cdf[k]` = P(rank ≤ k); the last entry is exactly 1.
    cdf: Vec<f64>,
    exponent: f64,
}

impl Zipf {
    /// Builds the law over `n` ranks with exponent `s`.
    ///
    /// Errors when `n` is zero or `s` is negative or not finite.
    pub fn new(n: usize, s: f64) -> Result<Self, WorkloadError> {
        if n == 0 {
            return Err(WorkloadError::InvalidSpec(
                "zipf: need at least one conversation".into(),
            ));
        }
        if !s.is_finite() || s < 0.0 {
            return Err(WorkloadError::InvalidSpec(format!(
                "zipf: exponent must be finite and >= 0, got {s}"
            )));
        }
        let mut cdf = Vec::with_capacity(n);
        let mut total = 0.0f64;
        for k in 0..n {
            total += Self::weight(k, s);
            cdf.push(total);
        }
        for c in &mut cdf {
            *c /= total;
        }
        // Rounding could leave the last entry a hair below 1 and make u ≈ 1 fall off the end.
        if let Some(last) = cdf.last_mut() {
            *last = 1.0;
        }
        Ok(Self { cdf, exponent: s })
    }

    fn weight(k: usize, s: f64) -> f64 {
        if s == 0.0 {
            1.0
        } else {
            ((k + 1) as f64).powf(-s)
        }
    }

    /// Number of ranks.
    pub fn len(&self) -> usize {
        self.cdf.len()
    }

    /// Always false: a Zipf law has at least one rank.
    pub fn is_empty(&self) -> bool {
        self.cdf.is_empty()
    }

    /// The exponent `s`.
    pub fn exponent(&self) -> f64 {
        self.exponent
    }

    /// Exact probability of rank `k` (0 outside the support).
    pub fn pmf(&self, k: usize) -> f64 {
        match k {
            0 => self.cdf.first().copied().unwrap_or(0.0),
            k if k < self.cdf.len() => self.cdf[k] - self.cdf[k - 1],
            _ => 0.0,
        }
    }

    /// Maps a uniform draw `u ∈ [0, 1)` to a rank: the first `k` with `cdf[k] > u`.
    pub fn sample_from_uniform(&self, u: f64) -> usize {
        let k = self.cdf.partition_point(|&c| c <= u);
        k.min(self.cdf.len() - 1)
    }

    /// Draws a rank with `rng`.
    pub fn sample<R: rand::Rng + ?Sized>(&self, rng: &mut R) -> usize {
        self.sample_from_uniform(rng.random::<f64>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pmf_sums_to_one_and_decreases() {
        for s in [0.0, 1.0, 1.4] {
            let z = Zipf::new(100, s).unwrap();
            let sum: f64 = (0..100).map(|k| z.pmf(k)).sum();
            assert!((sum - 1.0).abs() < 1e-12);
            for k in 1..100 {
                assert!(z.pmf(k) <= z.pmf(k - 1) + 1e-15);
            }
        }
        let u = Zipf::new(4, 0.0).unwrap();
        assert!((u.pmf(2) - 0.25).abs() < 1e-15);
        let z = Zipf::new(2, 1.0).unwrap();
        assert!((z.pmf(0) - 2.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn inversion_edges() {
        let z = Zipf::new(3, 0.0).unwrap();
        assert_eq!(z.sample_from_uniform(0.0), 0);
        assert_eq!(z.sample_from_uniform(0.34), 1);
        assert_eq!(z.sample_from_uniform(0.999_999), 2);
        assert_eq!(z.sample_from_uniform(1.0), 2);
    }

    #[test]
    fn rejects_bad_parameters() {
        assert!(Zipf::new(0, 1.0).is_err());
        assert!(Zipf::new(5, -0.1).is_err());
        assert!(Zipf::new(5, f64::NAN).is_err());
    }
}
