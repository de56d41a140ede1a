// swiglu_fwd and swiglu_bwd on CUDA (ROCm: HIP) devices: argument checks, contiguous outputs,
// and the one launch of swiglu_cuda.cu per op on the current stream. Contract: csrc/ops.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "common/device_bindings.h"
#include "swiglu/swiglu_launch.h"
#include "swiglu/swiglu_rows.h"

namespace megatron_het {
namespace {

using namespace device_bindings;

// The launch arguments of gate and up (and grad when given) after their checks.
SwigluArgs check_operands(const at::Tensor& gate, const at::Tensor& up, const at::Tensor* grad,
                          const char* op) {
  check_device(gate, op, "gate");
  SwigluArgs args{};
  args.dtype = float_dtype(gate, op, "gate");
  check_device(up, op, "up", &gate);
  swiglu::check_like_gate(up, gate, op, "up");
  const swiglu::RowView rows = swiglu::row_view(gate, op, "gate");
  args.rows = rows.rows;
  args.cols = rows.cols;
  args.gate = gate.data_ptr();
  args.gate_stride = rows.stride;
  args.up = up.data_ptr();
  args.up_stride = swiglu::row_view(up, op, "up").stride;
  if (grad != nullptr) {
    check_device(*grad, op, "grad", &gate);
    swiglu::check_like_gate(*grad, gate, op, "grad");
    args.grad = grad->data_ptr();
    args.grad_stride = swiglu::row_view(*grad, op, "grad").stride;
  }
  return args;
}

at::Tensor swiglu_fwd_cuda(const at::Tensor& gate, const at::Tensor& up) {
  const char* op = "swiglu_fwd";
  SwigluArgs args = check_operands(gate, up, nullptr, op);
  const c10::cuda::CUDAGuard guard(gate.device());
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  if (out.numel() == 0) {
    return out;
  }
  args.out = out.data_ptr();
  check_launch(launch_swiglu_fwd(args, c10::cuda::getCurrentCUDAStream().stream()), op);
  return out;
}

std::tuple<at::Tensor, at::Tensor> swiglu_bwd_cuda(const at::Tensor& grad,
                                                   const at::Tensor& gate,
                                                   const at::Tensor& up) {
  const char* op = "swiglu_bwd";
  SwigluArgs args = check_operands(gate, up, &grad, op);
  const c10::cuda::CUDAGuard guard(gate.device());
  at::Tensor grad_gate = at::empty(gate.sizes(), gate.options());
  at::Tensor grad_up = at::empty(gate.sizes(), gate.options());
  if (grad_gate.numel() == 0) {
    return {grad_gate, grad_up};
  }
  args.grad_gate = grad_gate.data_ptr();
  args.grad_up = grad_up.data_ptr();
  check_launch(launch_swiglu_bwd(args, c10::cuda::getCurrentCUDAStream().stream()), op);
  return {grad_gate, grad_up};
}

}  // namespace
}  // namespace megatron_het

TORCH_LIBRARY_IMPL(megatron_het, CUDA, m) {
  m.impl("swiglu_fwd", &megatron_het::swiglu_fwd_cuda);
  m.impl("swiglu_bwd", &megatron_het::swiglu_bwd_cuda);
}
