//! Small statistics used throughout: quantiles (`schema::stats`), median-with-range, ordinary
//! least squares.

use serde::{Deserialize, Serialize};

/// The one percentile definition (R type 7, linear interpolation between closest ranks; p50 of an
/// even count is the mean of the middle two), shared with the driver and the simulator.
pub use schema::stats::{median, quantile};

/// Arithmetic mean; `None` when empty.
pub fn mean(values: &[f64]) -> Option<f64> {
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}

/// A figure across repetitions: the median with the range beside it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    /// Median over repetitions.
    pub median: f64,
    /// Smallest repetition.
    pub min: f64,
    /// Largest repetition.
    pub max: f64,
    /// Repetitions it rests on.
    pub n: usize,
}

impl Spread {
    /// The spread of `values`; `None` when empty.
    pub fn of(values: &[f64]) -> Option<Spread> {
        let median = median(values)?;
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        Some(Spread {
            median,
            min,
            max,
            n: values.len(),
        })
    }

    /// Whether the two closed ranges share any point.
    pub fn overlaps(&self, other: &Spread) -> bool {
        self.min <= other.max && other.min <= self.max
    }
}

/// Ordinary least squares fit of `y = a + b·x` with the slope's t-statistic.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Ols {
    /// Points fitted.
    pub n: usize,
    /// Intercept.
    pub intercept: f64,
    /// Slope (units of y per unit of x).
    pub slope: f64,
    /// Standard error of the slope.
    pub slope_se: f64,
    /// slope / slope_se; `None` when the residuals are exactly zero and the slope is not (a
    /// perfect line: the t-statistic is unbounded).
    pub t_stat: Option<f64>,
    /// Mean of y.
    pub y_mean: f64,
}

/// Fits `y = a + b·x`; `None` with fewer than 3 points or when every x is equal.
pub fn ols(x: &[f64], y: &[f64]) -> Option<Ols> {
    let n = x.len().min(y.len());
    if n < 3 {
        return None;
    }
    let (x, y) = (&x[..n], &y[..n]);
    let x_mean = mean(x)?;
    let y_mean = mean(y)?;
    let sxx: f64 = x.iter().map(|xi| (xi - x_mean).powi(2)).sum();
    if sxx <= 0.0 {
        return None;
    }
    let sxy: f64 = x
        .iter()
        .zip(y)
        .map(|(xi, yi)| (xi - x_mean) * (yi - y_mean))
        .sum();
    let slope = sxy / sxx;
    let intercept = y_mean - slope * x_mean;
    let sse: f64 = x
        .iter()
        .zip(y)
        .map(|(xi, yi)| (yi - intercept - slope * xi).powi(2))
        .sum();
    let slope_se = (sse / (n as f64 - 2.0) / sxx).sqrt();
    // Rounding leaves a tiny residual on exact lines; treat it as zero relative to the data.
    let scale = y.iter().map(|v| v.abs()).fold(0.0, f64::max).max(1e-300);
    let t_stat = if slope_se > 1e-12 * scale {
        Some(slope / slope_se)
    } else if slope == 0.0 {
        Some(0.0)
    } else {
        None
    };
    Some(Ols {
        n,
        intercept,
        slope,
        slope_se,
        t_stat,
        y_mean,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_overlap_is_closed_interval() {
        let a = Spread::of(&[1.0, 2.0, 3.0]).unwrap();
        let b = Spread::of(&[3.0, 4.0, 5.0]).unwrap();
        let c = Spread::of(&[3.5, 4.0]).unwrap();
        assert!(a.overlaps(&b));
        assert!(!a.overlaps(&c));
        assert_eq!((a.median, a.min, a.max, a.n), (2.0, 1.0, 3.0, 3));
    }

    #[test]
    fn ols_recovers_a_noisy_slope() {
        let x: Vec<f64> = (0..10).map(f64::from).collect();
        let y: Vec<f64> = x
            .iter()
            .enumerate()
            .map(|(i, xi)| 5.0 + 2.0 * xi + if i % 2 == 0 { 0.5 } else { -0.5 })
            .collect();
        let fit = ols(&x, &y).unwrap();
        assert!((fit.slope - 2.0).abs() < 0.1, "{fit:?}");
        assert!(fit.t_stat.unwrap() > 20.0);
        let flat = ols(&x, &[7.0; 10]).unwrap();
        assert_eq!((flat.slope, flat.t_stat), (0.0, Some(0.0)));
        let exact = ols(&x, &x).unwrap();
        assert_eq!(exact.t_stat, None);
        assert!(ols(&[1.0, 1.0, 1.0], &[1.0, 2.0, 3.0]).is_none());
    }
}
