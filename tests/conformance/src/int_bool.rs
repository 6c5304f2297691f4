//! Int and bool cases (default int dtype), all exact.

use burn::prelude::*;
use burn::tensor::{DType, IntDType, TensorData};

use crate::harness::{Fail, Family, Measured, Runner, tol};
use crate::host::{H, Rng, check, check_exact, ints};

fn max_of(results: impl IntoIterator<Item = Measured>) -> Measured {
    let mut worst = 0.0f64;
    for r in results {
        worst = worst.max(r?);
    }
    Ok(worst)
}

fn int_h(v: &[i64], s: &[usize]) -> H {
    H::new(s, v.iter().map(|&x| x as f64).collect())
}

fn bools<B: Backend, const D: usize>(v: &[bool], s: [usize; D], dev: &B::Device) -> Tensor<B, D, Bool> {
    Tensor::from_bool(TensorData::new(v.to_vec(), s), dev)
}

fn bool_h(v: &[bool], s: &[usize]) -> H {
    H::new(s, v.iter().map(|&b| if b { 1.0 } else { 0.0 }).collect())
}

/// Int cases, named `<label>/int/<op>`.
pub(crate) fn int_cases<B: Backend>(r: &mut Runner<'_>, label: &str, dev: &B::Device) {
    let n = |op: &str| format!("{label}/int/{op}");
    let t0 = tol(Family::Exact, DType::I64);

    r.case(n("from_data_into_data"), t0, || {
        let v = Rng::new(60).ints(30, -1000, 1000);
        check_exact(ints::<B, 2>(&v, [5, 6], dev), &int_h(&v, &[5, 6]))
    });
    r.case(n("arange_zeros_ones_full"), t0, || {
        max_of([
            check_exact(Tensor::<B, 1, Int>::arange(0..7, dev), &int_h(&[0, 1, 2, 3, 4, 5, 6], &[7])),
            check_exact(Tensor::<B, 1, Int>::arange(-3..3, dev), &int_h(&[-3, -2, -1, 0, 1, 2], &[6])),
            check_exact(Tensor::<B, 1, Int>::arange_step(1..10, 3, dev), &int_h(&[1, 4, 7], &[3])),
            check_exact(Tensor::<B, 2, Int>::zeros([2, 3], dev), &int_h(&[0; 6], &[2, 3])),
            check_exact(Tensor::<B, 2, Int>::ones([2, 3], dev), &int_h(&[1; 6], &[2, 3])),
            check_exact(Tensor::<B, 2, Int>::full([2, 3], 7, dev), &int_h(&[7; 6], &[2, 3])),
        ])
    });
    r.case(n("arith"), t0, || {
        let mut g = Rng::new(61);
        let (av, bv) = (g.ints(24, -50, 50), g.ints(4, -5, 6));
        let (a, b) = (ints::<B, 3>(&av, [2, 4, 3], dev), ints::<B, 3>(&bv, [1, 4, 1], dev));
        let (ah, bh) = (int_h(&av, &[2, 4, 3]), int_h(&bv, &[1, 4, 1]));
        max_of([
            check_exact(a.clone() + b.clone(), &ah.zip(&bh, |x, y| x + y)),
            check_exact(a.clone() - b.clone(), &ah.zip(&bh, |x, y| x - y)),
            check_exact(a.clone() * b, &ah.zip(&bh, |x, y| x * y)),
            check_exact(a.clone().add_scalar(5), &ah.map(|x| x + 5.0)),
            check_exact(a.clone().mul_scalar(-3), &ah.map(|x| x * -3.0)),
            check_exact(a.clone().neg(), &ah.map(|x| -x)),
            check_exact(a.clone().abs(), &ah.map(f64::abs)),
            check_exact(a.clamp(-10, 10), &ah.map(|x| x.clamp(-10.0, 10.0))),
        ])
    });
    r.case(n("div_remainder"), t0, || {
        // Division on non-negative operands (truncation and floor agree); remainder follows
        // Burn's (and PyTorch's) floor convention: the result has the divisor's sign.
        let mut g = Rng::new(62);
        let (av, bv) = (g.ints(20, 0, 100), g.ints(20, 1, 9));
        let sv = g.ints(20, -40, 40);
        let (a, b, s) =
            (ints::<B, 1>(&av, [20], dev), ints::<B, 1>(&bv, [20], dev), ints::<B, 1>(&sv, [20], dev));
        let (ah, bh, sh) = (int_h(&av, &[20]), int_h(&bv, &[20]), int_h(&sv, &[20]));
        let floor_mod = |x: f64, y: f64| x - y * (x / y).floor();
        max_of([
            check_exact(a.clone() / b.clone(), &ah.zip(&bh, |x, y| (x / y).floor())),
            check_exact(a.div_scalar(7), &ah.map(|x| (x / 7.0).floor())),
            check_exact(s.clone().remainder(b), &sh.zip(&bh, floor_mod)),
            check_exact(s.remainder_scalar(3), &sh.map(|x| floor_mod(x, 3.0))),
        ])
    });
    r.case(n("reductions"), t0, || {
        let v = Rng::new(63).ints(24, -20, 20);
        let (t, h) = (ints::<B, 2>(&v, [4, 6], dev), int_h(&v, &[4, 6]));
        let argmax = h.reduce(1, |f| (0..f.len()).fold(0, |b, i| if f[i] > f[b] { i } else { b }) as f64);
        max_of([
            check_exact(t.clone().sum(), &H::new(&[1], vec![h.v.iter().sum()])),
            check_exact(t.clone().sum_dim(0), &h.sum_dim(0)),
            check_exact(t.clone().max_dim(1), &h.reduce(1, |f| f.iter().cloned().fold(f64::MIN, f64::max))),
            check_exact(t.clone().min_dim(0), &h.reduce(0, |f| f.iter().cloned().fold(f64::MAX, f64::min))),
            check_exact(
                t.clone().cumsum(1),
                &H::from_fn(&h.s, |i| (0..=i[1]).map(|k| h.at(&[i[0], k])).sum()),
            ),
            check_exact(t.argmax(1), &argmax),
        ])
    });
    r.case(n("compare"), t0, || {
        let mut g = Rng::new(64);
        let (av, bv) = (g.ints(12, -2, 3), g.ints(12, -2, 3));
        let (a, b) = (ints::<B, 2>(&av, [3, 4], dev), ints::<B, 2>(&bv, [3, 4], dev));
        let (ah, bh) = (int_h(&av, &[3, 4]), int_h(&bv, &[3, 4]));
        let bo = |c: bool| if c { 1.0 } else { 0.0 };
        max_of([
            check_exact(a.clone().equal(b.clone()), &ah.zip(&bh, |x, y| bo(x == y))),
            check_exact(a.clone().greater(b.clone()), &ah.zip(&bh, |x, y| bo(x > y))),
            check_exact(a.clone().lower_equal(b), &ah.zip(&bh, |x, y| bo(x <= y))),
            check_exact(a.clone().equal_elem(0), &ah.map(|x| bo(x == 0.0))),
            check_exact(a.greater_elem(1), &ah.map(|x| bo(x > 1.0))),
        ])
    });
    r.case(n("indexing"), t0, || {
        let v: Vec<i64> = (0..24).collect();
        let (t, h) = (ints::<B, 3>(&v, [2, 3, 4], dev), int_h(&v, &[2, 3, 4]));
        let idx = [2i64, 0, 2];
        max_of([
            check_exact(t.clone().reshape([6, 4]), &h.reshape(&[6, 4])),
            check_exact(t.clone().swap_dims(0, 2), &h.permute(&[2, 1, 0])),
            check_exact(t.clone().slice([0..2, 1..3, 1..2]), &h.slice(&[(0, 2), (1, 3), (1, 2)])),
            check_exact(Tensor::cat(vec![t.clone(), t.clone()], 1), &H::cat(&[&h, &h], 1)),
            check_exact(
                t.clone().select(1, ints::<B, 1>(&idx, [3], dev)),
                &H::from_fn(&[2, 3, 4], |i| h.at(&[i[0], idx[i[1]] as usize, i[2]])),
            ),
            check_exact(t.narrow(2, 1, 2), &h.slice(&[(0, 2), (0, 3), (1, 3)])),
        ])
    });
    r.case(n("to_float"), t0, || {
        let v = Rng::new(65).ints(10, -300, 300);
        let t = ints::<B, 1>(&v, [10], dev);
        max_of([
            check(t.clone().float(), &int_h(&v, &[10]), None),
            check_exact(t.float().int(), &int_h(&v, &[10])),
        ])
    });
    r.case(n("cast_i32_i64"), t0, || {
        for dt in [DType::I32, DType::I64] {
            if !B::supports_dtype(dev, dt) {
                return Err(Fail::Skip(format!("backend does not support {dt:?}")));
            }
        }
        let v = Rng::new(66).ints(10, -100_000, 100_000);
        let t = ints::<B, 1>(&v, [10], dev);
        let a = t.clone().cast(IntDType::I32);
        let b = t.cast(IntDType::I64);
        if a.dtype() != DType::I32 || b.dtype() != DType::I64 {
            return Err(Fail::Mismatch(format!("dtypes {:?}, {:?}", a.dtype(), b.dtype())));
        }
        max_of([check_exact(a.cast(IntDType::I64), &int_h(&v, &[10])), check_exact(b, &int_h(&v, &[10]))])
    });
}

/// Bool cases, named `<label>/bool/<op>`.
pub(crate) fn bool_cases<B: Backend>(r: &mut Runner<'_>, label: &str, dev: &B::Device) {
    let n = |op: &str| format!("{label}/bool/{op}");
    let t0 = tol(Family::Exact, DType::Bool(burn::tensor::BoolStore::Native));
    let mut g = Rng::new(70);
    let av: Vec<bool> = g.ints(12, 0, 2).into_iter().map(|x| x == 1).collect();
    let bv: Vec<bool> = g.ints(12, 0, 2).into_iter().map(|x| x == 1).collect();

    r.case(n("logic"), t0, || {
        let (a, b) = (bools::<B, 2>(&av, [3, 4], dev), bools::<B, 2>(&bv, [3, 4], dev));
        let (ah, bh) = (bool_h(&av, &[3, 4]), bool_h(&bv, &[3, 4]));
        max_of([
            check_exact(a.clone(), &ah),
            check_exact(a.clone().bool_not(), &ah.map(|x| 1.0 - x)),
            check_exact(a.clone().bool_and(b.clone()), &ah.zip(&bh, |x, y| x * y)),
            check_exact(a.clone().bool_or(b.clone()), &ah.zip(&bh, |x, y| x.max(y))),
            check_exact(a.bool_xor(b), &ah.zip(&bh, |x, y| (x - y).abs())),
        ])
    });
    r.case(n("any_all"), t0, || {
        let a = bools::<B, 2>(&av, [3, 4], dev);
        let ah = bool_h(&av, &[3, 4]);
        let all_true = bools::<B, 1>(&[true; 5], [5], dev);
        let all_false = bools::<B, 1>(&[false; 5], [5], dev);
        max_of([
            check_exact(a.clone().any_dim(1), &ah.reduce(1, |f| f.iter().cloned().fold(0.0, f64::max))),
            check_exact(a.clone().all_dim(0), &ah.reduce(0, |f| f.iter().cloned().fold(1.0, f64::min))),
            check_exact(a.clone().any(), &H::new(&[1], vec![ah.v.iter().cloned().fold(0.0, f64::max)])),
            check_exact(a.all(), &H::new(&[1], vec![ah.v.iter().cloned().fold(1.0, f64::min)])),
            check_exact(all_true.clone().all(), &H::new(&[1], vec![1.0])),
            check_exact(all_true.any(), &H::new(&[1], vec![1.0])),
            check_exact(all_false.clone().any(), &H::new(&[1], vec![0.0])),
            check_exact(all_false.all(), &H::new(&[1], vec![0.0])),
        ])
    });
    r.case(n("to_int_float"), t0, || {
        let a = bools::<B, 2>(&av, [3, 4], dev);
        let ah = bool_h(&av, &[3, 4]);
        max_of([check_exact(a.clone().int(), &ah), check(a.float(), &ah, None)])
    });
    r.case(n("tri_masks"), t0, || {
        max_of([
            check_exact(
                Tensor::<B, 2, Bool>::tril_mask([4, 6], 2, dev),
                &H::from_fn(&[4, 6], |i| ((i[1] > i[0] + 2) as u8).into()),
            ),
            check_exact(
                Tensor::<B, 2, Bool>::triu_mask([4, 4], 0, dev),
                &H::from_fn(&[4, 4], |i| ((i[1] < i[0]) as u8).into()),
            ),
        ])
    });
    r.case(n("movement"), t0, || {
        let a = bools::<B, 2>(&av, [3, 4], dev);
        let ah = bool_h(&av, &[3, 4]);
        max_of([
            check_exact(a.clone().reshape([4, 3]), &ah.reshape(&[4, 3])),
            check_exact(a.clone().swap_dims(0, 1), &ah.permute(&[1, 0])),
            check_exact(
                a.clone().unsqueeze::<3>().expand([2, 3, 4]),
                &H::from_fn(&[2, 3, 4], |i| ah.at(&i[1..])),
            ),
            check_exact(Tensor::cat(vec![a.clone(), a.clone()], 0), &H::cat(&[&ah, &ah], 0)),
            check_exact(a.slice([1..3, 0..2]), &ah.slice(&[(1, 3), (0, 2)])),
        ])
    });
}
