//! Errors of the driver layer, and the mapping of MACA runtime (`mcError_t`) and run-time
//! compiler (`mcrtcResult`) codes to their names and messages.
//!
//! The numeric values of `mcError_t` are taken from a public Cython mirror of `mcr/maca.h`
//! (an `_mcError_t` enum with explicit values, found through code search of public MetaX
//! ports); they coincide with `cudaError_t` for every code both define. The `mcrtcResult`
//! values are assumed to follow `nvrtcResult` (only `MCRTC_SUCCESS = 0` and the compile-error
//! status `6` are corroborated by public MetaX tooling). See the crate README.

use std::fmt;
use std::path::PathBuf;

/// A status code returned by a MACA runtime call (`mcError_t`), never `mcSuccess` (0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MacaError {
    code: i32,
}

/// `(code, name, message)` for the `mcError_t` values the backend knows about.
const MACA_ERRORS: &[(i32, &str, &str)] = &[
    (0, "mcSuccess", "no error"),
    (1, "mcErrorInvalidValue", "an argument is out of its valid range"),
    (2, "mcErrorMemoryAllocation", "out of device memory"),
    (3, "mcErrorInitializationError", "the MACA runtime could not be initialised"),
    (4, "mcErrorDeinitialized", "the MACA runtime is shutting down"),
    (9, "mcErrorInvalidConfiguration", "invalid launch configuration"),
    (16, "mcErrorInvalidHostPointer", "invalid host pointer"),
    (17, "mcErrorInvalidDevicePointer", "invalid device pointer"),
    (21, "mcErrorInvalidMemcpyDirection", "invalid copy direction"),
    (25, "mcErrorSynchronizationError", "synchronisation error"),
    (35, "mcErrorInsufficientDriver", "the installed MetaX driver is older than the runtime"),
    (46, "mcErrorDevicesUnavailable", "all devices are busy or unavailable"),
    (53, "mcErrorPriorLaunchFailure", "a previous launch failed"),
    (98, "mcErrorInvalidDeviceFunction", "invalid device function"),
    (100, "mcErrorNoDevice", "no MetaX device found"),
    (101, "mcErrorInvalidDevice", "invalid device ordinal"),
    (200, "mcErrorInvalidKernelImage", "invalid kernel image"),
    (201, "mcErrorDeviceUninitialized", "no valid context on the device"),
    (209, "mcErrorNoKernelImageForDevice", "no kernel image for this device"),
    (214, "mcErrorECCUncorrectable", "uncorrectable ECC error"),
    (218, "mcErrorInvalidKernelFile", "invalid kernel file"),
    (220, "mcErrorMxlinkUncorrectable", "uncorrectable MetaXLink error"),
    (221, "mcErrorJitCompilerNotFound", "the JIT compiler was not found"),
    (300, "mcErrorInvalidSource", "invalid source"),
    (301, "mcErrorFileNotFound", "file not found"),
    (302, "mcErrorSharedObjectSymbolNotFound", "shared object symbol not found"),
    (303, "mcErrorSharedObjectInitFailed", "shared object initialisation failed"),
    (304, "mcErrorOperatingSystem", "an operating-system call failed"),
    (400, "mcErrorInvalidResourceHandle", "invalid resource handle (stream, event, module)"),
    (401, "mcErrorIllegalState", "the operation is not legal in the current state"),
    (500, "mcErrorSymbolNotFound", "named symbol not found"),
    (600, "mcErrorNotReady", "the queried work is not complete yet"),
    (700, "mcErrorIllegalAddress", "a kernel accessed an illegal address"),
    (701, "mcErrorLaunchOutOfResources", "too many resources requested for the launch"),
    (702, "mcErrorLaunchTimeout", "the kernel timed out"),
    (709, "mcErrorContextIsDestroyed", "the context was destroyed"),
    (710, "mcErrorAssert", "a device-side assertion failed"),
    (714, "mcErrorHardwareStackError", "hardware stack error"),
    (715, "mcErrorIllegalInstruction", "illegal instruction"),
    (716, "mcErrorMisalignedAddress", "misaligned address"),
    (717, "mcErrorInvalidAddressSpace", "invalid address space"),
    (718, "mcErrorInvalidPc", "invalid program counter"),
    (719, "mcErrorLaunchFailure", "unspecified launch failure"),
    (800, "mcErrorNotPermitted", "operation not permitted"),
    (801, "mcErrorNotSupported", "operation not supported"),
    (909, "mcErrorTimeout", "timed out"),
    (999, "mcErrorUnknown", "unknown error"),
    (1004, "mcErrorModuleNotFound", "module not found"),
    (1012, "mcErrorNoBitcodeForGPU", "no bitcode for this GPU"),
    (2000, "mcErrorInvalidKernel", "invalid kernel"),
    (2001, "mcErrorDeviceNotFound", "device not found"),
    (10002, "mcErrorDriverWarmReset", "the driver performed a warm reset"),
    (10003, "mcErrorDriverMismatch", "user-mode component is incompatible with the kernel driver"),
    (10007, "mcErrorNoMemory", "no memory available"),
    (10030, "mcErrorDriverFunctionLevelReset", "function-level reset"),
    (10032, "mcErrorKernelExecTimeout", "kernel execution timed out"),
];

/// Codes after which the device context is unusable until the process restarts (the analogue
/// of CUDA's "sticky" errors): the driver poisons the device when it sees one.
const STICKY_CODES: &[i32] =
    &[214, 220, 700, 702, 709, 710, 714, 715, 716, 717, 718, 719, 10002, 10030, 10032];

impl MacaError {
    /// `mcErrorInvalidValue`.
    pub const INVALID_VALUE: MacaError = MacaError { code: 1 };
    /// `mcErrorMemoryAllocation`.
    pub const MEMORY_ALLOCATION: MacaError = MacaError { code: 2 };
    /// `mcErrorNoDevice`.
    pub const NO_DEVICE: MacaError = MacaError { code: 100 };
    /// `mcErrorNotReady`.
    pub const NOT_READY: MacaError = MacaError { code: 600 };
    /// `mcErrorIllegalAddress`.
    pub const ILLEGAL_ADDRESS: MacaError = MacaError { code: 700 };

    /// Wraps a raw status; `None` for `mcSuccess` (0).
    pub fn from_code(code: i32) -> Option<Self> {
        (code != 0).then_some(Self { code })
    }

    /// The raw `mcError_t` value.
    pub fn code(&self) -> i32 {
        self.code
    }

    /// The enumerator's name (e.g. `mcErrorInvalidValue`), or `None` for a code this crate does
    /// not know.
    pub fn name(&self) -> Option<&'static str> {
        MACA_ERRORS.iter().find(|(c, _, _)| *c == self.code).map(|(_, n, _)| *n)
    }

    /// A short human-readable description.
    pub fn message(&self) -> &'static str {
        MACA_ERRORS
            .iter()
            .find(|(c, _, _)| *c == self.code)
            .map_or("unrecognised MACA error code", |(_, _, m)| *m)
    }

    /// Whether the error leaves the device context unusable (see [`DriverError::Poisoned`]).
    pub fn is_sticky(&self) -> bool {
        STICKY_CODES.contains(&self.code)
    }
}

impl fmt::Display for MacaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => write!(f, "{name} ({}): {}", self.code, self.message()),
            None => write!(f, "mcError {} ({})", self.code, self.message()),
        }
    }
}

/// A status code returned by the run-time compiler (`mcrtcResult`), never `MCRTC_SUCCESS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RtcError {
    code: i32,
}

/// `mcrtcResult` names, assumed to follow `nvrtcResult` numbering.
const RTC_ERRORS: &[(i32, &str)] = &[
    (0, "MCRTC_SUCCESS"),
    (1, "MCRTC_ERROR_OUT_OF_MEMORY"),
    (2, "MCRTC_ERROR_PROGRAM_CREATION_FAILURE"),
    (3, "MCRTC_ERROR_INVALID_INPUT"),
    (4, "MCRTC_ERROR_INVALID_PROGRAM"),
    (5, "MCRTC_ERROR_INVALID_OPTION"),
    (6, "MCRTC_ERROR_COMPILATION"),
    (7, "MCRTC_ERROR_BUILTIN_OPERATION_FAILURE"),
    (11, "MCRTC_ERROR_INTERNAL_ERROR"),
];

impl RtcError {
    /// Wraps a raw status; `None` for `MCRTC_SUCCESS` (0).
    pub fn from_code(code: i32) -> Option<Self> {
        (code != 0).then_some(Self { code })
    }

    /// The raw `mcrtcResult` value.
    pub fn code(&self) -> i32 {
        self.code
    }

    /// The enumerator's name, if known.
    pub fn name(&self) -> Option<&'static str> {
        RTC_ERRORS.iter().find(|(c, _)| *c == self.code).map(|(_, n)| *n)
    }
}

impl fmt::Display for RtcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => write!(f, "{name} ({})", self.code),
            None => write!(f, "mcrtcResult {}", self.code),
        }
    }
}

/// An error of the driver layer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DriverError {
    /// The runtime library could not be opened.
    #[error(
        "MACA runtime library not available: could not load {path} ({reason}). Install the MACA \
         SDK or set MACA_PATH to its root (the library is looked for in $MACA_PATH/lib, default \
         /opt/maca/lib)"
    )]
    LibraryNotFound {
        /// The file that was looked for.
        path: PathBuf,
        /// What the dynamic loader said.
        reason: String,
    },
    /// A non-MACA driver library (the CUDA driver of the `cuda-proxy` feature) could not be
    /// opened.
    #[error("{library} not available: {reason}")]
    LibraryUnavailable {
        /// The library that was looked for.
        library: String,
        /// Why it is unavailable.
        reason: String,
    },
    /// A required symbol is missing from a library that did load.
    #[error(
        "symbol `{symbol}` not found in {library}: the MACA SDK there is incomplete or of an \
         unsupported version (set MACA_PATH to another installation)"
    )]
    MissingSymbol {
        /// The library that was searched.
        library: PathBuf,
        /// The missing symbol.
        symbol: &'static str,
    },
    /// A runtime call returned an error status.
    #[error("{call} failed: {error}")]
    Api {
        /// The C function that failed.
        call: &'static str,
        /// Its status.
        error: MacaError,
    },
    /// An earlier sticky error (e.g. an illegal address in a kernel) left the device context
    /// unusable; every later call on that device fails with this error without reaching the
    /// runtime. Only a new process recovers the device.
    #[error(
        "device {device} is poisoned: {call} failed earlier with {error}; the device context is \
         unusable until the process restarts"
    )]
    Poisoned {
        /// The device ordinal.
        device: usize,
        /// The call that first reported the sticky error.
        call: &'static str,
        /// The sticky error.
        error: MacaError,
    },
    /// A kernel faulted on the emulated MetaX device ([`crate::emu`]): a barrier or wave
    /// operation in divergent control flow, an invalid launch, … The device is poisoned as after
    /// a sticky error on hardware; `reason` says what the emulator saw.
    #[error("device {device} is poisoned: kernel `{kernel}` faulted on the emulated MetaX device: {reason}")]
    KernelFault {
        /// The device ordinal.
        device: usize,
        /// The kernel's name.
        kernel: String,
        /// What went wrong, with the source lines involved.
        reason: String,
    },
    /// A host-side wait gave up (the emulated device's `METAX_EMU_WAIT_TIMEOUT`).
    #[error("{call} timed out after {seconds} s: queued work did not complete")]
    Timeout {
        /// The call that waited.
        call: &'static str,
        /// How long it waited.
        seconds: u64,
    },
    /// A run-time compiler call failed.
    #[error("{call} failed: {error}")]
    Rtc {
        /// The C function that failed.
        call: &'static str,
        /// Its status.
        error: RtcError,
    },
    /// The run-time compiler rejected a program.
    #[error("run-time compilation of `{program}` failed with {error}; compiler log:\n{log}")]
    Compilation {
        /// The program name given to the compiler.
        program: String,
        /// The compiler's status.
        error: RtcError,
        /// The compiler's log.
        log: String,
    },
    /// No run-time compiler entry points were found.
    #[error("the mcrtc run-time compiler is not available: {0}")]
    RtcUnavailable(String),
    /// An argument was rejected before calling the runtime.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The runtime returned a value this crate cannot make sense of (e.g. a warp size other than
    /// 32 or 64, which hints at an attribute numbering that differs from the assumed one).
    #[error("unexpected value from the MACA runtime: {0}")]
    UnexpectedValue(String),
}

/// The result type of the driver layer.
pub type Result<T> = std::result::Result<T, DriverError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_codes_have_names_and_messages() {
        let e = MacaError::from_code(1).expect("non-zero");
        assert_eq!(e.name(), Some("mcErrorInvalidValue"));
        assert!(e.to_string().contains("mcErrorInvalidValue (1)"));
        assert_eq!(MacaError::from_code(0), None);
        assert_eq!(MacaError::ILLEGAL_ADDRESS.name(), Some("mcErrorIllegalAddress"));
        assert!(MacaError::ILLEGAL_ADDRESS.is_sticky());
        assert!(!MacaError::INVALID_VALUE.is_sticky());
    }

    #[test]
    fn unknown_codes_are_reported_numerically() {
        let e = MacaError::from_code(4242).expect("non-zero");
        assert_eq!(e.name(), None);
        assert_eq!(e.to_string(), "mcError 4242 (unrecognised MACA error code)");
        assert_eq!(
            RtcError::from_code(6).map(|e| e.to_string()).as_deref(),
            Some("MCRTC_ERROR_COMPILATION (6)")
        );
        assert_eq!(RtcError::from_code(77).map(|e| e.to_string()).as_deref(), Some("mcrtcResult 77"));
    }

    #[test]
    fn codes_are_unique() {
        for (i, (c, n, _)) in MACA_ERRORS.iter().enumerate() {
            assert!(MACA_ERRORS[i + 1..].iter().all(|(c2, n2, _)| c2 != c && n2 != n), "{n}");
        }
    }
}
