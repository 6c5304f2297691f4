//! Errors of loading, saving and configuring Qwen3.

use std::path::PathBuf;

/// Everything that can go wrong reading or writing a Qwen3 checkpoint or config.
///
/// Every variant names the file, and where it applies the tensor, so that a user can fix
/// the input without reading code.
#[derive(Debug, thiserror::Error)]
pub enum Qwen3Error {
    /// A file could not be read or written.
    #[error("{path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error (in the message, not repeated as a `source`).
        error: std::io::Error,
    },
    /// A JSON file is not valid JSON or does not have the expected fields.
    #[error("{path}: invalid JSON: {error}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error (in the message, not repeated as a `source`).
        error: serde_json::Error,
    },
    /// The model configuration is invalid or unsupported.
    #[error("{path}: invalid Qwen3 config: {msg}")]
    Config {
        /// The config file (or `<preset>` / `<config>` for built-in ones).
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A safetensors file is malformed or truncated.
    #[error("{path}: not a valid safetensors file: {msg}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        msg: String,
    },
    /// A tensor the model needs is not in the checkpoint.
    #[error("{path}: missing tensor `{name}`")]
    MissingTensor {
        /// The checkpoint file (or index) that should hold it.
        path: PathBuf,
        /// The HF tensor name.
        name: String,
    },
    /// A tensor has the wrong shape for the config.
    #[error("{path}: tensor `{name}` has shape {got:?}, the config needs {expected:?}")]
    Shape {
        /// The file.
        path: PathBuf,
        /// The HF tensor name.
        name: String,
        /// What the config implies.
        expected: Vec<usize>,
        /// What the file holds.
        got: Vec<usize>,
    },
    /// A tensor has a dtype that cannot be converted to floating point.
    #[error("{path}: tensor `{name}` has dtype {dtype}, expected a floating-point type")]
    DType {
        /// The file.
        path: PathBuf,
        /// The HF tensor name.
        name: String,
        /// The dtype found.
        dtype: String,
    },
    /// The checkpoint holds tensors the model does not know.
    #[error("{path}: unknown tensors (not part of this Qwen3 config): {}", names.join(", "))]
    UnknownTensors {
        /// The file.
        path: PathBuf,
        /// The unknown names.
        names: Vec<String>,
    },
    /// The tokenizer could not be loaded or used.
    #[error("{path}: tokenizer error: {msg}")]
    Tokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// The tokenizers crate's message.
        msg: String,
    },
}

impl From<burn_fsdp::io::IoError> for Qwen3Error {
    fn from(e: burn_fsdp::io::IoError) -> Self {
        use burn_fsdp::io::IoError as E;
        match e {
            E::Io { path, error } => Qwen3Error::Io { path, error },
            E::Format { path, msg } => Qwen3Error::Safetensors { path, msg },
            E::Missing { path, name } => Qwen3Error::MissingTensor { path, name },
            E::DType { path, name, dtype } => Qwen3Error::DType { path, name, dtype },
        }
    }
}

/// Short for `Result<T, Qwen3Error>`.
pub type Result<T> = std::result::Result<T, Qwen3Error>;

pub(crate) fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Qwen3Error {
    let path = path.into();
    move |error| Qwen3Error::Io { path, error }
}
