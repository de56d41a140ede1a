// Reductions over a row's team of threads, for CUDA (32-lane warps) and HIP (64-lane wavefronts).
//
// A block is blockDim.y teams of blockDim.x threads, team y working on one row; blockDim.x is a
// multiple of 64 (kTeamGranule), so a team is whole warps on either vendor. A team reduction
// combines within each warp by xor-shuffles (every lane ends with the same value), then across
// the team's warps
// through shared memory in warp order. The order is fixed by the launch shape alone, so results
// are deterministic. Every thread of the block must call a team reduction (a thread without
// work passes the identity): with several warps a team synchronises the whole block.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

namespace megatron_het {
namespace device {

// Team sizes are multiples of this: one AMD wavefront, two NVIDIA warps.
constexpr int kTeamGranule = 64;
// Shared-memory slots of one block's reduction: its warps, 1024 threads / 32 lanes at most.
constexpr int kMaxWarpsPerBlock = 32;

__device__ __forceinline__ float shuffle_xor(float v, int lane_mask) {
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIP_PLATFORM_HCC__)
  return __shfl_xor(v, lane_mask);
#else
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
#endif
}

__device__ __forceinline__ float shuffle_from(float v, int lane) {
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIP_PLATFORM_HCC__)
  return __shfl(v, lane);
#else
  return __shfl_sync(0xffffffffu, v, lane);
#endif
}

struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

// Running maximum and sum of exp(value - maximum) of a set of logits; {-inf, 0} is empty.
struct MaxSumExp {
  float max;
  float sum;
};

__device__ __forceinline__ MaxSumExp combine(MaxSumExp a, MaxSumExp b) {
  const float m = fmaxf(a.max, b.max);
  if (m == -INFINITY) {
    return {m, 0.0f};  // both empty (or all -inf): exp(-inf - -inf) would be NaN
  }
  return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

// Adds the N values v to a running MaxSumExp: one rescale per vector, one exp per value.
template <int N>
__device__ __forceinline__ void accumulate(MaxSumExp& acc, const float (&v)[N]) {
  float vmax = v[0];
#pragma unroll
  for (int i = 1; i < N; ++i) {
    vmax = fmaxf(vmax, v[i]);
  }
  if (vmax > acc.max) {
    acc.sum *= expf(acc.max - vmax);  // exp(-inf) = 0 for the first values
    acc.max = vmax;
  }
  if (acc.max != -INFINITY) {  // else every value so far is -inf and adds nothing
#pragma unroll
    for (int i = 0; i < N; ++i) {
      acc.sum += expf(v[i] - acc.max);
    }
  }
}

template <typename Op>
__device__ __forceinline__ float warp_all_reduce(float v, Op op) {
  for (int mask = warpSize / 2; mask > 0; mask >>= 1) {
    v = op(v, shuffle_xor(v, mask));
  }
  return v;
}

__device__ __forceinline__ MaxSumExp warp_all_reduce(MaxSumExp v) {
  for (int mask = warpSize / 2; mask > 0; mask >>= 1) {
    const MaxSumExp other{shuffle_xor(v.max, mask), shuffle_xor(v.sum, mask)};
    v = combine(v, other);
  }
  // lane 0's result for all: a contracted multiply-add may round combine(a, b) and
  // combine(b, a) differently, so the lanes of a shuffle pair can differ in the last bit
  return {shuffle_from(v.max, 0), shuffle_from(v.sum, 0)};
}

// The team's reduction of v, returned to every thread of the team (see the file comment).
template <typename Op>
__device__ __forceinline__ float team_all_reduce(float v, Op op) {
  __shared__ float slots[kMaxWarpsPerBlock];
  v = warp_all_reduce(v, op);
  const int warps = static_cast<int>(blockDim.x) / warpSize;
  if (warps == 1) {
    return v;
  }
  float* team = slots + threadIdx.y * warps;
  const int lane = static_cast<int>(threadIdx.x) % warpSize;
  const int warp = static_cast<int>(threadIdx.x) / warpSize;
  __syncthreads();  // the slots may still be read by the previous reduction
  if (lane == 0) {
    team[warp] = v;
  }
  __syncthreads();
  float total = team[0];
  for (int w = 1; w < warps; ++w) {
    total = op(total, team[w]);
  }
  return total;
}

__device__ __forceinline__ MaxSumExp team_all_reduce(MaxSumExp v) {
  __shared__ float max_slots[kMaxWarpsPerBlock];
  __shared__ float sum_slots[kMaxWarpsPerBlock];
  v = warp_all_reduce(v);
  const int warps = static_cast<int>(blockDim.x) / warpSize;
  if (warps == 1) {
    return v;
  }
  const int first = static_cast<int>(threadIdx.y) * warps;
  const int lane = static_cast<int>(threadIdx.x) % warpSize;
  const int warp = static_cast<int>(threadIdx.x) / warpSize;
  __syncthreads();
  if (lane == 0) {
    max_slots[first + warp] = v.max;
    sum_slots[first + warp] = v.sum;
  }
  __syncthreads();
  MaxSumExp total{max_slots[first], sum_slots[first]};
  for (int w = 1; w < warps; ++w) {
    total = combine(total, MaxSumExp{max_slots[first + w], sum_slots[first + w]});
  }
  return total;
}

}  // namespace device
}  // namespace megatron_het
