//! Float64 host references: a seeded generator, a tiny row-major tensor, and comparisons.

use burn::prelude::*;
use burn::tensor::{DType, TensorData};

use crate::harness::{Fail, Measured, mismatch};

/// xorshift64* — deterministic inputs, no dependency.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `[0, 1)`.
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// `n` values uniform in `[lo, hi)`.
    pub(crate) fn vec(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| lo + (hi - lo) * self.unit()).collect()
    }

    /// `n` integers uniform in `[lo, hi)`.
    pub(crate) fn ints(&mut self, n: usize, lo: i64, hi: i64) -> Vec<i64> {
        (0..n).map(|_| lo + (self.next_u64() % (hi - lo) as u64) as i64).collect()
    }
}

/// A row-major f64 tensor on the host.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct H {
    pub(crate) s: Vec<usize>,
    pub(crate) v: Vec<f64>,
}

fn unravel(mut i: usize, s: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; s.len()];
    for d in (0..s.len()).rev() {
        idx[d] = i % s[d];
        i /= s[d];
    }
    idx
}

impl H {
    pub(crate) fn new(s: &[usize], v: Vec<f64>) -> Self {
        assert_eq!(s.iter().product::<usize>(), v.len(), "host tensor shape");
        Self { s: s.to_vec(), v }
    }

    pub(crate) fn at(&self, idx: &[usize]) -> f64 {
        let mut flat = 0;
        for (i, n) in idx.iter().zip(&self.s) {
            flat = flat * n + i;
        }
        self.v[flat]
    }

    /// Builds a tensor of shape `s` from a function of the multi-index.
    pub(crate) fn from_fn(s: &[usize], f: impl Fn(&[usize]) -> f64) -> Self {
        let n = s.iter().product();
        Self::new(s, (0..n).map(|i| f(&unravel(i, s))).collect())
    }

    pub(crate) fn map(&self, f: impl Fn(f64) -> f64) -> Self {
        Self { s: self.s.clone(), v: self.v.iter().map(|&x| f(x)).collect() }
    }

    /// Broadcast binary op (equal ranks, sizes equal or 1).
    pub(crate) fn zip(&self, o: &Self, f: impl Fn(f64, f64) -> f64) -> Self {
        let s: Vec<usize> = self.s.iter().zip(&o.s).map(|(a, b)| *a.max(b)).collect();
        let pick = |t: &Self, idx: &[usize]| -> f64 {
            let j: Vec<usize> = idx.iter().zip(&t.s).map(|(i, n)| if *n == 1 { 0 } else { *i }).collect();
            t.at(&j)
        };
        Self::from_fn(&s, |idx| f(pick(self, idx), pick(o, idx)))
    }

    /// Reduces `dim` (kept with size 1) with `f` over the values of each fibre.
    pub(crate) fn reduce(&self, dim: usize, f: impl Fn(&[f64]) -> f64) -> Self {
        let mut s = self.s.clone();
        s[dim] = 1;
        Self::from_fn(&s, |idx| {
            let mut j = idx.to_vec();
            let fibre: Vec<f64> = (0..self.s[dim])
                .map(|k| {
                    j[dim] = k;
                    self.at(&j)
                })
                .collect();
            f(&fibre)
        })
    }

    pub(crate) fn sum_dim(&self, dim: usize) -> Self {
        self.reduce(dim, |x| x.iter().sum())
    }

    pub(crate) fn abs_sum_dim(&self, dim: usize) -> Self {
        self.reduce(dim, |x| x.iter().map(|v| v.abs()).sum())
    }

    pub(crate) fn permute(&self, axes: &[usize]) -> Self {
        let s: Vec<usize> = axes.iter().map(|&a| self.s[a]).collect();
        Self::from_fn(&s, |idx| {
            let mut j = vec![0; idx.len()];
            for (k, &a) in axes.iter().enumerate() {
                j[a] = idx[k];
            }
            self.at(&j)
        })
    }

    pub(crate) fn reshape(&self, s: &[usize]) -> Self {
        Self::new(s, self.v.clone())
    }

    /// `[start, end)` along each dim.
    pub(crate) fn slice(&self, r: &[(usize, usize)]) -> Self {
        let s: Vec<usize> = r.iter().map(|(a, b)| b - a).collect();
        Self::from_fn(&s, |idx| {
            let j: Vec<usize> = idx.iter().zip(r).map(|(i, (a, _))| i + a).collect();
            self.at(&j)
        })
    }

    pub(crate) fn cat(parts: &[&Self], dim: usize) -> Self {
        let mut s = parts[0].s.clone();
        s[dim] = parts.iter().map(|p| p.s[dim]).sum();
        Self::from_fn(&s, |idx| {
            let mut j = idx.to_vec();
            for p in parts {
                if j[dim] < p.s[dim] {
                    return p.at(&j);
                }
                j[dim] -= p.s[dim];
            }
            unreachable!()
        })
    }

    /// Batched matmul over equal leading dims; returns the product and `Σₖ|aᵢₖ·bₖⱼ|`.
    pub(crate) fn matmul(&self, o: &Self) -> (Self, Self) {
        let r = self.s.len();
        let (m, k, n) = (self.s[r - 2], self.s[r - 1], o.s[r - 1]);
        let mut s = self.s.clone();
        s[r - 1] = n;
        let prod = |abs: bool| {
            Self::from_fn(&s, |idx| {
                let (mut ia, mut ib) = (idx.to_vec(), idx.to_vec());
                let (i, j) = (idx[r - 2], idx[r - 1]);
                debug_assert!(i < m);
                (0..k)
                    .map(|kk| {
                        ia[r - 1] = kk;
                        ib[r - 2] = kk;
                        ib[r - 1] = j;
                        let p = self.at(&ia) * o.at(&ib);
                        if abs { p.abs() } else { p }
                    })
                    .sum()
            })
        };
        (prod(false), prod(true))
    }

    /// Softmax along the last dim.
    pub(crate) fn softmax(&self) -> Self {
        let d = self.s.len() - 1;
        let m = self.reduce(d, |x| x.iter().cloned().fold(f64::NEG_INFINITY, f64::max));
        let e = self.zip(&m, |x, m| (x - m).exp());
        let z = e.sum_dim(d);
        e.zip(&z, |x, z| x / z)
    }

    /// Log-softmax along the last dim.
    pub(crate) fn log_softmax(&self) -> Self {
        let d = self.s.len() - 1;
        let m = self.reduce(d, |x| x.iter().cloned().fold(f64::NEG_INFINITY, f64::max));
        let lse = self.zip(&m, |x, m| (x - m).exp()).sum_dim(d).zip(&m, |z, m| z.ln() + m);
        self.zip(&lse, |x, l| x - l)
    }

    /// Qwen3's RMSNorm over the last dim: `w · x / sqrt(mean(x²) + eps)`.
    pub(crate) fn rms_norm(&self, w: &Self, eps: f64) -> Self {
        let d = self.s.len() - 1;
        let ms = self.reduce(d, |x| x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64);
        let mut ws = vec![1; self.s.len()];
        ws[d] = w.s[0];
        self.zip(&ms, |x, m| x / (m + eps).sqrt()).zip(&w.reshape(&ws), |a, b| a * b)
    }
}

/// Max over elements of `|a − e| / max(|e|, scaleᵢ, floor)` with `floor = 1e-3·max|e|`.
pub(crate) fn max_err(actual: &[f64], expected: &[f64], scale: Option<&[f64]>) -> Measured {
    if actual.len() != expected.len() {
        return mismatch(format!("{} values, expected {}", actual.len(), expected.len()));
    }
    let floor = 1e-3 * expected.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(f64::MIN_POSITIVE);
    let mut worst = 0.0f64;
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        if a.is_nan() != e.is_nan() {
            return mismatch(format!("element {i}: got {a}, expected {e}"));
        }
        if a.is_infinite() || e.is_infinite() {
            if a != e {
                return mismatch(format!("element {i}: got {a}, expected {e}"));
            }
            continue;
        }
        let s = scale.map_or(0.0, |s| s[i]).max(e.abs()).max(floor);
        worst = worst.max((a - e).abs() / s);
    }
    Ok(worst)
}

/// Reads a tensor's values as f64, checking its dims (and, when given, its dtype).
pub(crate) fn read<B: Backend, const D: usize, K>(
    t: Tensor<B, D, K>,
    dims: &[usize],
    dtype: Option<DType>,
) -> Result<Vec<f64>, Fail>
where
    K: burn::tensor::BasicOps<B>,
{
    if t.dims().as_slice() != dims {
        return mismatch(format!("shape {:?}, expected {dims:?}", t.dims()));
    }
    let data = t.into_data();
    if let Some(dt) = dtype
        && data.dtype != dt
    {
        return mismatch(format!("dtype {:?}, expected {dt:?}", data.dtype));
    }
    Ok(data.iter::<f64>().collect())
}

/// Compares a float tensor with a reference (same shape and, when given, dtype).
pub(crate) fn check<B: Backend, const D: usize>(t: Tensor<B, D>, e: &H, dtype: Option<DType>) -> Measured {
    let a = read(t, &e.s, dtype)?;
    max_err(&a, &e.v, None)
}

/// Compares with a reference whose per-element error scale is given (reductions, matmul).
pub(crate) fn check_scaled<B: Backend, const D: usize>(
    t: Tensor<B, D>,
    e: &H,
    scale: &H,
    dtype: DType,
) -> Measured {
    let a = read(t, &e.s, Some(dtype))?;
    max_err(&a, &e.v, Some(&scale.v))
}

/// Compares an int or bool tensor exactly.
pub(crate) fn check_exact<B: Backend, const D: usize, K>(t: Tensor<B, D, K>, e: &H) -> Measured
where
    K: burn::tensor::BasicOps<B>,
{
    let a = read(t, &e.s, None)?;
    match a.iter().zip(&e.v).position(|(x, y)| x != y) {
        None => Ok(0.0),
        Some(i) => mismatch(format!("element {i}: got {}, expected {}", a[i], e.v[i])),
    }
}

/// Uploads `v` as a float tensor of `dtype` and returns it with its values as the backend
/// stores them (rounded to `dtype`), so that references start from the same inputs.
pub(crate) fn upload<B: Backend, const D: usize>(
    v: Vec<f64>,
    s: [usize; D],
    dev: &B::Device,
    dtype: DType,
) -> (Tensor<B, D>, H) {
    let t = Tensor::<B, D>::from_data(TensorData::new(v, s), (dev, dtype));
    let back = t.to_data().iter::<f64>().collect();
    (t, H::new(&s, back))
}

/// Uniform random float input of `shape` in `[lo, hi)`.
pub(crate) fn rand_t<B: Backend, const D: usize>(
    rng: &mut Rng,
    s: [usize; D],
    lo: f64,
    hi: f64,
    dev: &B::Device,
    dtype: DType,
) -> (Tensor<B, D>, H) {
    let n = s.iter().product();
    upload(rng.vec(n, lo, hi), s, dev, dtype)
}

/// An int tensor from `i64` values.
pub(crate) fn ints<B: Backend, const D: usize>(
    v: &[i64],
    s: [usize; D],
    dev: &B::Device,
) -> Tensor<B, D, Int> {
    Tensor::from_data(TensorData::new(v.to_vec(), s), dev)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_matmul_and_softmax() {
        let a = H::new(&[2, 2], vec![1.0, 2.0, 3.0, 4.0]);
        let b = H::new(&[2, 2], vec![5.0, 6.0, 7.0, 8.0]);
        assert_eq!(a.matmul(&b).0.v, vec![19.0, 22.0, 43.0, 50.0]);
        let s = a.softmax();
        assert!((s.v[0] + s.v[1] - 1.0).abs() < 1e-15);
        assert_eq!(a.permute(&[1, 0]).v, vec![1.0, 3.0, 2.0, 4.0]);
    }

    #[test]
    fn max_err_flags_a_wrong_value() {
        assert_eq!(max_err(&[1.0, 2.0], &[1.0, 2.0], None), Ok(0.0));
        let e = max_err(&[1.0, 2.2], &[1.0, 2.0], None).unwrap();
        assert!((e - 0.1).abs() < 1e-12, "{e}");
        assert!(max_err(&[f64::NAN], &[1.0], None).is_err());
        assert!(max_err(&[1.0], &[1.0, 2.0], None).is_err());
    }
}
