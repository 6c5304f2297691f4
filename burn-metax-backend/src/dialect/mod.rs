//! The MACA dialect for cubecl-cpp: turns CubeCL kernels into MACA C++ source (issue #6).
//!
//! MetaX GPUs (C500 class) run 64-lane waves. Everything in this dialect that touches a wave
//! is written for 64 lanes:
//!
//! * shuffles are `__shfl_*_sync(0xffffffffffffffff, value, lane, 64)` (64-bit member mask,
//!   explicit width 64);
//! * `__ballot_sync` returns a 64-bit mask, written into **two** `u32` lanes of CubeCL's
//!   `plane_ballot` result (lanes 0–31 in component 0, lanes 32–63 in component 1) instead of
//!   the shared 32-bit `{ ballot, 0, 0, 0 }` form;
//! * `plane_elect` uses this dialect's own [`DialectInstructions::compile_warp_elect`]
//!   (the compilation options set `elect_sync`), never the shared `__activemask()` fallback;
//! * the plane size builtin is the compile-time constant `MACA_WARP_SIZE` (64).
//!
//! No inline assembly is emitted and no matrix (MMA/WMMA) instruction is supported: the MMA
//! hooks emit `#error` and report no supported combination.
//!
//! The intrinsic and header names used are listed in [`intrinsics`] with their provenance
//! (verified against public MetaX sources, or assumed from the CUDA/HIP analogue).

mod compile;
pub mod intrinsics;

pub use compile::{MACA_WARP_SIZE, MacaCompileError, compile_kernel_source, maca_compilation_options};

use std::collections::HashSet;
use std::fmt::{Display, Formatter, Result as FmtResult};

use cubecl_core::ir::Processor;
use cubecl_core::post_processing::saturating::SaturatingArithmeticProcessor;
use cubecl_cpp::shared::{
    self, Architecture, Body, Component, Dialect, DialectBindings, DialectCubeBuiltins, DialectIncludes,
    DialectInstructions, DialectProcessors, DialectTypes, DialectWarpReduceCompiler, DialectWmmaCompiler,
    Elem, Flags, Instruction, Item, KernelArg, ManualMma, SupportedMmaCombinations, Variable,
    WarpInstruction, WmmaInstruction,
};

use intrinsics::{
    BALLOT_SYNC, BF16_HEADER, BF16_TYPE, BF16X2_TYPE, F16_HEADER, F16_TYPE, F16X2_TYPE, FULL_WAVE_MASK,
    LANE_ID, RUNTIME_HEADER, SHFL_DOWN_SYNC, SHFL_SYNC, SHFL_UP_SYNC, SHFL_XOR_SYNC, WAVE_ALL_SYNC,
    WAVE_ANY_SYNC,
};

/// The cubecl-cpp dialect for MetaX GPUs (MACA), wave size 64.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MacaDialect;

/// The MetaX architecture as cubecl-cpp sees it: 64-lane waves, no WMMA/MFMA path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MacaArchitecture;

impl Architecture for MacaArchitecture {
    fn warp_size(&self) -> u32 {
        MACA_WARP_SIZE
    }

    fn is_wmma_capable(&self) -> bool {
        false
    }

    fn is_mfma_capable(&self) -> bool {
        false
    }
}

/// Code snippets the MACA dialect can add to a kernel's preamble.
///
/// Today every helper the dialect needs is emitted from the kernel flags (see
/// `compile_polyfills`), so no instruction registers one; the enum exists because
/// cubecl-cpp's own `Extension` enums (CUDA's, HIP's) cannot be named from outside that crate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Extension {
    /// Nothing to add.
    #[default]
    None,
}

/// Name of the half-precision `max` helper emitted in the preamble (f16 and bf16 overloads).
const HALF_MAX: &str = "maca_half_max";
/// Name of the half-precision `min` helper emitted in the preamble (f16 and bf16 overloads).
const HALF_MIN: &str = "maca_half_min";

/// The vector width of an item. `Item`'s fields are private to cubecl-cpp, so the width is
/// derived from the sizes.
fn vector_width(item: &Item<MacaDialect>) -> usize {
    item.size().checked_div(item.elem().size()).map_or(1, |width| width.max(1))
}

/// Whether an item uses the native vector type (`float4`) rather than a generated struct.
fn is_native(item: &Item<MacaDialect>) -> bool {
    *item == Item::new(*item.elem(), vector_width(item), true)
}

impl Dialect for MacaDialect {
    type Architecture = MacaArchitecture;
}

// The default warp-reduce helpers (butterfly over `warpSizeChecked` with
// `compile_warp_shuffle_xor`) are correct for 64 lanes once the shuffle is.
impl DialectWarpReduceCompiler<Self> for MacaDialect {}

impl DialectIncludes<Self> for MacaDialect {
    type Extension = Extension;

    fn compile_includes(f: &mut Formatter<'_>, flags: &Flags<Self>) -> FmtResult {
        // mcrtc compiles kernels without any include (MetaX's vectorAdd_mcrtc sample), so the
        // runtime header is included only where the include path provides it.
        write_optional_include(f, RUNTIME_HEADER)?;
        if flags.elem_f16 {
            write_optional_include(f, F16_HEADER)?;
        }
        if flags.elem_bf16 {
            write_optional_include(f, BF16_HEADER)?;
        }
        if flags.elem_fp4 || flags.elem_fp6 || flags.elem_fp8 {
            f.write_str("#error FP4/FP6/FP8 are not supported by the MACA dialect\n")?;
        }
        if flags.elem_tf32 || flags.inst_wmma {
            f.write_str("#error matrix instructions are not supported by the MACA dialect\n")?;
        }
        if flags.op_barrier || flags.op_pipeline || flags.inst_tma || flags.inst_async_copy {
            f.write_str("#error barriers, pipelines and TMA copies are not supported by the MACA dialect\n")?;
        }
        Ok(())
    }

    fn compile_extensions(f: &mut Formatter<'_>, extensions: &[Self::Extension]) -> FmtResult {
        for extension in extensions {
            match extension {
                Extension::None => {}
            }
        }
        let _ = f;
        Ok(())
    }

    fn register_instruction_extension(
        _extensions: &mut Vec<Self::Extension>,
        _instruction: &Instruction<Self>,
    ) {
    }

    fn register_warp_instruction_extension(
        _extensions: &mut Vec<Self::Extension>,
        _instruction: &WarpInstruction<Self>,
    ) {
    }
}

/// `#include <header>` when the include path has it (`__has_include`), nothing otherwise.
fn write_optional_include(f: &mut Formatter<'_>, header: &[&str]) -> FmtResult {
    for (i, name) in header.iter().enumerate() {
        let keyword = if i == 0 { "#if" } else { "#elif" };
        writeln!(f, "{keyword} __has_include(<{name}>)\n#include <{name}>")?;
    }
    writeln!(f, "#endif")
}

impl DialectTypes<Self> for MacaDialect {
    fn item_can_be_optimized() -> bool {
        // No packed half2/bfloat162 arithmetic: every half value is handled one at a time.
        false
    }

    fn compile_elem(f: &mut Formatter<'_>, elem: &Elem<Self>, word: bool) -> FmtResult {
        if word {
            // The word form names native vector types (`float4`, `uint2`).
            let name = match elem {
                Elem::F32 | Elem::TF32 => "float",
                Elem::F64 => "double",
                Elem::I8 => "char",
                Elem::I16 => "short",
                Elem::I32 => "int",
                Elem::I64 => "longlong",
                Elem::U8 => "uchar",
                Elem::U16 => "ushort",
                Elem::U32 => "uint",
                Elem::U64 => "ulonglong",
                _ => return Self::compile_elem(f, elem, false),
            };
            return f.write_str(name);
        }
        match elem {
            Elem::FP4(_) | Elem::FP4x2(_) | Elem::FP6(_) | Elem::FP6x2(_) | Elem::FP8(_) | Elem::FP8x2(_) => {
                f.write_str("#error FP4/FP6/FP8 are not supported on MACA\n")
            }
            Elem::F16 => f.write_str(F16_TYPE),
            Elem::F16x2 => f.write_str(F16X2_TYPE),
            Elem::BF16 => f.write_str(BF16_TYPE),
            Elem::BF16x2 => f.write_str(BF16X2_TYPE),
            Elem::F32 | Elem::TF32 => f.write_str("float"),
            Elem::F64 => f.write_str("double"),
            Elem::I8 => f.write_str("int8"),
            Elem::I16 => f.write_str("int16"),
            Elem::I32 => f.write_str("int32"),
            Elem::I64 => f.write_str("int64"),
            Elem::U8 => f.write_str("uint8"),
            Elem::U16 => f.write_str("uint16"),
            Elem::U32 => f.write_str("uint32"),
            Elem::U64 => f.write_str("uint64"),
            Elem::Bool => f.write_str("bool"),
            Elem::Barrier(_) => f.write_str("#error barriers are not supported on MACA\n"),
            Elem::Atomic(inner) => Self::compile_atomic_kind(f, inner),
            Elem::_Dialect(_) => Ok(()),
        }
    }

    fn compile_item(f: &mut Formatter<'_>, item: &Item<Self>) -> FmtResult {
        let width = vector_width(item);
        if width == 1 {
            return write!(f, "{}", item.elem());
        }
        if is_native(item) {
            Self::compile_elem(f, item.elem(), true)?;
            write!(f, "{width}")
        } else {
            write!(f, "{}_{width}", item.elem())
        }
    }

    fn compile_type_definitions(
        f: &mut Formatter<'_>,
        items: &HashSet<Item<Self>>,
        scalars: &[(Elem<Self>, usize)],
        info: &cubecl_core::Info,
        flags: &Flags<Self>,
    ) -> FmtResult {
        shared::type_definitions::<Self>(f)?;
        // The plane size is a compile-time constant: MetaX waves have 64 lanes.
        writeln!(f, "static constexpr uint32 MACA_WARP_SIZE = {MACA_WARP_SIZE}u;")?;
        shared::type_vectorized_definitions::<Self>(f, items)?;
        shared::type_info_definition_sized(f, info, scalars, flags.address_type)
    }

    fn compile_polyfills(f: &mut Formatter<'_>, flags: &Flags<Self>) -> FmtResult {
        // max/min on half types go through float: no assumption about `__hmax` on MACA.
        let mut half_types = Vec::new();
        if flags.elem_f16 {
            half_types.push(F16_TYPE);
        }
        if flags.elem_bf16 {
            half_types.push(BF16_TYPE);
        }
        for ty in half_types {
            writeln!(
                f,
                "__device__ inline {ty} {HALF_MAX}({ty} a, {ty} b) {{ return {ty}(fmaxf(float(a), float(b))); }}"
            )?;
            writeln!(
                f,
                "__device__ inline {ty} {HALF_MIN}({ty} a, {ty} b) {{ return {ty}(fminf(float(a), float(b))); }}"
            )?;
        }
        Ok(())
    }

    fn compile_local_memory_qualifier(_f: &mut Formatter<'_>) -> FmtResult {
        Ok(())
    }
}

impl DialectBindings<Self> for MacaDialect {
    fn compile_kernel_signature(
        f: &mut Formatter<'_>,
        kernel_name: &str,
        tensor_maps: &[KernelArg<Self>],
        buffers: &[KernelArg<Self>],
        flags: &Flags<Self>,
    ) -> FmtResult {
        write!(
            f,
            "\n\nextern \"C\" __global__ void __launch_bounds__({}) {kernel_name}(\n",
            flags.cube_dim.num_elems()
        )?;
        shared::compile_bindings::<Self>(f, tensor_maps, buffers, flags.has_info)?;
        // The info struct travels by pointer (no `__grid_constant__` on MACA).
        shared::compile_info_dynamic::<Self>(f, flags)?;
        f.write_str("\n)")
    }

    fn compile_bindings_body(f: &mut Formatter<'_>, body: &Body<Self>) -> FmtResult {
        if let Some(align) = body.shared_memories.iter().map(|smem| smem.align()).max() {
            writeln!(f, "extern __shared__ __align__({align}) uint8 dynamic_shared_mem[];")?;
        }
        if body.info_by_ptr {
            f.write_str("const info_st& info = *info_ptr;\n")?;
            writeln!(
                f,
                "const {addr}* dynamic_meta = reinterpret_cast<const {addr}*>(\n    reinterpret_cast<const char*>(info_ptr) + sizeof(info_st)\n);",
                addr = body.address_type,
            )?;
        }
        Ok(())
    }
}

impl DialectCubeBuiltins<Self> for MacaDialect {
    fn compile_plane_dim(f: &mut Formatter<'_>) -> FmtResult {
        f.write_str("MACA_WARP_SIZE")
    }
}

/// Writes a shuffle of `var` (of element type `elem`) through `intrinsic` with the full
/// 64-bit mask and width 64. Half types travel as `float` so that only the `float` overload
/// of the intrinsic is relied upon.
fn write_shuffle(
    f: &mut Formatter<'_>,
    intrinsic: &str,
    var: &str,
    elem: Option<&Elem<MacaDialect>>,
    lane: &str,
) -> FmtResult {
    match elem {
        Some(half @ (Elem::F16 | Elem::BF16)) => {
            write!(f, "{half}({intrinsic}({FULL_WAVE_MASK}, float({var}), {lane}, {MACA_WARP_SIZE}))")
        }
        _ => write!(f, "{intrinsic}({FULL_WAVE_MASK}, {var}, {lane}, {MACA_WARP_SIZE})"),
    }
}

impl DialectInstructions<Self> for MacaDialect {
    fn compile_instruction_sync_threads(f: &mut Formatter<'_>) -> FmtResult {
        writeln!(f, "__syncthreads();")
    }

    fn compile_instruction_sync_warp(f: &mut Formatter<'_>) -> FmtResult {
        writeln!(f, "__syncwarp();")
    }

    fn compile_instruction_thread_fence(f: &mut Formatter<'_>) -> FmtResult {
        writeln!(f, "__threadfence();")
    }

    fn compile_instruction_find_first_set<T: Component<Self>>(
        f: &mut Formatter<'_>,
        input: T,
        out_elem: Elem<Self>,
    ) -> FmtResult {
        match input.elem() {
            Elem::I32 | Elem::U32 => write!(f, "{out_elem}(__ffs({input}))"),
            Elem::I64 | Elem::U64 => write!(f, "{out_elem}(__ffsll({input}))"),
            _ => write!(f, "{out_elem}(__ffs({}({input})))", Elem::<Self>::U32),
        }
    }

    fn compile_instruction_leading_zeros_scalar<T: Component<Self>>(
        f: &mut Formatter<'_>,
        input: T,
        out_elem: Elem<Self>,
    ) -> FmtResult {
        match input.elem() {
            Elem::I32 | Elem::U32 => write!(f, "{out_elem}(__clz({input}))"),
            Elem::I64 | Elem::U64 => write!(f, "{out_elem}(__clzll({input}))"),
            in_elem => write!(
                f,
                "{out_elem}(__clz({}) - {})",
                shared::unary::zero_extend(input),
                (size_of::<u32>().saturating_sub(in_elem.size())) * 8
            ),
        }
    }

    fn compile_instruction_trailing_zeros_scalar<T: Component<Self>>(
        f: &mut Formatter<'_>,
        input: T,
        out_elem: Elem<Self>,
    ) -> FmtResult {
        match input.elem() {
            Elem::I32 | Elem::U32 => {
                write!(f, "{out_elem}({input} == 0 ? 32 : __ffs({input}) - 1)")
            }
            Elem::I64 | Elem::U64 => {
                write!(f, "{out_elem}({input} == 0 ? 64 : __ffsll({input}) - 1)")
            }
            in_elem => {
                let bits = in_elem.size() * 8;
                let wide = shared::unary::zero_extend(input);
                write!(f, "{out_elem}({wide} == 0 ? {bits} : __ffs({wide}) - 1)")
            }
        }
    }

    fn compile_saturating_add(
        f: &mut Formatter<'_>,
        _lhs: impl Display,
        _rhs: impl Display,
        _item: Item<Self>,
    ) -> FmtResult {
        // `SaturatingArithmeticProcessor` (see `processors`) rewrites these before codegen.
        f.write_str("#error saturating add must be lowered before MACA codegen\n")
    }

    fn compile_saturating_sub(
        f: &mut Formatter<'_>,
        _lhs: impl Display,
        _rhs: impl Display,
        _item: Item<Self>,
    ) -> FmtResult {
        f.write_str("#error saturating sub must be lowered before MACA codegen\n")
    }

    fn compile_instruction_max_function_name(f: &mut Formatter<'_>, item: Item<Self>) -> FmtResult {
        match item.elem() {
            Elem::F16 | Elem::BF16 => f.write_str(HALF_MAX),
            _ => f.write_str("max"),
        }
    }

    fn compile_instruction_min_function_name(f: &mut Formatter<'_>, item: Item<Self>) -> FmtResult {
        match item.elem() {
            Elem::F16 | Elem::BF16 => f.write_str(HALF_MIN),
            _ => f.write_str("min"),
        }
    }

    fn compile_warp_shuffle(f: &mut Formatter<'_>, var: &str, source: &str) -> FmtResult {
        write_shuffle(f, SHFL_SYNC, var, None, source)
    }

    fn compile_warp_shuffle_xor(
        f: &mut Formatter<'_>,
        var: &str,
        elem: &Elem<Self>,
        offset: &str,
    ) -> FmtResult {
        write_shuffle(f, SHFL_XOR_SYNC, var, Some(elem), offset)
    }

    fn compile_warp_shuffle_up(f: &mut Formatter<'_>, var: &str, offset: &str) -> FmtResult {
        write_shuffle(f, SHFL_UP_SYNC, var, None, offset)
    }

    fn compile_warp_shuffle_down(f: &mut Formatter<'_>, var: &str, offset: &str) -> FmtResult {
        write_shuffle(f, SHFL_DOWN_SYNC, var, None, offset)
    }

    fn compile_warp_all<T: Component<Self>>(f: &mut Formatter<'_>, input: &T) -> FmtResult {
        let item = input.item();
        let elem = item.elem();
        write!(f, "static_cast<{elem}>({WAVE_ALL_SYNC}({FULL_WAVE_MASK}, {input}))")
    }

    fn compile_warp_any<T: Component<Self>>(f: &mut Formatter<'_>, input: &T) -> FmtResult {
        let item = input.item();
        let elem = item.elem();
        write!(f, "static_cast<{elem}>({WAVE_ANY_SYNC}({FULL_WAVE_MASK}, {input}))")
    }

    /// The shared `Ballot` display writes `out = { <this>, 0, 0, 0 };`, which keeps only 32
    /// bits. This writes all four components itself — lanes 0–31, lanes 32–63, 0, 0 — closes
    /// the initializer, and opens a line comment so that the shared formatter's trailing
    /// `, 0, 0, 0 };` lands in that comment (it ends with a newline).
    fn compile_warp_ballot(
        f: &mut Formatter<'_>,
        input: &Variable<Self>,
        out_elem: &Elem<Self>,
    ) -> FmtResult {
        write!(
            f,
            "{out_elem}(uint64({BALLOT_SYNC}({FULL_WAVE_MASK}, {input})) & 0xffffffffull), \
             {out_elem}(uint64({BALLOT_SYNC}({FULL_WAVE_MASK}, {input})) >> 32), 0, 0 }}; \
             // wave64 ballot (lanes 0-31, lanes 32-63); superseded padding:"
        )
    }

    /// Elects the lowest active lane of the wave: the lane whose bit is the lowest set bit of
    /// a 64-bit ballot of the active lanes.
    fn compile_warp_elect(f: &mut Formatter<'_>, out: &str) -> FmtResult {
        writeln!(
            f,
            "{out} = [&]() -> bool {{
    const uint64 maca_active = uint64({BALLOT_SYNC}({FULL_WAVE_MASK}, 1));
    const uint32 maca_lane = uint32({LANE_ID}) % MACA_WARP_SIZE;
    return (maca_active & ((uint64(1) << maca_lane) - uint64(1))) == uint64(0);
}}();"
        )
    }

    fn compile_unreachable(f: &mut Formatter<'_>) -> FmtResult {
        write!(f, "__builtin_unreachable();")
    }
}

impl DialectWmmaCompiler<Self> for MacaDialect {
    fn compile_wmma_fragment_declaration(f: &mut Formatter<'_>, _var: &Variable<Self>) -> FmtResult {
        f.write_str("#error matrix fragments are not supported by the MACA dialect\n")
    }

    fn compile_wmma_instruction(f: &mut Formatter<'_>, _instruction: &WmmaInstruction<Self>) -> FmtResult {
        f.write_str("#error matrix instructions are not supported by the MACA dialect\n")
    }

    fn compile_manual_mma(f: &mut Formatter<'_>, _mma: ManualMma<Self>) -> FmtResult {
        f.write_str("#error matrix instructions are not supported by the MACA dialect\n")
    }

    fn compile_scaled_mma(
        f: &mut Formatter<'_>,
        _mma: ManualMma<Self>,
        _scales_a: Variable<Self>,
        _scales_b: Variable<Self>,
        _scales_factor: u32,
    ) -> FmtResult {
        f.write_str("#error scaled matrix instructions are not supported by the MACA dialect\n")
    }

    fn supported_wmma_combinations(_arch: &MacaArchitecture) -> SupportedMmaCombinations {
        Vec::new()
    }

    fn supported_mma_combinations(_arch: &MacaArchitecture) -> SupportedMmaCombinations {
        Vec::new()
    }
}

impl DialectProcessors<Self> for MacaDialect {
    fn processors() -> Vec<Box<dyn Processor>> {
        vec![Box::new(SaturatingArithmeticProcessor::new(true))]
    }
}
