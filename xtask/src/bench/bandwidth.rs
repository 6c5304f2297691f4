//! Collective bandwidth against memory copies.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use burn::tensor::{Tensor, TensorData};
use burn_fsdp::{LocalGroup, ProcessGroup, ReduceOp, Tag, launch};

use crate::Backend;

/// Seconds for `reps` copies of `bytes` between two warm buffers on this thread.
pub(crate) fn timed_copies(bytes: usize, reps: usize) -> f64 {
    let src = vec![1.0f32; bytes / 4];
    let mut dst = vec![0.0f32; bytes / 4];
    dst.copy_from_slice(&src);
    let start = Instant::now();
    for i in 0..reps {
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst[i % dst.len()]);
    }
    start.elapsed().as_secs_f64()
}

/// GB/s of a plain memory copy of `bytes` (warm buffers, one thread).
pub(super) fn memcpy_gbps(bytes: usize, reps: usize) -> f64 {
    (bytes * reps) as f64 / timed_copies(bytes, reps) / 1e9
}

/// GB/s per thread of `threads` threads each copying `bytes` at the same time (warm buffers):
/// the copy an ideal in-process all-gather with one output per rank has to make.
pub(super) fn parallel_memcpy_gbps(threads: usize, bytes: usize, reps: usize) -> f64 {
    let secs = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads).map(|_| s.spawn(move || timed_copies(bytes, reps))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or(f64::NAN)).fold(0.0f64, f64::max)
    });
    (bytes * reps) as f64 / secs / 1e9
}

/// GB/s of in-process all-gather and reduce-scatter over `world` ranks, counted as the bytes
/// each rank receives into its output (all-gather) or reads from its input (reduce-scatter),
/// over the slowest rank's time. One untimed warm-up call of each first.
pub(super) fn collective_gbps(world: usize, bytes_per_rank: usize, reps: usize) -> Result<(f64, f64)> {
    let n = bytes_per_rank / 4;
    let times = launch(world, Duration::from_secs(120), |group: Arc<LocalGroup>| {
        let device = crate::device();
        let shard = Tensor::<Backend, 1>::from_data(TensorData::new(vec![1.0f32; n], [n]), &device);
        let full =
            Tensor::<Backend, 1>::from_data(TensorData::new(vec![1.0f32; n * world], [n * world]), &device);
        let tag = Tag::new("bench");
        let ag = |g: &LocalGroup| ProcessGroup::<Backend>::all_gather(g, shard.clone(), &tag);
        let rs =
            |g: &LocalGroup| ProcessGroup::<Backend>::reduce_scatter(g, full.clone(), ReduceOp::Avg, &tag);
        std::hint::black_box(ag(&group)?);
        ProcessGroup::<Backend>::barrier(&*group, &tag)?;
        let start = Instant::now();
        for _ in 0..reps {
            std::hint::black_box(ag(&group)?);
        }
        let ag_secs = start.elapsed().as_secs_f64();
        std::hint::black_box(rs(&group)?);
        ProcessGroup::<Backend>::barrier(&*group, &tag)?;
        let start = Instant::now();
        for _ in 0..reps {
            std::hint::black_box(rs(&group)?);
        }
        Ok::<_, burn_fsdp::CommError>((ag_secs, start.elapsed().as_secs_f64()))
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let (ag, rs) = times.iter().fold((0.0f64, 0.0f64), |acc, t| (acc.0.max(t.0), acc.1.max(t.1)));
    let moved = (bytes_per_rank * world * reps) as f64;
    Ok((moved / ag / 1e9, moved / rs / 1e9))
}
