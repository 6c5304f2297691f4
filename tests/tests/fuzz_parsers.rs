//! Hostile files (issue #44): a seeded mutation fuzzer over every parser of user files —
//! safetensors (weights and the batches file), a sharded checkpoint's `index.json`, the HF
//! `config.json` and the tokenizer. 10 000 mutated inputs each (bit flips, bytes overwritten
//! with delimiters, truncations, insertions, duplicated spans, huge and negative numbers, a
//! header length pointing past the file, deep nesting). Every input must give `Ok` or an
//! error naming the file: never a panic, a hang (each case is timed), or an allocation beyond
//! a small multiple of the file's size (a counting allocator: in the `memory` test binary,
//! whose tests run one at a time).
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use burn_fsdp::io::{SafetensorsFile, TensorOut, write_safetensors};

const CASES: usize = 10_000;

/// What qwen3-burn's tokenizer loader says of a panic of the `tokenizers` crate it caught.
const CAUGHT_PANIC: &str = "the tokenizers crate panicked";

/// xorshift64*: the fuzzer's only randomness, seeded per parser (a failure reproduces).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const NUMBERS: &[&str] = &[
    "0",
    "-1",
    "18446744073709551615",
    "9223372036854775807",
    "1e308",
    "-1e308",
    "4294967296",
    "3.5",
    "NaN",
];
const BYTES: &[u8] = b"\0\xff{}[]\",:0-9e ";

/// One mutation of `seed_bytes`.
fn mutate(rng: &mut Rng, seed: &[u8], safetensors: bool) -> Vec<u8> {
    let mut v = seed.to_vec();
    let rounds = 1 + rng.below(3);
    for _ in 0..rounds {
        let len = v.len().max(1);
        match rng.below(9) {
            0 => {
                let i = rng.below(len);
                if let Some(b) = v.get_mut(i) {
                    *b ^= 1 << rng.below(8);
                }
            }
            1 => {
                let i = rng.below(len);
                if let Some(b) = v.get_mut(i) {
                    *b = BYTES[rng.below(BYTES.len())];
                }
            }
            2 => v.truncate(rng.below(len)),
            3 => {
                let i = rng.below(len + 1).min(v.len());
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                v.splice(i..i, bytes);
            }
            4 => {
                // A span repeated: duplicated keys, repeated tensors.
                let a = rng.below(len).min(v.len());
                let b = (a + 1 + rng.below(64)).min(v.len());
                let span = v[a..b].to_vec();
                v.splice(b..b, span);
            }
            5 => {
                // A number replaced by a huge, negative or fractional one.
                let digits: Vec<usize> = (0..v.len()).filter(|&i| v[i].is_ascii_digit()).collect();
                if let Some(&i) = digits.get(rng.below(digits.len().max(1))) {
                    let end = (i..v.len()).find(|&j| !v[j].is_ascii_digit()).unwrap_or(v.len());
                    let n = NUMBERS[rng.below(NUMBERS.len())].as_bytes().to_vec();
                    v.splice(i..end, n);
                }
            }
            6 if safetensors && v.len() >= 8 => {
                // The header length: past the file, huge, or off by a little.
                let real = u64::from_le_bytes(v[..8].try_into().unwrap());
                let n = match rng.below(4) {
                    0 => u64::MAX,
                    1 => real.saturating_add(1 + rng.below(1 << 20) as u64),
                    2 => real.saturating_sub(1 + rng.below(8) as u64),
                    _ => rng.next(),
                };
                v[..8].copy_from_slice(&n.to_le_bytes());
            }
            7 => {
                // Deep nesting.
                let i = rng.below(len + 1).min(v.len());
                let depth = 1 + rng.below(100_000);
                v.splice(i..i, std::iter::repeat_n(b'[', depth));
            }
            _ => {
                let i = rng.below(len);
                let j = rng.below(len);
                if i < v.len() && j < v.len() {
                    v.swap(i, j);
                }
            }
        }
    }
    v
}

/// Runs `parse` on `CASES` mutations of `seed`, written to `file`: each ends in `Ok` or an
/// error whose message names the file, within a second and a bounded allocation.
fn fuzz(
    name: &str,
    seed_value: u64,
    seed: &[u8],
    file: &Path,
    safetensors: bool,
    parse: &dyn Fn(&Path) -> Result<(), String>,
) {
    let _serial = tests::alloc::exclusive();
    assert!(parse(&write(file, seed)).is_ok(), "{name}: the seed input parses");
    let mut rng = Rng(seed_value);
    let (mut ok, mut errors, mut caught_panics) = (0, 0, 0);
    let needle = file.file_name().unwrap().to_string_lossy().to_string();
    let start = Instant::now();
    for case in 0..CASES {
        let input = mutate(&mut rng, seed, safetensors);
        write(file, &input);
        let before = tests::alloc::live();
        tests::alloc::reset_peak();
        let t = Instant::now();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| parse(file)));
        let took = t.elapsed();
        let grew = tests::alloc::peak() - before;
        let context = || {
            format!(
                "{name}, case {case} (seed {seed_value}), {} bytes: {:?}",
                input.len(),
                String::from_utf8_lossy(&input[..input.len().min(200)])
            )
        };
        // A panic the loader caught (`tokenizers`' own) allocates for its unwinding and
        // backtrace, not for the file: that case is exempt from the bound, and counted.
        let caught = matches!(&outcome, Ok(Err(msg)) if msg.contains(CAUGHT_PANIC));
        match outcome {
            Ok(Ok(())) => ok += 1,
            Ok(Err(msg)) => {
                assert!(msg.contains(&needle), "{}: the error does not name the file: {msg}", context());
                errors += 1;
            }
            Err(_) => panic!("{}: the parser panicked", context()),
        }
        assert!(took < Duration::from_secs(1), "{}: took {took:?}", context());
        let bound = 64 * input.len() as isize + (4 << 20);
        caught_panics += usize::from(caught);
        assert!(
            caught || grew <= bound,
            "{}: allocated {grew} bytes for a {}-byte file",
            context(),
            input.len()
        );
    }
    eprintln!(
        "{name}: {CASES} mutated inputs in {:.1} s: {ok} parsed, {errors} errors naming the file \
         ({caught_panics} of them a panic of a dependency, caught)",
        start.elapsed().as_secs_f64()
    );
}

fn write(path: &Path, bytes: &[u8]) -> PathBuf {
    std::fs::write(path, bytes).unwrap();
    path.to_path_buf()
}

fn fixture(rel: &str) -> Vec<u8> {
    std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(rel)).unwrap()
}

#[test]
fn safetensors_weights() {
    let dir = tempfile::tempdir().unwrap();
    let seed_file = dir.path().join("seed.safetensors");
    write_safetensors(
        &seed_file,
        vec![
            ("a.weight".into(), TensorOut::F32(vec![3, 4], (0..12).map(|i| i as f32).collect())),
            ("b".into(), TensorOut::F32(vec![5], vec![1.0; 5])),
            ("ids".into(), TensorOut::I64(vec![2, 2], vec![1, 2, 3, 4])),
        ],
        None,
    )
    .unwrap();
    let seed = std::fs::read(&seed_file).unwrap();
    fuzz("safetensors", 1, &seed, &dir.path().join("model.safetensors"), true, &|p| {
        let f = SafetensorsFile::open(p).map_err(|e| e.to_string())?;
        for name in f.names().map_err(|e| e.to_string())? {
            match f.read_f32(&name) {
                Ok(_) => {}
                Err(e) => {
                    let e = e.to_string();
                    // Integer tensors are read with read_i64.
                    f.read_i64(&name).map_err(|e2| format!("{e}; {e2}"))?;
                }
            }
        }
        Ok(())
    });
}

#[test]
fn batches_file() {
    let dir = tempfile::tempdir().unwrap();
    let seed_file = dir.path().join("seed.safetensors");
    write_safetensors(
        &seed_file,
        vec![("tokens".into(), TensorOut::I64(vec![2, 2, 5], (0..20).collect()))],
        None,
    )
    .unwrap();
    let seed = std::fs::read(&seed_file).unwrap();
    fuzz("batches", 2, &seed, &dir.path().join("batches.safetensors"), true, &|p| {
        qwen3_burn::train::Batches::load(p).map(|_| ()).map_err(|e| e.to_string())
    });
}

#[test]
fn hf_config_json() {
    let dir = tempfile::tempdir().unwrap();
    let seed = fixture("qwen3-tiny-a/config.json");
    fuzz("config.json", 3, &seed, &dir.path().join("config.json"), false, &|p| {
        qwen3_burn::Qwen3Config::from_file(p).map(|_| ()).map_err(|e| e.to_string())
    });
}

#[test]
fn checkpoint_index_json() {
    use burn::backend::{Autodiff, NdArray};
    use burn::module::Module;
    use burn_fsdp::{DeviceMesh, Fsdp, FsdpConfig, TorchAdamWConfig};
    #[derive(Module, Debug)]
    struct Net<B: burn::tensor::backend::Backend> {
        w: burn::nn::Linear<B>,
    }
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    {
        let ckpt = ckpt.clone();
        burn_fsdp::launch(1, Duration::from_secs(30), move |group| {
            let device = Default::default();
            let model = Net::<Autodiff<NdArray<f32>>> { w: burn::nn::LinearConfig::new(3, 2).init(&device) };
            let mesh = DeviceMesh::new_1d(group, device);
            let fsdp = Fsdp::wrap(model, &mesh, FsdpConfig::default())?;
            let optim = TorchAdamWConfig::default().init();
            fsdp.save_sharded(&ckpt, &optim, 1, &serde_json::json!({"model": "net"}))
                .map_err(|e| burn_fsdp::FsdpError::Config(e.to_string()))
        })
        .unwrap();
    }
    let index = ckpt.join("index.json");
    let seed = std::fs::read(&index).unwrap();
    fuzz("index.json", 4, &seed, &index, false, &|p| {
        let dir = p.parent().unwrap();
        burn_fsdp::checkpoint::read_index(dir).map_err(|e| e.to_string())?;
        burn_fsdp::checkpoint::CheckpointReader::open(dir).map(|_| ()).map_err(|e| e.to_string())
    });
}

#[test]
fn tokenizer_json() {
    // A small word-level tokenizer of the `tokenizers` format (the real Qwen3 tokenizer is
    // 11 MB: 10 000 parses of it would take minutes).
    let seed = br#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[{"id":0,"content":"<unk>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],"normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,"model":{"type":"WordLevel","vocab":{"<unk>":0,"hello":1,"world":2,"fsdp":3},"unk_token":"<unk>"}}"#;
    let dir = tempfile::tempdir().unwrap();
    fuzz("tokenizer.json", 5, seed, &dir.path().join("tokenizer.json"), false, &|p| {
        let t = qwen3_burn::tokenizer::Tokenizer::from_file(p).map_err(|e| e.to_string())?;
        t.encode("hello fsdp world").map(|_| ()).map_err(|e| e.to_string())
    });
}
