// Shared helpers for every kernel file: error reporting, dtype dispatch, conversions.
#pragma once
#include <stdint.h>
#include <string.h>

#include <atomic>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "api.h"

// Each toolkit leg compiles into its own namespace so that legs can share one library.
#ifndef WLLM_NS
#define WLLM_NS wllm
#endif

namespace WLLM_NS {

// Records a printf-style message as the calling thread's last error and returns `code`.
int fail(int code, const char* fmt, ...);

// Checks the launch that just happened; returns WLLM_OK or WLLM_ERR_CUDA with the CUDA message.
int check_launch(const char* what);

template <typename T>
struct Conv;
template <>
struct Conv<float> {
  static __device__ __forceinline__ float to_float(float v) { return v; }
  static __device__ __forceinline__ float from_float(float v) { return v; }
};
template <>
struct Conv<__half> {
  static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
};
template <>
struct Conv<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};

// Two floats rounded to T and packed into one 32-bit register, lo in the low half (fragment order).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  const T v[2] = {Conv<T>::from_float(lo), Conv<T>::from_float(hi)};
  uint32_t r;
  memcpy(&r, v, 4);
  return r;
}

// 32-bit shared-state-space address of a pointer into shared memory (for asm operands).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- Programmatic Dependent Launch (PDL, sm_90+) ----------------------------------------------
// A kernel launched with launch_pdl() may start while the kernels before it in the stream are still
// running. Protocol every PDL kernel follows:
//  - before pdl_wait(), read only data that no kernel of the running PDL chain writes: weights and
//    constant tables, and data written by memory copies or by kernels launched without PDL (they never
//    trigger early, so they have completed before any later kernel starts): seq_lens, block tables,
//    positions, slot mappings, K/V rows of earlier steps. Write nothing at all;
//  - pdl_wait() on every path through the kernel (early exits included), before the first read of
//    anything a PDL kernel before it writes and before the first global write. It returns when the
//    predecessor has completed with its writes visible; the predecessor completed only after its own
//    wait, so by then everything before this kernel in the stream has completed. (A CTA that exited
//    without waiting would break that chain, hence the wait on early-exit paths too.)
//  - trigger the dependents (pdl_launch_dependents) either first thing (pdl_trigger_early) or right
//    after the wait (pdl_wait_and_trigger), per kernel family. Early, the next kernel may start its
//    pre-wait part while this one -- and the kernels before it -- still run. That hides rotary+cache's
//    dependent, decode attention's chain of seq_len -> block table -> K/V reads, behind the QKV
//    projection; but when every kernel triggers early, whole layers of prologues run ahead and the
//    8B decode step got slower (benchmarks/RESULTS.md), so by default only rotary_and_cache does.
//    WLLM_PDL_EARLY_MASK (build time, bits PdlFamily) chooses the families for measurements.
// Without a programmatic dependency (no attribute, older GPU, wllm_set_pdl(0)) all of these are no-ops.
enum PdlFamily { PDL_ROPE = 1, PDL_NORM = 2, PDL_GEMV = 4, PDL_ATTENTION = 8, PDL_ACTIVATION = 16 };
#ifndef WLLM_PDL_EARLY_MASK
#define WLLM_PDL_EARLY_MASK 1
#endif

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#ifdef WLLM_TRACE
// Diagnostic builds only (NVCC_APPEND_FLAGS=-DWLLM_TRACE): thread 0 of every CTA records %globaltimer
// when the CTA starts (event 0) and when its pdl_wait() returns (event 1), into this translation unit's
// buffer; WLLM_TRACE_TU(name) exports wllm_trace_dump_<name>(dst, max) to read and reset it.
constexpr unsigned kTraceRecs = 1u << 21;
static __device__ unsigned long long g_trace_recs[2 * kTraceRecs];
static __device__ unsigned int g_trace_n;
__device__ __forceinline__ void trace_event(int family, int event) {
  if (threadIdx.x != 0 || threadIdx.y != 0) return;
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  unsigned int smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  const unsigned i = atomicAdd(&g_trace_n, 1u);
  if (i >= kTraceRecs) return;
  g_trace_recs[2 * i] = (unsigned long long)family | ((unsigned long long)event << 8) |
                        ((unsigned long long)gridDim.x << 12) | ((unsigned long long)(blockIdx.x & 0xffff) << 32) |
                        ((unsigned long long)(blockIdx.z & 0xff) << 48) | ((unsigned long long)(smid & 0xff) << 56);
  g_trace_recs[2 * i + 1] = t;
}
// Exported like the API (api.h), with the leg's symbol suffix, so a multi-leg trace build links.
#define WLLM_TRACE_TU(name)                                                                              \
  WLLM_API int WLLM_FN(wllm_trace_dump_##name)(void* dst, int max) {                                     \
    unsigned int n = 0;                                                                                \
    cudaDeviceSynchronize();                                                                           \
    cudaMemcpyFromSymbol(&n, g_trace_n, sizeof(n));                                                    \
    if (n > kTraceRecs) n = kTraceRecs;                                                                \
    if ((int)n > max) n = (unsigned)max;                                                               \
    if (n > 0) cudaMemcpyFromSymbol(dst, g_trace_recs, (size_t)n * 16);                                \
    const unsigned int zero = 0;                                                                       \
    cudaMemcpyToSymbol(g_trace_n, &zero, sizeof(zero));                                                \
    return (int)n;                                                                                     \
  }
#else
__device__ __forceinline__ void trace_event(int, int) {}
#define WLLM_TRACE_TU(name)
#endif

// First thing in a PDL kernel of `Family`: triggers the dependents now if the family triggers early.
template <int Family>
__device__ __forceinline__ void pdl_trigger_early() {
  trace_event(Family, 0);
  if ((WLLM_PDL_EARLY_MASK & Family) != 0) pdl_launch_dependents();
}

// pdl_wait(), then the trigger of a family that did not trigger early.
template <int Family>
__device__ __forceinline__ void pdl_wait_and_trigger() {
  pdl_wait();
  trace_event(Family, 1);
  if ((WLLM_PDL_EARLY_MASK & Family) == 0) pdl_launch_dependents();
}

// True when launches on the current device should carry the PDL attribute: the device is sm_90+ and
// PDL is on (the default; the tests' hook wllm_set_pdl turns it off).
bool pdl_enabled();

// What launch code needs to know of the current device, read once per device.
struct DeviceProps {
  int major;     // compute capability major
  int minor;     // compute capability minor
  int sms;       // multiprocessors
  int max_smem;  // opt-in shared memory per block, bytes
};

// The current device's properties (cached per device); WLLM_OK, or an error code with the message set.
int current_device_props(DeviceProps* props);

// Compute-capability major of the current device, 0 if it cannot be read.
int current_device_major();

// Launches `kernel` like kernel<<<grid, block, smem, stream>>>(args...), with the programmatic
// stream serialization attribute when pdl_enabled(). Returns the launch's error (also left for
// check_launch, which reads cudaGetLastError).
template <typename... KArgs, typename... Args>
cudaError_t launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  if (pdl_enabled()) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attr;
    config.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&config, kernel, args...);  // converts each argument to the kernel's type
}

// Gated activations (the MLP's act(gate) * up), in fp32: act_and_mul and the SM 9.0 GEMM's epilogue.
enum Activation { ACT_SILU = 0, ACT_GELU_TANH = 1 };

template <int ACT>
__device__ __forceinline__ float gated(float g, float u) {
  if (ACT == ACT_SILU) return g / (1.0f + expf(-g)) * u;
  // tanh approximation of GELU, as HF's "gelu_pytorch_tanh" / gelu(approximate="tanh").
  const float k0 = 0.7978845608028654f;  // sqrt(2 / pi)
  const float inner = k0 * (g + 0.044715f * g * g * g);
  return 0.5f * g * (1.0f + tanhf(inner)) * u;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the whole block; every thread gets the result. `scratch` holds >= 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int num_warps = (blockDim.x + 31) >> 5;
  v = (lane < num_warps) ? scratch[lane] : 0.0f;
  return warp_sum(v);
}

}  // namespace WLLM_NS

// Runs the following statement with `T` bound to the element type of dtype code `code`.
#define WLLM_DISPATCH_FLOAT(code, T, ...)                                                   \
  switch (code) {                                                                           \
    case WLLM_FLOAT32: {                                                                    \
      typedef float T;                                                                      \
      __VA_ARGS__;                                                                          \
    } break;                                                                                \
    case WLLM_FLOAT16: {                                                                    \
      typedef __half T;                                                                     \
      __VA_ARGS__;                                                                          \
    } break;                                                                                \
    case WLLM_BFLOAT16: {                                                                   \
      typedef __nv_bfloat16 T;                                                              \
      __VA_ARGS__;                                                                          \
    } break;                                                                                \
    default:                                                                                \
      return ::WLLM_NS::fail(WLLM_ERR_INVALID_ARGUMENT, "unsupported dtype code %d", (int)code); \
  }
