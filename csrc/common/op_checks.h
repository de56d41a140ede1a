// Argument checks shared by the CPU and the device registrations of the ops, in the message
// style of csrc/ops.cpp ("megatron_het::<op>: <argument> must ..."). Needs only ATen's tensor
// header, so the host code of either side can include it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace megatron_het::checks {

inline void check_contiguous(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_contiguous(), "megatron_het::", op, ": ", name,
              " must be contiguous (call .contiguous() first)");
}

inline void check_dtype(const at::Tensor& t, at::ScalarType dtype, const char* op,
                        const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype, "megatron_het::", op, ": ", name, " must be ", dtype,
              ", got ", t.scalar_type());
}

inline void check_sizes(const at::Tensor& t, c10::IntArrayRef sizes, const char* op,
                        const char* name) {
  TORCH_CHECK(t.sizes() == sizes, "megatron_het::", op, ": ", name, " must have shape ", sizes,
              ", got ", t.sizes());
}

}  // namespace megatron_het::checks
