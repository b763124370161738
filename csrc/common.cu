// Library-wide entry points: ABI version, error reporting and the device check.
#include <stdarg.h>
#include <stdio.h>

#include "common.cuh"

namespace WLLM_NS {

static thread_local char g_last_error[1024] = "";

int fail(int code, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(g_last_error, sizeof(g_last_error), fmt, args);
  va_end(args);
  return code;
}

int check_launch(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return WLLM_OK;
  const int code = (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction)
                       ? WLLM_ERR_NO_KERNEL_IMAGE
                       : WLLM_ERR_CUDA;
  return fail(code, "%s: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
}

// Does nothing; its attributes tell whether this library carries code for a device.
__global__ void probe_kernel(int* flag) {
  if (flag != nullptr) *flag = 1;
}

}  // namespace WLLM_NS

WLLM_API int WLLM_FN(wllm_abi_version)(void) { return WLLM_ABI_VERSION; }

WLLM_API const char* WLLM_FN(wllm_last_error)(void) { return WLLM_NS::g_last_error; }

WLLM_API int WLLM_FN(wllm_device_check)(int device, int* binary_sm, int* ptx_version) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    return WLLM_NS::fail(WLLM_ERR_CUDA, "no usable CUDA driver or device: %s", cudaGetErrorString(err));
  }
  if (device < 0 || device >= count) {
    return WLLM_NS::fail(WLLM_ERR_INVALID_ARGUMENT, "device %d out of range (%d devices)", device, count);
  }
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device);
  cudaFuncAttributes attr;
  err = cudaFuncGetAttributes(&attr, WLLM_NS::probe_kernel);
  cudaSetDevice(previous);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, device);
    return WLLM_NS::fail(err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction
                          ? WLLM_ERR_NO_KERNEL_IMAGE
                          : WLLM_ERR_CUDA,
                      "the kernel library has no code for %s (sm_%d%d): %s", prop.name, prop.major,
                      prop.minor, cudaGetErrorString(err));
  }
  if (binary_sm != nullptr) *binary_sm = attr.binaryVersion;
  if (ptx_version != nullptr) *ptx_version = attr.ptxVersion;
  return WLLM_OK;
}
