// Element types of the device kernels and their float32 conversions, for CUDA and (through
// hipify) HIP alike.
//
// bfloat16 is our own 16-bit storage type, converted with bit operations: HIP 5.x has no
// hip_bf16.h, and one definition keeps both vendors' rounding identical to torch's
// (round-to-nearest-even, NaN -> 0x7FC0). float16 uses the vendors' __half and their
// round-to-nearest conversions. Every kernel computes in float32 and rounds each output once.
//
// Vector access: load_vec / store_vec move N consecutive elements with 16-byte memory
// operations (the widest both vendors issue); the caller guarantees 16-byte alignment, or
// passes N == 1 for the scalar path.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/device_types.h"

namespace megatron_het {
namespace device {

// bfloat16 storage: the high half of a float32's bits.
struct alignas(2) BF16 {
  uint16_t bits;
};

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(BF16 v) {
  return __uint_as_float(static_cast<uint32_t>(v.bits) << 16);
}

template <typename T>
struct Rounding;

template <>
struct Rounding<float> {
  __device__ __forceinline__ static float from_float(float v) { return v; }
};

template <>
struct Rounding<__half> {
  __device__ __forceinline__ static __half from_float(float v) { return __float2half_rn(v); }
};

template <>
struct Rounding<BF16> {
  __device__ __forceinline__ static BF16 from_float(float v) {
    uint32_t bits = __float_as_uint(v);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
      return BF16{static_cast<uint16_t>(0x7fc0u)};  // NaN: torch's quiet NaN
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);  // ties to the even bfloat16
    return BF16{static_cast<uint16_t>(bits >> 16)};
  }
};

// v rounded once to T.
template <typename T>
__device__ __forceinline__ T from_float(float v) {
  return Rounding<T>::from_float(v);
}

// v rounded to T and back: the value a T tensor would hold.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}

// N elements at p as floats. N == 1, or N * sizeof(T) a multiple of 16 with p 16-byte aligned.
template <int N, typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[N]) {
  if constexpr (N == 1) {
    out[0] = to_float(p[0]);
  } else {
    static_assert((N * sizeof(T)) % 16 == 0, "vector access moves whole 16-byte chunks");
    constexpr int kChunks = static_cast<int>(N * sizeof(T) / 16);
    alignas(16) T buf[N];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      reinterpret_cast<uint4*>(buf)[c] = reinterpret_cast<const uint4*>(p)[c];
    }
#pragma unroll
    for (int i = 0; i < N; ++i) {
      out[i] = to_float(buf[i]);
    }
  }
}

// in[0..N) rounded to T and stored at p (same alignment rule as load_vec).
template <int N, typename T>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[N]) {
  if constexpr (N == 1) {
    p[0] = from_float<T>(in[0]);
  } else {
    static_assert((N * sizeof(T)) % 16 == 0, "vector access moves whole 16-byte chunks");
    constexpr int kChunks = static_cast<int>(N * sizeof(T) / 16);
    alignas(16) T buf[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      buf[i] = from_float<T>(in[i]);
    }
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      reinterpret_cast<uint4*>(p)[c] = reinterpret_cast<const uint4*>(buf)[c];
    }
  }
}

// Host side: the storage type of a DeviceDType, handed to a generic launcher as a tag.
template <typename T>
struct TypeTag {
  using type = T;
};

// fn(TypeTag<float | BF16 | __half>{}) for `dtype`.
template <typename Fn>
void with_device_type(DeviceDType dtype, Fn&& fn) {
  switch (dtype) {
    case DeviceDType::kFloat32:
      fn(TypeTag<float>{});
      break;
    case DeviceDType::kBFloat16:
      fn(TypeTag<BF16>{});
      break;
    case DeviceDType::kFloat16:
      fn(TypeTag<__half>{});
      break;
  }
}

}  // namespace device
}  // namespace megatron_het
