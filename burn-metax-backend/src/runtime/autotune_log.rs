//! Which kernel CubeCL's autotune chose, written to a file: what tells whether the tensor-core
//! matmuls won on a GPU.

use std::path::Path;
use std::sync::Arc;

use cubecl_runtime::config::autotune::AutotuneLogLevel;
use cubecl_runtime::config::{CubeClRuntimeConfig, RuntimeConfig};

/// Makes CubeCL's autotune write, for each key it tunes, the kernel it chose and the three best
/// candidates' times (its `minimal` log level) to `path`, which is emptied first.
///
/// The setting is CubeCL's, global to the process: it covers every CubeCL runtime in it (this
/// crate's, and Burn's CUDA backend where both run). The rest of CubeCL's configuration is what
/// it would have read itself (a `cubecl.toml` in the current directory or its parents, the
/// `CUBECL_*` variables). CubeCL reads its configuration once, when the first client starts, so
/// the call must come before that; later it changes nothing and returns an error. Nothing is
/// written where autotune is off (burn-metax-backend's `autotune` feature).
///
/// ```
/// use burn_metax_backend::runtime::log_autotune_choices;
///
/// let dir = tempfile::tempdir()?;
/// log_autotune_choices(&dir.path().join("autotune.log"))?;
/// // The configuration is set now: a second call is refused.
/// assert!(log_autotune_choices(&dir.path().join("again.log")).is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// CubeCL's configuration was already read or set, or `path` cannot be written.
pub fn log_autotune_choices(path: &Path) -> Result<(), String> {
    let mut state = CubeClRuntimeConfig::storage().lock();
    if state.is_some() {
        return Err(format!(
            "cannot log autotune's choices to {}: CubeCL's configuration was already read (the \
             first client has started)",
            path.display()
        ));
    }
    // Each CubeCL logger opens the file on its own: they append, to an emptied file.
    std::fs::write(path, b"").map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    config.autotune.logger.level = AutotuneLogLevel::Minimal;
    config.autotune.logger.file = Some(path.to_path_buf());
    config.autotune.logger.append = true;
    *state = Some(Arc::new(config));
    Ok(())
}
