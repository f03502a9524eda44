// XLA FFI handlers around kernels exported by the CuTe DSL (`export_to_c`); generated code
// (jax_kimik3/native_build.py) defines one `Kernel` and two handler symbols per kernel call.
//
// A kernel compiled through `cutlass.jax`'s wrapper takes, per buffer (inputs, then outputs,
// aliased ones included), a pointer to {data, dims}: what XLA's FFI buffer holds. So the
// handler passes XLA's buffers through and the kernel reads every shape at run time.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace k3 {

namespace ffi = xla::ffi;

inline constexpr size_t kMaxBuffers = 32;

struct Descriptor {  // cutlass.jax's view of an XLA FFI buffer
  void* data;
  const int64_t* dims;
};

// The first CUDA error an exported header's load reported on this thread (its macro).
inline thread_local cudaError_t load_error = cudaSuccess;
inline void RecordLoadError(cudaError_t err) {
  if (err != cudaSuccess && load_error == cudaSuccess) load_error = err;
}

struct Kernel {
  const char* name;
  size_t buffers;  // inputs present + outputs
  void (*load)();  // the exported module's Load: the cubin into every device
  int32_t (*run)(cudaStream_t, Descriptor*);
  std::once_flag once;
  cudaError_t loaded = cudaSuccess;
};

inline ffi::Error Load(Kernel* kernel) {
  std::call_once(kernel->once, [kernel] {
    int device = 0;
    cudaGetDevice(&device);  // the exported Load visits every device; come back to ours
    load_error = cudaSuccess;
    kernel->load();
    kernel->loaded = load_error;
    cudaSetDevice(device);
  });
  if (kernel->loaded != cudaSuccess) {
    return ffi::Error::Internal(std::string(kernel->name) + ": loading the kernel failed: " +
                                cudaGetErrorString(kernel->loaded));
  }
  return ffi::Error::Success();
}

// Instantiate stage: load the cubin before any launch (outside command-buffer capture).
struct Instantiate {
  Kernel* kernel;
  ffi::Error operator()() const { return Load(kernel); }
};

// Execute stage: pass the buffers to the kernel; no allocation, no sync (capturable).
struct Execute {
  Kernel* kernel;
  ffi::Error operator()(cudaStream_t stream, ffi::RemainingArgs args,
                        ffi::RemainingRets rets) const {
    if (ffi::Error loaded = Load(kernel); loaded.failure()) return loaded;
    const size_t count = args.size() + rets.size();
    if (count != kernel->buffers) {
      return ffi::Error::InvalidArgument(std::string(kernel->name) + ": got " +
                                         std::to_string(count) + " buffers, expected " +
                                         std::to_string(kernel->buffers));
    }
    std::array<Descriptor, kMaxBuffers> descriptors;
    for (size_t i = 0; i < args.size(); ++i) {
      auto buffer = args.get<ffi::AnyBuffer>(i);
      if (buffer.has_error()) return buffer.error();
      descriptors[i] = {buffer->untyped_data(), buffer->dimensions().begin()};
    }
    for (size_t i = 0; i < rets.size(); ++i) {
      auto buffer = rets.get<ffi::AnyBuffer>(i);
      if (buffer.has_error()) return buffer.error();
      descriptors[args.size() + i] = {(*buffer)->untyped_data(), (*buffer)->dimensions().begin()};
    }
    if (int32_t status = kernel->run(stream, descriptors.data()); status != 0) {
      return ffi::Error::Internal(std::string(kernel->name) + ": launch failed with status " +
                                  std::to_string(status));
    }
    return ffi::Error::Success();
  }
};

inline auto InstantiateBinding() { return ffi::Ffi::BindInstantiate(); }
inline auto ExecuteBinding() {
  return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().RemainingArgs().RemainingRets();
}

}  // namespace k3

// The exported headers report errors through this macro; keep the first one.
#define CUTE_DSL_CUDA_ERROR_CHECK(err) k3::RecordLoadError(err)
