//! Kernel modules of the emulated device: shared objects built by [`super::compiler`], loaded with
//! the dynamic loader, and launched on a stream worker with fiber stacks and a shared-memory arena
//! owned by that worker thread.

use std::ffi::{CStr, c_char, c_void};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};

use crate::driver::{DriverError, Result};

/// The launch ABI shared with `emu/include/mcr/mc_runtime.h` (`METAX_EMU_ABI`).
pub(crate) const ABI: u32 = 1;
/// Maximum lanes per block (as the header's `METAX_EMU_MAX_LANES`).
pub(crate) const MAX_LANES: usize = 1024;
/// Maximum dynamic shared memory per block.
pub(crate) const MAX_SHARED: usize = 64 << 10;
/// Usable stack per lane of a cooperative kernel (plus one guard page below it).
const LANE_STACK: usize = 128 << 10;

/// `metax_emu::LaunchDesc` of the header (C layout; keep both in step with [`ABI`]).
#[repr(C)]
struct LaunchDesc {
    abi: u32,
    grid: [u32; 3],
    block: [u32; 3],
    warp_size: u32,
    block_begin: u64,
    block_end: u64,
    shared_mem: *mut u8,
    shared_bytes: u64,
    params: *mut *mut c_void,
    stacks: *mut u8,
    stack_stride: u64,
    stack_slots: u64,
    error: *mut c_char,
    error_cap: u64,
}

type LaunchFn = unsafe extern "C" fn(*mut LaunchDesc) -> i32;
type ParamSizesFn = unsafe extern "C" fn(*mut u32, u32) -> u32;

/// A loaded kernel.
pub(crate) struct Module {
    launch: LaunchFn,
    /// Size in bytes of each kernel parameter, in order.
    pub(crate) param_sizes: Vec<usize>,
    /// The kernel's name (the `extern "C"` function the source defines).
    pub(crate) name: String,
    /// Whether the kernel runs its lanes as fibers (it uses barriers or wave operations).
    pub(crate) cooperative: bool,
    path: PathBuf,
    // Kept last: the function pointer above points into it.
    _library: Library,
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Module")
            .field("name", &self.name)
            .field("cooperative", &self.cooperative)
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

fn invalid_image(reason: String) -> DriverError {
    DriverError::InvalidArgument(format!("not a kernel module of the MetaX emulator: {reason}"))
}

impl Module {
    /// Loads the shared object at `path` (written by [`super::EmuDriver::module_load_data`]).
    pub(crate) fn load(path: &Path) -> Result<Self> {
        // SAFETY: the file is a shared object this emulator's compiler built from the emulation
        // header plus generated kernel source; its only initialisers are the header's
        // (thread-local pointers, constant data), which have no preconditions.
        let library = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL) }
            .map_err(|e| invalid_image(format!("{}: {e}", path.display())))?;
        // The symbols are defined by `METAX_EMU_ENTRY` in the header with exactly the types
        // looked up below; values are copied out while `library` is alive, and the function
        // pointers are only called while the module (which owns `library`) is alive.
        // SAFETY: as just said, `metax_emu_abi` is a `const uint32_t` of the loaded library.
        let abi = unsafe { library.get::<*const u32>(b"metax_emu_abi\0") }
            .map(|s| *s)
            .map_err(|e| invalid_image(e.to_string()))?;
        // SAFETY: `abi` points at a `const uint32_t` in the loaded library.
        let abi = unsafe { *abi };
        if abi != ABI {
            return Err(DriverError::UnexpectedValue(format!(
                "kernel module {} was built for emulator ABI {abi}, this build uses {ABI}",
                path.display()
            )));
        }
        // SAFETY: see above.
        let launch = unsafe { library.get::<LaunchFn>(b"metax_emu_launch\0") }
            .map(|s| *s)
            .map_err(|e| invalid_image(e.to_string()))?;
        // SAFETY: see above.
        let param_sizes_fn = unsafe { library.get::<ParamSizesFn>(b"metax_emu_param_sizes\0") }
            .map(|s| *s)
            .map_err(|e| invalid_image(e.to_string()))?;
        // SAFETY: see above; the symbol is a NUL-terminated `const char[]`.
        let name_ptr = unsafe { library.get::<*const c_char>(b"metax_emu_kernel_name\0") }
            .map(|s| *s)
            .map_err(|e| invalid_image(e.to_string()))?;
        // SAFETY: see above; the symbol is a `const uint32_t`.
        let cooperative_ptr = unsafe { library.get::<*const u32>(b"metax_emu_cooperative\0") }
            .map(|s| *s)
            .map_err(|e| invalid_image(e.to_string()))?;
        // SAFETY: `name_ptr` is the address of the NUL-terminated array itself (a data symbol).
        let name = unsafe { CStr::from_ptr(name_ptr) }.to_string_lossy().into_owned();
        // SAFETY: `cooperative_ptr` is the address of a `const uint32_t`.
        let cooperative = unsafe { *cooperative_ptr } != 0;
        let mut sizes = [0u32; 1024];
        // SAFETY: the function writes at most `cap` entries into `sizes`.
        let count = unsafe { param_sizes_fn(sizes.as_mut_ptr(), sizes.len() as u32) } as usize;
        if count > sizes.len() {
            return Err(DriverError::UnexpectedValue(format!("kernel `{name}` has {count} parameters")));
        }
        Ok(Self {
            launch,
            param_sizes: sizes[..count].iter().map(|&s| s as usize).collect(),
            name,
            cooperative,
            path: path.to_path_buf(),
            _library: library,
        })
    }
}

/// A launch queued on a stream: the module, the configuration, and a copy of the parameters.
pub(crate) struct Launch {
    pub(crate) module: std::sync::Arc<Module>,
    pub(crate) grid: [u32; 3],
    pub(crate) block: [u32; 3],
    pub(crate) shared: u32,
    pub(crate) warp_size: u32,
    /// The parameter values, each at a 16-byte aligned offset.
    pub(crate) values: Vec<u128>,
    pub(crate) offsets: Vec<usize>,
}

impl Launch {
    /// Copies the parameter values out of `params` (one pointer per parameter, to a value of the
    /// size the module reports).
    ///
    /// # Safety
    /// `params[i]` points at `module.param_sizes[i]` readable bytes.
    pub(crate) unsafe fn new(
        module: std::sync::Arc<Module>,
        grid: [u32; 3],
        block: [u32; 3],
        shared: u32,
        warp_size: u32,
        params: &[*mut c_void],
    ) -> Self {
        let mut offsets = Vec::with_capacity(params.len());
        let mut slots = 0;
        for size in &module.param_sizes {
            offsets.push(slots);
            slots += size.div_ceil(16).max(1);
        }
        let mut values = vec![0u128; slots];
        for ((param, size), offset) in params.iter().zip(&module.param_sizes).zip(&offsets) {
            // SAFETY: the caller guarantees `param` points at `size` readable bytes; the
            // destination has `size.div_ceil(16)` 16-byte slots from `offset`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    param.cast::<u8>().cast_const(),
                    values.as_mut_ptr().add(*offset).cast::<u8>(),
                    *size,
                );
            }
        }
        Self { module, grid, block, shared, warp_size, values, offsets }
    }

    /// Runs every block of the launch on the calling thread. Returns the emulator's fault message
    /// on a fault.
    pub(crate) fn run(&mut self) -> std::result::Result<(), String> {
        let blocks = u64::from(self.grid[0]) * u64::from(self.grid[1]) * u64::from(self.grid[2]);
        if blocks == 0 {
            return Ok(());
        }
        let base = self.values.as_mut_ptr();
        let mut params: Vec<*mut c_void> =
            self.offsets.iter().map(|&offset| base.wrapping_add(offset).cast::<c_void>()).collect();
        let mut arena = Arena::take();
        let result = (|| {
            let arena = &mut arena;
            if self.module.cooperative {
                arena.ensure_stacks()?;
            }
            let mut error = [0u8; 1024];
            let mut desc = LaunchDesc {
                abi: ABI,
                grid: self.grid,
                block: self.block,
                warp_size: self.warp_size,
                block_begin: 0,
                block_end: blocks,
                shared_mem: arena.shared,
                shared_bytes: u64::from(self.shared),
                params: params.as_mut_ptr(),
                stacks: arena.stacks,
                stack_stride: arena.stride as u64,
                stack_slots: if arena.stacks.is_null() { 0 } else { MAX_LANES as u64 },
                error: error.as_mut_ptr().cast(),
                error_cap: error.len() as u64,
            };
            // SAFETY: `desc` is a valid descriptor for this ABI: `params` holds one pointer per
            // kernel parameter into `self.values` (copies of the caller's values, sizes from the
            // module), the shared arena has `MAX_SHARED` bytes, the stack arena (when present)
            // `MAX_LANES` slots of `stride` bytes with a guard page at the bottom of each, and the
            // error buffer `error_cap` bytes. Buffers the kernel dereferences are device
            // allocations kept live by the server until the stream passes this launch.
            let status = unsafe { (self.module.launch)(&mut desc) };
            if status == 0 {
                Ok(())
            } else {
                let end = error.iter().position(|&b| b == 0).unwrap_or(error.len());
                Err(String::from_utf8_lossy(&error[..end]).into_owned())
            }
        })();
        arena.give_back();
        result
    }
}

/// Arenas no launch is using. A launch takes one and gives it back when it returns, so there
/// are as many as launches ever ran at once (one per stream running a kernel), not one per
/// thread that ever launched: a process that starts many streams (CubeCL makes one per client
/// thread, up to 128 per device) would otherwise keep an arena per stream worker, each with
/// `MAX_LANES` guard pages, and run out of memory mappings (`vm.max_map_count`).
static POOL: Mutex<Vec<Arena>> = Mutex::new(Vec::new());

/// Launch memory: `MAX_SHARED` bytes of shared memory, and (created on the first cooperative
/// launch) `MAX_LANES` lane stacks, each with a guard page below it, reserved with
/// `MAP_NORESERVE` so that only the pages lanes touch are ever committed.
struct Arena {
    shared: *mut u8,
    stacks: *mut u8,
    stride: usize,
}

fn page_size() -> usize {
    // SAFETY: `sysconf` has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).ok().filter(|s| *s > 0).unwrap_or(4096)
}

// SAFETY: an `Arena` owns its two allocations and nothing else points into them once a launch
// has returned (a launch borrows the arena for its whole, synchronous run), so moving the
// arena to another thread between launches moves sole ownership.
unsafe impl Send for Arena {}

impl Arena {
    /// An idle arena from the pool, or a new one.
    fn take() -> Self {
        POOL.lock().unwrap_or_else(|e| e.into_inner()).pop().unwrap_or_else(Self::new)
    }

    /// Returns the arena to the pool.
    fn give_back(self) {
        POOL.lock().unwrap_or_else(|e| e.into_inner()).push(self);
    }

    fn new() -> Self {
        let layout = std::alloc::Layout::from_size_align(MAX_SHARED, 4096).expect("valid layout");
        // SAFETY: non-zero size.
        let shared = unsafe { std::alloc::alloc(layout) };
        Self { shared, stacks: std::ptr::null_mut(), stride: 0 }
    }

    fn ensure_stacks(&mut self) -> std::result::Result<(), String> {
        if !self.stacks.is_null() {
            return Ok(());
        }
        if self.shared.is_null() {
            return Err("could not allocate the shared-memory arena".to_string());
        }
        let page = page_size();
        let stride = LANE_STACK.div_ceil(page) * page + page;
        let total = stride * MAX_LANES;
        // SAFETY: an anonymous private mapping with no address hint; the result is checked.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(format!("could not reserve {total} bytes of lane stacks"));
        }
        for slot in 0..MAX_LANES {
            // SAFETY: the page lies inside the mapping just created.
            let guarded =
                unsafe { libc::mprotect(base.cast::<u8>().add(slot * stride).cast(), page, libc::PROT_NONE) };
            if guarded != 0 {
                // SAFETY: unmapping the mapping created above, which nothing uses yet.
                unsafe { libc::munmap(base, total) };
                return Err("could not protect the lane stacks' guard pages".to_string());
            }
        }
        self.stacks = base.cast();
        self.stride = stride;
        Ok(())
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if !self.stacks.is_null() {
            // SAFETY: the mapping made in `ensure_stacks`; no launch runs on this thread any more.
            unsafe { libc::munmap(self.stacks.cast(), self.stride * MAX_LANES) };
        }
        if !self.shared.is_null() {
            // SAFETY: allocated in `new` with this layout.
            unsafe {
                std::alloc::dealloc(
                    self.shared,
                    std::alloc::Layout::from_size_align_unchecked(MAX_SHARED, 4096),
                )
            };
        }
    }
}
