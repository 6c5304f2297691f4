//! The Burn backend types.

use burn_cubecl::CubeBackend;

use crate::runtime::MacaRuntime;

/// Burn backend for MetaX GPUs: [`CubeBackend`] over [`MacaRuntime`] (float `F`, int `I`, bool
/// stored as `u8`). Use `burn::backend::Autodiff<Metax>` for training.
pub type Metax<F = f32, I = i32> = CubeBackend<MacaRuntime, F, I, u8>;

/// The device type of [`Metax`].
pub type MetaxDevice = crate::runtime::MacaDevice;

/// Burn backend running the MetaX server on NVIDIA GPUs (CUDA driver API + NVRTC + cubecl-cpp's
/// CUDA dialect): the tier-3 stand-in for MetaX hardware.
#[cfg(feature = "cuda-proxy")]
pub type CudaProxy<F = f32, I = i32> = CubeBackend<crate::runtime::CudaProxyRuntime, F, I, u8>;
