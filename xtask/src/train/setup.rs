//! What a run starts from — the model's config and weights, the data, the steps, the
//! checkpoint it resumes — with every flag checked against them before any weight is read.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use burn_fsdp::checkpoint::{CheckpointIndex, INDEX_FILE, read_index};
use qwen3_burn::train::Batches;
use qwen3_burn::trainer::{InitialWeights, Topology};
use qwen3_burn::{Qwen3Config, Qwen3Init};

use super::args::{ActivationCheckpointing, Launcher, Precision, TrainArgs};
use crate::data::synthetic_batches;

/// Steps of the synthetic default run when `--steps` is not given.
pub const DEFAULT_STEPS: usize = 20;

/// The model and data a run starts from.
#[derive(Clone)]
pub struct Setup {
    /// Model config.
    pub config: Qwen3Config,
    /// The initial weights: a single device builds the model from them, each FSDP rank only
    /// its shards.
    pub model: InitialWeights,
    /// Token batches.
    pub batches: Batches,
    /// Number of steps to run.
    pub steps: usize,
    /// Checkpoint to resume from.
    pub resume: Option<PathBuf>,
}

/// Loads (or builds) the model and data, validating every flag against them.
pub fn setup(args: &TrainArgs) -> Result<Setup> {
    let topology = args.topology();
    if topology.world() == 0 {
        bail!("--world-size must be at least 1");
    }
    if let (Some(w), Topology::DpTp { .. } | Topology::Hsdp { .. }) = (args.world_size, topology)
        && w != topology.world()
    {
        bail!("--world-size {w} disagrees with the mesh, which has {} ranks", topology.world());
    }
    if topology != Topology::Flat(topology.world()) && args.offload {
        bail!("--offload is not supported with --mesh or --hsdp");
    }
    // The batch is split across the ranks that see different data.
    let world = topology.data_world();
    if args.grad_accum == 0 {
        bail!("--grad-accum must be at least 1");
    }
    if args.no_fsdp && args.offload {
        bail!("--offload is an FSDP policy; use --world-size N (1 is fine) instead of --no-fsdp");
    }
    if args.no_fsdp && (args.save_dir.is_some() || args.resume.is_some()) {
        bail!(
            "--save-dir and --resume use sharded FSDP checkpoints; use --world-size N (1 is fine) instead of --no-fsdp"
        );
    }
    refuse_ignored_flags(args)?;
    if args.save_every == Some(0) {
        bail!("--save-every must be at least 1");
    }
    let resume = match &args.resume {
        Some(dir) => Some(resolve_checkpoint(dir)?),
        None => None,
    };
    if args.no_fsdp && args.mixed_precision != Precision::Fp32 {
        bail!(
            "--mixed-precision bf16 is an FSDP policy; use --world-size N (1 is fine) instead of --no-fsdp"
        );
    }
    if !(args.lr.is_finite() && args.lr >= 0.0) {
        bail!("--lr must be a non-negative number, got {}", args.lr);
    }
    if !(args.eps.is_finite() && args.eps > 0.0) {
        bail!("--eps must be positive, got {}", args.eps);
    }
    if let Some(c) = args.clip
        && (c.is_nan() || c < 0.0)
    {
        bail!("--clip must be non-negative, got {c}");
    }
    // The model's config first: every check of the flags and the data runs before any weight
    // is read or initialised (a 0.6B model takes a while).
    let config = match (&args.checkpoint, &resume) {
        (Some(dir), _) => Qwen3Config::from_file(dir.join("config.json"))?,
        // Resuming without --checkpoint: the model is the checkpoint's.
        (None, Some((dir, index))) => resume_config(dir, index)?,
        (None, None) => preset_config(args)?,
    };
    // --checkpoint or --preset with --resume: the model they name must be the checkpoint's.
    if let Some((dir, index)) = &resume
        && (args.checkpoint.is_some() || args.preset.is_some())
    {
        let (flag, given) = match (&args.checkpoint, &args.preset) {
            (Some(c), _) => (format!("--checkpoint {}", c.display()), config.clone()),
            (None, p) => (format!("--preset {}", p.as_deref().unwrap_or("tiny")), preset_config(args)?),
        };
        let differ = config_differences(&given, &resume_config(dir, index)?);
        if !differ.is_empty() {
            bail!(
                "{flag} is another model than the one saved in --resume {} (given vs saved: {}); \
                 omit it to resume the checkpoint's model",
                dir.display(),
                differ.join(", ")
            );
        }
    }
    let batches = match (&args.batches, &args.data) {
        (None, Some(path)) => {
            let tok_path = crate::tokenizer::resolve(args.tokenizer.as_deref(), args.checkpoint.as_deref())?;
            let tokenizer = qwen3_burn::tokenizer::Tokenizer::from_file(&tok_path)?;
            let docs = crate::data::text::read_documents(path)?;
            let eos = tokenizer.token_id("<|endoftext|>");
            let (batch, seq) = args.batch_and_seq()?;
            let what = format!("--data {}", path.display());
            let steps = args.steps.unwrap_or(DEFAULT_STEPS);
            let layout = crate::data::text::Layout { seq, steps, rows: world * batch, seed: args.seed() };
            let b = crate::data::text::pack(&docs, &tokenizer, eos, layout, &what)?;
            if b.max_token() as usize >= config.vocab_size {
                bail!(
                    "{what}: --tokenizer {} produces token ids up to {}, but the model's vocabulary has {} entries; \
                     use a model that covers the tokenizer (e.g. --preset 0.6b, or a Qwen3 --checkpoint)",
                    tok_path.display(),
                    b.max_token(),
                    config.vocab_size
                );
            }
            b
        }
        (Some(path), _) => {
            let b = Batches::load(path)?;
            if b.min_token() < 0 || b.max_token() as usize >= config.vocab_size {
                bail!(
                    "{}: `tokens` holds ids {}..={}, outside the model's vocabulary 0..{}",
                    path.display(),
                    b.min_token(),
                    b.max_token(),
                    config.vocab_size
                );
            }
            b
        }
        (None, None) => {
            let (batch, seq) = args.batch_and_seq()?;
            synthetic_batches(
                args.steps.unwrap_or(DEFAULT_STEPS),
                world * batch,
                seq,
                config.vocab_size,
                args.seed(),
            )
        }
    };
    let steps = args.steps.unwrap_or(batches.steps);
    if let Some((dir, index)) = &resume
        && index.step as usize >= steps
    {
        bail!(
            "--resume {}: the checkpoint is at step {}, nothing left to run with --steps {steps}",
            dir.display(),
            index.step
        );
    }
    if steps > batches.steps {
        bail!("--steps {steps} exceeds the {} steps of the batches file", batches.steps);
    }
    if !batches.rows.is_multiple_of(world) {
        bail!(
            "the global batch has {} rows, which the {world} data-parallel ranks (--world-size, --mesh DP, --hsdp R·S) do not divide",
            batches.rows
        );
    }
    if let Topology::DpTp { dp, tp } = topology {
        qwen3_burn::parallelize::check_tp(&config, tp)
            .map_err(|e| anyhow::anyhow!("--mesh {dp}x{tp}: {e}"))?;
    }
    if !(batches.rows / world).is_multiple_of(args.grad_accum) {
        bail!(
            "each rank has {} rows per step, which --grad-accum {} does not divide",
            batches.rows / world,
            args.grad_accum
        );
    }
    let model = match (&args.checkpoint, &resume) {
        (Some(dir), _) => InitialWeights::checkpoint(&config, dir)?,
        // Resuming: the weights come from the checkpoint when training starts.
        (None, Some(_)) => InitialWeights::Seeded(Qwen3Init::new(0)),
        (None, None) => InitialWeights::Seeded(Qwen3Init::new(args.seed())),
    };
    Ok(Setup { config, model, batches, steps, resume: resume.map(|(dir, _)| dir) })
}

/// Refuses flags that the chosen mode would ignore, naming them.
fn refuse_ignored_flags(args: &TrainArgs) -> Result<()> {
    let mut ignored: Vec<(&str, &str)> = Vec::new();
    if args.batches.is_some() {
        let why = "--batches fixes the rows and length of every step";
        if args.batch.is_some() {
            ignored.push(("--batch", why));
        }
        if args.seq.is_some() {
            ignored.push(("--seq", why));
        }
        if args.seed.is_some() && (args.checkpoint.is_some() || args.resume.is_some()) {
            ignored.push((
                "--seed",
                "the weights come from a checkpoint and the data from --batches: nothing is random",
            ));
        }
    }
    if args.no_fsdp {
        let why = "it is an FSDP setting and --no-fsdp trains without FSDP";
        if args.no_prefetch {
            ignored.push(("--no-prefetch", why));
        }
        if args.reshard_after_forward.is_some() {
            ignored.push(("--reshard-after-forward", why));
        }
    }
    if args.activation_checkpointing == ActivationCheckpointing::Block
        && args.mesh.is_some_and(|(_, tp)| tp > 1)
    {
        ignored.push((
            "--activation-checkpointing block",
            "tensor-parallel layers run collectives inside them and are not recomputed",
        ));
    }
    if args.launcher != Launcher::Mpi {
        let why = "it is for --launcher mpi";
        if args.mpirun.is_some() {
            ignored.push(("--mpirun", why));
        }
        if !args.mpirun_args.is_empty() {
            ignored.push(("--mpirun-arg", why));
        }
    }
    match ignored.first() {
        None => Ok(()),
        Some((flag, why)) => bail!("{flag} would be ignored: {why}; leave it out"),
    }
}

/// The model of a `--resume` checkpoint (its index's `model_config`).
fn resume_config(dir: &Path, index: &CheckpointIndex) -> Result<Qwen3Config> {
    serde_json::from_value(index.model_config.clone())
        .with_context(|| format!("{}: model_config is not a Qwen3 config", dir.join(INDEX_FILE).display()))
}

/// The model of `--preset` (tiny when not given).
fn preset_config(args: &TrainArgs) -> Result<Qwen3Config> {
    let name = args.preset.as_deref().unwrap_or("tiny");
    Qwen3Config::preset(name)
        .with_context(|| format!("--preset `{name}` is unknown (tiny, 0.6b, 1.7b, 4b, 8b)"))
}

/// The fields in which two model configs differ, as `name given vs saved`.
fn config_differences(given: &Qwen3Config, saved: &Qwen3Config) -> Vec<String> {
    let (a, b) =
        (serde_json::to_value(given).unwrap_or_default(), serde_json::to_value(saved).unwrap_or_default());
    let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else {
        return vec!["the configs cannot be compared".to_owned()];
    };
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| {
            let show = |v: Option<&serde_json::Value>| v.map_or("absent".to_owned(), |v| v.to_string());
            format!("{k} {} vs {}", show(a.get(k)), show(b.get(k)))
        })
        .collect()
}

/// A `--resume` argument: the checkpoint directory itself, or a directory of `step-*/`
/// checkpoints (the latest complete one).
pub fn resolve_checkpoint(dir: &std::path::Path) -> Result<(PathBuf, CheckpointIndex)> {
    if dir.join(INDEX_FILE).is_file() {
        return Ok((dir.to_path_buf(), read_index(dir)?));
    }
    let mut candidates: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("--resume {}: not a checkpoint directory", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("step-"))
                && p.join(INDEX_FILE).is_file()
        })
        .collect();
    candidates.sort();
    match candidates.pop() {
        Some(latest) => {
            let index = read_index(&latest)?;
            Ok((latest, index))
        }
        None => bail!(
            "--resume {}: holds neither {INDEX_FILE} nor any complete step-*/ checkpoint",
            dir.display()
        ),
    }
}
