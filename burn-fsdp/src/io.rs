//! Safetensors files in and out: read (with dtype conversion), write atomically.
//!
//! Shared by the sharded checkpoints of this crate and the HF checkpoints of model crates.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

/// A file that could not be read, parsed or written. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    /// The file system refused.
    #[error("{path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error (in the message, not repeated as a `source`).
        error: std::io::Error,
    },
    /// The file is not valid safetensors (malformed or truncated).
    #[error("{path}: not a valid safetensors file: {msg}")]
    Format {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        msg: String,
    },
    /// A tensor is missing.
    #[error("{path}: missing tensor `{name}`")]
    Missing {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
    },
    /// A tensor has a dtype that cannot be converted as asked.
    #[error("{path}: tensor `{name}` has dtype {dtype}")]
    DType {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// What was found (and expected).
        dtype: String,
    },
}

/// `map_err` helper naming the file of an I/O error.
pub fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> IoError {
    let path = path.into();
    move |error| IoError::Io { path, error }
}

/// A safetensors file, memory-mapped: opening it reads only the header, and a tensor's bytes
/// (or some rows of them, [`read_rows_f32`](Self::read_rows_f32)) are read when asked for, so a
/// rank loading its shards of a large checkpoint touches only its own rows.
pub struct SafetensorsFile {
    path: PathBuf,
    bytes: FileBytes,
}

/// The bytes of a file: mapped, or (for an empty file, which cannot be mapped) none.
enum FileBytes {
    Mapped(memmap2::Mmap),
    Empty,
}

impl std::ops::Deref for FileBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            FileBytes::Mapped(m) => m,
            FileBytes::Empty => &[],
        }
    }
}

impl SafetensorsFile {
    /// Maps `path` and checks its header; a truncated or malformed file is an error.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, IoError> {
        let path = path.as_ref().to_path_buf();
        let file = std::fs::File::open(&path).map_err(io_err(&path))?;
        let len = file.metadata().map_err(io_err(&path))?.len();
        let bytes = if len == 0 {
            FileBytes::Empty
        } else {
            // SAFETY: the map is read-only and private to this value. Its invariant — the file
            // is not truncated or rewritten in place while mapped — holds for every file this
            // project reads: checkpoints are only ever replaced by atomic rename (a new inode),
            // never modified in place. A file truncated by someone else under us would raise
            // SIGBUS on access, as with any memory-mapped reader (safetensors' own loaders).
            FileBytes::Mapped(unsafe { memmap2::Mmap::map(&file) }.map_err(io_err(&path))?)
        };
        let file = Self { path, bytes };
        file.parse()?;
        Ok(file)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Gives the pages of the file read so far back to the kernel (`MADV_DONTNEED`): they stop
    /// counting in this process's resident memory, and a later read maps them again from the
    /// page cache or the disk, with the same bytes. For a checkpoint whose shards have all
    /// been loaded: its mapping would otherwise keep every page the ranks read resident for the
    /// rest of the run (2.4 GB for Qwen3-0.6B in f32). Best effort: does nothing where it is
    /// not supported.
    pub fn release_pages(&self) {
        #[cfg(unix)]
        if let FileBytes::Mapped(map) = &self.bytes {
            // SAFETY: MADV_DONTNEED on a private, read-only file mapping that is never written
            // (an `Mmap` gives out `&[u8]` only) drops the page-table entries; the next access
            // faults the page in from the file again. The file is not modified in place while
            // mapped (`open`'s invariant), so every byte read afterwards — by this thread or
            // another holding a slice of the map — is the byte that was there before: no
            // borrowed data changes.
            let _ = unsafe { map.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
        }
    }

    /// XXH3-64 of the whole file (header and data).
    pub fn digest(&self) -> u64 {
        xxhash_rust::xxh3::xxh3_64(&self.bytes)
    }

    fn parse(&self) -> Result<SafeTensors<'_>, IoError> {
        SafeTensors::deserialize(&self.bytes)
            .map_err(|e| IoError::Format { path: self.path.clone(), msg: e.to_string() })
    }

    /// Names of all tensors in the file.
    pub fn names(&self) -> Result<Vec<String>, IoError> {
        Ok(self.parse()?.names().into_iter().map(str::to_owned).collect())
    }

    /// Shape and dtype of tensor `name`.
    pub fn info(&self, name: &str) -> Result<(Vec<usize>, Dtype), IoError> {
        let st = self.parse()?;
        let view = st.tensor(name).map_err(|_| self.missing(name))?;
        Ok((view.shape().to_vec(), view.dtype()))
    }

    fn missing(&self, name: &str) -> IoError {
        IoError::Missing { path: self.path.clone(), name: name.to_owned() }
    }

    /// Tensor `name` converted to `f32` (from f32, f64, bf16 or f16), with its shape.
    pub fn read_f32(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>), IoError> {
        let st = self.parse()?;
        let view = st.tensor(name).map_err(|_| self.missing(name))?;
        let values = self.to_f32(name, view.dtype(), view.data())?;
        Ok((values, view.shape().to_vec()))
    }

    /// Rows `rows` of dim 0 of tensor `name`, converted to `f32` like
    /// [`read_f32`](Self::read_f32), with the tensor's full shape. Only those rows' bytes are
    /// read from the file. Rows past the end are an error naming the tensor.
    ///
    /// ```
    /// # let dir = std::env::temp_dir().join(format!("burn-fsdp-io-doc-{}", std::process::id()));
    /// # std::fs::create_dir_all(&dir).unwrap();
    /// use burn_fsdp::io::{SafetensorsFile, TensorOut, write_safetensors};
    ///
    /// let path = dir.join("w.safetensors");
    /// let w = TensorOut::F32(vec![3, 2], vec![0., 1., 2., 3., 4., 5.]);
    /// write_safetensors(&path, vec![("w".into(), w)], None).unwrap();
    /// let file = SafetensorsFile::open(&path).unwrap();
    /// assert_eq!(file.read_rows_f32("w", 1..3).unwrap(), (vec![2., 3., 4., 5.], vec![3, 2]));
    /// # std::fs::remove_dir_all(&dir).unwrap();
    /// ```
    pub fn read_rows_f32(
        &self,
        name: &str,
        rows: std::ops::Range<usize>,
    ) -> Result<(Vec<f32>, Vec<usize>), IoError> {
        let st = self.parse()?;
        let view = st.tensor(name).map_err(|_| self.missing(name))?;
        let shape = view.shape().to_vec();
        let d0 = shape.first().copied().unwrap_or(1);
        if rows.start > rows.end || rows.end > d0 {
            return Err(IoError::Format {
                path: self.path.clone(),
                msg: format!(
                    "tensor `{name}` has {d0} rows, rows {}..{} were asked for",
                    rows.start, rows.end
                ),
            });
        }
        let row_bytes = view.data().len() / d0.max(1);
        let data = &view.data()[rows.start * row_bytes..rows.end * row_bytes];
        let values = self.to_f32(name, view.dtype(), data)?;
        Ok((values, shape))
    }

    fn to_f32(&self, name: &str, dtype: Dtype, data: &[u8]) -> Result<Vec<f32>, IoError> {
        let values = match dtype {
            Dtype::F32 => {
                data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
            }
            Dtype::F64 => data
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as f32)
                .collect(),
            Dtype::BF16 => {
                data.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
            }
            Dtype::F16 => {
                data.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
            }
            other => {
                return Err(IoError::DType {
                    path: self.path.clone(),
                    name: name.to_owned(),
                    dtype: format!("{other:?}"),
                });
            }
        };
        Ok(values)
    }

    /// Tensor `name` as `i64` (from i64, i32, u32, u16 or u8), with its shape.
    pub fn read_i64(&self, name: &str) -> Result<(Vec<i64>, Vec<usize>), IoError> {
        let st = self.parse()?;
        let view = st.tensor(name).map_err(|_| self.missing(name))?;
        let data = view.data();
        let values = match view.dtype() {
            Dtype::I64 => {
                data.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8]))).collect()
            }
            Dtype::I32 => {
                data.chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64).collect()
            }
            Dtype::U32 => {
                data.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64).collect()
            }
            Dtype::U16 => data.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]]) as i64).collect(),
            Dtype::U8 => data.iter().map(|&b| b as i64).collect(),
            other => {
                return Err(IoError::DType {
                    path: self.path.clone(),
                    name: name.to_owned(),
                    dtype: format!("{other:?} (expected an integer type)"),
                });
            }
        };
        Ok((values, view.shape().to_vec()))
    }
}

/// One tensor to write: name, shape and either `f32` or `i64` values.
#[derive(Debug, Clone)]
pub enum TensorOut {
    /// 32-bit floats.
    F32(Vec<usize>, Vec<f32>),
    /// 64-bit integers.
    I64(Vec<usize>, Vec<i64>),
}

/// Writes `tensors` to a safetensors file, atomically: the data goes to a temporary file in the
/// same directory, which is then renamed, so a crash never leaves a half-written file under
/// `path`.
pub fn write_safetensors(
    path: impl AsRef<Path>,
    tensors: Vec<(String, TensorOut)>,
    metadata: Option<HashMap<String, String>>,
) -> Result<(), IoError> {
    let path = path.as_ref();
    let bytes: Vec<(String, Vec<u8>, Vec<usize>, Dtype)> = tensors
        .into_iter()
        .map(|(name, t)| match t {
            TensorOut::F32(shape, v) => {
                (name, v.iter().flat_map(|x| x.to_le_bytes()).collect(), shape, Dtype::F32)
            }
            TensorOut::I64(shape, v) => {
                (name, v.iter().flat_map(|x| x.to_le_bytes()).collect(), shape, Dtype::I64)
            }
        })
        .collect();
    let mut views = Vec::with_capacity(bytes.len());
    for (name, data, shape, dtype) in &bytes {
        let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), data)
            .map_err(|e| IoError::Format { path: path.to_path_buf(), msg: format!("{name}: {e}") })?;
        views.push((name.clone(), view));
    }
    let buf = safetensors::serialize(views, metadata)
        .map_err(|e| IoError::Format { path: path.to_path_buf(), msg: e.to_string() })?;
    write_atomic(path, &buf)
}

/// Writes `bytes` to `path` through a temporary file and a rename, then syncs the directory:
/// a reader sees the old file or the whole new one, never part of it, whenever the writer
/// dies.
///
/// For crash tests, [`CRASH_AT_VAR`] can make the process abort inside one such write.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), IoError> {
    use std::io::Write;
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let file_name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{file_name}.{}.tmp", std::process::id()));
    let mut f = std::fs::File::create(&tmp).map_err(io_err(&tmp))?;
    if crash_point(&file_name) {
        // Half the bytes reach the temporary file, then the process dies as under SIGKILL:
        // no destructor runs, nothing else is flushed.
        let _ = f.write_all(&bytes[..bytes.len() / 2]);
        let _ = f.sync_all();
        std::process::abort();
    }
    f.write_all(bytes).map_err(io_err(&tmp))?;
    f.sync_all().map_err(io_err(&tmp))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(io_err(path))?;
    // The rename itself survives a crash of the machine only once the directory is synced.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// The environment variable of a deterministic crash for tests: `NAME#N` aborts the process
/// inside its `N`-th atomic write of a file called `NAME` (counting from 1), once half of the
/// bytes reached the temporary file — e.g. `index.json#3` dies while rank 0 writes the third
/// checkpoint's index. The crash tests use it to hit points a timed SIGKILL rarely does.
pub const CRASH_AT_VAR: &str = "BURN_FSDP_CRASH_AT";

/// Whether this write of a file called `file_name` is the one [`CRASH_AT_VAR`] names.
fn crash_point(file_name: &str) -> bool {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    static TARGET: OnceLock<Option<(String, u64)>> = OnceLock::new();
    static SEEN: AtomicU64 = AtomicU64::new(0);
    let target = TARGET.get_or_init(|| {
        let v = std::env::var(CRASH_AT_VAR).ok()?;
        let (name, n) = v.rsplit_once('#')?;
        Some((name.to_owned(), n.parse().ok()?))
    });
    match target {
        Some((name, n)) if name == file_name => SEEN.fetch_add(1, Ordering::SeqCst) + 1 == *n,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This process's resident memory backed by files (`RssFile` of `/proc/self/status`), in
    /// bytes.
    #[cfg(target_os = "linux")]
    fn rss_file() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
        let line = status.lines().find(|l| l.starts_with("RssFile:")).expect("RssFile");
        let kib: u64 = line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("kB");
        kib * 1024
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn released_pages_leave_resident_memory_and_read_back_the_same() {
        let path = std::env::temp_dir().join(format!("release-pages-{}.safetensors", std::process::id()));
        let (rows, cols) = (4096, 4096); // 64 MiB of f32
        let values: Vec<f32> = (0..rows * cols).map(|i| (i % 9973) as f32 * 0.5).collect();
        write_safetensors(&path, vec![("w".into(), TensorOut::F32(vec![rows, cols], values))], None)
            .expect("written");
        let file = SafetensorsFile::open(&path).expect("opened");
        let before = rss_file();
        let (first, shape) = file.read_rows_f32("w", 0..rows).expect("read");
        assert_eq!(shape, [rows, cols]);
        let read = rss_file();
        assert!(read >= before + (48 << 20), "reading 64 MiB mapped it: {before} → {read}");
        file.release_pages();
        let released = rss_file();
        assert!(released + (48 << 20) <= read, "released: {read} → {released}");
        let (again, _) = file.read_rows_f32("w", 0..rows).expect("read again");
        assert!(first == again, "the same values after the pages were released");
        assert_eq!(again[rows * cols - 1], ((rows * cols - 1) % 9973) as f32 * 0.5);
        drop(file);
        let _ = std::fs::remove_file(&path);
    }
}
