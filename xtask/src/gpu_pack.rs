//! `cargo xtask gpu-pack --out gpu-pack/`: everything `scripts/gpu-check.sh` needs on a GPU
//! machine that has no Rust toolchain, no crate registry and no internet (issue #15).
//!
//! It builds `xtask` here with the GPU features (`--features gpu-pack`: the CUDA proxy with
//! NCCL, Burn's own CUDA backend, autotune and fusion) in the `gpu-pack` profile (release,
//! symbols stripped; no MPI, so the binary needs no library beyond libc's), and writes
//!
//! ```text
//! gpu-pack/
//!   bin/xtask.gz            the stripped binary, gzip-compressed (the script unpacks it)
//!   fixtures/qwen3-tiny-a/  the PyTorch fixtures the Qwen3 steps compare with (and -b, untied)
//!   manifest.json           commit, features, profile, build time, every file's size and SHA-256
//! ```
//!
//! and fails when the pack is larger than `--max-mib` (60 MiB by default: the GPU machine takes
//! at most 64 MiB of build output along with the working tree). The binary is compressed because
//! it is larger than that on its own (66.5 MiB stripped at opt-level "s"; 14.6 MiB compressed).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde::Serialize;
use sha2::{Digest, Sha256};

/// The cargo features the pack's binary is built with.
pub const PACK_FEATURES: &str = "gpu-pack";
/// The cargo profile the pack's binary is built in (Cargo.toml: release, stripped).
pub const PACK_PROFILE: &str = "gpu-pack";
/// The fixture directories (under `tests/fixtures`) the pack carries.
pub const PACK_FIXTURES: [&str; 2] = ["qwen3-tiny-a", "qwen3-tiny-b"];

/// Arguments of `gpu-pack`.
#[derive(Debug, Clone, clap::Args)]
pub struct GpuPackArgs {
    /// The pack directory (replaced if it exists; `gpu-pack/` is ignored by git).
    #[arg(long, default_value = "gpu-pack")]
    pub out: PathBuf,
    /// Use this already built binary instead of building one (it should come from
    /// `cargo build --profile gpu-pack -p xtask --features gpu-pack`).
    #[arg(long)]
    pub binary: Option<PathBuf>,
    /// Largest pack allowed, in MiB.
    #[arg(long, default_value_t = 60.0)]
    pub max_mib: f64,
}

/// One file of the pack.
#[derive(Debug, Clone, Serialize)]
pub struct PackFile {
    /// Path inside the pack.
    pub path: String,
    /// Size in bytes.
    pub bytes: u64,
    /// SHA-256 of the contents, hex.
    pub sha256: String,
}

/// `manifest.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Manifest {
    /// `git describe --always --dirty` of the working tree the pack was built from.
    pub commit: String,
    /// Cargo features of the binary.
    pub features: String,
    /// Cargo profile of the binary.
    pub profile: String,
    /// The host it was built for (`std::env::consts`): the GPU machine must be the same.
    pub target: String,
    /// Seconds the build took (0 with `--binary`).
    pub build_seconds: f64,
    /// Size of the uncompressed binary (`bin/xtask.gz` unpacked), in bytes.
    pub binary_bytes: u64,
    /// SHA-256 of the uncompressed binary, hex: what `scripts/gpu-check.sh` checks after
    /// unpacking it.
    pub binary_sha256: String,
    /// The binary's shared-library needs (`ldd`), where `ldd` is present.
    pub needs: Vec<String>,
    /// Every file but the manifest.
    pub files: Vec<PackFile>,
    /// Their total size in bytes.
    pub total_bytes: u64,
}

fn sha256(path: &Path) -> Result<String> {
    let mut file = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The workspace root (this crate's parent directory).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Builds the binary; returns its path.
fn build(root: &Path) -> Result<PathBuf> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    println!(
        "gpu-pack: cargo build --profile {PACK_PROFILE} -p xtask --features {PACK_FEATURES} --bin xtask (a release \
         build: tens of minutes on two cores the first time)"
    );
    let status = Command::new(&cargo)
        .current_dir(root)
        .args([
            "build",
            "--profile",
            PACK_PROFILE,
            "-p",
            "xtask",
            "--features",
            PACK_FEATURES,
            "--bin",
            "xtask",
        ])
        .status()
        .with_context(|| format!("running {}", Path::new(&cargo).display()))?;
    if !status.success() {
        bail!("the pack's build failed ({status})");
    }
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target"));
    Ok(target.join(PACK_PROFILE).join("xtask"))
}

/// `from` gzip-compressed (best compression) into `to`.
fn compress(from: &Path, to: &Path) -> Result<()> {
    let mut input = std::fs::File::open(from).with_context(|| format!("reading {}", from.display()))?;
    let output = std::fs::File::create(to).with_context(|| format!("creating {}", to.display()))?;
    let mut gz = flate2::write::GzEncoder::new(std::io::BufWriter::new(output), flate2::Compression::best());
    std::io::copy(&mut input, &mut gz).with_context(|| format!("compressing {}", from.display()))?;
    gz.finish().and_then(|mut w| w.flush()).with_context(|| format!("writing {}", to.display()))?;
    Ok(())
}

fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    for entry in std::fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let entry = entry?;
        let path = entry.path();
        let dest = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&path, &dest)?;
        } else {
            std::fs::copy(&path, &dest)
                .with_context(|| format!("copying {} to {}", path.display(), dest.display()))?;
        }
    }
    Ok(())
}

fn files_under(dir: &Path, base: &Path, out: &mut Vec<PackFile>) -> Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)?.collect::<std::io::Result<_>>()?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            files_under(&path, base, out)?;
        } else {
            let rel = path.strip_prefix(base).unwrap_or(&path).to_string_lossy().into_owned();
            if rel == "manifest.json" {
                continue;
            }
            out.push(PackFile { path: rel, bytes: entry.metadata()?.len(), sha256: sha256(&path)? });
        }
    }
    Ok(())
}

fn ldd(binary: &Path) -> Vec<String> {
    Command::new("ldd")
        .arg(binary)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().map(|l| l.trim().to_string()).collect())
        .unwrap_or_default()
}

fn describe(root: &Path) -> String {
    Command::new("git")
        .current_dir(root)
        .args(["describe", "--always", "--dirty"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".to_string())
}

/// Writes the pack from `binary` and the fixtures under `fixtures` into `out` (replacing it),
/// and its manifest; fails, naming the sizes, when it is larger than `max_mib`.
pub fn write_pack(
    binary: &Path,
    fixtures: &Path,
    out: &Path,
    max_mib: f64,
    build_seconds: f64,
    commit: String,
) -> Result<Manifest> {
    if !binary.is_file() {
        bail!("the pack's binary {} does not exist", binary.display());
    }
    if out.exists() {
        std::fs::remove_dir_all(out).with_context(|| format!("removing the old pack {}", out.display()))?;
    }
    let bin = out.join("bin");
    std::fs::create_dir_all(&bin).with_context(|| format!("creating {}", bin.display()))?;
    compress(binary, &bin.join("xtask.gz"))?;
    for name in PACK_FIXTURES {
        let from = fixtures.join(name);
        if !from.is_dir() {
            bail!("fixture directory {} is missing", from.display());
        }
        copy_dir(&from, &out.join("fixtures").join(name))?;
    }
    let mut files = Vec::new();
    files_under(out, out, &mut files)?;
    let total_bytes = files.iter().map(|f| f.bytes).sum();
    let manifest = Manifest {
        commit,
        features: PACK_FEATURES.to_string(),
        profile: PACK_PROFILE.to_string(),
        target: format!("{}-{}", std::env::consts::ARCH, std::env::consts::OS),
        build_seconds,
        binary_bytes: std::fs::metadata(binary)
            .with_context(|| format!("reading {}", binary.display()))?
            .len(),
        binary_sha256: sha256(binary)?,
        needs: ldd(binary),
        files,
        total_bytes,
    };
    let json = serde_json::to_string_pretty(&manifest)?;
    std::fs::write(out.join("manifest.json"), json + "\n")
        .with_context(|| format!("writing {}", out.join("manifest.json").display()))?;
    let mib = total_bytes as f64 / (1u64 << 20) as f64;
    if mib > max_mib {
        let largest =
            manifest.files.iter().max_by_key(|f| f.bytes).map(|f| format!("{} ({} bytes)", f.path, f.bytes));
        bail!(
            "the pack {} is {mib:.1} MiB, over --max-mib {max_mib} (largest: {})",
            out.display(),
            largest.unwrap_or_default()
        );
    }
    Ok(manifest)
}

/// Runs `gpu-pack`.
pub fn run(args: &GpuPackArgs) -> Result<Manifest> {
    let root = workspace_root();
    let start = Instant::now();
    let (binary, build_seconds) = match &args.binary {
        Some(b) => (b.clone(), 0.0),
        None => {
            let b = build(&root)?;
            (b, start.elapsed().as_secs_f64())
        }
    };
    let manifest = write_pack(
        &binary,
        &root.join("tests/fixtures"),
        &args.out,
        args.max_mib,
        build_seconds,
        describe(&root),
    )?;
    let packed = manifest.files.iter().find(|f| f.path == "bin/xtask.gz").map_or(0, |f| f.bytes);
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    println!(
        "gpu-pack: {} — {:.1} MiB in all (binary {:.1} MiB, {:.1} MiB compressed), built in {:.0} s; {} files, \
         manifest.json",
        args.out.display(),
        mib(manifest.total_bytes),
        mib(manifest.binary_bytes),
        mib(packed),
        build_seconds,
        manifest.files.len()
    );
    println!(
        "gpu-pack: on the GPU machine: scripts/gpu-check.sh {} OUT_DIR (docs/gpu.md)",
        args.out.display()
    );
    Ok(manifest)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixtures(dir: &Path) -> PathBuf {
        let f = dir.join("fixtures");
        for name in PACK_FIXTURES {
            std::fs::create_dir_all(f.join(name)).unwrap();
            std::fs::write(f.join(name).join("config.json"), format!("{{\"name\": \"{name}\"}}")).unwrap();
        }
        f
    }

    #[test]
    fn the_pack_holds_the_binary_the_fixtures_and_a_manifest_of_them() {
        let dir = tempfile::tempdir().unwrap();
        let binary = dir.path().join("xtask-built");
        std::fs::write(&binary, b"not really a binary").unwrap();
        let out = dir.path().join("pack");
        std::fs::create_dir_all(out.join("stale")).unwrap();
        let m = write_pack(&binary, &fixtures(dir.path()), &out, 60.0, 1.5, "abc123".into()).unwrap();
        assert!(!out.join("stale").exists(), "the old pack is replaced");
        let paths: Vec<&str> = m.files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(
            paths,
            ["bin/xtask.gz", "fixtures/qwen3-tiny-a/config.json", "fixtures/qwen3-tiny-b/config.json"]
        );
        // The binary unpacks to what was built; its digest is `sha256sum`'s of the contents.
        let mut unpacked = Vec::new();
        flate2::read::GzDecoder::new(std::fs::File::open(out.join("bin/xtask.gz")).unwrap())
            .read_to_end(&mut unpacked)
            .unwrap();
        assert_eq!(unpacked, b"not really a binary");
        assert_eq!(m.binary_bytes, 19);
        assert_eq!(m.binary_sha256, "3d1f26f6196e8f4540912d86677919d1419ed19ef458772d33a886ef4d796ec3");
        assert_eq!(m.total_bytes, m.files.iter().map(|f| f.bytes).sum::<u64>());
        let written: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
        assert_eq!(written["commit"], "abc123");
        assert_eq!(written["features"], PACK_FEATURES);
        assert_eq!(written["binary_sha256"], m.binary_sha256.as_str());
        assert_eq!(written["files"].as_array().unwrap().len(), 3);
    }

    #[test]
    fn a_pack_over_the_limit_is_an_error_naming_its_size_and_largest_file() {
        let dir = tempfile::tempdir().unwrap();
        let binary = dir.path().join("big");
        // Bytes that do not compress (a xorshift sequence), 3 MiB of them.
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let noise: Vec<u8> = (0..3 << 20)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        std::fs::write(&binary, noise).unwrap();
        let err = write_pack(&binary, &fixtures(dir.path()), &dir.path().join("pack"), 2.0, 0.0, "x".into())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("3.0 MiB") && err.contains("--max-mib 2") && err.contains("bin/xtask.gz"),
            "{err}"
        );
    }

    #[test]
    fn missing_inputs_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let err =
            write_pack(&dir.path().join("nope"), dir.path(), &dir.path().join("pack"), 60.0, 0.0, "x".into())
                .unwrap_err()
                .to_string();
        assert!(err.contains("nope") && err.contains("does not exist"), "{err}");
        let binary = dir.path().join("b");
        std::fs::write(&binary, b"b").unwrap();
        let err = write_pack(
            &binary,
            &dir.path().join("no-fixtures"),
            &dir.path().join("pack"),
            60.0,
            0.0,
            "x".into(),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("qwen3-tiny-a") && err.contains("missing"), "{err}");
    }
}
