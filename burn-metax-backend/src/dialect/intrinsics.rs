//! MACA header, type and intrinsic names used by [`super::MacaDialect`], with provenance.
//!
//! No MACA header is public. "Verified" means the name, used the same way, appears in public
//! MetaX sources (found with code search; see the crate README for the list). "Assumed" means
//! taken from the CUDA analogue (MACA mirrors the CUDA device API) and still to be checked
//! against the SDK's headers on a real machine.

/// Runtime header candidates, first match wins (`__has_include`).
///
/// Verified: `#include <mcr/mc_runtime.h>` (mcTriton's generated launcher, MetaX mcFlashAttn
/// headers) and `#include <mc_runtime.h>` (MetaX `maca-samples` with `include/mcr` on the
/// include path). MetaX's `vectorAdd_mcrtc` sample compiles a kernel with `mcrtc` without
/// including anything, so the include is optional.
pub const RUNTIME_HEADER: &[&str] = &["mcr/mc_runtime.h", "mc_runtime.h"];

/// f16 header candidates. Verified: `common/maca_fp16.h` and `maca_fp16.h` (MetaX ports of
/// vLLM/InfiniCore/llaisys include one or the other, depending on the include path).
pub const F16_HEADER: &[&str] = &["common/maca_fp16.h", "maca_fp16.h"];

/// bf16 header candidates. Verified: `common/maca_bfloat16.h`, `maca_bfloat16.h`.
pub const BF16_HEADER: &[&str] = &["common/maca_bfloat16.h", "maca_bfloat16.h"];

/// f16 type. Verified: `__half` (MetaX kernels use `__half` with `maca_fp16.h`).
pub const F16_TYPE: &str = "__half";
/// Packed f16 pair. Assumed (`__half2`, as CUDA); unused while packed halves are disabled.
pub const F16X2_TYPE: &str = "__half2";
/// bf16 type. Verified: `__maca_bfloat16` (MetaX's CUTLASS shim typedefs `__nv_bfloat16` to it).
pub const BF16_TYPE: &str = "__maca_bfloat16";
/// Packed bf16 pair. Verified: `__maca_bfloat162` (same shim); unused while packed halves are
/// disabled.
pub const BF16X2_TYPE: &str = "__maca_bfloat162";

/// Full 64-lane member mask. Verified spelling: MetaX-modified kernels write the unsuffixed
/// literal (type `unsigned long`, i.e. `uint64_t`), which selects MACA's 64-bit overloads; a
/// 32-bit literal such as `0xFFFFFFFF` is ambiguous between the 32- and 64-bit overloads.
pub const FULL_WAVE_MASK: &str = "0xffffffffffffffff";

/// Verified: `__shfl_xor_sync(0xffffffffffffffff, v, offset, 64)` in MetaX-modified kernels
/// (`__MACACC__` softmax path).
pub const SHFL_XOR_SYNC: &str = "__shfl_xor_sync";
/// Verified in third-party MACA code (YiRage MACA backend, 64-bit mask): `__shfl_sync`.
pub const SHFL_SYNC: &str = "__shfl_sync";
/// Verified in third-party MACA code (YiRage, llaisys MetaX ops): `__shfl_down_sync`.
pub const SHFL_DOWN_SYNC: &str = "__shfl_down_sync";
/// Assumed (CUDA name with a 64-bit mask): `__shfl_up_sync`.
pub const SHFL_UP_SYNC: &str = "__shfl_up_sync";
/// `__ballot_sync(mask64, pred)` returning a 64-bit mask. Verified as far as public porting
/// notes for MACA go (`__ballot_sync(0xFFFFFFFFFFFFFFFFULL, p)`); the return type is taken as
/// 64-bit and always widened through `uint64(...)`.
pub const BALLOT_SYNC: &str = "__ballot_sync";
/// `__all_sync(mask64, pred)`. Assumed (named with a 64-bit mask in MACA porting notes).
pub const WAVE_ALL_SYNC: &str = "__all_sync";
/// `__any_sync(mask64, pred)`. Assumed (named with a 64-bit mask in MACA porting notes).
pub const WAVE_ANY_SYNC: &str = "__any_sync";
/// Lane index in the wave. Verified: `__lane_id()` (MetaX's mctlass `LaneId()` under
/// `__MACA__`).
pub const LANE_ID: &str = "__lane_id()";

/// Other names the generated code relies on, all assumed identical to CUDA: `__syncthreads`,
/// `__syncwarp`, `__threadfence`, `__ffs`/`__ffsll`, `__clz`/`__clzll`, `__popc`/`__popcll`,
/// `__brev`/`__brevll`, `atomicAdd`/`atomicCAS`/…, `__launch_bounds__`, `__align__`,
/// `extern __shared__`, `__builtin_unreachable`. `__syncthreads`, `__launch_bounds__`,
/// `extern __shared__ __align__(…)`, `__threadfence` and `atomicAdd` appear in MetaX-modified
/// kernels compiled for MACA.
pub const CUDA_LIKE_BUILTINS: &[&str] = &[
    "__syncthreads",
    "__syncwarp",
    "__threadfence",
    "__ffs",
    "__ffsll",
    "__clz",
    "__clzll",
    "__popc",
    "__popcll",
    "__brev",
    "__brevll",
    "__launch_bounds__",
    "__align__",
    "__builtin_unreachable",
];
