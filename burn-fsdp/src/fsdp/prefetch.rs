//! Overlap of communication with compute: a communication thread per rank, forward and
//! backward prefetch of all-gathers, and reduce-scatters that run while backward goes on.
//!
//! Every FSDP collective of a rank (all-gathers, re-gathers, reduce-scatters) runs on the
//! rank's `CommWorker` thread, in the order it was issued — the same order on every rank,
//! as FSDP2's communication stream. The compute thread only waits for a result when it needs
//! it:
//!
//! - **Forward prefetch.** When unit `i` is gathered, the gather of the unit that ran after
//!   it in the previous forward is issued at once, so it moves while unit `i` computes.
//! - **Backward prefetch.** When a resharded unit is re-gathered in backward, the re-gather
//!   that followed it in the previous backward is issued at once.
//! - **Asynchronous reduce-scatter.** A unit's backward hands its gradient to the worker and
//!   returns. The reduced shard gradients are collected at the end of the same backward pass
//!   by its last step (`Prefetcher::collect_into`, run by the node that
//!   [`FsdpBackend::fsdp_backward_end`](crate::FsdpBackend::fsdp_backward_end) makes, a parent
//!   of every gather of the forward) and registered on the shards' autodiff nodes, so that
//!   Burn's own `GradientsParams::from_grads(loss.backward(), fsdp.module())` sees them, as
//!   [`Fsdp::gradients`](crate::Fsdp::gradients) does. A reduction nobody collected (a backward
//!   pass without that node) is an error at the next forward, never dropped unnoticed.
//!   At most [`FsdpConfig::max_inflight_reduce_scatters`](crate::FsdpConfig::max_inflight_reduce_scatters)
//!   are in flight (default 2): each holds its unit's full gradient until it has run, so a
//!   backward about to issue one more first waits for the oldest, as FSDP2 waits on the
//!   previous reduce-scatter. Communication memory does not grow with the number of units
//!   (`tests/tests/fsdp_memory.rs`: a link 20 ms slower than compute, 16 units — 16 in flight
//!   without the bound, 2 with it).
//!
//! The orders are recorded during the first step (which therefore prefetches nothing), so
//! any model works without declaring its unit order; if a model runs its units in another
//! order, a prefetched result is simply not used (every rank still issues the same
//! collectives). Only the first all-gather of forward, the first re-gather of backward and
//! the last reduce-scatter are exposed. [`PrefetchStats`] counts what was prefetched and how
//! long the compute thread waited.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::grads::Gradients;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, StreamId, Tensor, TensorPrimitive};

use crate::fsdp::collectives::{Phase, UnitComm};

type Job = Box<dyn FnOnce() + Send>;

/// A thread that runs one rank's collectives in the order they are issued.
pub(crate) struct CommWorker {
    tx: Mutex<Option<Sender<Job>>>,
}

impl std::fmt::Debug for CommWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CommWorker")
    }
}

/// The result of a job on a [`CommWorker`].
pub(crate) struct Pending<T>(Receiver<std::thread::Result<T>>);

impl<T> Pending<T> {
    /// Waits for the result; a panic of the job (a failed collective) continues here.
    pub fn wait(self) -> T {
        match self.0.recv() {
            Ok(Ok(v)) => v,
            Ok(Err(panic)) => resume_unwind(panic),
            Err(_) => crate::comm::CollectiveFailure::raise("FSDP: the communication thread stopped"),
        }
    }
}

impl CommWorker {
    /// Starts the thread.
    pub fn new(name: &str) -> Self {
        let (tx, rx) = channel::<Job>();
        let spawned = std::thread::Builder::new().name(format!("fsdp-comm-{name}")).spawn(move || {
            while let Ok(job) = rx.recv() {
                job();
            }
        });
        // Without a thread, jobs run inline (the sender is dropped and `submit` falls back).
        Self { tx: Mutex::new(spawned.ok().map(|_| tx)) }
    }

    /// Queues `f`; its result (or panic) comes back through the [`Pending`].
    ///
    /// `f` runs on the **submitting thread's stream** ([`StreamId`]), not on one of the worker
    /// thread's own: the tensor work around a collective (flattening and casting its input,
    /// allocating its output, dropping what it consumed) is then ordered on the device with
    /// the compute that produced the input and the compute that reads the output, with no wait
    /// between streams, and its memory comes from and goes back to the compute stream's pool.
    /// What runs on a stream of its own is the collective itself: backends that communicate on
    /// the device queue it on their group's communication stream. Backends without streams
    /// ignore the id.
    pub fn submit<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> Pending<T> {
        let (tx, rx) = channel();
        let stream = StreamId::current();
        let job: Job = Box::new(move || {
            stream.executes(move || {
                let _ = tx.send(catch_unwind(AssertUnwindSafe(f)));
            })
        });
        let sender = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        match sender.as_ref() {
            Some(s) => {
                if let Err(returned) = s.send(job) {
                    (returned.0)();
                }
            }
            None => job(),
        }
        Pending(rx)
    }

    /// Waits until every job queued so far has run.
    pub fn drain(&self) {
        self.submit(|| ()).wait();
    }
}

impl Drop for CommWorker {
    fn drop(&mut self) {
        // Closing the channel ends the thread after the queued jobs; it is not joined, so a
        // collective stuck on a dead peer cannot hang the drop (it ends at its timeout).
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

/// What overlap achieved, counted per rank since the wrap.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefetchStats {
    /// Forward all-gathers whose result was prefetched.
    pub forward_prefetched: u64,
    /// Forward all-gathers issued on demand (exposed): one per forward once the order is known.
    pub forward_on_demand: u64,
    /// Backward re-gathers whose result was prefetched.
    pub backward_prefetched: u64,
    /// Backward re-gathers issued on demand (exposed): one per backward once the order is known.
    pub backward_on_demand: u64,
    /// Reduce-scatters that ran on the communication thread while backward went on.
    pub async_reduce_scatters: u64,
    /// Nanoseconds the compute thread spent waiting for communication results.
    pub wait_nanos: u64,
    /// The most reduce-scatters queued or running on the communication thread at once, each
    /// holding its unit's full gradient (at most
    /// [`FsdpConfig::max_inflight_reduce_scatters`](crate::FsdpConfig::max_inflight_reduce_scatters)).
    pub max_reduce_scatters_in_flight: u64,
}

#[derive(Default)]
struct Counters {
    /// Reduce-scatters queued or running now, and the most so far.
    reduce_scatters_in_flight: Arc<AtomicU64>,
    max_reduce_scatters_in_flight: AtomicU64,
    forward_prefetched: AtomicU64,
    forward_on_demand: AtomicU64,
    backward_prefetched: AtomicU64,
    backward_on_demand: AtomicU64,
    async_reduce_scatters: AtomicU64,
    wait_nanos: AtomicU64,
}

/// Which order a unit gather belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    Forward,
    Backward,
}

struct State<B: Backend> {
    /// Every unit's shard tensors (as the parameters hold them), saved at the last forward.
    shards: Vec<Option<Vec<B::FloatTensorPrimitive>>>,
    /// Unit orders of the previous forward and backward, and of the current ones.
    order: [Vec<usize>; 2],
    current: [Vec<usize>; 2],
    /// Prefetched gathers, per pass and unit.
    ready: [HashMap<usize, Pending<Tensor<B, 1>>>; 2],
    /// Reduce-scatters in flight.
    reductions: Vec<Reduction<B>>,
}

/// A reduce-scatter issued by this backward: its unit, its result (`None` without sync) and
/// where its pieces go.
type Reduction<B> = (usize, Flight<B>, Targets);

/// A reduce-scatter on the communication thread, or its result once waited for (the oldest
/// ones are, when more than the bound are in flight).
enum Flight<B: Backend> {
    Waiting(Pending<Option<Tensor<B, 1>>>),
    Done(Option<Tensor<B, 1>>),
}

/// What an offloaded unit's reduced shard gradient is handed to, on the communication thread.
pub(crate) type Deliver<B> = Box<dyn FnOnce(Tensor<B, 1>) + Send>;

/// Where one parameter's piece of a unit's reduced flat shard gradient is registered: the
/// shard's autodiff node (`None` when the shard needs no gradient), its shape and dtype.
pub(crate) type ShardTarget = (Option<NodeId>, Shape, DType);

/// Another node a parameter's piece goes to besides its shard: the parameter's view in the
/// root unit's gathered module, which a forward hands to the model as `self` — so that Burn's
/// `GradientsParams::from_grads(grads, &view)` (in a burn-train `TrainStep` run on that view)
/// finds the same reduced gradient as `from_grads(grads, fsdp.module())`. The view's node,
/// the piece's offset in the flat shard, the shard's shape and dtype.
pub(crate) type Alias = (NodeId, usize, Shape, DType);

/// Where a unit's reduced flat shard gradient goes: its shards' nodes and their aliases.
#[derive(Debug, Default)]
pub(crate) struct Targets {
    pub(crate) shards: Vec<ShardTarget>,
    pub(crate) aliases: Vec<Alias>,
}

/// The overlap machinery of one [`Fsdp`](crate::Fsdp) on one rank.
pub(crate) struct Prefetcher<B: Backend> {
    worker: CommWorker,
    /// At most this many reduce-scatters in flight ([`FsdpConfig::max_inflight_reduce_scatters`](crate::FsdpConfig::max_inflight_reduce_scatters)).
    max_inflight: usize,
    comms: Mutex<Vec<Weak<UnitComm<B>>>>,
    state: Mutex<State<B>>,
    counters: Counters,
}

impl<B: Backend> std::fmt::Debug for Prefetcher<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Prefetcher")
    }
}

pub(crate) fn flat<B: Backend>(pieces: Vec<B::FloatTensorPrimitive>) -> Tensor<B, 1> {
    let mut pieces: Vec<Tensor<B, 1>> = pieces
        .into_iter()
        .map(|t| {
            let n = burn::tensor::TensorMetadata::shape(&t).num_elements();
            Tensor::from_primitive(TensorPrimitive::Float(B::float_reshape(t, Shape::new([n]))))
        })
        .collect();
    if pieces.len() == 1 { pieces.remove(0) } else { Tensor::cat(pieces, 0) }
}

impl<B: Backend> Prefetcher<B> {
    /// A prefetcher for `units` units, with its own communication thread and at most
    /// `max_inflight` reduce-scatters in flight (at least one).
    pub fn new(units: usize, name: &str, max_inflight: usize) -> Arc<Self> {
        Arc::new(Self {
            worker: CommWorker::new(name),
            max_inflight: max_inflight.max(1),
            comms: Mutex::new(Vec::new()),
            state: Mutex::new(State {
                shards: (0..units).map(|_| None).collect(),
                order: [Vec::new(), Vec::new()],
                current: [Vec::new(), Vec::new()],
                ready: [HashMap::new(), HashMap::new()],
                reductions: Vec::new(),
            }),
            counters: Counters::default(),
        })
    }

    /// Registers the units' communicators (index = unit index).
    pub(crate) fn set_units(&self, comms: &[Arc<UnitComm<B>>]) {
        *self.comms.lock().unwrap_or_else(|p| p.into_inner()) = comms.iter().map(Arc::downgrade).collect();
    }

    fn state(&self) -> MutexGuard<'_, State<B>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The counters so far.
    pub fn stats(&self) -> PrefetchStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PrefetchStats {
            forward_prefetched: l(&c.forward_prefetched),
            forward_on_demand: l(&c.forward_on_demand),
            backward_prefetched: l(&c.backward_prefetched),
            backward_on_demand: l(&c.backward_on_demand),
            async_reduce_scatters: l(&c.async_reduce_scatters),
            wait_nanos: l(&c.wait_nanos),
            max_reduce_scatters_in_flight: l(&c.max_reduce_scatters_in_flight),
        }
    }

    fn timed_wait<T>(&self, p: Pending<T>) -> T {
        let start = Instant::now();
        let v = p.wait();
        self.counters.wait_nanos.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        v
    }

    /// Waits until the communication thread is idle: before collectives issued from the
    /// compute thread on the same groups, so that every rank issues them in the same order.
    pub fn quiesce(&self) {
        self.worker.drain();
    }

    /// Starts a forward: the previous forward's and backward's unit orders become the ones
    /// to prefetch by, unused prefetches are dropped, and the shards of this forward are
    /// saved for the backward prefetch.
    ///
    /// # Errors
    /// When reduce-scatters of the previous backward were never collected (a backward pass
    /// whose gradients neither reached the shards nor went through
    /// [`Fsdp::gradients`](crate::Fsdp::gradients)): their number, for the caller's message.
    pub(crate) fn begin_forward(
        &self,
        shards: Vec<Option<Vec<B::FloatTensorPrimitive>>>,
    ) -> Result<(), usize> {
        self.quiesce();
        let mut st = self.state();
        let uncollected = std::mem::take(&mut st.reductions).len();
        if uncollected > 0 {
            return Err(uncollected);
        }
        for pass in 0..2 {
            let current = std::mem::take(&mut st.current[pass]);
            if !current.is_empty() {
                st.order[pass] = current;
            }
            st.ready[pass].clear();
        }
        st.shards = shards;
        Ok(())
    }

    fn issue(&self, st: &mut State<B>, pass: Pass, unit: usize) {
        let p = pass as usize;
        if st.ready[p].contains_key(&unit) {
            return;
        }
        let Some(Some(shards)) = st.shards.get(unit).cloned() else { return };
        let Some(comm) =
            self.comms.lock().unwrap_or_else(|p| p.into_inner()).get(unit).and_then(Weak::upgrade)
        else {
            return;
        };
        let phase = if pass == Pass::Forward { Phase::ForwardGather } else { Phase::BackwardGather };
        let pending = self.worker.submit(move || comm.gather(flat::<B>(shards), phase));
        st.ready[p].insert(unit, pending);
    }

    /// The all-gathered flat buffer of `unit` in `pass`: the prefetched one, or gathered now
    /// from `shard` (called only when needed). Then prefetches the unit that followed this
    /// one in the previous pass.
    fn gather(
        &self,
        pass: Pass,
        unit: usize,
        comm: &Arc<UnitComm<B>>,
        shard: impl FnOnce() -> Tensor<B, 1>,
    ) -> Tensor<B, 1> {
        let p = pass as usize;
        let (pending, prefetched) = {
            let mut st = self.state();
            st.current[p].push(unit);
            let (pending, prefetched) = match st.ready[p].remove(&unit) {
                Some(pending) => (pending, true),
                None => {
                    let comm = comm.clone();
                    let shard = shard();
                    let phase =
                        if pass == Pass::Forward { Phase::ForwardGather } else { Phase::BackwardGather };
                    (self.worker.submit(move || comm.gather(shard, phase)), false)
                }
            };
            // The next unit of the recorded order, unless the orders diverged.
            let pos = st.current[p].len() - 1;
            let next = match st.order[p].get(pos) {
                Some(&u) if u == unit => st.order[p].get(pos + 1).copied(),
                _ => None,
            };
            if let Some(next) = next {
                self.issue(&mut st, pass, next);
            }
            (pending, prefetched)
        };
        let counter = match (pass, prefetched) {
            (Pass::Forward, true) => &self.counters.forward_prefetched,
            (Pass::Forward, false) => &self.counters.forward_on_demand,
            (Pass::Backward, true) => &self.counters.backward_prefetched,
            (Pass::Backward, false) => &self.counters.backward_on_demand,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        self.timed_wait(pending)
    }

    /// The forward all-gather of `unit` (see the module docs).
    pub(crate) fn forward_gather(
        &self,
        unit: usize,
        comm: &Arc<UnitComm<B>>,
        shard: impl FnOnce() -> Tensor<B, 1>,
    ) -> Tensor<B, 1> {
        self.gather(Pass::Forward, unit, comm, shard)
    }

    /// The backward re-gather of `unit` (see the module docs).
    pub(crate) fn backward_gather(
        &self,
        unit: usize,
        comm: &Arc<UnitComm<B>>,
        shard: impl FnOnce() -> Tensor<B, 1>,
    ) -> Tensor<B, 1> {
        self.gather(Pass::Backward, unit, comm, shard)
    }

    /// Queues the reduce-scatter of the unit's full gradient, then, for offloaded units,
    /// `deliver` with the reduced shard gradient on the communication thread. `targets` are
    /// the unit's shards in unit order, where [`collect_into`](Self::collect_into) registers
    /// the pieces (empty for offloaded units).
    pub(crate) fn reduce(
        &self,
        unit: usize,
        comm: &Arc<UnitComm<B>>,
        full_grad: Tensor<B, 1>,
        deliver: Option<Deliver<B>>,
        targets: Targets,
    ) {
        // Bounded: each one in flight holds its unit's full gradient until it has run. At the
        // bound, wait for the oldest first (as FSDP2 waits on the previous reduce-scatter),
        // keeping its small result.
        loop {
            let (i, pending) = {
                let mut st = self.state();
                let waiting = st.reductions.iter().filter(|r| matches!(r.1, Flight::Waiting(_))).count();
                let oldest = st.reductions.iter().position(|r| matches!(r.1, Flight::Waiting(_)));
                match oldest {
                    Some(i) if waiting >= self.max_inflight => {
                        match std::mem::replace(&mut st.reductions[i].1, Flight::Done(None)) {
                            Flight::Waiting(p) => (i, p),
                            Flight::Done(_) => break,
                        }
                    }
                    _ => break,
                }
            };
            // Waited for without the state's lock; only this (compute) thread changes the list.
            let g = self.timed_wait(pending);
            if let Some(r) = self.state().reductions.get_mut(i) {
                r.1 = Flight::Done(g);
            }
        }
        let comm = comm.clone();
        let sync = comm.sync.load(Ordering::SeqCst);
        let in_flight = self.counters.reduce_scatters_in_flight.clone();
        let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.counters.max_reduce_scatters_in_flight.fetch_max(now, Ordering::Relaxed);
        let pending = self.worker.submit(move || {
            let g = comm.reduce_with(full_grad, sync);
            in_flight.fetch_sub(1, Ordering::SeqCst);
            match (deliver, g) {
                (Some(deliver), Some(g)) => {
                    deliver(g);
                    None
                }
                (_, g) => g,
            }
        });
        self.counters.async_reduce_scatters.fetch_add(1, Ordering::Relaxed);
        self.state().reductions.push((unit, Flight::Waiting(pending), targets));
    }

    fn result(&self, flight: Flight<B>) -> Option<Tensor<B, 1>> {
        match flight {
            Flight::Waiting(p) => self.timed_wait(p),
            Flight::Done(g) => g,
        }
    }

    /// The reduce-scatter of `unit`'s full gradient, waited for (after everything queued
    /// before it).
    pub(crate) fn reduce_blocking(
        &self,
        comm: &Arc<UnitComm<B>>,
        full_grad: Tensor<B, 1>,
    ) -> Option<Tensor<B, 1>> {
        let comm = comm.clone();
        let sync = comm.sync.load(Ordering::SeqCst);
        self.timed_wait(self.worker.submit(move || comm.reduce_with(full_grad, sync)))
    }

    /// Waits for every reduce-scatter in flight and returns the reduced shard gradients by
    /// unit (units without sync or offloaded ones have none), for a backward without the node
    /// that collects them (the segmented backward of activation checkpointing, whose blocks
    /// run again on copies of the shards: their pieces are registered by parameter id).
    pub(crate) fn finish_reductions(&self) -> Vec<(usize, Tensor<B, 1>)> {
        let pending = std::mem::take(&mut self.state().reductions);
        let out = pending.into_iter().filter_map(|(u, p, _)| self.result(p).map(|g| (u, g))).collect();
        self.end_backward();
        out
    }

    /// Reduce-scatters issued by backward passes and not collected yet.
    pub(crate) fn uncollected(&self) -> usize {
        self.state().reductions.len()
    }

    /// The last step of a backward pass: waits for every reduce-scatter in flight and
    /// registers each parameter's piece of the reduced shard gradients on its shard's node in
    /// `grads` (added to what is there, as Burn adds the uses of a tensor), so that the
    /// gradients are complete when `backward()` returns, however they are read.
    pub(crate) fn collect_into(&self, grads: &mut Gradients) {
        let pending = std::mem::take(&mut self.state().reductions);
        for (_, p, targets) in pending {
            if let Some(g) = self.result(p) {
                register_pieces(grads, g, targets);
            }
        }
        self.end_backward();
    }

    /// Backward is over: the saved shard references are released, so that the optimizer
    /// step's old shards are not kept alive until the next forward.
    fn end_backward(&self) {
        self.quiesce();
        let mut st = self.state();
        st.shards.iter_mut().for_each(|s| *s = None);
        st.ready[Pass::Backward as usize].clear();
    }
}

/// Registers each parameter's piece of a unit's reduced flat shard gradient `g` on its
/// shard's node (`targets` in unit order; `None` nodes need no gradient), added to what is
/// there.
pub(crate) fn register_pieces<B: Backend>(grads: &mut Gradients, g: Tensor<B, 1>, targets: Targets) {
    let mut offset = 0;
    for (node, shape, dtype) in targets.shards {
        let n = shape.num_elements();
        if let Some(node) = node {
            grads.register::<B>(node, piece(&g, offset, shape, dtype));
        }
        offset += n;
    }
    register_aliases(grads, &g, targets.aliases);
}

/// Registers each alias's piece of the reduced flat shard gradient `g` on the alias's node.
pub(crate) fn register_aliases<B: Backend>(grads: &mut Gradients, g: &Tensor<B, 1>, aliases: Vec<Alias>) {
    for (node, offset, shape, dtype) in aliases {
        grads.register::<B>(node, piece(g, offset, shape, dtype));
    }
}

/// The piece of `g` at `offset`, in `shape` and `dtype`.
fn piece<B: Backend>(g: &Tensor<B, 1>, offset: usize, shape: Shape, dtype: DType) -> B::FloatTensorPrimitive {
    let piece = g.clone().narrow(0, offset, shape.num_elements());
    let piece = if piece.dtype() == dtype { piece } else { piece.cast(dtype) };
    shard_shaped(piece, shape)
}

/// A piece of a flat gradient in its parameter's shape, sharing memory where it can.
fn shard_shaped<B: Backend>(piece: Tensor<B, 1>, shape: Shape) -> B::FloatTensorPrimitive {
    macro_rules! to {
        ($($d:literal)*) => {
            match shape.num_dims() {
                $($d => crate::downcast::reshape_shared::<B, $d>(piece, shape).into_primitive().tensor(),)*
                _ => B::float_reshape(piece.into_primitive().tensor(), shape),
            }
        };
    }
    to!(1 2 3 4 5 6)
}
