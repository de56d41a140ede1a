// The device launchers of cross_entropy_stats, cross_entropy_grad_ and cross_entropy_fused_
// (cross_entropy_cuda.cu), called by their torch bindings (cross_entropy_cuda.cpp) on the
// current stream. See csrc/ops.cpp for the contract.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/device_types.h"

namespace megatron_het {

struct CrossEntropyArgs {
  void* logits;           // [rows, vocab] dtype, row stride `row_stride` elements, columns dense
  const int64_t* labels;  // [rows] token ids; column = label - vocab_start
  int64_t rows;
  int64_t vocab;
  int64_t row_stride;
  int64_t vocab_start;
  // stats: outputs [rows] float32 each
  float* max;
  float* sum_exp;
  float* target;
  // grad_ (lse input) and fused_ (loss output): [rows] float32; scale [rows] or null for 1
  const float* lse;
  const float* scale;
  float* loss;
  DeviceDType dtype;
};

// Each is one launch; the launch's error.
cudaError_t launch_cross_entropy_stats(const CrossEntropyArgs& args, cudaStream_t stream);
cudaError_t launch_cross_entropy_grad(const CrossEntropyArgs& args, cudaStream_t stream);
cudaError_t launch_cross_entropy_fused(const CrossEntropyArgs& args, cudaStream_t stream);

}  // namespace megatron_het
