//! `cargo xtask`: train Qwen3 with or without FSDP, compute logits, and the other commands.

use clap::{Parser, Subcommand};

#[global_allocator] // Counts live bytes for the memory figures of `bench`.
static ALLOCATOR: xtask::bench::CountingAlloc = xtask::bench::CountingAlloc;

#[derive(Parser)]
#[command(name = "cargo xtask", about = "burn-fsdp developer and user commands")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train Qwen3 (single device with --no-fsdp, or FSDP over in-process ranks).
    #[command(name = "train-qwen3")]
    TrainQwen3(Box<xtask::train::TrainArgs>),
    /// Write the logits of a checkpoint for the `input_ids` of a safetensors file.
    #[command(name = "qwen3-logits")]
    Qwen3Logits(xtask::logits::LogitsArgs),
    /// Benchmarks: FSDP vs single-device throughput, collective vs memcpy bandwidth.
    Bench(xtask::bench::BenchArgs),
    /// Continue a prompt with a Qwen3 checkpoint (KV cache, Qwen3 tokenizer).
    Generate(xtask::generate::GenerateArgs),
    /// Turn a sharded FSDP checkpoint into one HF checkpoint (config.json + model.safetensors).
    Consolidate(xtask::consolidate::ConsolidateArgs),
    /// The reference run at real size: Qwen3-0.6B, W = 4, this project's FSDP and single device
    /// against PyTorch FSDP2 on the same random checkpoint and batches.
    Headline(xtask::headline::HeadlineArgs),
    /// Per-rank memory, collective traffic and step time of Qwen3 training on a layout (8 to
    /// 1024 GPUs): which layouts fit, the best one found.
    Plan(xtask::plan::PlanArgs),
    /// Backend conformance suite: every op Qwen3 training and FSDP use vs float64 references.
    Conformance(xtask::conformance::ConformanceArgs),
    /// Qwen3 training throughput, MFU, kernel share and FSDP W=1 overhead on an NVIDIA GPU
    /// (CUDA proxy), a MetaX GPU or the emulated device.
    #[cfg(feature = "metax")]
    #[command(name = "gpu-bench")]
    GpuBench(xtask::gpu_bench::GpuBenchArgs),
    /// Build the GPU pack (release binary with the GPU features, fixtures, manifest) for
    /// scripts/gpu-check.sh on a GPU machine without Rust (docs/gpu.md).
    #[command(name = "gpu-pack")]
    GpuPack(xtask::gpu_pack::GpuPackArgs),
    /// (Run under mpirun.) Checks MPI collectives against in-process ones, and failure paths.
    #[cfg(feature = "mpi")]
    #[command(name = "mpi-selftest", hide = true)]
    MpiSelftest(xtask::mpi_tools::SelftestArgs),
    /// (Run under mpirun.) MPI all-gather/reduce-scatter vs memcpy bandwidth.
    #[cfg(feature = "mpi")]
    #[command(name = "mpi-bench", hide = true)]
    MpiBench(xtask::mpi_tools::MpiBenchArgs),
}

fn main() {
    // Freed host memory stays with the process for reuse (every command alike, so that the
    // bench's single-device and FSDP workers run under the same allocator settings): FSDP's
    // in-process ranks on the CPU otherwise fault in fresh pages every step (docs/performance.md,
    // "Host memory retained"). `XTASK_MALLOC_DEFAULTS=1` keeps glibc's defaults.
    if std::env::var_os("XTASK_MALLOC_DEFAULTS").is_none_or(|v| v.is_empty() || v == "0") {
        burn_fsdp::retain_host_memory();
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::TrainQwen3(args) => {
            let raw: Vec<String> = std::env::args().skip(1).collect();
            xtask::train::train_entry(&args, &raw)
        }
        Command::Qwen3Logits(args) => xtask::logits::run(&args),
        Command::Consolidate(args) => xtask::consolidate::run(&args),
        #[cfg(feature = "metax")]
        Command::GpuBench(args) => match xtask::gpu_bench::run(&args) {
            Ok(true) => Ok(()),
            Ok(false) => std::process::exit(3),
            Err(e) => Err(e),
        },
        Command::GpuPack(args) => xtask::gpu_pack::run(&args).map(|_| ()),
        #[cfg(feature = "mpi")]
        Command::MpiSelftest(args) => xtask::mpi_tools::selftest(&args),
        #[cfg(feature = "mpi")]
        Command::MpiBench(args) => xtask::mpi_tools::bench(&args),
        Command::Bench(args) => xtask::bench::run(&args).map(|_| ()),
        Command::Headline(args) => xtask::headline::run(&args).map(|_| ()),
        Command::Plan(args) => xtask::plan::run(&args),
        Command::Generate(args) => xtask::generate::run(&args).map(|text| println!("{text}")),
        Command::Conformance(args) => xtask::conformance::run(&args).map(|status| match status.exit_code() {
            0 => (),
            code => std::process::exit(code),
        }),
    };
    if let Err(e) = result {
        // One write for the whole line: the ranks of a job share this stderr, and pieces
        // written separately interleave with theirs.
        use std::io::Write;
        let _ = std::io::stderr().write_all(format!("error: {e:#}\n").as_bytes());
        std::process::exit(1);
    }
}
