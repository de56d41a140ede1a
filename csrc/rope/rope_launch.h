// The device launcher of rope_fwd (rope_cuda.cu), called by its torch binding (rope_cuda.cpp)
// on the current stream. See csrc/ops.cpp for the contract.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/device_types.h"

namespace megatron_het {

// One 5-D input [B, S, G, R, D] (any strides, the last 1) and its contiguous output.
struct RopeTensor {
  const void* in;
  void* out;
  int64_t sizes[4];    // B, S, G, R
  int64_t strides[4];  // in elements, of B, S, G, R
};

struct RopeArgs {
  RopeTensor q;
  RopeTensor k;  // k.in == nullptr: no k (sizes all 0)
  const float* cos;  // [P, D/2] float32, contiguous
  const float* sin;
  int64_t head_dim;  // D, even
  int64_t offset;    // position of sequence index 0
  bool inverse;
  DeviceDType dtype;
};

// One launch over q's rows then k's; the launch's error.
cudaError_t launch_rope_fwd(const RopeArgs& args, cudaStream_t stream);

}  // namespace megatron_het
