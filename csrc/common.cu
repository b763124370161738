// Library-wide entry points: ABI version, error reporting and the device check.
#include <stdarg.h>
#include <stdio.h>

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

// PDL on or off for launches from now on (on by default; wllm_set_pdl is the tests' hook to launch the
// way pre-SM 9.0 GPUs do). Atomic because launches may come from several host threads.
static std::atomic<int> g_pdl_switch(1);

// Per-device properties, filled once (`ready` marks a filled entry). Devices past the table are asked
// every time. Written at most once per entry with the same values, so a race between threads is benign;
// `ready` orders the fields before the flag.
constexpr int kMaxCachedDevices = 64;
static DeviceProps g_device_props[kMaxCachedDevices];
static std::atomic<int> g_device_ready[kMaxCachedDevices];

int current_device_props(DeviceProps* props) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  const bool cached = err == cudaSuccess && device >= 0 && device < kMaxCachedDevices;
  if (cached && g_device_ready[device].load(std::memory_order_acquire)) {
    *props = g_device_props[device];
    return WLLM_OK;
  }
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&props->major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&props->minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&props->sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&props->max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  if (err != cudaSuccess) {
    cudaGetLastError();  // not sticky: later calls start clean
    return fail(WLLM_ERR_CUDA, "cannot read the device's properties: %s", cudaGetErrorString(err));
  }
  if (cached) {
    g_device_props[device] = *props;
    g_device_ready[device].store(1, std::memory_order_release);
  }
  return WLLM_OK;
}

int current_device_major() {
  DeviceProps props;
  return current_device_props(&props) == WLLM_OK ? props.major : 0;
}

bool pdl_enabled() { return g_pdl_switch.load(std::memory_order_relaxed) && current_device_major() >= 9; }

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

WLLM_API int WLLM_FN(wllm_set_pdl)(int enable) { return WLLM_NS::g_pdl_switch.exchange(enable != 0 ? 1 : 0); }
