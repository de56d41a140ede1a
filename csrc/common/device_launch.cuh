// Host-side launch shapes shared by the device kernels: team and block sizes, alignment tests
// and the device's multiprocessor count.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/device_reduce.cuh"

namespace megatron_het {
namespace device {

constexpr int kMaxTeam = 1024;
// Threads a block holds at least when its teams are small (several rows per block).
constexpr int kMinBlockThreads = 256;
// Threads of a flat (one item per thread) launch.
constexpr int kFlatBlockThreads = 256;

// v limited to [low, high]. (Not std::clamp: hipify rewrites std:: math in device sources.)
inline int64_t clamp_to(int64_t v, int64_t low, int64_t high) {
  return v < low ? low : (v > high ? high : v);
}

// Threads of the team that works on one row of `vectors` vector loads: one load each where
// possible, in whole kTeamGranule groups, 64 to 1024.
inline int team_threads(int64_t vectors) {
  const int64_t rounded = (vectors + kTeamGranule - 1) / kTeamGranule * kTeamGranule;
  return static_cast<int>(clamp_to(rounded, kTeamGranule, kMaxTeam));
}

// Rows (teams) per block for teams of `team` threads.
inline int teams_per_block(int team) {
  return static_cast<int>(clamp_to(kMinBlockThreads / team, 1, kMinBlockThreads));
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Blocks of one launch for `items` items of `per_block` each; at least one.
inline unsigned int blocks_for(int64_t items, int64_t per_block) {
  const int64_t blocks = (items + per_block - 1) / per_block;
  return static_cast<unsigned int>(clamp_to(blocks, 1, 0x7fffffff));
}

// The current device's multiprocessor count (compute units on AMD).
inline cudaError_t multiprocessor_count(int* count) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) {
    return err;
  }
  return cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, device);
}

}  // namespace device
}  // namespace megatron_het
