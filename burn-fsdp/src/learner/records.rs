//! The Learner's checkpoints under FSDP: each rank saves its learner's records (burn-train's own
//! `LearningCheckpointer`, so every Burn optimizer's state goes in whatever it holds), rank 0
//! writes an index last; a resume at any world size rebuilds the whole records from every
//! saved rank's rows and re-slices them.
//!
//! Layout of `dir`:
//!
//! ```text
//! rank-00000-of-00002/model-3.mpk     the rank's learner records after epoch 3: its shards
//! rank-00000-of-00002/optim-3.mpk     (rows, padded) of every parameter, its optimizer
//! rank-00000-of-00002/scheduler-3.mpk state for them, the scheduler
//! rank-00001-of-00002/…
//! epoch-3.json                        written last (atomically), once every rank's files are
//!                                     in place: the world size and each parameter's id,
//!                                     path and global shape
//! ```
//!
//! Records are resharded without knowing the optimizer: a record is turned into serde values
//! (Burn records serialise), and every tensor under a parameter's id (a map key, as in
//! optimizer records, or the `id` of a parameter item) whose shape is that parameter's shard
//! shape is a per-row state (Adam's moments, SGD's momentum, RmsProp's square average):
//! its rows are gathered from every rank and cut again. Other tensors (a step count) are
//! rank 0's. Burn's optimizers keep element-wise state only (Muon and L-BFGS are refused by
//! FSDP), so this covers them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder, Record};
use burn::tensor::backend::Backend;
use burn_train::checkpoint::{Checkpointer, FileCheckpointer};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::fsdp::FsdpError;

/// The recorder of the Learner's FSDP checkpoints.
pub(crate) fn recorder() -> NamedMpkFileRecorder<FullPrecisionSettings> {
    NamedMpkFileRecorder::new()
}

/// The directory of rank `r` of `w`.
pub(crate) fn rank_dir(dir: &Path, r: usize, w: usize) -> PathBuf {
    dir.join(format!("rank-{r:05}-of-{w:05}"))
}

/// The index of one epoch's checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Index {
    pub(crate) epoch: usize,
    pub(crate) world: usize,
    /// `(serialised ParamId, module path, global shape)` of every sharded parameter.
    pub(crate) params: Vec<(String, String, Vec<usize>)>,
}

pub(crate) fn index_path(dir: &Path, epoch: usize) -> PathBuf {
    dir.join(format!("epoch-{epoch}.json"))
}

/// Writes the index atomically (temporary file, then rename).
pub(crate) fn write_index(dir: &Path, index: &Index) -> Result<(), FsdpError> {
    let path = index_path(dir, index.epoch);
    let tmp = path.with_extension("json.tmp");
    let text = serde_json::to_string_pretty(index)
        .map_err(|e| FsdpError::Config(format!("{}: {e}", path.display())))?;
    std::fs::write(&tmp, text).map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| io(&path, e))
}

pub(crate) fn read_index(dir: &Path, epoch: usize) -> Result<Index, FsdpError> {
    let path = index_path(dir, epoch);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        FsdpError::Config(format!(
            "no FSDP checkpoint of epoch {epoch} to resume from: {}: {e} (an epoch whose index is \
             missing was not completely saved)",
            path.display()
        ))
    })?;
    serde_json::from_str(&text)
        .map_err(|e| FsdpError::Config(format!("{}: malformed index: {e}", path.display())))
}

fn io(path: &Path, e: std::io::Error) -> FsdpError {
    FsdpError::Config(format!("{}: {e}", path.display()))
}

/// Every saved rank's record `name` of `epoch`, as serde values.
pub(crate) fn load_all<R: Record<B>, B: Backend>(
    dir: &Path,
    index: &Index,
    name: &str,
    device: &B::Device,
) -> Result<Vec<Value>, FsdpError> {
    (0..index.world).map(|r| load_rank::<R, B>(dir, index, r, name, device)).collect()
}

/// Saved rank `r`'s record `name` of `epoch`, as a serde value.
pub(crate) fn load_rank<R: Record<B>, B: Backend>(
    dir: &Path,
    index: &Index,
    r: usize,
    name: &str,
    device: &B::Device,
) -> Result<Value, FsdpError> {
    let rdir = rank_dir(dir, r, index.world);
    let record: R = FileCheckpointer::new(recorder(), &rdir, name)
        .restore(index.epoch, device)
        .map_err(|e| FsdpError::Config(format!("{}: {name}-{}: {e:?}", rdir.display(), index.epoch)))?;
    serde_json::to_value(record.into_item::<FullPrecisionSettings>())
        .map_err(|e| FsdpError::Config(format!("{}: {name}: {e}", rdir.display())))
}

/// A serde value back into a record.
pub(crate) fn from_value<R: Record<B>, B: Backend>(
    value: Value,
    device: &B::Device,
    what: &str,
) -> Result<R, FsdpError> {
    let item: R::Item<FullPrecisionSettings> =
        serde_json::from_value(value).map_err(|e| FsdpError::Config(format!("{what}: {e}")))?;
    Ok(R::from_item(item, device))
}

/// Rows of parameter `id`: global rows, the size of the other dimensions.
#[derive(Debug, Clone)]
struct Rows {
    rows: usize,
    rest: Vec<usize>,
}

fn layout(index: &Index) -> HashMap<String, Rows> {
    index
        .params
        .iter()
        .map(|(id, _, shape)| {
            let rows = shape.first().copied().unwrap_or(1);
            (id.clone(), Rows { rows, rest: shape.iter().skip(1).copied().collect() })
        })
        .collect()
}

fn chunk(rows: usize, world: usize) -> usize {
    rows.div_ceil(world.max(1)).max(1)
}

/// The whole record: every per-row tensor of `records` (one per saved rank) with its rows
/// gathered (padding dropped), everything else as rank 0 saved it.
pub(crate) fn unshard(records: &[Value], index: &Index) -> Result<Value, FsdpError> {
    let layout = layout(index);
    let mut out = records.first().cloned().ok_or_else(|| FsdpError::Config("no saved rank".into()))?;
    let mut edits: Vec<(String, Vec<u8>, usize)> = Vec::new();
    find(&records[0], "", None, &layout, &mut |pointer, tensor, rows| {
        let c = chunk(rows.rows, index.world);
        if shape_of(tensor) != shard_shape(c, &rows.rest) {
            return Ok(());
        }
        let row_bytes = bytes_of(tensor)?.len() / c;
        let mut full = Vec::with_capacity(row_bytes * rows.rows);
        for (r, record) in records.iter().enumerate() {
            let t = record.pointer(pointer).ok_or_else(|| mismatch(r, pointer))?;
            let valid = rows.rows.saturating_sub(r * c).min(c);
            full.extend_from_slice(&bytes_of(t)?[..valid * row_bytes]);
        }
        edits.push((pointer.to_owned(), full, rows.rows));
        Ok(())
    })?;
    for (pointer, bytes, rows) in edits {
        set(&mut out, &pointer, bytes, rows)?;
    }
    Ok(out)
}

/// `whole` (from [`unshard`]) cut to rank `rank`'s padded rows of `world`.
pub(crate) fn reslice(whole: &Value, index: &Index, rank: usize, world: usize) -> Result<Value, FsdpError> {
    let layout = layout(index);
    let mut out = whole.clone();
    let mut edits: Vec<(String, Vec<u8>, usize)> = Vec::new();
    find(whole, "", None, &layout, &mut |pointer, tensor, rows| {
        if shape_of(tensor) != shard_shape(rows.rows, &rows.rest) {
            return Ok(());
        }
        let c = chunk(rows.rows, world);
        let bytes = bytes_of(tensor)?;
        let row_bytes = bytes.len() / rows.rows.max(1);
        let start = (rank * c).min(rows.rows);
        let end = ((rank + 1) * c).min(rows.rows);
        let mut mine = bytes[start * row_bytes..end * row_bytes].to_vec();
        mine.resize(c * row_bytes, 0);
        edits.push((pointer.to_owned(), mine, c));
        Ok(())
    })?;
    for (pointer, bytes, rows) in edits {
        set(&mut out, &pointer, bytes, rows)?;
    }
    Ok(out)
}

fn mismatch(rank: usize, pointer: &str) -> FsdpError {
    FsdpError::Config(format!(
        "the record of saved rank {rank} has no tensor at `{pointer}` (ranks saved different models?)"
    ))
}

fn shard_shape(rows: usize, rest: &[usize]) -> Vec<usize> {
    std::iter::once(rows).chain(rest.iter().copied()).collect()
}

/// A serialised tensor: an object with `bytes`, `shape` and `dtype`.
fn is_tensor(v: &Value) -> bool {
    v.as_object()
        .is_some_and(|o| o.contains_key("bytes") && o.contains_key("shape") && o.contains_key("dtype"))
}

fn shape_of(t: &Value) -> Vec<usize> {
    t.get("shape")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|d| d.as_u64().map(|d| d as usize)).collect())
        .unwrap_or_default()
}

fn bytes_of(t: &Value) -> Result<Vec<u8>, FsdpError> {
    t.get("bytes")
        .and_then(Value::as_array)
        .map(|a| a.iter().map(|b| b.as_u64().unwrap_or(0) as u8).collect())
        .ok_or_else(|| FsdpError::Config("a saved tensor without bytes".into()))
}

fn set(root: &mut Value, pointer: &str, bytes: Vec<u8>, rows: usize) -> Result<(), FsdpError> {
    let t = root.pointer_mut(pointer).ok_or_else(|| mismatch(0, pointer))?;
    let mut shape = shape_of(t);
    if let Some(first) = shape.first_mut() {
        *first = rows;
    }
    t["bytes"] = Value::Array(bytes.into_iter().map(Value::from).collect());
    t["shape"] = Value::from(shape);
    Ok(())
}

/// Calls `f(pointer, tensor, rows)` for every tensor under a parameter's id.
fn find(
    v: &Value,
    pointer: &str,
    param: Option<&Rows>,
    layout: &HashMap<String, Rows>,
    f: &mut dyn FnMut(&str, &Value, &Rows) -> Result<(), FsdpError>,
) -> Result<(), FsdpError> {
    if is_tensor(v) {
        return match param {
            Some(rows) => f(pointer, v, rows),
            None => Ok(()),
        };
    }
    match v {
        Value::Object(o) => {
            // A parameter item (`{"id": …, "param": …}`) names its parameter.
            let here = o.get("id").and_then(Value::as_str).and_then(|id| layout.get(id)).or(param);
            for (k, child) in o {
                let escaped = k.replace('~', "~0").replace('/', "~1");
                // A map keyed by parameter ids (an optimizer's record).
                let under = layout.get(k.as_str()).or(here);
                find(child, &format!("{pointer}/{escaped}"), under, layout, f)?;
            }
            Ok(())
        }
        Value::Array(a) => {
            for (i, child) in a.iter().enumerate() {
                find(child, &format!("{pointer}/{i}"), param, layout, f)?;
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(rows: usize, values: &[u8]) -> Value {
        serde_json::json!({"bytes": values, "shape": [rows, 2], "dtype": "U8"})
    }

    #[test]
    fn rows_gathered_from_every_rank_and_cut_again_for_another_world() {
        // A 3-row parameter `7` of width 2 at W = 2: chunks of 2 rows, rank 1's padded.
        let index = Index { epoch: 1, world: 2, params: vec![("7".into(), "w".into(), vec![3, 2])] };
        let rank = |rows: &[u8]| serde_json::json!({"7": {"moment": tensor(2, rows), "time": 4}, "other": tensor(2, &[9, 9, 9, 9])});
        let saved = [rank(&[1, 2, 3, 4]), rank(&[5, 6, 0, 0])];
        let whole = unshard(&saved, &index).expect("unshard");
        assert_eq!(bytes_of(&whole["7"]["moment"]).expect("bytes"), [1, 2, 3, 4, 5, 6]);
        assert_eq!(shape_of(&whole["7"]["moment"]), [3, 2]);
        assert_eq!(whole["7"]["time"], 4);
        // Not under a parameter: rank 0's, untouched.
        assert_eq!(bytes_of(&whole["other"]).expect("bytes"), [9, 9, 9, 9]);
        // At W = 3, one row each; at W = 1, everything.
        let r2 = reslice(&whole, &index, 2, 3).expect("reslice");
        assert_eq!(bytes_of(&r2["7"]["moment"]).expect("bytes"), [5, 6]);
        assert_eq!(shape_of(&r2["7"]["moment"]), [1, 2]);
        let r0 = reslice(&whole, &index, 0, 1).expect("reslice");
        assert_eq!(bytes_of(&r0["7"]["moment"]).expect("bytes"), [1, 2, 3, 4, 5, 6]);
        // A parameter item names its parameter by its `id` field.
        let item = |rows: &[u8]| serde_json::json!({"layer": {"id": "7", "param": tensor(2, rows)}});
        let whole = unshard(&[item(&[1, 2, 3, 4]), item(&[5, 6, 0, 0])], &index).expect("unshard");
        assert_eq!(bytes_of(&whole["layer"]["param"]).expect("bytes"), [1, 2, 3, 4, 5, 6]);
    }
}
