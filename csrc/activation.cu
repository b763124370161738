// Fused gated activations: out = act(gate) * up over x = [gate | up] (HF's gate_up_proj layout),
// computed in fp32 and rounded once.
#include "common.cuh"

namespace WLLM_NS {

// grid.x = row, grid.y strides over the row in chunks of blockDim.x * VEC elements.
template <typename T, int ACT, int VEC>
__global__ void act_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t inter,
                                   int64_t out_stride, int64_t x_stride) {
  pdl_trigger_early<PDL_ACTIVATION>();
  // Everything this kernel reads is the previous kernel's output: nothing to do before the wait.
  pdl_wait_and_trigger<PDL_ACTIVATION>();
  const T* gate = x + blockIdx.x * x_stride;
  const T* up = gate + inter;
  T* dst = out + blockIdx.x * out_stride;
  const int64_t step = (int64_t)gridDim.y * blockDim.x * VEC;
  for (int64_t i = ((int64_t)blockIdx.y * blockDim.x + threadIdx.x) * VEC; i < inter; i += step) {
    if (VEC == 1) {
      dst[i] = Conv<T>::from_float(gated<ACT>(Conv<T>::to_float(gate[i]), Conv<T>::to_float(up[i])));
    } else {
      uint4 gv = *reinterpret_cast<const uint4*>(gate + i);
      uint4 uv = *reinterpret_cast<const uint4*>(up + i);
      uint4 ov;
      const T* g = reinterpret_cast<const T*>(&gv);
      const T* u = reinterpret_cast<const T*>(&uv);
      T* o = reinterpret_cast<T*>(&ov);
#pragma unroll
      for (int j = 0; j < VEC; ++j) o[j] = Conv<T>::from_float(gated<ACT>(Conv<T>::to_float(g[j]), Conv<T>::to_float(u[j])));
      *reinterpret_cast<uint4*>(dst + i) = ov;
    }
  }
}

template <typename T, int ACT>
static void launch_act(T* out, const T* x, int64_t rows, int64_t inter, int64_t out_stride, int64_t x_stride,
                       bool wide, cudaStream_t s) {
  const int vec = wide ? 16 / (int)sizeof(T) : 1;
  const int threads = 256;
  const int64_t per_block = (int64_t)threads * vec;
  int64_t chunks = (inter + per_block - 1) / per_block;
  if (chunks > 65535) chunks = 65535;
  const dim3 grid((unsigned)rows, (unsigned)chunks);
  if (wide) {
    launch_pdl(act_and_mul_kernel<T, ACT, 16 / sizeof(T)>, grid, dim3(threads), 0, s, out, x, inter, out_stride,
               x_stride);
  } else {
    launch_pdl(act_and_mul_kernel<T, ACT, 1>, grid, dim3(threads), 0, s, out, x, inter, out_stride, x_stride);
  }
}

}  // namespace WLLM_NS

WLLM_API int WLLM_FN(wllm_act_and_mul)(void* out, const void* x, int64_t rows, int64_t inter, int64_t out_row_stride,
                                       int64_t x_row_stride, int activation, int dtype, void* stream) {
  using namespace WLLM_NS;
  if (out == nullptr || x == nullptr) return fail(WLLM_ERR_INVALID_ARGUMENT, "act_and_mul: null pointer");
  if (rows < 0 || inter <= 0 || rows > 0x7fffffffLL) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "act_and_mul: bad shape rows=%lld intermediate=%lld", (long long)rows,
                (long long)inter);
  }
  if (activation != ACT_SILU && activation != ACT_GELU_TANH) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "act_and_mul: unknown activation %d (0 = silu, 1 = gelu_tanh)",
                activation);
  }
  if (rows == 0) return WLLM_OK;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  WLLM_DISPATCH_FLOAT(dtype, T, {
    const int vec = 16 / (int)sizeof(T);
    const bool wide = ((reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(x)) & 15u) == 0 &&
                      inter % vec == 0 && out_row_stride % vec == 0 && x_row_stride % vec == 0;
    if (activation == ACT_SILU) {
      launch_act<T, ACT_SILU>(static_cast<T*>(out), static_cast<const T*>(x), rows, inter, out_row_stride,
                              x_row_stride, wide, s);
    } else {
      launch_act<T, ACT_GELU_TANH>(static_cast<T*>(out), static_cast<const T*>(x), rows, inter, out_row_stride,
                                   x_row_stride, wide, s);
    }
  });
  return check_launch("act_and_mul");
}
