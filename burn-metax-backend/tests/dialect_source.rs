//! Golden/structural tests of the MACA dialect: representative CubeCL kernels are compiled to
//! MACA C++ source, checked for wave-64 forms and for the absence of CUDA/HIP-only code, and
//! syntax-checked with a host C++ compiler against `tests/maca_stub/mc_runtime.h` when one is
//! on `PATH`.

use std::path::{Path, PathBuf};
use std::process::Command;

use burn_metax_backend::dialect::{
    MACA_WARP_SIZE, MacaCompileError, compile_kernel_source, maca_compilation_options,
};
use cubecl_core as cubecl;
use cubecl_core::prelude::*;
use cubecl_cpp::shared::CompilationOptions;
use half::{bf16, f16};

// ---------------------------------------------------------------------------------------------
// Kernels

/// Elementwise `out = a * b + c`.
#[cube(launch)]
fn fma_elementwise(a: &Array<f32>, b: &Array<f32>, c: &Array<f32>, out: &mut Array<f32>) {
    if ABSOLUTE_POS < out.len() {
        out[ABSOLUTE_POS] = a[ABSOLUTE_POS] * b[ABSOLUTE_POS] + c[ABSOLUTE_POS];
    }
}

/// One result per plane: sum and max of the plane's values, the ballot of positive values,
/// and which lane the plane elected.
#[cube(launch)]
fn plane_reduce(
    input: &Array<f32>,
    sums: &mut Array<f32>,
    maxes: &mut Array<f32>,
    ballots: &mut Array<Vector<u32, Const<4>>>,
    elected: &mut Array<u32>,
) {
    let value = input[ABSOLUTE_POS];
    let sum = plane_sum(value);
    let max = plane_max(value);
    let ballot = plane_ballot(value > 0.0);
    let plane = ABSOLUTE_POS / PLANE_DIM as usize;
    if plane_elect() {
        sums[plane] = sum;
        maxes[plane] = max;
        ballots[plane] = ballot;
        elected[plane] = UNIT_POS_PLANE;
    }
}

/// A 16×16 tile of `out = a · b` through shared memory (one cube of 16×16 units).
#[cube(launch)]
fn matmul_tile(a: &Array<f32>, b: &Array<f32>, out: &mut Array<f32>) {
    let mut tile_a = SharedMemory::<f32>::new(256usize);
    let mut tile_b = SharedMemory::<f32>::new(256usize);
    let row = UNIT_POS_Y as usize;
    let col = UNIT_POS_X as usize;
    tile_a[row * 16 + col] = a[row * 16 + col];
    tile_b[row * 16 + col] = b[row * 16 + col];
    sync_cube();
    let mut acc = 0.0f32;
    for k in 0..16usize {
        acc += tile_a[row * 16 + k] * tile_b[k * 16 + col];
    }
    out[row * 16 + col] = acc;
}

/// Softmax of one row per cube; the cube is one 64-lane plane.
#[cube(launch)]
fn softmax_row(input: &Array<f32>, out: &mut Array<f32>, #[comptime] row_len: usize) {
    let base = CUBE_POS_X as usize * row_len;
    let lane = UNIT_POS_X as usize;
    let stride = CUBE_DIM_X as usize;

    let mut local_max = input[base];
    for i in range_stepped(lane, row_len, stride) {
        let x = input[base + i];
        if x > local_max {
            local_max = x;
        }
    }
    let row_max = plane_max(local_max);

    let mut local_sum = 0.0f32;
    for i in range_stepped(lane, row_len, stride) {
        local_sum += (input[base + i] - row_max).exp();
    }
    let row_sum = plane_sum(local_sum);

    for i in range_stepped(lane, row_len, stride) {
        out[base + i] = (input[base + i] - row_max).exp() / row_sum;
    }
}

/// A plane max over f16 and bf16 (headers, type names, max helpers, half shuffles).
#[cube(launch)]
fn half_max(a: &Array<f16>, b: &Array<bf16>, out_a: &mut Array<f16>, out_b: &mut Array<bf16>) {
    out_a[ABSOLUTE_POS] = plane_max(a[ABSOLUTE_POS]);
    out_b[ABSOLUTE_POS] = plane_max(b[ABSOLUTE_POS]);
}

// ---------------------------------------------------------------------------------------------
// Building kernel definitions without a runtime (what `#[cube(launch)]`'s `define` does).

fn input<C: CubePrimitive>(builder: &mut KernelBuilder) -> NativeExpand<Array<C>> {
    <Array<C> as LaunchArg>::expand(&ArrayCompilationArg { inplace: None }, builder)
}

fn output<C: CubePrimitive>(builder: &mut KernelBuilder) -> NativeExpand<Array<C>> {
    <Array<C> as LaunchArg>::expand_output(&ArrayCompilationArg { inplace: None }, builder)
}

fn builder() -> KernelBuilder {
    let mut builder = KernelBuilder::default();
    AddressType::U32.register(&mut builder.scope);
    builder
}

fn settings(name: &str, cube_dim: CubeDim) -> KernelSettings {
    KernelSettings::default().cube_dim(cube_dim).address_type(AddressType::U32).kernel_name(name)
}

fn compile(definition: KernelDefinition) -> String {
    compile_kernel_source(definition, None, ExecutionMode::Checked, AddressType::U32)
        .unwrap_or_else(|err| panic!("MACA compilation failed: {err}"))
}

fn elementwise_source() -> String {
    let mut b = builder();
    let (x, y, z, out) = (input(&mut b), input(&mut b), input(&mut b), output(&mut b));
    fma_elementwise::expand(&mut b.scope, x, y, z, out);
    compile(b.build(settings("fma_elementwise", CubeDim::new_1d(256))))
}

fn plane_reduce_source() -> String {
    let mut b = builder();
    let values = input(&mut b);
    let (sums, maxes) = (output(&mut b), output(&mut b));
    let ballots = output(&mut b);
    let elected = output(&mut b);
    plane_reduce::expand(&mut b.scope, values, sums, maxes, ballots, elected);
    compile(b.build(settings("plane_reduce", CubeDim::new_1d(256))))
}

fn matmul_tile_source() -> String {
    let mut b = builder();
    let (x, y, out) = (input(&mut b), input(&mut b), output(&mut b));
    matmul_tile::expand(&mut b.scope, x, y, out);
    compile(b.build(settings("matmul_tile", CubeDim::new_2d(16, 16))))
}

fn softmax_source() -> String {
    let mut b = builder();
    let (x, out) = (input(&mut b), output(&mut b));
    softmax_row::expand(&mut b.scope, x, out, 1000);
    compile(b.build(settings("softmax_row", CubeDim::new_1d(MACA_WARP_SIZE))))
}

fn half_max_source() -> String {
    let mut b = builder();
    let (x, y) = (input(&mut b), input(&mut b));
    let (out_x, out_y) = (output(&mut b), output(&mut b));
    half_max::expand(&mut b.scope, x, y, out_x, out_y);
    compile(b.build(settings("half_max", CubeDim::new_1d(64))))
}

// ---------------------------------------------------------------------------------------------
// Checks

/// Lines of code without `//` comments (the ballot deliberately comments out the shared
/// formatter's 32-bit padding).
fn code_only(source: &str) -> String {
    source.lines().map(|line| line.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

/// What must hold for every kernel compiled by the MACA dialect.
fn assert_maca_clean(name: &str, source: &str) {
    let code = code_only(source);
    let forbidden = [
        "__activemask",
        "asm(",
        "asm volatile",
        "asm (",
        "cuda_runtime",
        "cuda_fp16",
        "cuda_bf16",
        "cuda/",
        "cuda::",
        "hip_runtime",
        "hip/",
        "__hip",
        "__nv_",
        "nvcuda",
        "wmma",
        "mma",
        "0xffffffff,",
        "0xffffffffu,",
        "0xffffffffu)",
        "0xffffffffU",
        "(-1,",
        "#error",
        "__grid_constant__",
    ];
    for needle in forbidden {
        assert!(!code.contains(needle), "{name}: generated MACA source contains `{needle}`:\n{source}");
    }
    // The hardware `warpSize` builtin is never used: the plane size is the constant below.
    assert!(
        !code.replace("warpSizeChecked", "").contains("warpSize"),
        "{name}: uses the `warpSize` builtin:\n{source}"
    );
    assert!(
        code.contains("static constexpr uint32 MACA_WARP_SIZE = 64u;"),
        "{name}: the warp size constant must be 64:\n{source}"
    );
    assert!(code.contains("extern \"C\" __global__ void"), "{name}: missing kernel entry point:\n{source}");
    // Every shuffle uses the full 64-bit mask and width 64.
    for call in ["__shfl_sync(", "__shfl_xor_sync(", "__shfl_up_sync(", "__shfl_down_sync("] {
        for (pos, _) in code.match_indices(call) {
            let rest = &code[pos + call.len()..];
            assert!(
                rest.starts_with("0xffffffffffffffff, "),
                "{name}: {call} without the 64-bit mask:\n{source}"
            );
            let end = rest.find(';').unwrap_or(rest.len());
            assert!(rest[..end].contains(", 64)"), "{name}: {call} without width 64:\n{source}");
        }
    }
    for call in ["__ballot_sync(", "__all_sync(", "__any_sync("] {
        for (pos, _) in code.match_indices(call) {
            assert!(
                code[pos + call.len()..].starts_with("0xffffffffffffffff, "),
                "{name}: {call} without the 64-bit mask:\n{source}"
            );
        }
    }
}

/// The stub header directory.
fn stub_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/maca_stub")
}

fn find_cxx() -> Option<&'static str> {
    ["g++", "clang++"]
        .into_iter()
        .find(|cxx| Command::new(cxx).arg("--version").output().is_ok_and(|out| out.status.success()))
}

/// Syntax-checks `source` with a host C++ compiler and the stub header (`scripts/setup.sh`
/// installs g++; the emulated device needs one too).
fn syntax_check(name: &str, source: &str) {
    if std::env::var_os("MACA_DUMP_SOURCE").is_some() {
        eprintln!("--- {name} ---\n{source}");
    }
    let Some(cxx) = find_cxx() else {
        panic!("{name}: no g++ or clang++ on PATH: run scripts/setup.sh (it installs g++)");
    };
    let dir = tempfile::tempdir().expect("temporary directory");
    let file = dir.path().join(format!("{name}.maca.cpp"));
    std::fs::write(&file, source).expect("write generated source");
    let stub = stub_dir().join("mc_runtime.h");
    let output = Command::new(cxx)
        .args(["-fsyntax-only", "-std=c++17", "-Wno-unused", "-x", "c++", "-include"])
        .arg(&stub)
        .arg("-I")
        .arg(stub_dir())
        .arg(&file)
        .output()
        .expect("run the C++ compiler");
    assert!(
        output.status.success(),
        "{name}: {cxx} rejected the generated source\n--- compiler output ---\n{}\n--- source ---\n{source}",
        String::from_utf8_lossy(&output.stderr)
    );
}

// ---------------------------------------------------------------------------------------------
// Tests

#[test]
fn options_are_wave64_with_elect_sync() {
    let options = maca_compilation_options();
    assert_eq!(options.warp_size, 64);
    assert!(options.supports_features.elect_sync);
    assert!(!options.supports_features.grid_constants);
    // cubecl's own default would be wrong for MACA.
    assert_eq!(CompilationOptions::default().warp_size, 32);
}

#[test]
fn rejects_a_32_lane_warp_size() {
    let mut b = builder();
    let (x, y, z, out) = (input(&mut b), input(&mut b), input(&mut b), output(&mut b));
    fma_elementwise::expand(&mut b.scope, x, y, z, out);
    let definition = b.build(settings("fma_elementwise", CubeDim::new_1d(256)));
    let options = CompilationOptions::default();
    let result = compile_kernel_source(definition, Some(&options), ExecutionMode::Checked, AddressType::U32);
    assert!(matches!(result, Err(MacaCompileError::WarpSize(32))));
}

#[test]
fn elementwise_fma() {
    let source = elementwise_source();
    assert_maca_clean("fma_elementwise", &source);
    assert!(source.contains("fma_elementwise"));
    assert!(source.contains("__launch_bounds__(256)"));
    assert!(source.contains('*') && source.contains('+'));
    // No plane operation, no wave collective.
    assert!(!source.contains("__shfl") && !source.contains("__ballot"));
    syntax_check("fma_elementwise", &source);
}

#[test]
fn plane_reduction_uses_wave64_forms() {
    let source = plane_reduce_source();
    assert_maca_clean("plane_reduce", &source);
    let code = code_only(&source);
    // plane_sum / plane_max: butterfly over the (checked) plane size with 64-bit shuffles.
    assert!(code.contains("__shfl_xor_sync(0xffffffffffffffff, "));
    assert!(code.contains("warpSizeChecked = min(MACA_WARP_SIZE"));
    // plane_ballot: both 32-bit halves of the 64-bit mask, never `{ ballot, 0, 0, 0 }`.
    assert!(code.contains("__ballot_sync(0xffffffffffffffff, "));
    assert!(code.contains("& 0xffffffffull)"), "low half missing:\n{source}");
    assert!(code.contains(">> 32), 0, 0 };"), "high half missing:\n{source}");
    assert!(!code.contains(", 0, 0, 0 }"), "32-bit ballot form:\n{source}");
    // plane_elect: the dialect's own 64-bit election.
    assert!(code.contains("maca_active"), "elect missing:\n{source}");
    assert!(code.contains("__lane_id()"));
    // UNIT_POS_PLANE is taken modulo the 64-lane constant.
    assert!(code.contains("% MACA_WARP_SIZE"));
    syntax_check("plane_reduce", &source);
}

#[test]
fn matmul_tile_with_shared_memory() {
    let source = matmul_tile_source();
    assert_maca_clean("matmul_tile", &source);
    assert!(source.contains("extern __shared__"), "no shared memory:\n{source}");
    assert!(source.contains("__syncthreads();"));
    assert!(source.contains("__launch_bounds__(256)"));
    syntax_check("matmul_tile", &source);
}

#[test]
fn softmax_row_kernel() {
    let source = softmax_source();
    assert_maca_clean("softmax_row", &source);
    let code = code_only(&source);
    assert!(code.contains("__shfl_xor_sync(0xffffffffffffffff, "));
    assert!(code.contains("exp("), "no exp:\n{source}");
    assert!(code.contains("__launch_bounds__(64)"));
    syntax_check("softmax_row", &source);
}

#[test]
fn includes_are_maca_headers() {
    let source = elementwise_source();
    assert!(source.contains("#if __has_include(<mcr/mc_runtime.h>)"));
    assert!(source.contains("#include <mc_runtime.h>"));
    assert!(!source.contains("hip"), "HIP name in:\n{source}");
}

#[test]
fn half_types_use_maca_names() {
    let source = half_max_source();
    assert_maca_clean("half_max", &source);
    assert!(source.contains("#include <common/maca_fp16.h>"));
    assert!(source.contains("#include <common/maca_bfloat16.h>"));
    assert!(source.contains("__half maca_half_max(__half a, __half b)"));
    assert!(source.contains("= maca_half_max(acc, "), "max helper unused:\n{source}");
    assert!(source.contains("__maca_bfloat16 maca_half_max("));
    // Half values are shuffled as float.
    assert!(source.contains("__half(__shfl_xor_sync(0xffffffffffffffff, float("));
    assert!(source.contains("__maca_bfloat16(__shfl_xor_sync(0xffffffffffffffff, float("));
    syntax_check("half_max", &source);
}
