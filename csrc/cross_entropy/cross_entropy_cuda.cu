// Softmax cross-entropy over a (vocabulary-shard) logits chunk on CUDA (and HIP through
// hipify): statistics, gradient in place, and both fused. Contract: csrc/ops.cpp.
//
// A team of threads per row (rows of a short vocabulary share a block), 16-byte vector loads
// where the row starts are aligned, then a scalar tail. The statistics read the row once:
// each thread keeps a running (max, sum of exp(x - max)) rescaled when its max grows, and the
// team combines them in a fixed order. The fused op then reads the row a second time (mostly
// from cache) to write the gradient.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common/device_convert.cuh"
#include "common/device_launch.cuh"
#include "common/device_reduce.cuh"
#include "cross_entropy/cross_entropy_launch.h"

namespace megatron_het {
namespace {

using device::accumulate;
using device::load_vec;
using device::MaxSumExp;
using device::store_vec;
using device::team_all_reduce;
using device::to_float;

enum class Mode { kStats, kGrad, kFused };

// The team's (max, sum of exp) of row[0, vocab): `vectors` = vocab / VEC vectors, then the
// scalar tail. Every thread of the block calls it (an idle team with vocab 0).
template <typename T, int VEC>
__device__ __forceinline__ MaxSumExp row_stats(const T* row, int64_t vocab) {
  const int64_t vectors = vocab / VEC;
  MaxSumExp acc{-INFINITY, 0.0f};
  for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) {
    float v[VEC];
    load_vec<VEC>(row + c * VEC, v);
    accumulate(acc, v);
  }
  for (int64_t j = vectors * VEC + threadIdx.x; j < vocab; j += blockDim.x) {
    const float v[1] = {to_float(row[j])};
    accumulate(acc, v);
  }
  return team_all_reduce(acc);
}

// row[j] <- (exp(row[j] - lse) - (j == column)) * scale over row[0, vocab), in place.
template <typename T, int VEC>
__device__ __forceinline__ void row_grad(T* row, int64_t vocab, int64_t column, float lse,
                                         float scale) {
  const int64_t vectors = vocab / VEC;
  for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) {
    float v[VEC];
    load_vec<VEC>(row + c * VEC, v);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float p = expf(v[i] - lse);
      v[i] = (c * VEC + i == column ? p - 1.0f : p) * scale;
    }
    store_vec<VEC>(row + c * VEC, v);
  }
  for (int64_t j = vectors * VEC + threadIdx.x; j < vocab; j += blockDim.x) {
    float v[1] = {to_float(row[j])};
    const float p = expf(v[0] - lse);
    v[0] = (j == column ? p - 1.0f : p) * scale;
    store_vec<1>(row + j, v);
  }
}

template <typename T, int VEC, Mode kMode>
__global__ void __launch_bounds__(device::kMaxTeam) cross_entropy_kernel(CrossEntropyArgs a) {
  const int64_t rows_per_step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.y; first < a.rows;
       first += rows_per_step) {
    const int64_t row = first + threadIdx.y;
    const bool active = row < a.rows;  // an idle team still joins the block's reductions
    T* logits = static_cast<T*>(a.logits) + (active ? row * a.row_stride : 0);
    const int64_t vocab = active ? a.vocab : 0;
    const int64_t column = active ? a.labels[row] - a.vocab_start : -1;
    const bool in_shard = column >= 0 && column < vocab;
    if constexpr (kMode == Mode::kGrad) {
      const float lse = active ? a.lse[row] : 0.0f;
      const float scale = active && a.scale != nullptr ? a.scale[row] : 1.0f;
      row_grad<T, VEC>(logits, vocab, column, lse, scale);
    } else {
      // the label's logit, read before any thread of the team overwrites the row
      const float target = threadIdx.x == 0 && in_shard ? to_float(logits[column]) : 0.0f;
      const MaxSumExp stats = row_stats<T, VEC>(logits, vocab);
      const float log_sum = logf(stats.sum);
      if constexpr (kMode == Mode::kStats) {
        if (active && threadIdx.x == 0) {
          a.max[row] = stats.max;
          a.sum_exp[row] = stats.sum;
          a.target[row] = target;
        }
      } else {
        if (active && threadIdx.x == 0) {
          a.loss[row] = log_sum + stats.max - target;
        }
        __syncthreads();  // thread 0's read of the label's logit precedes the writes below
        const float scale = active && a.scale != nullptr ? a.scale[row] : 1.0f;
        row_grad<T, VEC>(logits, vocab, column, stats.max + log_sum, scale);
      }
    }
  }
}

template <typename T, int VEC, Mode kMode>
cudaError_t launch(const CrossEntropyArgs& a, cudaStream_t stream) {
  const int team = device::team_threads((a.vocab + VEC - 1) / VEC);
  const int rows_per_block = device::teams_per_block(team);
  const dim3 block(team, rows_per_block);
  const dim3 grid(device::blocks_for(a.rows, rows_per_block));
  cross_entropy_kernel<T, VEC, kMode><<<grid, block, 0, stream>>>(a);
  return cudaGetLastError();
}

template <Mode kMode>
cudaError_t launch_mode(const CrossEntropyArgs& a, cudaStream_t stream) {
  if (a.rows == 0) {
    return cudaSuccess;
  }
  const int64_t vec = 16 / device_dtype_size(a.dtype);
  // every row start aligned (a single row's stride does not matter)
  const bool vectorised =
      device::aligned16(a.logits) && (a.rows == 1 || a.row_stride % vec == 0);
  cudaError_t err = cudaSuccess;
  device::with_device_type(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = static_cast<int>(16 / sizeof(T));
    err = vectorised ? launch<T, kVec, kMode>(a, stream) : launch<T, 1, kMode>(a, stream);
  });
  return err;
}

}  // namespace

cudaError_t launch_cross_entropy_stats(const CrossEntropyArgs& args, cudaStream_t stream) {
  return launch_mode<Mode::kStats>(args, stream);
}

cudaError_t launch_cross_entropy_grad(const CrossEntropyArgs& args, cudaStream_t stream) {
  return launch_mode<Mode::kGrad>(args, stream);
}

cudaError_t launch_cross_entropy_fused(const CrossEntropyArgs& args, cudaStream_t stream) {
  return launch_mode<Mode::kFused>(args, stream);
}

}  // namespace megatron_het
