// Plain C++ types shared by the device kernels (*_cuda.cu) and their torch bindings
// (*_cuda.cpp): the element dtype of a tensor as the launchers see it. No CUDA and no torch
// here, so every side can include it.
#pragma once

#include <cstdint>

namespace megatron_het {

// The floating dtypes the device kernels take (torch's float32, bfloat16, float16).
enum class DeviceDType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Bytes of one element of `dtype`.
inline int device_dtype_size(DeviceDType dtype) {
  return dtype == DeviceDType::kFloat32 ? 4 : 2;
}

}  // namespace megatron_het
