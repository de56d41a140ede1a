// The device launchers of rms_norm_fwd / rms_norm_bwd (rms_norm_cuda.cu), called by the torch
// bindings (rms_norm_cuda.cpp) on the current stream. Pointers are device memory of contiguous
// tensors; the bindings have checked shapes and dtypes (see csrc/ops.cpp for the contract).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/device_types.h"

namespace megatron_het {

struct RmsNormFwdArgs {
  const void* x;         // [rows, hidden], dtype
  const void* residual;  // [rows, hidden], dtype, or null
  const void* weight;    // [hidden], weight_dtype (dtype or float32)
  void* out;             // [rows, hidden], dtype
  void* sum;             // [rows, hidden], dtype: x + residual; null without a residual
  float* rstd;           // [rows]
  int64_t rows;
  int64_t hidden;
  float eps;
  DeviceDType dtype;
  DeviceDType weight_dtype;
};

// One launch; the launch's error (cudaSuccess when it started).
cudaError_t launch_rms_norm_fwd(const RmsNormFwdArgs& args, cudaStream_t stream);

struct RmsNormBwdArgs {
  const void* grad_out;  // [rows, hidden], dtype
  const void* grad_sum;  // [rows, hidden], dtype, or null
  const void* input;     // [rows, hidden], dtype: the normed input of the forward
  const void* weight;    // [hidden], weight_dtype
  const float* rstd;     // [rows]
  void* grad_input;      // [rows, hidden], dtype
  // With weight_grad: partials [partial_rows, hidden] float32 is scratch the caller allocates
  // (partial_rows from rms_norm_bwd_partial_rows), grad_weight [hidden] float32 the result;
  // the three are unused without.
  bool weight_grad;
  int64_t partial_rows;
  float* partials;
  float* grad_weight;
  int64_t rows;
  int64_t hidden;
  DeviceDType dtype;
  DeviceDType weight_dtype;
};

// Rows of the float32 partials the bwd needs for `args` (every field set but the three of the
// weight gradient): one per block of its launch on the current device, at least 1.
cudaError_t rms_norm_bwd_partial_rows(const RmsNormBwdArgs& args, int64_t* partial_rows);

// Two launches with a weight gradient (rows, then the fixed-order sum of the partials), else
// one.
cudaError_t launch_rms_norm_bwd(const RmsNormBwdArgs& args, cudaStream_t stream);

}  // namespace megatron_het
