//! Sharded checkpoints of Burn records: [`Fsdp::save_records`](crate::Fsdp::save_records) in a
//! hand-written loop, and the Learner's (`FsdpStrategy::checkpoints`). Each rank saves its own
//! records with Burn's recorder (so every Burn optimizer's state goes in, whatever it holds, and
//! the model record carries the buffers); rank 0 writes an index last; a load at any world size
//! rebuilds the whole records from every saved rank's rows and re-slices them.
//!
//! Layout of `dir` (`step` for `save_records`, `epoch` for the Learner):
//!
//! ```text
//! rank-00000-of-00002/model-3.mpk     the rank's records of step 3: its shards (rows, padded)
//! rank-00000-of-00002/optim-3.mpk     of every parameter and its buffers, its optimizer's
//! rank-00000-of-00002/…               state for them (the Learner's: also its scheduler)
//! rank-00000-of-00002/params-3.json the rank's parameter ids and their paths
//! rank-00001-of-00002/…
//! step-3.json                         written last (atomically), once every rank's files are
//!                                     in place: the world size and each parameter's path
//!                                     and global shape
//! ```
//!
//! Records are resharded without knowing the optimizer: a record is turned into serde values
//! (Burn records serialise), and every tensor under a parameter's id (a map key, as in
//! optimizer records, or the `id` of a parameter item) whose shape is that parameter's shard
//! shape is a per-row state (Adam's moments, SGD's momentum, RmsProp's square average):
//! its rows are gathered from every rank and cut again. Other tensors (a step count, the
//! buffers) are rank 0's. Burn's optimizers keep element-wise state only (Muon and L-BFGS are
//! refused by FSDP), so this covers them. Parameter ids differ from rank to rank (each rank
//! may build its model itself) and from run to run: a loaded record's ids are renamed to
//! their paths (each rank's `params-N.json`), and after re-slicing to the loading model's ids.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder, Record, Recorder};
use burn::tensor::backend::Backend;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::fsdp::FsdpError;

/// The recorder of FSDP's record checkpoints (Burn's named MessagePack, full precision).
pub(crate) fn recorder() -> NamedMpkFileRecorder<FullPrecisionSettings> {
    NamedMpkFileRecorder::new()
}

/// The directory of rank `r` of `w`.
pub(crate) fn rank_dir(dir: &Path, r: usize, w: usize) -> PathBuf {
    dir.join(format!("rank-{r:05}-of-{w:05}"))
}

/// The file (without extension) of record `name` of checkpoint `number` in a rank directory
/// (burn-train's `FileCheckpointer` names its files so).
pub(crate) fn record_path(rank_dir: &Path, name: &str, number: usize) -> PathBuf {
    rank_dir.join(format!("{name}-{number}"))
}

/// The index of one checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Index {
    /// What the number counts: `step` or `epoch` (also the index file's stem).
    pub(crate) kind: String,
    /// The step or epoch.
    pub(crate) number: usize,
    /// The world size that saved it.
    pub(crate) world: usize,
    /// `(module path, global shape)` of every sharded parameter.
    pub(crate) params: Vec<(String, Vec<usize>)>,
}

/// `dir/{kind}-{number}.json`.
pub(crate) fn index_path(dir: &Path, kind: &str, number: usize) -> PathBuf {
    dir.join(format!("{kind}-{number}.json"))
}

/// Writes the index atomically (temporary file, then rename).
pub(crate) fn write_index(dir: &Path, index: &Index) -> Result<(), FsdpError> {
    let path = index_path(dir, &index.kind, index.number);
    let text = serde_json::to_string_pretty(index).map_err(|e| err(&path, e))?;
    write_atomic(&path, text.as_bytes())
}

/// The index of checkpoint `number` (`kind` `step` or `epoch`).
pub(crate) fn read_index(dir: &Path, kind: &str, number: usize) -> Result<Index, FsdpError> {
    let path = index_path(dir, kind, number);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        err(
            &path,
            format!(
                "no FSDP checkpoint of {kind} {number} to load: {e} (a checkpoint whose index is \
                 missing was not completely saved)"
            ),
        )
    })?;
    let index: Index =
        serde_json::from_str(&text).map_err(|e| err(&path, format!("malformed index: {e}")))?;
    if index.world == 0 || index.kind != kind || index.number != number {
        return Err(err(
            &path,
            format!("the index describes {} {} of world {}", index.kind, index.number, index.world),
        ));
    }
    Ok(index)
}

/// The numbers of the complete checkpoints (`kind`) in `dir`, ascending.
pub(crate) fn saved(dir: &Path, kind: &str) -> Vec<usize> {
    let prefix = format!("{kind}-");
    let mut out: Vec<usize> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            name.strip_prefix(&prefix)?.strip_suffix(".json")?.parse().ok()
        })
        .collect();
    out.sort_unstable();
    out
}

/// [`crate::io::write_atomic`], its error a checkpoint error naming the file it was writing.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), FsdpError> {
    crate::io::write_atomic(path, bytes).map_err(|e| match e {
        crate::io::IoError::Io { path, error } => err(&path, error),
        e => err(path, e),
    })
}

/// A checkpoint error naming `path`.
pub(crate) fn err(path: &Path, e: impl std::fmt::Display) -> FsdpError {
    FsdpError::Checkpoint { path: path.to_path_buf(), reason: e.to_string() }
}

/// Saves `record` as record `name` of checkpoint `number` in `rank_dir`.
pub(crate) fn save_rank<R: Record<B>, B: Backend>(
    record: R,
    rank_dir: &Path,
    name: &str,
    number: usize,
) -> Result<(), FsdpError> {
    std::fs::create_dir_all(rank_dir).map_err(|e| err(rank_dir, e))?;
    let path = record_path(rank_dir, name, number);
    Recorder::<B>::record(&recorder(), record, path.clone()).map_err(|e| err(&path, format!("{e:?}")))?;
    Ok(())
}

/// Every saved rank's record `name`, as serde values.
pub(crate) fn load_all<R: Record<B>, B: Backend>(
    dir: &Path,
    index: &Index,
    name: &str,
    device: &B::Device,
) -> Result<Vec<Value>, FsdpError> {
    (0..index.world).map(|r| load_rank::<R, B>(dir, index, r, name, device)).collect()
}

/// Saved rank `r`'s record `name`, as a serde value.
pub(crate) fn load_rank<R: Record<B>, B: Backend>(
    dir: &Path,
    index: &Index,
    r: usize,
    name: &str,
    device: &B::Device,
) -> Result<Value, FsdpError> {
    let rdir = rank_dir(dir, r, index.world);
    let ids = read_ids(&rdir, index.number)?;
    let path = record_path(&rdir, name, index.number);
    let record: R = Recorder::<B>::load(&recorder(), path.clone(), device)
        .map_err(|e| err(&path, format!("cannot load the {name} record: {e:?}")))?;
    let mut value =
        serde_json::to_value(record.into_item::<FullPrecisionSettings>()).map_err(|e| err(&path, e))?;
    rename_ids(&mut value, &ids);
    Ok(value)
}

/// A parameter's name in records being resharded: its path, marked so that it cannot be
/// taken for a field of a record.
pub(crate) fn canonical(path: &str) -> String {
    format!("@param:{path}")
}

fn ids_path(rank_dir: &Path, number: usize) -> PathBuf {
    rank_dir.join(format!("params-{number}.json"))
}

/// Writes a rank's `(parameter id, path)` pairs, atomically.
pub(crate) fn write_ids(rank_dir: &Path, number: usize, ids: &[(String, String)]) -> Result<(), FsdpError> {
    let path = ids_path(rank_dir, number);
    let text = serde_json::to_string(ids).map_err(|e| err(&path, e))?;
    write_atomic(&path, text.as_bytes())
}

/// A saved rank's renaming of its parameter ids to their canonical names.
fn read_ids(rank_dir: &Path, number: usize) -> Result<HashMap<String, String>, FsdpError> {
    let path = ids_path(rank_dir, number);
    let text = std::fs::read_to_string(&path).map_err(|e| err(&path, e))?;
    let pairs: Vec<(String, String)> =
        serde_json::from_str(&text).map_err(|e| err(&path, format!("malformed: {e}")))?;
    Ok(pairs.into_iter().map(|(id, p)| (id, canonical(&p))).collect())
}

/// A serde value back into a record.
pub(crate) fn from_value<R: Record<B>, B: Backend>(
    value: Value,
    device: &B::Device,
    what: &str,
) -> Result<R, FsdpError> {
    let item: R::Item<FullPrecisionSettings> = serde_json::from_value(value)
        .map_err(|e| FsdpError::Config(format!("{what} does not fit this model or optimizer: {e}")))?;
    Ok(R::from_item(item, device))
}

/// Renames parameter names (map keys, as in optimizer records, and the `id` of parameter
/// items): saved ids to canonical names, canonical names to the loading model's ids.
pub(crate) fn rename_ids(v: &mut Value, ids: &HashMap<String, String>) {
    match v {
        Value::Object(o) => {
            for (k, mut child) in std::mem::take(o) {
                if k == "id" {
                    if let Value::String(id) = &mut child
                        && let Some(new) = ids.get(id.as_str())
                    {
                        *id = new.clone();
                    }
                } else {
                    rename_ids(&mut child, ids);
                }
                o.insert(ids.get(&k).cloned().unwrap_or(k), child);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|c| rename_ids(c, ids)),
        _ => {}
    }
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
        .map(|(path, shape)| {
            let rows = shape.first().copied().unwrap_or(1);
            (canonical(path), Rows { rows, rest: shape.iter().skip(1).copied().collect() })
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

/// Calls `f(pointer, tensor, rows)` for every tensor under a parameter's (canonical) name.
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
        // A 3-row parameter `w` of width 2 at W = 2: chunks of 2 rows, rank 1's padded.
        let index =
            Index { kind: "step".into(), number: 1, world: 2, params: vec![("w".into(), vec![3, 2])] };
        assert_eq!(canonical("w"), "@param:w");
        let rank = |rows: &[u8]| serde_json::json!({"@param:w": {"moment": tensor(2, rows), "time": 4}, "other": tensor(2, &[9, 9, 9, 9])});
        let saved = [rank(&[1, 2, 3, 4]), rank(&[5, 6, 0, 0])];
        let whole = unshard(&saved, &index).expect("unshard");
        assert_eq!(bytes_of(&whole["@param:w"]["moment"]).expect("bytes"), [1, 2, 3, 4, 5, 6]);
        assert_eq!(shape_of(&whole["@param:w"]["moment"]), [3, 2]);
        assert_eq!(whole["@param:w"]["time"], 4);
        // Not under a parameter: rank 0's, untouched.
        assert_eq!(bytes_of(&whole["other"]).expect("bytes"), [9, 9, 9, 9]);
        // At W = 3, one row each; at W = 1, everything.
        let r2 = reslice(&whole, &index, 2, 3).expect("reslice");
        assert_eq!(bytes_of(&r2["@param:w"]["moment"]).expect("bytes"), [5, 6]);
        assert_eq!(shape_of(&r2["@param:w"]["moment"]), [1, 2]);
        let r0 = reslice(&whole, &index, 0, 1).expect("reslice");
        assert_eq!(bytes_of(&r0["@param:w"]["moment"]).expect("bytes"), [1, 2, 3, 4, 5, 6]);
        // A parameter item names its parameter by its `id` field.
        let item = |rows: &[u8]| serde_json::json!({"layer": {"id": "@param:w", "param": tensor(2, rows)}});
        let whole = unshard(&[item(&[1, 2, 3, 4]), item(&[5, 6, 0, 0])], &index).expect("unshard");
        assert_eq!(bytes_of(&whole["layer"]["param"]).expect("bytes"), [1, 2, 3, 4, 5, 6]);
    }

    #[test]
    fn ids_are_renamed_in_map_keys_and_id_fields_only() {
        let ids: HashMap<String, String> =
            [("a1".to_owned(), "@param:w".to_owned()), ("b2".to_owned(), "a1".to_owned())].into();
        let mut v = serde_json::json!({"a1": {"b2": 1, "id": "b2", "other": "a1"}, "w": {"id": "zz"}});
        rename_ids(&mut v, &ids);
        // Keys and `id` strings renamed once each (no chains), other strings left alone.
        assert_eq!(
            v,
            serde_json::json!({"@param:w": {"a1": 1, "id": "a1", "other": "a1"}, "w": {"id": "zz"}})
        );
    }
}
