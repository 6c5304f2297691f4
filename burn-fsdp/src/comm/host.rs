//! Host reductions shared by the host-buffer transports ([`LocalGroup`](crate::comm::local::LocalGroup),
//! [`TcpGroup`](crate::comm::tcp::TcpGroup) and, with the `mpi` feature, `MpiGroup`).
//!
//! Every transport reduces the ranks' little-endian element bytes in rank order with the same
//! loop, so they give bit-identical results: `((p₀ + p₁) + p₂) + …`, then one division by the
//! number of ranks for [`ReduceOp::Avg`]. bf16 and f16 are widened to f32, reduced, and
//! rounded once.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};

use crate::comm::ReduceOp;

/// The one-byte code of the dtypes the host transports (MPI, TCP) carry, for their message
/// headers; `None` for the others.
pub(crate) fn dtype_code(d: DType) -> Option<u8> {
    Some(match d {
        DType::F64 => 1,
        DType::F32 => 2,
        DType::F16 => 3,
        DType::BF16 => 4,
        DType::I64 => 5,
        DType::I32 => 6,
        _ => return None,
    })
}

/// The dtype of a [`dtype_code`].
pub(crate) fn dtype_of_code(c: u8) -> Option<DType> {
    [DType::F64, DType::F32, DType::F16, DType::BF16, DType::I64, DType::I32]
        .into_iter()
        .find(|d| dtype_code(*d) == Some(c))
}

/// The host bytes of a 1D tensor, with its dtype and length.
pub(crate) fn to_bytes<B: Backend>(t: Tensor<B, 1>) -> (Vec<u8>, DType, usize) {
    let n = t.shape().num_elements();
    let data = t.into_data();
    let dtype = data.dtype;
    (data.into_bytes().to_vec(), dtype, n)
}

/// A 1D tensor of `n` elements of `dtype` from host bytes.
pub(crate) fn from_bytes<B: Backend>(
    bytes: Vec<u8>,
    n: usize,
    dtype: DType,
    device: &B::Device,
) -> Tensor<B, 1> {
    Tensor::from_data(TensorData::from_bytes_vec(bytes, [n], dtype), (device, dtype))
}

/// Elements reduced per block, so that the accumulator stays in cache and the output is
/// written once.
const BLOCK: usize = 4096;

/// An element type that can be decoded from and encoded to little-endian bytes, with the
/// type the reduction accumulates in.
trait HostElem {
    const SIZE: usize;
    type Acc: Copy + std::ops::Add<Output = Self::Acc> + std::ops::Div<Output = Self::Acc> + PartialOrd;
    fn load(b: &[u8]) -> Self::Acc;
    fn store(v: Self::Acc, out: &mut Vec<u8>);
    fn from_count(n: usize) -> Self::Acc;
}

struct F32;
struct F64;
struct Bf16;
struct F16;

impl HostElem for F32 {
    const SIZE: usize = 4;
    type Acc = f32;
    fn load(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
    fn store(v: f32, out: &mut Vec<u8>) {
        out.extend_from_slice(&v.to_le_bytes());
    }
    fn from_count(n: usize) -> f32 {
        n as f32
    }
}

impl HostElem for F64 {
    const SIZE: usize = 8;
    type Acc = f64;
    fn load(b: &[u8]) -> f64 {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[..8]);
        f64::from_le_bytes(a)
    }
    fn store(v: f64, out: &mut Vec<u8>) {
        out.extend_from_slice(&v.to_le_bytes());
    }
    fn from_count(n: usize) -> f64 {
        n as f64
    }
}

impl HostElem for Bf16 {
    const SIZE: usize = 2;
    type Acc = f32;
    fn load(b: &[u8]) -> f32 {
        half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
    }
    fn store(v: f32, out: &mut Vec<u8>) {
        out.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes());
    }
    fn from_count(n: usize) -> f32 {
        n as f32
    }
}

impl HostElem for F16 {
    const SIZE: usize = 2;
    type Acc = f32;
    fn load(b: &[u8]) -> f32 {
        half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
    }
    fn store(v: f32, out: &mut Vec<u8>) {
        out.extend_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
    }
    fn from_count(n: usize) -> f32 {
        n as f32
    }
}

/// The fast path for f32 and f64 parts that are aligned (as a backend's host data is): the
/// same operations in the same order on typed slices.
fn fold_typed<T>(parts: &[&[u8]], op: ReduceOp) -> Option<Vec<T>>
where
    T: bytemuck::Pod + std::ops::Add<Output = T> + std::ops::Div<Output = T> + PartialOrd + FromCount,
{
    let slices =
        parts.iter().map(|p| bytemuck::try_cast_slice::<u8, T>(p)).collect::<Result<Vec<_>, _>>().ok()?;
    let n = slices[0].len();
    let divisor = T::from_count(parts.len());
    let mut acc: Vec<T> = Vec::with_capacity(n);
    for start in (0..n).step_by(BLOCK) {
        let end = (start + BLOCK).min(n);
        acc.extend_from_slice(&slices[0][start..end]);
        let block = &mut acc[start..end];
        for s in &slices[1..] {
            let s = &s[start..end];
            match op {
                ReduceOp::Sum | ReduceOp::Avg => block.iter_mut().zip(s).for_each(|(a, b)| *a = *a + *b),
                ReduceOp::Max => {
                    block.iter_mut().zip(s).for_each(|(a, b)| *a = if *a >= *b { *a } else { *b })
                }
            }
        }
        if op == ReduceOp::Avg {
            block.iter_mut().for_each(|a| *a = *a / divisor);
        }
    }
    Some(acc)
}

/// `n as T` for the divisor of a mean.
trait FromCount {
    fn from_count(n: usize) -> Self;
}

impl FromCount for f32 {
    fn from_count(n: usize) -> Self {
        n as f32
    }
}

impl FromCount for f64 {
    fn from_count(n: usize) -> Self {
        n as f64
    }
}

fn fold<E: HostElem>(parts: &[&[u8]], op: ReduceOp, out: &mut Vec<u8>) {
    let n = parts[0].len() / E::SIZE;
    let divisor = E::from_count(parts.len());
    let mut acc: Vec<E::Acc> = Vec::with_capacity(BLOCK.min(n));
    for start in (0..n).step_by(BLOCK) {
        let end = (start + BLOCK).min(n);
        acc.clear();
        acc.extend(parts[0][start * E::SIZE..end * E::SIZE].chunks_exact(E::SIZE).map(E::load));
        for p in &parts[1..] {
            let p = &p[start * E::SIZE..end * E::SIZE];
            for (a, b) in acc.iter_mut().zip(p.chunks_exact(E::SIZE)) {
                let b = E::load(b);
                *a = match op {
                    ReduceOp::Sum | ReduceOp::Avg => *a + b,
                    ReduceOp::Max => {
                        if *a >= b {
                            *a
                        } else {
                            b
                        }
                    }
                };
            }
        }
        for a in &acc {
            let v = if op == ReduceOp::Avg { *a / divisor } else { *a };
            E::store(v, out);
        }
    }
}

/// Reduces the ranks' `parts` (equal-length little-endian element bytes of `dtype`, in rank
/// order) into one buffer of the same length.
///
/// Errors for dtypes other than f32, f64, bf16 and f16, and for parts of different or
/// partial-element lengths.
pub fn reduce_bytes(parts: &[&[u8]], dtype: DType, op: ReduceOp) -> Result<Vec<u8>, String> {
    let Some(first) = parts.first() else {
        return Err("nothing to reduce".to_owned());
    };
    let len = first.len();
    if let Some(r) = parts.iter().position(|p| p.len() != len) {
        return Err(format!("rank {r} contributed {} bytes, rank 0 {len}", parts[r].len()));
    }
    if !len.is_multiple_of(dtype.size()) {
        return Err(format!("{len} bytes are not a whole number of {dtype:?} elements"));
    }
    if cfg!(target_endian = "little") {
        let typed = match dtype {
            DType::F32 => fold_typed::<f32>(parts, op).map(|acc| bytemuck::cast_slice(&acc).to_vec()),
            DType::F64 => fold_typed::<f64>(parts, op).map(|acc| bytemuck::cast_slice(&acc).to_vec()),
            _ => None,
        };
        if let Some(bytes) = typed {
            return Ok(bytes);
        }
    }
    let mut out = Vec::with_capacity(len);
    match dtype {
        DType::F32 => fold::<F32>(parts, op, &mut out),
        DType::F64 => fold::<F64>(parts, op, &mut out),
        DType::BF16 => fold::<Bf16>(parts, op, &mut out),
        DType::F16 => fold::<F16>(parts, op, &mut out),
        other => return Err(format!("cannot reduce tensors of dtype {other:?}")),
    }
    Ok(out)
}

/// [`reduce_bytes`] as tensor data of `n` elements: aligned `f32`/`f64` parts are reduced
/// straight into the tensor's own vector (`TensorData::from_bytes_vec` would copy a byte
/// vector once more, into memory of the alignment a backend wants).
pub fn reduce_to_data(parts: &[&[u8]], dtype: DType, op: ReduceOp, n: usize) -> Result<TensorData, String> {
    let whole = !parts.is_empty() && parts.iter().all(|p| p.len() == n * dtype.size());
    if cfg!(target_endian = "little") && whole {
        let data = match dtype {
            DType::F32 => fold_typed::<f32>(parts, op).map(|acc| TensorData::new(acc, [n])),
            DType::F64 => fold_typed::<f64>(parts, op).map(|acc| TensorData::new(acc, [n])),
            _ => None,
        };
        if let Some(data) = data {
            return Ok(data);
        }
    }
    reduce_bytes(parts, dtype, op).map(|bytes| TensorData::from_bytes_vec(bytes, [n], dtype))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn back(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    #[test]
    fn sums_in_rank_order() {
        // 1e8 + 1 - 1e8 depends on the order: rank order gives 0 in f32.
        let a = f32s(&[1e8, 1.0]);
        let b = f32s(&[1.0, 2.0]);
        let c = f32s(&[-1e8, 3.0]);
        let out = reduce_bytes(&[&a, &b, &c], DType::F32, ReduceOp::Sum).unwrap();
        assert_eq!(back(&out), vec![(1e8f32 + 1.0) - 1e8, 6.0]);
        let avg = reduce_bytes(&[&a, &b, &c], DType::F32, ReduceOp::Avg).unwrap();
        assert_eq!(back(&avg)[1], 2.0);
        let max = reduce_bytes(&[&a, &b, &c], DType::F32, ReduceOp::Max).unwrap();
        assert_eq!(back(&max), vec![1e8, 3.0]);
    }

    /// `reduce_to_data` gives `reduce_bytes`'s bytes as tensor data, for aligned and misaligned
    /// parts, f32 and bf16, and reports the same errors.
    #[test]
    fn reduce_to_data_equals_reduce_bytes() {
        let a = f32s(&(0..300).map(|i| i as f32 * 0.1 - 7.0).collect::<Vec<_>>());
        let b = f32s(&(0..300).map(|i| 1e6 / (i as f32 + 1.0)).collect::<Vec<_>>());
        let mut shifted = vec![0u8; a.len() + 1];
        shifted[1..].copy_from_slice(&a);
        for parts in [[&a[..], &b[..]], [&shifted[1..], &b[..]]] {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                let bytes = reduce_bytes(&parts, DType::F32, op).unwrap();
                let data = reduce_to_data(&parts, DType::F32, op, 300).unwrap();
                assert_eq!((data.as_bytes(), data.shape.clone()), (&bytes[..], vec![300].into()), "{op:?}");
            }
        }
        let h: Vec<u8> = (0..8u8).collect();
        let data = reduce_to_data(&[&h, &h], DType::BF16, ReduceOp::Sum, 4).unwrap();
        assert_eq!(data.as_bytes(), &reduce_bytes(&[&h, &h], DType::BF16, ReduceOp::Sum).unwrap()[..]);
        assert!(reduce_to_data(&[], DType::F32, ReduceOp::Sum, 0).is_err(), "nothing to reduce");
        assert!(reduce_to_data(&[&a, &b[..8]], DType::F32, ReduceOp::Sum, 300).is_err(), "unequal parts");
    }

    #[test]
    fn longer_than_a_block() {
        let n = BLOCK * 2 + 7;
        let a: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..n).map(|i| 2.0 * i as f32).collect();
        let out = reduce_bytes(&[&f32s(&a), &f32s(&b)], DType::F32, ReduceOp::Sum).unwrap();
        assert_eq!(back(&out), (0..n).map(|i| 3.0 * i as f32).collect::<Vec<_>>());
    }

    #[test]
    fn bf16_accumulates_in_f32_and_rounds_once() {
        let enc = |v: &[f32]| -> Vec<u8> {
            v.iter().flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes()).collect()
        };
        // 256 + 1 + 1 is 258 in f32 (exact in bf16) but 256 when each step rounds to bf16.
        let parts = [enc(&[256.0]), enc(&[1.0]), enc(&[1.0])];
        let refs: Vec<&[u8]> = parts.iter().map(|p| p.as_slice()).collect();
        let out = reduce_bytes(&refs, DType::BF16, ReduceOp::Sum).unwrap();
        assert_eq!(half::bf16::from_bits(u16::from_le_bytes([out[0], out[1]])).to_f32(), 258.0);
    }

    #[test]
    fn errors_name_the_problem() {
        let a = f32s(&[1.0]);
        let b = f32s(&[1.0, 2.0]);
        assert!(reduce_bytes(&[&a, &b], DType::F32, ReduceOp::Sum).unwrap_err().contains("rank 1"));
        assert!(reduce_bytes(&[&a], DType::I32, ReduceOp::Sum).unwrap_err().contains("I32"));
        assert!(reduce_bytes(&[&a[..3]], DType::F32, ReduceOp::Sum).unwrap_err().contains("whole number"));
    }
}
