//! Qwen3's parallelisation plan, kept beside the model as torchtitan keeps
//! `models/<name>/parallelize`: which parameters form FSDP units and how tensor parallelism
//! splits each decoder layer. The model ([`crate::model`]) knows nothing of it; the plan is
//! applied from outside, by [`burn_fsdp::Fsdp::wrap`] and
//! [`burn_fsdp::tp::TensorParallel::apply`].
//!
//! ```
//! use qwen3_burn::{Qwen3Config, parallelize};
//!
//! let config = Qwen3Config::tiny();
//! parallelize::check_tp(&config, 2).expect("tiny Qwen3 splits over 2 ranks");
//! let plan = parallelize::tp_plan(&config);
//! assert_eq!(plan.params.len(), 9);
//! ```

use burn_fsdp::UnitPolicy;
use burn_fsdp::tp::TpPlan;
use burn_fsdp::tp::TpStyle::{Colwise, PartialGrad, Rowwise};

use crate::Qwen3Config;

/// Qwen3's FSDP units: one per decoder layer (`model.layers.N`, every element of the layers'
/// `Vec`), and the root unit for the embedding, the final norm and an untied head.
pub fn fsdp_units() -> UnitPolicy {
    UnitPolicy::VecElements
}

/// Qwen3's tensor-parallel plan: q/k/v and gate/up column-parallel (whole heads per rank),
/// o and down row-parallel with an all-reduce of their output, the per-head q/k norms
/// replicated with summed gradients; the embedding, final norm and head replicated.
pub fn tp_plan(c: &Qwen3Config) -> TpPlan {
    let hd = c.head_dim;
    let layer = |s: &str| format!("model.layers.*.{s}.weight");
    TpPlan {
        params: vec![
            (layer("self_attn.q_proj"), Colwise { granule: hd }),
            (layer("self_attn.k_proj"), Colwise { granule: hd }),
            (layer("self_attn.v_proj"), Colwise { granule: hd }),
            (layer("self_attn.o_proj"), Rowwise { granule: hd }),
            (layer("self_attn.q_norm"), PartialGrad),
            (layer("self_attn.k_norm"), PartialGrad),
            (layer("mlp.gate_proj"), Colwise { granule: 1 }),
            (layer("mlp.up_proj"), Colwise { granule: 1 }),
            (layer("mlp.down_proj"), Rowwise { granule: 1 }),
        ],
        copy_inputs: vec!["self_attn".into(), "mlp".into()],
        reduce_outputs: vec!["self_attn".into(), "mlp".into()],
    }
}

/// Why a model cannot be split over `tp` tensor-parallel ranks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TpSplitError {
    /// The query or key/value heads do not divide among the ranks.
    #[error(
        "the model has {heads} query heads and {kv_heads} key/value heads; tensor parallelism needs both divisible by tp = {tp}"
    )]
    Heads {
        /// `num_attention_heads`.
        heads: usize,
        /// `num_key_value_heads`.
        kv_heads: usize,
        /// The tensor-parallel degree.
        tp: usize,
    },
    /// The MLP's width does not divide among the ranks.
    #[error("the MLP width {width} (intermediate_size) is not divisible by tp = {tp}")]
    MlpWidth {
        /// `intermediate_size`.
        width: usize,
        /// The tensor-parallel degree.
        tp: usize,
    },
}

/// Whether [`tp_plan`] can split `c` over `tp` ranks: whole query and key/value heads, and the
/// MLP's width, per rank.
pub fn check_tp(c: &Qwen3Config, tp: usize) -> Result<(), TpSplitError> {
    let (heads, kv_heads) = (c.num_attention_heads, c.num_key_value_heads);
    if !heads.is_multiple_of(tp) || !kv_heads.is_multiple_of(tp) {
        return Err(TpSplitError::Heads { heads, kv_heads, tp });
    }
    if !c.intermediate_size.is_multiple_of(tp) {
        return Err(TpSplitError::MlpWidth { width: c.intermediate_size, tp });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_need_whole_heads_and_an_even_mlp() {
        let mut c = Qwen3Config::tiny();
        (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size) = (6, 2, 100);
        assert_eq!(check_tp(&c, 2), Ok(()));
        assert_eq!(check_tp(&c, 3), Err(TpSplitError::Heads { heads: 6, kv_heads: 2, tp: 3 }));
        c.intermediate_size = 101;
        assert_eq!(check_tp(&c, 2), Err(TpSplitError::MlpWidth { width: 101, tp: 2 }));
    }
}
