//! A mock of the MACA runtime (`libmcruntime.so`) and its run-time compiler, for tests.
//!
//! * Device memory is host memory (filled with `0xCD`, since real allocations are not zeroed).
//! * Work queued on a stream is **deferred**: it runs only when something waits for it
//!   (stream/event/device synchronisation, a blocking copy on the legacy default stream, or a
//!   stream waiting on an event). This makes ordering bugs observable: a blocking `mcMemcpy`
//!   does not wait for non-blocking streams, exactly as on the real device.
//! * The legacy default stream (null) orders itself against blocking streams, not against
//!   streams created with `mcStreamNonBlocking`. Each calling thread has its own default stream
//!   and device-wide synchronisation covers the calling thread's streams only, so that parallel
//!   tests cannot run each other's deferred work.
//! * `mcrtc*` "compiles" C++ source by listing its `__global__` functions into an image that
//!   `mcModuleLoadData` accepts; a source containing `#error` fails with
//!   `MCRTC_ERROR_COMPILATION` and the offending line in the log.
//! * Launches are validated and recorded; kernels do nothing.
//! * Errors can be injected per thread with `mcmockInjectError`, or for the whole process with
//!   `MCMOCK_INJECT=symbol=code[,symbol=code…]`.
//! * `MCMOCK_DEVICE_COUNT` sets the number of devices (default 1); `mcmockSetDeviceCount`
//!   overrides it. Devices share one memory map: the device index is only validated.
//! * MCCL (`mccl*`, the same library installed as `libmccl.so`): ranks of one process (threads)
//!   that call `mcclCommInitRank` with the same unique id rendezvous (the call blocks until all
//!   have joined) and run real collectives on the mock's device memory: all-gather,
//!   reduce-scatter, all-reduce (sum/prod/max/min/avg on f16, bf16, f32, f64; floats of 16 and
//!   32 bits accumulate in f32 in rank order, f64 in f64) and broadcast. A collective is queued
//!   on its stream like a copy and runs when every rank's queue has reached it, so a wait for it
//!   blocks (releasing the mock's lock) until the peers have queued theirs, or their
//!   communicators were aborted (`mcclCommAbort`: its own queued collectives complete without
//!   data; the peers' never complete). Blocking waits give up after `MCMOCK_MAX_BLOCK_MS`
//!   (default 120 000) with `mcErrorTimeout` (909).
//! * `mcmockSetQueryProgress(1)` makes `mcEventQuery` run the work the event waits for when it
//!   can (as a real device runs queued work on its own); by default a query runs nothing.
//! * An order log (`mcmockOrderLog*`) records, in call order, stream waits on events (with the
//!   stream the event was recorded on), event records and queued collectives.
//!
//! Control and inspection functions are exported with the `mcmock` prefix.
#![allow(non_snake_case)]
#![allow(clippy::missing_safety_doc)]

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::atomic::AtomicBool;
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

// ---- status codes (mcError_t) -------------------------------------------------------------------
const SUCCESS: c_int = 0;
const INVALID_VALUE: c_int = 1;
const INVALID_CONFIGURATION: c_int = 9;
const INVALID_MEMCPY_DIRECTION: c_int = 21;
const INVALID_DEVICE: c_int = 101;
const INVALID_KERNEL_IMAGE: c_int = 200;
const INVALID_HANDLE: c_int = 400;
const SYMBOL_NOT_FOUND: c_int = 500;
const NOT_READY: c_int = 600;
const TIMEOUT: c_int = 909;

const RTC_SUCCESS: c_int = 0;
const RTC_INVALID_INPUT: c_int = 3;
const RTC_INVALID_PROGRAM: c_int = 4;
const RTC_COMPILATION: c_int = 6;

const IMAGE_MAGIC: &[u8; 8] = b"MCMOCK01";
const TOTAL_MEMORY: usize = 64 << 30;

// ---- state ----------------------------------------------------------------------------------------

enum Op {
    Copy { dst: usize, src: usize, len: usize },
    Wait { stream: usize, seq: u64 },
    Mark { event: usize },
    Launch,
    Free { addr: usize },
    /// Round `round` of the collectives of communicator `comm`.
    Coll { comm: usize, round: u64 },
}

#[derive(Default)]
struct Stream {
    queue: VecDeque<(u64, Op)>,
    next_seq: u64,
    done: u64,
    non_blocking: bool,
    launches_run: u64,
    owner: Option<ThreadId>,
}

impl Stream {
    fn tail(&self) -> u64 {
        self.next_seq
    }
}

struct Event {
    recorded: Option<(usize, u64)>,
    time: Option<Instant>,
    timing: bool,
}

struct Program {
    source: String,
    log: String,
    image: Option<Vec<u8>>,
}

#[derive(Default)]
struct State {
    device_mem: BTreeMap<usize, (Box<[u8]>, ThreadId)>,
    host_mem: HashMap<usize, Box<[u8]>>,
    streams: HashMap<usize, Stream>,
    events: HashMap<usize, Event>,
    modules: HashMap<usize, Vec<String>>,
    functions: HashMap<usize, (usize, String)>,
    programs: HashMap<usize, Program>,
    comms: HashMap<usize, CommInfo>,
    cliques: HashMap<[u8; 128], Clique>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);
/// Signalled when a collective is queued or a communicator joins, is aborted or destroyed: the
/// events a blocked wait may be waiting for.
static PROGRESS: Condvar = Condvar::new();
/// `mcmockSetQueryProgress`.
static QUERY_PROGRESS: AtomicBool = AtomicBool::new(false);
/// `mcmockSetDeviceCount` (0: `MCMOCK_DEVICE_COUNT` or 1).
static DEVICE_COUNT: AtomicUsize = AtomicUsize::new(0);
/// The order log: `(kind, stream, other)`, see `mcmockOrderLogEntry`.
static ORDER_LOG: Mutex<Vec<(c_int, usize, usize)>> = Mutex::new(Vec::new());

const LOG_WAIT: c_int = 1;
const LOG_RECORD: c_int = 2;
const LOG_COLLECTIVE: c_int = 3;

fn log_order(kind: c_int, stream: usize, other: usize) {
    ORDER_LOG.lock().unwrap_or_else(|e| e.into_inner()).push((kind, stream, other));
}

fn max_block() -> Duration {
    static MS: OnceLock<u64> = OnceLock::new();
    Duration::from_millis(
        *MS.get_or_init(|| std::env::var("MCMOCK_MAX_BLOCK_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(120_000)),
    )
}

/// Runs `attempt` until it reports completion, waiting (with the lock released) for other
/// threads to make progress in between. Returns the guard and whether `attempt` completed
/// before `max_block()`.
fn block_until(
    mut guard: MutexGuard<'static, Option<State>>,
    mut attempt: impl FnMut(&mut State) -> bool,
) -> (MutexGuard<'static, Option<State>>, bool) {
    let deadline = Instant::now() + max_block();
    loop {
        let done = guard.as_mut().is_none_or(&mut attempt);
        if done {
            return (guard, true);
        }
        let now = Instant::now();
        if now >= deadline {
            return (guard, false);
        }
        let pause = (deadline - now).min(Duration::from_millis(10));
        guard = PROGRESS.wait_timeout(guard, pause).unwrap_or_else(|e| e.into_inner()).0;
    }
}
static NEXT_HANDLE: AtomicUsize = AtomicUsize::new(0x1000);
static TOTAL_LAUNCHES: AtomicU64 = AtomicU64::new(0);

fn state() -> MutexGuard<'static, Option<State>> {
    let mut guard = STATE.lock().unwrap_or_else(|e| e.into_inner());
    if guard.is_none() {
        *guard = Some(State::default());
    }
    guard
}

macro_rules! with_state {
    (|$s:ident| $body:expr) => {{
        let mut guard = state();
        match guard.as_mut() {
            Some($s) => $body,
            None => INVALID_VALUE,
        }
    }};
}

fn new_handle() -> usize {
    NEXT_HANDLE.fetch_add(0x10, Ordering::Relaxed)
}

/// A recorded kernel launch (see `mcmockLastLaunch`).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct MockLaunch {
    pub grid: [c_uint; 3],
    pub block: [c_uint; 3],
    pub shared_memory: c_uint,
    pub stream: usize,
    pub function: usize,
}

struct Injection {
    symbol: String,
    code: c_int,
    skip: u32,
    remaining: Option<u32>,
}

thread_local! {
    static CURRENT_DEVICE: Cell<c_int> = const { Cell::new(0) };
    static DEFAULT_STREAM: Cell<usize> = const { Cell::new(0) };
    static INJECTIONS: RefCell<Vec<Injection>> = const { RefCell::new(Vec::new()) };
    static LAUNCHES: RefCell<Vec<MockLaunch>> = const { RefCell::new(Vec::new()) };
    static COMPILES: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

fn env_injections() -> &'static Vec<(String, c_int)> {
    static ENV: OnceLock<Vec<(String, c_int)>> = OnceLock::new();
    ENV.get_or_init(|| {
        std::env::var("MCMOCK_INJECT")
            .unwrap_or_default()
            .split(',')
            .filter_map(|item| {
                let (symbol, code) = item.split_once('=')?;
                Some((symbol.trim().to_string(), code.trim().parse().ok()?))
            })
            .collect()
    })
}

/// Injections for every thread (`mcmockInjectErrorGlobal`), e.g. for calls made on a server's
/// own thread.
static GLOBAL_INJECTIONS: Mutex<Vec<Injection>> = Mutex::new(Vec::new());
/// Every launch, from any thread (`mcmockGlobal*`).
static GLOBAL_LAUNCHES: Mutex<Vec<MockLaunch>> = Mutex::new(Vec::new());
/// Every compiled source with its options, from any thread.
static GLOBAL_COMPILES: Mutex<Vec<(String, Vec<String>)>> = Mutex::new(Vec::new());
/// Successful device allocations, from any thread.
static GLOBAL_MALLOCS: AtomicU64 = AtomicU64::new(0);

fn take_injection(list: &mut Vec<Injection>, symbol: &str) -> Option<c_int> {
    let index = list.iter().position(|i| i.symbol == symbol)?;
    let injection = &mut list[index];
    if injection.skip > 0 {
        injection.skip -= 1;
        return None;
    }
    let code = injection.code;
    if let Some(remaining) = injection.remaining.as_mut() {
        *remaining -= 1;
        if *remaining == 0 {
            list.remove(index);
        }
    }
    Some(code)
}

/// The injected status for a call of `symbol`, if any.
fn injected(symbol: &str) -> Option<c_int> {
    if let Some((_, code)) = env_injections().iter().find(|(s, _)| s == symbol) {
        return Some(*code);
    }
    if let Some(code) =
        take_injection(&mut GLOBAL_INJECTIONS.lock().unwrap_or_else(|e| e.into_inner()), symbol)
    {
        return Some(code);
    }
    INJECTIONS.with(|list| take_injection(&mut list.borrow_mut(), symbol))
}

macro_rules! inject {
    ($name:literal) => {
        if let Some(code) = injected($name) {
            return code;
        }
    };
}

fn device_count() -> c_int {
    match DEVICE_COUNT.load(Ordering::Relaxed) {
        0 => std::env::var("MCMOCK_DEVICE_COUNT").ok().and_then(|v| v.parse().ok()).unwrap_or(1),
        n => c_int::try_from(n).unwrap_or(c_int::MAX),
    }
}

// ---- deferred execution ---------------------------------------------------------------------------

fn me() -> Option<ThreadId> {
    Some(std::thread::current().id())
}

impl State {
    /// Maps the null handle to the calling thread's legacy default stream. Each thread has its
    /// own (a mock simplification that keeps parallel tests independent: device-wide
    /// synchronisation and default-stream ordering only involve the calling thread's streams).
    fn resolve(&mut self, stream: usize) -> usize {
        if stream != 0 {
            return stream;
        }
        let id = DEFAULT_STREAM.with(Cell::get);
        if id != 0 && self.streams.contains_key(&id) {
            return id;
        }
        let id = new_handle();
        self.streams.insert(id, Stream { owner: me(), ..Stream::default() });
        DEFAULT_STREAM.with(|c| c.set(id));
        id
    }

    /// Whether `[addr, addr+len)` lies inside one device allocation.
    fn in_device_range(&self, addr: usize, len: usize) -> bool {
        match self.device_mem.range(..=addr).next_back() {
            Some((&base, (mem, _))) => addr + len <= base + mem.len(),
            None => false,
        }
    }

    /// Appends `op` to `stream`, adding the legacy default-stream ordering edges.
    fn enqueue(&mut self, stream: usize, op: Op) -> Result<u64, c_int> {
        let default_id = self.resolve(0);
        let stream = self.resolve(stream);
        if !self.streams.contains_key(&stream) {
            return Err(INVALID_HANDLE);
        }
        let mut edges = Vec::new();
        if stream == default_id {
            for (&id, s) in &self.streams {
                if id != default_id && s.owner == me() && !s.non_blocking && s.tail() > s.done {
                    edges.push(Op::Wait { stream: id, seq: s.tail() });
                }
            }
        } else if self.streams.get(&stream).is_some_and(|s| !s.non_blocking) {
            let default = &self.streams[&default_id];
            if default.tail() > default.done {
                edges.push(Op::Wait { stream: default_id, seq: default.tail() });
            }
        }
        let Some(s) = self.streams.get_mut(&stream) else { return Err(INVALID_HANDLE) };
        for op in edges.into_iter().chain(std::iter::once(op)) {
            s.next_seq += 1;
            s.queue.push_back((s.next_seq, op));
        }
        Ok(s.next_seq)
    }

    /// Runs `stream`'s queued work up to and including sequence number `upto`. Returns whether
    /// it got there: `false` when it is blocked on a collective whose peers have not queued
    /// theirs yet (the work before it has run).
    fn flush(&mut self, stream: usize, upto: u64) -> bool {
        thread_local! {
            static DEPTH: Cell<u32> = const { Cell::new(0) };
        }
        // Cyclic waits between streams are a deadlock on a real device too: give up.
        if DEPTH.with(Cell::get) > 256 {
            return false;
        }
        DEPTH.with(|d| d.set(d.get() + 1));
        let reached = self.flush_inner(stream, upto);
        DEPTH.with(|d| d.set(d.get() - 1));
        reached
    }

    fn flush_inner(&mut self, stream: usize, upto: u64) -> bool {
        loop {
            let Some(s) = self.streams.get(&stream) else { return true };
            let (seq, blocked) = match s.queue.front() {
                Some((seq, _)) if *seq > upto => return true,
                None => return true,
                Some((seq, Op::Wait { stream: other, seq: until })) => {
                    let (seq, other, until) = (*seq, *other, *until);
                    (seq, !self.flush(other, until))
                }
                Some((seq, Op::Coll { comm, round })) => {
                    let (seq, comm, round) = (*seq, *comm, *round);
                    if self.run_collective(stream, seq, comm, round) {
                        // `run_collective` popped the operation of every participant.
                        continue;
                    }
                    return false;
                }
                Some((seq, _)) => (*seq, false),
            };
            if blocked {
                return false;
            }
            let Some(s) = self.streams.get_mut(&stream) else { return true };
            let Some((_, op)) = s.queue.pop_front() else { return true };
            s.done = seq;
            match op {
                Op::Copy { dst, src, len } => {
                    // SAFETY: both ranges were validated at enqueue time (device side) or are
                    // guaranteed live by the caller of the async copy (host side).
                    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) }
                }
                Op::Mark { event } => {
                    if let Some(e) = self.events.get_mut(&event) {
                        e.time = Some(Instant::now());
                    }
                }
                Op::Launch => s.launches_run += 1,
                Op::Free { addr } => {
                    self.device_mem.remove(&addr);
                }
                Op::Wait { .. } | Op::Coll { .. } => {}
            }
        }
    }

    /// Device-wide synchronisation (of the calling thread's streams, see [`State::resolve`]).
    /// Returns whether every stream got to its end.
    fn flush_all(&mut self) -> bool {
        let ids: Vec<(usize, u64)> =
            self.streams.iter().filter(|(_, s)| s.owner == me()).map(|(&id, s)| (id, s.tail())).collect();
        let mut all = true;
        for (id, tail) in ids {
            all &= self.flush(id, tail);
        }
        all
    }

    /// Runs `stream`'s whole queue; `Err` for an unknown stream.
    fn flush_stream(&mut self, stream: usize) -> Result<bool, c_int> {
        let stream = self.resolve(stream);
        let Some(tail) = self.streams.get(&stream).map(Stream::tail) else { return Err(INVALID_HANDLE) };
        Ok(self.flush(stream, tail))
    }
}

/// A blocking wait of `attempt` (see [`block_until`]) as a runtime status.
fn wait_status(guard: MutexGuard<'static, Option<State>>, attempt: impl FnMut(&mut State) -> bool) -> c_int {
    let (_guard, done) = block_until(guard, attempt);
    if done { SUCCESS } else { TIMEOUT }
}

// ---- devices ---------------------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcGetDeviceCount(count: *mut c_int) -> c_int {
    inject!("mcGetDeviceCount");
    if count.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: checked non-null; the caller passes a writable int.
    unsafe { *count = device_count() };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcSetDevice(device: c_int) -> c_int {
    inject!("mcSetDevice");
    if device < 0 || device >= device_count() {
        return INVALID_DEVICE;
    }
    CURRENT_DEVICE.with(|c| c.set(device));
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcDeviceGetAttribute(value: *mut c_int, attribute: c_int, device: c_int) -> c_int {
    inject!("mcDeviceGetAttribute");
    if value.is_null() {
        return INVALID_VALUE;
    }
    if device < 0 || device >= device_count() {
        return INVALID_DEVICE;
    }
    let v = match attribute {
        0 => 1024,      // max threads per block
        1..=3 => 1024,  // max block dims
        4 => i32::MAX,  // max grid x
        5 | 6 => 65535, // max grid y, z
        7 => 64 * 1024, // shared memory per block
        9 | 10 => 64,   // warp / wave size
        16 => 104,      // multiprocessors
        21 => 10,       // compute capability major
        22 => 0,        // compute capability minor
        _ => 0,
    };
    // SAFETY: checked non-null.
    unsafe { *value = v };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcDeviceGetName(name: *mut c_char, len: c_int, device: c_int) -> c_int {
    inject!("mcDeviceGetName");
    if name.is_null() || len <= 0 {
        return INVALID_VALUE;
    }
    if device < 0 || device >= device_count() {
        return INVALID_DEVICE;
    }
    let text = b"MetaX Mock C500\0";
    let n = text.len().min(len as usize);
    // SAFETY: the caller provides `len` writable bytes; at most that many are written.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr().cast(), name, n);
        *name.add(n - 1) = 0;
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcDeviceSynchronize() -> c_int {
    inject!("mcDeviceSynchronize");
    wait_status(state(), State::flush_all)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcMemGetInfo(free: *mut usize, total: *mut usize) -> c_int {
    inject!("mcMemGetInfo");
    if free.is_null() || total.is_null() {
        return INVALID_VALUE;
    }
    with_state!(|s| {
        let used: usize = s.device_mem.values().map(|(m, _)| m.len()).sum();
        // SAFETY: checked non-null.
        unsafe {
            *free = TOTAL_MEMORY.saturating_sub(used);
            *total = TOTAL_MEMORY;
        }
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcGetErrorName(code: c_int) -> *const c_char {
    let name: &'static CStr = match code {
        0 => c"mcSuccess",
        1 => c"mcErrorInvalidValue",
        2 => c"mcErrorMemoryAllocation",
        400 => c"mcErrorInvalidResourceHandle",
        700 => c"mcErrorIllegalAddress",
        _ => c"mcErrorUnknown",
    };
    name.as_ptr()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcGetErrorString(code: c_int) -> *const c_char {
    let text: &'static CStr = match code {
        0 => c"no error",
        1 => c"invalid argument",
        2 => c"out of memory",
        700 => c"an illegal memory access was encountered",
        _ => c"unknown error (mock)",
    };
    text.as_ptr()
}

// ---- memory -------------------------------------------------------------------------------------

fn allocate(s: &mut State, size: usize) -> usize {
    if size == 0 {
        return 0;
    }
    GLOBAL_MALLOCS.fetch_add(1, Ordering::Relaxed);
    let mem = vec![0xCDu8; size].into_boxed_slice();
    let addr = mem.as_ptr() as usize;
    s.device_mem.insert(addr, (mem, std::thread::current().id()));
    addr
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcMalloc(ptr: *mut *mut c_void, size: usize) -> c_int {
    inject!("mcMalloc");
    if ptr.is_null() {
        return INVALID_VALUE;
    }
    with_state!(|s| {
        let addr = allocate(s, size);
        // SAFETY: checked non-null.
        unsafe { *ptr = addr as *mut c_void };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcMallocAsync(ptr: *mut *mut c_void, size: usize, stream: *mut c_void) -> c_int {
    inject!("mcMallocAsync");
    if ptr.is_null() {
        return INVALID_VALUE;
    }
    with_state!(|s| {
        let stream = s.resolve(stream as usize);
        if !s.streams.contains_key(&stream) {
            return INVALID_HANDLE;
        }
        let addr = allocate(s, size);
        // SAFETY: checked non-null.
        unsafe { *ptr = addr as *mut c_void };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcFree(ptr: *mut c_void) -> c_int {
    inject!("mcFree");
    if ptr.is_null() {
        return SUCCESS;
    }
    // Like the real runtime, freeing synchronises the device first.
    let (mut guard, done) = block_until(state(), State::flush_all);
    if !done {
        return TIMEOUT;
    }
    match guard.as_mut().and_then(|s| s.device_mem.remove(&(ptr as usize))) {
        Some(_) => SUCCESS,
        None => INVALID_VALUE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcFreeAsync(ptr: *mut c_void, stream: *mut c_void) -> c_int {
    inject!("mcFreeAsync");
    with_state!(|s| {
        if !s.device_mem.contains_key(&(ptr as usize)) {
            return INVALID_VALUE;
        }
        match s.enqueue(stream as usize, Op::Free { addr: ptr as usize }) {
            Ok(_) => SUCCESS,
            Err(code) => code,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcMallocHost(ptr: *mut *mut c_void, size: usize) -> c_int {
    inject!("mcMallocHost");
    if ptr.is_null() {
        return INVALID_VALUE;
    }
    with_state!(|s| {
        let mem = vec![0u8; size.max(1)].into_boxed_slice();
        let addr = mem.as_ptr() as usize;
        s.host_mem.insert(addr, mem);
        // SAFETY: checked non-null.
        unsafe { *ptr = addr as *mut c_void };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcFreeHost(ptr: *mut c_void) -> c_int {
    inject!("mcFreeHost");
    let (mut guard, done) = block_until(state(), State::flush_all);
    if !done {
        return TIMEOUT;
    }
    match guard.as_mut().and_then(|s| s.host_mem.remove(&(ptr as usize))) {
        Some(_) => SUCCESS,
        None => INVALID_VALUE,
    }
}

/// Validates a copy and queues it on `stream`.
fn queue_copy(s: &mut State, dst: usize, src: usize, len: usize, kind: c_int, stream: usize) -> c_int {
    let (dst_device, src_device) = match kind {
        1 => (true, false),
        2 => (false, true),
        3 => (true, true),
        _ => return INVALID_MEMCPY_DIRECTION,
    };
    if len == 0 {
        return SUCCESS;
    }
    if dst == 0 || src == 0 {
        return INVALID_VALUE;
    }
    if (dst_device && !s.in_device_range(dst, len)) || (src_device && !s.in_device_range(src, len)) {
        return INVALID_VALUE;
    }
    match s.enqueue(stream, Op::Copy { dst, src, len }) {
        Ok(_) => SUCCESS,
        Err(code) => code,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcMemcpy(dst: *mut c_void, src: *const c_void, len: usize, kind: c_int) -> c_int {
    inject!("mcMemcpy");
    // Legacy default-stream semantics: queued after (and ordered with) blocking streams' work
    // only, then run to completion.
    let guard = state();
    let mut guard = guard;
    let status = match guard.as_mut() {
        Some(s) => queue_copy(s, dst as usize, src as usize, len, kind, 0),
        None => INVALID_VALUE,
    };
    if status != SUCCESS {
        return status;
    }
    wait_status(guard, |s| s.flush_stream(0).unwrap_or(true))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcMemcpyAsync(
    dst: *mut c_void,
    src: *const c_void,
    len: usize,
    kind: c_int,
    stream: *mut c_void,
) -> c_int {
    inject!("mcMemcpyAsync");
    with_state!(|s| queue_copy(s, dst as usize, src as usize, len, kind, stream as usize))
}

// ---- streams and events -------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcStreamCreateWithFlags(stream: *mut *mut c_void, flags: c_uint) -> c_int {
    inject!("mcStreamCreateWithFlags");
    if stream.is_null() {
        return INVALID_VALUE;
    }
    with_state!(|s| {
        let id = new_handle();
        s.streams.insert(id, Stream { non_blocking: flags & 1 != 0, owner: me(), ..Stream::default() });
        // SAFETY: checked non-null.
        unsafe { *stream = id as *mut c_void };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcStreamDestroy(stream: *mut c_void) -> c_int {
    inject!("mcStreamDestroy");
    let id = stream as usize;
    let guard = state();
    let known = guard.as_ref().is_some_and(|s| s.streams.contains_key(&id));
    if id == 0 || id == DEFAULT_STREAM.with(Cell::get) || !known {
        return INVALID_HANDLE;
    }
    // Queued work still completes.
    let (mut guard, done) = block_until(guard, |s| s.flush_stream(id).unwrap_or(true));
    if !done {
        return TIMEOUT;
    }
    if let Some(s) = guard.as_mut() {
        s.streams.remove(&id);
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcStreamSynchronize(stream: *mut c_void) -> c_int {
    inject!("mcStreamSynchronize");
    let mut guard = state();
    let known = guard.as_mut().is_some_and(|s| s.flush_stream(stream as usize).is_ok());
    if !known {
        return INVALID_HANDLE;
    }
    wait_status(guard, |s| s.flush_stream(stream as usize).unwrap_or(true))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcStreamWaitEvent(stream: *mut c_void, event: *mut c_void, _flags: c_uint) -> c_int {
    inject!("mcStreamWaitEvent");
    with_state!(|s| {
        let stream = s.resolve(stream as usize);
        let Some(e) = s.events.get(&(event as usize)) else { return INVALID_HANDLE };
        match e.recorded {
            Some((other, seq)) => match s.enqueue(stream, Op::Wait { stream: other, seq }) {
                Ok(_) => {
                    log_order(LOG_WAIT, stream, other);
                    SUCCESS
                }
                Err(code) => code,
            },
            None if s.streams.contains_key(&stream) => SUCCESS,
            None => INVALID_HANDLE,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcEventCreateWithFlags(event: *mut *mut c_void, flags: c_uint) -> c_int {
    inject!("mcEventCreateWithFlags");
    if event.is_null() {
        return INVALID_VALUE;
    }
    with_state!(|s| {
        let id = new_handle();
        s.events.insert(id, Event { recorded: None, time: None, timing: flags & 2 == 0 });
        // SAFETY: checked non-null.
        unsafe { *event = id as *mut c_void };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcEventDestroy(event: *mut c_void) -> c_int {
    inject!("mcEventDestroy");
    with_state!(|s| match s.events.remove(&(event as usize)) {
        Some(_) => SUCCESS,
        None => INVALID_HANDLE,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcEventRecord(event: *mut c_void, stream: *mut c_void) -> c_int {
    inject!("mcEventRecord");
    with_state!(|s| {
        let id = event as usize;
        let stream = s.resolve(stream as usize);
        if !s.events.contains_key(&id) {
            return INVALID_HANDLE;
        }
        match s.enqueue(stream, Op::Mark { event: id }) {
            Ok(seq) => {
                if let Some(e) = s.events.get_mut(&id) {
                    e.recorded = Some((stream, seq));
                    e.time = None;
                }
                log_order(LOG_RECORD, stream, id);
                SUCCESS
            }
            Err(code) => code,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcEventSynchronize(event: *mut c_void) -> c_int {
    inject!("mcEventSynchronize");
    let guard = state();
    let Some(recorded) = guard.as_ref().and_then(|s| s.events.get(&(event as usize))).map(|e| e.recorded) else {
        return INVALID_HANDLE;
    };
    match recorded {
        Some((stream, seq)) => wait_status(guard, |s| s.flush(stream, seq)),
        None => SUCCESS,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcEventQuery(event: *mut c_void) -> c_int {
    inject!("mcEventQuery");
    with_state!(|s| {
        let Some(e) = s.events.get(&(event as usize)) else { return INVALID_HANDLE };
        let recorded = e.recorded;
        if let Some((stream, seq)) = recorded
            && QUERY_PROGRESS.load(Ordering::Relaxed)
        {
            // Runs what it can, without blocking (a real device runs queued work on its own).
            s.flush(stream, seq);
        }
        match recorded {
            Some((stream, seq)) if s.streams.get(&stream).is_some_and(|st| st.done < seq) => NOT_READY,
            _ => SUCCESS,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcEventElapsedTime(ms: *mut f32, start: *mut c_void, end: *mut c_void) -> c_int {
    inject!("mcEventElapsedTime");
    if ms.is_null() {
        return INVALID_VALUE;
    }
    with_state!(|s| {
        let (Some(a), Some(b)) = (s.events.get(&(start as usize)), s.events.get(&(end as usize))) else {
            return INVALID_HANDLE;
        };
        if !a.timing || !b.timing {
            return INVALID_HANDLE;
        }
        match (a.time, b.time) {
            (Some(t0), Some(t1)) => {
                // SAFETY: checked non-null.
                unsafe { *ms = t1.saturating_duration_since(t0).as_secs_f32() * 1000.0 };
                SUCCESS
            }
            _ => NOT_READY,
        }
    })
}

// ---- modules and launches -----------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcModuleLoadData(module: *mut *mut c_void, image: *const c_void) -> c_int {
    inject!("mcModuleLoadData");
    if module.is_null() || image.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: a valid image starts with the 8-byte magic and an 8-byte length; the caller passes
    // a readable image (the magic is checked before the length is trusted).
    let header = unsafe { std::slice::from_raw_parts(image.cast::<u8>(), 16) };
    if &header[..8] != IMAGE_MAGIC {
        return INVALID_KERNEL_IMAGE;
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(&header[8..16]);
    let len = u64::from_le_bytes(len) as usize;
    // SAFETY: the image produced by the mock compiler holds `len` payload bytes after its header.
    let payload = unsafe { std::slice::from_raw_parts(image.cast::<u8>().add(16), len) };
    let names: Vec<String> =
        String::from_utf8_lossy(payload).lines().filter(|l| !l.is_empty()).map(str::to_string).collect();
    with_state!(|s| {
        let id = new_handle();
        s.modules.insert(id, names);
        // SAFETY: checked non-null.
        unsafe { *module = id as *mut c_void };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcModuleUnload(module: *mut c_void) -> c_int {
    inject!("mcModuleUnload");
    with_state!(|s| {
        let id = module as usize;
        if s.modules.remove(&id).is_none() {
            return INVALID_HANDLE;
        }
        s.functions.retain(|_, (m, _)| *m != id);
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcModuleGetFunction(
    function: *mut *mut c_void,
    module: *mut c_void,
    name: *const c_char,
) -> c_int {
    inject!("mcModuleGetFunction");
    if function.is_null() || name.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: the caller passes a NUL-terminated name.
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
    with_state!(|s| {
        let Some(names) = s.modules.get(&(module as usize)) else { return INVALID_HANDLE };
        if !names.contains(&name) {
            return SYMBOL_NOT_FOUND;
        }
        let id = new_handle();
        s.functions.insert(id, (module as usize, name.clone()));
        // SAFETY: checked non-null.
        unsafe { *function = id as *mut c_void };
        SUCCESS
    })
}

#[cfg(not(feature = "missing-launch"))]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcModuleLaunchKernel(
    function: *mut c_void,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared_memory: c_uint,
    stream: *mut c_void,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> c_int {
    inject!("mcModuleLaunchKernel");
    let threads = u64::from(bx) * u64::from(by) * u64::from(bz);
    if gx == 0 || gy == 0 || gz == 0 || threads == 0 || threads > 1024 || shared_memory > 64 * 1024 {
        return INVALID_CONFIGURATION;
    }
    with_state!(|s| {
        if !s.functions.contains_key(&(function as usize)) {
            return INVALID_HANDLE;
        }
        let stream = s.resolve(stream as usize);
        if let Err(code) = s.enqueue(stream, Op::Launch) {
            return code;
        }
        let launch = MockLaunch {
            grid: [gx, gy, gz],
            block: [bx, by, bz],
            shared_memory,
            stream,
            function: function as usize,
        };
        LAUNCHES.with(|l| l.borrow_mut().push(launch));
        GLOBAL_LAUNCHES.lock().unwrap_or_else(|e| e.into_inner()).push(launch);
        TOTAL_LAUNCHES.fetch_add(1, Ordering::Relaxed);
        SUCCESS
    })
}

// ---- run-time compiler --------------------------------------------------------------------------

/// The `__global__` function names of `source` (the identifier before the first `(` after the
/// `__global__` keyword).
fn kernel_names(source: &str) -> Vec<String> {
    source
        .split("__global__")
        .skip(1)
        .filter_map(|rest| {
            // Skip a `__launch_bounds__(…)` qualifier between the return type and the name.
            let rest = match rest.find("__launch_bounds__") {
                Some(at) if rest[..at].trim() == "void" => {
                    let after = &rest[at..];
                    &after[after.find(')')? + 1..]
                }
                _ => rest,
            };
            let head = &rest[..rest.find('(')?];
            let name = head.split(|c: char| !(c.is_alphanumeric() || c == '_')).rfind(|t| !t.is_empty())?;
            Some(name.to_string())
        })
        .collect()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcrtcCreateProgram(
    program: *mut *mut c_void,
    source: *const c_char,
    _name: *const c_char,
    num_headers: c_int,
    _headers: *const *const c_char,
    _include_names: *const *const c_char,
) -> c_int {
    inject!("mcrtcCreateProgram");
    if program.is_null() || source.is_null() || num_headers < 0 {
        return RTC_INVALID_INPUT;
    }
    // SAFETY: the caller passes a NUL-terminated source.
    let source = unsafe { CStr::from_ptr(source) }.to_string_lossy().into_owned();
    let mut guard = state();
    let Some(s) = guard.as_mut() else { return RTC_INVALID_INPUT };
    let id = new_handle();
    s.programs.insert(id, Program { source, log: String::new(), image: None });
    // SAFETY: checked non-null.
    unsafe { *program = id as *mut c_void };
    RTC_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcrtcCompileProgram(
    program: *mut c_void,
    num_options: c_int,
    options: *const *const c_char,
) -> c_int {
    inject!("mcrtcCompileProgram");
    let mut opts = Vec::new();
    for i in 0..num_options.max(0) as usize {
        // SAFETY: the caller passes `num_options` NUL-terminated strings.
        let opt = unsafe { CStr::from_ptr(*options.add(i)) };
        opts.push(opt.to_string_lossy().into_owned());
    }
    let mut guard = state();
    let Some(s) = guard.as_mut() else { return RTC_INVALID_PROGRAM };
    let Some(p) = s.programs.get_mut(&(program as usize)) else { return RTC_INVALID_PROGRAM };
    COMPILES.with(|c| c.borrow_mut().push(p.source.clone()));
    GLOBAL_COMPILES.lock().unwrap_or_else(|e| e.into_inner()).push((p.source.clone(), opts.clone()));
    if let Some(line) = p.source.lines().find(|l| l.trim_start().starts_with("#error")) {
        p.log = format!("mock-mcrtc: error: {}\n", line.trim());
        return RTC_COMPILATION;
    }
    let names = kernel_names(&p.source);
    p.log = format!("mock-mcrtc: {} kernel(s); options: {}\n", names.len(), opts.join(" "));
    let payload = names.join("\n").into_bytes();
    let mut image = IMAGE_MAGIC.to_vec();
    image.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    image.extend_from_slice(&payload);
    p.image = Some(image);
    RTC_SUCCESS
}

fn with_program(program: *mut c_void, f: impl FnOnce(&Program) -> c_int) -> c_int {
    let guard = state();
    match guard.as_ref().and_then(|s| s.programs.get(&(program as usize))) {
        Some(p) => f(p),
        None => RTC_INVALID_PROGRAM,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcrtcGetProgramLogSize(program: *mut c_void, size: *mut usize) -> c_int {
    inject!("mcrtcGetProgramLogSize");
    with_program(program, |p| {
        // SAFETY: the caller passes a writable size_t.
        unsafe { *size = p.log.len() + 1 };
        RTC_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcrtcGetProgramLog(program: *mut c_void, log: *mut c_char) -> c_int {
    inject!("mcrtcGetProgramLog");
    with_program(program, |p| {
        // SAFETY: the caller provides the size returned by `mcrtcGetProgramLogSize`.
        unsafe {
            std::ptr::copy_nonoverlapping(p.log.as_ptr().cast(), log, p.log.len());
            *log.add(p.log.len()) = 0;
        }
        RTC_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcrtcGetBitcodeSize(program: *mut c_void, size: *mut usize) -> c_int {
    inject!("mcrtcGetBitcodeSize");
    with_program(program, |p| match &p.image {
        Some(image) => {
            // SAFETY: the caller passes a writable size_t.
            unsafe { *size = image.len() };
            RTC_SUCCESS
        }
        None => RTC_INVALID_PROGRAM,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcrtcGetBitcode(program: *mut c_void, out: *mut c_char) -> c_int {
    inject!("mcrtcGetBitcode");
    with_program(program, |p| match &p.image {
        Some(image) => {
            // SAFETY: the caller provides the size returned by `mcrtcGetBitcodeSize`.
            unsafe { std::ptr::copy_nonoverlapping(image.as_ptr().cast(), out, image.len()) };
            RTC_SUCCESS
        }
        None => RTC_INVALID_PROGRAM,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcrtcDestroyProgram(program: *mut *mut c_void) -> c_int {
    inject!("mcrtcDestroyProgram");
    if program.is_null() {
        return RTC_INVALID_INPUT;
    }
    // SAFETY: checked non-null.
    let id = unsafe { *program } as usize;
    let mut guard = state();
    let Some(s) = guard.as_mut() else { return RTC_INVALID_PROGRAM };
    match s.programs.remove(&id) {
        Some(_) => {
            // SAFETY: checked non-null.
            unsafe { *program = std::ptr::null_mut() };
            RTC_SUCCESS
        }
        None => RTC_INVALID_PROGRAM,
    }
}

// ---- control and inspection (mock only) -----------------------------------------------------------

/// Makes calls of `symbol` *on the calling thread* return `code`: after `skip` successful calls,
/// for the next `count` calls (`0`: every later call).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcmockInjectError(symbol: *const c_char, code: c_int, skip: c_uint, count: c_uint) {
    if symbol.is_null() {
        return;
    }
    // SAFETY: the caller passes a NUL-terminated name.
    let symbol = unsafe { CStr::from_ptr(symbol) }.to_string_lossy().into_owned();
    let remaining = (count > 0).then_some(count);
    INJECTIONS.with(|l| l.borrow_mut().push(Injection { symbol, code, skip, remaining }));
}

/// Removes the calling thread's injected errors.
#[unsafe(no_mangle)]
pub extern "C" fn mcmockClearInjections() {
    INJECTIONS.with(|l| l.borrow_mut().clear());
}

/// Kernel launches accepted on the calling thread.
#[unsafe(no_mangle)]
pub extern "C" fn mcmockLaunchCount() -> u64 {
    LAUNCHES.with(|l| l.borrow().len() as u64)
}

/// The last launch accepted on the calling thread; returns 0 and leaves `out` alone if none.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcmockLastLaunch(out: *mut MockLaunch) -> c_int {
    match LAUNCHES.with(|l| l.borrow().last().copied()) {
        Some(launch) if !out.is_null() => {
            // SAFETY: checked non-null; the caller passes a writable `MockLaunch`.
            unsafe { *out = launch };
            1
        }
        _ => 0,
    }
}

/// Programs compiled on the calling thread.
#[unsafe(no_mangle)]
pub extern "C" fn mcmockCompileCount() -> u64 {
    COMPILES.with(|c| c.borrow().len() as u64)
}

/// Operations queued on `stream` and not yet run (u64::MAX for an unknown stream).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcmockPendingOps(stream: *mut c_void) -> u64 {
    let mut guard = state();
    guard.as_mut().map_or(u64::MAX, |s| {
        let id = s.resolve(stream as usize);
        s.streams.get(&id).map_or(u64::MAX, |st| st.queue.len() as u64)
    })
}

/// Launches that have run (been reached by a synchronisation) on `stream`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcmockLaunchesRun(stream: *mut c_void) -> u64 {
    let mut guard = state();
    guard.as_mut().map_or(0, |s| {
        let id = s.resolve(stream as usize);
        s.streams.get(&id).map_or(0, |st| st.launches_run)
    })
}

/// Device allocations made on the calling thread and still live.
#[unsafe(no_mangle)]
pub extern "C" fn mcmockLiveAllocations() -> u64 {
    let me = std::thread::current().id();
    let guard = state();
    guard.as_ref().map_or(0, |s| s.device_mem.values().filter(|(_, owner)| *owner == me).count() as u64)
}

// ---- process-wide inspection (calls made on any thread) --------------------------------------------

/// As `mcmockInjectError`, but for calls made on *any* thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcmockInjectErrorGlobal(
    symbol: *const c_char,
    code: c_int,
    skip: c_uint,
    count: c_uint,
) {
    if symbol.is_null() {
        return;
    }
    // SAFETY: the caller passes a NUL-terminated name.
    let symbol = unsafe { CStr::from_ptr(symbol) }.to_string_lossy().into_owned();
    let remaining = (count > 0).then_some(count);
    GLOBAL_INJECTIONS.lock().unwrap_or_else(|e| e.into_inner()).push(Injection {
        symbol,
        code,
        skip,
        remaining,
    });
}

/// Removes the injections made with `mcmockInjectErrorGlobal`.
#[unsafe(no_mangle)]
pub extern "C" fn mcmockClearGlobalInjections() {
    GLOBAL_INJECTIONS.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

/// Kernel launches accepted on any thread.
#[unsafe(no_mangle)]
pub extern "C" fn mcmockGlobalLaunchCount() -> u64 {
    GLOBAL_LAUNCHES.lock().unwrap_or_else(|e| e.into_inner()).len() as u64
}

/// Launch number `index` (0-based, any thread); returns 0 and leaves `out` alone if none.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcmockGlobalLaunch(index: u64, out: *mut MockLaunch) -> c_int {
    let launches = GLOBAL_LAUNCHES.lock().unwrap_or_else(|e| e.into_inner());
    match launches.get(index as usize) {
        Some(launch) if !out.is_null() => {
            // SAFETY: checked non-null; the caller passes a writable `MockLaunch`.
            unsafe { *out = *launch };
            1
        }
        _ => 0,
    }
}

/// Programs compiled on any thread.
#[unsafe(no_mangle)]
pub extern "C" fn mcmockGlobalCompileCount() -> u64 {
    GLOBAL_COMPILES.lock().unwrap_or_else(|e| e.into_inner()).len() as u64
}

/// Copies the source (`what` = 0) or the space-joined options (`what` = 1) of compile number
/// `index` into `buf` (at most `len` bytes, NUL-terminated if room); returns the full length + 1,
/// or 0 if there is no such compile.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcmockGlobalCompileText(
    index: u64,
    what: c_int,
    buf: *mut c_char,
    len: usize,
) -> usize {
    let compiles = GLOBAL_COMPILES.lock().unwrap_or_else(|e| e.into_inner());
    let Some((source, options)) = compiles.get(index as usize) else { return 0 };
    let text = if what == 0 { source.clone() } else { options.join(" ") };
    if !buf.is_null() && len > 0 {
        let n = text.len().min(len - 1);
        // SAFETY: the caller passes `len` writable bytes; `n + 1 <= len`.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr().cast(), buf, n);
            *buf.add(n) = 0;
        }
    }
    text.len() + 1
}

/// Operations queued on all streams (of all threads) and not yet run.
#[unsafe(no_mangle)]
pub extern "C" fn mcmockTotalPendingOps() -> u64 {
    let guard = state();
    guard.as_ref().map_or(0, |s| s.streams.values().map(|st| st.queue.len() as u64).sum())
}

/// Device allocations still live, made on any thread.
#[unsafe(no_mangle)]
pub extern "C" fn mcmockTotalLiveAllocations() -> u64 {
    let guard = state();
    guard.as_ref().map_or(0, |s| s.device_mem.len() as u64)
}

/// Successful non-empty device allocations so far (any thread).
#[unsafe(no_mangle)]
pub extern "C" fn mcmockTotalMallocs() -> u64 {
    GLOBAL_MALLOCS.load(Ordering::Relaxed)
}

// ---- MCCL (libmccl.so) ------------------------------------------------------------------------------
//
// The tests install this same library a second time as `lib/libmccl.so`. Ranks are threads of
// this process; see the module documentation.

const MCCL_SUCCESS: c_int = 0;
const MCCL_INVALID_ARGUMENT: c_int = 4;
const MCCL_INVALID_USAGE: c_int = 5;
const MCCL_REMOTE_ERROR: c_int = 6;
const MCCL_ID_MAGIC: &[u8; 8] = b"MCMOCKID";

/// `mcclUniqueId` (128 opaque bytes, passed by value to `mcclCommInitRank`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct McclUniqueId {
    pub internal: [c_char; 128],
}

/// One rank's communicator.
struct CommInfo {
    clique: [u8; 128],
    rank: usize,
    next_round: u64,
    aborted: bool,
    destroyed: bool,
}

/// The ranks that joined with one unique id, and their collectives not yet run.
struct Clique {
    members: Vec<Option<usize>>,
    rounds: HashMap<u64, Vec<Option<Part>>>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    AllGather,
    ReduceScatter,
    AllReduce,
    Broadcast,
}

/// One rank's part of a collective.
#[derive(Clone, Copy, Debug)]
struct Part {
    kind: Kind,
    comm: usize,
    rank: usize,
    send: usize,
    recv: usize,
    /// Elements per rank: all-gather's send count, reduce-scatter's receive count, all-reduce's
    /// and broadcast's count.
    count: usize,
    datatype: c_int,
    op: c_int,
    root: usize,
    stream: usize,
    seq: u64,
}

impl Part {
    /// Bytes read from `send` and written to `recv`.
    fn lengths(&self, world: usize, size: usize) -> (usize, usize) {
        let n = self.count * size;
        match self.kind {
            Kind::AllGather => (n, n * world),
            Kind::ReduceScatter => (n * world, n),
            Kind::AllReduce => (n, n),
            Kind::Broadcast => (if self.rank == self.root { n } else { 0 }, n),
        }
    }
}

fn mccl_type_size(datatype: c_int) -> Option<usize> {
    match datatype {
        0 | 1 => Some(1),
        2 | 3 | 7 => Some(4),
        4 | 5 | 8 => Some(8),
        6 | 9 => Some(2),
        _ => None,
    }
}

fn f16_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = u32::from((h >> 10) & 0x1f);
    let mant = u32::from(h & 0x3ff);
    match exp {
        0 => sign * mant as f32 * 2f32.powi(-24),
        31 if mant == 0 => sign * f32::INFINITY,
        31 => f32::NAN,
        _ => f32::from_bits((u32::from(h & 0x8000) << 16) | ((exp + 112) << 23) | (mant << 13)),
    }
}

fn round_half_even(m: f32) -> f32 {
    let f = m.floor();
    let d = m - f;
    if d > 0.5 || (d == 0.5 && f % 2.0 == 1.0) { f + 1.0 } else { f }
}

fn f32_to_f16(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    if x.is_nan() {
        return sign | 0x7e00;
    }
    let a = x.abs();
    if a >= 65520.0 {
        return sign | 0x7c00;
    }
    if a < 2f32.powi(-14) {
        // Subnormal (or zero) in f16: a multiple of 2^-24, scaled exactly.
        return sign | round_half_even(a * 2f32.powi(24)) as u16;
    }
    let exp = ((bits >> 23) & 0xff) - 112;
    let mant = bits & 0x7f_ffff;
    let mut h = (exp << 10) | (mant >> 13);
    let rest = mant & 0x1fff;
    if rest > 0x1000 || (rest == 0x1000 && h & 1 == 1) {
        h += 1;
    }
    sign | h as u16
}

fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x40;
    }
    let lsb = (bits >> 16) & 1;
    (bits.wrapping_add(0x7fff + lsb) >> 16) as u16
}

/// Elements of a 16- or 32-bit float type as f32.
fn decode_f32(datatype: c_int, bytes: &[u8]) -> Vec<f32> {
    match datatype {
        6 => bytes.chunks_exact(2).map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]]))).collect(),
        9 => bytes.chunks_exact(2).map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]]))).collect(),
        _ => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
    }
}

fn encode_f32(datatype: c_int, values: &[f32]) -> Vec<u8> {
    match datatype {
        6 => values.iter().flat_map(|v| f32_to_f16(*v).to_le_bytes()).collect(),
        9 => values.iter().flat_map(|v| f32_to_bf16(*v).to_le_bytes()).collect(),
        _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// Reduces `parts` (rank order) element by element with `op` (sum 0, prod 1, max 2, min 3,
/// avg 4), accumulating in `T`.
fn reduce<T>(parts: &[Vec<T>], op: c_int, world: T) -> Vec<T>
where
    T: Copy + PartialOrd + std::ops::Add<Output = T> + std::ops::Mul<Output = T> + std::ops::Div<Output = T>,
{
    let mut acc = parts[0].clone();
    for part in &parts[1..] {
        for (a, &b) in acc.iter_mut().zip(part) {
            *a = match op {
                1 => *a * b,
                2 => {
                    if b > *a {
                        b
                    } else {
                        *a
                    }
                }
                3 => {
                    if b < *a {
                        b
                    } else {
                        *a
                    }
                }
                _ => *a + b,
            };
        }
    }
    if op == 4 {
        for a in &mut acc {
            *a = *a / world;
        }
    }
    acc
}

/// The reduction of the ranks' send buffers, as bytes of `datatype`.
fn reduce_bytes(datatype: c_int, op: c_int, sends: &[Vec<u8>]) -> Vec<u8> {
    let world = sends.len();
    if datatype == 8 {
        let parts: Vec<Vec<f64>> = sends
            .iter()
            .map(|b| b.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect())
            .collect();
        reduce(&parts, op, world as f64).iter().flat_map(|v| v.to_le_bytes()).collect()
    } else {
        let parts: Vec<Vec<f32>> = sends.iter().map(|b| decode_f32(datatype, b)).collect();
        encode_f32(datatype, &reduce(&parts, op, world as f32))
    }
}

impl State {
    fn comm_live(&self, comm: usize) -> bool {
        self.comms.get(&comm).is_some_and(|c| !c.aborted && !c.destroyed)
    }

    /// Pops `stream`'s front operation if it is number `seq`, marking it done.
    fn pop_done(&mut self, stream: usize, seq: u64) {
        if let Some(s) = self.streams.get_mut(&stream)
            && s.queue.front().is_some_and(|(q, _)| *q == seq)
        {
            s.queue.pop_front();
            s.done = seq;
        }
    }

    /// Runs round `round` of `comm`'s collectives, whose operation is number `seq` at the front of
    /// `stream`: once every rank has queued its part and every rank's stream has reached it.
    /// Pops the operation of every participant and returns `true`, or returns `false` (blocked).
    fn run_collective(&mut self, stream: usize, seq: u64, comm: usize, round: u64) -> bool {
        if !self.comm_live(comm) {
            // Aborted or destroyed: completes without data.
            self.pop_done(stream, seq);
            return true;
        }
        let Some(key) = self.comms.get(&comm).map(|c| c.clique) else { return false };
        let parts: Vec<Part> = match self.cliques.get(&key).and_then(|c| c.rounds.get(&round)) {
            Some(parts) if parts.iter().all(Option::is_some) => parts.iter().flatten().copied().collect(),
            _ => return false,
        };
        if parts.iter().any(|p| !self.comm_live(p.comm)) {
            // A peer aborted: this round never completes (the caller's timeout handles it).
            return false;
        }
        for p in &parts {
            if (p.stream, p.seq) == (stream, seq) {
                continue;
            }
            if !self.flush(p.stream, p.seq - 1) {
                return false;
            }
            let ready = self.streams.get(&p.stream).and_then(|s| s.queue.front()).is_some_and(|(q, _)| *q == p.seq);
            if !ready {
                return false;
            }
        }
        self.execute(&parts);
        for p in &parts {
            self.pop_done(p.stream, p.seq);
        }
        if let Some(clique) = self.cliques.get_mut(&key) {
            clique.rounds.remove(&round);
        }
        PROGRESS.notify_all();
        true
    }

    /// Computes a round's results into every rank's receive buffer.
    fn execute(&mut self, parts: &[Part]) {
        let first = parts[0];
        let world = parts.len();
        let matched = parts.iter().all(|p| {
            (p.kind, p.count, p.datatype, p.op, p.root) == (first.kind, first.count, first.datatype, first.op, first.root)
        });
        let Some(size) = mccl_type_size(first.datatype) else { return };
        if !matched {
            eprintln!("mock MCCL: ranks issued different collectives in one round: {parts:?}");
            return;
        }
        // Every buffer is checked again: it was valid when queued but may have been freed since.
        for p in parts {
            let (send_len, recv_len) = p.lengths(world, size);
            if (send_len > 0 && !self.in_device_range(p.send, send_len)) || !self.in_device_range(p.recv, recv_len) {
                eprintln!("mock MCCL: a buffer of {:?} was freed before the collective ran", p.kind);
                return;
            }
        }
        let read = |p: &Part, len: usize| -> Vec<u8> {
            // SAFETY: `p.send..p.send+len` lies in a live device allocation (checked above).
            unsafe { std::slice::from_raw_parts(p.send as *const u8, len) }.to_vec()
        };
        let n = first.count * size;
        let outputs: Vec<Vec<u8>> = match first.kind {
            Kind::AllGather => {
                let all: Vec<u8> = parts.iter().flat_map(|p| read(p, n)).collect();
                vec![all; world]
            }
            Kind::Broadcast => {
                let Some(root) = parts.iter().find(|p| p.rank == first.root) else { return };
                vec![read(root, n); world]
            }
            Kind::AllReduce => {
                let sends: Vec<Vec<u8>> = parts.iter().map(|p| read(p, n)).collect();
                vec![reduce_bytes(first.datatype, first.op, &sends); world]
            }
            Kind::ReduceScatter => {
                let sends: Vec<Vec<u8>> = parts.iter().map(|p| read(p, n * world)).collect();
                let all = reduce_bytes(first.datatype, first.op, &sends);
                parts.iter().map(|p| all[p.rank * n..(p.rank + 1) * n].to_vec()).collect()
            }
        };
        for (p, out) in parts.iter().zip(outputs) {
            // SAFETY: `p.recv..p.recv+out.len()` lies in a live device allocation (checked above:
            // `out.len()` is the receive length); `out` is a separate host buffer.
            unsafe { std::ptr::copy_nonoverlapping(out.as_ptr(), p.recv as *mut u8, out.len()) }
        }
    }
}

/// Validates and queues one rank's part of a collective on `stream`.
#[allow(clippy::too_many_arguments)]
fn mccl_queue(
    kind: Kind,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    datatype: c_int,
    op: c_int,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    let Some(size) = mccl_type_size(datatype) else { return MCCL_INVALID_ARGUMENT };
    let reduces = matches!(kind, Kind::AllReduce | Kind::ReduceScatter);
    // The mock reduces floating-point types only.
    if reduces && (!(0..=4).contains(&op) || !matches!(datatype, 6..=9)) {
        return MCCL_INVALID_ARGUMENT;
    }
    let mut guard = state();
    let Some(s) = guard.as_mut() else { return MCCL_INVALID_ARGUMENT };
    let comm = comm as usize;
    if !s.comm_live(comm) {
        return MCCL_INVALID_ARGUMENT;
    }
    let Some((key, rank)) = s.comms.get(&comm).map(|c| (c.clique, c.rank)) else { return MCCL_INVALID_ARGUMENT };
    let world = s.cliques.get(&key).map_or(0, |c| c.members.len());
    let Ok(root) = usize::try_from(root) else { return MCCL_INVALID_ARGUMENT };
    if kind == Kind::Broadcast && root >= world {
        return MCCL_INVALID_ARGUMENT;
    }
    if count == 0 {
        return MCCL_SUCCESS;
    }
    let stream = s.resolve(stream as usize);
    let mut part = Part {
        kind,
        comm,
        rank,
        send: send as usize,
        recv: recv as usize,
        count,
        datatype,
        op,
        root,
        stream,
        seq: 0,
    };
    let (send_len, recv_len) = part.lengths(world, size);
    if (send_len > 0 && !s.in_device_range(part.send, send_len)) || !s.in_device_range(part.recv, recv_len) {
        return MCCL_INVALID_ARGUMENT;
    }
    let Some(round) = s.comms.get_mut(&comm).map(|c| {
        c.next_round += 1;
        c.next_round - 1
    }) else {
        return MCCL_INVALID_ARGUMENT;
    };
    part.seq = match s.enqueue(stream, Op::Coll { comm, round }) {
        Ok(seq) => seq,
        Err(_) => return MCCL_INVALID_ARGUMENT,
    };
    if let Some(clique) = s.cliques.get_mut(&key) {
        let parts = clique.rounds.entry(round).or_insert_with(|| vec![None; world]);
        parts[rank] = Some(part);
    }
    log_order(LOG_COLLECTIVE, stream, comm);
    PROGRESS.notify_all();
    MCCL_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcclGetVersion(version: *mut c_int) -> c_int {
    inject!("mcclGetVersion");
    if version.is_null() {
        return MCCL_INVALID_ARGUMENT;
    }
    // SAFETY: checked non-null.
    unsafe { *version = 21_803 };
    MCCL_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcclGetUniqueId(id: *mut McclUniqueId) -> c_int {
    inject!("mcclGetUniqueId");
    if id.is_null() {
        return MCCL_INVALID_ARGUMENT;
    }
    let mut internal = [0 as c_char; 128];
    for (i, b) in MCCL_ID_MAGIC.iter().enumerate() {
        internal[i] = *b as c_char;
    }
    let nonce = new_handle().to_le_bytes();
    for (i, b) in nonce.iter().enumerate() {
        internal[8 + i] = *b as c_char;
    }
    // SAFETY: checked non-null.
    unsafe { *id = McclUniqueId { internal } };
    MCCL_SUCCESS
}

/// Joins the clique of `id` as `rank` of `nranks` and waits until every rank has joined.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcclCommInitRank(
    comm: *mut *mut c_void,
    nranks: c_int,
    id: McclUniqueId,
    rank: c_int,
) -> c_int {
    inject!("mcclCommInitRank");
    if comm.is_null() || nranks < 1 || rank < 0 || rank >= nranks {
        return MCCL_INVALID_ARGUMENT;
    }
    if id.internal[..8].iter().zip(MCCL_ID_MAGIC).any(|(a, b)| *a as u8 != *b) {
        return MCCL_INVALID_ARGUMENT;
    }
    let key: [u8; 128] = id.internal.map(|c| c as u8);
    let (world, rank) = (nranks as usize, rank as usize);
    let handle = new_handle();
    let mut guard = state();
    let Some(s) = guard.as_mut() else { return MCCL_INVALID_ARGUMENT };
    let clique = s.cliques.entry(key).or_insert_with(|| Clique { members: vec![None; world], rounds: HashMap::new() });
    if clique.members.len() != world || clique.members[rank].is_some() {
        // Another world size for this id, or the rank is taken.
        return MCCL_INVALID_USAGE;
    }
    clique.members[rank] = Some(handle);
    s.comms.insert(handle, CommInfo { clique: key, rank, next_round: 0, aborted: false, destroyed: false });
    PROGRESS.notify_all();
    let (mut guard, joined) = block_until(guard, |s| {
        s.cliques.get(&key).is_some_and(|c| c.members.iter().all(Option::is_some))
    });
    if !joined {
        if let Some(s) = guard.as_mut() {
            s.comms.remove(&handle);
            if let Some(c) = s.cliques.get_mut(&key) {
                c.members[rank] = None;
            }
        }
        return MCCL_REMOTE_ERROR;
    }
    // SAFETY: checked non-null.
    unsafe { *comm = handle as *mut c_void };
    MCCL_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcclCommDestroy(comm: *mut c_void) -> c_int {
    inject!("mcclCommDestroy");
    let mut guard = state();
    let Some(s) = guard.as_mut() else { return MCCL_INVALID_ARGUMENT };
    match s.comms.get_mut(&(comm as usize)) {
        Some(c) if !c.destroyed && !c.aborted => {
            c.destroyed = true;
            PROGRESS.notify_all();
            MCCL_SUCCESS
        }
        _ => MCCL_INVALID_ARGUMENT,
    }
}

/// Aborts a communicator: its queued collectives complete without data; its peers' collectives
/// with it never complete.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcclCommAbort(comm: *mut c_void) -> c_int {
    inject!("mcclCommAbort");
    let mut guard = state();
    let Some(s) = guard.as_mut() else { return MCCL_INVALID_ARGUMENT };
    match s.comms.get_mut(&(comm as usize)) {
        Some(c) if !c.destroyed && !c.aborted => {
            c.aborted = true;
            PROGRESS.notify_all();
            MCCL_SUCCESS
        }
        _ => MCCL_INVALID_ARGUMENT,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcclCommCount(comm: *mut c_void, count: *mut c_int) -> c_int {
    inject!("mcclCommCount");
    let guard = state();
    let Some(s) = guard.as_ref() else { return MCCL_INVALID_ARGUMENT };
    if count.is_null() || !s.comm_live(comm as usize) {
        return MCCL_INVALID_ARGUMENT;
    }
    let world = s.comms.get(&(comm as usize)).and_then(|c| s.cliques.get(&c.clique)).map_or(0, |c| c.members.len());
    // SAFETY: checked non-null.
    unsafe { *count = world as c_int };
    MCCL_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcclCommUserRank(comm: *mut c_void, rank: *mut c_int) -> c_int {
    inject!("mcclCommUserRank");
    let guard = state();
    let Some(s) = guard.as_ref() else { return MCCL_INVALID_ARGUMENT };
    if rank.is_null() || !s.comm_live(comm as usize) {
        return MCCL_INVALID_ARGUMENT;
    }
    let r = s.comms.get(&(comm as usize)).map_or(0, |c| c.rank);
    // SAFETY: checked non-null.
    unsafe { *rank = r as c_int };
    MCCL_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcclAllReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    datatype: c_int,
    op: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    inject!("mcclAllReduce");
    mccl_queue(Kind::AllReduce, send, recv, count, datatype, op, 0, comm, stream)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcclAllGather(
    send: *const c_void,
    recv: *mut c_void,
    send_count: usize,
    datatype: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    inject!("mcclAllGather");
    mccl_queue(Kind::AllGather, send, recv, send_count, datatype, 0, 0, comm, stream)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcclReduceScatter(
    send: *const c_void,
    recv: *mut c_void,
    recv_count: usize,
    datatype: c_int,
    op: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    inject!("mcclReduceScatter");
    mccl_queue(Kind::ReduceScatter, send, recv, recv_count, datatype, op, 0, comm, stream)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcclBroadcast(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    datatype: c_int,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    inject!("mcclBroadcast");
    mccl_queue(Kind::Broadcast, send, recv, count, datatype, 0, root, comm, stream)
}

#[unsafe(no_mangle)]
pub extern "C" fn mcclGroupStart() -> c_int {
    if let Some(code) = injected("mcclGroupStart") {
        return code;
    }
    MCCL_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn mcclGroupEnd() -> c_int {
    if let Some(code) = injected("mcclGroupEnd") {
        return code;
    }
    MCCL_SUCCESS
}

// ---- control for the collective tests (mock only) ---------------------------------------------------

/// Overrides the device count (`0`: back to `MCMOCK_DEVICE_COUNT` or 1).
#[unsafe(no_mangle)]
pub extern "C" fn mcmockSetDeviceCount(count: c_int) {
    DEVICE_COUNT.store(usize::try_from(count).unwrap_or(0), Ordering::Relaxed);
}

/// Whether `mcEventQuery` runs the work its event waits for when it can (default off).
#[unsafe(no_mangle)]
pub extern "C" fn mcmockSetQueryProgress(on: c_int) {
    QUERY_PROGRESS.store(on != 0, Ordering::Relaxed);
}

/// Entries in the order log.
#[unsafe(no_mangle)]
pub extern "C" fn mcmockOrderLogLen() -> u64 {
    ORDER_LOG.lock().unwrap_or_else(|e| e.into_inner()).len() as u64
}

/// Entry `index` of the order log: `kind` 1 = `stream` waits on an event recorded on `other`
/// (a stream), 2 = event `other` recorded on `stream`, 3 = a collective of communicator
/// `other` queued on `stream`. Returns 0 (and writes nothing) if there is no such entry.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mcmockOrderLogEntry(
    index: u64,
    kind: *mut c_int,
    stream: *mut usize,
    other: *mut usize,
) -> c_int {
    let log = ORDER_LOG.lock().unwrap_or_else(|e| e.into_inner());
    match log.get(index as usize) {
        Some(&(k, s, o)) if !kind.is_null() && !stream.is_null() && !other.is_null() => {
            // SAFETY: checked non-null; the caller passes writable values.
            unsafe {
                *kind = k;
                *stream = s;
                *other = o;
            }
            1
        }
        _ => 0,
    }
}

/// Empties the order log.
#[unsafe(no_mangle)]
pub extern "C" fn mcmockOrderLogClear() {
    ORDER_LOG.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

#[unsafe(no_mangle)]
pub extern "C" fn mcclGetErrorString(code: c_int) -> *const c_char {
    let text: &'static CStr = match code {
        0 => c"no error",
        1 => c"unhandled MACA runtime error",
        2 => c"unhandled system error",
        3 => c"internal error",
        4 => c"invalid argument",
        5 => c"invalid usage",
        6 => c"remote process exited or there was a network error",
        7 => c"MCCL operation in progress",
        _ => c"unknown result code",
    };
    text.as_ptr()
}
