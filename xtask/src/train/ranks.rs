//! The flags turned into the library's training loop ([`qwen3_burn::trainer`]): its options,
//! the backend and device each kind of run trains on, and one rank's share of a job. The loop
//! itself is the library's; nothing here trains.

use std::sync::Arc;

use anyhow::Result;
use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::tensor::DType;
use burn::tensor::backend::Backend as BurnBackend;
use burn_fsdp::offload::OffloadPolicy;
use burn_fsdp::{CommError, FsdpConfig, MixedPrecisionPolicy, ProcessGroup};
#[cfg(feature = "metax")]
use burn_metax_backend::{MetaxEmu, MetaxEmuDevice};
use qwen3_burn::trainer::{
    self, Parallelism, RankGroups, SavePolicy, StepMetrics, TrainOptions, split_mesh, train_in_process,
};

#[cfg(feature = "metax")]
use super::args::DeviceKind;
use super::args::{ActivationCheckpointing, CpuBackend, Precision, TrainArgs};
use super::report::MetricsSink;
use super::setup::Setup;
use crate::Backend;

/// The autodiff backend of FSDP training when backward re-gathers ([`regathers`]): balanced
/// checkpointing, so that resharded parameters are re-gathered in backward.
pub type FsdpTrainBackend<B> = Autodiff<B, BalancedCheckpointing>;

/// The FSDP policy the flags ask for.
pub fn fsdp_config(args: &TrainArgs) -> FsdpConfig {
    let mp_policy = match args.mixed_precision {
        Precision::Fp32 => MixedPrecisionPolicy::default(),
        Precision::Bf16 => MixedPrecisionPolicy {
            param_dtype: Some(DType::BF16),
            reduce_dtype: Some(DType::F32),
            output_dtype: None,
        },
    };
    FsdpConfig {
        reshard_after_forward: args.reshard_after_forward.unwrap_or(true),
        mp_policy,
        offload: OffloadPolicy { enabled: args.offload },
        prefetch: !args.no_prefetch,
        units: qwen3_burn::parallelize::fsdp_units(),
        ..FsdpConfig::default()
    }
}

/// What the flags ask the training loop for, over `steps` steps.
pub fn options(args: &TrainArgs, steps: usize) -> Result<TrainOptions> {
    let schedule = args.lr_schedule(steps);
    Ok(TrainOptions {
        steps,
        grad_accum: args.grad_accum,
        clip: args.clip,
        activation_checkpointing: args.activation_checkpointing == ActivationCheckpointing::Block,
        optimizer: args.adamw(),
        lr: Arc::new(move |step| schedule.lr_at(step)),
        fsdp: fsdp_config(args),
        resume: None,
        save: args.save_dir.clone().map(|dir| SavePolicy { dir, every: args.save_every }),
        export: args.export.clone(),
        timeout: args.collective_timeout()?,
    })
}

/// [`options`] for a run from `setup` (its steps and the checkpoint it resumes).
fn setup_options(args: &TrainArgs, setup: &Setup) -> Result<TrainOptions> {
    Ok(TrainOptions { resume: setup.resume.clone(), ..options(args, setup.steps)? })
}

/// Whether an FSDP rank's backward has anything to re-gather with these flags
/// ([`TrainOptions::regathers`]).
pub fn regathers(args: &TrainArgs, shard_world: usize) -> bool {
    let options = TrainOptions {
        fsdp: fsdp_config(args),
        activation_checkpointing: args.activation_checkpointing == ActivationCheckpointing::Block,
        ..TrainOptions::new(0)
    };
    options.regathers(shard_world)
}

/// Single-device training: the reference every FSDP run is compared with. On the CPU
/// (`--cpu-backend`), on emulated MetaX device 0 with `--device metax-emu`, or on GPU 0 with
/// `--device cuda-proxy` (xtask built with `cuda-proxy`), or with Burn's CUDA backend on GPU 0
/// with `--device cuda` (xtask built with `burn-cuda`).
pub fn train_single(args: &TrainArgs, setup: Setup, sink: &MetricsSink) -> Result<Vec<StepMetrics>> {
    let options = setup_options(args, &setup)?;
    let Setup { config, model, batches, .. } = &setup;
    Ok(match args.device {
        #[cfg(feature = "metax")]
        DeviceKind::MetaxEmu => {
            let single = Parallelism::Single(MetaxEmuDevice::new(0));
            trainer::train::<MetaxEmu>(single, config, model, batches, &options, sink)?
        }
        #[cfg(feature = "cuda-proxy")]
        DeviceKind::CudaProxy => {
            let single = Parallelism::Single(burn_metax_backend::CudaProxyDevice { index: 0 });
            trainer::train::<burn_metax_backend::CudaProxy<f32>>(
                single, config, model, batches, &options, sink,
            )?
        }
        #[cfg(feature = "burn-cuda")]
        DeviceKind::Cuda => {
            let single = Parallelism::Single(burn_cuda::CudaDevice::new(0));
            trainer::train::<burn_cuda::Cuda<f32>>(single, config, model, batches, &options, sink)?
        }
        _ if args.cpu_backend == CpuBackend::Flex => {
            let single = Parallelism::Single(Default::default());
            trainer::train::<burn::backend::Flex<f32>>(single, config, model, batches, &options, sink)?
        }
        _ => {
            let single = Parallelism::Single(crate::device());
            trainer::train::<Backend>(single, config, model, batches, &options, sink)?
        }
    })
}

/// FSDP training over in-process ranks (threads), `--world-size` of them or the ranks of
/// `--mesh`/`--hsdp`; each rank trains on its slice of every step's batch, all on the backend's
/// default device.
pub fn train_fsdp<B: BurnBackend>(
    args: &TrainArgs,
    setup: Setup,
    sink: &MetricsSink,
) -> Result<Vec<StepMetrics>> {
    train_fsdp_on::<B>(args, setup, sink, |_| Default::default())
}

/// [`train_fsdp`] on the CPU backend the flags choose: NdArray, or Flex for
/// `--cpu-backend flex` and for bf16 mixed precision (NdArray has no bf16).
pub fn train_fsdp_cpu(args: &TrainArgs, setup: Setup, sink: &MetricsSink) -> Result<Vec<StepMetrics>> {
    match args.cpu_backend.at(args.mixed_precision) {
        CpuBackend::NdArray => train_fsdp::<Backend>(args, setup, sink),
        CpuBackend::Flex => train_fsdp::<burn::backend::Flex<f32>>(args, setup, sink),
    }
}

/// [`train_fsdp`] with rank `r` on device `device_of(r)` (e.g. one emulated MetaX device per
/// rank).
pub fn train_fsdp_on<B: BurnBackend>(
    args: &TrainArgs,
    setup: Setup,
    sink: &MetricsSink,
    device_of: impl Fn(usize) -> B::Device + Sync,
) -> Result<Vec<StepMetrics>> {
    let options = setup_options(args, &setup)?;
    let Setup { config, model, batches, .. } = &setup;
    Ok(train_in_process::<B>(args.topology(), config, model, batches, &options, sink, device_of)?)
}

/// FSDP over in-process ranks on emulated MetaX devices (rank `r` on device `r`, flat
/// topology), with the collectives `--in-process-collectives` asks for: on the devices (a
/// [`MetaxEmuGroup`] per rank over one [`EmuCommunicator`] group) or through the host
/// (burn-fsdp's `LocalGroup`). `wrap` may wrap each rank's group (benchmarks count what the
/// collectives do). A rank that fails aborts the group, so its peers stop within their current
/// collective.
///
/// [`MetaxEmuGroup`]: burn_metax_backend::collective::MetaxEmuGroup
/// [`EmuCommunicator`]: burn_metax_backend::collective::EmuCommunicator
#[cfg(feature = "metax")]
pub fn train_fsdp_emu(
    args: &TrainArgs,
    setup: Setup,
    sink: &dyn trainer::TrainSink,
    wrap: &(
         dyn Fn(Arc<dyn ProcessGroup<MetaxEmu>>, MetaxEmuDevice) -> Arc<dyn ProcessGroup<MetaxEmu>> + Sync
     ),
) -> Result<Vec<StepMetrics>> {
    use super::args::InProcessCollectives;
    use burn_metax_backend::collective::{EmuCommunicator, MetaxEmuGroup};
    use std::sync::Mutex;
    let topology = args.topology();
    let qwen3_burn::trainer::Topology::Flat(world) = topology else {
        anyhow::bail!("in-process ranks on emulated devices: --mesh/--hsdp are not supported here");
    };
    let options = setup_options(args, &setup)?;
    let timeout = options.timeout;
    let on_device = args.in_process_collectives == InProcessCollectives::Device;
    let comms = if on_device {
        EmuCommunicator::group(world).map_err(|e| anyhow::anyhow!("--device metax-emu: {e}"))?
    } else {
        Vec::new()
    };
    let abort = comms.first().map(EmuCommunicator::abort_handle);
    let comms: Vec<Mutex<Option<EmuCommunicator>>> = comms.into_iter().map(|c| Mutex::new(Some(c))).collect();
    let Setup { config, model, batches, .. } = &setup;
    let results = burn_fsdp::comm::local::launch(world, timeout, |local| {
        let rank = ProcessGroup::<MetaxEmu>::rank(&*local);
        let device = MetaxEmuDevice::new(rank);
        let result = (|| {
            let group: Arc<dyn ProcessGroup<MetaxEmu>> = if on_device {
                let comm = comms[rank]
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take()
                    .ok_or_else(|| format!("rank {rank}: its communicator was already taken"))?;
                Arc::new(
                    MetaxEmuGroup::new(device, comm, timeout)
                        .map_err(|e| format!("rank {rank}: joining the emulated devices' group: {e}"))?,
                )
            } else {
                local.clone()
            };
            let groups = RankGroups::<MetaxEmu> {
                topology,
                rank,
                outer: wrap(group, device),
                inner: None,
                gate: None,
                device,
            };
            trainer::train::<MetaxEmu>(Parallelism::Sharded(groups), config, model, batches, &options, sink)
                .map_err(|e| e.to_string())
        })();
        if result.is_err()
            && let Some(abort) = &abort
        {
            abort.abort();
        }
        result
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    results.into_iter().next().ok_or_else(|| anyhow::anyhow!("no rank ran"))
}

/// One FSDP rank's training (any process groups: in-process threads, MPI or TCP processes,
/// device communicators). Rank 0 reports to `sink`.
pub fn fsdp_rank<B: BurnBackend>(
    args: &TrainArgs,
    setup: &Setup,
    groups: RankGroups<B>,
    sink: &MetricsSink,
) -> Result<Vec<StepMetrics>> {
    let options = setup_options(args, setup)?;
    let Setup { config, model, batches, .. } = setup;
    Ok(trainer::train::<B>(Parallelism::Sharded(groups), config, model, batches, &options, sink)?)
}

/// One process rank's CPU training: its mesh groups split from `world`
/// ([`split_mesh`]), on `--cpu-backend` (Flex for bf16 mixed precision).
pub fn cpu_rank<G>(
    args: &TrainArgs,
    setup: &Setup,
    sink: &MetricsSink,
    precision: Precision,
    rank: usize,
    world: Arc<G>,
    split: impl Fn(&G, u32, u32) -> std::result::Result<Arc<G>, CommError>,
) -> Result<Vec<StepMetrics>>
where
    G: ProcessGroup<Backend> + ProcessGroup<burn::backend::Flex<f32>> + 'static,
{
    let topology = args.topology();
    match args.cpu_backend.at(precision) {
        CpuBackend::NdArray => {
            let groups = split_mesh::<Backend, G>(topology, rank, world, split)?;
            fsdp_rank::<Backend>(args, setup, groups, sink)
        }
        CpuBackend::Flex => {
            let groups = split_mesh::<burn::backend::Flex<f32>, G>(topology, rank, world, split)?;
            fsdp_rank::<burn::backend::Flex<f32>>(args, setup, groups, sink)
        }
    }
}
