//! The language-modelling loss and fixed training batches.

use std::path::Path;

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use crate::checkpoint::SafetensorsFile;
use crate::error::{Qwen3Error, Result};

/// Mean token cross-entropy of `logits` against `labels` (PyTorch's `cross_entropy`, mean).
///
/// # Shapes
/// - logits: `[batch, seq, vocab]`
/// - labels: `[batch, seq]`
/// - output: `[1]`
pub fn cross_entropy<B: Backend>(logits: Tensor<B, 3>, labels: Tensor<B, 2, Int>) -> Tensor<B, 1> {
    let [b, t, v] = logits.dims();
    let logp = log_softmax(logits.reshape([b * t, v]), 1);
    let picked = logp.gather(1, labels.reshape([b * t, 1]));
    picked.mean().neg()
}

/// Splits token rows `[rows, seq + 1]` into inputs `[:, :-1]` and labels `[:, 1:]`.
pub fn inputs_and_labels<B: Backend>(tokens: Tensor<B, 2, Int>) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
    let [_, t1] = tokens.dims();
    (tokens.clone().narrow(1, 0, t1 - 1), tokens.narrow(1, 1, t1 - 1))
}

/// Fixed token batches: `tokens` `[steps, rows, seq + 1]` (the fixtures' `batches.safetensors`).
#[derive(Debug, Clone, PartialEq)]
pub struct Batches {
    /// Number of steps.
    pub steps: usize,
    /// Rows of the global batch per step.
    pub rows: usize,
    /// Tokens per row (`seq + 1`).
    pub width: usize,
    /// Row-major values.
    pub tokens: Vec<i64>,
}

impl Batches {
    /// Reads tensor `tokens` from a safetensors file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = SafetensorsFile::open(path)?;
        let (tokens, shape) = file.read_i64("tokens")?;
        let [steps, rows, width] = shape[..] else {
            return Err(Qwen3Error::Shape {
                path: path.to_path_buf(),
                name: "tokens".into(),
                expected: vec![0, 0, 0],
                got: shape,
            });
        };
        if width < 2 {
            return Err(Qwen3Error::Shape {
                path: path.to_path_buf(),
                name: "tokens".into(),
                expected: vec![steps, rows, 2],
                got: shape.clone(),
            });
        }
        Ok(Self { steps, rows, width, tokens })
    }

    /// Largest token id.
    pub fn max_token(&self) -> i64 {
        self.tokens.iter().copied().max().unwrap_or(0)
    }

    /// Smallest token id.
    pub fn min_token(&self) -> i64 {
        self.tokens.iter().copied().min().unwrap_or(0)
    }

    /// Rows `rows` of step `step` as a `[rows.len(), width]` tensor.
    pub fn rows<B: Backend>(
        &self,
        step: usize,
        rows: std::ops::Range<usize>,
        device: &B::Device,
    ) -> Tensor<B, 2, Int> {
        let start = (step * self.rows + rows.start) * self.width;
        let end = (step * self.rows + rows.end) * self.width;
        let data = TensorData::new(self.tokens[start..end].to_vec(), [rows.len(), self.width]);
        Tensor::from_data(data, device)
    }
}
