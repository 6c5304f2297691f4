//! Test support: builds the mock MACA runtime (`mock-mcruntime/`) once per process and gives a
//! MACA_PATH-style root for it, plus access to the mock's control functions.
#![allow(dead_code)]

use std::ffi::{CString, c_char, c_int, c_uint, c_void};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Which build of the mock.
#[derive(Clone, Copy)]
pub enum Variant {
    /// Every symbol.
    Full,
    /// Without `mcModuleLaunchKernel`.
    MissingLaunch,
}

fn cache_dir() -> PathBuf {
    std::env::temp_dir().join("burn-metax-backend-mock-mcruntime")
}

/// Builds the mock with cargo (into a target dir under the system temp dir) and lays it out as
/// `<root>/lib/libmcruntime.so`; returns `<root>`.
fn build(variant: Variant) -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("mock-mcruntime/Cargo.toml");
    let (name, features): (&str, &[&str]) = match variant {
        Variant::Full => ("full", &[]),
        Variant::MissingLaunch => ("missing-launch", &["--features", "missing-launch"]),
    };
    let target = cache_dir().join(format!("target-{name}"));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = Command::new(cargo)
        .args(["build", "--quiet", "--offline", "--manifest-path"])
        .arg(&manifest)
        .arg("--target-dir")
        .arg(&target)
        .args(features)
        // Do not inherit a target or flags meant for the outer build.
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET")
        .output()
        .expect("failed to run cargo to build the mock MACA runtime");
    assert!(
        output.status.success(),
        "building the mock MACA runtime failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let built = target.join("debug").join("libmcruntime.so");
    let root = cache_dir().join(format!("root-{name}"));
    let lib_dir = root.join("lib");
    std::fs::create_dir_all(&lib_dir).expect("create mock root");
    // Copy then rename, so that concurrent test processes never see a half-written library.
    let staging = lib_dir.join(format!(".libmcruntime.so.{}", std::process::id()));
    std::fs::copy(&built, &staging).expect("copy the mock library");
    std::fs::rename(&staging, lib_dir.join("libmcruntime.so")).expect("install the mock library");
    root
}

/// The MACA root of the full mock (built on first use; thread-safe).
pub fn mock_root() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| build(Variant::Full))
}

/// The MACA root of the mock built without `mcModuleLaunchKernel`.
pub fn mock_root_missing_launch() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| build(Variant::MissingLaunch))
}

/// A MACA root whose `lib/libmcruntime.so` and `lib/libmccl.so` are both symbolic links to the
/// full mock: the dynamic loader sees one file, so the runtime, MCCL and [`Control`] share one
/// instance of the mock (one device-memory map).
pub fn mock_root_with_mccl() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        let target = mock_root().join("lib/libmcruntime.so");
        let root = cache_dir().join("root-mccl");
        let lib_dir = root.join("lib");
        std::fs::create_dir_all(&lib_dir).expect("create mock root");
        for name in ["libmcruntime.so", "libmccl.so"] {
            let staging = lib_dir.join(format!(".{name}.{}", std::process::id()));
            let _ = std::fs::remove_file(&staging);
            std::os::unix::fs::symlink(&target, &staging).expect("link the mock library");
            std::fs::rename(&staging, lib_dir.join(name)).expect("install the link");
        }
        root
    })
}

/// A launch recorded by the mock (mirror of its `MockLaunch`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MockLaunch {
    pub grid: [c_uint; 3],
    pub block: [c_uint; 3],
    pub shared_memory: c_uint,
    pub stream: usize,
    pub function: usize,
}

/// The mock's control functions (the library is the one the driver opened: same path, same
/// loaded instance). Injections and records are per calling thread.
pub struct Control {
    lib: libloading::Library,
}

impl Control {
    pub fn open() -> Self {
        let path = mock_root().join("lib/libmcruntime.so");
        // SAFETY: the mock has no initialisers with preconditions.
        let lib = unsafe { libloading::Library::new(path) }.expect("open the mock runtime");
        Self { lib }
    }

    fn get<T: Copy>(&self, name: &str) -> T {
        // SAFETY: the callers name each control function with its exact prototype.
        unsafe { *self.lib.get::<T>(name.as_bytes()).expect(name) }
    }

    /// Makes `symbol` fail with `code` on this thread, after `skip` calls, for `count` calls
    /// (0 = forever).
    pub fn inject(&self, symbol: &str, code: i32, skip: u32, count: u32) {
        let f: unsafe extern "C" fn(*const c_char, c_int, c_uint, c_uint) = self.get("mcmockInjectError");
        let symbol = CString::new(symbol).expect("symbol");
        // SAFETY: NUL-terminated symbol name, plain values.
        unsafe { f(symbol.as_ptr(), code, skip, count) }
    }

    pub fn clear(&self) {
        let f: extern "C" fn() = self.get("mcmockClearInjections");
        f()
    }

    pub fn launch_count(&self) -> u64 {
        let f: extern "C" fn() -> u64 = self.get("mcmockLaunchCount");
        f()
    }

    pub fn compile_count(&self) -> u64 {
        let f: extern "C" fn() -> u64 = self.get("mcmockCompileCount");
        f()
    }

    pub fn live_allocations(&self) -> u64 {
        let f: extern "C" fn() -> u64 = self.get("mcmockLiveAllocations");
        f()
    }

    pub fn last_launch(&self) -> Option<MockLaunch> {
        let f: unsafe extern "C" fn(*mut MockLaunch) -> c_int = self.get("mcmockLastLaunch");
        let mut launch = MockLaunch::default();
        // SAFETY: `launch` is a writable `MockLaunch`.
        (unsafe { f(&mut launch) } == 1).then_some(launch)
    }

    pub fn pending_ops(&self, stream: usize) -> u64 {
        let f: unsafe extern "C" fn(*mut c_void) -> u64 = self.get("mcmockPendingOps");
        // SAFETY: the mock only uses the handle as a key.
        unsafe { f(stream as *mut c_void) }
    }

    pub fn launches_run(&self, stream: usize) -> u64 {
        let f: unsafe extern "C" fn(*mut c_void) -> u64 = self.get("mcmockLaunchesRun");
        // SAFETY: the mock only uses the handle as a key.
        unsafe { f(stream as *mut c_void) }
    }
}

/// Installs the full mock as the process-wide MACA driver of the runtime (idempotent).
pub fn install_mock_runtime() {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        // The tests count the mock's `mcrtc` compilations: kernels must not come from the
        // persistent cache that other test processes (or an earlier run) filled.
        burn_metax_backend::runtime::compile_cache::set_directory(None);
        let driver =
            burn_metax_backend::driver::MacaDriver::load_from(mock_root()).expect("load the mock runtime");
        assert!(
            burn_metax_backend::runtime::install_maca_driver(driver),
            "a MACA driver was loaded before the mock could be installed"
        );
    });
}

impl Control {
    /// Makes `symbol` fail with `code` on *every* thread (e.g. the server's), after `skip` calls,
    /// for `count` calls (0 = forever).
    pub fn inject_global(&self, symbol: &str, code: i32, skip: u32, count: u32) {
        let f: unsafe extern "C" fn(*const c_char, c_int, c_uint, c_uint) =
            self.get("mcmockInjectErrorGlobal");
        let symbol = CString::new(symbol).expect("symbol");
        // SAFETY: NUL-terminated symbol name, plain values.
        unsafe { f(symbol.as_ptr(), code, skip, count) }
    }

    pub fn clear_global(&self) {
        let f: extern "C" fn() = self.get("mcmockClearGlobalInjections");
        f()
    }

    /// Launches accepted on any thread.
    pub fn global_launch_count(&self) -> u64 {
        let f: extern "C" fn() -> u64 = self.get("mcmockGlobalLaunchCount");
        f()
    }

    /// Launch number `index` (any thread).
    pub fn global_launch(&self, index: u64) -> Option<MockLaunch> {
        let f: unsafe extern "C" fn(u64, *mut MockLaunch) -> c_int = self.get("mcmockGlobalLaunch");
        let mut launch = MockLaunch::default();
        // SAFETY: `launch` is a writable `MockLaunch`.
        (unsafe { f(index, &mut launch) } == 1).then_some(launch)
    }

    /// Programs compiled on any thread.
    pub fn global_compile_count(&self) -> u64 {
        let f: extern "C" fn() -> u64 = self.get("mcmockGlobalCompileCount");
        f()
    }

    fn compile_text(&self, index: u64, what: c_int) -> Option<String> {
        let f: unsafe extern "C" fn(u64, c_int, *mut c_char, usize) -> usize =
            self.get("mcmockGlobalCompileText");
        // SAFETY: a null buffer only asks for the length.
        let len = unsafe { f(index, what, std::ptr::null_mut(), 0) };
        if len == 0 {
            return None;
        }
        let mut buf = vec![0u8; len];
        // SAFETY: `buf` has `len` writable bytes.
        unsafe { f(index, what, buf.as_mut_ptr().cast(), len) };
        buf.pop();
        Some(String::from_utf8_lossy(&buf).into_owned())
    }

    /// Source of compile number `index` (any thread).
    pub fn global_compile_source(&self, index: u64) -> Option<String> {
        self.compile_text(index, 0)
    }

    /// Options of compile number `index` (any thread), space-joined.
    pub fn global_compile_options(&self, index: u64) -> Option<String> {
        self.compile_text(index, 1)
    }

    /// Operations queued on every stream of every thread and not yet run.
    pub fn total_pending_ops(&self) -> u64 {
        let f: extern "C" fn() -> u64 = self.get("mcmockTotalPendingOps");
        f()
    }

    /// Live device allocations (any thread).
    pub fn total_live_allocations(&self) -> u64 {
        let f: extern "C" fn() -> u64 = self.get("mcmockTotalLiveAllocations");
        f()
    }

    /// Successful non-empty device allocations so far (any thread).
    pub fn total_mallocs(&self) -> u64 {
        let f: extern "C" fn() -> u64 = self.get("mcmockTotalMallocs");
        f()
    }
}

/// An entry of the mock's order log (see `mcmockOrderLogEntry`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OrderEntry {
    /// `stream` waits on an event recorded on `on`.
    Wait { stream: usize, on: usize },
    /// An event recorded on `stream`.
    Record { stream: usize },
    /// A collective queued on `stream`.
    Collective { stream: usize },
}

impl Control {
    /// Overrides the mock's device count.
    pub fn set_device_count(&self, count: i32) {
        let f: extern "C" fn(c_int) = self.get("mcmockSetDeviceCount");
        f(count)
    }

    /// Whether `mcEventQuery` runs the work it waits for (as a real device does on its own).
    pub fn set_query_progress(&self, on: bool) {
        let f: extern "C" fn(c_int) = self.get("mcmockSetQueryProgress");
        f(c_int::from(on))
    }

    /// The order log: stream waits, event records and collectives, in call order.
    pub fn order_log(&self) -> Vec<OrderEntry> {
        let len: extern "C" fn() -> u64 = self.get("mcmockOrderLogLen");
        let entry: unsafe extern "C" fn(u64, *mut c_int, *mut usize, *mut usize) -> c_int =
            self.get("mcmockOrderLogEntry");
        let mut out = Vec::new();
        for i in 0..len() {
            let (mut kind, mut stream, mut other) = (0, 0, 0);
            // SAFETY: three writable values.
            if unsafe { entry(i, &mut kind, &mut stream, &mut other) } == 0 {
                break;
            }
            out.push(match kind {
                1 => OrderEntry::Wait { stream, on: other },
                2 => OrderEntry::Record { stream },
                _ => OrderEntry::Collective { stream },
            });
        }
        out
    }

    /// Empties the order log.
    pub fn clear_order_log(&self) {
        let f: extern "C" fn() = self.get("mcmockOrderLogClear");
        f()
    }
}
