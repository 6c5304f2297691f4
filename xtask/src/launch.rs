//! `--launcher mpi`: one process per FSDP rank.
//!
//! `cargo xtask train-qwen3 --launcher mpi --world-size 4 …` runs
//! `mpirun -n 4 <this xtask binary> train-qwen3 --launcher mpi … --out-dir <resolved>`; each
//! process started that way sees the launcher's environment ([`launched_by_mpi`]) and joins
//! the job as one rank ([`MpiRank::join`]). Before training, the ranks compare a digest of
//! their flags, model config, weights and data ([`MpiRank::check_consistent`]), so a rank
//! started with another world size or model is refused with a clear error.
//!
//! MPI support needs xtask built with `--features mpi` (OpenMPI or MPICH, and libclang, at
//! build time); without it `--launcher mpi` says how to get it.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Result, bail};

use crate::train::args::{Precision, TrainArgs};
#[cfg(feature = "mpi")]
use crate::train::ranks::cpu_rank;
use crate::train::report::MetricsSink;
use crate::train::setup::Setup;
use qwen3_burn::trainer::StepMetrics;

/// Whether this process was started by an MPI launcher (OpenMPI, MPICH/Hydra, Slurm PMI).
pub fn launched_by_mpi() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK", "MPI_LOCALNRANKS"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// Whether this xtask was built with MPI support.
pub const MPI_BUILT: bool = cfg!(feature = "mpi");

pub(crate) const NO_MPI: &str = "--launcher mpi: this xtask was built without MPI support; rebuild with \
     `cargo xtask-mpi …` (= `cargo run -p xtask --features mpi -- …`), which needs an MPI library and \
     libclang (Debian/Ubuntu: apt install openmpi-bin libopenmpi-dev libclang-dev)";

/// Which MPI implementation an `mpirun` belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MpiFlavor {
    /// Open MPI (`--oversubscribe`, `--allow-run-as-root`, `--bind-to none`).
    OpenMpi,
    /// MPICH's Hydra or another launcher taking only `-n`.
    Other,
}

/// Asks `mpirun --version` which implementation it is; Open MPI when it cannot be run (the
/// line is still printed for --dry-run).
pub fn mpi_flavor(mpirun: &str) -> MpiFlavor {
    match Command::new(mpirun).arg("--version").output() {
        Ok(o)
            if !String::from_utf8_lossy(&o.stdout).contains("Open MPI")
                && !String::from_utf8_lossy(&o.stderr).contains("Open MPI") =>
        {
            MpiFlavor::Other
        }
        _ => MpiFlavor::OpenMpi,
    }
}

fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("Uid:")).map(|l| l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

/// `mpirun -n <world>` plus the flags a one-machine Open MPI job needs (`--oversubscribe`,
/// `--bind-to none`, and `--allow-run-as-root` when running as root). The executable is
/// `mpirun` (default: `$MPIRUN`, else `mpirun`).
pub fn mpirun_prefix(mpirun: Option<&Path>, world: usize) -> Vec<String> {
    let mpirun = mpirun
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os("MPIRUN").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("mpirun"));
    let mpirun = mpirun.to_string_lossy().into_owned();
    let mut line = vec![mpirun.clone(), "-n".to_owned(), world.to_string()];
    if mpi_flavor(&mpirun) == MpiFlavor::OpenMpi {
        // One machine by default: allow more ranks than cores, don't pin ranks to cores.
        line.extend(["--oversubscribe", "--bind-to", "none"].map(String::from));
        if running_as_root() {
            line.push("--allow-run-as-root".to_owned());
        }
    }
    line
}

/// The mpirun command line that runs every rank of this training: `raw` (the `train-qwen3 …`
/// arguments) with `--out-dir` fixed, so that all ranks agree on it.
pub fn mpirun_line(args: &TrainArgs, raw: &[String], exe: &Path, out_dir: &Path) -> Result<Vec<String>> {
    if args.no_fsdp {
        bail!("--launcher mpi runs FSDP ranks; drop --no-fsdp (use --world-size)");
    }
    let world = args.world();
    if world == 0 {
        bail!("--world-size must be at least 1");
    }
    let mut line = mpirun_prefix(args.mpirun.as_deref(), world);
    line.extend(args.mpirun_args.iter().cloned());
    line.push(exe.to_string_lossy().into_owned());
    let mut rest: Vec<String> = raw.iter().filter(|a| *a != "--dry-run").cloned().collect();
    if args.out_dir.is_none() {
        rest.push("--out-dir".to_owned());
        rest.push(out_dir.to_string_lossy().into_owned());
    }
    line.extend(rest);
    Ok(line)
}

/// Quotes a command line for a POSIX shell.
pub fn shell_words(words: &[String]) -> String {
    words
        .iter()
        .map(|w| {
            if !w.is_empty() && w.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c)) {
                w.clone()
            } else {
                format!("'{}'", w.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Digests of everything every rank must agree on, one per item so that a mismatch names
/// it: each flag (`--lr`, …, but not `--quiet`: where a rank prints), the model config, the
/// weights (names, shapes and values) and the data.
pub fn run_digest(args: &TrainArgs, setup: &Setup) -> Vec<(String, u64)> {
    let digest = |bytes: &[u8]| {
        let mut h = Fnv64::default();
        h.write(bytes);
        h.0
    };
    let mut items = Vec::new();
    if let Ok(serde_json::Value::Object(flags)) = serde_json::to_value(args) {
        for (name, value) in flags.iter().filter(|(name, _)| name.as_str() != "quiet") {
            let flag = match name.as_str() {
                "mpirun_args" => "--mpirun-arg".to_owned(),
                n => format!("--{}", n.replace('_', "-")),
            };
            items.push((flag, digest(value.to_string().as_bytes())));
        }
    }
    items.push((
        "model config".to_owned(),
        digest(serde_json::to_string(&setup.config).unwrap_or_default().as_bytes()),
    ));
    items.push(("weights".to_owned(), setup.model.digest()));
    let mut h = Fnv64::default();
    h.write(
        format!("{:?}", (setup.batches.steps, setup.batches.rows, setup.batches.width, setup.steps))
            .as_bytes(),
    );
    setup.batches.tokens.iter().for_each(|t| h.write(&t.to_le_bytes()));
    items.push(("data".to_owned(), h.0));
    items
}

#[derive(Debug, Clone, Copy)]
struct Fnv64(u64);

impl Default for Fnv64 {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv64 {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ *b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// Compares [`run_digest`] over `world` (a multi-process job's world group): a rank started
/// with other flags, another model or other data is refused on every rank.
pub fn check_job_consistent(
    world: &dyn burn_fsdp::ProcessGroup<crate::Backend>,
    args: &TrainArgs,
    setup: &Setup,
) -> Result<()> {
    burn_fsdp::comm::check_items_on_all_ranks::<crate::Backend>(
        world,
        "flags, model config, weights or data",
        &run_digest(args, setup),
        &crate::device(),
    )
    .map_err(|e| anyhow::anyhow!("{e}"))
}

/// This process's place in an MPI job.
pub struct MpiRank {
    #[cfg(feature = "mpi")]
    group: std::sync::Arc<burn_fsdp::comm::mpi::MpiGroup>,
}

impl MpiRank {
    /// Joins the MPI job this process was started in, checking `--world-size` against it.
    pub fn join(args: &TrainArgs) -> Result<Self> {
        #[cfg(feature = "mpi")]
        {
            if !launched_by_mpi() {
                bail!(
                    "--launcher mpi: not started by an MPI launcher; run `cargo xtask-mpi train-qwen3 --launcher mpi …` \
                     (it runs mpirun itself) or start this command under mpirun"
                );
            }
            let group = burn_fsdp::comm::mpi::MpiGroup::world(args.collective_timeout()?)
                .map_err(|e| anyhow::anyhow!("initialising MPI: {e}"))?;
            let want =
                if args.mesh.is_some() || args.hsdp.is_some() { Some(args.world()) } else { args.world_size };
            if let Some(w) = want
                && w != group.size()
            {
                bail!(
                    "rank {}: --world-size/--mesh/--hsdp ask for {w} ranks but the MPI job has {} processes (mpirun -n {})",
                    group.rank(),
                    group.size(),
                    group.size()
                );
            }
            Ok(Self { group })
        }
        #[cfg(not(feature = "mpi"))]
        {
            let _ = args;
            bail!("{NO_MPI}")
        }
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        #[cfg(feature = "mpi")]
        {
            self.group.rank()
        }
        #[cfg(not(feature = "mpi"))]
        0
    }

    /// Number of processes.
    pub fn size(&self) -> usize {
        #[cfg(feature = "mpi")]
        {
            self.group.size()
        }
        #[cfg(not(feature = "mpi"))]
        1
    }

    /// Tells every other rank that this one failed, so they stop at once with `reason`.
    pub fn abort(&self, reason: &str) {
        #[cfg(feature = "mpi")]
        burn_fsdp::ProcessGroup::<crate::Backend>::abort(&*self.group, reason);
        #[cfg(not(feature = "mpi"))]
        let _ = reason;
    }

    /// Compares [`run_digest`] across ranks: a rank started with other flags, another model
    /// or other data is refused before training starts.
    pub fn check_consistent(&self, args: &TrainArgs, setup: &Setup) -> Result<()> {
        #[cfg(feature = "mpi")]
        {
            check_job_consistent(&*self.group, args, setup)
        }
        #[cfg(not(feature = "mpi"))]
        {
            let _ = (args, setup);
            bail!("{NO_MPI}")
        }
    }

    /// Runs this rank's share of FSDP training.
    pub fn train(
        &self,
        args: &TrainArgs,
        setup: Setup,
        sink: &MetricsSink,
        precision: Precision,
    ) -> Result<Vec<StepMetrics>> {
        #[cfg(feature = "mpi")]
        {
            let world = self.group.clone();
            let result = cpu_rank(
                args,
                &setup,
                sink,
                precision,
                self.rank(),
                world,
                burn_fsdp::comm::mpi::MpiGroup::split,
            );
            result.map_err(|e| {
                let msg = format!("rank {}: {e:#}", self.rank());
                self.abort(&msg);
                anyhow::anyhow!(msg)
            })
        }
        #[cfg(not(feature = "mpi"))]
        {
            let _ = (args, setup, sink, precision);
            bail!("{NO_MPI}")
        }
    }
}
