// Rotary embedding (rotate-half) of q and k on CUDA (and HIP through hipify), in one launch.
// Contract: csrc/ops.cpp.
//
// A flat launch over (row, chunk of pairs): the grid covers q's rows and then k's, each
// thread rotating VEC pairs (j, j + D/2) of one row with 16-byte accesses where every row start
// is aligned, else one pair. Inputs are strided views (the normal case is a slice of a fused
// qkv projection); the outputs are contiguous. Index arithmetic is 32-bit where the launch is
// small enough, the divisions by the view's sizes being the costliest part of the index math.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/device_convert.cuh"
#include "common/device_launch.cuh"
#include "rope/rope_launch.h"

namespace megatron_het {
namespace {

using device::load_vec;
using device::store_vec;

template <typename T, int VEC, typename I>
__device__ __forceinline__ void rotate_chunk(const RopeTensor& t, I row, I chunk, const RopeArgs& a,
                                             I half, float sign) {
  const I r = row % static_cast<I>(t.sizes[3]);
  I rest = row / static_cast<I>(t.sizes[3]);
  const I g = rest % static_cast<I>(t.sizes[2]);
  rest /= static_cast<I>(t.sizes[2]);
  const I s = rest % static_cast<I>(t.sizes[1]);
  const I b = rest / static_cast<I>(t.sizes[1]);
  const int64_t in_offset = static_cast<int64_t>(b) * t.strides[0] +
                            static_cast<int64_t>(s) * t.strides[1] +
                            static_cast<int64_t>(g) * t.strides[2] +
                            static_cast<int64_t>(r) * t.strides[3];
  const T* in = static_cast<const T*>(t.in) + in_offset;
  T* out = static_cast<T*>(t.out) + static_cast<int64_t>(row) * 2 * static_cast<int64_t>(half);
  const I j = chunk * VEC;
  const int64_t table = (a.offset + static_cast<int64_t>(s)) * static_cast<int64_t>(half) + j;
  float x1[VEC];
  float x2[VEC];
  float cosine[VEC];
  float sine[VEC];
  load_vec<VEC>(in + j, x1);
  load_vec<VEC>(in + j + half, x2);
  load_vec<VEC>(a.cos + table, cosine);
  load_vec<VEC>(a.sin + table, sine);
  float lo[VEC];
  float hi[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    lo[i] = x1[i] * cosine[i] - sign * x2[i] * sine[i];
    hi[i] = x2[i] * cosine[i] + sign * x1[i] * sine[i];
  }
  store_vec<VEC>(out + j, lo);
  store_vec<VEC>(out + j + half, hi);
}

template <typename T, int VEC, typename I>
__global__ void rope_kernel(RopeArgs a, I q_rows, I items, I chunks) {
  const I half = static_cast<I>(a.head_dim / 2);
  const float sign = a.inverse ? -1.0f : 1.0f;
  const I step = static_cast<I>(gridDim.x) * static_cast<I>(blockDim.x);
  for (I item = static_cast<I>(blockIdx.x) * static_cast<I>(blockDim.x) + threadIdx.x;
       item < items; item += step) {
    const I row = item / chunks;
    const I chunk = item - row * chunks;
    if (row < q_rows) {
      rotate_chunk<T, VEC, I>(a.q, row, chunk, a, half, sign);
    } else {
      rotate_chunk<T, VEC, I>(a.k, row - q_rows, chunk, a, half, sign);
    }
  }
}

int64_t rows_of(const RopeTensor& t) {
  return t.in == nullptr ? 0 : t.sizes[0] * t.sizes[1] * t.sizes[2] * t.sizes[3];
}

// Every row start of t (and of its output) is 16-byte aligned for vectors of `vec` elements.
bool rows_aligned(const RopeTensor& t, int64_t vec) {
  if (t.in == nullptr) {
    return true;
  }
  if (!device::aligned16(t.in) || !device::aligned16(t.out)) {
    return false;
  }
  for (int d = 0; d < 4; ++d) {
    if (t.sizes[d] != 1 && t.strides[d] % vec != 0) {
      return false;
    }
  }
  return true;
}

template <typename T, int VEC, typename I>
cudaError_t rope_launch(const RopeArgs& a, int64_t q_rows, int64_t items, int64_t chunks,
                        cudaStream_t stream) {
  const unsigned int grid = device::blocks_for(items, device::kFlatBlockThreads);
  rope_kernel<T, VEC, I><<<grid, device::kFlatBlockThreads, 0, stream>>>(
      a, static_cast<I>(q_rows), static_cast<I>(items), static_cast<I>(chunks));
  return cudaGetLastError();
}

template <typename T, int VEC>
cudaError_t rope_launch_sized(const RopeArgs& a, cudaStream_t stream) {
  const int64_t q_rows = rows_of(a.q);
  const int64_t chunks = a.head_dim / 2 / VEC;
  const int64_t items = (q_rows + rows_of(a.k)) * chunks;
  if (items == 0) {
    return cudaSuccess;
  }
  // 32-bit indices while an item index plus the grid's stride stays below 2^32
  if (items < (int64_t{1} << 31)) {
    return rope_launch<T, VEC, uint32_t>(a, q_rows, items, chunks, stream);
  }
  return rope_launch<T, VEC, uint64_t>(a, q_rows, items, chunks, stream);
}

}  // namespace

cudaError_t launch_rope_fwd(const RopeArgs& args, cudaStream_t stream) {
  const int64_t vec = 16 / device_dtype_size(args.dtype);
  const bool vectorised = (args.head_dim / 2) % vec == 0 && device::aligned16(args.cos) &&
                          device::aligned16(args.sin) && rows_aligned(args.q, vec) &&
                          rows_aligned(args.k, vec);
  cudaError_t err = cudaSuccess;
  device::with_device_type(args.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = static_cast<int>(16 / sizeof(T));
    err = vectorised ? rope_launch_sized<T, kVec>(args, stream)
                     : rope_launch_sized<T, 1>(args, stream);
  });
  return err;
}

}  // namespace megatron_het
