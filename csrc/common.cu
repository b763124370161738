// Library-wide entry points: ABI version, error reporting and the device check.
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>

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

// PDL switch: -1 = not read yet, then 0 or 1. Read from WLLM_PDL once (anything but "0" leaves PDL
// on); wllm_set_pdl overrides it. Atomic because launches may come from several host threads.
static std::atomic<int> g_pdl_switch(-1);

static int pdl_from_environment() {
#if defined(_MSC_VER)
  // getenv is "deprecated" under MSVC (C4996); _dupenv_s is its warning-free equivalent.
  char* value = nullptr;
  size_t length = 0;
  int enabled = 1;
  if (_dupenv_s(&value, &length, "WLLM_PDL") == 0 && value != nullptr) {
    enabled = strcmp(value, "0") != 0;
    free(value);
  }
  return enabled;
#else
  const char* value = getenv("WLLM_PDL");
  return (value != nullptr && strcmp(value, "0") == 0) ? 0 : 1;
#endif
}

// Per-device "is sm_90 or newer": 0 = not asked yet, 1 = no, 2 = yes. Devices past the table never use PDL.
constexpr int kMaxPdlDevices = 64;
static std::atomic<int> g_pdl_device[kMaxPdlDevices];

static int pdl_switch() {
  int value = g_pdl_switch.load(std::memory_order_relaxed);
  if (value < 0) {
    int expected = -1;
    g_pdl_switch.compare_exchange_strong(expected, pdl_from_environment());
    value = g_pdl_switch.load(std::memory_order_relaxed);
  }
  return value;
}

bool pdl_enabled() {
  if (!pdl_switch()) return false;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();  // not sticky; the launch itself will report a real problem
    return false;
  }
  if (device < 0 || device >= kMaxPdlDevices) return false;
  int known = g_pdl_device[device].load(std::memory_order_relaxed);
  if (known == 0) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    known = major >= 9 ? 2 : 1;
    g_pdl_device[device].store(known, std::memory_order_relaxed);
  }
  return known == 2;
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

WLLM_API int WLLM_FN(wllm_set_pdl)(int enable) {
  const int previous = WLLM_NS::pdl_switch();
  WLLM_NS::g_pdl_switch.store(enable != 0 ? 1 : 0);
  return previous;
}
