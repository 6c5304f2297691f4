//! Where `train-qwen3 --data` and `generate` find `tokenizer.json`.
//!
//! In order: the `--tokenizer` flag; the `QWEN3_TOKENIZER` environment variable; the
//! `tokenizer.json` beside the model (`--checkpoint DIR/tokenizer.json`, as HF checkpoints
//! ship it); the Qwen3 tokenizer of this repository (`tests/fixtures/qwen3-tokenizer/`), found
//! from the current directory or the binary's location upwards, so that `cargo xtask` works
//! anywhere in a clone. No path is fixed when the binary is built: a moved or installed
//! binary finds the tokenizer the same way.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

/// The environment variable naming a `tokenizer.json`.
pub const ENV_VAR: &str = "QWEN3_TOKENIZER";

/// Where the repository keeps the Qwen3 tokenizer, relative to its root.
pub const BUNDLED: &str = "tests/fixtures/qwen3-tokenizer/tokenizer.json";

/// The `tokenizer.json` to use, given `--tokenizer` (`flag`) and the model's directory.
///
/// ```no_run
/// let path = xtask::tokenizer::resolve(None, Some(std::path::Path::new("hf-export")))?;
/// # Ok::<(), anyhow::Error>(())
/// ```
pub fn resolve(flag: Option<&Path>, checkpoint: Option<&Path>) -> Result<PathBuf> {
    let mut starts: Vec<PathBuf> = std::env::current_dir().into_iter().collect();
    if let Ok(exe) = std::env::current_exe() {
        starts.extend(exe.parent().map(Path::to_path_buf));
    }
    resolve_from(flag, std::env::var_os(ENV_VAR), checkpoint, &starts)
}

/// [`resolve`] with the environment variable's value and the directories to search upwards
/// from given.
fn resolve_from(
    flag: Option<&Path>,
    env: Option<std::ffi::OsString>,
    checkpoint: Option<&Path>,
    starts: &[PathBuf],
) -> Result<PathBuf> {
    if let Some(path) = flag {
        if !path.is_file() {
            bail!("--tokenizer {}: no such file", path.display());
        }
        return Ok(path.to_path_buf());
    }
    if let Some(path) = env.filter(|v| !v.is_empty()) {
        let path = PathBuf::from(path);
        if !path.is_file() {
            bail!("{ENV_VAR}={}: no such file", path.display());
        }
        return Ok(path);
    }
    if let Some(dir) = checkpoint {
        let beside = dir.join("tokenizer.json");
        if beside.is_file() {
            return Ok(beside);
        }
    }
    for start in starts {
        for dir in start.ancestors() {
            let candidate = dir.join(BUNDLED);
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    let looked: Vec<String> = checkpoint
        .map(|d| d.join("tokenizer.json").display().to_string())
        .into_iter()
        .chain(starts.iter().map(|s| format!("{}/…/{BUNDLED}", s.display())))
        .collect();
    bail!(
        "no tokenizer.json found (looked for {}); give --tokenizer FILE or set {ENV_VAR}=FILE",
        looked.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_with(name: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join(name);
        std::fs::create_dir_all(file.parent().expect("parent")).expect("mkdir");
        std::fs::write(&file, "{}").expect("write");
        (dir, file)
    }

    #[test]
    fn the_flag_then_the_variable_then_the_checkpoint_then_the_clone() {
        let (flag_dir, flag) = temp_with("tok.json");
        let (env_dir, env) = temp_with("env.json");
        let (ckpt, beside) = temp_with("tokenizer.json");
        let (clone, bundled) = temp_with(BUNDLED);
        let deep = clone.path().join("target/release");
        let starts = [deep];
        let all = resolve_from(Some(&flag), Some(env.clone().into()), Some(ckpt.path()), &starts);
        assert_eq!(all.expect("flag"), flag);
        let no_flag = resolve_from(None, Some(env.clone().into()), Some(ckpt.path()), &starts);
        assert_eq!(no_flag.expect("env"), env);
        assert_eq!(resolve_from(None, None, Some(ckpt.path()), &starts).expect("beside"), beside);
        // A checkpoint without its own tokenizer: the clone's, found upwards from the binary.
        assert_eq!(resolve_from(None, None, Some(flag_dir.path()), &starts).expect("bundled"), bundled);
        drop(env_dir);
    }

    #[test]
    fn missing_files_are_named() {
        let dir = tempfile::tempdir().expect("temp dir");
        let missing = dir.path().join("missing.json");
        let e = resolve_from(Some(&missing), None, None, &[]).expect_err("flag").to_string();
        assert!(e.contains("--tokenizer") && e.contains("missing.json"), "{e}");
        let e = resolve_from(None, Some(missing.clone().into()), None, &[]).expect_err("env").to_string();
        assert!(e.contains(ENV_VAR) && e.contains("missing.json"), "{e}");
        let e = resolve_from(None, None, Some(dir.path()), &[dir.path().to_path_buf()]).expect_err("none");
        let e = e.to_string();
        assert!(e.contains("--tokenizer") && e.contains(ENV_VAR) && e.contains("tokenizer.json"), "{e}");
    }

    #[test]
    fn the_repository_s_tokenizer_is_found_from_inside_the_clone() {
        let here = [PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src")];
        let found = resolve_from(None, None, None, &here).expect("bundled");
        assert!(found.ends_with(BUNDLED) && found.is_file(), "{}", found.display());
    }
}
