// RMSNorm forward and backward on CUDA (and HIP through hipify). Contract: csrc/ops.cpp.
//
// Forward: a team of threads per row (a block of 64-1024 threads, or several rows per block for
// short rows), 16-byte vector accesses where the rows are aligned. The row is read once from
// memory for its sum of squares; the second pass (normalise and scale) reads it again from
// cache, the row having just been read by the same threads.
//
// Backward: blocks loop over rows (grid sized to fill the device once), each thread keeping
// the same columns of every row, so its share of grad_weight accumulates in float32 without
// atomics: in shared memory (hidden <= 12288) or in the block's own row of the partials. A
// second kernel sums the partials' rows in a fixed order: deterministic for a given device.
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/device_convert.cuh"
#include "common/device_launch.cuh"
#include "common/device_reduce.cuh"
#include "rms_norm/rms_norm_launch.h"

namespace megatron_het {
namespace {

using device::load_vec;
using device::round_to;
using device::store_vec;
using device::SumOp;
using device::team_all_reduce;

// Largest grad_weight accumulator kept in shared memory (the default limit per block).
constexpr int64_t kMaxSharedAccBytes = 48 * 1024;
// The partials' fixed-order sum: a tile of columns x groups of partial rows per block.
constexpr int kSumColumns = 32;
constexpr int kSumGroups = 16;

template <typename T, typename W, int VEC>
__global__ void __launch_bounds__(device::kMaxTeam) rms_norm_fwd_kernel(RmsNormFwdArgs a) {
  const int64_t vectors = a.hidden / VEC;
  const W* weight = static_cast<const W*>(a.weight);
  const int64_t rows_per_step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.y; first < a.rows;
       first += rows_per_step) {
    const int64_t row = first + threadIdx.y;
    const bool active = row < a.rows;  // an idle team still joins the block's reductions
    const int64_t base = active ? row * a.hidden : 0;
    const int64_t mine = active ? vectors : 0;
    const T* x = static_cast<const T*>(a.x) + base;
    const T* residual = a.residual != nullptr ? static_cast<const T*>(a.residual) + base : nullptr;
    T* sum = residual != nullptr ? static_cast<T*>(a.sum) + base : nullptr;

    float squares = 0.0f;
    for (int64_t c = threadIdx.x; c < mine; c += blockDim.x) {
      float v[VEC];
      load_vec<VEC>(x + c * VEC, v);
      if (residual != nullptr) {
        float r[VEC];
        load_vec<VEC>(residual + c * VEC, r);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          v[i] = round_to<T>(v[i] + r[i]);
        }
        store_vec<VEC>(sum + c * VEC, v);
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        squares += v[i] * v[i];
      }
    }
    squares = team_all_reduce(squares, SumOp{});
    const float inv_rms = 1.0f / sqrtf(squares / static_cast<float>(a.hidden) + a.eps);
    if (active && threadIdx.x == 0) {
      a.rstd[row] = inv_rms;
    }
    // the normed input as stored (this thread wrote its own sum elements above)
    const T* normed = residual != nullptr ? sum : x;
    T* out = static_cast<T*>(a.out) + base;
    for (int64_t c = threadIdx.x; c < mine; c += blockDim.x) {
      float v[VEC];
      float w[VEC];
      load_vec<VEC>(normed + c * VEC, v);
      load_vec<VEC>(weight + c * VEC, w);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        v[i] = v[i] * inv_rms * w[i];
      }
      store_vec<VEC>(out + c * VEC, v);
    }
  }
}

template <typename T, typename W, int VEC>
__global__ void __launch_bounds__(device::kMaxTeam)
    rms_norm_bwd_kernel(RmsNormBwdArgs a, bool acc_in_shared) {
  extern __shared__ float shared_acc[];
  const int64_t vectors = a.hidden / VEC;
  float* acc = nullptr;
  if (a.weight_grad) {
    acc = acc_in_shared ? shared_acc : a.partials + static_cast<int64_t>(blockIdx.x) * a.hidden;
    for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        acc[c * VEC + i] = 0.0f;
      }
    }
  }
  const W* weight = static_cast<const W*>(a.weight);
  // every thread of the block takes the same rows (blockDim.y == 1): the loop is uniform
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const int64_t base = row * a.hidden;
    const T* grad_out = static_cast<const T*>(a.grad_out) + base;
    const T* input = static_cast<const T*>(a.input) + base;
    const float rstd = a.rstd[row];
    float dot = 0.0f;  // sum over the row of (weight * grad) * normed
    for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) {
      float g[VEC];
      float s[VEC];
      float w[VEC];
      load_vec<VEC>(grad_out + c * VEC, g);
      load_vec<VEC>(input + c * VEC, s);
      load_vec<VEC>(weight + c * VEC, w);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        dot += (w[i] * g[i]) * (s[i] * rstd);
      }
    }
    dot = team_all_reduce(dot, SumOp{});
    const float mean = dot / static_cast<float>(a.hidden);
    const T* grad_sum =
        a.grad_sum != nullptr ? static_cast<const T*>(a.grad_sum) + base : nullptr;
    T* grad_input = static_cast<T*>(a.grad_input) + base;
    for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) {
      float g[VEC];
      float s[VEC];
      float w[VEC];
      float o[VEC];
      load_vec<VEC>(grad_out + c * VEC, g);
      load_vec<VEC>(input + c * VEC, s);
      load_vec<VEC>(weight + c * VEC, w);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float normed = s[i] * rstd;
        o[i] = (w[i] * g[i] - normed * mean) * rstd;
        s[i] = g[i] * normed;  // this row's term of grad_weight
      }
      if (grad_sum != nullptr) {
        float extra[VEC];
        load_vec<VEC>(grad_sum + c * VEC, extra);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          o[i] += extra[i];
        }
      }
      store_vec<VEC>(grad_input + c * VEC, o);
      if (acc != nullptr) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          acc[c * VEC + i] += s[i];
        }
      }
    }
  }
  if (acc != nullptr && acc_in_shared) {
    float* partial = a.partials + static_cast<int64_t>(blockIdx.x) * a.hidden;
    for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        partial[c * VEC + i] = acc[c * VEC + i];
      }
    }
  }
}

// grad_weight[j] = sum over the partials' rows of partials[b, j]: thread (x, y) sums rows
// y, y + kSumGroups, ... of column x of the tile, then row y == 0 adds the groups in order.
__global__ void rms_norm_sum_partials_kernel(const float* partials, int64_t partial_rows,
                                             int64_t hidden, float* grad_weight) {
  __shared__ float group_sums[kSumGroups][kSumColumns];
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kSumColumns + threadIdx.x;
  float total = 0.0f;
  if (j < hidden) {
    for (int64_t b = threadIdx.y; b < partial_rows; b += kSumGroups) {
      total += partials[b * hidden + j];
    }
  }
  group_sums[threadIdx.y][threadIdx.x] = total;
  __syncthreads();
  if (threadIdx.y == 0 && j < hidden) {
    float sum = 0.0f;
    for (int g = 0; g < kSumGroups; ++g) {
      sum += group_sums[g][threadIdx.x];
    }
    grad_weight[j] = sum;
  }
}

// fn(TypeTag<T>, TypeTag<W>, integral_constant<int, VEC>) for the element and weight dtypes,
// VEC the 16-byte vector width of T when `vectorised`, else 1.
template <typename Fn>
void with_norm_types(DeviceDType dtype, DeviceDType weight_dtype, bool vectorised, Fn&& fn) {
  device::with_device_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = static_cast<int>(16 / sizeof(T));
    auto with_weight = [&](auto weight_tag) {
      if (vectorised) {
        fn(tag, weight_tag, std::integral_constant<int, kVec>{});
      } else {
        fn(tag, weight_tag, std::integral_constant<int, 1>{});
      }
    };
    if (weight_dtype == DeviceDType::kFloat32) {
      with_weight(device::TypeTag<float>{});
    } else {
      with_weight(tag);
    }
  });
}

int vector_width(DeviceDType dtype) { return 16 / device_dtype_size(dtype); }

bool fwd_vectorised(const RmsNormFwdArgs& a) {
  return a.hidden % vector_width(a.dtype) == 0 && device::aligned16(a.x) &&
         device::aligned16(a.weight) && device::aligned16(a.out) &&
         (a.residual == nullptr || (device::aligned16(a.residual) && device::aligned16(a.sum)));
}

bool bwd_vectorised(const RmsNormBwdArgs& a) {
  return a.hidden % vector_width(a.dtype) == 0 && device::aligned16(a.grad_out) &&
         device::aligned16(a.input) && device::aligned16(a.weight) &&
         device::aligned16(a.grad_input) &&
         (a.grad_sum == nullptr || device::aligned16(a.grad_sum));
}

struct BwdShape {
  int team = 0;
  bool acc_in_shared = false;
  size_t shared_bytes = 0;
  unsigned int blocks = 0;
};

template <typename T, typename W, int VEC>
cudaError_t bwd_shape(const RmsNormBwdArgs& a, BwdShape* shape) {
  shape->team = device::team_threads(a.hidden / VEC);
  const int64_t acc_bytes = a.hidden * static_cast<int64_t>(sizeof(float));
  shape->acc_in_shared = a.weight_grad && acc_bytes <= kMaxSharedAccBytes;
  shape->shared_bytes = shape->acc_in_shared ? static_cast<size_t>(acc_bytes) : 0;
  int multiprocessors = 0;
  cudaError_t err = device::multiprocessor_count(&multiprocessors);
  if (err != cudaSuccess) {
    return err;
  }
  int per_multiprocessor = 0;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_multiprocessor, rms_norm_bwd_kernel<T, W, VEC>, shape->team, shape->shared_bytes);
  if (err != cudaSuccess) {
    return err;
  }
  const int64_t resident =
      static_cast<int64_t>(multiprocessors) * (per_multiprocessor > 0 ? per_multiprocessor : 1);
  shape->blocks = device::blocks_for(a.rows < resident ? a.rows : resident, 1);
  return cudaSuccess;
}

template <typename T, typename W, int VEC>
cudaError_t fwd_launch(const RmsNormFwdArgs& a, cudaStream_t stream) {
  const int team = device::team_threads(a.hidden / VEC);
  const int rows_per_block = device::teams_per_block(team);
  const dim3 block(team, rows_per_block);
  const dim3 grid(device::blocks_for(a.rows, rows_per_block));
  rms_norm_fwd_kernel<T, W, VEC><<<grid, block, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, typename W, int VEC>
cudaError_t bwd_launch(const RmsNormBwdArgs& a, cudaStream_t stream) {
  BwdShape shape;
  cudaError_t err = bwd_shape<T, W, VEC>(a, &shape);
  if (err != cudaSuccess) {
    return err;
  }
  // with a weight gradient, one block per partial row the caller allocated
  const unsigned int blocks =
      a.weight_grad ? device::blocks_for(a.partial_rows, 1) : shape.blocks;
  rms_norm_bwd_kernel<T, W, VEC>
      <<<blocks, shape.team, shape.shared_bytes, stream>>>(a, shape.acc_in_shared);
  err = cudaGetLastError();
  if (err != cudaSuccess || !a.weight_grad || a.hidden == 0) {
    return err;
  }
  const dim3 block(kSumColumns, kSumGroups);
  const dim3 grid(device::blocks_for(a.hidden, kSumColumns));
  rms_norm_sum_partials_kernel<<<grid, block, 0, stream>>>(a.partials, blocks, a.hidden,
                                                           a.grad_weight);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_rms_norm_fwd(const RmsNormFwdArgs& args, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  with_norm_types(args.dtype, args.weight_dtype, fwd_vectorised(args),
                  [&](auto tag, auto weight_tag, auto vec) {
                    using T = typename decltype(tag)::type;
                    using W = typename decltype(weight_tag)::type;
                    err = fwd_launch<T, W, decltype(vec)::value>(args, stream);
                  });
  return err;
}

cudaError_t rms_norm_bwd_partial_rows(const RmsNormBwdArgs& args, int64_t* partial_rows) {
  cudaError_t err = cudaSuccess;
  with_norm_types(args.dtype, args.weight_dtype, bwd_vectorised(args),
                  [&](auto tag, auto weight_tag, auto vec) {
                    using T = typename decltype(tag)::type;
                    using W = typename decltype(weight_tag)::type;
                    BwdShape shape;
                    err = bwd_shape<T, W, decltype(vec)::value>(args, &shape);
                    *partial_rows = shape.blocks;
                  });
  return err;
}

cudaError_t launch_rms_norm_bwd(const RmsNormBwdArgs& args, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  with_norm_types(args.dtype, args.weight_dtype, bwd_vectorised(args),
                  [&](auto tag, auto weight_tag, auto vec) {
                    using T = typename decltype(tag)::type;
                    using W = typename decltype(weight_tag)::type;
                    err = bwd_launch<T, W, decltype(vec)::value>(args, stream);
                  });
  return err;
}

}  // namespace megatron_het
