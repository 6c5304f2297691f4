//! CPU offload (FSDP2's `CPUOffloadPolicy`): shards, gradients and optimizer state on the host.
//!
//! With offload, the sharded module keeps no parameter data on the compute device (its
//! parameters are zero-row placeholders). A unit's shards are uploaded from the host store
//! right before its all-gather (and again for a re-gather in backward), the reduce-scattered
//! gradient is copied back into the store as soon as the unit's backward ends, and AdamW steps
//! the host copies with exactly the arithmetic of [`TorchAdamW`](crate::TorchAdamW). So between steps
//! the device holds nothing of the model, and during a step about one unit.
//!
//! Ordering: every device → host copy here is Burn's `into_data_async`, which on Burn's
//! backends is queued after the work queued before it on the tensor's stream; every host →
//! device copy is a fresh `Tensor::from_data`. FSDP's communication thread works on the compute
//! thread's stream, and a backend that runs collectives on a stream of its own orders a read of
//! their output after them, so a copy never overtakes the reduce-scatter that produced its
//! data.
//!
//! The gradient copies do not wait: a unit's copy is queued (its future polled once) when its
//! reduce-scatter has been issued, and the host waits for the copies only when it next needs
//! the stored gradients (the optimizer step, the norm, a checkpoint), in the order they were
//! queued — FSDP2's non-blocking device → host copies, synchronised before the optimizer step.
//! Until then the device keeps each unit's reduced shard gradient (at most the rank's shard of
//! all gradients, 1/W of them), as FSDP2 keeps its device gradients until its copies are
//! synchronised at the end of backward.
//! On a backend whose read completes at once (the CPU backends) the gradient is stored at
//! once. A copy that fails panics where the store is next read (the step), with the message a
//! failed copy in backward gave before.

use std::collections::HashMap;
use std::sync::Mutex;

use burn::module::ParamId;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};

use crate::optim::TorchAdamWConfig;

/// FSDP2's `CPUOffloadPolicy`: keep shards, gradients and optimizer state on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OffloadPolicy {
    /// Whether offloading is on.
    pub enabled: bool,
}

/// AdamW state of one parameter, on the host.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct HostAdam {
    /// Updates applied so far.
    pub step: u64,
    /// Running average of the gradient (padded flat shard).
    pub exp_avg: Vec<f32>,
    /// Running average of the squared gradient (padded flat shard).
    pub exp_avg_sq: Vec<f32>,
}

/// One parameter's host copies (padded flat shards).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct HostParam {
    /// The master shard.
    pub shard: Vec<f32>,
    /// The reduced gradient of the current step, if backward has produced it.
    pub grad: Option<Vec<f32>>,
    /// Optimizer state.
    pub adam: Option<HostAdam>,
}

/// A gradient copy queued and not yet waited for: the parameters it goes to (with their
/// lengths) and what waits for its values.
struct QueuedGrad {
    ids: Vec<(ParamId, usize)>,
    values: Box<dyn FnOnce() -> Vec<f32> + Send>,
}

/// Host memory holding every offloaded shard of one rank.
#[derive(Default)]
pub(crate) struct HostStore {
    params: Mutex<HashMap<ParamId, HostParam>>,
    /// Gradient copies in flight, oldest first (see the module docs).
    queued: Mutex<Vec<QueuedGrad>>,
}

impl std::fmt::Debug for HostStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostStore").finish_non_exhaustive()
    }
}

/// Polls `fut` once, without a task to wake: `Some` if it is done.
fn poll_once<F: std::future::Future + Unpin>(fut: &mut F) -> Option<F::Output> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match std::pin::Pin::new(fut).poll(&mut cx) {
        std::task::Poll::Ready(out) => Some(out),
        std::task::Poll::Pending => None,
    }
}

/// An offloaded unit's gradient as f32 values. Inside backward, where nothing can be returned:
/// the reduce-scatter made this gradient in the reduce dtype (f32 or bf16), which converts;
/// were it not, or did the read fail, fail loudly.
fn grad_values(data: Result<TensorData, burn::tensor::backend::ExecutionError>) -> Vec<f32> {
    let what = || "an offloaded unit's gradient".to_string();
    let data = match data {
        Ok(data) => data,
        Err(e) => panic!("reading {}: {e:?}", what()),
    };
    match crate::downcast::f32_values(data, what) {
        Ok(v) => v,
        Err(e) => panic!("{e}"),
    }
}

/// Bytes held in host memory under offload ([`Fsdp::offloaded_bytes`](crate::Fsdp::offloaded_bytes)), by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HostBytes {
    /// Master shards.
    pub params: usize,
    /// Gradients.
    pub grads: usize,
    /// Optimizer state.
    pub optimizer: usize,
}

impl HostStore {
    /// The stored parameters, with every queued gradient copy waited for and added first.
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ParamId, HostParam>> {
        let queued = std::mem::take(&mut *self.queue());
        let mut params = self.params();
        for grad in queued {
            add_grad(&mut params, &grad.ids, &(grad.values)());
        }
        params
    }

    fn params(&self) -> std::sync::MutexGuard<'_, HashMap<ParamId, HostParam>> {
        // Every update replaces whole entries, so a poisoned lock holds consistent data.
        self.params.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, Vec<QueuedGrad>> {
        // Pushes and takes only.
        self.queued.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stores a parameter's shard (replacing what was there, gradient and state included).
    pub fn insert(&self, id: ParamId, shard: Vec<f32>) {
        self.lock().insert(id, HostParam { shard, grad: None, adam: None });
    }

    /// A copy of one parameter's host data.
    pub fn get(&self, id: ParamId) -> Option<HostParam> {
        self.lock().get(&id).cloned()
    }

    /// Replaces one parameter's host data (checkpoint loading).
    pub fn set(&self, id: ParamId, param: HostParam) {
        self.lock().insert(id, param);
    }

    /// Host → device: the concatenated shards of `ids` as one flat fp32 tensor.
    pub fn upload<B: Backend>(&self, ids: &[ParamId], device: &B::Device) -> Tensor<B, 1> {
        // Shards only: the gradient copies in flight are not waited for (a re-gather in
        // backward would otherwise wait for the copies of the units reduced before it).
        let store = self.params();
        let mut flat = Vec::new();
        for id in ids {
            if let Some(p) = store.get(id) {
                flat.extend_from_slice(&p.shard);
            }
        }
        let n = flat.len();
        Tensor::from_data(TensorData::new(flat, [n]), (device, DType::F32))
    }

    /// Device → host: splits a unit's flat shard gradient over `ids` (with their lengths) and
    /// adds it to the stored gradients — once its copy has completed, which this call does not
    /// wait for (see the module docs).
    pub fn accumulate_grad<B: Backend>(&self, ids: &[(ParamId, usize)], grad: Tensor<B, 1>) {
        let mut read = Box::pin(grad.into_data_async());
        // The first poll queues the copy.
        let done = poll_once(&mut read);
        let mut queue = self.queue();
        let values: Box<dyn FnOnce() -> Vec<f32> + Send> = match done {
            // Done at once (a CPU backend) and nothing queued before it: stored now.
            Some(data) if queue.is_empty() => {
                drop(queue);
                add_grad(&mut self.params(), ids, &grad_values(data));
                return;
            }
            Some(data) => Box::new(move || grad_values(data)),
            None => Box::new(move || grad_values(burn::tensor::read_sync(read))),
        };
        queue.push(QueuedGrad { ids: ids.to_vec(), values });
    }

    /// Sum of squares of the stored gradients (the local part of the global norm).
    pub fn grad_sq_sum(&self) -> f64 {
        // f64 accumulation: a sequential f32 sum over a large shard would drift by ~1e-6.
        self.lock()
            .values()
            .filter_map(|p| p.grad.as_ref())
            .map(|g| g.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>())
            .sum()
    }

    /// Multiplies every stored gradient by `factor`.
    pub fn scale_grads(&self, factor: f64) {
        let f = factor as f32;
        for p in self.lock().values_mut() {
            if let Some(g) = &mut p.grad {
                g.iter_mut().for_each(|x| *x *= f);
            }
        }
    }

    /// One AdamW step on every parameter with a gradient, on the host, then drops the
    /// gradients. The arithmetic (f32, operation by operation) is that of
    /// [`TorchAdamW::update_tensor`](crate::TorchAdamW::update_tensor), so offloaded and on-device
    /// training agree.
    pub fn adam_step(&self, config: &TorchAdamWConfig) {
        let TorchAdamWConfig { lr, betas: (b1, b2), eps, weight_decay } = *config;
        for p in self.lock().values_mut() {
            let Some(g) = p.grad.take() else { continue };
            let n = g.len();
            let state = p.adam.take().unwrap_or_else(|| HostAdam {
                step: 0,
                exp_avg: vec![0.0; n],
                exp_avg_sq: vec![0.0; n],
            });
            let step = state.step + 1;
            let (mut m, mut v) = (state.exp_avg, state.exp_avg_sq);
            let decay = (1.0 - lr * weight_decay) as f32;
            let (b1c, b2f, b2c) = ((1.0 - b1) as f32, b2 as f32, (1.0 - b2) as f32);
            let bias_correction1 = 1.0 - b1.powi(step as i32);
            let bias_correction2 = 1.0 - b2.powi(step as i32);
            let step_size = (lr / bias_correction1) as f32;
            let bc2_sqrt = bias_correction2.sqrt() as f32;
            let eps = eps as f32;
            for i in 0..n {
                if weight_decay != 0.0 {
                    p.shard[i] *= decay;
                }
                m[i] += (g[i] - m[i]) * b1c;
                v[i] = v[i] * b2f + (g[i] * g[i]) * b2c;
                let denom = v[i].sqrt() / bc2_sqrt + eps;
                p.shard[i] -= (m[i] / denom) * step_size;
            }
            p.adam = Some(HostAdam { step, exp_avg: m, exp_avg_sq: v });
        }
    }

    /// Bytes held, by kind.
    pub fn bytes(&self) -> HostBytes {
        let store = self.lock();
        let mut b = HostBytes::default();
        for p in store.values() {
            b.params += 4 * p.shard.len();
            b.grads += 4 * p.grad.as_ref().map_or(0, Vec::len);
            b.optimizer += p.adam.as_ref().map_or(0, |a| 4 * (a.exp_avg.len() + a.exp_avg_sq.len()));
        }
        b
    }
}

/// Adds a unit's flat shard gradient `values` to the stored gradients of `ids` (with their
/// lengths), in order.
fn add_grad(store: &mut HashMap<ParamId, HostParam>, ids: &[(ParamId, usize)], values: &[f32]) {
    let mut offset = 0;
    for (id, len) in ids {
        let piece = &values[offset.min(values.len())..(offset + len).min(values.len())];
        offset += len;
        let Some(p) = store.get_mut(id) else { continue };
        match &mut p.grad {
            Some(g) => g.iter_mut().zip(piece).for_each(|(a, b)| *a += b),
            None => p.grad = Some(piece.to_vec()),
        }
    }
}
