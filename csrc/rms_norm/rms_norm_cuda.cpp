// rms_norm_fwd and rms_norm_bwd on CUDA (ROCm: HIP) devices: argument checks, outputs, and the
// launches of rms_norm_cuda.cu on the current stream. Contract: csrc/ops.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "common/device_bindings.h"
#include "rms_norm/rms_norm_launch.h"

namespace megatron_het {
namespace {

using namespace device_bindings;

// weight: [hidden], x's dtype or float32, contiguous, on x's device.
DeviceDType check_weight(const at::Tensor& weight, const at::Tensor& x, const char* op) {
  check_device(weight, op, "weight", &x);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat,
              "megatron_het::", op, ": weight must be ", x.scalar_type(), " (like ",
              "the input) or Float, got ", weight.scalar_type());
  check_sizes(weight, {x.size(1)}, op, "weight");
  check_contiguous(weight, op, "weight");
  return float_dtype(weight, op, "weight");
}

// x: [rows, hidden] float, contiguous, on a CUDA device.
DeviceDType check_rows(const at::Tensor& x, const char* op, const char* name) {
  check_device(x, op, name);
  const DeviceDType dtype = float_dtype(x, op, name);
  check_dim(x, 2, op, name);
  check_contiguous(x, op, name);
  return dtype;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_fwd_cuda(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
    double eps) {
  const char* op = "rms_norm_fwd";
  const DeviceDType dtype = check_rows(x, op, "x");
  if (residual.has_value()) {
    check_plain(*residual, x, x.scalar_type(), x.sizes(), op, "residual");
  }
  const DeviceDType weight_dtype = check_weight(weight, x, op);

  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor sum = residual.has_value() ? at::empty(x.sizes(), x.options())
                                        : at::empty({0}, x.options());
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  if (rows == 0) {
    return {out, sum, rstd};
  }
  RmsNormFwdArgs args{};
  args.x = x.data_ptr();
  args.residual = residual.has_value() ? residual->data_ptr() : nullptr;
  args.weight = weight.data_ptr();
  args.out = out.data_ptr();
  args.sum = residual.has_value() ? sum.data_ptr() : nullptr;
  args.rstd = rstd.data_ptr<float>();
  args.rows = rows;
  args.hidden = x.size(1);
  args.eps = static_cast<float>(eps);
  args.dtype = dtype;
  args.weight_dtype = weight_dtype;
  check_launch(launch_rms_norm_fwd(args, c10::cuda::getCurrentCUDAStream().stream()), op);
  return {out, sum, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cuda(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_sum,
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& rstd,
    bool weight_grad) {
  const char* op = "rms_norm_bwd";
  const DeviceDType dtype = check_rows(input, op, "input");
  check_plain(grad_out, input, input.scalar_type(), input.sizes(), op, "grad_out");
  if (grad_sum.has_value()) {
    check_plain(*grad_sum, input, input.scalar_type(), input.sizes(), op, "grad_sum");
  }
  const DeviceDType weight_dtype = check_weight(weight, input, op);
  const int64_t rows = input.size(0);
  const int64_t hidden = input.size(1);
  check_plain(rstd, input, at::kFloat, {rows}, op, "rstd");

  const c10::cuda::CUDAGuard guard(input.device());
  const at::TensorOptions float_options = input.options().dtype(at::kFloat);
  at::Tensor grad_input = at::empty(input.sizes(), input.options());
  at::Tensor grad_weight = !weight_grad ? at::empty({0}, float_options)
                           : rows == 0  ? at::zeros({hidden}, float_options)
                                        : at::empty({hidden}, float_options);
  if (rows == 0) {
    return {grad_input, grad_weight};
  }
  RmsNormBwdArgs args{};
  args.grad_out = grad_out.data_ptr();
  args.grad_sum = grad_sum.has_value() ? grad_sum->data_ptr() : nullptr;
  args.input = input.data_ptr();
  args.weight = weight.data_ptr();
  args.rstd = rstd.data_ptr<float>();
  args.grad_input = grad_input.data_ptr();
  args.weight_grad = weight_grad;
  args.rows = rows;
  args.hidden = hidden;
  args.dtype = dtype;
  args.weight_dtype = weight_dtype;
  at::Tensor partials;  // per-block float32 sums, kept alive until the launch is queued
  if (weight_grad) {
    check_launch(rms_norm_bwd_partial_rows(args, &args.partial_rows), op);
    partials = at::empty({args.partial_rows, hidden}, float_options);
    args.partials = partials.data_ptr<float>();
    args.grad_weight = grad_weight.data_ptr<float>();
  }
  check_launch(launch_rms_norm_bwd(args, c10::cuda::getCurrentCUDAStream().stream()), op);
  return {grad_input, grad_weight};
}

}  // namespace
}  // namespace megatron_het

TORCH_LIBRARY_IMPL(megatron_het, CUDA, m) {
  m.impl("rms_norm_fwd", &megatron_het::rms_norm_fwd_cuda);
  m.impl("rms_norm_bwd", &megatron_het::rms_norm_bwd_cuda);
}
