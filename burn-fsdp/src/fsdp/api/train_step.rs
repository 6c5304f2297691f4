//! One training step of a hand-written loop, for any model: what `train-qwen3` does around its
//! model — micro-batches accumulated without communication, the global norm clipped, the loss
//! averaged over ranks, no update when either is not finite, collective failures as errors.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

use super::*;

/// What one [`Fsdp::train_step`] did. Every rank gets the same report.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// The step's loss: the mean of the micro-batches' losses over every data-parallel rank.
    pub loss: f64,
    /// The global L2 norm of the step's gradients, before clipping.
    pub grad_norm: f64,
    /// Whether the optimizer stepped: `false` when the loss or the norm was not finite, and
    /// then the parameters and the optimizer's state are as before the step.
    pub stepped: bool,
    /// When the loss was not finite: the lowest data-parallel rank whose own loss was not
    /// (rank `replicate_rank · world + rank` under HSDP).
    pub nonfinite_rank: Option<usize>,
}

/// Runs `f`, returning a collective that failed inside it — which unwinds as a
/// [`CollectiveFailure`](crate::CollectiveFailure) out of a forward or backward, where Burn's
/// autodiff cannot return errors — as [`FsdpError::Collective`]. Other panics propagate. Call
/// [`crate::comm::quiet_collective_panics`] once so that the panic hook stays quiet for them.
///
/// # Example
/// ```ignore
/// let loss = burn_fsdp::catch_collective_failures(|| {
///     let loss = fsdp.try_forward(|m, _| m.loss(batch))?;
///     Ok(fsdp.gradients(loss.backward()))
/// })?;
/// ```
pub fn catch_collective_failures<T>(f: impl FnOnce() -> Result<T, FsdpError>) -> Result<T, FsdpError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) if p.is::<crate::CollectiveFailure>() => {
            Err(FsdpError::Collective(crate::comm::panic_message(p.as_ref())))
        }
        Err(p) => resume_unwind(p),
    }
}

impl<B: FsdpBackend, M: AutodiffModule<B>> Fsdp<B, M> {
    /// One optimizer step over `micro_batches` with any elementwise Burn optimizer, as
    /// `train-qwen3` takes its steps:
    ///
    /// 1. each micro-batch's `loss(model, batch)` forward and backward, its loss divided by
    ///    the number of micro-batches; gradients reduce-scatter once, after the last
    ///    ([`set_requires_gradient_sync`](Self::set_requires_gradient_sync)), so the step's
    ///    gradients are those of the mean loss;
    /// 2. the global gradient norm, clipped to `clip` when given
    ///    ([`clip_grad_norm`](Self::clip_grad_norm));
    /// 3. the loss averaged over the data-parallel ranks;
    /// 4. when the loss and the norm are finite, `optim` steps the shards at `lr`
    ///    ([`step_with`](Self::step_with)); otherwise nothing changes, and the report names the
    ///    lowest rank whose loss was not finite (every rank takes the same branch).
    ///
    /// A collective that fails inside a forward or backward (a peer died or timed out) is
    /// returned as [`FsdpError::Collective`] ([`catch_collective_failures`]).
    ///
    /// # Example
    /// ```ignore
    /// let mut optim = AdamWConfig::new().init();
    /// for (step, batch) in batches.enumerate() {
    ///     let micro = batch.split(4); // this rank's rows, in 4 micro-batches
    ///     let report = fsdp.train_step(&mut optim, schedule.step(), Some(1.0), micro, |m, b| m.loss(b))?;
    ///     if !report.stepped { break } // not finite
    /// }
    /// ```
    ///
    /// # Errors
    /// [`FsdpError::Config`] without micro-batches, and as [`step_with`](Self::step_with);
    /// failed collectives.
    pub fn train_step<O: Optimizer<M, B>, I>(
        &mut self,
        optim: &mut O,
        lr: LearningRate,
        clip: Option<f64>,
        micro_batches: impl IntoIterator<Item = I>,
        loss: impl FnMut(&M, I) -> Tensor<B, 1>,
    ) -> Result<StepReport, FsdpError> {
        let batches: Vec<I> = micro_batches.into_iter().collect();
        let n = batches.len();
        let batches = batches.into_iter();
        catch_collective_failures(|| {
            let mut parts = FsdpStep { fsdp: self, optim, lr, batches, loss, grads: None };
            take_step(&mut parts, n, clip)
        })
    }
}

/// A value of a training step that may still be on the device: [`take_step`] reads every
/// pending value of a step in one device → host copy.
#[derive(Debug, Clone)]
pub enum StepValue<B: Backend> {
    /// A tensor on the device, not read yet, whose value is the sum of its elements taken on
    /// the host in `f64`, in order: one element for most parts; tensor parallelism hands over
    /// its two partial sums (split and replicated parameters), which it added in `f64`.
    Pending(Tensor<B, 1>),
    /// A value already on the host (computed there, e.g. from offloaded gradients).
    Read(f64),
}

/// What [`StepParts::gradients`] returns: the step's gradients and their global squared norm.
pub type GradientsAndSqSum<G, B> = (G, StepValue<B>);

/// The parts of one training step that depend on how the model is held — on one device, or as
/// this rank's FSDP shards, with or without tensor parallelism or activation checkpointing —
/// for [`take_step`], which does the rest the same way for all of them. [`Fsdp::train_step`]
/// is `take_step` over an FSDP model and a Burn optimizer; `train-qwen3`'s loop is `take_step`
/// over its Qwen3 engine (one device or sharded, TorchAdamW).
///
/// The parts hand back device tensors, not numbers: the step's losses and norm stay on the
/// device until `take_step` reads them all at once (one host sync per step).
pub trait StepParts {
    /// The step's gradients, as [`gradients`](Self::gradients) hands them to
    /// [`apply`](Self::apply).
    type Gradients;
    /// The error of a part (FSDP's errors convert into it).
    type Error: From<FsdpError>;
    /// The backend the step's values (losses, norm) are computed on: the inner backend of the
    /// model's autodiff backend.
    type Backend: Backend;

    /// Forward and backward of micro-batch `index` of `count`, its loss divided by `count`
    /// (so that the step's gradients are those of the mean loss); returns that divided loss as
    /// a one-element tensor, **not read** (reading it would stop the host until the device
    /// caught up). Gradients reduce only after the last micro-batch
    /// ([`Fsdp::set_requires_gradient_sync`]).
    fn micro_batch(&mut self, index: usize, count: usize) -> Result<Tensor<Self::Backend, 1>, Self::Error>;

    /// The step's gradients and their global squared L2 norm `Σ g²` (over every shard of the
    /// model, each gradient counted once), not read where it can stay on the device.
    fn gradients(&mut self) -> Result<GradientsAndSqSum<Self::Gradients, Self::Backend>, Self::Error>;

    /// Scales `grads` so that their global norm, `norm` before, is at most `max_norm`
    /// (`torch.nn.utils.clip_grad_norm_`'s coefficient, [`crate::optim::clip_coefficient`]).
    fn clip(&mut self, grads: &mut Self::Gradients, norm: f64, max_norm: f64) -> Result<(), Self::Error>;

    /// `values` reduced elementwise over the data-parallel ranks, on the device (not read);
    /// `None` where this rank is the only one. `tag` names the collective.
    fn all_reduce(
        &self,
        values: Tensor<Self::Backend, 1>,
        op: ReduceOp,
        tag: &str,
    ) -> Result<Option<Tensor<Self::Backend, 1>>, Self::Error>;

    /// This rank among the data-parallel ranks, and their number: `(rank, world)`.
    fn data_parallel(&self) -> (usize, usize);

    /// The optimizer's update with the step's gradients.
    fn apply(&mut self, grads: Self::Gradients) -> Result<(), Self::Error>;
}

/// One training step of `micro_batches` micro-batches through `parts`:
///
/// 1. each micro-batch's forward and backward ([`StepParts::micro_batch`]);
/// 2. the global gradient norm ([`StepParts::gradients`]), and the loss (the sum of the
///    micro-batches' divided losses) averaged over the data-parallel ranks — both still on the
///    device;
/// 3. **one read** of the micro-batches' losses, the averaged loss and the norm: the step's
///    only host sync (the reads of tensor parallelism's norm and of offloaded gradients aside);
/// 4. when the loss and the norm are finite, the gradients clipped to `clip` when given and the
///    update; otherwise none, and the report names the lowest data-parallel rank whose own
///    loss was not finite. The loss and the norm are global, so every rank takes the same
///    branch, and the non-finite guard still stops before the update.
///
/// Failed collectives are not caught here: wrap the call in [`catch_collective_failures`]
/// (as [`Fsdp::train_step`] does) or catch them around the whole loop.
///
/// # Example
/// ```ignore
/// // `MyStep` implements StepParts for a model held however the loop holds it.
/// let report = burn_fsdp::take_step(&mut MyStep { model: &mut engine, batch }, 4, Some(1.0))?;
/// ```
///
/// # Errors
/// A configuration error without micro-batches, and any part's error.
pub fn take_step<P: StepParts>(
    parts: &mut P,
    micro_batches: usize,
    clip: Option<f64>,
) -> Result<StepReport, P::Error> {
    if micro_batches == 0 {
        return Err(FsdpError::Config("train_step: no micro-batch".into()).into());
    }
    let mut losses = Vec::with_capacity(micro_batches);
    for index in 0..micro_batches {
        losses.push(parts.micro_batch(index, micro_batches)?);
    }
    let (mut grads, sq_sum) = parts.gradients()?;
    let device = losses[0].device();
    // The losses are averaged over the ranks in f32, as a host scalar was before.
    let local_sum = losses.iter().cloned().map(|l| l.cast(DType::F32)).reduce(|a, b| a + b);
    let global = match local_sum {
        Some(sum) => parts.all_reduce(sum, ReduceOp::Avg, "train_step:loss")?,
        None => None,
    };
    // Everything the host needs, in one read: [micro-batch losses…, global loss?, Σ g²?].
    let mut pending = losses;
    pending.extend(global.iter().cloned());
    if let StepValue::Pending(t) = &sq_sum {
        pending.push(t.clone());
    }
    let mut values = read_values(pending, "the step's losses and gradient norm")?.into_iter();
    // As the losses were summed before: on the host, in f64, micro-batch by micro-batch.
    let local: f64 = values.by_ref().take(micro_batches).sum();
    let loss = match global {
        Some(_) => values.next().unwrap_or(f64::NAN),
        None => local,
    };
    let grad_norm = match sq_sum {
        StepValue::Pending(t) => match t.dims()[0] {
            0 => f64::NAN,
            parts => values.by_ref().take(parts).sum::<f64>(),
        },
        StepValue::Read(v) => v,
    }
    .sqrt();
    let stepped = loss.is_finite() && grad_norm.is_finite();
    let mut nonfinite_rank = None;
    if stepped {
        if let Some(max_norm) = clip.filter(|m| m.is_finite() && *m > 0.0) {
            parts.clip(&mut grads, grad_norm, max_norm)?;
        }
        parts.apply(grads)?;
    } else {
        // The lowest data-parallel rank whose loss was not finite, as world - max(world - r)
        // (0 from ranks whose loss was finite).
        let (rank, world) = parts.data_parallel();
        let mine = if local.is_finite() { 0.0 } else { (world - rank) as f64 };
        let mark = Tensor::<P::Backend, 1>::from_data(TensorData::new(vec![mine as f32], [1]), &device);
        let max = match parts.all_reduce(mark, ReduceOp::Max, "train_step:nonfinite-rank")? {
            Some(t) => read_values(vec![t], "the non-finite rank")?.first().copied().unwrap_or(0.0),
            None => mine,
        };
        nonfinite_rank = (max > 0.0).then(|| world - max.round() as usize);
    }
    Ok(StepReport { loss, grad_norm, stepped, nonfinite_rank })
}

/// The values of one-dimensional tensors, in order, as `f64` in **one** device → host read:
/// they are concatenated in `f64` when one of them is `f64`, else in `f32` (exact for `f32`,
/// `bf16` and `f16`). An error names `what`.
pub(crate) fn read_values<B: Backend>(tensors: Vec<Tensor<B, 1>>, what: &str) -> Result<Vec<f64>, FsdpError> {
    let dtype = if tensors.iter().any(|t| t.dtype() == DType::F64) { DType::F64 } else { DType::F32 };
    let all = Tensor::cat(tensors.into_iter().map(|t| t.cast(dtype)).collect(), 0);
    let data = all.into_data();
    match dtype {
        DType::F64 => data.to_vec::<f64>(),
        _ => data.to_vec::<f32>().map(|v| v.into_iter().map(f64::from).collect()),
    }
    .map_err(|e| FsdpError::Values { what: what.to_string(), reason: format!("{e:?}") })
}

/// [`Fsdp::train_step`]'s parts: an FSDP model, a Burn optimizer, the step's micro-batches.
struct FsdpStep<'a, B: FsdpBackend, M: AutodiffModule<B>, O, I, L> {
    fsdp: &'a mut Fsdp<B, M>,
    optim: &'a mut O,
    lr: LearningRate,
    /// The micro-batches not run yet, in order.
    batches: std::vec::IntoIter<I>,
    loss: L,
    /// The last micro-batch's gradients (earlier ones FSDP keeps).
    grads: Option<GradientsParams>,
}

impl<B, M, O, I, L> StepParts for FsdpStep<'_, B, M, O, I, L>
where
    B: FsdpBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
    L: FnMut(&M, I) -> Tensor<B, 1>,
{
    type Gradients = GradientsParams;
    type Error = FsdpError;
    type Backend = B::InnerBackend;

    fn micro_batch(&mut self, index: usize, count: usize) -> Result<Tensor<B::InnerBackend, 1>, FsdpError> {
        let batch = (self.batches.next())
            .ok_or_else(|| FsdpError::Config(format!("train_step: no micro-batch {index}")))?;
        self.fsdp.set_requires_gradient_sync(index + 1 == count);
        let loss = &mut self.loss;
        let l = self.fsdp.try_forward(|m, _| loss(m, batch).div_scalar(count as f64))?;
        let value = l.clone().inner();
        // Before the last micro-batch, FSDP keeps the gradients (nothing returned).
        self.grads = Some(self.fsdp.gradients(l.backward()));
        Ok(value)
    }

    fn gradients(&mut self) -> Result<(GradientsParams, StepValue<B::InnerBackend>), FsdpError> {
        let mut grads =
            self.grads.take().ok_or_else(|| FsdpError::Config("train_step: no micro-batch ran".into()))?;
        let sq_sum = self.fsdp.grad_sq_sum(&mut grads)?;
        Ok((grads, sq_sum))
    }

    fn clip(&mut self, grads: &mut GradientsParams, norm: f64, max_norm: f64) -> Result<(), FsdpError> {
        self.fsdp.clip_grads(grads, norm, max_norm)
    }

    fn all_reduce(
        &self,
        values: Tensor<B::InnerBackend, 1>,
        op: ReduceOp,
        tag: &str,
    ) -> Result<Option<Tensor<B::InnerBackend, 1>>, FsdpError> {
        self.fsdp.all_reduce_data_parallel(values, op, tag)
    }

    fn data_parallel(&self) -> (usize, usize) {
        let fsdp = &*self.fsdp;
        let world = fsdp.world() * fsdp.replicate_group().map_or(1, |g| g.size());
        (fsdp.replicate_rank() * fsdp.world() + fsdp.rank(), world)
    }

    fn apply(&mut self, grads: GradientsParams) -> Result<(), FsdpError> {
        self.fsdp.step_with(self.optim, self.lr, grads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step over made-up parts: micro-batch losses, a norm, and what the all-reduces return
    /// (standing in for the other ranks); records what `take_step` called.
    struct Fake {
        losses: Vec<f64>,
        norm: f64,
        /// What the all-reduce of a finite loss returns (the "global" loss).
        global_loss: f64,
        /// The largest non-finite mark of the other ranks.
        max_mark: f64,
        data: (usize, usize),
        norm_on_device: bool,
        calls: Vec<String>,
    }

    type Nd = burn::backend::NdArray;

    fn scalar(v: f64) -> Tensor<Nd, 1> {
        Tensor::from_data(TensorData::new(vec![v as f32], [1]), &Default::default())
    }

    fn value(t: Tensor<Nd, 1>) -> f64 {
        f64::from(t.into_data().to_vec::<f32>().unwrap()[0])
    }

    impl StepParts for Fake {
        type Gradients = &'static str;
        type Error = FsdpError;
        type Backend = Nd;

        fn micro_batch(&mut self, index: usize, count: usize) -> Result<Tensor<Nd, 1>, FsdpError> {
            self.calls.push(format!("micro {index}/{count}"));
            Ok(scalar(self.losses[index]))
        }
        fn gradients(&mut self) -> Result<(&'static str, StepValue<Nd>), FsdpError> {
            self.calls.push("norm".into());
            // Half the fakes hand the norm over on the device, half on the host.
            let sq = self.norm * self.norm;
            Ok((
                "grads",
                if self.norm_on_device { StepValue::Pending(scalar(sq)) } else { StepValue::Read(sq) },
            ))
        }
        fn clip(&mut self, _: &mut &'static str, norm: f64, max_norm: f64) -> Result<(), FsdpError> {
            self.calls.push(format!("clip {norm} to {max_norm}"));
            Ok(())
        }
        fn all_reduce(
            &self,
            t: Tensor<Nd, 1>,
            op: ReduceOp,
            tag: &str,
        ) -> Result<Option<Tensor<Nd, 1>>, FsdpError> {
            let v = value(t);
            Ok(Some(scalar(match op {
                ReduceOp::Avg => {
                    assert_eq!(tag, "train_step:loss");
                    if v.is_finite() { self.global_loss } else { v }
                }
                ReduceOp::Max => {
                    assert_eq!(tag, "train_step:nonfinite-rank");
                    self.max_mark.max(v)
                }
                _ => return Err(FsdpError::Config("unexpected reduction".into())),
            })))
        }
        fn data_parallel(&self) -> (usize, usize) {
            self.data
        }
        fn apply(&mut self, grads: &'static str) -> Result<(), FsdpError> {
            self.calls.push(format!("apply {grads}"));
            Ok(())
        }
    }

    fn fake(losses: Vec<f64>) -> Fake {
        let norm_on_device = losses.len().is_multiple_of(2);
        Fake {
            losses,
            norm: 2.5,
            global_loss: 0.75,
            max_mark: 0.0,
            data: (1, 4),
            norm_on_device,
            calls: vec![],
        }
    }

    #[test]
    fn every_micro_batch_then_clip_then_the_update() {
        let mut p = fake(vec![0.25, 0.5]);
        let r = take_step(&mut p, 2, Some(1.0)).unwrap();
        assert_eq!(r, StepReport { loss: 0.75, grad_norm: 2.5, stepped: true, nonfinite_rank: None });
        assert_eq!(p.calls, ["micro 0/2", "micro 1/2", "norm", "clip 2.5 to 1", "apply grads"]);
        // Without clipping the norm is only measured.
        let mut p = fake(vec![0.25]);
        let r = take_step(&mut p, 1, None).unwrap();
        assert_eq!(r.grad_norm, 2.5);
        assert_eq!(p.calls, ["micro 0/1", "norm", "apply grads"]);
    }

    #[test]
    fn a_non_finite_loss_skips_the_update_and_names_the_lowest_rank() {
        // This rank (1 of 4) has a NaN loss; another's mark (4 - 2) says rank 2 has one too.
        let mut p = fake(vec![0.25, f64::NAN]);
        p.max_mark = 2.0;
        let r = take_step(&mut p, 2, Some(1.0)).unwrap();
        assert!(!r.stepped && r.loss.is_nan());
        assert_eq!(r.nonfinite_rank, Some(1));
        assert!(!p.calls.iter().any(|c| c.starts_with("apply") || c.starts_with("clip")), "{:?}", p.calls);
        // Finite here, but a peer (rank 3: mark 1) was not: the global loss is NaN.
        let mut p = fake(vec![0.25]);
        (p.global_loss, p.max_mark) = (f64::NAN, 1.0);
        let r = take_step(&mut p, 1, None).unwrap();
        assert_eq!((r.stepped, r.nonfinite_rank), (false, Some(3)));
        // A non-finite norm with finite losses: no update, no rank to name.
        let mut p = fake(vec![0.25]);
        p.norm = f64::INFINITY;
        let r = take_step(&mut p, 1, None).unwrap();
        assert_eq!((r.stepped, r.nonfinite_rank), (false, None));
        assert!(!p.calls.iter().any(|c| c.starts_with("apply")), "{:?}", p.calls);
    }

    #[test]
    fn no_micro_batch_is_an_error() {
        let mut p = fake(vec![]);
        let e = take_step(&mut p, 0, None).unwrap_err();
        assert!(e.to_string().contains("no micro-batch"), "{e}");
        assert!(p.calls.is_empty());
    }
}
