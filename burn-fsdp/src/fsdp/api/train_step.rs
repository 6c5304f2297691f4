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
        mut loss: impl FnMut(&M, I) -> Tensor<B, 1>,
    ) -> Result<StepReport, FsdpError> {
        let batches: Vec<I> = micro_batches.into_iter().collect();
        let n = batches.len();
        if n == 0 {
            return Err(FsdpError::Config("train_step: no micro-batch".into()));
        }
        catch_collective_failures(|| {
            let mut local = 0.0;
            let mut grads = GradientsParams::new();
            for (i, batch) in batches.into_iter().enumerate() {
                self.set_requires_gradient_sync(i + 1 == n);
                let l = self.try_forward(|m, _| loss(m, batch).div_scalar(n as f64))?;
                local += l.clone().into_scalar().elem_f64();
                // Before the last micro-batch, FSDP keeps the gradients (nothing returned).
                grads = self.gradients(l.backward());
            }
            let grad_norm = self.clip_grad_norm(&mut grads, clip.unwrap_or(0.0))?;
            let loss = self.all_reduce_scalar(local, ReduceOp::Avg, "train_step:loss")?;
            let stepped = loss.is_finite() && grad_norm.is_finite();
            let mut nonfinite_rank = None;
            if stepped {
                self.step_with(optim, lr, grads)?;
            } else {
                // The lowest data-parallel rank whose loss was not finite, as
                // world - max(world - r) (0 from ranks whose loss was finite).
                let world = self.world() * self.replicate_group().map_or(1, |g| g.size());
                let rank = self.replicate_rank() * self.world() + self.rank();
                let mine = if local.is_finite() { 0.0 } else { (world - rank) as f64 };
                let max = self.all_reduce_scalar(mine, ReduceOp::Max, "train_step:nonfinite-rank")?;
                nonfinite_rank = (max > 0.0).then(|| world - max.round() as usize);
            }
            Ok(StepReport { loss, grad_norm, stepped, nonfinite_rank })
        })
    }
}
