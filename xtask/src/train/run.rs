//! `train-qwen3` from the command line to the training loop: the entry point (which starts
//! an MPI or env job when asked), joining a job as one of its ranks, choosing the backend and
//! the kind of run, and rank 0's report at the end.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};
#[cfg(feature = "metax")]
use burn_metax_backend::{MetaxEmu, MetaxEmuDevice};
use qwen3_burn::trainer::{StepMetrics, Topology};

#[cfg(feature = "metax")]
use super::args::InProcessCollectives;
use super::args::{CpuBackend, DeviceKind, Launcher, Precision, TrainArgs};
#[cfg(feature = "metax")]
use super::ranks::train_fsdp_on;
use super::ranks::{train_fsdp_cpu, train_single};
use super::report::{
    Finished, MetricsSink, compare, default_run_dir, mean_tps, read_reference, write_summary,
};
use super::setup::{Setup, setup};

/// Entry point of `train-qwen3`: starts the MPI job when `--launcher mpi` is asked for outside
/// an MPI launcher (or prints its command line with `--dry-run`), else trains in this process.
///
/// `raw` is the command line after the program name (`train-qwen3 …`), passed on verbatim to
/// every rank.
pub fn train_entry(args: &TrainArgs, raw: &[String]) -> Result<()> {
    if args.launcher == Launcher::Env && std::env::var_os("RANK").is_none() {
        return crate::env_launch::launch_local(args, raw);
    }
    if args.launcher == Launcher::Mpi && !crate::launch::launched_by_mpi() {
        let exe = std::env::current_exe().context("locating the xtask binary")?;
        let out_dir = args.out_dir.clone().unwrap_or_else(default_run_dir);
        let line = crate::launch::mpirun_line(args, raw, &exe, &out_dir)?;
        if args.dry_run {
            println!("{}", crate::launch::shell_words(&line));
            return Ok(());
        }
        if !crate::launch::MPI_BUILT {
            bail!("{}", crate::launch::NO_MPI);
        }
        if !args.quiet {
            println!("launching: {}", crate::launch::shell_words(&line));
        }
        let status = Command::new(&line[0])
            .args(&line[1..])
            .status()
            .with_context(|| format!("starting `{}` (set --mpirun or $MPIRUN)", line[0]))?;
        if !status.success() {
            bail!("the MPI job failed: {} exited with {status}", line[0]);
        }
        return Ok(());
    }
    if args.dry_run {
        bail!("--dry-run prints the command lines of --launcher mpi or env; add one of them");
    }
    run(args).map(|_| ())
}

/// This process's place in a multi-process job.
enum Job {
    Mpi(crate::launch::MpiRank),
    Env(crate::env_launch::EnvJob),
}

impl Job {
    fn rank(&self) -> usize {
        match self {
            Job::Mpi(m) => m.rank(),
            Job::Env(e) => e.rank(),
        }
    }

    fn size(&self) -> usize {
        match self {
            Job::Mpi(m) => m.size(),
            Job::Env(e) => e.size(),
        }
    }

    fn abort(&self, reason: &str) {
        match self {
            Job::Mpi(m) => m.abort(reason),
            Job::Env(e) => e.abort(reason),
        }
    }

    fn check_consistent(&self, args: &TrainArgs, setup: &Setup) -> Result<()> {
        match self {
            Job::Mpi(m) => m.check_consistent(args, setup),
            Job::Env(e) => e.check_consistent(args, setup),
        }
    }

    fn train(
        &self,
        args: &TrainArgs,
        setup: Setup,
        sink: &MetricsSink,
        precision: Precision,
    ) -> Result<Vec<StepMetrics>> {
        match self {
            Job::Mpi(m) => m.train(args, setup, sink, precision),
            Job::Env(e) => e.train(args, setup, sink, precision),
        }
    }

    fn how(&self) -> &'static str {
        match self {
            Job::Mpi(_) => "MPI processes",
            Job::Env(_) => "processes (env launcher, TCP)",
        }
    }
}

/// Copies the tokenizer that goes with the model into the `--export` directory, so that
/// `generate` on the export uses it: the one `--data` was tokenized with, else the input
/// checkpoint's own `tokenizer.json` (and `tokenizer_config.json`). A model trained on
/// synthetic data from no checkpoint has none.
fn export_tokenizer(args: &TrainArgs, dir: &std::path::Path) -> Result<()> {
    let source = if args.data.is_some() {
        Some(crate::tokenizer::resolve(args.tokenizer.as_deref(), args.checkpoint.as_deref())?)
    } else {
        args.checkpoint.as_ref().map(|c| c.join("tokenizer.json")).filter(|p| p.is_file())
    };
    let Some(source) = source else { return Ok(()) };
    let copy = |from: &std::path::Path, name: &str| -> Result<()> {
        let to = dir.join(name);
        std::fs::copy(from, &to).with_context(|| {
            format!("--export: copying the tokenizer {} to {}", from.display(), to.display())
        })?;
        Ok(())
    };
    copy(&source, "tokenizer.json")?;
    if let Some(config) = source.parent().map(|p| p.join("tokenizer_config.json")).filter(|p| p.is_file()) {
        copy(&config, "tokenizer_config.json")?;
    }
    Ok(())
}

/// Runs training as the flags say and returns the per-step metrics (also written to
/// `--metrics`, or `metrics.jsonl` in `--out-dir`, with a `summary.json` beside it).
pub fn run(args: &TrainArgs) -> Result<Vec<StepMetrics>> {
    if args.compare_to.as_deref() == Some("single") && args.resume.is_some() {
        bail!(
            "--compare-to single reruns from step 0 and cannot follow --resume; compare with a file instead"
        );
    }
    args.collective_timeout()?;
    if matches!(args.device, DeviceKind::Metax | DeviceKind::MetaxEmu) && !cfg!(feature = "metax") {
        bail!(
            "--device {} needs xtask built with the MetaX backend, which the default build leaves out: \
             run `cargo xtask-metax train-qwen3 …` (or build xtask with `--features metax`)",
            args.device.name()
        );
    }
    if args.dry_run && args.launcher == Launcher::Local {
        bail!("--dry-run prints the command lines of --launcher mpi or env; add one of them");
    }
    if args.device == DeviceKind::Metax && (args.launcher != Launcher::Env || args.no_fsdp) {
        bail!(
            "--device metax runs one FSDP rank per GPU process with device collectives: use --launcher env \
             (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR; the GPU is LOCAL_RANK)"
        );
    }
    // CUDA proxy: one process per GPU with NCCL (`--launcher env`), or in this process on GPU 0
    // (`--no-fsdp`, or FSDP over in-process ranks sharing it, host collectives).
    if args.device == DeviceKind::CudaProxy
        && (args.launcher == Launcher::Mpi || (args.launcher == Launcher::Env && args.no_fsdp))
    {
        bail!(
            "--device cuda-proxy runs FSDP under --launcher env (one process per GPU), or in this process \
             (no --launcher: --no-fsdp, or in-process ranks on GPU 0)"
        );
    }
    if args.device == DeviceKind::CudaProxy
        && args.launcher == Launcher::Local
        && !cfg!(feature = "cuda-proxy")
    {
        bail!(
            "--device cuda-proxy needs xtask built with `--features cuda-proxy` (the CUDA driver through cudarc)"
        );
    }
    if args.device == DeviceKind::Cuda && args.launcher != Launcher::Local {
        bail!(
            "--device cuda (Burn's CUDA backend) trains in this process: --no-fsdp, or in-process ranks \
             over the visible GPUs; for one process per GPU use --device cuda-proxy --launcher env"
        );
    }
    if args.device == DeviceKind::Cuda && !cfg!(feature = "burn-cuda") {
        bail!("--device cuda needs xtask built with `--features burn-cuda` (Burn's CUDA backend)");
    }
    // In this process on a GPU: say so clearly when there is none (CubeCL's device threads
    // would panic on first use instead).
    #[cfg(feature = "cuda-proxy")]
    if matches!(args.device, DeviceKind::CudaProxy | DeviceKind::Cuda)
        && args.launcher == Launcher::Local
        && let Err(e) = burn_metax_backend::CudaProxyRuntime::first_device()
    {
        bail!("--device {}: {e}", args.device.name());
    }
    #[cfg(feature = "metax")]
    if args.device == DeviceKind::MetaxEmu {
        check_emu_devices(args)?;
    }
    // Under a launcher this process is one rank: join the job first, so that the world
    // size comes from it and only rank 0 writes files and prints.
    let mpi = match args.launcher {
        Launcher::Mpi => Some(Job::Mpi(crate::launch::MpiRank::join(args)?)),
        Launcher::Env => Some(Job::Env(crate::env_launch::EnvJob::join(args)?)),
        Launcher::Local => None,
    };
    let owned;
    let args = match &mpi {
        Some(m) if args.world_size.is_none() => {
            owned = TrainArgs { world_size: Some(m.size()), ..args.clone() };
            &owned
        }
        _ => args,
    };
    let is_main = mpi.as_ref().is_none_or(|m| m.rank() == 0);
    let setup = match setup(args) {
        Ok(s) => s,
        Err(e) => {
            if let Some(m) = &mpi {
                m.abort(&format!("{e:#}"));
            }
            return Err(e);
        }
    };
    if let Some(m) = &mpi {
        m.check_consistent(args, &setup)?;
    }
    let out_dir = args.out_dir.clone().unwrap_or_else(default_run_dir);
    if is_main {
        std::fs::create_dir_all(&out_dir)
            .with_context(|| format!("creating --out-dir {}", out_dir.display()))?;
    }
    let metrics_path = args.metrics.clone().unwrap_or_else(|| out_dir.join("metrics.jsonl"));
    let sink = if is_main {
        MetricsSink::new(Some(&metrics_path), args.quiet)?
            .with_progress(setup.steps)
            .with_profile(&out_dir.join("profile.jsonl"))?
    } else {
        MetricsSink::new(None, true)?
    };
    let reference_setup = (args.compare_to.as_deref() == Some("single")).then(|| setup.clone());
    let (params, layers, world, steps) =
        (setup.config.num_params(), setup.config.num_hidden_layers, args.world(), setup.steps);
    let mode = if args.no_fsdp {
        "single device (no FSDP)".to_owned()
    } else {
        let how = mpi.as_ref().map(Job::how).unwrap_or("in-process ranks");
        match args.topology() {
            Topology::Flat(_) => format!("FSDP over {world} {how}"),
            Topology::DpTp { dp, tp } => {
                format!("FSDP (dp = {dp}) × tensor parallel (tp = {tp}), {world} {how}")
            }
            Topology::Hsdp { replicate, shard } => {
                format!("HSDP ({replicate} replicas × {shard}-way sharding), {world} {how}")
            }
        }
    };
    // The policies that change the numbers or where state lives, named in the summary and plot.
    let policies: Vec<&str> = [
        (args.mixed_precision == Precision::Bf16).then_some("bf16 mixed precision"),
        args.offload.then_some("CPU offload"),
        (args.device == DeviceKind::Cpu && args.cpu_backend == CpuBackend::Flex).then_some("Flex backend"),
        (args.device != DeviceKind::Cpu).then_some(args.device.name()),
    ]
    .into_iter()
    .flatten()
    .collect();
    let mode = if policies.is_empty() { mode } else { format!("{mode}, {}", policies.join(", ")) };
    if !args.quiet && is_main {
        println!(
            "train-qwen3: {params} params, {layers} layers, {mode}, {steps} steps of {} rows × {} tokens → {}",
            setup.batches.rows,
            setup.batches.width - 1,
            out_dir.display()
        );
    }
    let config = setup.config.clone();
    let metrics = match (args.no_fsdp, args.mixed_precision, &mpi) {
        (true, _, _) => train_single(args, setup, &sink)?,
        (false, precision, Some(m)) => m.train(args, setup, &sink, precision)?,
        #[cfg(feature = "metax")]
        (false, _, None)
            if args.device == DeviceKind::MetaxEmu
                && args.in_process_collectives == InProcessCollectives::Device
                && matches!(args.topology(), Topology::Flat(_)) =>
        {
            super::ranks::train_fsdp_emu(args, setup, &sink, &|group, _| group)?
        }
        #[cfg(feature = "metax")]
        (false, _, None) if args.device == DeviceKind::MetaxEmu => {
            train_fsdp_on::<MetaxEmu>(args, setup, &sink, MetaxEmuDevice::new)?
        }
        #[cfg(feature = "cuda-proxy")]
        (false, _, None) if args.device == DeviceKind::CudaProxy => {
            // Every in-process rank on GPU 0, host collectives.
            let gpu0 = burn_metax_backend::CudaProxyDevice { index: 0 };
            train_fsdp_on::<burn_metax_backend::CudaProxy<f32>>(args, setup, &sink, |_| gpu0)?
        }
        #[cfg(feature = "burn-cuda")]
        (false, _, None) if args.device == DeviceKind::Cuda => {
            // Rank r on GPU r mod (visible GPUs), host collectives.
            use burn::tensor::backend::Backend as _;
            let gpus = burn_cuda::Cuda::<f32>::device_count(0).max(1);
            train_fsdp_on::<burn_cuda::Cuda<f32>>(args, setup, &sink, |rank| {
                burn_cuda::CudaDevice::new(rank % gpus)
            })?
        }
        (false, _, None) => train_fsdp_cpu(args, setup, &sink)?,
    };
    sink.finish();
    if !is_main {
        if let Some(m) = metrics.iter().find(|m| !m.is_finite()) {
            bail!(
                "step {}: non-finite loss or gradient norm; training stopped (rank 0 writes the summary)",
                m.step
            );
        }
        return Ok(metrics);
    }
    if let Some(dir) = args.export.as_deref().filter(|d| d.is_dir()) {
        export_tokenizer(args, dir)?;
    }
    // The first non-finite step (training stopped there): no comparison, and the error below
    // once summary.json and the plot of what ran are written.
    let stopped = metrics.iter().find(|m| !m.is_finite()).map(|m| {
        let what = match (m.loss.is_finite(), m.grad_norm.is_finite()) {
            (false, _) => format!("loss {}", m.loss),
            (true, _) => format!("gradient norm {}", m.grad_norm),
        };
        let rank = match m.nonfinite_rank {
            Some(r) if !args.no_fsdp => format!(" (first on rank {r})"),
            _ => String::new(),
        };
        format!(
            "step {}: {what}{rank}; training stopped before this step's update (check the learning rate, \
             the data and the checkpoint's weights)",
            m.step
        )
    });
    let reference_setup = if stopped.is_some() { None } else { reference_setup };
    let comparison = match (args.compare_to.as_deref().filter(|_| stopped.is_none()), reference_setup) {
        (Some("single"), Some(reference)) => {
            if !args.quiet {
                println!("compare-to single: rerunning the same model and data on one device without FSDP…");
            }
            let quiet_sink = MetricsSink::new(None, true)?;
            let single = train_single(args, reference, &quiet_sink)?;
            let l = single.iter().map(|m| m.loss).collect();
            let n = single.iter().map(|m| m.grad_norm).collect();
            Some(compare("single device (no FSDP)".into(), &metrics, l, n, Some(mean_tps(&single))))
        }
        (Some(file), _) => {
            let path = PathBuf::from(file);
            let (l, n, tps) = read_reference(&path)?;
            Some(compare(path.display().to_string(), &metrics, l, n, tps))
        }
        (None, _) => None,
    };
    write_summary(
        &Finished {
            args,
            out_dir: &out_dir,
            metrics_path: &metrics_path,
            mode: &mode,
            params,
            world,
            config: &config,
            sink: &sink,
        },
        &metrics,
        stopped,
        comparison.as_ref(),
    )?;
    Ok(metrics)
}

/// `--device metax-emu`: one emulated device per in-process rank (or device 0 for `--no-fsdp`);
/// the flags must fit the emulated devices, and the emulator must be usable (a C++ compiler).
#[cfg(feature = "metax")]
fn check_emu_devices(args: &TrainArgs) -> Result<()> {
    if args.launcher != Launcher::Local {
        bail!(
            "--device metax-emu runs in-process ranks, one emulated device each: drop --launcher {}",
            if args.launcher == Launcher::Mpi { "mpi" } else { "env" }
        );
    }
    let driver = burn_metax_backend::runtime::emu_driver()
        .map_err(|e| anyhow::anyhow!("--device metax-emu: the emulated MetaX device is unavailable: {e}"))?;
    let have = driver.config().devices.len();
    let need = if args.no_fsdp { 1 } else { args.world() };
    if need > have {
        bail!(
            "--device metax-emu: {need} ranks need {need} emulated devices, but there are {have} \
             (set METAX_EMU_DEVICES={need})"
        );
    }
    Ok(())
}
