//! `--launcher env`: one process per FSDP rank, joined through `RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` (torchrun's variables) and connected over
//! TCP ([`burn_fsdp::comm::tcp::TcpGroup`]).
//!
//! - Started with those variables set, this process is one rank of the job.
//! - Started without them, `cargo xtask train-qwen3 --launcher env --world-size 4 …` starts
//!   the 4 ranks on this machine itself (like `torchrun --standalone`): the same command with
//!   the variables set, a free `MASTER_PORT`, and `--out-dir` fixed so all ranks agree.
//!   `--dry-run` prints the per-rank command lines instead, which is also how to start a job
//!   on several machines (set `MASTER_ADDR` to rank 0's machine; see docs/multi-process.md).
//!
//! The same rendezvous is what device communicators (NCCL, MCCL) use to share their unique id.

use std::path::Path;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use burn_fsdp::ProcessGroup;
use burn_fsdp::comm::tcp::{EnvRank, TcpGroup};

use crate::launch::{check_job_consistent, shell_words};
use crate::train::args::{DeviceKind, Precision, TrainArgs};
use crate::train::ranks::cpu_rank;
#[cfg(feature = "metax")]
use crate::train::ranks::fsdp_rank;
use crate::train::report::{MetricsSink, default_run_dir};
use crate::train::setup::Setup;
use qwen3_burn::trainer::StepMetrics;
#[cfg(feature = "metax")]
use qwen3_burn::trainer::{RankGroups, Topology};

/// The environment of rank `rank` of a one-machine job on `port`.
pub fn rank_env(rank: usize, world: usize, port: u16) -> Vec<(String, String)> {
    [
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_owned()),
        ("MASTER_PORT", port.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// A free TCP port on the loopback interface.
fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port for MASTER_PORT")?;
    Ok(l.local_addr()?.port())
}

/// The per-rank command line (after the environment) of `raw` with `--out-dir` fixed.
fn rank_args(args: &TrainArgs, raw: &[String], out_dir: &Path) -> Vec<String> {
    let mut rest: Vec<String> = raw.iter().filter(|a| *a != "--dry-run").cloned().collect();
    if args.out_dir.is_none() {
        rest.push("--out-dir".to_owned());
        rest.push(out_dir.to_string_lossy().into_owned());
    }
    rest
}

/// Starts every rank of `--launcher env` on this machine (or prints their command lines with
/// `--dry-run`) and waits for them. When one rank fails, the others fail within the collective
/// timeout (their connections report it); any still running after that are killed, so no
/// process is left behind.
pub fn launch_local(args: &TrainArgs, raw: &[String]) -> Result<()> {
    if args.no_fsdp {
        bail!("--launcher env runs FSDP ranks; drop --no-fsdp (use --world-size)");
    }
    let world = args.world();
    if world == 0 {
        bail!("--world-size must be at least 1");
    }
    let exe = std::env::current_exe().context("locating the xtask binary")?;
    let out_dir = args.out_dir.clone().unwrap_or_else(default_run_dir);
    let port = free_port()?;
    let rest = rank_args(args, raw, &out_dir);
    if args.dry_run {
        for rank in 0..world {
            let mut line: Vec<String> =
                rank_env(rank, world, port).into_iter().map(|(k, v)| format!("{k}={v}")).collect();
            line.push(exe.to_string_lossy().into_owned());
            line.extend(rest.iter().cloned());
            println!("{}", shell_words(&line));
        }
        return Ok(());
    }
    if !args.quiet {
        println!("launching {world} ranks on 127.0.0.1:{port}: {} {}", exe.display(), shell_words(&rest));
    }
    let mut children: Vec<Child> = Vec::new();
    for rank in 0..world {
        let mut cmd = Command::new(&exe);
        cmd.args(&rest).envs(rank_env(rank, world, port));
        match cmd.spawn() {
            Ok(c) => children.push(c),
            Err(e) => {
                kill_all(&mut children);
                return Err(e).with_context(|| format!("starting rank {rank} ({})", exe.display()));
            }
        }
    }
    let timeout = args.collective_timeout()? + Duration::from_secs(5);
    let mut status: Vec<Option<std::process::ExitStatus>> = vec![None; world];
    // Failures in the order seen, with when: (rank, killed by a signal, seen at).
    let mut failures: Vec<(usize, bool, Instant)> = Vec::new();
    loop {
        for (rank, child) in children.iter_mut().enumerate() {
            if status[rank].is_none()
                && let Ok(Some(s)) = child.try_wait()
            {
                status[rank] = Some(s);
                if !s.success() {
                    use std::os::unix::process::ExitStatusExt;
                    failures.push((rank, s.signal().is_some(), Instant::now()));
                }
            }
        }
        if status.iter().all(Option::is_some) {
            break;
        }
        if let Some(&(_, _, at)) = failures.first()
            && at.elapsed() > timeout
        {
            // The others should have noticed; don't leave them behind.
            kill_all(&mut children);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Some(rank) = first_failed(&failures) {
        let codes: Vec<String> = status
            .iter()
            .enumerate()
            .map(|(r, s)| format!("rank {r}: {}", s.map(|s| s.to_string()).unwrap_or_default()))
            .collect();
        use std::os::unix::process::ExitStatusExt;
        let how = match status[rank].and_then(|s| s.signal()) {
            Some(sig) => format!("was killed by signal {sig}"),
            None => "exited with an error".to_owned(),
        };
        bail!("the job failed: rank {rank} {how} first ({})", codes.join(", "));
    }
    Ok(())
}

/// The rank whose failure started it all. The others fail because they lost it, a moment
/// later — or, on a busy machine, a moment *before* its exit status can be read: a process's
/// sockets close before its parent can reap it. So failures seen within [`SETTLE`] of the
/// first count as simultaneous, and of those a rank killed by a signal is named first (the
/// others' errors are most likely their reaction to losing it; ranks this launcher kills
/// after the timeout come later than that).
fn first_failed(failures: &[(usize, bool, Instant)]) -> Option<usize> {
    let &(first, _, at) = failures.first()?;
    let soon = failures.iter().take_while(|f| f.2.duration_since(at) <= SETTLE);
    Some(soon.clone().find(|f| f.1).map_or(first, |f| f.0))
}

/// How close together failures count as one event (see [`first_failed`]).
const SETTLE: Duration = Duration::from_secs(1);

fn kill_all(children: &mut [Child]) {
    for c in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// This process's place in a `--launcher env` job.
pub struct EnvJob {
    env: EnvRank,
    world: Arc<TcpGroup>,
}

impl EnvJob {
    /// Joins the job this process's environment describes, checking the flags' world size
    /// against `WORLD_SIZE`.
    pub fn join(args: &TrainArgs) -> Result<Self> {
        let env = EnvRank::from_env().map_err(|e| anyhow::anyhow!("--launcher env: {e}"))?.context(
            "--launcher env: RANK/WORLD_SIZE are not set (run without them to start all ranks here)",
        )?;
        let want =
            if args.mesh.is_some() || args.hsdp.is_some() { Some(args.world()) } else { args.world_size };
        if let Some(w) = want
            && w != env.world_size
        {
            bail!(
                "rank {}: --world-size/--mesh/--hsdp ask for {w} ranks but WORLD_SIZE={}",
                env.rank,
                env.world_size
            );
        }
        let world = TcpGroup::connect(&env, args.collective_timeout()?)
            .map_err(|e| anyhow::anyhow!("rank {}: joining the job: {e}", env.rank))?;
        Ok(Self { env, world })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.env.rank
    }

    /// Number of processes.
    pub fn size(&self) -> usize {
        self.env.world_size
    }

    /// Tells every other rank that this one failed.
    pub fn abort(&self, reason: &str) {
        ProcessGroup::<crate::Backend>::abort(&*self.world, reason);
    }

    /// Compares [`run_digest`](crate::launch::run_digest) across ranks (flags, model config, weights, data).
    pub fn check_consistent(&self, args: &TrainArgs, setup: &Setup) -> Result<()> {
        check_job_consistent(&*self.world, args, setup)
    }

    /// Runs this rank's share of FSDP training.
    pub fn train(
        &self,
        args: &TrainArgs,
        setup: Setup,
        sink: &MetricsSink,
        precision: Precision,
    ) -> Result<Vec<StepMetrics>> {
        let result = match args.device {
            DeviceKind::Cpu => {
                cpu_rank(args, &setup, sink, precision, self.rank(), self.world.clone(), TcpGroup::split)
            }
            DeviceKind::Metax => self.train_metax(args, setup, sink),
            DeviceKind::CudaProxy => self.train_cuda(args, setup, sink),
            DeviceKind::MetaxEmu => Err(anyhow::anyhow!("--device metax-emu runs in-process ranks only")),
            DeviceKind::Cuda => Err(anyhow::anyhow!("--device cuda runs in this process only")),
        };
        result.map_err(|e| {
            let msg = format!("rank {}: {e:#}", self.rank());
            self.abort(&msg);
            anyhow::anyhow!(msg)
        })
    }

    /// Rank 0's device-communicator unique id (`make` runs on rank 0 only), sent to every rank
    /// over the job's TCP connection. A rank 0 that cannot make one fails the job for all.
    #[cfg(feature = "metax")]
    fn unique_id(&self, make: impl FnOnce() -> Result<[u8; 128]>) -> Result<[u8; 128]> {
        let mine = if self.rank() == 0 { Some(make()?.to_vec()) } else { None };
        let bytes =
            self.world.broadcast_bytes(0, mine).map_err(|e| anyhow::anyhow!("sharing the unique id: {e}"))?;
        bytes.try_into().map_err(|b: Vec<u8>| anyhow::anyhow!("rank 0 sent a {}-byte unique id", b.len()))
    }

    /// Flat FSDP on this process's GPU with `group` as the world.
    #[cfg(feature = "metax")]
    fn device_groups<B: burn::tensor::backend::Backend>(
        &self,
        args: &TrainArgs,
        group: Arc<dyn ProcessGroup<B>>,
        device: B::Device,
    ) -> Result<RankGroups<B>> {
        let topology = args.topology();
        if !matches!(topology, Topology::Flat(_)) {
            bail!("--device with --mesh/--hsdp is not supported yet: device sub-communicators are not built");
        }
        Ok(RankGroups { topology, rank: self.rank(), outer: group, inner: None, gate: None, device })
    }

    /// FSDP on MetaX GPU `LOCAL_RANK` with MCCL.
    #[cfg(feature = "metax")]
    fn train_metax(&self, args: &TrainArgs, setup: Setup, sink: &MetricsSink) -> Result<Vec<StepMetrics>> {
        use burn_metax_backend::collective::{MetaxGroup, mccl_unique_id};
        use burn_metax_backend::mccl::Mccl;
        let device = burn_metax_backend::MacaDevice::new(self.env.local_rank);
        let load = || Mccl::load().map(Arc::new).map_err(|e| anyhow::anyhow!("--device metax: {e}"));
        let id = self.unique_id(|| {
            let mccl = load()?;
            mccl_unique_id(&mccl).map_err(|e| anyhow::anyhow!("--device metax: {e}"))
        })?;
        let group =
            MetaxGroup::mccl(device, load()?, id, self.rank(), self.size(), args.collective_timeout()?)
                .map_err(|e| {
                    anyhow::anyhow!("--device metax: joining MCCL on MetaX device {}: {e}", device.index)
                })?;
        type B = burn_metax_backend::Metax<f32>;
        let groups = self.device_groups::<B>(args, Arc::new(group), device)?;
        fsdp_rank::<B>(args, &setup, groups, sink)
    }

    /// FSDP on NVIDIA GPU `LOCAL_RANK` through the CUDA proxy, with NCCL.
    #[cfg(feature = "cuda")]
    fn train_cuda(&self, args: &TrainArgs, setup: Setup, sink: &MetricsSink) -> Result<Vec<StepMetrics>> {
        use burn_metax_backend::collective::{CudaProxyNcclGroup, NcclCommunicator};
        let device = burn_metax_backend::CudaProxyDevice { index: self.env.local_rank };
        let id = self.unique_id(|| {
            NcclCommunicator::unique_id().map_err(|e| anyhow::anyhow!("--device cuda-proxy: {e}"))
        })?;
        let group =
            CudaProxyNcclGroup::nccl(device, id, self.rank(), self.size(), args.collective_timeout()?)
                .map_err(|e| {
                    anyhow::anyhow!("--device cuda-proxy: joining NCCL on CUDA device {}: {e}", device.index)
                })?;
        type B = burn_metax_backend::CudaProxy<f32>;
        let groups = self.device_groups::<B>(args, Arc::new(group), device)?;
        fsdp_rank::<B>(args, &setup, groups, sink)
    }

    #[cfg(not(feature = "metax"))]
    fn train_metax(&self, _: &TrainArgs, _: Setup, _: &MetricsSink) -> Result<Vec<StepMetrics>> {
        bail!("--device metax needs xtask built with `--features metax` (`cargo xtask-metax …`)")
    }

    #[cfg(not(feature = "cuda"))]
    fn train_cuda(&self, _: &TrainArgs, _: Setup, _: &MetricsSink) -> Result<Vec<StepMetrics>> {
        bail!(
            "--device cuda-proxy needs xtask built with `--features cuda` (NCCL through cudarc, loaded at run time)"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_killed_by_a_signal_is_named_over_errors_seen_just_before_it() {
        let t = Instant::now();
        let ms = |m| t + Duration::from_millis(m);
        // Rank 1 reacted to losing rank 2 before rank 2 could be reaped.
        assert_eq!(first_failed(&[(1, false, ms(0)), (3, false, ms(0)), (2, true, ms(20))]), Some(2));
        // Nobody was killed: the first error is the first failure.
        assert_eq!(first_failed(&[(3, false, ms(0)), (1, false, ms(40))]), Some(3));
        // Ranks killed long after the first failure (the launcher's own kill) are not it.
        assert_eq!(first_failed(&[(0, false, ms(0)), (1, true, ms(25_000))]), Some(0));
        assert_eq!(first_failed(&[]), None);
    }
}
