//! Training data sources: fixed batches from a safetensors file, or synthetic tokens.

use qwen3_burn::train::Batches;

/// The fixtures' "learnable synthetic language": each next token is `(7·cur + 3) mod V` with
/// probability 0.85, otherwise uniform; the first token of each row is uniform.
pub fn synthetic_batches(steps: usize, rows: usize, seq: usize, vocab: usize, seed: u64) -> Batches {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let mut next = move || {
        // splitmix64
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let width = seq + 1;
    let v = vocab as u64;
    let mut tokens = Vec::with_capacity(steps * rows * width);
    for _ in 0..steps * rows {
        let mut cur = next() % v;
        tokens.push(cur as i64);
        for _ in 1..width {
            let keep = (next() >> 11) as f64 / (1u64 << 53) as f64 <= 0.85;
            cur = if keep { (7 * cur + 3) % v } else { next() % v };
            tokens.push(cur as i64);
        }
    }
    Batches { steps, rows, width, tokens }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_batches_follow_the_rule_mostly_and_are_seeded() {
        let b = synthetic_batches(3, 4, 64, 97, 7);
        assert_eq!(b.tokens.len(), 3 * 4 * 65);
        assert!(b.tokens.iter().all(|&t| (0..97).contains(&t)));
        let mut follows = 0;
        let mut total = 0;
        for row in b.tokens.chunks(65) {
            for w in row.windows(2) {
                total += 1;
                follows += usize::from(w[1] == (7 * w[0] + 3) % 97);
            }
        }
        let frac = follows as f64 / total as f64;
        assert!((0.8..0.9).contains(&frac), "rule followed {frac}");
        assert_eq!(b, synthetic_batches(3, 4, 64, 97, 7));
        assert_ne!(b, synthetic_batches(3, 4, 64, 97, 8));
    }
}

/// Token rows packed from a text corpus: `--data FILE.txt|FILE.jsonl` with a tokenizer.
pub mod text {
    use std::path::Path;

    use anyhow::{Context, Result, bail};
    use qwen3_burn::tokenizer::Tokenizer;
    use qwen3_burn::train::Batches;

    /// The documents of a `.txt` (one document) or `.jsonl` (one `{"text": …}` per line) file.
    pub fn read_documents(path: &Path) -> Result<Vec<String>> {
        let text = std::fs::read_to_string(path).with_context(|| format!("--data {}", path.display()))?;
        let is_jsonl = path.extension().is_some_and(|e| e == "jsonl");
        if !is_jsonl {
            return Ok(vec![text]);
        }
        let mut docs = Vec::new();
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let v: serde_json::Value = serde_json::from_str(line)
                .with_context(|| format!("--data {}: line {} is not JSON", path.display(), i + 1))?;
            match v.get("text").and_then(|t| t.as_str()) {
                Some(t) => docs.push(t.to_owned()),
                None => bail!("--data {}: line {} has no string field \"text\"", path.display(), i + 1),
            }
        }
        Ok(docs)
    }

    /// How packed rows are laid out into batches.
    #[derive(Debug, Clone, Copy)]
    pub struct Layout {
        /// Tokens per row, minus one (inputs = row[..seq], labels = row[1..]).
        pub seq: usize,
        /// Number of steps.
        pub steps: usize,
        /// Rows of the global batch per step.
        pub rows: usize,
        /// Seed of the row shuffle.
        pub seed: u64,
    }

    /// Tokenizes `docs` (each followed by `eos` when given), packs the stream into rows of
    /// `seq + 1` tokens, shuffles the rows with `seed`, and lays out `steps` batches of `rows`.
    /// `what` names the source in errors.
    pub fn pack(
        docs: &[String],
        tokenizer: &Tokenizer,
        eos: Option<u32>,
        layout: Layout,
        what: &str,
    ) -> Result<Batches> {
        let Layout { seq, steps, rows, seed } = layout;
        let mut stream: Vec<i64> = Vec::new();
        for d in docs {
            stream.extend(tokenizer.encode(d)?.into_iter().map(i64::from));
            if let Some(e) = eos {
                stream.push(e as i64);
            }
        }
        let width = seq + 1;
        let available = stream.len() / width;
        let needed = steps * rows;
        if available < needed {
            bail!(
                "{what} holds {} tokens: {available} rows of {width} (--seq {seq} + 1), but {steps} steps × {rows} rows \
                 need {needed}; lower --steps, --batch or --seq, or give more text",
                stream.len()
            );
        }
        let mut order: Vec<usize> = (0..available).collect();
        let mut state = seed ^ 0xA076_1D64_78BD_642F;
        for i in (1..order.len()).rev() {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let j = ((state >> 33) as usize) % (i + 1);
            order.swap(i, j);
        }
        let mut tokens = Vec::with_capacity(needed * width);
        for &r in &order[..needed] {
            tokens.extend_from_slice(&stream[r * width..(r + 1) * width]);
        }
        Ok(Batches { steps, rows, width, tokens })
    }
}
