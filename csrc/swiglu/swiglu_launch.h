// The device launchers of swiglu_fwd / swiglu_bwd (swiglu_cuda.cu), called by their torch
// bindings (swiglu_cuda.cpp) on the current stream. Inputs are rows [rows, cols] read through a
// row stride (stride 1 along cols); outputs are contiguous [rows, cols]. The bindings have
// checked shapes and dtypes (see csrc/ops.cpp for the contract).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/device_types.h"

namespace megatron_het {

struct SwigluArgs {
  const void* gate;
  const void* up;
  const void* grad;  // bwd only
  void* out;         // fwd: silu(gate) * up
  void* grad_gate;   // bwd
  void* grad_up;     // bwd
  int64_t rows;
  int64_t cols;
  int64_t gate_stride;  // elements between rows
  int64_t up_stride;
  int64_t grad_stride;
  DeviceDType dtype;
};

// Each is one launch; the launch's error (cudaSuccess for an empty input).
cudaError_t launch_swiglu_fwd(const SwigluArgs& args, cudaStream_t stream);
cudaError_t launch_swiglu_bwd(const SwigluArgs& args, cudaStream_t stream);

}  // namespace megatron_het
