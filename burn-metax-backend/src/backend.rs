//! The Burn backend types.

use burn_cubecl::CubeBackend;

use crate::runtime::MacaRuntime;

/// Burn backend for MetaX GPUs: [`CubeBackend`] over [`MacaRuntime`] (float `F`, int `I`, bool
/// stored as `u8`). Use `burn::backend::Autodiff<Metax>` for training.
pub type Metax<F = f32, I = i32> = CubeBackend<MacaRuntime, F, I, u8>;

/// [`Metax`] on the emulated MetaX device ([`crate::emu`]): the same server, dialect (wave 64)
/// and compilation options, with the kernels compiled by the host C++ compiler and run on the CPU.
///
/// ```no_run
/// use burn::tensor::Tensor;
/// use burn_metax_backend::{MetaxEmu, MetaxEmuDevice, MetaxEmuRuntime};
///
/// let device = MetaxEmuRuntime::first_device().expect("a host C++ compiler");
/// let x = Tensor::<MetaxEmu, 1>::from_floats([1.0, 2.0, 3.0], &device);
/// assert_eq!(x.sum().into_scalar(), 6.0);
/// # let _ = MetaxEmuDevice::new(0);
/// ```
pub type MetaxEmu<F = f32, I = i32> = CubeBackend<crate::runtime::MetaxEmuRuntime, F, I, u8>;

/// The device type of [`Metax`].
pub type MetaxDevice = crate::runtime::MacaDevice;

/// Burn backend running the MetaX server on NVIDIA GPUs (CUDA driver API + NVRTC + cubecl-cpp's
/// CUDA dialect): the tier-3 stand-in for MetaX hardware.
#[cfg(feature = "cuda-proxy")]
pub type CudaProxy<F = f32, I = i32> = CubeBackend<crate::runtime::CudaProxyRuntime, F, I, u8>;

/// [`Metax`] under Burn's kernel fusion (`burn-fusion`): element-wise chains, reductions and
/// matmul epilogues are fused into kernels generated at run time, as Burn's own CUDA backend
/// does by default. Feature `fusion`.
#[cfg(feature = "fusion")]
pub type MetaxFused<F = f32, I = i32> = burn_fusion::Fusion<Metax<F, I>>;

/// [`MetaxEmu`] under Burn's kernel fusion (feature `fusion`): the fused kernels through the
/// MACA dialect, run on the CPU.
#[cfg(feature = "fusion")]
pub type MetaxEmuFused<F = f32, I = i32> = burn_fusion::Fusion<MetaxEmu<F, I>>;

/// [`CudaProxy`] under Burn's kernel fusion (features `cuda-proxy` and `fusion`).
#[cfg(all(feature = "cuda-proxy", feature = "fusion"))]
pub type CudaProxyFused<F = f32, I = i32> = burn_fusion::Fusion<CudaProxy<F, I>>;
