// cross_entropy_stats, cross_entropy_grad_ and cross_entropy_fused_ on CUDA (ROCm: HIP)
// devices: argument checks, outputs, and the launches of cross_entropy_cuda.cu on the current
// stream. Contract: csrc/ops.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "common/device_bindings.h"
#include "cross_entropy/cross_entropy_launch.h"

namespace megatron_het {
namespace {

using namespace device_bindings;

// logits [N, V] float with dense columns and rows that do not overlap; labels int64 [N]. The
// launch arguments of both.
CrossEntropyArgs check_logits(const at::Tensor& logits, const at::Tensor& labels,
                              int64_t vocab_start, const char* op) {
  check_device(logits, op, "logits");
  const DeviceDType dtype = float_dtype(logits, op, "logits");
  check_dim(logits, 2, op, "logits");
  const int64_t rows = logits.size(0);
  const int64_t vocab = logits.size(1);
  TORCH_CHECK(vocab <= 1 || logits.stride(1) == 1, "megatron_het::", op,
              ": logits must have stride 1 in its last dimension, got ", logits.stride(1));
  TORCH_CHECK(rows <= 1 || logits.stride(0) >= vocab, "megatron_het::", op,
              ": logits rows must not overlap (row stride ", logits.stride(0), " < ", vocab,
              " columns)");
  check_plain(labels, logits, at::kLong, {rows}, op, "labels");
  CrossEntropyArgs args{};
  args.logits = logits.data_ptr();
  args.labels = labels.data_ptr<int64_t>();
  args.rows = rows;
  args.vocab = vocab;
  args.row_stride = logits.stride(0);
  args.vocab_start = vocab_start;
  args.dtype = dtype;
  return args;
}

const float* optional_scale(const std::optional<at::Tensor>& scale, const at::Tensor& logits,
                            const char* op) {
  if (!scale.has_value()) {
    return nullptr;
  }
  check_plain(*scale, logits, at::kFloat, {logits.size(0)}, op, "scale");
  return scale->data_ptr<float>();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_entropy_stats_cuda(
    const at::Tensor& logits, const at::Tensor& labels, int64_t vocab_start) {
  const char* op = "cross_entropy_stats";
  CrossEntropyArgs args = check_logits(logits, labels, vocab_start, op);
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::TensorOptions float_options = logits.options().dtype(at::kFloat);
  at::Tensor max = at::empty({args.rows}, float_options);
  at::Tensor sum_exp = at::empty({args.rows}, float_options);
  at::Tensor target = at::empty({args.rows}, float_options);
  if (args.rows == 0) {
    return {max, sum_exp, target};
  }
  args.max = max.data_ptr<float>();
  args.sum_exp = sum_exp.data_ptr<float>();
  args.target = target.data_ptr<float>();
  check_launch(launch_cross_entropy_stats(args, c10::cuda::getCurrentCUDAStream().stream()), op);
  return {max, sum_exp, target};
}

void cross_entropy_grad_cuda(const at::Tensor& logits, const at::Tensor& labels,
                             int64_t vocab_start, const at::Tensor& lse,
                             const std::optional<at::Tensor>& scale) {
  const char* op = "cross_entropy_grad_";
  CrossEntropyArgs args = check_logits(logits, labels, vocab_start, op);
  check_plain(lse, logits, at::kFloat, {args.rows}, op, "lse");
  args.scale = optional_scale(scale, logits, op);
  args.lse = lse.data_ptr<float>();
  if (args.rows == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(logits.device());
  check_launch(launch_cross_entropy_grad(args, c10::cuda::getCurrentCUDAStream().stream()), op);
}

at::Tensor cross_entropy_fused_cuda(const at::Tensor& logits, const at::Tensor& labels,
                                    int64_t vocab_start, const std::optional<at::Tensor>& scale) {
  const char* op = "cross_entropy_fused_";
  CrossEntropyArgs args = check_logits(logits, labels, vocab_start, op);
  args.scale = optional_scale(scale, logits, op);
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor loss = at::empty({args.rows}, logits.options().dtype(at::kFloat));
  if (args.rows == 0) {
    return loss;
  }
  args.loss = loss.data_ptr<float>();
  check_launch(launch_cross_entropy_fused(args, c10::cuda::getCurrentCUDAStream().stream()), op);
  return loss;
}

}  // namespace
}  // namespace megatron_het

TORCH_LIBRARY_IMPL(megatron_het, CUDA, m) {
  m.impl("cross_entropy_stats", &megatron_het::cross_entropy_stats_cuda);
  m.impl("cross_entropy_grad_", &megatron_het::cross_entropy_grad_cuda);
  m.impl("cross_entropy_fused_", &megatron_het::cross_entropy_fused_cuda);
}
