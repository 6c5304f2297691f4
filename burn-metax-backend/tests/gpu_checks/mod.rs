//! Checks shared by the real-GPU test tiers (tier 3: `CudaProxy`, tier 4: `Metax`): Burn ops and a
//! backward pass on the backend under test against NdArray, copies through the server, and the
//! ordering of work written from several threads (streams).
#![allow(dead_code)]

use burn::backend::{Autodiff, NdArray};
use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, ElementConversion, Tensor, TensorData};
use burn_metax_backend::runtime::{DriverRuntime, Platform};
use cubecl_runtime::runtime::Runtime;

/// Deterministic pseudo-random values in [-1, 1).
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Asserts `got` ≈ `want` (relative error, floored at 1 in magnitude).
pub fn assert_close(name: &str, got: TensorData, want: TensorData, tolerance: f32) {
    assert_eq!(got.shape, want.shape, "{name}: shape");
    let got: Vec<f32> = got.to_vec().expect("f32 data");
    let want: Vec<f32> = want.to_vec().expect("f32 data");
    let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs() / b.abs().max(1.0)).fold(0f32, f32::max);
    assert!(worst <= tolerance, "{name}: max relative error {worst} > {tolerance}");
    eprintln!("{name}: ok (max relative error {worst:e})");
}

fn tensor<B: Backend, const D: usize>(shape: [usize; D], seed: u64, device: &B::Device) -> Tensor<B, D> {
    let n = shape.iter().product();
    Tensor::from_data(TensorData::new(values(n, seed), shape), device)
}

/// add, matmul, softmax, sum and sum_dim on `G` match NdArray.
pub fn ops_match_ndarray<G: Backend>(device: &G::Device) {
    type C = NdArray;
    let cpu = Default::default();

    let (a, b) = (tensor::<G, 1>([1000], 1, device), tensor::<G, 1>([1000], 2, device));
    let (ca, cb) = (tensor::<C, 1>([1000], 1, &cpu), tensor::<C, 1>([1000], 2, &cpu));
    assert_close("add", (a + b).into_data(), (ca + cb).into_data(), 1e-6);

    let (x, w) = (tensor::<G, 2>([64, 96], 3, device), tensor::<G, 2>([96, 48], 4, device));
    let (cx, cw) = (tensor::<C, 2>([64, 96], 3, &cpu), tensor::<C, 2>([96, 48], 4, &cpu));
    assert_close("matmul", x.matmul(w).into_data(), cx.matmul(cw).into_data(), 1e-4);

    let s = tensor::<G, 2>([8, 333], 5, device);
    let cs = tensor::<C, 2>([8, 333], 5, &cpu);
    assert_close("softmax", softmax(s, 1).into_data(), softmax(cs, 1).into_data(), 1e-5);

    let r = tensor::<G, 1>([100_000], 6, device);
    let cr = tensor::<C, 1>([100_000], 6, &cpu);
    assert_close("sum", r.sum().into_data(), cr.sum().into_data(), 1e-4);
    let m = tensor::<G, 3>([4, 16, 70], 7, device);
    let cm = tensor::<C, 3>([4, 16, 70], 7, &cpu);
    assert_close("sum_dim", m.sum_dim(2).into_data(), cm.sum_dim(2).into_data(), 1e-4);

    let uniform = Tensor::<G, 1>::random([1 << 16], Distribution::Uniform(0.0, 1.0), device);
    let mean: f32 = uniform.mean().into_scalar().elem();
    assert!((0.4..0.6).contains(&mean), "uniform mean {mean}");
}

/// The gradient of `sum(softmax(x·w)²)` with respect to `w` on `Autodiff<G>` matches NdArray.
pub fn gradients_match_ndarray<G: Backend>(device: &G::Device) {
    type C = Autodiff<NdArray>;
    let cpu = Default::default();

    let x = tensor::<Autodiff<G>, 2>([16, 32], 11, device);
    let w = tensor::<Autodiff<G>, 2>([32, 8], 12, device).require_grad();
    let loss = softmax(x.matmul(w.clone()), 1).powf_scalar(2.0).sum();
    let grads = loss.backward();
    let gw = w.grad(&grads).expect("grad");

    let cx = tensor::<C, 2>([16, 32], 11, &cpu);
    let cw = tensor::<C, 2>([32, 8], 12, &cpu).require_grad();
    let closs = softmax(cx.matmul(cw.clone()), 1).powf_scalar(2.0).sum();
    let cgrads = closs.backward();
    let cgw = cw.grad(&cgrads).expect("grad");
    assert_close("grad", gw.into_data(), cgw.into_data(), 1e-4);
}

/// Round trips through the server, and buffers written from 8 threads (streams) read back from
/// another.
pub fn copies_round_trip_and_streams_are_ordered<P: Platform>(device: &P::Device) {
    let client = DriverRuntime::<P>::try_client(device).expect("client");
    for len in [1usize, 1000, 1 << 24] {
        let data: Vec<u8> = (0..len).map(|i| (i * 7 % 253) as u8).collect();
        let handle = client.create_from_slice(&data);
        assert_eq!(&client.read_one(handle).expect("read")[..], &data[..], "{len} bytes");
    }
    let handles: Vec<_> = (0..8u8)
        .map(|i| {
            let client = client.clone();
            std::thread::spawn(move || (i, client.create_from_slice(&vec![i; 1 << 20])))
        })
        .map(|t| t.join().expect("thread"))
        .collect();
    for (i, handle) in handles {
        assert!(client.read_one(handle).expect("read").iter().all(|&b| b == i));
    }
    let _ = DriverRuntime::<P>::name(&client);
}

/// `Tensor::to_device` from `src` to `dst` (two devices of one backend) carries the values of
/// work still queued on `src`, keeps a transposed (strided) tensor's layout right, carries bf16
/// bytes exactly, and the moved tensor computes on `dst`.
pub fn to_device_between_devices<G: Backend>(src: &G::Device, dst: &G::Device) {
    let a = tensor::<G, 2>([37, 70], 11, src);
    let b = tensor::<G, 2>([70, 45], 12, src);
    // Queued on `src` just before the move: the copy must wait for it.
    let product = a.clone().matmul(b.clone());
    let want = tensor::<NdArray, 2>([37, 70], 11, &Default::default()).matmul(tensor::<NdArray, 2>(
        [70, 45],
        12,
        &Default::default(),
    ));
    assert_close(
        "to_device(matmul)",
        product.clone().to_device(dst).into_data(),
        want.clone().into_data(),
        1e-5,
    );

    let moved_t = a.clone().transpose().to_device(dst);
    assert_eq!(moved_t.device(), *dst);
    let want_t = tensor::<NdArray, 2>([37, 70], 11, &Default::default()).transpose();
    assert_close("to_device(transpose)", moved_t.clone().into_data(), want_t.clone().into_data(), 0.0);
    // Computes on the destination with the moved layout.
    let sums = moved_t.sum_dim(1);
    assert_close("sum_dim after to_device", sums.into_data(), want_t.sum_dim(1).into_data(), 1e-5);

    let bf = a.clone().cast(burn::tensor::DType::BF16);
    let back = bf.clone().to_device(dst).into_data();
    assert_eq!(back.as_bytes(), bf.into_data().as_bytes(), "to_device(bf16) changed bytes");

    // And back again.
    let round = product.to_device(dst).to_device(src);
    assert_close("to_device and back", round.into_data(), want.into_data(), 1e-5);
}
