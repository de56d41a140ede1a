// How swiglu_fwd and swiglu_bwd read their operands, shared by the CPU and the device
// registrations: a tensor [..., F] as rows [N, F] with stride 1 along F and one stride between
// rows. That covers contiguous tensors and column slices of one (gate and up as the two halves
// of a fused [N, 2F] projection); any other layout is refused with a one-line message, as the
// other ops refuse what they do not read (the Python wrapper copies such tensors first).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

#include "common/op_checks.h"

namespace megatron_het::swiglu {

struct RowView {
  int64_t rows;    // N: the product of the leading dimensions
  int64_t cols;    // F
  int64_t stride;  // elements from one row to the next
};

// t's rows; an error naming `op` and `name` where t cannot be read so.
inline RowView row_view(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.dim() >= 1, "megatron_het::", op, ": ", name,
              " must have a last dimension [..., F], got a 0-d tensor");
  const int64_t cols = t.size(-1);
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  RowView view{rows, cols, cols};
  if (rows == 0 || cols == 0) return view;
  TORCH_CHECK(cols == 1 || t.stride(-1) == 1, "megatron_het::", op, ": ", name,
              " must have stride 1 in its last dimension, got strides ", t.strides(),
              " (call .contiguous() first)");
  // From the innermost leading dimension out, each (of size > 1) must step over all the rows
  // inside it: then one stride, that of the innermost, walks every row.
  int64_t spanned = -1;
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (spanned < 0) {
      view.stride = t.stride(d);
    } else {
      TORCH_CHECK(t.stride(d) == spanned, "megatron_het::", op, ": ", name,
                  " must be rows [N, F] with one stride between rows (a contiguous tensor or "
                  "a slice of one along F), got shape ",
                  t.sizes(), " and strides ", t.strides(), " (call .contiguous() first)");
    }
    spanned = t.stride(d) * t.size(d);
  }
  return view;
}

// `t` has gate's dtype and shape (its device is checked by the caller's registration).
inline void check_like_gate(const at::Tensor& t, const at::Tensor& gate, const char* op,
                            const char* name) {
  checks::check_dtype(t, gate.scalar_type(), op, name);
  TORCH_CHECK(t.sizes() == gate.sizes(), "megatron_het::", op, ": ", name,
              " must have gate's shape ", gate.sizes(), ", got ", t.sizes());
}

}  // namespace megatron_het::swiglu
