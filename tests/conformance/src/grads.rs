//! Autodiff cases: gradients of `L = Σ f(x)·w` (fixed random `w`) for each input `x`,
//! against central finite differences of an f64 host implementation of `f` (h = 1e-5,
//! truncation error ~1e-10). The forward value is checked too.

use burn::prelude::*;
use burn::tensor::activation::{log_softmax, sigmoid, silu, softmax};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, TensorData};

use crate::forward::{attention_host, erf, rope_host, rope_tables, sigmoid_f};
use crate::harness::{Fail, Family, Measured, Runner, mismatch, tol};
use crate::host::{H, Rng, ints, max_err};

/// One differentiable input: shape and the range its values are drawn from.
#[derive(Clone)]
struct In {
    s: Vec<usize>,
    lo: f64,
    hi: f64,
}

fn inp(s: &[usize], lo: f64, hi: f64) -> In {
    In { s: s.to_vec(), lo, hi }
}

type BurnFn<'a, B> = dyn Fn(&[Tensor<B, 1>]) -> Tensor<B, 1> + 'a;
type HostFn = dyn Fn(&[H]) -> H;

/// Runs the gradient check described in the module docs.
fn grad_check<B: AutodiffBackend>(
    dev: &B::Device,
    seed: u64,
    ins: &[In],
    f: &BurnFn<'_, B>,
    fh: &HostFn,
) -> Measured {
    let mut g = Rng::new(seed);
    let mut xs = Vec::new();
    let mut hs = Vec::new();
    for i in ins {
        let n: usize = i.s.iter().product();
        let t = Tensor::<B, 1>::from_data(TensorData::new(g.vec(n, i.lo, i.hi), [n]), (dev, DType::F32));
        hs.push(H::new(&i.s, t.to_data().iter::<f64>().collect()));
        xs.push(t.require_grad());
    }
    let out = f(&xs);
    let expected = fh(&hs);
    let m = expected.v.len();
    let w = g.vec(m, -1.0, 1.0);
    let got: Vec<f64> = out.to_data().iter::<f64>().collect();
    let fwd_err = max_err(&got, &expected.v, None)?;
    let wt = Tensor::<B, 1>::from_data(TensorData::new(w.clone(), [m]), (dev, DType::F32));
    let grads = (out * wt).sum().backward();
    let loss = |hs: &[H]| fh(hs).v.iter().zip(&w).map(|(a, b)| a * b).sum::<f64>();
    let mut worst = fwd_err;
    for (k, x) in xs.iter().enumerate() {
        let Some(gr) = x.grad(&grads) else {
            return mismatch(format!("no gradient for input {k}"));
        };
        let gr: Vec<f64> = gr.into_data().iter::<f64>().collect();
        let mut fd = Vec::with_capacity(gr.len());
        let mut hp = hs.clone();
        for j in 0..hs[k].v.len() {
            let x0 = hs[k].v[j];
            let h = 1e-5 * x0.abs().max(1.0);
            hp[k].v[j] = x0 + h;
            let up = loss(&hp);
            hp[k].v[j] = x0 - h;
            let down = loss(&hp);
            hp[k].v[j] = x0;
            fd.push((up - down) / (2.0 * h));
        }
        worst = worst.max(max_err(&gr, &fd, None).map_err(|e| match e {
            Fail::Mismatch(m) => Fail::Mismatch(format!("gradient of input {k}: {m}")),
            other => other,
        })?);
    }
    Ok(worst)
}

fn r2<B: Backend>(x: &Tensor<B, 1>, s: [usize; 2]) -> Tensor<B, 2> {
    x.clone().reshape(s)
}
fn r3<B: Backend>(x: &Tensor<B, 1>, s: [usize; 3]) -> Tensor<B, 3> {
    x.clone().reshape(s)
}
fn r4<B: Backend>(x: &Tensor<B, 1>, s: [usize; 4]) -> Tensor<B, 4> {
    x.clone().reshape(s)
}
fn flat<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, 1> {
    let n = x.shape().num_elements();
    x.reshape([n])
}

/// Host `x · wᵀ` for `x: [.., k]`, `w: [n, k]`.
fn linear_h(x: &H, w: &H) -> H {
    let k = *x.s.last().unwrap_or(&1);
    let rows = x.v.len() / k;
    let mut s = x.s.clone();
    *s.last_mut().unwrap_or(&mut 0) = w.s[0];
    x.reshape(&[rows, k]).matmul(&w.permute(&[1, 0])).0.reshape(&s)
}

fn linear<B: Backend, const D: usize>(x: Tensor<B, D>, w: Tensor<B, 2>) -> Tensor<B, D> {
    let [n, k] = w.dims();
    let mut s = x.dims();
    let rows = x.shape().num_elements() / k;
    s[D - 1] = n;
    x.reshape([rows, k]).matmul(w.transpose()).reshape(s)
}

fn rms_norm<B: Backend, const D: usize>(x: Tensor<B, D>, w: Tensor<B, 1>) -> Tensor<B, D> {
    let inv = (x.clone().square().mean_dim(D - 1) + 1e-6).sqrt().recip();
    (x * inv) * w.unsqueeze()
}

/// Host cross-entropy of `logits: [n, v]` against `labels`, `[1]`.
fn ce_h(logits: &H, labels: &[i64]) -> H {
    let lp = logits.log_softmax();
    let n = labels.len();
    H::new(&[1], vec![-(0..n).map(|i| lp.at(&[i, labels[i] as usize])).sum::<f64>() / n as f64])
}

fn ce<B: Backend>(logits: Tensor<B, 2>, labels: &[i64], dev: &B::Device) -> Tensor<B, 1> {
    let n = labels.len();
    log_softmax(logits, 1).gather(1, ints::<B, 2>(labels, [n, 1], dev)).mean().neg()
}

/// Gradient cases, named `grad/f32/<op>`.
pub(crate) fn grad_cases<B: AutodiffBackend>(r: &mut Runner<'_>, dev: &B::Device) {
    let t = tol(Family::Gradient, DType::F32);
    let n = |op: &str| format!("grad/f32/{op}");
    fn case<'a, B: AutodiffBackend>(
        r: &mut Runner<'_>,
        dev: &'a B::Device,
        name: &str,
        ins: Vec<In>,
        f: Box<BurnFn<'a, B>>,
        fh: Box<HostFn>,
    ) where
        B::Device: 'a,
    {
        let seed = name.len() as u64 * 7919 + name.bytes().map(u64::from).sum::<u64>();
        r.case(format!("grad/f32/{name}"), tol(Family::Gradient, DType::F32), || {
            grad_check::<B>(dev, seed, &ins, &*f, &*fh)
        });
    }

    // ---- matmul ----
    case::<B>(
        r,
        dev,
        "matmul.batched3d",
        vec![inp(&[3, 5, 7], -1.0, 1.0), inp(&[3, 7, 4], -1.0, 1.0)],
        Box::new(|x| flat(r3(&x[0], [3, 5, 7]).matmul(r3(&x[1], [3, 7, 4])))),
        Box::new(|x| x[0].matmul(&x[1]).0),
    );
    case::<B>(
        r,
        dev,
        "matmul.linear",
        vec![inp(&[6, 8], -1.0, 1.0), inp(&[5, 8], -1.0, 1.0)],
        Box::new(|x| flat(linear(r2(&x[0], [6, 8]), r2(&x[1], [5, 8])))),
        Box::new(|x| linear_h(&x[0], &x[1])),
    );
    case::<B>(
        r,
        dev,
        "matmul.4d_swapped",
        vec![inp(&[1, 2, 3, 4], -1.0, 1.0), inp(&[1, 2, 5, 4], -1.0, 1.0)],
        Box::new(|x| flat(r4(&x[0], [1, 2, 3, 4]).matmul(r4(&x[1], [1, 2, 5, 4]).swap_dims(2, 3)))),
        Box::new(|x| x[0].matmul(&x[1].permute(&[0, 1, 3, 2])).0),
    );

    // ---- broadcasting arithmetic ----
    case::<B>(
        r,
        dev,
        "arith.broadcast",
        vec![inp(&[3, 4], -1.0, 1.0), inp(&[1, 4], 0.5, 2.0)],
        Box::new(|x| {
            let (a, b) = (r2(&x[0], [3, 4]), r2(&x[1], [1, 4]));
            flat((a.clone() + b.clone()) * a.clone() / (b.clone() + 3.0) - b * a)
        }),
        Box::new(|x| {
            let (a, b) = (&x[0], &x[1]);
            let l = a.zip(b, |a, b| a + b).zip(a, |s, a| s * a).zip(b, |s, b| s / (b + 3.0));
            l.zip(&b.zip(a, |b, a| b * a), |p, q| p - q)
        }),
    );
    case::<B>(
        r,
        dev,
        "arith.scalar",
        vec![inp(&[4, 5], -2.0, 2.0)],
        Box::new(|x| {
            flat(x[0].clone().mul_scalar(1.5).add_scalar(0.25).div_scalar(3.0).sub_scalar(1.0).neg())
        }),
        Box::new(|x| x[0].map(|v| -((v * 1.5 + 0.25) / 3.0 - 1.0))),
    );
    type Un<B> = fn(Tensor<B, 1>) -> Tensor<B, 1>;
    type UnCase<B> = (&'static str, (f64, f64), Un<B>, fn(f64) -> f64);
    let unary: Vec<UnCase<B>> = vec![
        ("exp", (-2.0, 2.0), |x| x.exp(), f64::exp),
        ("log", (0.2, 3.0), |x| x.log(), f64::ln),
        ("sqrt", (0.2, 3.0), |x| x.sqrt(), f64::sqrt),
        ("recip", (0.5, 3.0), |x| x.recip(), |x| 1.0 / x),
        ("square", (-2.0, 2.0), |x| x.square(), |x| x * x),
        ("powf_scalar", (0.2, 3.0), |x| x.powf_scalar(-0.5), |x| x.powf(-0.5)),
        ("tanh", (-2.0, 2.0), |x| x.tanh(), f64::tanh),
        ("sin_cos", (-3.0, 3.0), |x| x.clone().sin() * x.cos(), |x| x.sin() * x.cos()),
        ("erf", (-2.0, 2.0), |x| x.erf(), erf),
        ("sigmoid", (-4.0, 4.0), sigmoid, sigmoid_f),
        ("silu", (-4.0, 4.0), silu, |x| x * sigmoid_f(x)),
        ("abs", (0.1, 2.0), |x| x.clone().abs() - x.neg().abs().mul_scalar(0.5), |x| x.abs() * 0.5),
    ];
    for (name, (lo, hi), f, fh) in unary {
        case::<B>(
            r,
            dev,
            name,
            vec![inp(&[24], lo, hi)],
            Box::new(move |x| f(x[0].clone())),
            Box::new(move |x| x[0].map(fh)),
        );
    }
    case::<B>(
        r,
        dev,
        "powf.tensor",
        vec![inp(&[10], 0.3, 2.0), inp(&[10], -1.5, 1.5)],
        Box::new(|x| x[0].clone().powf(x[1].clone())),
        Box::new(|x| x[0].zip(&x[1], f64::powf)),
    );

    // ---- softmax family and the loss ----
    case::<B>(
        r,
        dev,
        "softmax",
        vec![inp(&[3, 7], -3.0, 3.0)],
        Box::new(|x| flat(softmax(r2(&x[0], [3, 7]), 1))),
        Box::new(|x| x[0].softmax()),
    );
    case::<B>(
        r,
        dev,
        "softmax.inner_dim",
        vec![inp(&[2, 5, 3], -3.0, 3.0)],
        Box::new(|x| flat(softmax(r3(&x[0], [2, 5, 3]), 1))),
        Box::new(|x| x[0].permute(&[0, 2, 1]).softmax().permute(&[0, 2, 1])),
    );
    case::<B>(
        r,
        dev,
        "log_softmax",
        vec![inp(&[3, 7], -3.0, 3.0)],
        Box::new(|x| flat(log_softmax(r2(&x[0], [3, 7]), 1))),
        Box::new(|x| x[0].log_softmax()),
    );
    let labels = [3i64, 0, 9, 9, 5, 1];
    case::<B>(
        r,
        dev,
        "cross_entropy.qwen3",
        vec![inp(&[6, 10], -3.0, 3.0)],
        Box::new(move |x| ce(r2(&x[0], [6, 10]), &labels, dev)),
        Box::new(move |x| ce_h(&x[0], &labels)),
    );

    // ---- reductions ----
    case::<B>(
        r,
        dev,
        "sum",
        vec![inp(&[4, 6], -1.0, 1.0)],
        Box::new(|x| x[0].clone().sum()),
        Box::new(|x| H::new(&[1], vec![x[0].v.iter().sum()])),
    );
    case::<B>(
        r,
        dev,
        "mean",
        vec![inp(&[4, 6], -1.0, 1.0)],
        Box::new(|x| x[0].clone().mean()),
        Box::new(|x| H::new(&[1], vec![x[0].v.iter().sum::<f64>() / 24.0])),
    );
    case::<B>(
        r,
        dev,
        "sum_dim_mean_dim",
        vec![inp(&[3, 4, 5], -1.0, 1.0)],
        Box::new(|x| {
            let a = r3(&x[0], [3, 4, 5]);
            flat(a.clone().sum_dim(1).square()).add(flat(a.mean_dim(2)).sum())
        }),
        Box::new(|x| {
            let s = x[0].sum_dim(1).map(|v| v * v);
            let m: f64 = x[0].sum_dim(2).v.iter().map(|v| v / 5.0).sum();
            s.reshape(&[15]).map(|v| v + m)
        }),
    );
    case::<B>(
        r,
        dev,
        "max_dim",
        vec![inp(&[4, 9], -3.0, 3.0)],
        Box::new(|x| flat(r2(&x[0], [4, 9]).max_dim(1))),
        Box::new(|x| x[0].reduce(1, |f| f.iter().cloned().fold(f64::NEG_INFINITY, f64::max))),
    );

    // ---- data movement ----
    case::<B>(
        r,
        dev,
        "reshape_permute_swap",
        vec![inp(&[2, 3, 4], -1.0, 1.0)],
        Box::new(|x| {
            let a = r3(&x[0], [2, 3, 4]);
            flat(a.clone().permute([2, 0, 1]).reshape([4, 6]).mul_scalar(2.0))
                + flat(a.swap_dims(0, 1).square())
        }),
        Box::new(|x| {
            let p = x[0].permute(&[2, 0, 1]).map(|v| 2.0 * v).reshape(&[24]);
            p.zip(&x[0].permute(&[1, 0, 2]).map(|v| v * v).reshape(&[24]), |a, b| a + b)
        }),
    );
    case::<B>(
        r,
        dev,
        "slice_narrow_chunk",
        vec![inp(&[4, 6], -1.0, 1.0)],
        Box::new(|x| {
            let a = r2(&x[0], [4, 6]);
            let c = a.clone().chunk(2, 1);
            let s = a.clone().slice([1..3, 0..6]).narrow(1, 2, 3);
            flat(s * c[1].clone().slice([0..2, 0..3]).exp()) + flat(c[0].clone().slice([2..4, 0..3]))
        }),
        Box::new(|x| {
            let s = x[0].slice(&[(1, 3), (2, 5)]);
            let c1 = x[0].slice(&[(0, 2), (3, 6)]).map(f64::exp);
            s.zip(&c1, |a, b| a * b).zip(&x[0].slice(&[(2, 4), (0, 3)]), |a, b| a + b).reshape(&[6])
        }),
    );
    case::<B>(
        r,
        dev,
        "cat_expand_unsqueeze",
        vec![inp(&[2, 3], -1.0, 1.0), inp(&[2, 2], -1.0, 1.0), inp(&[3], -1.0, 1.0)],
        Box::new(|x| {
            let c = Tensor::cat(vec![r2(&x[0], [2, 3]), r2(&x[1], [2, 2]).square()], 1);
            let e = x[2].clone().unsqueeze::<2>().expand([2, 3]);
            Tensor::cat(vec![flat(c.clone()), flat(c.slice([0..2, 0..3]) * e)], 0)
        }),
        Box::new(|x| {
            let c = H::cat(&[&x[0], &x[1].map(|v| v * v)], 1);
            let e = c.slice(&[(0, 2), (0, 3)]).zip(&x[2].reshape(&[1, 3]), |a, b| a * b);
            H::cat(&[&c.reshape(&[10]), &e.reshape(&[6])], 0)
        }),
    );
    case::<B>(
        r,
        dev,
        "slice_assign_mask_where",
        vec![inp(&[3, 4], -1.0, 1.0), inp(&[2, 2], -1.0, 1.0), inp(&[3, 4], -1.0, 1.0)],
        Box::new(|x| {
            let a = r2(&x[0], [3, 4]).slice_assign([1..3, 1..3], r2(&x[1], [2, 2]).exp());
            let b = r2(&x[2], [3, 4]);
            flat(a.clone().mask_where(a.clone().greater(b.clone()), b))
        }),
        Box::new(|x| {
            let a = H::from_fn(&[3, 4], |i| {
                if (1..3).contains(&i[0]) && (1..3).contains(&i[1]) {
                    x[1].at(&[i[0] - 1, i[1] - 1]).exp()
                } else {
                    x[0].at(i)
                }
            });
            a.zip(&x[2], |p, q| if p > q { q } else { p })
        }),
    );

    // ---- Qwen3 building blocks ----
    let ids = [3i64, 0, 7, 3, 3, 5];
    let rows = [3i64, 0, 4, 3];
    case::<B>(
        r,
        dev,
        "embedding",
        vec![inp(&[8, 4], -1.0, 1.0)],
        Box::new(move |x| {
            flat(burn::tensor::module::embedding(r2(&x[0], [8, 4]), ints::<B, 2>(&ids, [2, 3], dev)))
        }),
        Box::new(move |x| H::from_fn(&[2, 3, 4], |i| x[0].at(&[ids[i[0] * 3 + i[1]] as usize, i[2]]))),
    );
    case::<B>(
        r,
        dev,
        "select",
        vec![inp(&[5, 3], -1.0, 1.0)],
        Box::new(move |x| flat(r2(&x[0], [5, 3]).select(0, ints::<B, 1>(&rows, [4], dev)))),
        Box::new(move |x| H::from_fn(&[4, 3], |i| x[0].at(&[rows[i[0]] as usize, i[1]]))),
    );
    case::<B>(
        r,
        dev,
        "rms_norm.qwen3",
        vec![inp(&[2, 3, 8], -2.0, 2.0), inp(&[8], 0.5, 1.5)],
        Box::new(|x| flat(rms_norm(r3(&x[0], [2, 3, 8]), x[1].clone()))),
        Box::new(|x| x[0].rms_norm(&x[1], 1e-6)),
    );
    case::<B>(
        r,
        dev,
        "rope.qwen3",
        vec![inp(&[1, 2, 3, 8], -1.0, 1.0)],
        Box::new(move |x| {
            let (c, s) = rope_tables(3, 8, 1e4);
            let ct = Tensor::<B, 2>::from_data(TensorData::new(c.v, [3, 8]), dev)
                .unsqueeze::<4>()
                .expand([1, 2, 3, 8]);
            let st = Tensor::<B, 2>::from_data(TensorData::new(s.v, [3, 8]), dev)
                .unsqueeze::<4>()
                .expand([1, 2, 3, 8]);
            let a = r4(&x[0], [1, 2, 3, 8]);
            let rot = Tensor::cat(vec![a.clone().narrow(3, 4, 4).neg(), a.clone().narrow(3, 0, 4)], 3);
            flat(a * ct + rot * st)
        }),
        Box::new(|x| {
            let (c, s) = rope_tables(3, 8, 1e4);
            // The tables are f32 on the device: round them the same way.
            rope_host(&x[0], &c.map(|v| v as f32 as f64), &s.map(|v| v as f32 as f64))
        }),
    );
    case::<B>(
        r,
        dev,
        "attention.causal",
        vec![inp(&[1, 2, 4, 4], -1.0, 1.0), inp(&[1, 2, 4, 4], -1.0, 1.0), inp(&[1, 2, 4, 4], -1.0, 1.0)],
        Box::new(move |x| {
            let (q, k, v) = (r4(&x[0], [1, 2, 4, 4]), r4(&x[1], [1, 2, 4, 4]), r4(&x[2], [1, 2, 4, 4]));
            let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(0.5);
            let mask = Tensor::<B, 2, Bool>::tril_mask([4, 4], 0, dev).unsqueeze::<4>().expand([1, 2, 4, 4]);
            flat(softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 3).matmul(v))
        }),
        Box::new(|x| attention_host(&x[0], &x[1], &x[2])),
    );
    case::<B>(
        r,
        dev,
        "mlp.swiglu",
        vec![
            inp(&[3, 6], -1.0, 1.0),
            inp(&[5, 6], -0.5, 0.5),
            inp(&[5, 6], -0.5, 0.5),
            inp(&[6, 5], -0.5, 0.5),
        ],
        Box::new(|x| {
            let a = r2(&x[0], [3, 6]);
            let h = silu(linear(a.clone(), r2(&x[1], [5, 6]))) * linear(a, r2(&x[2], [5, 6]));
            flat(linear(h, r2(&x[3], [6, 5])))
        }),
        Box::new(|x| {
            let g = linear_h(&x[0], &x[1]).map(|v| v * sigmoid_f(v));
            linear_h(&g.zip(&linear_h(&x[0], &x[2]), |a, b| a * b), &x[3])
        }),
    );
    let f64_skip = r.unsupported(DType::F64, B::supports_dtype(dev, DType::F64));
    r.case(n("cast.f64_roundtrip"), t, || {
        if let Some(why) = f64_skip {
            return Err(Fail::Skip(why));
        }
        grad_check::<B>(
            dev,
            77,
            &[inp(&[12], -2.0, 2.0)],
            &|x| x[0].clone().cast(DType::F64).exp().cast(DType::F32),
            &|x| x[0].map(f64::exp),
        )
    });
    r.case(n("cast.bf16_roundtrip"), tol(Family::Gradient, DType::BF16), || {
        if !B::supports_dtype(dev, DType::BF16) {
            return Err(Fail::Skip("backend does not support BF16".into()));
        }
        // d/dx of cast(cast(x, bf16), f32)·3 is 3 (a straight-through cast).
        let x = Tensor::<B, 1>::from_data(TensorData::new(Rng::new(78).vec(16, -2.0, 2.0), [16]), dev)
            .require_grad();
        let grads = x.clone().cast(DType::BF16).mul_scalar(3.0).cast(DType::F32).sum().backward();
        let Some(g) = x.grad(&grads) else { return mismatch("no gradient") };
        max_err(&g.into_data().iter::<f64>().collect::<Vec<_>>(), &[3.0; 16], None)
    });

    // ---- a tiny Qwen3 decoder layer, end to end ----
    let tokens = [1i64, 4, 2, 7, 4, 0];
    let targets = [4i64, 2, 7, 4, 0, 1];
    case::<B>(
        r,
        dev,
        "qwen3_layer.end_to_end",
        vec![
            inp(&[8, 8], -1.0, 1.0),  // embed (tied lm head)
            inp(&[8], 0.5, 1.5),      // input_layernorm
            inp(&[8, 8], -0.4, 0.4),  // q_proj (2 heads × 4)
            inp(&[4, 8], -0.4, 0.4),  // k_proj (1 kv head)
            inp(&[4, 8], -0.4, 0.4),  // v_proj
            inp(&[4], 0.5, 1.5),      // q_norm / k_norm (shared here)
            inp(&[8, 8], -0.4, 0.4),  // o_proj
            inp(&[8], 0.5, 1.5),      // post_attention_layernorm
            inp(&[12, 8], -0.4, 0.4), // gate_proj, up_proj stacked
            inp(&[8, 6], -0.4, 0.4),  // down_proj
        ],
        Box::new(move |x| {
            let emb = r2(&x[0], [8, 8]);
            let h = burn::tensor::module::embedding(emb.clone(), ints::<B, 2>(&tokens, [1, 6], dev));
            let a = rms_norm(h.clone(), x[1].clone());
            let heads =
                |y: Tensor<B, 3>, nh: usize| rms_norm(y.reshape([1, 6, nh, 4]), x[5].clone()).swap_dims(1, 2);
            let q = heads(linear(a.clone(), r2(&x[2], [8, 8])), 2);
            let k = heads(linear(a.clone(), r2(&x[3], [4, 8])), 1).expand([1, 2, 6, 4]);
            let v = linear(a, r2(&x[4], [4, 8])).reshape([1, 6, 1, 4]).swap_dims(1, 2).expand([1, 2, 6, 4]);
            let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(0.5);
            let mask = Tensor::<B, 2, Bool>::tril_mask([6, 6], 0, dev).unsqueeze::<4>().expand([1, 2, 6, 6]);
            let att = softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 3).matmul(v);
            let h = h + linear(att.swap_dims(1, 2).reshape([1, 6, 8]), r2(&x[6], [8, 8]));
            let m = rms_norm(h.clone(), x[7].clone());
            let gu = linear(m, r2(&x[8], [12, 8]));
            let act = silu(gu.clone().narrow(2, 0, 6)) * gu.narrow(2, 6, 6);
            let h = h + linear(act, r2(&x[9], [8, 6]));
            ce(linear(h, emb).reshape([6, 8]), &targets, dev)
        }),
        Box::new(move |x| {
            let h = H::from_fn(&[1, 6, 8], |i| x[0].at(&[tokens[i[1]] as usize, i[2]]));
            let a = h.rms_norm(&x[1], 1e-6);
            let heads =
                |y: H, nh: usize| y.reshape(&[1, 6, nh, 4]).rms_norm(&x[5], 1e-6).permute(&[0, 2, 1, 3]);
            let q = heads(linear_h(&a, &x[2]), 2);
            let k1 = heads(linear_h(&a, &x[3]), 1);
            let v1 = linear_h(&a, &x[4]).reshape(&[1, 6, 1, 4]).permute(&[0, 2, 1, 3]);
            let k = H::cat(&[&k1, &k1], 1);
            let v = H::cat(&[&v1, &v1], 1);
            let att = attention_host(&q, &k, &v);
            let h = h.zip(&linear_h(&att.permute(&[0, 2, 1, 3]).reshape(&[1, 6, 8]), &x[6]), |p, q| p + q);
            let m = h.rms_norm(&x[7], 1e-6);
            let gu = linear_h(&m, &x[8]);
            let act = gu
                .slice(&[(0, 1), (0, 6), (0, 6)])
                .map(|v| v * sigmoid_f(v))
                .zip(&gu.slice(&[(0, 1), (0, 6), (6, 12)]), |p, q| p * q);
            let h = h.zip(&linear_h(&act, &x[9]), |p, q| p + q);
            ce_h(&linear_h(&h, &x[0]).reshape(&[6, 8]), &targets)
        }),
    );
}
