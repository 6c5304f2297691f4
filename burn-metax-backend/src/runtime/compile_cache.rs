//! The persistent kernel cache: compiled images on disk, keyed by a SHA-256 of the compiler's
//! fingerprint ([`Driver::compiler_fingerprint`]), the options, the kernel name and the source.
//!
//! Every run-time compilation of the server goes through [`compile`]: the MACA path (`mcrtc`), the
//! CUDA proxy (NVRTC) and the emulated device (the host C++ compiler) alike. A first GPU run
//! compiles hundreds of kernels; later runs, and the other in-process ranks of the same run, load
//! them instead.
//!
//! - **Where**: `$METAX_KERNEL_CACHE` if set (`off`, `0` or an empty value disables the disk
//!   layer), else `$XDG_CACHE_HOME/burn-metax-backend/kernels`, else
//!   `$HOME/.cache/burn-metax-backend/kernels`. [`set_directory`] overrides all of these for the
//!   process (tests use it).
//! - **Files**: `<key>.kernel` = an 8-byte magic, the SHA-256 of the image, the image. Written to a
//!   temporary file and renamed into place, so a reader never sees half a file; a file whose hash
//!   does not match (truncated, corrupted) is ignored and rewritten.
//! - **In process**: concurrent compilations of one key (four in-process ranks starting the same
//!   kernel) wait for the first instead of compiling four times.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use sha2::{Digest, Sha256};

use crate::driver::{CompiledProgram, Driver, DriverError};

const MAGIC: &[u8; 8] = b"BMXKRN01";

/// Counters of the cache since the process started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Programs compiled by the driver's run-time compiler.
    pub compiled: u64,
    /// Programs loaded from the disk cache.
    pub disk_hits: u64,
    /// Programs served from memory (compiled or loaded earlier in this process).
    pub memory_hits: u64,
}

static COMPILED: AtomicU64 = AtomicU64::new(0);
static DISK_HITS: AtomicU64 = AtomicU64::new(0);
static MEMORY_HITS: AtomicU64 = AtomicU64::new(0);

/// The cache's counters so far (process-wide).
pub fn stats() -> CacheStats {
    CacheStats {
        compiled: COMPILED.load(Ordering::Relaxed),
        disk_hits: DISK_HITS.load(Ordering::Relaxed),
        memory_hits: MEMORY_HITS.load(Ordering::Relaxed),
    }
}

type Slot = Arc<OnceLock<Result<CompiledProgram, DriverError>>>;

fn memory() -> &'static Mutex<HashMap<[u8; 32], Slot>> {
    static MEMORY: OnceLock<Mutex<HashMap<[u8; 32], Slot>>> = OnceLock::new();
    MEMORY.get_or_init(Default::default)
}

static DIRECTORY: OnceLock<Option<PathBuf>> = OnceLock::new();

/// Sets the process's disk cache directory (`None`: no disk cache), overriding
/// `$METAX_KERNEL_CACHE`. Returns `false`, changing nothing, if the directory was already chosen
/// (by an earlier call or a first compilation).
pub fn set_directory(directory: Option<PathBuf>) -> bool {
    DIRECTORY.set(directory).is_ok()
}

/// The disk cache directory in use (`None` when disabled).
pub fn directory() -> Option<&'static Path> {
    DIRECTORY.get_or_init(default_directory).as_deref()
}

fn default_directory() -> Option<PathBuf> {
    if let Some(value) = std::env::var_os("METAX_KERNEL_CACHE") {
        let text = value.to_string_lossy();
        if text.is_empty() || text == "off" || text == "0" {
            return None;
        }
        return Some(PathBuf::from(value));
    }
    let base =
        std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()).map(PathBuf::from).or_else(|| {
            std::env::var_os("HOME").filter(|v| !v.is_empty()).map(|h| PathBuf::from(h).join(".cache"))
        })?;
    Some(base.join("burn-metax-backend").join("kernels"))
}

/// The cache key of one compilation.
pub fn key(fingerprint: &str, source: &str, name: &str, options: &[&str]) -> [u8; 32] {
    let mut hasher = Sha256::new();
    for part in [fingerprint, name].into_iter().chain(options.iter().copied()).chain([source]) {
        hasher.update((part.len() as u64).to_le_bytes());
        hasher.update(part.as_bytes());
    }
    hasher.finalize().into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Compiles `source` with `driver` (see [`Driver::compile`]), or returns the image compiled
/// earlier for the same fingerprint, options, name and source. Compilation errors are not cached
/// on disk (they are in memory, for this process).
pub fn compile(
    driver: &dyn Driver,
    source: &str,
    name: &str,
    options: &[&str],
) -> Result<CompiledProgram, DriverError> {
    let key = key(&driver.compiler_fingerprint(), source, name, options);
    let slot = {
        let mut map = memory().lock().unwrap_or_else(|e| e.into_inner());
        map.entry(key).or_default().clone()
    };
    let mut ran = false;
    let result = slot.get_or_init(|| {
        ran = true;
        let file = directory().map(|dir| dir.join(format!("{}.kernel", hex(&key))));
        if let Some(image) = file.as_deref().and_then(read_entry) {
            DISK_HITS.fetch_add(1, Ordering::Relaxed);
            return Ok(CompiledProgram { image, log: String::new() });
        }
        let compiled = driver.compile(source, name, options)?;
        COMPILED.fetch_add(1, Ordering::Relaxed);
        if let Some(file) = &file {
            // A cache that cannot be written only costs a recompilation next time.
            let _ = write_entry(file, &compiled.image);
        }
        Ok(compiled)
    });
    if !ran {
        MEMORY_HITS.fetch_add(1, Ordering::Relaxed);
    }
    result.clone()
}

/// The image stored in `file`, if the file is complete and its hash matches.
fn read_entry(file: &Path) -> Option<Vec<u8>> {
    let bytes = std::fs::read(file).ok()?;
    let (magic, rest) = bytes.split_at_checked(MAGIC.len())?;
    let (hash, image) = rest.split_at_checked(32)?;
    (magic == MAGIC && Sha256::digest(image).as_slice() == hash).then(|| image.to_vec())
}

/// Writes an entry atomically: a temporary file in the same directory, renamed into place.
fn write_entry(file: &Path, image: &[u8]) -> std::io::Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let dir = file.parent().ok_or_else(|| std::io::Error::other("cache file without a directory"))?;
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.{}.{}.tmp",
        file.file_name().map(|n| n.to_string_lossy()).unwrap_or_default(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let mut bytes = Vec::with_capacity(MAGIC.len() + 32 + image.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&Sha256::digest(image));
    bytes.extend_from_slice(image);
    let written = std::fs::write(&tmp, &bytes).and_then(|()| std::fs::rename(&tmp, file));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_change_with_every_part() {
        let base = key("fp", "src", "k", &["-O2"]);
        assert_eq!(base, key("fp", "src", "k", &["-O2"]));
        assert_ne!(base, key("fp2", "src", "k", &["-O2"]));
        assert_ne!(base, key("fp", "src2", "k", &["-O2"]));
        assert_ne!(base, key("fp", "src", "k2", &["-O2"]));
        assert_ne!(base, key("fp", "src", "k", &["-O3"]));
        assert_ne!(base, key("fp", "src", "k", &[]));
        // Length prefixes keep the parts apart.
        assert_ne!(key("ab", "c", "k", &[]), key("a", "bc", "k", &[]));
    }

    #[test]
    fn entries_round_trip_and_damaged_ones_are_ignored() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("sub").join("x.kernel");
        write_entry(&file, b"image bytes").expect("write");
        assert_eq!(read_entry(&file).as_deref(), Some(&b"image bytes"[..]));
        // Truncated: ignored.
        let bytes = std::fs::read(&file).expect("read");
        std::fs::write(&file, &bytes[..bytes.len() - 1]).expect("truncate");
        assert_eq!(read_entry(&file), None);
        // Same size, one byte flipped: ignored.
        let mut flipped = bytes.clone();
        *flipped.last_mut().expect("non-empty") ^= 1;
        std::fs::write(&file, &flipped).expect("flip");
        assert_eq!(read_entry(&file), None);
        // No temporary file is left behind.
        let names: Vec<_> = std::fs::read_dir(file.parent().expect("dir"))
            .expect("list")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }
}
