//! The forward scope: how a block the model marks as a unit ([`crate::FsdpUnit`]) finds the
//! FSDP forward running on its thread, so that the model's forward keeps its own signature.
//!
//! [`Fsdp::forward`](crate::Fsdp::forward) and [`Fsdp::forward_valid`](crate::Fsdp::forward_valid)
//! install their runner here (type-erased, per thread) for as long as the model's forward runs;
//! [`FsdpUnit::run`](crate::FsdpUnit::run) looks it up and, when one is installed for its
//! backend, runs its block through it exactly as an explicit [`UnitRunner`](crate::UnitRunner)
//! would. Outside an FSDP forward (single-device code) it calls the block directly.
//!
//! The same file holds the second thread-local of the mechanism: while [`Fsdp::wrap`]
//! describes the model, each `FsdpUnit` it visits tells which parameters it holds
//! ([`discover_units`]).

use std::any::TypeId;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::fsdp::MixedPrecisionPolicy;

/// The views of one gathered unit's parameters, by id (`None` for a parameter of another unit).
pub(crate) type Views<'a, X> = Box<dyn FnMut(ParamId) -> Option<FloatTensor<X>> + 'a>;

/// What a forward's runner does for one block, without knowing the block's type: the generic
/// half (collecting the block's shards, mapping its parameters to views) is [`run_unit`].
pub(crate) trait UnitHost<X: Backend> {
    /// The unit that holds the parameters `ids` (marked as run), or `None` when the block runs
    /// as it is (no sharded parameter, world size 1, or the root unit, gathered already).
    fn enter(&self, ids: &[ParamId]) -> Option<usize>;
    /// All-gathers unit `u` from the block's `shards`; `anchor` is the block's input.
    fn gather(
        &self,
        u: usize,
        shards: &HashMap<ParamId, FloatTensor<X>>,
        anchor: FloatTensor<X>,
    ) -> Views<'_, X>;
    /// The mixed-precision policy (input and output casts).
    fn policy(&self) -> MixedPrecisionPolicy;
}

/// Runs block `unit` on `x` through `host`: gathers its unit, casts `x` to the compute dtype,
/// calls `f` on the gathered view and casts the output.
pub(crate) fn run_unit<X: Backend, U: Module<X>, const D: usize>(
    host: &dyn UnitHost<X>,
    unit: &U,
    x: Tensor<X, D>,
    f: impl FnOnce(&U, Tensor<X, D>) -> Tensor<X, D>,
) -> Tensor<X, D> {
    struct Shards<X: Backend>(Vec<ParamId>, HashMap<ParamId, FloatTensor<X>>);
    impl<X: Backend> ModuleVisitor<X> for Shards<X> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<X, D>>) {
            self.0.push(param.id);
            self.1.insert(param.id, param.val().into_primitive().tensor());
        }
    }
    let mut shards = Shards(Vec::new(), HashMap::new());
    unit.visit(&mut shards);
    // A block inside a block that is running gathered (an `FsdpUnit` or `Direct` call inside
    // an explicit runner's block): its parameters are views already.
    if inside_gathered(&shards.0) {
        return f(unit, x);
    }
    let Some(u) = host.enter(&shards.0) else { return f(unit, x) };
    let anchor = x.clone().into_primitive().tensor();
    let view = {
        let views = host.gather(u, &shards.1, anchor);
        unit.clone().map(&mut ByView(views))
    };
    let _gathered = Gathered::push(shards.0);
    let policy = host.policy();
    let x = match policy.param_dtype {
        Some(dt) if x.dtype() != dt => x.cast(dt),
        _ => x,
    };
    let y = f(&view, x);
    match policy.output_dtype {
        Some(dt) if y.dtype() != dt => y.cast(dt),
        _ => y,
    }
}

thread_local! {
    /// The parameter ids of the blocks running gathered on this thread, innermost last.
    static GATHERED: RefCell<Vec<Vec<ParamId>>> = const { RefCell::new(Vec::new()) };
}

fn inside_gathered(ids: &[ParamId]) -> bool {
    !ids.is_empty() && GATHERED.with(|g| g.borrow().iter().any(|set| ids.iter().all(|id| set.contains(id))))
}

/// A block running gathered, until dropped (unwinding included).
struct Gathered;

impl Gathered {
    fn push(ids: Vec<ParamId>) -> Self {
        GATHERED.with(|g| g.borrow_mut().push(ids));
        Gathered
    }
}

impl Drop for Gathered {
    fn drop(&mut self) {
        GATHERED.with(|g| {
            g.borrow_mut().pop();
        });
    }
}

/// Replaces each parameter that has a view by it.
struct ByView<'a, X: Backend>(Views<'a, X>);

impl<X: Backend> ModuleMapper<X> for ByView<'_, X> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<X, D>>) -> Param<Tensor<X, D>> {
        let (id, tensor, mapper) = param.consume();
        match (self.0)(id) {
            Some(full) => {
                Param::from_mapped_value(id, Tensor::from_primitive(TensorPrimitive::Float(full)), mapper)
            }
            None => Param::from_mapped_value(id, tensor, mapper),
        }
    }
}

/// The runner installed on this thread: its backend and a pointer to a `&dyn UnitHost<X>`.
#[derive(Clone, Copy)]
struct Installed {
    backend: TypeId,
    host: *const (),
}

thread_local! {
    static CURRENT: Cell<Option<Installed>> = const { Cell::new(None) };
}

/// Uninstalls on drop (also when the forward unwinds), restoring what was there before.
pub(crate) struct ScopeGuard {
    previous: Option<Installed>,
}

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.previous));
    }
}

/// Installs `host` as this thread's runner for backend `X` until the guard drops.
///
/// The guard must drop before `host` does: callers keep both on their stack, the guard
/// declared after the host (so dropped first, unwinding included).
pub(crate) fn install<X: Backend>(host: &&dyn UnitHost<X>) -> ScopeGuard {
    let installed =
        Installed { backend: TypeId::of::<X>(), host: host as *const &dyn UnitHost<X> as *const () };
    ScopeGuard { previous: CURRENT.with(|c| c.replace(Some(installed))) }
}

/// Calls `f` with this thread's runner for backend `X`, if an FSDP forward on `X` is running.
pub(crate) fn with_host<X: Backend, R>(f: impl FnOnce(Option<&dyn UnitHost<X>>) -> R) -> R {
    match CURRENT.with(Cell::get) {
        Some(Installed { backend, host }) if backend == TypeId::of::<X>() => {
            // SAFETY: `host` was made by `install::<X>` from a `&&dyn UnitHost<X>` (the
            // backend's `TypeId` matches), and it is installed only while its `ScopeGuard`
            // lives, which drops before the host it points to (see `install`). Everything
            // runs on this thread (a thread-local), and the host is only read (`&`).
            let host: &&dyn UnitHost<X> = unsafe { &*(host as *const &dyn UnitHost<X>) };
            f(Some(*host))
        }
        _ => f(None),
    }
}

/// While `Fsdp::wrap` describes a model: the units met so far and the innermost one entered.
struct Discovery {
    next: usize,
    stack: Vec<usize>,
}

thread_local! {
    static DISCOVERY: RefCell<Option<Discovery>> = const { RefCell::new(None) };
}

/// Called by `FsdpUnit::visit` around its module's visit: while units are being discovered,
/// the parameters visited meanwhile belong to a new unit.
pub(crate) fn visit_marked(visit: impl FnOnce()) {
    let entered = DISCOVERY.with(|d| {
        d.borrow_mut().as_mut().map(|d| {
            d.next += 1;
            d.stack.push(d.next);
        })
    });
    visit();
    if entered.is_some() {
        DISCOVERY.with(|d| {
            if let Some(d) = d.borrow_mut().as_mut() {
                d.stack.pop();
            }
        });
    }
}

/// The marked unit (numbered from 1 in visiting order) of every parameter of `module` that is
/// inside an [`FsdpUnit`](crate::FsdpUnit) (the innermost one), with that unit's path.
pub(crate) fn discover_units<B: Backend, M: Module<B>>(module: &M) -> HashMap<ParamId, (usize, String)> {
    struct Find {
        path: crate::walk::PathStack,
        found: HashMap<ParamId, (usize, String)>,
        /// The path of each unit: the common prefix of its parameters' module paths.
        prefix: HashMap<usize, Vec<String>>,
    }
    impl<B: Backend> ModuleVisitor<B> for Find {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let Some(unit) = DISCOVERY.with(|d| d.borrow().as_ref().and_then(|d| d.stack.last().copied()))
            else {
                return;
            };
            // The module holding the parameter (its path without the parameter's own name).
            let segments = self.path.segments();
            let module: Vec<String> = segments[..segments.len().saturating_sub(1)].to_vec();
            let prefix = self.prefix.entry(unit).or_insert_with(|| module.clone());
            let common = prefix.iter().zip(&module).take_while(|(a, b)| a == b).count();
            prefix.truncate(common);
            self.found.insert(param.id, (unit, String::new()));
        }
    }
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            DISCOVERY.with(|d| *d.borrow_mut() = None);
        }
    }
    DISCOVERY.with(|d| *d.borrow_mut() = Some(Discovery { next: 0, stack: Vec::new() }));
    let _reset = Reset;
    let mut find =
        Find { path: crate::walk::PathStack::default(), found: HashMap::new(), prefix: HashMap::new() };
    module.visit(&mut find);
    let Find { mut found, prefix, .. } = find;
    for (unit, name) in found.values_mut() {
        *name = prefix.get(unit).map(|p| p.join(".")).unwrap_or_default();
    }
    found
}
