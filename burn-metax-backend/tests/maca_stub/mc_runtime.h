// A stand-in for the MACA device headers, for syntax-checking generated kernels with a host
// C++ compiler (`g++ -fsyntax-only -include tests/maca_stub/mc_runtime.h`). It declares only
// what the MACA dialect emits, with the signatures the dialect assumes (64-bit wave masks).
// Written for these tests; not derived from the MACA SDK, which is not public.
#ifndef BURN_METAX_MACA_STUB_MC_RUNTIME_H
#define BURN_METAX_MACA_STUB_MC_RUNTIME_H

#include <cmath>
#include <cstdint>

#define __global__
#define __device__
#define __host__
#define __shared__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(n)
#define __align__(n) __attribute__((aligned(n)))

struct maca_stub_uint3 {
    unsigned int x, y, z;
};
// Built-in index variables.
extern const maca_stub_uint3 threadIdx;
extern const maca_stub_uint3 blockIdx;
extern const maca_stub_uint3 blockDim;
extern const maca_stub_uint3 gridDim;
extern const int warpSize;

inline maca_stub_uint3 make_uint3(unsigned int x, unsigned int y, unsigned int z) {
    return maca_stub_uint3{x, y, z};
}
typedef maca_stub_uint3 uint3;

// Synchronisation.
void __syncthreads();
void __syncwarp();
void __threadfence();

// Wave-64 collectives: the member mask is 64 bits wide (uint64_t overloads only, so that a
// 32-bit mask literal would not compile here either).
template <typename T> T __shfl_sync(std::uint64_t mask, T var, int src_lane, int width);
template <typename T> T __shfl_xor_sync(std::uint64_t mask, T var, int lane_mask, int width);
template <typename T> T __shfl_up_sync(std::uint64_t mask, T var, unsigned int delta, int width);
template <typename T> T __shfl_down_sync(std::uint64_t mask, T var, unsigned int delta, int width);
std::uint64_t __ballot_sync(std::uint64_t mask, int predicate);
int __all_sync(std::uint64_t mask, int predicate);
int __any_sync(std::uint64_t mask, int predicate);
unsigned int __lane_id();

// Bit operations.
int __ffs(int x);
int __ffs(unsigned int x);
int __ffsll(long long x);
int __ffsll(unsigned long long x);
int __clz(int x);
int __clz(unsigned int x);
int __clzll(long long x);
int __clzll(unsigned long long x);
int __popc(unsigned int x);
int __popcll(unsigned long long x);
unsigned int __brev(unsigned int x);
unsigned long long __brevll(unsigned long long x);

// Atomics (the subset the dialect's shared code may emit for 32-bit values).
template <typename T> T atomicAdd(T* address, T value);
template <typename T> T atomicExch(T* address, T value);
template <typename T> T atomicCAS(T* address, T compare, T value);
template <typename T> T atomicMax(T* address, T value);
template <typename T> T atomicMin(T* address, T value);

// min/max as device functions of one type.
template <typename T> T max(T a, T b) { return a > b ? a : b; }
template <typename T> T min(T a, T b) { return a < b ? a : b; }
using std::exp;
using std::fmaxf;
using std::fminf;
using std::log;
using std::sqrt;

// Minimal half types (the MACA names the dialect emits).
struct __half {
    std::uint16_t bits;
    __half() = default;
    explicit __half(float) {}
    operator float() const { return 0.0f; }
};
struct __half2 {
    __half x, y;
};
struct __maca_bfloat16 {
    std::uint16_t bits;
    __maca_bfloat16() = default;
    explicit __maca_bfloat16(float) {}
    operator float() const { return 0.0f; }
};
struct __maca_bfloat162 {
    __maca_bfloat16 x, y;
};

#endif
