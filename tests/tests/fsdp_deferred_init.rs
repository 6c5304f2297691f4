//! Deferred, sharded initialisation (`Fsdp::wrap_deferred`): each rank creates only its rows,
//! from a seed or from a checkpoint, and the shards are exactly the single device's model.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, NdArray};
use burn_fsdp::UnitPolicy;
use burn_fsdp::init::ShardInit;
use burn_fsdp::{DeviceMesh, Fsdp, FsdpConfig, launch};
use qwen3_burn::checkpoint::{HfWeights, TensorOut};
use qwen3_burn::{Qwen3, Qwen3Config, Qwen3Init};
use tests::fixture;

type FB = Autodiff<NdArray<f32>, BalancedCheckpointing>;

/// Every parameter's full value, by name, gathered from the shards of `world` ranks that
/// each made only their own rows from `source`.
fn deferred_full(config: &Qwen3Config, world: usize, source: &dyn ShardInit) -> HashMap<String, Vec<f32>> {
    let per_rank = launch(world, Duration::from_secs(120), |group| {
        let device = Default::default();
        let skeleton = Qwen3::<FB>::new_seeded(config, Qwen3Init::new(999), &device);
        let mesh = DeviceMesh::new_1d(group, device);
        let fsdp = Fsdp::wrap_deferred(
            skeleton,
            &mesh,
            FsdpConfig { units: UnitPolicy::VecElements, ..FsdpConfig::default() },
            source,
        )?;
        fsdp.full_parameters()
    })
    .unwrap();
    per_rank[0]
        .iter()
        .map(|(name, _, data)| (name.clone(), data.clone().convert::<f32>().to_vec::<f32>().unwrap()))
        .collect()
}

fn single(model: &Qwen3<NdArray<f32>>) -> HashMap<String, Vec<f32>> {
    model
        .to_hf_tensors()
        .into_iter()
        .map(|(name, t)| match t {
            TensorOut::F32(_, v) => (name, v),
            TensorOut::I64(..) => unreachable!("a float model"),
        })
        .collect()
}

/// Shapes that leave padding at most world sizes (vocab 101, 3 KV heads of 8), untied and tied.
fn odd_configs() -> [Qwen3Config; 2] {
    let untied = Qwen3Config {
        vocab_size: 101,
        hidden_size: 24,
        intermediate_size: 40,
        num_hidden_layers: 2,
        num_attention_heads: 6,
        num_key_value_heads: 3,
        head_dim: 8,
        tie_word_embeddings: false,
        ..Qwen3Config::tiny()
    };
    [untied.clone(), Qwen3Config { tie_word_embeddings: true, ..untied }]
}

#[test]
fn seeded_shards_are_the_single_device_init_at_every_world_size() {
    for config in odd_configs() {
        let want = single(&config.init_seeded::<NdArray<f32>>(11, &Default::default()));
        for world in 1..=8 {
            let got = deferred_full(&config, world, &Qwen3Init::new(11));
            assert_eq!(got.len(), want.len());
            for (name, w) in &want {
                assert!(
                    got[name] == *w,
                    "world {world}, tied {}: `{name}` differs",
                    config.tie_word_embeddings
                );
            }
        }
        // Another seed gives another model (the test can fail).
        let other = deferred_full(&config, 2, &Qwen3Init::new(12));
        assert!(other["model.embed_tokens.weight"] != want["model.embed_tokens.weight"]);
    }
}

/// Writes `tensors` with dtype bf16 (values rounded) into `path`.
fn write_bf16(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(n, shape, v)| {
            (
                n.clone(),
                v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
                shape.clone(),
            )
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(n, b, s)| {
            (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, s.clone(), b).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn checkpoint_shards_are_read_row_by_row_from_bf16_and_sharded_checkpoints() {
    let fixture_dir = fixture("qwen3-tiny-a");
    let config = Qwen3Config::from_file(fixture_dir.join("config.json")).unwrap();
    // The fixture (f32, one file).
    let weights = HfWeights::open(&fixture_dir).unwrap();
    Qwen3::<NdArray<f32>>::check_weights(&config, &weights).unwrap();
    let want = single(&Qwen3::from_weights(&config, &weights, &Default::default()).unwrap());
    for world in [3, 4] {
        assert_eq!(deferred_full(&config, world, &weights), want, "f32 checkpoint, world {world}");
    }

    // The same weights in bf16, split over two files listed by an HF index.
    let dir = tempfile::tempdir().unwrap();
    let mut names: Vec<&String> = want.keys().collect();
    names.sort();
    let shape_of = |n: &str| weights.file_of(n).unwrap().info(n).unwrap().0;
    let mut map = serde_json::Map::new();
    let (a, b): (Vec<_>, Vec<_>) =
        names.iter().map(|n| (*n).clone()).enumerate().partition(|(i, _)| i % 2 == 0);
    for (file, part) in [("model-00001-of-00002.safetensors", a), ("model-00002-of-00002.safetensors", b)] {
        let tensors: Vec<_> = part.iter().map(|(_, n)| (n.clone(), shape_of(n), want[n].clone())).collect();
        write_bf16(&dir.path().join(file), &tensors);
        for (n, ..) in &tensors {
            map.insert(n.clone(), serde_json::Value::String(file.into()));
        }
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": map });
    std::fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).unwrap();
    let bf16 = HfWeights::open(dir.path()).unwrap();
    Qwen3::<NdArray<f32>>::check_weights(&config, &bf16).unwrap();
    let want_bf16 = single(&Qwen3::from_weights(&config, &bf16, &Default::default()).unwrap());
    assert_ne!(want_bf16, want, "bf16 rounding changes the values");
    for world in [2, 4] {
        assert_eq!(deferred_full(&config, world, &bf16), want_bf16, "bf16 sharded checkpoint, world {world}");
    }
}

#[test]
fn a_missing_or_misshapen_tensor_is_refused_by_name() {
    let fixture_dir = fixture("qwen3-tiny-a");
    let config = Qwen3Config::from_file(fixture_dir.join("config.json")).unwrap();
    let weights = HfWeights::open(&fixture_dir).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let mut tensors: Vec<(String, TensorOut)> = weights
        .names()
        .map(|n| {
            (n.to_owned(), TensorOut::F32(weights.read_f32(n).unwrap().1, weights.read_f32(n).unwrap().0))
        })
        .collect();
    tensors.retain(|(n, _)| n != "model.layers.1.mlp.up_proj.weight");
    qwen3_burn::checkpoint::write_safetensors(&path, tensors.clone(), None).unwrap();
    let missing = HfWeights::open(&path).unwrap();
    let e = Qwen3::<NdArray<f32>>::check_weights(&config, &missing).unwrap_err().to_string();
    assert!(e.contains("model.layers.1.mlp.up_proj.weight"), "{e}");
    // Unchecked, each rank's read names the parameter too (and no rank hangs).
    let e = launch(2, Duration::from_secs(60), |group| {
        let device = Default::default();
        let skeleton = Qwen3::<FB>::new_seeded(&config, Qwen3Init::new(0), &device);
        let mesh = DeviceMesh::new_1d(group, device);
        Fsdp::wrap_deferred(
            skeleton,
            &mesh,
            FsdpConfig { units: UnitPolicy::VecElements, ..FsdpConfig::default() },
            &missing,
        )
        .map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("deferred initialisation of `model.layers.1.mlp.up_proj.weight`"), "{e}");

    // A tensor of the wrong shape.
    let (name, TensorOut::F32(shape, v)) = tensors.remove(0) else { unreachable!() };
    let (wrong, cut) =
        (vec![shape[0] - 1, shape[1..].iter().product()], shape[1..].iter().product::<usize>());
    tensors.push((name.clone(), TensorOut::F32(wrong, v[cut..].to_vec())));
    qwen3_burn::checkpoint::write_safetensors(&path, tensors, None).unwrap();
    let e = Qwen3::<NdArray<f32>>::check_weights(&config, &HfWeights::open(&path).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains(&name) && e.contains("model.safetensors"), "{e}");
}
