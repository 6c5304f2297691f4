//! Learning-rate schedules of `train-qwen3` (`--lr-schedule constant|cosine|linear --warmup N`).
//!
//! [`WarmupDecay`] is a Burn [`LrScheduler`], so the same schedule drives burn-fsdp's
//! `TorchAdamW` (through `set_lr`) and any Burn optimizer (through `Fsdp::step_with`).

use burn::optim::LearningRate;
use burn::optim::lr_scheduler::LrScheduler;
use burn::tensor::backend::Backend;

/// How the learning rate evolves after the warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LrSchedule {
    /// The base learning rate throughout.
    Constant,
    /// Half a cosine from the base learning rate down to 0 at the last step.
    Cosine,
    /// A straight line from the base learning rate down to 0 at the last step.
    Linear,
}

/// Linear warmup over `warmup` steps, then `schedule` over the remaining steps of `total`.
///
/// At step `s` (0-based), with `w = warmup` and base rate `lr`:
/// - `s < w`: `lr · (s + 1) / (w + 1)` (torchtitan's warmup: never 0, so no step is wasted);
/// - then, with `p = (s − w) / (total − w)` ∈ [0, 1): constant `lr`, cosine
///   `lr · (1 + cos πp) / 2`, linear `lr · (1 − p)`.
///
/// # Example
/// ```
/// use burn::optim::lr_scheduler::LrScheduler;
/// use xtask::schedule::{LrSchedule, WarmupDecay};
///
/// let mut s = WarmupDecay::new(LrSchedule::Linear, 1e-3, 1, 5);
/// let lrs: Vec<f64> = (0..5).map(|_| s.step()).collect();
/// assert_eq!(lrs, [5e-4, 1e-3, 7.5e-4, 5e-4, 2.5e-4]);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WarmupDecay {
    schedule: LrSchedule,
    base: f64,
    warmup: usize,
    total: usize,
    next: usize,
}

impl WarmupDecay {
    /// `total` steps in all, the first `warmup` of them warming up to `base`.
    pub fn new(schedule: LrSchedule, base: f64, warmup: usize, total: usize) -> Self {
        Self { schedule, base, warmup, total, next: 0 }
    }

    /// The learning rate of step `step` (0-based), whatever steps ran before (so a resumed
    /// run continues the schedule where the checkpoint left it).
    pub fn lr_at(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.base * (step + 1) as f64 / (self.warmup + 1) as f64;
        }
        let span = self.total.saturating_sub(self.warmup).max(1);
        let p = ((step - self.warmup) as f64 / span as f64).min(1.0);
        match self.schedule {
            LrSchedule::Constant => self.base,
            LrSchedule::Cosine => self.base * 0.5 * (1.0 + (std::f64::consts::PI * p).cos()),
            LrSchedule::Linear => self.base * (1.0 - p),
        }
    }
}

impl LrScheduler for WarmupDecay {
    type Record<B: Backend> = usize;

    fn step(&mut self) -> LearningRate {
        let lr = self.lr_at(self.next);
        self.next += 1;
        lr
    }

    fn to_record<B: Backend>(&self) -> Self::Record<B> {
        self.next
    }

    fn load_record<B: Backend>(mut self, record: Self::Record<B>) -> Self {
        self.next = record;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_without_warmup_is_the_base_rate() {
        let s = WarmupDecay::new(LrSchedule::Constant, 3e-3, 0, 10);
        assert!((0..12).all(|k| s.lr_at(k) == 3e-3));
    }

    #[test]
    fn warmup_rises_linearly_then_cosine_falls_to_zero() {
        let s = WarmupDecay::new(LrSchedule::Cosine, 1.0, 3, 7);
        let lrs: Vec<f64> = (0..7).map(|k| s.lr_at(k)).collect();
        let want = [
            0.25,
            0.5,
            0.75,
            1.0,
            0.5 * (1.0 + (std::f64::consts::PI / 4.0).cos()),
            0.5,
            0.5 * (1.0 - (std::f64::consts::PI / 4.0).cos()),
        ];
        for (k, (a, b)) in lrs.iter().zip(want).enumerate() {
            assert!((a - b).abs() < 1e-12, "step {k}: {a} vs {b}");
        }
    }

    #[test]
    fn linear_decays_to_zero_and_the_scheduler_steps_through_lr_at() {
        let mut s = WarmupDecay::new(LrSchedule::Linear, 2.0, 0, 4);
        let stepped: Vec<f64> = (0..4).map(|_| s.step()).collect();
        assert_eq!(stepped, [2.0, 1.5, 1.0, 0.5]);
        let resumed =
            WarmupDecay::new(LrSchedule::Linear, 2.0, 0, 4).load_record::<burn::backend::NdArray>(2);
        assert_eq!(resumed.clone().step(), 1.0);
    }
}
