//! Checks of a device group's collectives against values computed on the host, shared by the
//! mock tests (`collective_mock.rs`) and the GPU tests (`nccl_gpu.rs`, `mccl_gpu.rs`).
//!
//! The inputs are multiples of 0.25 in [-7.5, 7.5], so every sum and mean over up to 8 ranks is
//! exact in bf16, f16, f32 and f64 whatever order the library adds in: results are compared
//! exactly.
#![allow(dead_code)]

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData, bf16, f16};
use burn_fsdp::comm::{CollectiveKind, ProcessGroup, ReduceOp, Tag};

/// Runs `f` on `world` threads, one per rank: rank `r` joins its group with `join(r)` (the
/// group and its device) and then runs `f` on them. Every rank's result, in rank order; a
/// rank's panic is raised again here.
pub fn run_ranks<G, D: Send, T: Send>(
    world: usize,
    join: impl Fn(usize) -> (G, D) + Sync,
    f: impl Fn(&G, D) -> T + Sync,
) -> Vec<T> {
    let (join, f) = (&join, &f);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                s.spawn(move || {
                    let (group, device) = join(rank);
                    f(&group, device)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    })
}

/// Element `i` of rank `r`'s input.
pub fn value(r: usize, i: usize) -> f64 {
    (((i * 7 + r * 13) % 61) as f64 - 30.0) * 0.25
}

/// A 1D tensor of `values` in `dtype`, created from host data of that dtype (no kernel runs).
pub fn tensor<B: Backend>(values: &[f64], dtype: DType, device: &B::Device) -> Tensor<B, 1> {
    let n = values.len();
    let data = match dtype {
        DType::F64 => TensorData::new(values.to_vec(), [n]),
        DType::F32 => TensorData::new(values.iter().map(|v| *v as f32).collect::<Vec<_>>(), [n]),
        DType::F16 => TensorData::new(values.iter().map(|v| f16::from_f64(*v)).collect::<Vec<_>>(), [n]),
        DType::BF16 => TensorData::new(values.iter().map(|v| bf16::from_f64(*v)).collect::<Vec<_>>(), [n]),
        other => panic!("no test data for {other:?}"),
    };
    Tensor::from_data(data, (device, dtype))
}

/// The elements of `t` as f64 (read on the host: no kernel runs), checking its dtype.
pub fn values<B: Backend>(t: Tensor<B, 1>, dtype: DType) -> Vec<f64> {
    assert_eq!(t.dtype(), dtype, "the output keeps the input's dtype");
    let data = t.into_data();
    match dtype {
        DType::F64 => data.to_vec::<f64>().expect("f64"),
        DType::F32 => data.to_vec::<f32>().expect("f32").into_iter().map(f64::from).collect(),
        DType::F16 => data.to_vec::<f16>().expect("f16").into_iter().map(f64::from).collect(),
        DType::BF16 => data.to_vec::<bf16>().expect("bf16").into_iter().map(f64::from).collect(),
        other => panic!("no test data for {other:?}"),
    }
}

/// Every collective of `group` (any size; every rank calls this) in f32, bf16, f16 and f64 with
/// uneven sizes, checked against host values; then the barrier and the call counters.
pub fn check_collectives<B: Backend>(group: &dyn ProcessGroup<B>, device: &B::Device) {
    let (rank, world) = (group.rank(), group.size());
    let before = group.stats();
    let mut calls = 0u64;
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        let tag = Tag::new(format!("check {dtype:?}"));
        // All-gather of 3 elements per rank (not a multiple of anything useful).
        let mine: Vec<f64> = (0..3).map(|i| value(rank, i)).collect();
        let gathered =
            values(group.all_gather(tensor::<B>(&mine, dtype, device), &tag).expect("all_gather"), dtype);
        let want: Vec<f64> = (0..world).flat_map(|r| (0..3).map(move |i| value(r, i))).collect();
        assert_eq!(gathered, want, "all_gather {dtype:?} rank {rank} of {world}");

        // Reduce-scatter of 5 elements per rank, sum and mean.
        let chunk = 5;
        let input: Vec<f64> = (0..chunk * world).map(|i| value(rank, i)).collect();
        let sum_all: Vec<f64> = (0..chunk * world).map(|i| (0..world).map(|r| value(r, i)).sum()).collect();
        let my_chunk = &sum_all[rank * chunk..(rank + 1) * chunk];
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let out =
                group.reduce_scatter(tensor::<B>(&input, dtype, device), op, &tag).expect("reduce_scatter");
            let want: Vec<f64> = match op {
                ReduceOp::Avg => my_chunk.iter().map(|v| v / world as f64).collect(),
                _ => my_chunk.to_vec(),
            };
            assert_eq!(values(out, dtype), want, "reduce_scatter {op:?} {dtype:?} rank {rank} of {world}");
        }

        // All-reduce of 7 elements: sum, mean, max.
        let input: Vec<f64> = (0..7).map(|i| value(rank, i)).collect();
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
            let out = group.all_reduce(tensor::<B>(&input, dtype, device), op, &tag).expect("all_reduce");
            let want: Vec<f64> = (0..7)
                .map(|i| {
                    let column = (0..world).map(|r| value(r, i));
                    match op {
                        ReduceOp::Sum => column.sum(),
                        ReduceOp::Avg => column.sum::<f64>() / world as f64,
                        ReduceOp::Max => column.fold(f64::NEG_INFINITY, f64::max),
                    }
                })
                .collect();
            assert_eq!(values(out, dtype), want, "all_reduce {op:?} {dtype:?} rank {rank} of {world}");
        }

        // Broadcast of 3 elements from the last rank.
        let root = world - 1;
        let out = group.broadcast(tensor::<B>(&mine, dtype, device), root, &tag).expect("broadcast");
        let want: Vec<f64> = (0..3).map(|i| value(root, i)).collect();
        assert_eq!(values(out, dtype), want, "broadcast {dtype:?} rank {rank} of {world}");
        calls += 1;
    }
    group.barrier(&Tag::new("check barrier")).expect("barrier");

    let stats = group.stats().since(&before);
    // A group of one returns inputs without communicating (and counts nothing), unless it is
    // made to communicate; either way every kind is counted the same number of times.
    let per_dtype = stats.calls(CollectiveKind::AllGather);
    assert!(per_dtype == calls || per_dtype == 0, "{stats:?}");
    let k = per_dtype / calls.max(1);
    assert_eq!(stats.calls(CollectiveKind::ReduceScatter), 2 * calls * k, "{stats:?}");
    assert_eq!(stats.calls(CollectiveKind::AllReduce), 3 * calls * k, "{stats:?}");
    assert_eq!(stats.calls(CollectiveKind::Broadcast), calls * k, "{stats:?}");
    assert_eq!(stats.calls(CollectiveKind::Barrier), k, "{stats:?}");
}

/// Compute → collective → compute on a real device: the input is written by a kernel queued
/// just before the collective, and a kernel reads the output just after, so both orderings
/// (communication stream after compute, compute after communication) are exercised.
pub fn check_kernel_ordering<B: Backend>(group: &dyn ProcessGroup<B>, device: &B::Device) {
    let (rank, world) = (group.rank(), group.size());
    let n = 100_003;
    let host: Vec<f64> = (0..n).map(|i| value(rank, i)).collect();
    // bf16 holds the results exactly for one rank only.
    let dtypes: &[DType] = if world == 1 { &[DType::F32, DType::BF16] } else { &[DType::F32] };
    for &dtype in dtypes {
        let x = tensor::<B>(&host, dtype, device);
        let tripled = x * 3.0;
        let summed = group.all_reduce(tripled, ReduceOp::Sum, &Tag::new("ordering")).expect("all_reduce");
        let after = summed.clone() * 2.0 + 1.0;
        let want: Vec<f64> = (0..n).map(|i| (0..world).map(|r| 3.0 * value(r, i)).sum()).collect();
        assert_eq!(values(summed, dtype), want, "{dtype:?}: the collective saw the kernel's output");
        let want_after: Vec<f64> = want.iter().map(|v| v * 2.0 + 1.0).collect();
        assert_eq!(values(after, dtype), want_after, "{dtype:?}: the kernel saw the collective's output");
    }
}
