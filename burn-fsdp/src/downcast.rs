//! Moving a backend's tensor primitive into its concrete type (and back), for the host paths
//! that work on the CPU backends' memory directly.

use std::any::Any;

/// `value` as type `T` when it is one (moved, not copied); else `value` back.
pub(crate) fn cast<S: 'static, T: 'static>(value: S) -> Result<T, S> {
    let mut slot = Some(value);
    match (&mut slot as &mut dyn Any).downcast_mut::<Option<T>>() {
        Some(t) => Ok(t.take().expect("the slot was just filled")),
        None => Err(slot.expect("the slot is still filled")),
    }
}

/// `value` as type `T`, which the caller has checked it is.
pub(crate) fn must<S: 'static, T: 'static>(value: S, checked: &str) -> T {
    match cast(value) {
        Ok(t) => t,
        Err(_) => unreachable!("{checked}"),
    }
}
