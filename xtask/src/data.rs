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
