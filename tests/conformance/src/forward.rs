//! Forward float cases, run once per float dtype on a plain backend.

use burn::prelude::*;
use burn::tensor::activation::{gelu, log_softmax, relu, sigmoid, silu, softmax};
use burn::tensor::{DType, TensorData, bf16, f16};

use crate::harness::{Family, Measured, Runner, dtype_name, mismatch, tol};
use crate::host::{H, Rng, check, check_exact, check_scaled, ints, rand_t, upload};

/// Rounds a value to `dtype` on the host.
pub(crate) fn round_to(x: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F64 => x,
        DType::BF16 => bf16::from_f64(x).to_f64(),
        DType::F16 => f16::from_f64(x).to_f64(),
        _ => x as f32 as f64,
    }
}

/// `erf` in f64: Taylor series below 2, `1 − erfc` above.
pub(crate) fn erf(x: f64) -> f64 {
    if x.abs() >= 2.0 {
        return x.signum() * (1.0 - erfc_large(x.abs()));
    }
    let (mut term, mut sum) = (x, x);
    for n in 1..200 {
        term *= -x * x / n as f64;
        let t = term / (2 * n + 1) as f64;
        sum += t;
        if t.abs() < 1e-17 * sum.abs() {
            break;
        }
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

/// `erfc(z)` for `z ≥ 2` by its continued fraction (modified Lentz), to ~1e-16 relative.
fn erfc_large(z: f64) -> f64 {
    // erfc(z) = exp(−z²)/√π · 1/(z + (1/2)/(z + 1/(z + (3/2)/(z + 2/(z + …)))))
    let tiny = 1e-300;
    let (mut f, mut c, mut d) = (z, z, 0.0);
    for k in 1..300 {
        let a = k as f64 / 2.0;
        d = z + a * d;
        d = if d.abs() < tiny { tiny } else { d };
        c = z + a / c;
        c = if c.abs() < tiny { tiny } else { c };
        d = 1.0 / d;
        let delta = c * d;
        f *= delta;
        if (delta - 1.0).abs() < 1e-16 {
            break;
        }
    }
    (-z * z).exp() / std::f64::consts::PI.sqrt() / f
}

/// `1 + erf(x)` without cancellation for negative `x`.
pub(crate) fn one_plus_erf(x: f64) -> f64 {
    if x < -2.0 { erfc_large(-x) } else { 1.0 + erf(x) }
}

pub(crate) fn sigmoid_f(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn max_of(results: impl IntoIterator<Item = Measured>) -> Measured {
    let mut worst = 0.0f64;
    for r in results {
        worst = worst.max(r?);
    }
    Ok(worst)
}

/// Rotary tables `[t, d]` (HF layout: `cat(freqs, freqs)`).
pub(crate) fn rope_tables(t: usize, d: usize, theta: f64) -> (H, H) {
    let ang = |idx: &[usize]| {
        let i = idx[1] % (d / 2);
        idx[0] as f64 / theta.powf(2.0 * i as f64 / d as f64)
    };
    (H::from_fn(&[t, d], |i| ang(i).cos()), H::from_fn(&[t, d], |i| ang(i).sin()))
}

/// Host reference of `x·cos + rotate_half(x)·sin` for `x: [b, h, t, d]`.
pub(crate) fn rope_host(x: &H, cos: &H, sin: &H) -> H {
    let d = x.s[3];
    H::from_fn(&x.s, |i| {
        let j = i[3];
        let mut k = i.to_vec();
        let rot = if j < d / 2 {
            k[3] = j + d / 2;
            -x.at(&k)
        } else {
            k[3] = j - d / 2;
            x.at(&k)
        };
        x.at(i) * cos.at(&[i[2], j]) + rot * sin.at(&[i[2], j])
    })
}

/// Causal attention `softmax(mask(q·kᵀ/√d))·v` on the host, `[b, h, t, d]`.
pub(crate) fn attention_host(q: &H, k: &H, v: &H) -> H {
    let scale = (q.s[3] as f64).powf(-0.5);
    let (scores, _) = q.matmul(&k.permute(&[0, 1, 3, 2]));
    let masked =
        H::from_fn(&scores.s, |i| if i[3] > i[2] { f64::NEG_INFINITY } else { scores.at(i) * scale });
    masked.softmax().matmul(v).0
}

/// Every forward float case for `dtype`, named `<label>/<dtype>/<op>`.
pub(crate) fn float_cases<B: Backend>(r: &mut Runner<'_>, label: &str, dev: &B::Device, d: DType) {
    use Family::*;
    let n = |op: &str| format!("{label}/{}/{op}", dtype_name(d));
    let rng = |seed: u64| Rng::new(seed);
    let sd = Some(d);

    // ---- creation and host round trips ----
    r.case(n("creation.zeros_ones_full"), tol(Exact, d), || {
        max_of([
            check(Tensor::<B, 2>::zeros([3, 4], (dev, d)), &H::new(&[3, 4], vec![0.0; 12]), sd),
            check(Tensor::<B, 2>::ones([3, 4], (dev, d)), &H::new(&[3, 4], vec![1.0; 12]), sd),
            check(Tensor::<B, 3>::full([2, 3, 2], -1.5, (dev, d)), &H::new(&[2, 3, 2], vec![-1.5; 12]), sd),
            check(Tensor::<B, 2>::ones([2, 5], (dev, d)).zeros_like(), &H::new(&[2, 5], vec![0.0; 10]), sd),
        ])
    });
    r.case(n("data.from_data_into_data"), tol(Exact, d), || {
        let v = rng(1).vec(37, -100.0, 100.0);
        let t = Tensor::<B, 1>::from_data(TensorData::new(v.clone(), [37]), (dev, d));
        check(t, &H::new(&[37], v.iter().map(|&x| round_to(x, d)).collect()), sd)
    });
    r.case(n("data.into_scalar"), tol(Exact, d), || {
        let t = Tensor::<B, 1>::from_data(TensorData::new(vec![-2.5f64], [1]), (dev, d));
        let v: f64 = t.into_scalar().elem();
        if v == -2.5 { Ok(0.0) } else { mismatch(format!("into_scalar gave {v}, expected -2.5")) }
    });
    r.case(n("cast.from_f32"), tol(Exact, d), || {
        let (x, xh) = rand_t::<B, 2>(&mut rng(2), [5, 7], -3.0, 3.0, dev, DType::F32);
        check(x.cast(d), &xh.map(|v| round_to(v, d)), sd)
    });
    r.case(n("cast.to_f32_and_back"), tol(Exact, d), || {
        let (x, xh) = rand_t::<B, 2>(&mut rng(3), [5, 7], -3.0, 3.0, dev, d);
        // Exact for the half types; f64 rounds to f32.
        let e = xh.map(|v| round_to(v, DType::F32));
        let f = x.cast(DType::F32);
        max_of([check(f.clone(), &e, Some(DType::F32)), check(f.cast(d), &e, sd)])
    });
    r.case(n("cast.to_int_truncates"), tol(Exact, d), || {
        let (x, xh) = rand_t::<B, 2>(&mut rng(4), [4, 6], -9.0, 9.0, dev, d);
        check_exact(x.int(), &xh.map(f64::trunc))
    });

    // ---- shape and data movement ----
    r.case(n("reshape"), tol(Exact, d), || {
        let (x, xh) = rand_t::<B, 3>(&mut rng(5), [2, 3, 4], -1.0, 1.0, dev, d);
        max_of([
            check(x.clone().reshape([6, 4]), &xh.reshape(&[6, 4]), sd),
            check(x.clone().reshape([4, -1]), &xh.reshape(&[4, 6]), sd),
            check(x.flatten::<1>(0, 2), &xh.reshape(&[24]), sd),
        ])
    });
    r.case(n("permute.4d"), tol(Exact, d), || {
        let (x, xh) = rand_t::<B, 4>(&mut rng(6), [2, 3, 4, 5], -1.0, 1.0, dev, d);
        max_of([
            check(x.clone().permute([0, 2, 1, 3]), &xh.permute(&[0, 2, 1, 3]), sd),
            check(x.clone().permute([3, 1, 0, 2]), &xh.permute(&[3, 1, 0, 2]), sd),
            // A permuted (strided) view fed to an elementwise op and a reshape.
            check(x.permute([0, 2, 1, 3]).reshape([8, 15]), &xh.permute(&[0, 2, 1, 3]).reshape(&[8, 15]), sd),
        ])
    });
    r.case(n("swap_dims_transpose"), tol(Exact, d), || {
        let (x, xh) = rand_t::<B, 3>(&mut rng(7), [2, 3, 4], -1.0, 1.0, dev, d);
        max_of([
            check(x.clone().swap_dims(1, 2), &xh.permute(&[0, 2, 1]), sd),
            check(x.clone().transpose(), &xh.permute(&[0, 2, 1]), sd),
            check(x.swap_dims(0, 2), &xh.permute(&[2, 1, 0]), sd),
        ])
    });
    r.case(n("slice"), tol(Exact, d), || {
        let (x, xh) = rand_t::<B, 3>(&mut rng(8), [4, 5, 6], -1.0, 1.0, dev, d);
        max_of([
            check(x.clone().slice([1..3, 0..5, 2..6]), &xh.slice(&[(1, 3), (0, 5), (2, 6)]), sd),
            check(x.clone().slice([0..1, 3..5]), &xh.slice(&[(0, 1), (3, 5), (0, 6)]), sd),
            check(x.slice_dim(2, 1..4), &xh.slice(&[(0, 4), (0, 5), (1, 4)]), sd),
        ])
    });
    r.case(n("slice_assign"), tol(Exact, d), || {
        let mut g = rng(9);
        let (x, xh) = rand_t::<B, 2>(&mut g, [5, 6], -1.0, 1.0, dev, d);
        let (v, vh) = rand_t::<B, 2>(&mut g, [2, 3], 2.0, 3.0, dev, d);
        let e = H::from_fn(&[5, 6], |i| {
            if (1..3).contains(&i[0]) && (2..5).contains(&i[1]) {
                vh.at(&[i[0] - 1, i[1] - 2])
            } else {
                xh.at(i)
            }
        });
        check(x.slice_assign([1..3, 2..5], v), &e, sd)
    });
    r.case(n("narrow_chunk_split"), tol(Exact, d), || {
        let (x, xh) = rand_t::<B, 3>(&mut rng(10), [2, 3, 8], -1.0, 1.0, dev, d);
        let chunks = x.clone().chunk(2, 2);
        let splits = x.clone().split(3, 2);
        if chunks.len() != 2 || splits.len() != 3 {
            return mismatch(format!("{} chunks, {} splits", chunks.len(), splits.len()));
        }
        let mut res = vec![check(x.narrow(2, 4, 4), &xh.slice(&[(0, 2), (0, 3), (4, 8)]), sd)];
        for (i, c) in chunks.into_iter().enumerate() {
            res.push(check(c, &xh.slice(&[(0, 2), (0, 3), (4 * i, 4 * i + 4)]), sd));
        }
        for (i, c) in splits.into_iter().enumerate() {
            res.push(check(c, &xh.slice(&[(0, 2), (0, 3), (3 * i, (3 * i + 3).min(8))]), sd));
        }
        max_of(res)
    });
    r.case(n("cat_stack"), tol(Exact, d), || {
        let mut g = rng(11);
        let (a, ah) = rand_t::<B, 3>(&mut g, [2, 3, 4], -1.0, 1.0, dev, d);
        let (b, bh) = rand_t::<B, 3>(&mut g, [2, 1, 4], -1.0, 1.0, dev, d);
        let (c, ch) = rand_t::<B, 3>(&mut g, [2, 3, 2], -1.0, 1.0, dev, d);
        let stacked = H::from_fn(&[2, 2, 3, 4], |i| {
            if i[1] == 0 { ah.at(&[i[0], i[2], i[3]]) } else { ah.at(&[i[0], i[2], i[3]]) * 2.0 }
        });
        max_of([
            check(Tensor::cat(vec![a.clone(), b, a.clone()], 1), &H::cat(&[&ah, &bh, &ah], 1), sd),
            check(Tensor::cat(vec![a.clone(), c], 2), &H::cat(&[&ah, &ch], 2), sd),
            check(Tensor::stack::<4>(vec![a.clone(), a.mul_scalar(2.0)], 1), &stacked, sd),
        ])
    });
    r.case(n("expand_repeat_unsqueeze_flip"), tol(Exact, d), || {
        let (x, xh) = rand_t::<B, 3>(&mut rng(12), [1, 3, 1], -1.0, 1.0, dev, d);
        let ex = H::from_fn(&[2, 3, 4], |i| xh.at(&[0, i[1], 0]));
        max_of([
            check(x.clone().expand([2, 3, 4]), &ex, sd),
            check(x.clone().repeat_dim(2, 4).repeat_dim(0, 2), &ex, sd),
            check(x.clone().unsqueeze_dim::<4>(1), &xh.reshape(&[1, 1, 3, 1]), sd),
            check(x.clone().squeeze_dim::<2>(0), &xh.reshape(&[3, 1]), sd),
            check(x.flip([1]), &H::from_fn(&[1, 3, 1], |i| xh.at(&[0, 2 - i[1], 0])), sd),
        ])
    });
    r.case(n("select_embedding"), tol(Exact, d), || {
        let (w, wh) = rand_t::<B, 2>(&mut rng(13), [10, 4], -1.0, 1.0, dev, d);
        let ids = [3i64, 0, 9, 3, 7, 1];
        let sel = H::from_fn(&[6, 4], |i| wh.at(&[ids[i[0]] as usize, i[1]]));
        max_of([
            check(w.clone().select(0, ints::<B, 1>(&ids, [6], dev)), &sel, sd),
            check(
                burn::tensor::module::embedding(w, ints::<B, 2>(&ids, [2, 3], dev)),
                &sel.reshape(&[2, 3, 4]),
                sd,
            ),
        ])
    });
    r.case(n("gather_scatter"), tol(Exact, d), || {
        let mut g = rng(14);
        let (x, xh) = rand_t::<B, 2>(&mut g, [4, 7], -1.0, 1.0, dev, d);
        let idx = g.ints(12, 0, 7);
        let e = H::from_fn(&[4, 3], |i| xh.at(&[i[0], idx[i[0] * 3 + i[1]] as usize]));
        check(x.gather(1, ints::<B, 2>(&idx, [4, 3], dev)), &e, sd)
    });
    r.case(n("mask_fill_causal"), tol(Exact, d), || {
        let (x, xh) = rand_t::<B, 4>(&mut rng(15), [2, 2, 4, 6], -1.0, 1.0, dev, d);
        // Qwen3's mask: `tril_mask([t, past + t], past)` is true where key j > past + query i.
        let mask = Tensor::<B, 2, Bool>::tril_mask([4, 6], 2, dev).unsqueeze::<4>().expand([2, 2, 4, 6]);
        let e = H::from_fn(&xh.s, |i| if i[3] > i[2] + 2 { -7.0 } else { xh.at(i) });
        check(x.mask_fill(mask, -7.0), &e, sd)
    });
    r.case(n("mask_where"), tol(Exact, d), || {
        let mut g = rng(16);
        let (x, xh) = rand_t::<B, 2>(&mut g, [4, 5], -1.0, 1.0, dev, d);
        let (y, yh) = rand_t::<B, 2>(&mut g, [4, 5], -1.0, 1.0, dev, d);
        let e = xh.zip(&yh, |a, b| if a > b { b } else { a });
        check(x.clone().mask_where(x.greater(y.clone()), y), &e, sd)
    });
    // `mask_where` broadcasting, outputs larger than one cube of work, the value held
    // elsewhere (so no kernel may write over it), the input or the input and value smaller
    // than the mask: burn-cubecl 0.21 sizes the launch from the input and may reuse an input
    // that is smaller than the output (`KNOWN_CUBECL_0_21`). (`mask_fill` with an input smaller
    // than the mask is not a case: NdArray 0.21 panics on it, so Burn does not promise it.)
    let (b0, b1, b2) = (3, 4, 300);
    let at3 = |h: &H, i: &[usize]| h.at(&[i[0].min(h.s[0] - 1), i[1].min(h.s[1] - 1), i[2].min(h.s[2] - 1)]);
    r.case(n("mask_where.broadcast_input"), tol(Exact, d), || {
        let mut g = rng(30);
        let (x, xh) = rand_t::<B, 3>(&mut g, [1, b1, 1], -1.0, 1.0, dev, d);
        let (y, yh) = rand_t::<B, 3>(&mut g, [b0, b1, b2], -1.0, 1.0, dev, d);
        let mask = y.clone().greater_elem(0.0);
        let e = H::from_fn(&yh.s, |i| if yh.at(i) > 0.0 { yh.at(i) } else { at3(&xh, i) });
        let kept = y.clone();
        let out = check(x.mask_where(mask, y), &e, sd);
        drop(kept);
        out
    });
    r.case(n("mask_where.broadcast_mask"), tol(Exact, d), || {
        let mut g = rng(31);
        let (x, xh) = rand_t::<B, 3>(&mut g, [1, b1, b2], -1.0, 1.0, dev, d);
        let (y, yh) = rand_t::<B, 3>(&mut g, [1, b1, b2], -1.0, 1.0, dev, d);
        let (z, zh) = rand_t::<B, 3>(&mut g, [b0, b1, b2], -1.0, 1.0, dev, d);
        let e = H::from_fn(&zh.s, |i| if zh.at(i) > 0.0 { at3(&yh, i) } else { at3(&xh, i) });
        check(x.mask_where(z.greater_elem(0.0), y), &e, sd)
    });
    r.case(n("tril_triu"), tol(Exact, d), || {
        let (x, xh) = rand_t::<B, 3>(&mut rng(17), [2, 4, 5], -1.0, 1.0, dev, d);
        max_of([
            check(x.clone().tril(0), &H::from_fn(&xh.s, |i| if i[2] <= i[1] { xh.at(i) } else { 0.0 }), sd),
            check(x.clone().triu(1), &H::from_fn(&xh.s, |i| if i[2] > i[1] { xh.at(i) } else { 0.0 }), sd),
            check(x.tril(-1), &H::from_fn(&xh.s, |i| if i[2] < i[1] { xh.at(i) } else { 0.0 }), sd),
        ])
    });

    // ---- elementwise arithmetic ----
    type Bin<B> = fn(Tensor<B, 3>, Tensor<B, 3>) -> Tensor<B, 3>;
    type BinCase<B> = (&'static str, Bin<B>, fn(f64, f64) -> f64);
    let binops: [BinCase<B>; 6] = [
        ("add", |a, b| a + b, |a, b| a + b),
        ("sub", |a, b| a - b, |a, b| a - b),
        ("mul", |a, b| a * b, |a, b| a * b),
        ("div", |a, b| a / b, |a, b| a / b),
        ("max_pair", |a, b| a.max_pair(b), f64::max),
        ("min_pair", |a, b| a.min_pair(b), f64::min),
    ];
    for (name, f, fh) in binops {
        r.case(n(&format!("{name}.broadcast")), tol(Elementwise, d), || {
            let mut g = rng(20);
            let (a, ah) = rand_t::<B, 3>(&mut g, [3, 4, 5], 0.5, 2.0, dev, d);
            let (b, bh) = rand_t::<B, 3>(&mut g, [1, 4, 1], -2.0, -0.5, dev, d);
            let (c, ch) = rand_t::<B, 3>(&mut g, [3, 4, 5], 0.5, 2.0, dev, d);
            max_of([
                check(f(a.clone(), b.clone()), &ah.zip(&bh, fh), sd),
                check(f(b, a.clone()), &bh.zip(&ah, fh), sd),
                check(f(a, c), &ah.zip(&ch, fh), sd),
            ])
        });
    }
    type Un<B> = fn(Tensor<B, 2>) -> Tensor<B, 2>;
    // (name, family, input range, op, reference); scalars are exact in every dtype.
    type UnCase<B> = (&'static str, Family, (f64, f64), Un<B>, fn(f64) -> f64);
    let unops: Vec<UnCase<B>> = vec![
        ("add_scalar", Elementwise, (-2.0, 2.0), |x| x.add_scalar(1.5), |x| x + 1.5),
        ("sub_scalar", Elementwise, (-2.0, 2.0), |x| x.sub_scalar(0.75), |x| x - 0.75),
        ("mul_scalar", Elementwise, (-2.0, 2.0), |x| x.mul_scalar(-0.375), |x| x * -0.375),
        ("div_scalar", Elementwise, (-2.0, 2.0), |x| x.div_scalar(3.0), |x| x / 3.0),
        ("neg", Elementwise, (-2.0, 2.0), |x| x.neg(), |x| -x),
        ("abs", Elementwise, (-2.0, 2.0), |x| x.abs(), f64::abs),
        ("recip", Elementwise, (0.25, 4.0), |x| x.recip(), |x| 1.0 / x),
        ("square", Elementwise, (-2.0, 2.0), |x| x.square(), |x| x * x),
        ("sqrt", Elementwise, (0.01, 4.0), |x| x.sqrt(), f64::sqrt),
        ("clamp", Elementwise, (-2.0, 2.0), |x| x.clamp(-0.5, 0.75), |x| x.clamp(-0.5, 0.75)),
        ("relu", Elementwise, (-2.0, 2.0), relu, |x| x.max(0.0)),
        ("exp", Transcendental, (-5.0, 5.0), |x| x.exp(), f64::exp),
        ("log", Transcendental, (0.01, 10.0), |x| x.log(), f64::ln),
        ("log1p", Transcendental, (-0.5, 3.0), |x| x.log1p(), f64::ln_1p),
        ("sin", Transcendental, (-3.0, 3.0), |x| x.sin(), f64::sin),
        ("cos", Transcendental, (-3.0, 3.0), |x| x.cos(), f64::cos),
        ("tanh", Transcendental, (-3.0, 3.0), |x| x.tanh(), f64::tanh),
        ("erf", Transcendental, (-2.5, 2.5), |x| x.erf(), erf),
        ("powf_scalar", Transcendental, (0.1, 3.0), |x| x.powf_scalar(2.5), |x| x.powf(2.5)),
        ("powf_scalar.neg_half", Transcendental, (0.1, 3.0), |x| x.powf_scalar(-0.5), |x| x.powf(-0.5)),
        ("powi_scalar", Elementwise, (-2.0, 2.0), |x| x.powi_scalar(2), |x| x * x),
        ("sigmoid", Transcendental, (-6.0, 6.0), sigmoid, sigmoid_f),
        ("silu", Transcendental, (-6.0, 6.0), silu, |x| x * sigmoid_f(x)),
    ];
    for (name, fam, (lo, hi), f, fh) in unops {
        // Burn's default `ActivationOps::sigmoid` (which silu uses) computes in f32 whatever
        // the dtype, by design: f64 gets the f32 tolerance there.
        let t = if d == DType::F64 && (name == "sigmoid" || name == "silu") {
            tol(fam, DType::F32)
        } else {
            tol(fam, d)
        };
        r.case(n(name), t, || {
            let (x, xh) = rand_t::<B, 2>(&mut rng(21), [6, 33], lo, hi, dev, d);
            check(f(x), &xh.map(fh), sd)
        });
    }
    // Burn's `gelu` is a composite, `x · 0.5 · (1 + erf(x/√2))`, which a backend may evaluate op
    // by op in the dtype (CubeCL backends do; Flex computes in f32). Rounding `erf` to the dtype
    // then costs up to u·|0.5·x·(1 + |erf|)| absolute, which is most of the result where
    // `1 + erf` cancels (x → −3). The error is measured against that magnitude — the forward
    // error bound of the formula, as reductions are measured against Σ|xₖ| — with the
    // transcendental tolerance.
    r.case(n("gelu"), tol(Transcendental, d), || {
        let (x, xh) = rand_t::<B, 2>(&mut rng(21), [6, 33], -3.0, 3.0, dev, d);
        let e = xh.map(|x| 0.5 * x * one_plus_erf(x / 2f64.sqrt()));
        let s = xh.map(|x| 0.5 * x.abs() * (1.0 + erf(x / 2f64.sqrt()).abs()));
        check_scaled(gelu(x), &e, &s, d)
    });
    r.case(n("powf.tensor"), tol(Transcendental, d), || {
        let mut g = rng(22);
        let (x, xh) = rand_t::<B, 2>(&mut g, [4, 9], 0.1, 3.0, dev, d);
        let (y, yh) = rand_t::<B, 2>(&mut g, [4, 9], -2.0, 2.0, dev, d);
        check(x.powf(y), &xh.zip(&yh, f64::powf), sd)
    });

    // ---- reductions (errors relative to the sum of magnitudes) ----
    r.case(n("sum"), tol(Reduction, d), || {
        let (x, xh) = rand_t::<B, 2>(&mut rng(30), [64, 157], -1.0, 1.0, dev, d);
        let e = H::new(&[1], vec![xh.v.iter().sum()]);
        let s = H::new(&[1], vec![xh.v.iter().map(|v| v.abs()).sum()]);
        check_scaled(x.sum(), &e, &s, d)
    });
    r.case(n("sum_dim"), tol(Reduction, d), || {
        let (x, xh) = rand_t::<B, 3>(&mut rng(31), [4, 37, 9], -1.0, 1.0, dev, d);
        max_of([
            check_scaled(x.clone().sum_dim(1), &xh.sum_dim(1), &xh.abs_sum_dim(1), d),
            check_scaled(x.sum_dim(2), &xh.sum_dim(2), &xh.abs_sum_dim(2), d),
        ])
    });
    r.case(n("mean_mean_dim"), tol(Reduction, d), || {
        let (x, xh) = rand_t::<B, 3>(&mut rng(32), [3, 5, 64], -1.0, 1.0, dev, d);
        let k = 64.0;
        let n_all = xh.v.len() as f64;
        max_of([
            check_scaled(
                x.clone().mean_dim(2),
                &xh.sum_dim(2).map(|v| v / k),
                &xh.abs_sum_dim(2).map(|v| v / k),
                d,
            ),
            check_scaled(
                x.mean(),
                &H::new(&[1], vec![xh.v.iter().sum::<f64>() / n_all]),
                &H::new(&[1], vec![xh.v.iter().map(|v| v.abs()).sum::<f64>() / n_all]),
                d,
            ),
        ])
    });
    r.case(n("var"), tol(Reduction, d), || {
        let (x, xh) = rand_t::<B, 2>(&mut rng(33), [5, 40], -1.0, 1.0, dev, d);
        let e = xh.reduce(1, |f| {
            let m = f.iter().sum::<f64>() / f.len() as f64;
            f.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (f.len() - 1) as f64
        });
        let s = xh.reduce(1, |f| f.iter().map(|v| v * v).sum::<f64>() / (f.len() - 1) as f64);
        check_scaled(x.var(1), &e, &s, d)
    });
    r.case(n("cumsum"), tol(Reduction, d), || {
        let (x, xh) = rand_t::<B, 2>(&mut rng(34), [3, 50], -1.0, 1.0, dev, d);
        let cum = |abs: bool| {
            H::from_fn(&xh.s, |i| {
                (0..=i[1]).map(|k| xh.at(&[i[0], k])).map(|v| if abs { v.abs() } else { v }).sum()
            })
        };
        check_scaled(x.cumsum(1), &cum(false), &cum(true), d)
    });
    r.case(n("max_min_argmax"), tol(Exact, d), || {
        let (x, xh) = rand_t::<B, 3>(&mut rng(35), [3, 11, 6], -5.0, 5.0, dev, d);
        let argmax = xh.reduce(1, |f| (0..f.len()).fold(0, |b, i| if f[i] > f[b] { i } else { b }) as f64);
        let argmin = xh.reduce(2, |f| (0..f.len()).fold(0, |b, i| if f[i] < f[b] { i } else { b }) as f64);
        let mx = xh.v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let mn = xh.v.iter().cloned().fold(f64::INFINITY, f64::min);
        max_of([
            check(
                x.clone().max_dim(1),
                &xh.reduce(1, |f| f.iter().cloned().fold(f64::NEG_INFINITY, f64::max)),
                sd,
            ),
            check(
                x.clone().min_dim(2),
                &xh.reduce(2, |f| f.iter().cloned().fold(f64::INFINITY, f64::min)),
                sd,
            ),
            check(x.clone().max(), &H::new(&[1], vec![mx]), sd),
            check(x.clone().min(), &H::new(&[1], vec![mn]), sd),
            check_exact(x.clone().argmax(1), &argmax),
            check_exact(x.argmin(2), &argmin),
        ])
    });

    // ---- comparisons ----
    r.case(n("compare"), tol(Exact, d), || {
        let mut g = rng(36);
        let av: Vec<f64> = g.ints(40, -2, 3).into_iter().map(|v| v as f64 * 0.5).collect();
        let bv: Vec<f64> = g.ints(40, -2, 3).into_iter().map(|v| v as f64 * 0.5).collect();
        let (a, ah) = upload::<B, 2>(av, [5, 8], dev, d);
        let (b, bh) = upload::<B, 2>(bv, [5, 8], dev, d);
        let bo = |c: bool| if c { 1.0 } else { 0.0 };
        max_of([
            check_exact(a.clone().equal(b.clone()), &ah.zip(&bh, |x, y| bo(x == y))),
            check_exact(a.clone().not_equal(b.clone()), &ah.zip(&bh, |x, y| bo(x != y))),
            check_exact(a.clone().greater(b.clone()), &ah.zip(&bh, |x, y| bo(x > y))),
            check_exact(a.clone().greater_equal(b.clone()), &ah.zip(&bh, |x, y| bo(x >= y))),
            check_exact(a.clone().lower(b.clone()), &ah.zip(&bh, |x, y| bo(x < y))),
            check_exact(a.clone().lower_equal(b), &ah.zip(&bh, |x, y| bo(x <= y))),
            check_exact(a.clone().equal_elem(0.5), &ah.map(|x| bo(x == 0.5))),
            check_exact(a.clone().not_equal_elem(0.5), &ah.map(|x| bo(x != 0.5))),
            check_exact(a.clone().greater_elem(0.0), &ah.map(|x| bo(x > 0.0))),
            check_exact(a.clone().greater_equal_elem(0.0), &ah.map(|x| bo(x >= 0.0))),
            check_exact(a.clone().lower_elem(-0.5), &ah.map(|x| bo(x < -0.5))),
            check_exact(a.lower_equal_elem(-0.5), &ah.map(|x| bo(x <= -0.5))),
        ])
    });
    r.case(n("is_nan_is_inf"), tol(Exact, d), || {
        let v = vec![1.0, f64::NAN, f64::INFINITY, -2.0, f64::NEG_INFINITY, 0.0];
        let t = Tensor::<B, 1>::from_data(TensorData::new(v, [6]), (dev, d));
        max_of([
            check_exact(t.clone().is_nan(), &H::new(&[6], vec![0.0, 1.0, 0.0, 0.0, 0.0, 0.0])),
            check_exact(t.clone().is_inf(), &H::new(&[6], vec![0.0, 0.0, 1.0, 0.0, 1.0, 0.0])),
            check_exact(t.is_finite(), &H::new(&[6], vec![1.0, 0.0, 0.0, 1.0, 0.0, 1.0])),
        ])
    });

    // ---- matmul (errors relative to Σₖ|aᵢₖ·bₖⱼ|) ----
    r.case(n("matmul.2d_odd"), tol(Matmul(33), d), || {
        let mut g = rng(40);
        let (a, ah) = rand_t::<B, 2>(&mut g, [17, 33], -1.0, 1.0, dev, d);
        let (b, bh) = rand_t::<B, 2>(&mut g, [33, 9], -1.0, 1.0, dev, d);
        let (e, s) = ah.matmul(&bh);
        check_scaled(a.matmul(b), &e, &s, d)
    });
    r.case(n("matmul.linear_transposed_weight"), tol(Matmul(48), d), || {
        // Qwen3's Linear: x.reshape([rows, d_in]).matmul(w.transpose()).
        let mut g = rng(41);
        let (x, xh) = rand_t::<B, 3>(&mut g, [2, 5, 48], -1.0, 1.0, dev, d);
        let (w, wh) = rand_t::<B, 2>(&mut g, [24, 48], -1.0, 1.0, dev, d);
        let (e, s) = xh.reshape(&[10, 48]).matmul(&wh.permute(&[1, 0]));
        check_scaled(
            x.reshape([10, 48]).matmul(w.transpose()).reshape([2, 5, 24]),
            &e.reshape(&[2, 5, 24]),
            &s.reshape(&[2, 5, 24]),
            d,
        )
    });
    r.case(n("matmul.batched3d"), tol(Matmul(16), d), || {
        let mut g = rng(42);
        let (a, ah) = rand_t::<B, 3>(&mut g, [3, 8, 16], -1.0, 1.0, dev, d);
        let (b, bh) = rand_t::<B, 3>(&mut g, [3, 16, 5], -1.0, 1.0, dev, d);
        let (e, s) = ah.matmul(&bh);
        check_scaled(a.matmul(b), &e, &s, d)
    });
    r.case(n("matmul.batched4d_attention"), tol(Matmul(16), d), || {
        // q·kᵀ with k a swapped (strided) view, as in Qwen3 attention.
        let mut g = rng(43);
        let (q, qh) = rand_t::<B, 4>(&mut g, [2, 3, 7, 16], -1.0, 1.0, dev, d);
        let (k, kh) = rand_t::<B, 4>(&mut g, [2, 3, 9, 16], -1.0, 1.0, dev, d);
        let (e, s) = qh.matmul(&kh.permute(&[0, 1, 3, 2]));
        check_scaled(q.matmul(k.swap_dims(2, 3)), &e, &s, d)
    });
    r.case(n("matmul.broadcast_batch"), tol(Matmul(8), d), || {
        let mut g = rng(44);
        let (a, ah) = rand_t::<B, 3>(&mut g, [4, 6, 8], -1.0, 1.0, dev, d);
        let (b, bh) = rand_t::<B, 3>(&mut g, [1, 8, 5], -1.0, 1.0, dev, d);
        let bh4 = H::from_fn(&[4, 8, 5], |i| bh.at(&[0, i[1], i[2]]));
        let (e, s) = ah.matmul(&bh4);
        check_scaled(a.matmul(b), &e, &s, d)
    });

    // ---- composite formulas of Qwen3 ----
    r.case(n("softmax.last_dim"), tol(Composite, d), || {
        let (x, xh) = rand_t::<B, 3>(&mut rng(50), [3, 4, 37], -4.0, 4.0, dev, d);
        check(softmax(x, 2), &xh.softmax(), sd)
    });
    r.case(n("softmax.inner_dim"), tol(Composite, d), || {
        let (x, xh) = rand_t::<B, 3>(&mut rng(51), [3, 5, 4], -4.0, 4.0, dev, d);
        check(softmax(x, 1), &xh.permute(&[0, 2, 1]).softmax().permute(&[0, 2, 1]), sd)
    });
    r.case(n("log_softmax.large_logits"), tol(Composite, d), || {
        let (x, xh) = rand_t::<B, 2>(&mut rng(52), [6, 50], 40.0, 60.0, dev, d);
        let e = xh.log_softmax();
        // log-probabilities are differences of large numbers: scale by the logit magnitude.
        let s = e.map(|_| 60.0);
        check_scaled(log_softmax(x, 1), &e, &s, d)
    });
    r.case(n("cross_entropy.qwen3"), tol(Composite, d), || {
        // qwen3_burn::train::cross_entropy: -mean(gather(log_softmax(logits), labels)).
        let mut g = rng(53);
        let (logits, lh) = rand_t::<B, 3>(&mut g, [2, 5, 23], -3.0, 3.0, dev, d);
        let labels = g.ints(10, 0, 23);
        let lp = lh.reshape(&[10, 23]).log_softmax();
        let e = -(0..10).map(|i| lp.at(&[i, labels[i] as usize])).sum::<f64>() / 10.0;
        let logp = log_softmax(logits.reshape([10, 23]), 1);
        let loss = logp.gather(1, ints::<B, 2>(&labels, [10, 1], dev)).mean().neg();
        check(loss, &H::new(&[1], vec![e]), sd)
    });
    r.case(n("rms_norm.qwen3"), tol(Composite, d), || {
        let mut g = rng(54);
        let (x, xh) = rand_t::<B, 3>(&mut g, [2, 3, 32], -2.0, 2.0, dev, d);
        let (w, wh) = rand_t::<B, 1>(&mut g, [32], 0.5, 1.5, dev, d);
        let inv_rms = (x.clone().square().mean_dim(2) + 1e-6).sqrt().recip();
        check((x * inv_rms) * w.unsqueeze::<3>(), &xh.rms_norm(&wh, 1e-6), sd)
    });
    r.case(n("rope.qwen3"), tol(Composite, d), || {
        let (x, xh) = rand_t::<B, 4>(&mut rng(55), [1, 2, 5, 8], -1.0, 1.0, dev, d);
        let (cos, sin) = rope_tables(5, 8, 1e6);
        let (ct, ch) = upload::<B, 2>(cos.v.clone(), [5, 8], dev, d);
        let (st, sh) = upload::<B, 2>(sin.v.clone(), [5, 8], dev, d);
        let x1 = x.clone().narrow(3, 0, 4);
        let x2 = x.clone().narrow(3, 4, 4);
        let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
        let out =
            x * ct.unsqueeze::<4>().expand([1, 2, 5, 8]) + rotated * st.unsqueeze::<4>().expand([1, 2, 5, 8]);
        // Error relative to |x·cos| + |rotate_half(x)·sin| (the sum may cancel).
        let (xa, zero) = (xh.map(f64::abs), ch.map(|_| 0.0));
        let scale = rope_host(&xa, &ch.map(f64::abs), &zero)
            .zip(&rope_host(&xa, &zero, &sh.map(f64::abs)), |a, b| a + b.abs());
        check_scaled(out, &rope_host(&xh, &ch, &sh), &scale, d)
    });
    r.case(n("attention.causal"), tol(Composite, d), || {
        let mut g = rng(56);
        let (q, qh) = rand_t::<B, 4>(&mut g, [1, 2, 5, 8], -1.0, 1.0, dev, d);
        let (k, kh) = rand_t::<B, 4>(&mut g, [1, 2, 5, 8], -1.0, 1.0, dev, d);
        let (v, vh) = rand_t::<B, 4>(&mut g, [1, 2, 5, 8], -1.0, 1.0, dev, d);
        let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(8f64.powf(-0.5));
        let mask = Tensor::<B, 2, Bool>::tril_mask([5, 5], 0, dev).unsqueeze::<4>().expand([1, 2, 5, 5]);
        let probs = softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 3);
        // Error relative to Σⱼ pᵢⱼ·|vⱼ| (the weighted sum may cancel).
        check_scaled(
            probs.matmul(v),
            &attention_host(&qh, &kh, &vh),
            &attention_host(&qh, &kh, &vh.map(f64::abs)),
            d,
        )
    });
}
