// silu(gate) * up and its backward on CUDA (and HIP through hipify). Contract: csrc/ops.cpp.
//
// A flat launch over (row, chunk of VEC columns): each thread loads VEC elements of every
// input with 16-byte accesses where every row start is aligned (else VEC = 1), computes in
// float32 and stores each output once. silu is recomputed from gate in the backward. Index
// arithmetic is 32-bit where the launch is small enough (a division by the chunks per row is
// the costliest part of the index math).
#include <cuda_runtime.h>

#include <cstdint>

#include "common/device_convert.cuh"
#include "common/device_launch.cuh"
#include "swiglu/swiglu_launch.h"

namespace megatron_het {
namespace {

using device::load_vec;
using device::store_vec;

// silu(g) and its slope without overflow: with e = exp(-|g|) and r = 1 / (1 + e), sigmoid(g)
// is r for g >= 0 and e * r below. |g| * e is 0 where e underflows, which gives the limits at
// g = +-inf (value +inf / -0, slope 1 / 0); NaN passes through. (The CPU kernel's formula.)
__device__ __forceinline__ void silu_of(float g, float* value, float* slope) {
  const float a = fabsf(g);
  const float e = expf(-a);
  const float r = 1.0f / (1.0f + e);
  const float ae = e == 0.0f ? 0.0f : a * e;
  if (g >= 0.0f) {
    *value = g * r;
    *slope = r * (1.0f + ae * r);
  } else {  // and NaN
    *value = -ae * r;
    *slope = r * (e - ae * r);
  }
}

template <typename T, int VEC, typename I>
__global__ void swiglu_fwd_kernel(SwigluArgs a, I items, I chunks) {
  const I step = static_cast<I>(gridDim.x) * static_cast<I>(blockDim.x);
  for (I item = static_cast<I>(blockIdx.x) * static_cast<I>(blockDim.x) + threadIdx.x;
       item < items; item += step) {
    const I row = item / chunks;
    const int64_t j = static_cast<int64_t>(item - row * chunks) * VEC;
    const int64_t r = static_cast<int64_t>(row);
    float g[VEC];
    float u[VEC];
    load_vec<VEC>(static_cast<const T*>(a.gate) + r * a.gate_stride + j, g);
    load_vec<VEC>(static_cast<const T*>(a.up) + r * a.up_stride + j, u);
    float out[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      float value, slope;
      silu_of(g[i], &value, &slope);
      out[i] = value * u[i];
    }
    store_vec<VEC>(static_cast<T*>(a.out) + r * a.cols + j, out);
  }
}

template <typename T, int VEC, typename I>
__global__ void swiglu_bwd_kernel(SwigluArgs a, I items, I chunks) {
  const I step = static_cast<I>(gridDim.x) * static_cast<I>(blockDim.x);
  for (I item = static_cast<I>(blockIdx.x) * static_cast<I>(blockDim.x) + threadIdx.x;
       item < items; item += step) {
    const I row = item / chunks;
    const int64_t j = static_cast<int64_t>(item - row * chunks) * VEC;
    const int64_t r = static_cast<int64_t>(row);
    float d[VEC];
    float g[VEC];
    float u[VEC];
    load_vec<VEC>(static_cast<const T*>(a.grad) + r * a.grad_stride + j, d);
    load_vec<VEC>(static_cast<const T*>(a.gate) + r * a.gate_stride + j, g);
    load_vec<VEC>(static_cast<const T*>(a.up) + r * a.up_stride + j, u);
    float grad_gate[VEC];
    float grad_up[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      float value, slope;
      silu_of(g[i], &value, &slope);
      grad_gate[i] = d[i] * u[i] * slope;
      grad_up[i] = d[i] * value;
    }
    store_vec<VEC>(static_cast<T*>(a.grad_gate) + r * a.cols + j, grad_gate);
    store_vec<VEC>(static_cast<T*>(a.grad_up) + r * a.cols + j, grad_up);
  }
}

// Every row of a pointer with row stride `stride` starts 16-byte aligned for `vec` elements.
bool rows_aligned(const void* p, int64_t stride, int64_t rows, int64_t vec) {
  return p == nullptr || (device::aligned16(p) && (rows <= 1 || stride % vec == 0));
}

template <bool kBackward, typename T, int VEC, typename I>
cudaError_t launch_items(const SwigluArgs& a, int64_t items, int64_t chunks, cudaStream_t stream) {
  const unsigned int grid = device::blocks_for(items, device::kFlatBlockThreads);
  if constexpr (kBackward) {
    swiglu_bwd_kernel<T, VEC, I><<<grid, device::kFlatBlockThreads, 0, stream>>>(
        a, static_cast<I>(items), static_cast<I>(chunks));
  } else {
    swiglu_fwd_kernel<T, VEC, I><<<grid, device::kFlatBlockThreads, 0, stream>>>(
        a, static_cast<I>(items), static_cast<I>(chunks));
  }
  return cudaGetLastError();
}

template <bool kBackward, typename T, int VEC>
cudaError_t launch_sized(const SwigluArgs& a, cudaStream_t stream) {
  const int64_t chunks = a.cols / VEC;
  const int64_t items = a.rows * chunks;
  if (items == 0) {
    return cudaSuccess;
  }
  // 32-bit indices while an item index plus the grid's stride stays below 2^32
  if (items < (int64_t{1} << 31)) {
    return launch_items<kBackward, T, VEC, uint32_t>(a, items, chunks, stream);
  }
  return launch_items<kBackward, T, VEC, uint64_t>(a, items, chunks, stream);
}

template <bool kBackward>
cudaError_t launch(const SwigluArgs& a, cudaStream_t stream) {
  const int64_t vec = 16 / device_dtype_size(a.dtype);
  const void* outs[2] = {kBackward ? a.grad_gate : a.out, kBackward ? a.grad_up : nullptr};
  bool vectorised = a.cols % vec == 0 && rows_aligned(a.gate, a.gate_stride, a.rows, vec) &&
                    rows_aligned(a.up, a.up_stride, a.rows, vec) &&
                    rows_aligned(outs[0], a.cols, a.rows, vec) &&
                    rows_aligned(outs[1], a.cols, a.rows, vec);
  if (kBackward) {
    vectorised = vectorised && rows_aligned(a.grad, a.grad_stride, a.rows, vec);
  }
  cudaError_t err = cudaSuccess;
  device::with_device_type(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = static_cast<int>(16 / sizeof(T));
    err = vectorised ? launch_sized<kBackward, T, kVec>(a, stream)
                     : launch_sized<kBackward, T, 1>(a, stream);
  });
  return err;
}

}  // namespace

cudaError_t launch_swiglu_fwd(const SwigluArgs& args, cudaStream_t stream) {
  return launch<false>(args, stream);
}

cudaError_t launch_swiglu_bwd(const SwigluArgs& args, cudaStream_t stream) {
  return launch<true>(args, stream);
}

}  // namespace megatron_het
