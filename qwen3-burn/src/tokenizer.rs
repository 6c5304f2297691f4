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
        check_added_tokens(&path)?;
        // tokenizers 0.22 panics on some malformed files (an `unwrap` in its deserialisers,
        // found by `tests/tests/fuzz_parsers.rs`): caught, it is an error naming the file.
        let loaded = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_file(&path));
        let inner = match loaded {
            Ok(t) => t.map_err(|e| Qwen3Error::Tokenizer { path: path.clone(), msg: e.to_string() })?,
            Err(panic) => {
                let msg = burn_fsdp::comm::panic_message(panic.as_ref());
                return Err(Qwen3Error::Tokenizer {
                    path,
                    msg: format!("malformed (the tokenizers crate panicked reading it: {msg})"),
                });
            }
        };
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

/// The longest added token accepted, in bytes. Real ones are a few dozen (Qwen3's longest of its 26 is
/// 20); `tokenizers` 0.22 builds its added-vocabulary matcher in time that grows steeply with
/// a token's length (2.6 s for one of 33 000 bytes, found by `tests/tests/fuzz_parsers.rs`),
/// so a file with a longer one is refused rather than loaded for seconds or minutes.
pub const MAX_ADDED_TOKEN_BYTES: usize = 1024;

/// Refuses a `tokenizer.json` with an added token longer than [`MAX_ADDED_TOKEN_BYTES`]
/// (reading only that list; a file that is not JSON is left to `tokenizers`' own error).
fn check_added_tokens(path: &std::path::Path) -> Result<()> {
    #[derive(serde::Deserialize)]
    struct Added {
        #[serde(default)]
        content: String,
    }
    #[derive(serde::Deserialize)]
    struct File {
        #[serde(default)]
        added_tokens: Vec<Added>,
    }
    let Ok(text) = std::fs::read(path) else { return Ok(()) };
    let Ok(file) = serde_json::from_slice::<File>(&text) else { return Ok(()) };
    match file.added_tokens.iter().position(|t| t.content.len() > MAX_ADDED_TOKEN_BYTES) {
        Some(i) => Err(Qwen3Error::Tokenizer {
            path: path.to_path_buf(),
            msg: format!(
                "added token {i} is {} bytes long; tokens longer than {MAX_ADDED_TOKEN_BYTES} bytes are refused",
                file.added_tokens[i].content.len()
            ),
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen3() -> Tokenizer {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3-tokenizer/tokenizer.json");
        Tokenizer::from_file(path).unwrap()
    }

    #[test]
    fn matches_python_tokenizers_on_the_real_qwen3_file() {
        let t = qwen3();
        // Reference ids from Python `tokenizers` 0.23.3 on the same file (see its SOURCE.md).
        assert_eq!(
            t.encode("Hello, world! <think>2+2=4</think> 你好").unwrap(),
            vec![9707, 11, 1879, 0, 220, 151667, 17, 10, 17, 28, 19, 151668, 220, 108386]
        );
        assert_eq!(
            t.encode("FSDP shards every parameter across ranks.").unwrap(),
            vec![37, 5491, 47, 74110, 1449, 5733, 3941, 20803, 13]
        );
        assert_eq!(
            t.encode("  x = 7*cur + 3\n").unwrap(),
            vec![220, 856, 284, 220, 22, 9, 2352, 488, 220, 18, 198]
        );
        assert_eq!(t.token_id("<|endoftext|>"), Some(151643));
        assert_eq!(t.vocab_size(), 151669);
        let text = "FSDP shards every parameter across ranks.";
        assert_eq!(t.decode(&t.encode(text).unwrap()).unwrap(), text);
    }

    #[test]
    fn missing_file_is_named() {
        let e = Tokenizer::from_file("/nonexistent/tokenizer.json").err().unwrap().to_string();
        assert!(e.contains("/nonexistent/tokenizer.json"), "{e}");
    }
}
