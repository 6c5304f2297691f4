//! Tier-3 tests: `DeviceGroup` over NCCL (`NcclCommunicator`) on the `CudaProxy` backend, on
//! NVIDIA GPUs: one rank driven through NCCL (`communicate_at_size_one`), and one rank per GPU
//! when there are several.
//!
//! They run only with `--features cuda` and `CUDA_PROXY_TESTS=1` at build time (see
//! `scripts/tier3-cuda-proxy.sh`; one rank per GPU also needs `MULTI_GPU_TESTS=1`); otherwise
//! cargo lists them as ignored, with the reason.
//! NCCL is opened at run time as `libnccl.so` (cudarc's name: a bare `libnccl.so.2` is not found).

mod collective_checks;

use std::time::Duration;

use burn_fsdp::comm::{CollectiveKind, ProcessGroup, ReduceOp, Tag};
use burn_metax_backend::collective::{CollectiveError, CudaProxyNcclGroup, NcclCommunicator};
use burn_metax_backend::{CudaProxy, CudaProxyDevice, CudaProxyRuntime};
use collective_checks::{check_collectives, check_kernel_ordering, tensor, values};

const TIMEOUT: Duration = Duration::from_secs(120);

fn first_device() -> CudaProxyDevice {
    CudaProxyRuntime::first_device()
        .unwrap_or_else(|err| panic!("CUDA_PROXY_TESTS=1 but no CUDA device is usable: {err}"))
}

fn one_rank_group(device: CudaProxyDevice) -> CudaProxyNcclGroup {
    let id = NcclCommunicator::unique_id().unwrap_or_else(|e| panic!("CUDA_PROXY_TESTS=1 but NCCL: {e}"));
    CudaProxyNcclGroup::nccl(device, id, 0, 1, TIMEOUT)
        .expect("one-rank NCCL group")
        .communicate_at_size_one(true)
}

fn as_group(g: &CudaProxyNcclGroup) -> &dyn ProcessGroup<CudaProxy> {
    g
}

/// Without NCCL the entry points fail with an error naming the library (no panic); with it
/// (and a GPU) they work.
#[test]
fn a_missing_nccl_is_an_error() {
    match NcclCommunicator::unique_id() {
        Ok(id) => assert_eq!(id.len(), 128),
        Err(CollectiveError::Unavailable { library, reason }) => {
            assert_eq!(library, "NCCL");
            assert!(reason.contains("libnccl.so"), "{reason}");
        }
        Err(other) => panic!("unexpected {other}"),
    }
}

#[test]
#[cfg_attr(
    not(cuda_proxy_tests),
    ignore = "needs an NVIDIA GPU and NCCL (build with --features cuda): set CUDA_PROXY_TESTS=1"
)]
fn one_rank_through_nccl_matches_the_host() {
    let device = first_device();
    let group = one_rank_group(device);
    check_collectives(as_group(&group), &device);
    group.synchronize().expect("synchronize");
}

#[test]
#[cfg_attr(
    not(cuda_proxy_tests),
    ignore = "needs an NVIDIA GPU and NCCL (build with --features cuda): set CUDA_PROXY_TESTS=1"
)]
fn one_rank_collectives_are_ordered_against_kernels() {
    let device = first_device();
    let group = one_rank_group(device);
    check_kernel_ordering(as_group(&group), &device);
}

#[test]
#[cfg_attr(
    not(cuda_proxy_tests),
    ignore = "needs an NVIDIA GPU and NCCL (build with --features cuda): set CUDA_PROXY_TESTS=1"
)]
fn a_group_of_one_skips_nccl_by_default() {
    let device = first_device();
    let id = NcclCommunicator::unique_id().expect("NCCL");
    let group = CudaProxyNcclGroup::nccl(device, id, 0, 1, TIMEOUT).expect("group");
    let g = as_group(&group);
    let x = tensor::<CudaProxy>(&[1.0, 2.0], burn::tensor::DType::F32, &device);
    let out = g.all_reduce(x, ReduceOp::Sum, &Tag::new("one")).expect("all_reduce");
    assert_eq!(values(out, burn::tensor::DType::F32), vec![1.0, 2.0]);
    assert_eq!(g.stats().calls(CollectiveKind::AllReduce), 0);
}

/// One rank per visible GPU (threads of this process); needs at least two.
#[test]
#[cfg_attr(
    not(all(cuda_proxy_tests, multi_gpu_tests)),
    ignore = "needs two or more NVIDIA GPUs with NCCL: set CUDA_PROXY_TESTS=1 and MULTI_GPU_TESTS=1"
)]
fn one_rank_per_gpu() {
    let devices = CudaProxyRuntime::devices();
    assert!(devices.len() >= 2, "MULTI_GPU_TESTS=1 but only {} CUDA device(s)", devices.len());
    let world = devices.len();
    let id = NcclCommunicator::unique_id().expect("NCCL");
    std::thread::scope(|s| {
        let handles: Vec<_> = devices
            .iter()
            .enumerate()
            .map(|(rank, &device)| {
                s.spawn(move || {
                    let group = CudaProxyNcclGroup::nccl(device, id, rank, world, TIMEOUT).expect("group");
                    check_collectives(as_group(&group), &device);
                    check_kernel_ordering(as_group(&group), &device);
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
        }
    });
}
