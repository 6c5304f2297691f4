// The MetaX emulator's device header: what the MACA dialect's generated kernels use, for a host
// C++ compiler (g++ or clang++), with GPU semantics at a configurable wave size (64 on MetaX).
//
// The emulator compiles each kernel source that `MacaDialect` generates, unchanged, into a shared
// object with `-include`-free `#include <mcr/mc_runtime.h>` resolved to this file (the dialect
// includes it through `__has_include`). It appends one line, `METAX_EMU_ENTRY(<kernel>)`, that
// defines the shared object's entry points (see the end of this file). Everything here was written
// for this project; nothing is taken from the MACA SDK, which is not public.
//
// Execution model (the full contract: the module docs of burn-metax-backend/src/emu/mod.rs and
// its `module.rs`, `stream.rs`; what it proves: docs/conformance.md):
// - a launch runs a range of blocks, one after another, on the calling OS thread (a stream worker
//   of the emulated device);
// - kernels that use no barrier or wave operation run lane after lane as plain calls;
// - kernels that do run every lane of a block as a fiber (own stack, switched without system
//   calls); `__syncthreads` waits for the block's live lanes, wave operations for the wave's live
//   lanes; lanes that returned no longer take part (as on hardware, where exited lanes do not
//   block a barrier);
// - lanes reaching different `__syncthreads` lines, or a wave whose lanes wait at different wave
//   operations, or a block where every live lane waits and no wait can end, are *faults*: the
//   launch stops and reports the lines involved, instead of hanging;
// - shared memory is per block (the launch's arena, reused by the next block), lanes' local
//   variables live on their own stacks.
#ifndef METAX_EMU_MC_RUNTIME_H
#define METAX_EMU_MC_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

// ---------------------------------------------------------------------------------------------
// Qualifiers

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Shared memory: the dialect declares one block-scope array,
// `extern __shared__ __align__(N) uint8 dynamic_shared_mem[];`, and carves every shared buffer out
// of it. `__shared__` is dropped and `dynamic_shared_mem` names the current block's arena; the
// declaration then declares a function returning a pointer to that array (a valid, harmless
// declaration), and every use reads the arena.
#define __shared__
#define dynamic_shared_mem (*metax_emu_dynamic_shared())

#define METAX_EMU_ABI 1u
#define METAX_EMU_MAX_LANES 1024u

extern "C" int printf(const char* format, ...);
extern "C" int snprintf(char* out, size_t size, const char* format, ...);

// ---------------------------------------------------------------------------------------------
// Vector types (CUDA layout: x, y, z, w; 2- and 4-wide types aligned to their size)

#define METAX_EMU_VEC(T, N)                                                                        \
    struct __attribute__((aligned(sizeof(T) * 2))) N##2 { T x, y; };                               \
    struct N##3 { T x, y, z; };                                                                    \
    struct __attribute__((aligned(sizeof(T) * 4 > 16 ? 16 : sizeof(T) * 4))) N##4 { T x, y, z, w; }; \
    struct N##1 { T x; };                                                                          \
    static inline N##1 make_##N##1(T x) { return N##1{x}; }                                        \
    static inline N##2 make_##N##2(T x, T y) { return N##2{x, y}; }                                \
    static inline N##3 make_##N##3(T x, T y, T z) { return N##3{x, y, z}; }                        \
    static inline N##4 make_##N##4(T x, T y, T z, T w) { return N##4{x, y, z, w}; }

METAX_EMU_VEC(signed char, char)
METAX_EMU_VEC(unsigned char, uchar)
METAX_EMU_VEC(short, short)
METAX_EMU_VEC(unsigned short, ushort)
METAX_EMU_VEC(int, int)
METAX_EMU_VEC(unsigned int, uint)
METAX_EMU_VEC(long, long)
METAX_EMU_VEC(unsigned long, ulong)
METAX_EMU_VEC(long long, longlong)
METAX_EMU_VEC(unsigned long long, ulonglong)
METAX_EMU_VEC(float, float)
METAX_EMU_VEC(double, double)
#undef METAX_EMU_VEC

typedef uint3 dim3;

// ---------------------------------------------------------------------------------------------
// The emulator's state: the launch descriptor (shared with Rust, `src/emu/module.rs`), lanes,
// waves and blocks.

namespace metax_emu {

// C layout shared with `LaunchDesc` in `src/emu/module.rs`. Keep both in step (and bump
// `METAX_EMU_ABI`).
struct LaunchDesc {
    uint32_t abi;
    uint32_t grid[3];
    uint32_t block[3];
    uint32_t warp_size;
    uint64_t block_begin;
    uint64_t block_end;
    uint8_t* shared_mem;
    uint64_t shared_bytes;
    void** params;
    uint8_t* stacks;
    uint64_t stack_stride;
    uint64_t stack_slots;
    char* error;
    uint64_t error_cap;
};

enum : uint32_t { LANE_READY = 0, LANE_BLOCK_WAIT = 1, LANE_WAVE_WAIT = 2, LANE_DONE = 3 };

struct Lane {
    void* sp;
    uint3 tid;
    uint32_t linear;
    uint32_t state;
    uint32_t wait_gen;
    uint32_t ops;
    int site;
};

struct Wave {
    uint32_t live;
    uint32_t arrived;
    uint32_t gen;
    int site;
    // The lanes (bit i = lane i of the wave) that took part in the wave operations of even and
    // odd generations: fixed when the operation completes, because a lane may run on and finish
    // the kernel before the others have read the operation's result.
    uint64_t members[2];
};

typedef void (*KernelFn)(void** params);

struct Block {
    uint3 bid, bdim, gdim;
    uint32_t warp_size;
    uint32_t n;
    Lane* lanes;
    Wave* waves;
    uint64_t* slots;
    uint32_t live;
    uint32_t arrived;
    uint32_t gen;
    int site;
    bool cooperative;
    bool faulted;
    Lane* cur;
    void* sched_sp;
    uint8_t* smem;
    KernelFn kernel;
    void** params;
    char* error;
    uint64_t error_cap;
};

// The current block and lane of this OS thread. External linkage on purpose: with `static`, the
// compiler may prove that the opaque `metax_emu_switch` cannot change them and keep `t_lane` in a
// register across a fiber switch — a resumed lane would then act as the lane it switched to
// (wrong `__lane_id()` after a wave operation; found by `plane_elect` electing lane 48).
__attribute__((visibility("hidden"))) inline thread_local Block* t_block = nullptr;
__attribute__((visibility("hidden"))) inline thread_local Lane* t_lane = nullptr;

}  // namespace metax_emu

static inline uint8_t (*metax_emu_dynamic_shared())[] {
    return reinterpret_cast<uint8_t (*)[]>(::metax_emu::t_block->smem);
}

#define threadIdx (::metax_emu::t_lane->tid)
#define blockIdx (::metax_emu::t_block->bid)
#define blockDim (::metax_emu::t_block->bdim)
#define gridDim (::metax_emu::t_block->gdim)
#define warpSize (::metax_emu::t_block->warp_size)

// ---------------------------------------------------------------------------------------------
// Fibers: a context switch that saves the callee-saved registers on the current stack and
// switches stack pointers (no signal-mask system call, unlike swapcontext).

extern "C" void metax_emu_switch(void** save_sp, void* load_sp) __attribute__((visibility("hidden")));
extern "C" void metax_emu_lane_main(metax_emu::Lane* lane) __attribute__((visibility("hidden"), used, noreturn));

#if defined(__x86_64__)
__asm__(
    ".text\n"
    ".p2align 4\n"
    ".globl metax_emu_switch\n"
    ".hidden metax_emu_switch\n"
    ".type metax_emu_switch,@function\n"
    "metax_emu_switch:\n"
    "    pushq %rbp\n"
    "    pushq %rbx\n"
    "    pushq %r12\n"
    "    pushq %r13\n"
    "    pushq %r14\n"
    "    pushq %r15\n"
    "    movq %rsp, (%rdi)\n"
    "    movq %rsi, %rsp\n"
    "    popq %r15\n"
    "    popq %r14\n"
    "    popq %r13\n"
    "    popq %r12\n"
    "    popq %rbx\n"
    "    popq %rbp\n"
    "    ret\n"
    ".size metax_emu_switch, .-metax_emu_switch\n"
    ".p2align 4\n"
    ".globl metax_emu_fiber_start\n"
    ".hidden metax_emu_fiber_start\n"
    ".type metax_emu_fiber_start,@function\n"
    "metax_emu_fiber_start:\n"
    "    movq %r12, %rdi\n"
    "    call metax_emu_lane_main\n"
    "    ud2\n"
    ".size metax_emu_fiber_start, .-metax_emu_fiber_start\n");
extern "C" void metax_emu_fiber_start() __attribute__((visibility("hidden")));

namespace metax_emu {
// A new fiber's stack, laid out as `metax_emu_switch` pops it: r15 r14 r13 r12(=lane) rbx rbp, then
// the return address `metax_emu_fiber_start`, which calls `metax_emu_lane_main(lane)` with a
// 16-byte aligned stack.
static inline void* fiber_init(uint8_t* top, Lane* lane) {
    uintptr_t t = reinterpret_cast<uintptr_t>(top) & ~uintptr_t(15);
    void** sp = reinterpret_cast<void**>(t) - 7;
    for (int i = 0; i < 7; ++i) sp[i] = nullptr;
    sp[3] = lane;
    sp[6] = reinterpret_cast<void*>(&metax_emu_fiber_start);
    return sp;
}
}  // namespace metax_emu
#elif defined(__aarch64__)
__asm__(
    ".text\n"
    ".p2align 4\n"
    ".globl metax_emu_switch\n"
    ".hidden metax_emu_switch\n"
    ".type metax_emu_switch,%function\n"
    "metax_emu_switch:\n"
    "    sub sp, sp, #176\n"
    "    stp x19, x20, [sp, #0]\n"
    "    stp x21, x22, [sp, #16]\n"
    "    stp x23, x24, [sp, #32]\n"
    "    stp x25, x26, [sp, #48]\n"
    "    stp x27, x28, [sp, #64]\n"
    "    stp x29, x30, [sp, #80]\n"
    "    stp d8, d9, [sp, #96]\n"
    "    stp d10, d11, [sp, #112]\n"
    "    stp d12, d13, [sp, #128]\n"
    "    stp d14, d15, [sp, #144]\n"
    "    mov x9, sp\n"
    "    str x9, [x0]\n"
    "    mov sp, x1\n"
    "    ldp x19, x20, [sp, #0]\n"
    "    ldp x21, x22, [sp, #16]\n"
    "    ldp x23, x24, [sp, #32]\n"
    "    ldp x25, x26, [sp, #48]\n"
    "    ldp x27, x28, [sp, #64]\n"
    "    ldp x29, x30, [sp, #80]\n"
    "    ldp d8, d9, [sp, #96]\n"
    "    ldp d10, d11, [sp, #112]\n"
    "    ldp d12, d13, [sp, #128]\n"
    "    ldp d14, d15, [sp, #144]\n"
    "    add sp, sp, #176\n"
    "    ret\n"
    ".size metax_emu_switch, .-metax_emu_switch\n"
    ".p2align 4\n"
    ".globl metax_emu_fiber_start\n"
    ".hidden metax_emu_fiber_start\n"
    ".type metax_emu_fiber_start,%function\n"
    "metax_emu_fiber_start:\n"
    "    mov x0, x19\n"
    "    bl metax_emu_lane_main\n"
    "    brk #0\n"
    ".size metax_emu_fiber_start, .-metax_emu_fiber_start\n");
extern "C" void metax_emu_fiber_start() __attribute__((visibility("hidden")));

namespace metax_emu {
// Laid out as `metax_emu_switch` restores it: x19 (= lane) … x28, x29 = 0, x30 (the return
// address) = `metax_emu_fiber_start`, d8–d15 = 0.
static inline void* fiber_init(uint8_t* top, Lane* lane) {
    uintptr_t t = reinterpret_cast<uintptr_t>(top) & ~uintptr_t(15);
    void** sp = reinterpret_cast<void**>(t - 176);
    for (int i = 0; i < 22; ++i) sp[i] = nullptr;
    sp[0] = lane;
    sp[11] = reinterpret_cast<void*>(&metax_emu_fiber_start);
    return sp;
}
}  // namespace metax_emu
#else
#error "the MetaX emulator's fibers support x86_64 and aarch64 hosts"
#endif

// ---------------------------------------------------------------------------------------------
// The scheduler

namespace metax_emu {

static inline void fault(const char* what, int line_a, int line_b) {
    Block* b = t_block;
    if (b->faulted) return;
    b->faulted = true;
    if (b->error && b->error_cap) {
        snprintf(b->error, b->error_cap, "%s (block (%u, %u, %u), lane (%u, %u, %u); lines %d and %d of the kernel source)",
                 what, b->bid.x, b->bid.y, b->bid.z, t_lane ? t_lane->tid.x : 0u, t_lane ? t_lane->tid.y : 0u,
                 t_lane ? t_lane->tid.z : 0u, line_a, line_b);
    }
}

static inline Wave& wave_of(Block* b, Lane* l) { return b->waves[l->linear / b->warp_size]; }

static inline bool runnable(Block* b, Lane* l) {
    switch (l->state) {
        case LANE_READY:
            return true;
        case LANE_BLOCK_WAIT:
            return l->wait_gen != b->gen;
        case LANE_WAVE_WAIT:
            return l->wait_gen != wave_of(b, l).gen;
        default:
            return false;
    }
}

// Switches from the current lane to the next runnable one (round robin), or back to the block's
// scheduler when no lane is left or the block faulted. With `finished`, the current lane's context
// is not resumed again.
static inline void switch_away(bool finished) {
    Block* b = t_block;
    Lane* me = t_lane;
    Lane* next = nullptr;
    if (!b->faulted && b->live > 0) {
        for (uint32_t k = 1; k <= b->n; ++k) {
            Lane* cand = &b->lanes[(me->linear + k) % b->n];
            if (runnable(b, cand)) {
                next = cand;
                break;
            }
        }
        if (next == nullptr) {
            // Every live lane waits and none can go on: divergent barriers.
            int other = 0;
            for (uint32_t k = 0; k < b->n; ++k) {
                Lane* l = &b->lanes[k];
                if (l->state != LANE_DONE && l->site != me->site) {
                    other = l->site;
                    break;
                }
            }
            fault("deadlock: every live lane of the block waits, at barriers or wave operations that cannot complete "
                  "(barrier inside divergent control flow)",
                  me->site, other);
        }
    }
    if (next == me) return;
    void* discard;
    void** save = finished ? &discard : &me->sp;
    if (next == nullptr) {
        t_lane = nullptr;
        metax_emu_switch(save, b->sched_sp);
    } else {
        t_lane = next;
        metax_emu_switch(save, next->sp);
    }
    // Resumed: `t_lane` was set to this lane by whoever switched here. Nothing read from memory
    // before the switch may be reused after it.
    __asm__ __volatile__("" ::: "memory");
}

// Completes the wave's current operation: records which lanes took part, then releases them.
static inline void complete_wave_op(Block* b, Wave& w) {
    const uint32_t base = uint32_t(&w - b->waves) * b->warp_size;
    uint64_t mask = 0;
    for (uint32_t i = 0; i < b->warp_size && base + i < b->n; ++i) {
        if (b->lanes[base + i].state != LANE_DONE) mask |= uint64_t(1) << i;
    }
    w.members[w.gen & 1u] = mask;
    w.arrived = 0;
    ++w.gen;
}

static inline void release_finished_waits(Block* b, Wave& w) {
    if (b->arrived > 0 && b->arrived == b->live) {
        b->arrived = 0;
        ++b->gen;
    }
    if (w.arrived > 0 && w.arrived == w.live) complete_wave_op(b, w);
}

// Block-wide barrier (`__syncthreads`).
static inline void block_barrier(int site) {
    Block* b = t_block;
    Lane* l = t_lane;
    if (!b->cooperative) {
        fault("__syncthreads in a kernel the emulator compiled without fibers", site, site);
        return;
    }
    if (b->faulted) return;
    if (b->arrived == 0) {
        b->site = site;
    } else if (b->site != site) {
        fault("divergent __syncthreads: lanes of one block wait at different barriers", b->site, site);
        switch_away(false);
        return;
    }
    l->site = site;
    if (++b->arrived == b->live) {
        b->arrived = 0;
        ++b->gen;
        return;
    }
    l->state = LANE_BLOCK_WAIT;
    l->wait_gen = b->gen;
    do {
        switch_away(false);
    } while (!b->faulted && l->wait_gen == b->gen);
    l->state = LANE_READY;
}

// Wave-wide barrier: every live lane of the caller's wave reaches the same wave operation.
static inline void wave_barrier(int site) {
    Block* b = t_block;
    Lane* l = t_lane;
    if (!b->cooperative) {
        fault("a wave operation in a kernel the emulator compiled without fibers", site, site);
        return;
    }
    if (b->faulted) return;
    Wave& w = wave_of(b, l);
    if (w.arrived == 0) {
        w.site = site;
    } else if (w.site != site) {
        fault("divergent wave operation: lanes of one wave wait at different wave operations", w.site, site);
        switch_away(false);
        return;
    }
    l->site = site;
    if (++w.arrived == w.live) {
        complete_wave_op(b, w);
        return;
    }
    l->state = LANE_WAVE_WAIT;
    l->wait_gen = w.gen;
    do {
        switch_away(false);
    } while (!b->faulted && l->wait_gen == w.gen);
    l->state = LANE_READY;
}

}  // namespace metax_emu

extern "C" void metax_emu_lane_main(metax_emu::Lane* lane) {
    using namespace metax_emu;
    Block* b = t_block;
    b->kernel(b->params);
    lane->state = LANE_DONE;
    --b->live;
    Wave& w = wave_of(b, lane);
    --w.live;
    release_finished_waits(b, w);
    switch_away(true);
    __builtin_trap();
}

namespace metax_emu {

// Runs blocks `d->block_begin .. d->block_end` (linear, x fastest) of a launch. Returns 0, or 1 with
// a message in `d->error`.
static inline int launch(LaunchDesc* d, KernelFn kernel, bool cooperative) {
    if (d->abi != METAX_EMU_ABI) {
        if (d->error && d->error_cap) snprintf(d->error, d->error_cap, "emulator ABI mismatch: launcher %u, kernel %u", d->abi, METAX_EMU_ABI);
        return 1;
    }
    const uint64_t n64 = uint64_t(d->block[0]) * d->block[1] * d->block[2];
    if (n64 == 0) return 0;
    if (n64 > METAX_EMU_MAX_LANES || d->warp_size == 0 || d->warp_size > 64 || (d->warp_size & (d->warp_size - 1)) != 0) {
        if (d->error && d->error_cap)
            snprintf(d->error, d->error_cap, "invalid launch: %llu lanes per block (at most %u), wave size %u",
                     (unsigned long long)n64, METAX_EMU_MAX_LANES, d->warp_size);
        return 1;
    }
    const uint32_t n = uint32_t(n64);
    if (cooperative && (d->stacks == nullptr || d->stack_slots < n)) {
        if (d->error && d->error_cap)
            snprintf(d->error, d->error_cap, "the launcher provided %llu lane stacks for %u lanes",
                     (unsigned long long)d->stack_slots, n);
        return 1;
    }
    // On the calling thread's stack (about 72 KiB; stream workers have 8 MiB): the fibers only run
    // while this call is active.
    Lane lanes[METAX_EMU_MAX_LANES];
    Wave waves[METAX_EMU_MAX_LANES];
    uint64_t slots[2 * METAX_EMU_MAX_LANES];
    Block block;
    Block* b = &block;
    b->bdim = uint3{d->block[0], d->block[1], d->block[2]};
    b->gdim = uint3{d->grid[0], d->grid[1], d->grid[2]};
    b->warp_size = d->warp_size;
    b->n = n;
    b->lanes = lanes;
    b->waves = waves;
    b->slots = slots;
    b->cooperative = cooperative;
    b->faulted = false;
    b->smem = d->shared_mem;
    b->kernel = kernel;
    b->params = d->params;
    b->error = d->error;
    b->error_cap = d->error_cap;
    Block* saved_block = t_block;
    Lane* saved_lane = t_lane;
    t_block = b;
    const uint64_t gx = d->grid[0], gy = d->grid[1];
    const uint32_t nwaves = (n + b->warp_size - 1) / b->warp_size;
    for (uint64_t lin = d->block_begin; lin < d->block_end && !b->faulted; ++lin) {
        b->bid = uint3{uint32_t(lin % gx), uint32_t((lin / gx) % gy), uint32_t(lin / (gx * gy))};
        uint32_t i = 0;
        for (uint32_t z = 0; z < b->bdim.z; ++z)
            for (uint32_t y = 0; y < b->bdim.y; ++y)
                for (uint32_t x = 0; x < b->bdim.x; ++x, ++i) {
                    Lane& l = lanes[i];
                    l.tid = uint3{x, y, z};
                    l.linear = i;
                    l.state = LANE_READY;
                    l.wait_gen = 0;
                    l.ops = 0;
                    l.site = 0;
                }
        if (!cooperative) {
            for (uint32_t k = 0; k < n && !b->faulted; ++k) {
                t_lane = &lanes[k];
                kernel(d->params);
            }
            continue;
        }
        b->live = n;
        b->arrived = 0;
        b->gen = 0;
        b->site = 0;
        for (uint32_t w = 0; w < nwaves; ++w) {
            const uint32_t first = w * b->warp_size;
            waves[w] = Wave{(n - first) < b->warp_size ? (n - first) : b->warp_size, 0, 0, 0};
        }
        for (uint32_t k = 0; k < n; ++k) {
            lanes[k].sp = fiber_init(d->stacks + (uint64_t(k) + 1) * d->stack_stride, &lanes[k]);
        }
        t_lane = &lanes[0];
        metax_emu_switch(&b->sched_sp, lanes[0].sp);
        // Back when every lane returned, or on a fault.
    }
    const bool faulted = b->faulted;
    t_block = saved_block;
    t_lane = saved_lane;
    return faulted ? 1 : 0;
}

// ---- parameters: the kernel's parameter types, deduced from its signature --------------------

template <class T> struct remove_ref { typedef T type; };
template <class T> struct remove_ref<T&> { typedef T type; };
template <unsigned... I> struct seq {};
template <unsigned N, unsigned... I> struct make_seq : make_seq<N - 1, N - 1, I...> {};
template <unsigned... I> struct make_seq<0, I...> { typedef seq<I...> type; };

template <class... A, unsigned... I>
static inline void invoke_seq(void (*f)(A...), void** p, seq<I...>) {
    f(*static_cast<typename remove_ref<A>::type*>(p[I])...);
}
template <class... A>
static inline void invoke(void (*f)(A...), void** p) {
    invoke_seq(f, p, typename make_seq<sizeof...(A)>::type{});
}
template <class... A>
static inline uint32_t param_sizes(void (*)(A...), uint32_t* out, uint32_t cap) {
    const uint32_t sizes[] = {uint32_t(sizeof(typename remove_ref<A>::type))..., 0u};
    for (uint32_t i = 0; i < sizeof...(A) && i < cap; ++i) out[i] = sizes[i];
    return sizeof...(A);
}

}  // namespace metax_emu

#ifndef METAX_EMU_COOPERATIVE
#define METAX_EMU_COOPERATIVE 1
#endif

// The entry points of a compiled kernel: `metax_emu_launch(desc)` runs blocks of a launch;
// `metax_emu_param_sizes(out, cap)` gives the size of each kernel parameter (the launcher copies
// them when the launch is queued); `metax_emu_kernel_name` names the kernel, `metax_emu_abi` is
// `METAX_EMU_ABI`, `metax_emu_cooperative` says whether lanes run as fibers (the compiler sets
// `METAX_EMU_COOPERATIVE` to 0 for sources without barriers and wave operations).
#define METAX_EMU_ENTRY(kernel)                                                                        \
    extern "C" __attribute__((visibility("default"))) int metax_emu_launch(::metax_emu::LaunchDesc* d) { \
        return ::metax_emu::launch(d, [](void** p) { ::metax_emu::invoke(kernel, p); }, METAX_EMU_COOPERATIVE != 0); \
    }                                                                                                  \
    extern "C" __attribute__((visibility("default"))) uint32_t metax_emu_param_sizes(uint32_t* out, uint32_t cap) { \
        return ::metax_emu::param_sizes(kernel, out, cap);                                             \
    }                                                                                                  \
    extern "C" __attribute__((visibility("default"))) const char metax_emu_kernel_name[] = #kernel;     \
    extern "C" __attribute__((visibility("default"))) const uint32_t metax_emu_abi = METAX_EMU_ABI;        \
    extern "C" __attribute__((visibility("default"))) const uint32_t metax_emu_cooperative = METAX_EMU_COOPERATIVE;

// ---------------------------------------------------------------------------------------------
// Synchronisation and wave operations (64-bit member masks; the mask is not checked: the dialect
// always passes the full wave and the emulator takes every live lane of the wave).

static inline void metax_emu_syncthreads(int site = __builtin_LINE()) { ::metax_emu::block_barrier(site); }
#define __syncthreads() metax_emu_syncthreads(__LINE__)
static inline void __syncwarp(uint64_t = ~0ull, int site = __builtin_LINE()) { ::metax_emu::wave_barrier(site); }
static inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline unsigned int __lane_id() { return ::metax_emu::t_lane->linear % ::metax_emu::t_block->warp_size; }

namespace metax_emu {

template <class T> static inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8, "wave operations move at most 64 bits per lane");
    uint64_t bits = 0;
    __builtin_memcpy(&bits, &v, sizeof(T));
    return bits;
}
template <class T> static inline T from_bits(uint64_t bits) {
    T v;
    __builtin_memcpy(&v, &bits, sizeof(T));
    return v;
}

// Publishes this lane's value, waits for the wave, and returns the slot array of that round (two
// alternating slot arrays, so one barrier per operation suffices: a lane can only overwrite a
// round's slots after every lane of the wave has arrived at the next operation).
static inline uint64_t* exchange(uint64_t value, int site) {
    Block* b = t_block;
    Lane* l = t_lane;
    uint64_t* round = b->slots + (l->ops++ & 1u) * METAX_EMU_MAX_LANES;
    round[l->linear] = value;
    wave_barrier(site);
    return round;
}

// The value of wave lane `src` (an index within the caller's wave), or the caller's own value when
// `src` is not a lane of the wave.
template <class T> static inline T shuffle_from(T v, int64_t src, int site) {
    Block* b = t_block;
    Lane* l = t_lane;
    uint64_t* round = exchange(to_bits(v), site);
    const uint32_t base = l->linear - l->linear % b->warp_size;
    if (src < 0 || src >= int64_t(b->warp_size) || base + uint64_t(src) >= b->n) return v;
    return from_bits<T>(round[base + uint32_t(src)]);
}

// The lanes that took part in the caller's latest wave operation (bit i = lane i of the wave).
static inline uint64_t last_op_members() {
    Lane* l = t_lane;
    return wave_of(t_block, l).members[(l->ops - 1u) & 1u];
}

// The bits of `pred` of the lanes taking part (lane i of the wave → bit i).
static inline uint64_t ballot(int pred, int site) {
    Block* b = t_block;
    Lane* l = t_lane;
    uint64_t* round = exchange(pred != 0, site);
    const uint32_t base = l->linear - l->linear % b->warp_size;
    const uint64_t members = last_op_members();
    uint64_t mask = 0;
    for (uint32_t i = 0; i < b->warp_size && base + i < b->n; ++i) {
        if ((members >> i & 1u) && round[base + i]) mask |= uint64_t(1) << i;
    }
    return mask;
}

// The wave's lanes that have not exited (outside a wave operation).
static inline uint64_t live_mask() {
    Block* b = t_block;
    Lane* l = t_lane;
    const uint32_t base = l->linear - l->linear % b->warp_size;
    uint64_t mask = 0;
    for (uint32_t i = 0; i < b->warp_size && base + i < b->n; ++i) {
        if (b->lanes[base + i].state != LANE_DONE) mask |= uint64_t(1) << i;
    }
    return mask;
}

}  // namespace metax_emu

// Lane `src` of the caller's `width`-lane segment.
template <class T>
static inline T __shfl_sync(uint64_t, T v, int src, int width = 64, int site = __builtin_LINE()) {
    const int lane = int(__lane_id());
    const int segment = lane - lane % width;
    return ::metax_emu::shuffle_from(v, int64_t(segment) + ((src % width) + width) % width, site);
}
// Lane `lane ^ mask`, if it lies in the caller's `width`-lane segment.
template <class T>
static inline T __shfl_xor_sync(uint64_t, T v, int lane_mask, int width = 64, int site = __builtin_LINE()) {
    const int lane = int(__lane_id());
    const int target = lane ^ lane_mask;
    const int segment = lane - lane % width;
    return ::metax_emu::shuffle_from(v, target >= segment + width ? int64_t(-1) : int64_t(target), site);
}
// Lane `lane - delta`, if it lies in the caller's segment.
template <class T>
static inline T __shfl_up_sync(uint64_t, T v, unsigned int delta, int width = 64, int site = __builtin_LINE()) {
    const int lane = int(__lane_id());
    const int target = lane - int(delta);
    const int segment = lane - lane % width;
    return ::metax_emu::shuffle_from(v, target < segment ? int64_t(-1) : int64_t(target), site);
}
// Lane `lane + delta`, if it lies in the caller's segment.
template <class T>
static inline T __shfl_down_sync(uint64_t, T v, unsigned int delta, int width = 64, int site = __builtin_LINE()) {
    const int lane = int(__lane_id());
    const int target = lane + int(delta);
    const int segment = lane - lane % width;
    return ::metax_emu::shuffle_from(v, target >= segment + width ? int64_t(-1) : int64_t(target), site);
}
static inline uint64_t __ballot_sync(uint64_t, int pred, int site = __builtin_LINE()) {
    return ::metax_emu::ballot(pred, site);
}
static inline int __all_sync(uint64_t, int pred, int site = __builtin_LINE()) {
    const uint64_t votes = ::metax_emu::ballot(pred, site);
    return votes == ::metax_emu::last_op_members();
}
static inline int __any_sync(uint64_t, int pred, int site = __builtin_LINE()) {
    return ::metax_emu::ballot(pred, site) != 0;
}
static inline uint64_t __activemask() { return ::metax_emu::live_mask(); }

// ---------------------------------------------------------------------------------------------
// Atomics (blocks may run on several host threads: real atomics)

template <class T> static inline T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
template <class T> static inline T atomicSub(T* p, T v) { return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST); }
template <class T> static inline T atomicAnd(T* p, T v) { return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST); }
template <class T> static inline T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
template <class T> static inline T atomicXor(T* p, T v) { return __atomic_fetch_xor(p, v, __ATOMIC_SEQ_CST); }
template <class T> static inline T atomicExch(T* p, T v) {
    T old;
    __atomic_exchange(p, &v, &old, __ATOMIC_SEQ_CST);
    return old;
}
template <class T> static inline T atomicCAS(T* p, T compare, T value) {
    __atomic_compare_exchange(p, &compare, &value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return compare;
}
namespace metax_emu {
// Read-modify-write of any trivially copyable value through a compare-and-swap loop.
template <class T, class F> static inline T cas_loop(T* p, F f) {
    T old;
    __atomic_load(p, &old, __ATOMIC_SEQ_CST);
    for (;;) {
        T next = f(old);
        if (__atomic_compare_exchange(p, &old, &next, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) return old;
    }
}
}  // namespace metax_emu
static inline float atomicAdd(float* p, float v) { return ::metax_emu::cas_loop(p, [v](float o) { return o + v; }); }
static inline double atomicAdd(double* p, double v) { return ::metax_emu::cas_loop(p, [v](double o) { return o + v; }); }
template <class T> static inline T atomicMax(T* p, T v) {
    return ::metax_emu::cas_loop(p, [v](T o) { return o < v ? v : o; });
}
template <class T> static inline T atomicMin(T* p, T v) {
    return ::metax_emu::cas_loop(p, [v](T o) { return v < o ? v : o; });
}
static inline unsigned int atomicInc(unsigned int* p, unsigned int limit) {
    return ::metax_emu::cas_loop(p, [limit](unsigned int o) { return o >= limit ? 0u : o + 1; });
}
static inline unsigned int atomicDec(unsigned int* p, unsigned int limit) {
    return ::metax_emu::cas_loop(p, [limit](unsigned int o) { return (o == 0 || o > limit) ? limit : o - 1; });
}

// ---------------------------------------------------------------------------------------------
// Integer and bit intrinsics

static inline int __popc(unsigned int x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffs(unsigned int x) { return __builtin_ffs(int(x)); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline int __ffsll(unsigned long long x) { return __builtin_ffsll((long long)x); }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned int)x); }
static inline int __clz(unsigned int x) { return x == 0 ? 32 : __builtin_clz(x); }
static inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
static inline int __clzll(unsigned long long x) { return x == 0 ? 64 : __builtin_clzll(x); }
static inline unsigned int __brev(unsigned int x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
    return __builtin_bswap32(x);
}
static inline unsigned long long __brevll(unsigned long long x) {
    return (static_cast<unsigned long long>(__brev(static_cast<unsigned int>(x))) << 32) | __brev(static_cast<unsigned int>(x >> 32));
}
static inline int __mulhi(int a, int b) { return int((long long)a * b >> 32); }
static inline unsigned int __umulhi(unsigned int a, unsigned int b) { return (unsigned int)((unsigned long long)a * b >> 32); }
static inline long long __mul64hi(long long a, long long b) { return (long long)((__int128)a * b >> 64); }
static inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)((unsigned __int128)a * b >> 64);
}

// ---------------------------------------------------------------------------------------------
// Math (host libm through compiler builtins; no <cmath>, which would double the compile time)

#define METAX_EMU_MATH1(name, fb, db)                                   \
    static inline float name(float x) { return fb(x); }                 \
    static inline double name(double x) { return db(x); }
METAX_EMU_MATH1(exp, __builtin_expf, __builtin_exp)
METAX_EMU_MATH1(exp2, __builtin_exp2f, __builtin_exp2)
METAX_EMU_MATH1(expm1, __builtin_expm1f, __builtin_expm1)
METAX_EMU_MATH1(log, __builtin_logf, __builtin_log)
METAX_EMU_MATH1(log2, __builtin_log2f, __builtin_log2)
METAX_EMU_MATH1(log10, __builtin_log10f, __builtin_log10)
METAX_EMU_MATH1(log1p, __builtin_log1pf, __builtin_log1p)
METAX_EMU_MATH1(sin, __builtin_sinf, __builtin_sin)
METAX_EMU_MATH1(cos, __builtin_cosf, __builtin_cos)
METAX_EMU_MATH1(tan, __builtin_tanf, __builtin_tan)
METAX_EMU_MATH1(sinh, __builtin_sinhf, __builtin_sinh)
METAX_EMU_MATH1(cosh, __builtin_coshf, __builtin_cosh)
METAX_EMU_MATH1(tanh, __builtin_tanhf, __builtin_tanh)
METAX_EMU_MATH1(asin, __builtin_asinf, __builtin_asin)
METAX_EMU_MATH1(acos, __builtin_acosf, __builtin_acos)
METAX_EMU_MATH1(atan, __builtin_atanf, __builtin_atan)
METAX_EMU_MATH1(asinh, __builtin_asinhf, __builtin_asinh)
METAX_EMU_MATH1(acosh, __builtin_acoshf, __builtin_acosh)
METAX_EMU_MATH1(atanh, __builtin_atanhf, __builtin_atanh)
METAX_EMU_MATH1(sqrt, __builtin_sqrtf, __builtin_sqrt)
METAX_EMU_MATH1(cbrt, __builtin_cbrtf, __builtin_cbrt)
METAX_EMU_MATH1(erf, __builtin_erff, __builtin_erf)
METAX_EMU_MATH1(erfc, __builtin_erfcf, __builtin_erfc)
METAX_EMU_MATH1(ceil, __builtin_ceilf, __builtin_ceil)
METAX_EMU_MATH1(floor, __builtin_floorf, __builtin_floor)
METAX_EMU_MATH1(trunc, __builtin_truncf, __builtin_trunc)
METAX_EMU_MATH1(round, __builtin_roundf, __builtin_round)
METAX_EMU_MATH1(rint, __builtin_rintf, __builtin_rint)
METAX_EMU_MATH1(fabs, __builtin_fabsf, __builtin_fabs)
#undef METAX_EMU_MATH1
static inline float rsqrt(float x) { return 1.0f / __builtin_sqrtf(x); }
static inline double rsqrt(double x) { return 1.0 / __builtin_sqrt(x); }
static inline float expf(float x) { return __builtin_expf(x); }
static inline float logf(float x) { return __builtin_logf(x); }
static inline float sqrtf(float x) { return __builtin_sqrtf(x); }
static inline float tanhf(float x) { return __builtin_tanhf(x); }
static inline float erff(float x) { return __builtin_erff(x); }
static inline float fabsf(float x) { return __builtin_fabsf(x); }
static inline float __expf(float x) { return __builtin_expf(x); }
static inline float __logf(float x) { return __builtin_logf(x); }
static inline float __sinf(float x) { return __builtin_sinf(x); }
static inline float __cosf(float x) { return __builtin_cosf(x); }
static inline float __tanhf(float x) { return __builtin_tanhf(x); }
static inline float __powf(float x, float y) { return __builtin_powf(x, y); }
static inline float __fdividef(float x, float y) { return x / y; }
static inline float __fsqrt_rn(float x) { return __builtin_sqrtf(x); }
static inline double __fsqrt_rn(double x) { return __builtin_sqrt(x); }
static inline float __frsqrt_rn(float x) { return 1.0f / __builtin_sqrtf(x); }
static inline float __frcp_rn(float x) { return 1.0f / x; }
static inline double __frcp_rn(double x) { return 1.0 / x; }
static inline float pow(float x, float y) { return __builtin_powf(x, y); }
static inline double pow(double x, double y) { return __builtin_pow(x, y); }
static inline float powf(float x, float y) { return __builtin_powf(x, y); }
static inline float atan2(float y, float x) { return __builtin_atan2f(y, x); }
static inline double atan2(double y, double x) { return __builtin_atan2(y, x); }
static inline float hypot(float x, float y) { return __builtin_hypotf(x, y); }
static inline double hypot(double x, double y) { return __builtin_hypot(x, y); }
static inline float hypotf(float x, float y) { return __builtin_hypotf(x, y); }
static inline float rhypot(float x, float y) { return 1.0f / __builtin_hypotf(x, y); }
static inline double rhypot(double x, double y) { return 1.0 / __builtin_hypot(x, y); }
static inline float rhypotf(float x, float y) { return 1.0f / __builtin_hypotf(x, y); }
static inline float fmod(float x, float y) { return __builtin_fmodf(x, y); }
static inline double fmod(double x, double y) { return __builtin_fmod(x, y); }
static inline float fmodf(float x, float y) { return __builtin_fmodf(x, y); }
static inline float remainder(float x, float y) { return __builtin_remainderf(x, y); }
static inline double remainder(double x, double y) { return __builtin_remainder(x, y); }
static inline float copysign(float x, float y) { return __builtin_copysignf(x, y); }
static inline double copysign(double x, double y) { return __builtin_copysign(x, y); }
static inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
static inline double fma(double a, double b, double c) { return __builtin_fma(a, b, c); }
static inline float fmaf(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
// CUDA's fmaxf/fminf: NaN only when both operands are NaN.
static inline float fmaxf(float a, float b) { return __builtin_fmaxf(a, b); }
static inline float fminf(float a, float b) { return __builtin_fminf(a, b); }
static inline double fmax(double a, double b) { return __builtin_fmax(a, b); }
static inline double fmin(double a, double b) { return __builtin_fmin(a, b); }
static inline float fmax(float a, float b) { return __builtin_fmaxf(a, b); }
static inline float fmin(float a, float b) { return __builtin_fminf(a, b); }
static inline bool isnan(float x) { return __builtin_isnan(x); }
static inline bool isnan(double x) { return __builtin_isnan(x); }
static inline bool isinf(float x) { return __builtin_isinf(x); }
static inline bool isinf(double x) { return __builtin_isinf(x); }
static inline bool isfinite(float x) { return __builtin_isfinite(x); }
static inline bool isfinite(double x) { return __builtin_isfinite(x); }
static inline bool signbit(float x) { return __builtin_signbit(x); }
static inline bool signbit(double x) { return __builtin_signbit(x); }

static inline int abs(int x) { return x < 0 ? -x : x; }
static inline long abs(long x) { return x < 0 ? -x : x; }
static inline long long abs(long long x) { return x < 0 ? -x : x; }
static inline signed char abs(signed char x) { return x < 0 ? -x : x; }
static inline short abs(short x) { return x < 0 ? -x : x; }
static inline float abs(float x) { return __builtin_fabsf(x); }
static inline double abs(double x) { return __builtin_fabs(x); }
static inline unsigned int abs(unsigned int x) { return x; }
static inline unsigned long abs(unsigned long x) { return x; }
static inline unsigned long long abs(unsigned long long x) { return x; }
static inline unsigned char abs(unsigned char x) { return x; }
static inline unsigned short abs(unsigned short x) { return x; }

// CUDA's max/min: one template over every type (float max/min follow fmaxf/fminf).
template <class T> static inline T max(T a, T b) { return a < b ? b : a; }
template <class T> static inline T min(T a, T b) { return b < a ? b : a; }
static inline float max(float a, float b) { return __builtin_fmaxf(a, b); }
static inline float min(float a, float b) { return __builtin_fminf(a, b); }
static inline double max(double a, double b) { return __builtin_fmax(a, b); }
static inline double min(double a, double b) { return __builtin_fmin(a, b); }

// ---------------------------------------------------------------------------------------------
// Half precision: `__half` (IEEE binary16) and `__maca_bfloat16` (bfloat16), stored as 16 bits.
//
// Conversions from float round to nearest, ties to even, keep signed zeros and infinities, turn
// NaN into a quiet NaN with the sign kept, and flush nothing (binary16 subnormals are produced).
// This is what CUDA's `__float2half_rn` / `__float2bfloat16_rn` do; MetaX's `maca_fp16.h` and
// `maca_bfloat16.h` are not public, so that MACA rounds the same way is *assumed* (MetaX ports
// of CUDA code use `__float2half`/`__float2bfloat16` interchangeably with CUDA's, which suggests
// it). Arithmetic on half values is done in float and rounded once to the half type, as CUDA's
// operators do on hardware without native half arithmetic.

namespace metax_emu {
static inline uint32_t f32_bits(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    return u;
}
static inline float f32_from(uint32_t u) {
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t float_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}
static inline float bf16_to_float(uint16_t h) { return f32_from(uint32_t(h) << 16); }
static inline uint16_t float_to_f16(float f) {
    const uint32_t u = f32_bits(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));  // NaN
    if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to infinity (>= 65520)
    if (abs < 0x38800000u) {                                    // below the smallest normal 2^-14
        if (abs < 0x33000000u) return uint16_t(sign);            // below half the smallest subnormal
        const uint32_t exp = abs >> 23;
        const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126u - exp;  // 14 + (113 - exp) - 1 … shift of the 24-bit mantissa
        const uint32_t half = mant >> shift;
        const uint32_t rem = mant & ((1u << shift) - 1u);
        const uint32_t mid = 1u << (shift - 1u);
        uint32_t r = half;
        if (rem > mid || (rem == mid && (half & 1u))) ++r;
        return uint16_t(sign | r);
    }
    uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
    const uint32_t rem = r & 0x1fffu;
    r >>= 13;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
    return uint16_t(sign | r);
}
static inline float f16_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1fu) return f32_from(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
        if (mant == 0) return f32_from(sign);
        int e = -1;
        do {
            ++e;
            mant <<= 1;
        } while ((mant & 0x400u) == 0);
        return f32_from(sign | (uint32_t(112 - e) << 23) | ((mant & 0x3ffu) << 13));
    }
    return f32_from(sign | ((exp + 112u) << 23) | (mant << 13));
}
}  // namespace metax_emu

#define METAX_EMU_HALF_TYPE(T, TO, FROM)                                                              \
    struct __attribute__((aligned(2))) T {                                                            \
        uint16_t bits;                                                                                \
        T() = default;                                                                                \
        T(float f) : bits(::metax_emu::TO(f)) {}                                                      \
        T(double f) : bits(::metax_emu::TO(float(f))) {}                                              \
        T(int v) : bits(::metax_emu::TO(float(v))) {}                                                 \
        T(unsigned int v) : bits(::metax_emu::TO(float(v))) {}                                        \
        T(long v) : bits(::metax_emu::TO(float(v))) {}                                                \
        T(unsigned long v) : bits(::metax_emu::TO(float(v))) {}                                       \
        T(long long v) : bits(::metax_emu::TO(float(v))) {}                                           \
        T(unsigned long long v) : bits(::metax_emu::TO(float(v))) {}                                  \
        T(short v) : bits(::metax_emu::TO(float(v))) {}                                               \
        T(unsigned short v) : bits(::metax_emu::TO(float(v))) {}                                      \
        T(signed char v) : bits(::metax_emu::TO(float(v))) {}                                         \
        T(unsigned char v) : bits(::metax_emu::TO(float(v))) {}                                       \
        T(bool v) : bits(::metax_emu::TO(v ? 1.0f : 0.0f)) {}                                         \
        operator float() const { return ::metax_emu::FROM(bits); }                                    \
        explicit operator double() const { return double(::metax_emu::FROM(bits)); }                  \
        explicit operator int() const { return int(::metax_emu::FROM(bits)); }                        \
        explicit operator unsigned int() const { return (unsigned int)(::metax_emu::FROM(bits)); }    \
        explicit operator long() const { return long(::metax_emu::FROM(bits)); }                      \
        explicit operator unsigned long() const { return (unsigned long)(::metax_emu::FROM(bits)); }  \
        explicit operator long long() const { return (long long)(::metax_emu::FROM(bits)); }          \
        explicit operator unsigned long long() const {                                               \
            return (unsigned long long)(::metax_emu::FROM(bits));                                     \
        }                                                                                             \
        explicit operator short() const { return short(::metax_emu::FROM(bits)); }                    \
        explicit operator unsigned short() const { return (unsigned short)(::metax_emu::FROM(bits)); }\
        explicit operator signed char() const { return (signed char)(::metax_emu::FROM(bits)); }      \
        explicit operator unsigned char() const { return (unsigned char)(::metax_emu::FROM(bits)); }  \
        explicit operator bool() const { return (bits & 0x7fffu) != 0; }                              \
        T& operator+=(T o) { return *this = T(float(*this) + float(o)); }                             \
        T& operator-=(T o) { return *this = T(float(*this) - float(o)); }                             \
        T& operator*=(T o) { return *this = T(float(*this) * float(o)); }                             \
        T& operator/=(T o) { return *this = T(float(*this) / float(o)); }                             \
    };                                                                                                \
    static inline T operator+(T a, T b) { return T(float(a) + float(b)); }                            \
    static inline T operator-(T a, T b) { return T(float(a) - float(b)); }                            \
    static inline T operator*(T a, T b) { return T(float(a) * float(b)); }                            \
    static inline T operator/(T a, T b) { return T(float(a) / float(b)); }                            \
    static inline T operator-(T a) {                                                                  \
        T r;                                                                                          \
        r.bits = uint16_t(a.bits ^ 0x8000u);                                                          \
        return r;                                                                                     \
    }                                                                                                 \
    static inline T operator+(T a) { return a; }                                                      \
    static inline bool operator==(T a, T b) { return float(a) == float(b); }                          \
    static inline bool operator!=(T a, T b) { return float(a) != float(b); }                          \
    static inline bool operator<(T a, T b) { return float(a) < float(b); }                            \
    static inline bool operator<=(T a, T b) { return float(a) <= float(b); }                          \
    static inline bool operator>(T a, T b) { return float(a) > float(b); }                            \
    static inline bool operator>=(T a, T b) { return float(a) >= float(b); }                          \
    static inline T hexp(T x) { return T(__builtin_expf(float(x))); }                                 \
    static inline T hexp2(T x) { return T(__builtin_exp2f(float(x))); }                               \
    static inline T hlog(T x) { return T(__builtin_logf(float(x))); }                                 \
    static inline T hlog2(T x) { return T(__builtin_log2f(float(x))); }                               \
    static inline T hlog10(T x) { return T(__builtin_log10f(float(x))); }                             \
    static inline T hsin(T x) { return T(__builtin_sinf(float(x))); }                                 \
    static inline T hcos(T x) { return T(__builtin_cosf(float(x))); }                                 \
    static inline T hsqrt(T x) { return T(__builtin_sqrtf(float(x))); }                               \
    static inline T hrsqrt(T x) { return T(1.0f / __builtin_sqrtf(float(x))); }                       \
    static inline T hrcp(T x) { return T(1.0f / float(x)); }                                          \
    static inline T hceil(T x) { return T(__builtin_ceilf(float(x))); }                               \
    static inline T hfloor(T x) { return T(__builtin_floorf(float(x))); }                             \
    static inline T htrunc(T x) { return T(__builtin_truncf(float(x))); }                             \
    static inline T hrint(T x) { return T(__builtin_rintf(float(x))); }                               \
    static inline T __habs(T x) {                                                                     \
        T r;                                                                                          \
        r.bits = uint16_t(x.bits & 0x7fffu);                                                          \
        return r;                                                                                     \
    }                                                                                                 \
    static inline T abs(T x) { return __habs(x); }                                                    \
    static inline bool __hisnan(T x) { return __builtin_isnan(float(x)); }                            \
    static inline bool __hisinf(T x) { return __builtin_isinf(float(x)); }                            \
    static inline bool isnan(T x) { return __builtin_isnan(float(x)); }                               \
    static inline bool isinf(T x) { return __builtin_isinf(float(x)); }                               \
    static inline T __hmax(T a, T b) { return T(__builtin_fmaxf(float(a), float(b))); }               \
    static inline T __hmin(T a, T b) { return T(__builtin_fminf(float(a), float(b))); }               \
    static inline T max(T a, T b) { return __hmax(a, b); }                                            \
    static inline T min(T a, T b) { return __hmin(a, b); }

METAX_EMU_HALF_TYPE(__half, float_to_f16, f16_to_float)
METAX_EMU_HALF_TYPE(__maca_bfloat16, float_to_bf16, bf16_to_float)
#undef METAX_EMU_HALF_TYPE

struct __attribute__((aligned(4))) __half2 {
    __half x, y;
};
struct __attribute__((aligned(4))) __maca_bfloat162 {
    __maca_bfloat16 x, y;
};

static inline float __half2float(__half h) { return float(h); }
static inline __half __float2half(float f) { return __half(f); }
static inline __half __float2half_rn(float f) { return __half(f); }
static inline float __bfloat162float(__maca_bfloat16 h) { return float(h); }
static inline __maca_bfloat16 __float2bfloat16(float f) { return __maca_bfloat16(f); }
static inline __maca_bfloat16 __float2bfloat16_rn(float f) { return __maca_bfloat16(f); }

// Atomic add on half values (compare-and-swap on the 16 bits).
static inline __half atomicAdd(__half* p, __half v) {
    return ::metax_emu::cas_loop(p, [v](__half o) { return o + v; });
}
static inline __maca_bfloat16 atomicAdd(__maca_bfloat16* p, __maca_bfloat16 v) {
    return ::metax_emu::cas_loop(p, [v](__maca_bfloat16 o) { return o + v; });
}

#endif  // METAX_EMU_MC_RUNTIME_H
