//! Output items that travel between processes, so that rank 0 of a mesh of processes renders
//! the metrics of every rank's items ([`FsdpStrategy::global_metrics`](super::FsdpStrategy::global_metrics)).
//!
//! An item ([`ClassificationOutput`], [`RegressionOutput`], …, or a user's own output type) is
//! written as its tensors' bytes; every rank's bytes are all-gathered over the mesh's process
//! groups (as f32 values carrying 24 bits each, exact) and rank 0 rebuilds the other ranks'
//! items on its device.

use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_train::{ClassificationOutput, MultiLabelClassificationOutput, RegressionOutput, SequenceOutput};

use crate::comm::{CommError, ProcessGroup, Tag};

/// An output item of a `TrainStep` or `InferenceStep` that can be sent to another process:
/// its tensors out, and the item rebuilt from them.
///
/// burn-train's outputs implement it; implement it for an output type of your own to use
/// [`FsdpStrategy::global_metrics`](super::FsdpStrategy::global_metrics) with it.
///
/// # Example
///
/// ```
/// use burn::tensor::{Tensor, TensorData, backend::Backend};
/// use burn_fsdp::learner::MeshItem;
///
/// /// A regression output with only a loss.
/// struct LossOnly<B: Backend> {
///     loss: Tensor<B, 1>,
/// }
///
/// impl<B: Backend> MeshItem<B> for LossOnly<B> {
///     fn to_data(&self) -> Vec<TensorData> {
///         vec![self.loss.to_data()]
///     }
///     fn from_data(data: Vec<TensorData>, device: &B::Device) -> Result<Self, String> {
///         let [loss] = <[TensorData; 1]>::try_from(data).map_err(|d| format!("{} tensors, not 1", d.len()))?;
///         Ok(Self { loss: Tensor::from_data(loss, device) })
///     }
/// }
/// ```
pub trait MeshItem<B: Backend>: Sized {
    /// The item's tensors, in an order [`from_data`](Self::from_data) reads back.
    fn to_data(&self) -> Vec<TensorData>;
    /// The item rebuilt on `device` from the tensors [`to_data`](Self::to_data) gave (on
    /// another rank); an error names what does not fit.
    fn from_data(data: Vec<TensorData>, device: &B::Device) -> Result<Self, String>;
}

/// `data` as exactly `N` tensors, or an error naming `what`.
fn exactly<const N: usize>(data: Vec<TensorData>, what: &str) -> Result<[TensorData; N], String> {
    <[TensorData; N]>::try_from(data)
        .map_err(|d| format!("{what}: {} tensors received, {N} expected", d.len()))
}

/// Checks that `data` has rank `D` before it becomes a `Tensor<_, D>` (which would panic).
fn of_rank<const D: usize>(data: TensorData, what: &str) -> Result<TensorData, String> {
    if data.shape.num_dims() == D {
        Ok(data)
    } else {
        Err(format!(
            "{what}: a tensor of shape {:?} received where rank {D} is expected",
            data.shape.as_slice()
        ))
    }
}

fn float<B: Backend, const D: usize>(
    data: TensorData,
    device: &B::Device,
    what: &str,
) -> Result<Tensor<B, D>, String> {
    Ok(Tensor::from_data(of_rank::<D>(data, what)?, device))
}

fn int<B: Backend, const D: usize>(
    data: TensorData,
    device: &B::Device,
    what: &str,
) -> Result<Tensor<B, D, Int>, String> {
    Ok(Tensor::from_data(of_rank::<D>(data, what)?, device))
}

impl<B: Backend> MeshItem<B> for ClassificationOutput<B> {
    fn to_data(&self) -> Vec<TensorData> {
        vec![self.loss.to_data(), self.output.to_data(), self.targets.to_data()]
    }
    fn from_data(data: Vec<TensorData>, device: &B::Device) -> Result<Self, String> {
        let what = "ClassificationOutput";
        let [loss, output, targets] = exactly(data, what)?;
        Ok(Self {
            loss: float(loss, device, what)?,
            output: float(output, device, what)?,
            targets: int(targets, device, what)?,
        })
    }
}

impl<B: Backend> MeshItem<B> for MultiLabelClassificationOutput<B> {
    fn to_data(&self) -> Vec<TensorData> {
        vec![self.loss.to_data(), self.output.to_data(), self.targets.to_data()]
    }
    fn from_data(data: Vec<TensorData>, device: &B::Device) -> Result<Self, String> {
        let what = "MultiLabelClassificationOutput";
        let [loss, output, targets] = exactly(data, what)?;
        Ok(Self {
            loss: float(loss, device, what)?,
            output: float(output, device, what)?,
            targets: int(targets, device, what)?,
        })
    }
}

impl<B: Backend> MeshItem<B> for RegressionOutput<B> {
    fn to_data(&self) -> Vec<TensorData> {
        vec![self.loss.to_data(), self.output.to_data(), self.targets.to_data()]
    }
    fn from_data(data: Vec<TensorData>, device: &B::Device) -> Result<Self, String> {
        let what = "RegressionOutput";
        let [loss, output, targets] = exactly(data, what)?;
        Ok(Self {
            loss: float(loss, device, what)?,
            output: float(output, device, what)?,
            targets: float(targets, device, what)?,
        })
    }
}

impl<B: Backend> MeshItem<B> for SequenceOutput<B> {
    fn to_data(&self) -> Vec<TensorData> {
        let mut data = vec![self.loss.to_data(), self.logits.to_data(), self.targets.to_data()];
        data.extend(self.predictions.as_ref().map(|p| p.to_data()));
        data
    }
    fn from_data(data: Vec<TensorData>, device: &B::Device) -> Result<Self, String> {
        let what = "SequenceOutput";
        let mut data = data.into_iter();
        let mut next = |name: &str| data.next().ok_or_else(|| format!("{what}: no {name} received"));
        let (loss, logits, targets) = (next("loss")?, next("logits")?, next("targets")?);
        let predictions = next("predictions").ok();
        Ok(Self {
            loss: float(loss, device, what)?,
            logits: float(logits, device, what)?,
            predictions: predictions.map(|p| int(p, device, what)).transpose()?,
            targets: int(targets, device, what)?,
        })
    }
}

/// Writes `tensors` as bytes: their count, then per tensor its dtype (as serde names it), its
/// dims and its bytes, every number little-endian u64.
pub(crate) fn encode(tensors: &[TensorData]) -> Vec<u8> {
    let mut out = Vec::new();
    put(&mut out, tensors.len() as u64);
    for t in tensors {
        let dtype = serde_json::to_vec(&t.dtype).unwrap_or_default();
        put(&mut out, dtype.len() as u64);
        out.extend_from_slice(&dtype);
        put(&mut out, t.shape.num_dims() as u64);
        for &d in t.shape.iter() {
            put(&mut out, d as u64);
        }
        let bytes = t.as_bytes();
        put(&mut out, bytes.len() as u64);
        out.extend_from_slice(bytes);
    }
    out
}

/// Reads back what [`encode`] wrote; an error says where the bytes stop fitting.
pub(crate) fn decode(bytes: &[u8]) -> Result<Vec<TensorData>, String> {
    let mut r = Reader { bytes, at: 0 };
    let n = r.len("the tensor count", 1)?;
    let mut tensors = Vec::with_capacity(n);
    for i in 0..n {
        let len = r.len("a dtype's length", 1)?;
        let dtype: DType = serde_json::from_slice(r.take(len, "a dtype")?)
            .map_err(|e| format!("tensor {i}: its dtype does not read: {e}"))?;
        let rank = r.len("a rank", 8)?;
        let dims = (0..rank).map(|_| r.len("a dim", 0)).collect::<Result<Vec<_>, _>>()?;
        let len = r.len("a byte count", 1)?;
        let data = r.take(len, "a tensor's bytes")?.to_vec();
        let want = dims
            .iter()
            .chain([&dtype.size()])
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .unwrap_or(usize::MAX);
        if !matches!(dtype, DType::QFloat(_)) && data.len() != want {
            return Err(format!(
                "tensor {i}: {} bytes for dims {dims:?} of {dtype:?} ({want} expected)",
                data.len()
            ));
        }
        tensors.push(TensorData::from_bytes_vec(data, dims, dtype));
    }
    if r.at != bytes.len() {
        return Err(format!("{} bytes left over after {n} tensors", bytes.len() - r.at));
    }
    Ok(tensors)
}

fn put(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or_else(|| {
            format!("{what}: {n} bytes at offset {} of {} do not fit", self.at, self.bytes.len())
        })?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    /// A u64 read as a count of things each at least `unit` bytes long still to come (so
    /// that a corrupt count is refused before anything is allocated for it).
    fn len(&mut self, what: &str, unit: usize) -> Result<usize, String> {
        let b = self.take(8, what)?;
        let v = u64::from_le_bytes(b.try_into().map_err(|_| format!("{what}: short"))?);
        let left = (self.bytes.len() - self.at) as u64;
        if unit > 0 && v.saturating_mul(unit as u64) > left {
            return Err(format!("{what} {v} does not fit in the {left} bytes left"));
        }
        usize::try_from(v).map_err(|_| format!("{what} {v} is too large"))
    }
}

/// Every rank's `mine`, in global rank order (row-major over `groups`, outermost first):
/// all-gathered over each group from the innermost out, so every rank gets all of them.
pub(crate) fn all_gather_bytes<B: Backend>(
    groups: &[Arc<dyn ProcessGroup<B>>],
    mine: Vec<u8>,
    tag: &Tag,
    device: &B::Device,
) -> Result<Vec<Vec<u8>>, CommError> {
    let mut blobs = vec![mine];
    for group in groups.iter().rev() {
        let packed = pack(&blobs);
        let mut next = Vec::new();
        for blob in gather_one(group.as_ref(), &packed, tag, device)? {
            next.extend(unpack(&blob).map_err(|msg| bad(group.as_ref(), tag, msg))?);
        }
        blobs = next;
    }
    Ok(blobs)
}

/// `blobs` as one: each length-prefixed.
fn pack(blobs: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for b in blobs {
        put(&mut out, b.len() as u64);
        out.extend_from_slice(b);
    }
    out
}

fn unpack(bytes: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let mut r = Reader { bytes, at: 0 };
    let mut out = Vec::new();
    while r.at < bytes.len() {
        let n = r.len("a packed item's length", 1)?;
        out.push(r.take(n, "a packed item")?.to_vec());
    }
    Ok(out)
}

fn bad<B: Backend>(group: &dyn ProcessGroup<B>, tag: &Tag, msg: String) -> CommError {
    CommError::BadInput {
        kind: crate::comm::CollectiveKind::AllGather,
        tag: tag.clone(),
        rank: group.rank(),
        msg,
    }
}

/// Bytes per f32 value on the wire: 24 bits, which f32 holds exactly.
const PER_VALUE: usize = 3;

/// Every rank of `group`'s `bytes` (lengths may differ): the lengths first, then the bytes
/// padded to the longest.
fn gather_one<B: Backend>(
    group: &dyn ProcessGroup<B>,
    bytes: &[u8],
    tag: &Tag,
    device: &B::Device,
) -> Result<Vec<Vec<u8>>, CommError> {
    let len = bytes.len() as u64;
    let lens = to_values(group.all_gather(values(&[len & 0xff_ffff, len >> 24], device), tag)?)
        .map_err(|msg| bad(group, tag, msg))?;
    let lens: Vec<usize> =
        lens.chunks_exact(2).map(|c| (c[0] as u64 | ((c[1] as u64) << 24)) as usize).collect();
    let longest = lens.iter().copied().max().unwrap_or(0);
    let per_rank = longest.div_ceil(PER_VALUE);
    let mut pieces: Vec<u64> = bytes
        .chunks(PER_VALUE)
        .map(|c| c.iter().enumerate().fold(0u64, |acc, (i, &b)| acc | (u64::from(b) << (8 * i))))
        .collect();
    pieces.resize(per_rank, 0);
    if per_rank == 0 {
        return Ok(lens.iter().map(|_| Vec::new()).collect());
    }
    let all =
        to_values(group.all_gather(values(&pieces, device), tag)?).map_err(|msg| bad(group, tag, msg))?;
    Ok(all
        .chunks_exact(per_rank)
        .zip(&lens)
        .map(|(chunk, &len)| {
            let mut b: Vec<u8> = chunk
                .iter()
                .flat_map(|&v| (0..PER_VALUE).map(move |i| ((v as u32) >> (8 * i)) as u8))
                .collect();
            b.truncate(len);
            b
        })
        .collect())
}

/// `pieces` (each below 2^24) as an f32 tensor.
fn values<B: Backend>(pieces: &[u64], device: &B::Device) -> Tensor<B, 1> {
    let v: Vec<f32> = pieces.iter().map(|&p| p as f32).collect();
    let n = v.len();
    Tensor::from_data(TensorData::new(v, [n]), (device, DType::F32))
}

fn to_values<B: Backend>(t: Tensor<B, 1>) -> Result<Vec<f32>, String> {
    t.into_data().convert::<f32>().to_vec::<f32>().map_err(|e| format!("{e:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::local::launch;
    use burn::backend::NdArray;
    use std::time::Duration;

    type B = NdArray<f32>;

    #[test]
    fn items_survive_the_wire_and_corrupt_bytes_are_errors() {
        let device = Default::default();
        let out = ClassificationOutput::<B> {
            loss: Tensor::from_floats([0.75], &device),
            output: Tensor::from_floats([[0.1, -2.5], [3.0, 1e-7]], &device),
            targets: Tensor::from_ints([1, 0], &device),
        };
        let bytes = encode(&out.to_data());
        let back = ClassificationOutput::<B>::from_data(decode(&bytes).unwrap(), &device).unwrap();
        assert_eq!(back.output.to_data(), out.output.to_data());
        assert_eq!(back.targets.to_data(), out.targets.to_data());
        assert_eq!(back.loss.to_data(), out.loss.to_data());
        for cut in [0, 7, 8, bytes.len() / 2, bytes.len() - 1] {
            assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = bytes.clone();
        long[0] = 0xff; // a tensor count nothing could hold
        assert!(decode(&long).unwrap_err().contains("does not fit"));
        let wrong = RegressionOutput::<B>::from_data(decode(&bytes).unwrap(), &device);
        assert!(wrong.is_err(), "int targets where float rank-2 targets are expected fit by luck only");
        let two = ClassificationOutput::<B>::from_data(decode(&bytes).unwrap()[..2].to_vec(), &device);
        assert!(two.err().unwrap().contains("2 tensors received, 3 expected"));
    }

    #[test]
    fn bytes_of_every_length_reach_every_rank_over_a_2d_mesh() {
        let new = |w: usize| crate::comm::local::LocalGroup::new_group(w, Duration::from_secs(10));
        // A 2 × 3 mesh of separate local groups: rank r = o·3 + i is in row o (the inner
        // group, size 3) and column i (the outer group, size 2).
        let rows = [new(3), new(3)];
        let cols = [new(2), new(2), new(2)];
        // Rank r sends r·7 + 1 bytes (uneven, mostly not a multiple of 3) covering every byte value.
        let mine = |r: usize| (0..r * 7 + 1).map(|i| ((i * 37 + r * 101) % 256) as u8).collect::<Vec<u8>>();
        let got: Vec<Vec<Vec<u8>>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..6)
                .map(|r| {
                    let (o, i) = (r / 3, r % 3);
                    let groups: Vec<Arc<dyn ProcessGroup<B>>> = vec![cols[i][o].clone(), rows[o][i].clone()];
                    let bytes = mine(r);
                    s.spawn(move || {
                        all_gather_bytes(&groups, bytes, &Tag::new("t"), &Default::default()).unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let want: Vec<Vec<u8>> = (0..6).map(mine).collect();
        for (r, g) in got.iter().enumerate() {
            assert_eq!(g, &want, "rank {r}");
        }
        // A group of one, and an empty item.
        let one = launch(1, Duration::from_secs(5), |g| {
            let groups: Vec<Arc<dyn ProcessGroup<B>>> = vec![g];
            all_gather_bytes(&groups, Vec::new(), &Tag::new("t"), &Default::default())
        })
        .unwrap();
        assert_eq!(one, vec![vec![Vec::<u8>::new()]]);
    }
}
