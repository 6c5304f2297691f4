//! The emulated device's run-time compiler: the host C++ compiler (g++ or clang++) builds the MACA
//! source that [`crate::dialect::MacaDialect`] generated, unchanged, into a shared object against
//! the emulation headers (`emu/include/`, embedded in this crate and written out on first use).
//!
//! The only addition to the source is one line after it, `METAX_EMU_ENTRY(<kernel>)`, which
//! defines the shared object's entry points (see the header). A source that uses no barrier and
//! no wave operation is compiled with `-DMETAX_EMU_COOPERATIVE=0`: its lanes then run as plain
//! calls, without fibers.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

use crate::driver::{DriverError, Result};

/// The emulation header: what the generated kernels include as `<mcr/mc_runtime.h>`.
pub const RUNTIME_HEADER: &str = include_str!("../../emu/include/mcr/mc_runtime.h");

/// Names whose presence in a source makes its lanes run as fibers.
const COOPERATIVE_MARKERS: &[&str] =
    &["__syncthreads", "__syncwarp", "__shfl", "__ballot", "__all_sync", "__any_sync", "__activemask"];

/// Compiler flags of every kernel (the platform may add more, see
/// [`crate::runtime::MetaxEmuPlatform`]).
const BASE_FLAGS: &[&str] = &[
    "-std=c++17",
    "-O2",
    "-fPIC",
    "-shared",
    "-fvisibility=hidden",
    "-fno-exceptions",
    "-fno-rtti",
    "-w",
    "-s",
];

/// A host C++ compiler and the directory holding the emulation headers.
#[derive(Debug, Clone)]
pub(crate) struct HostCompiler {
    cxx: PathBuf,
    /// The compiler's `--version` first line.
    version: String,
    include: PathBuf,
}

fn header_files() -> [(&'static str, String); 7] {
    let forward = "#include <mcr/mc_runtime.h>\n".to_string();
    [
        ("mcr/mc_runtime.h", RUNTIME_HEADER.to_string()),
        ("mc_runtime.h", forward.clone()),
        ("mcr/maca_fp16.h", forward.clone()),
        ("common/maca_fp16.h", forward.clone()),
        ("common/maca_bfloat16.h", forward.clone()),
        ("maca_fp16.h", forward.clone()),
        ("maca_bfloat16.h", forward),
    ]
}

/// A short hash of the emulation headers (part of the kernel cache's fingerprint).
pub(crate) fn headers_hash() -> String {
    let mut hasher = Sha256::new();
    for (name, text) in header_files() {
        hasher.update(name.as_bytes());
        hasher.update([0]);
        hasher.update(text.as_bytes());
    }
    hasher.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// Where the emulator keeps its files: beside the kernel cache when there is one, else in the
/// temporary directory.
pub(crate) fn work_root() -> PathBuf {
    crate::runtime::compile_cache::directory()
        .map(|dir| dir.join("metax-emu"))
        .unwrap_or_else(|| std::env::temp_dir().join(format!("burn-metax-emu-{}", user_tag())))
}

fn user_tag() -> String {
    std::env::var("USER").or_else(|_| std::env::var("LOGNAME")).unwrap_or_else(|_| "user".to_string())
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A fresh scratch directory under `root`.
pub(crate) fn scratch_dir(root: &Path, what: &str) -> std::io::Result<PathBuf> {
    let dir = root.join("tmp").join(format!(
        "{what}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Writes `text` to `path` unless it already holds exactly that (atomically: temporary + rename).
fn write_if_changed(path: &Path, text: &str) -> std::io::Result<()> {
    if std::fs::read(path).is_ok_and(|bytes| bytes == text.as_bytes()) {
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!(
        "tmp.{}.{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

impl HostCompiler {
    /// Finds the compiler (`$METAX_EMU_CXX`, else `$CXX`, else `g++`, `clang++`, `c++` on `PATH`)
    /// and writes the headers out.
    pub(crate) fn find() -> Result<Self> {
        let candidates: Vec<PathBuf> = ["METAX_EMU_CXX", "CXX"]
            .iter()
            .filter_map(|v| std::env::var_os(v).filter(|s| !s.is_empty()).map(PathBuf::from))
            .chain(["g++", "clang++", "c++"].iter().map(PathBuf::from))
            .collect();
        let mut tried = Vec::new();
        for cxx in candidates {
            match Command::new(&cxx).arg("--version").output() {
                Ok(out) if out.status.success() => {
                    let version = String::from_utf8_lossy(&out.stdout)
                        .lines()
                        .next()
                        .unwrap_or_default()
                        .trim()
                        .to_string();
                    let include = Self::install_headers()?;
                    return Ok(Self { cxx, version, include });
                }
                Ok(out) => tried.push(format!("{} (exit {})", cxx.display(), out.status)),
                Err(e) => tried.push(format!("{} ({e})", cxx.display())),
            }
        }
        Err(DriverError::LibraryUnavailable {
            library: "a host C++ compiler for the emulated MetaX device".to_string(),
            reason: format!(
                "none found (tried {}): install g++ (`apt-get install g++`, which scripts/setup.sh does) or set \
                 METAX_EMU_CXX",
                tried.join(", ")
            ),
        })
    }

    fn install_headers() -> Result<PathBuf> {
        let dir = work_root().join(format!("include-{}", headers_hash()));
        for (name, text) in header_files() {
            write_if_changed(&dir.join(name), &text).map_err(|e| DriverError::LibraryUnavailable {
                library: "the MetaX emulator's headers".to_string(),
                reason: format!("could not write {}: {e}", dir.join(name).display()),
            })?;
        }
        Ok(dir)
    }

    /// Identifies the compiler and the headers, for the kernel cache.
    pub(crate) fn fingerprint(&self) -> String {
        format!(
            "metax-emu:abi{}:{}:{}:{}",
            super::module::ABI,
            self.cxx.display(),
            self.version,
            headers_hash()
        )
    }

    /// The compiler's `--version` line.
    pub(crate) fn version(&self) -> &str {
        &self.version
    }

    /// Compiles one kernel source into a shared object. Returns the object's bytes, or the
    /// compiler's messages on failure.
    pub(crate) fn compile(
        &self,
        source: &str,
        name: &str,
        options: &[String],
    ) -> std::result::Result<Vec<u8>, String> {
        if !is_identifier(name) {
            return Err(format!("`{name}` is not a C identifier, so it cannot name a kernel"));
        }
        if !defines_kernel(source, name) {
            return Err(format!("the source defines no `__global__` function named `{name}`"));
        }
        let cooperative = COOPERATIVE_MARKERS.iter().any(|m| source.contains(m));
        let dir = scratch_dir(&work_root(), "compile").map_err(|e| format!("scratch directory: {e}"))?;
        let result = (|| {
            let src = dir.join(format!("{name}.cpp"));
            let out = dir.join(format!("{name}.so"));
            let text = format!("{source}\n#line 1 \"metax-emu-entry\"\nMETAX_EMU_ENTRY({name})\n");
            std::fs::write(&src, text).map_err(|e| format!("writing {}: {e}", src.display()))?;
            keep_source(name, source);
            let output = Command::new(&self.cxx)
                .args(BASE_FLAGS)
                .arg(format!("-DMETAX_EMU_COOPERATIVE={}", u8::from(cooperative)))
                .arg("-I")
                .arg(&self.include)
                .args(options)
                .arg("-o")
                .arg(&out)
                .arg(&src)
                .output()
                .map_err(|e| format!("running {}: {e}", self.cxx.display()))?;
            let log = format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
            if !output.status.success() {
                return Err(format!("{} exited with {}:\n{log}", self.cxx.display(), output.status));
            }
            std::fs::read(&out).map_err(|e| format!("reading {}: {e}", out.display()))
        })();
        let _ = std::fs::remove_dir_all(&dir);
        result
    }
}

/// `$METAX_EMU_DUMP_DIR`: every kernel source the emulator compiles is also written there, as
/// `<kernel name>.cpp` (for reading what the dialect generated).
fn keep_source(name: &str, source: &str) {
    if let Some(dir) = std::env::var_os("METAX_EMU_DUMP_DIR").filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        if std::fs::create_dir_all(&dir).is_ok() {
            let _ = std::fs::write(dir.join(format!("{name}.cpp")), source);
        }
    }
}

fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c == '_' || c.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric())
}

/// Whether `source` has a `__global__ … name(` definition.
fn defines_kernel(source: &str, name: &str) -> bool {
    source.lines().any(|line| {
        line.contains("__global__")
            && line.split(|c: char| !(c == '_' || c.is_ascii_alphanumeric())).any(|word| word == name)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_names_are_found_in_the_signature_line() {
        let src = "extern \"C\" __global__ void __launch_bounds__(256) my_kernel(\n float* a\n) {}";
        assert!(defines_kernel(src, "my_kernel"));
        assert!(!defines_kernel(src, "my_kern"));
        assert!(!defines_kernel(src, "other"));
        assert!(is_identifier("k_1"));
        assert!(!is_identifier("1k"));
        assert!(!is_identifier("a b"));
        assert!(!is_identifier(""));
    }
}
