// rope_fwd on CUDA (ROCm: HIP) devices: argument checks, contiguous outputs, and the one launch
// of rope_cuda.cu (q and k together) on the current stream. Contract: csrc/ops.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "common/device_bindings.h"
#include "rope/rope_launch.h"

namespace megatron_het {
namespace {

using namespace device_bindings;

// t: 5-D [B, S, *, *, D] of q's dtype and device, last stride 1.
void check_heads(const at::Tensor& t, const at::Tensor& q, const char* op, const char* name) {
  check_device(t, op, name, &q);
  check_dtype(t, q.scalar_type(), op, name);
  check_dim(t, 5, op, name);
  TORCH_CHECK(t.size(0) == q.size(0) && t.size(1) == q.size(1) && t.size(4) == q.size(4),
              "megatron_het::", op, ": ", name, " must have q's batch, sequence and head ",
              "dimension [", q.size(0), ", ", q.size(1), ", *, *, ", q.size(4), "], got ",
              t.sizes());
  TORCH_CHECK(t.size(4) <= 1 || t.stride(4) == 1, "megatron_het::", op, ": ", name,
              " must have stride 1 in its last dimension, got ", t.stride(4));
}

RopeTensor view_of(const at::Tensor& in, at::Tensor& out) {
  RopeTensor t{};
  t.in = in.data_ptr();
  t.out = out.data_ptr();
  for (int d = 0; d < 4; ++d) {
    t.sizes[d] = in.size(d);
    t.strides[d] = in.stride(d);
  }
  return t;
}

std::tuple<at::Tensor, at::Tensor> rope_fwd_cuda(const at::Tensor& q,
                                                 const std::optional<at::Tensor>& k,
                                                 const at::Tensor& cos, const at::Tensor& sin,
                                                 int64_t offset, bool inverse) {
  const char* op = "rope_fwd";
  check_device(q, op, "q");
  const DeviceDType dtype = float_dtype(q, op, "q");
  check_heads(q, q, op, "q");
  const int64_t head_dim = q.size(4);
  TORCH_CHECK(head_dim % 2 == 0, "megatron_het::", op, ": the head dimension must be even, got ",
              head_dim);
  if (k.has_value()) {
    check_heads(*k, q, op, "k");
  }
  TORCH_CHECK(offset >= 0, "megatron_het::", op, ": offset must be >= 0, got ", offset);
  check_device(cos, op, "cos", &q);
  check_dtype(cos, at::kFloat, op, "cos");
  check_dim(cos, 2, op, "cos");
  TORCH_CHECK(cos.size(1) == head_dim / 2, "megatron_het::", op, ": cos must have ",
              head_dim / 2, " columns (half the head dimension), got ", cos.size(1));
  check_contiguous(cos, op, "cos");
  check_plain(sin, q, at::kFloat, cos.sizes(), op, "sin");
  TORCH_CHECK(cos.size(0) >= offset + q.size(1), "megatron_het::", op, ": the tables have ",
              cos.size(0), " positions, fewer than offset + sequence = ", offset + q.size(1));

  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor q_out = at::empty(q.sizes(), q.options());
  at::Tensor k_out =
      k.has_value() ? at::empty(k->sizes(), k->options()) : at::empty({0}, q.options());
  if (q.numel() == 0 && k_out.numel() == 0) {
    return {q_out, k_out};
  }
  RopeArgs args{};
  if (q.numel() > 0) {
    args.q = view_of(q, q_out);
  }
  if (k.has_value() && k->numel() > 0) {
    args.k = view_of(*k, k_out);
  }
  args.cos = cos.data_ptr<float>();
  args.sin = sin.data_ptr<float>();
  args.head_dim = head_dim;
  args.offset = offset;
  args.inverse = inverse;
  args.dtype = dtype;
  check_launch(launch_rope_fwd(args, c10::cuda::getCurrentCUDAStream().stream()), op);
  return {q_out, k_out};
}

}  // namespace
}  // namespace megatron_het

TORCH_LIBRARY_IMPL(megatron_het, CUDA, m) { m.impl("rope_fwd", &megatron_het::rope_fwd_cuda); }
