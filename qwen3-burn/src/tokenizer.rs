//! The Qwen3 tokenizer (a `tokenizer.json` read with the `tokenizers` crate).

use std::path::{Path, PathBuf};

use crate::error::{Qwen3Error, Result};

/// A Hugging Face tokenizer loaded from `tokenizer.json`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl Tokenizer {
    /// Loads `tokenizer.json` (a file, or a directory holding one).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let mut path = path.as_ref().to_path_buf();
        if path.is_dir() {
            path = path.join("tokenizer.json");
        }
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| Qwen3Error::Tokenizer { path: path.clone(), msg: e.to_string() })?;
        Ok(Self { inner, path })
    }

    /// Token ids of `text` (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| self.err(e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids` (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(|e| self.err(e))
    }

    /// The id of a token string such as `<|endoftext|>`.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    fn err(&self, e: impl std::fmt::Display) -> Qwen3Error {
        Qwen3Error::Tokenizer { path: self.path.clone(), msg: e.to_string() }
    }
}
