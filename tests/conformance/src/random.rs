//! Random ops: sample statistics of `Tensor::random` against the distribution's moments.
//!
//! The error of a statistic is measured in standard errors (`|m − μ| / SE`, with `SE` from
//! the distribution's moments at N = 100 000), so the tolerance is a number of standard
//! errors: [`Z_TOL`]. A fixed backend seed keeps the samples the same from run to run.

use burn::prelude::*;
use burn::tensor::{DType, Distribution};

use crate::harness::{Measured, Runner, mismatch};

/// Samples per statistic.
pub(crate) const N: usize = 100_000;
/// Allowed deviation of a sample mean or variance, in standard errors.
pub(crate) const Z_TOL: f64 = 5.0;

/// Moments of a distribution: mean, variance, fourth central moment, support `[lo, hi]`.
struct Moments {
    mean: f64,
    var: f64,
    mu4: f64,
    lo: f64,
    hi: f64,
}

fn moments(dist: Distribution) -> Moments {
    match dist {
        Distribution::Default => moments(Distribution::Uniform(0.0, 1.0)),
        Distribution::Uniform(a, b) => {
            let w = b - a;
            Moments { mean: (a + b) / 2.0, var: w * w / 12.0, mu4: w.powi(4) / 80.0, lo: a, hi: b }
        }
        Distribution::Normal(m, s) => {
            Moments { mean: m, var: s * s, mu4: 3.0 * s.powi(4), lo: f64::NEG_INFINITY, hi: f64::INFINITY }
        }
        Distribution::Bernoulli(p) => {
            let q = 1.0 - p;
            Moments { mean: p, var: p * q, mu4: p * q * (1.0 - 3.0 * p * q), lo: 0.0, hi: 1.0 }
        }
    }
}

/// Mean and variance of `samples` checked against `dist`, in standard errors.
pub(crate) fn z_scores(samples: &[f64], dist: Distribution) -> Measured {
    let m = moments(dist);
    let n = samples.len() as f64;
    if let Some(x) = samples.iter().find(|x| !(m.lo..=m.hi).contains(*x)) {
        return mismatch(format!("sample {x} outside [{}, {}]", m.lo, m.hi));
    }
    if let Distribution::Bernoulli(_) = dist
        && let Some(x) = samples.iter().find(|x| **x != 0.0 && **x != 1.0)
    {
        return mismatch(format!("Bernoulli sample {x} is neither 0 nor 1"));
    }
    let mean = samples.iter().sum::<f64>() / n;
    let var = samples.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    let z_mean = (mean - m.mean).abs() / (m.var / n).sqrt();
    let z_var = (var - m.var).abs() / ((m.mu4 - m.var * m.var) / n).sqrt();
    Ok(z_mean.max(z_var))
}

/// Random cases, named `<label>/random/<dist>`.
pub(crate) fn random_cases<B: Backend>(r: &mut Runner<'_>, label: &str, dev: &B::Device) {
    let dists = [
        ("default", Distribution::Default),
        ("uniform", Distribution::Uniform(-1.0, 3.0)),
        ("normal", Distribution::Normal(0.5, 2.0)),
        ("normal.init_std", Distribution::Normal(0.0, 0.02)),
        ("bernoulli", Distribution::Bernoulli(0.3)),
    ];
    for (i, (name, dist)) in dists.into_iter().enumerate() {
        r.case(format!("{label}/random/{name}"), Z_TOL, || {
            B::seed(dev, 1234 + i as u64);
            let t = Tensor::<B, 2>::random([N / 100, 100], dist, dev);
            let samples: Vec<f64> = t.into_data().iter::<f64>().collect();
            z_scores(&samples, dist)
        });
    }
    r.case(format!("{label}/random/seeded_is_reproducible"), 0.0, || {
        let draw = || {
            B::seed(dev, 99);
            Tensor::<B, 1>::random([1000], Distribution::Normal(0.0, 1.0), dev).into_data()
        };
        if draw() == draw() { Ok(0.0) } else { mismatch("two draws after the same seed differ") }
    });
    r.case(format!("{label}/random/uniform_bf16_dtype"), Z_TOL, || {
        if !B::supports_dtype(dev, DType::BF16) {
            return Err(crate::harness::Fail::Skip("backend does not support BF16".into()));
        }
        B::seed(dev, 7);
        let dist = Distribution::Uniform(-1.0, 1.0);
        let t = Tensor::<B, 1>::random([N], dist, (dev, DType::BF16));
        if t.dtype() != DType::BF16 {
            return mismatch(format!("dtype {:?}, expected BF16", t.dtype()));
        }
        z_scores(&t.into_data().iter::<f64>().collect::<Vec<_>>(), dist)
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::Rng;

    #[test]
    fn z_scores_accept_good_and_reject_bad_samples() {
        let mut g = Rng::new(5);
        let u: Vec<f64> = (0..N).map(|_| g.unit()).collect();
        assert!(z_scores(&u, Distribution::Default).unwrap() < Z_TOL);
        // Same samples, claimed to be U(0, 1.1): the mean is off by ~30 standard errors.
        assert!(z_scores(&u, Distribution::Uniform(0.0, 1.1)).unwrap() > Z_TOL);
        assert!(z_scores(&[0.5, 2.0], Distribution::Default).is_err());
    }
}
