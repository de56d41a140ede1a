// Argument checks of the device ops' torch bindings (*_cuda.cpp), in the contract's message
// style ("megatron_het::rms_norm_fwd: x must be float32, bfloat16 or float16, got Long"), and
// the launchers' view of a tensor's dtype. The Python wrappers check first; these are the
// second line, for direct calls of torch.ops.megatron_het.*.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>

#include "common/device_types.h"
#include "common/op_checks.h"

namespace megatron_het::device_bindings {

// The launchers' dtype of a float32, bfloat16 or float16 tensor; any other is an error.
inline DeviceDType float_dtype(const at::Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DeviceDType::kFloat32;
    case at::kBFloat16:
      return DeviceDType::kBFloat16;
    case at::kHalf:
      return DeviceDType::kFloat16;
    default:
      TORCH_CHECK(false, "megatron_het::", op, ": ", name,
                  " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

// `t` is on a CUDA (ROCm: HIP) device, the one of `like` when given.
inline void check_device(const at::Tensor& t, const char* op, const char* name,
                         const at::Tensor* like = nullptr) {
  TORCH_CHECK(t.is_cuda(), "megatron_het::", op, ": ", name,
              " must be on a CUDA device like the other arguments, got ", t.device());
  if (like != nullptr) {
    TORCH_CHECK(t.device() == like->device(), "megatron_het::", op, ": ", name,
                " must be on ", like->device(), " like the other arguments, got ", t.device());
  }
}

using checks::check_contiguous;
using checks::check_dtype;
using checks::check_sizes;

inline void check_dim(const at::Tensor& t, int64_t dim, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == dim, "megatron_het::", op, ": ", name, " must have ", dim,
              " dimensions, got ", t.dim());
}

// On `like`'s device, of `dtype` and shape `sizes`, contiguous: the common case.
inline void check_plain(const at::Tensor& t, const at::Tensor& like, at::ScalarType dtype,
                        c10::IntArrayRef sizes, const char* op, const char* name) {
  check_device(t, op, name, &like);
  check_dtype(t, dtype, op, name);
  check_sizes(t, sizes, op, name);
  check_contiguous(t, op, name);
}

// A launcher's error, if any, as a one-line error naming the op.
inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "megatron_het::", op, ": kernel launch failed: ",
              cudaGetErrorString(err));
}

}  // namespace megatron_het::device_bindings
