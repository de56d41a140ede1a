// CPU implementations of rms_norm_fwd and rms_norm_bwd (schemas and contract: csrc/ops.cpp).
//
// Rows run in parallel (at::parallel_for, chunks of >= kGrainElements elements). Each row is
// read from memory once: its sum of squares (or dot product) pass leaves it in L1/L2, where
// the second pass that writes the output finds it. The loops are plain code vectorised per ISA
// variant (common/cpu_dispatch.h); all arithmetic is float32 and each output is rounded once.
//
// grad_weight is deterministic whatever the thread count: rows are cut into blocks whose size
// depends only on N and H, each block adds its rows in order into its own float32 partial row,
// and the partial rows are added in block order.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "common/cpu_dispatch.h"

namespace megatron_het::cpu {
namespace {

constexpr const char* kFwd = "rms_norm_fwd";
constexpr const char* kBwd = "rms_norm_bwd";

// At most this many partial grad_weight rows ([blocks, H] float32), so their memory and final
// sum stay small next to the [N, H] input; also the most threads the weight gradient can use.
constexpr int64_t kMaxWeightBlocks = 128;

// ---- forward ----

struct FwdArgs {
  const void* x;
  const void* residual;  // null: s = x
  const void* weight;
  void* out;
  void* sum;  // written when residual is given
  float* rstd;
  int64_t hidden;
  float eps;
};

template <class T, class W>
MH_INLINE void fwd_rows(const FwdArgs& a, int64_t begin, int64_t end) {
  using S = typename T::storage;
  const int64_t h = a.hidden;
  const auto* __restrict w = static_cast<const typename W::storage*>(a.weight);
  for (int64_t i = begin; i < end; ++i) {
    const S* __restrict x = static_cast<const S*>(a.x) + i * h;
    const S* s = x;
    float squares;
    if (a.residual != nullptr) {
      const S* __restrict r = static_cast<const S*>(a.residual) + i * h;
      S* __restrict sum = static_cast<S*>(a.sum) + i * h;
      squares = blocked_sum(h, [&](int64_t j) __attribute__((always_inline)) {
        sum[j] = T::store(T::load(x[j]) + T::load(r[j]));
        const float v = T::load(sum[j]);
        return v * v;
      });
      s = sum;
    } else {
      squares = blocked_sum(h, [&](int64_t j) __attribute__((always_inline)) {
        const float v = T::load(x[j]);
        return v * v;
      });
    }
    const float rstd = 1.0f / std::sqrt(squares / float(h) + a.eps);
    a.rstd[i] = rstd;
    S* __restrict out = static_cast<S*>(a.out) + i * h;
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) out[j] = T::store(T::load(s[j]) * rstd * W::load(w[j]));
  }
}
MH_CPU_ISA_VARIANTS(fwd_rows, FwdArgs)

// ---- backward ----

struct BwdArgs {
  const void* grad_out;
  const void* grad_sum;  // may be null
  const void* input;
  const void* weight;
  const float* rstd;
  void* grad_input;
  float* partial;  // [blocks, hidden] grad_weight partial sums, or null without weight_grad
  int64_t hidden;
  int64_t rows;
  int64_t rows_per_block;
};

// grad_input of row i, and (kPartial) its g * n added into part.
template <class T, class W, bool kGradSum, bool kPartial>
MH_INLINE void bwd_row(const BwdArgs& a, int64_t i, float* __restrict part) {
  using S = typename T::storage;
  const int64_t h = a.hidden;
  const auto* __restrict w = static_cast<const typename W::storage*>(a.weight);
  const S* __restrict g = static_cast<const S*>(a.grad_out) + i * h;
  const S* __restrict x = static_cast<const S*>(a.input) + i * h;
  const S* __restrict gs = kGradSum ? static_cast<const S*>(a.grad_sum) + i * h : nullptr;
  S* __restrict gi = static_cast<S*>(a.grad_input) + i * h;
  const float rstd = a.rstd[i];
  const float dot = blocked_sum(h, [&](int64_t j) __attribute__((always_inline)) {
    return W::load(w[j]) * T::load(g[j]) * (T::load(x[j]) * rstd);
  });
  const float mean = dot / float(h);
#pragma omp simd
  for (int64_t j = 0; j < h; ++j) {
    const float gj = T::load(g[j]);
    const float nj = T::load(x[j]) * rstd;
    float v = (W::load(w[j]) * gj - nj * mean) * rstd;
    if constexpr (kGradSum) v += T::load(gs[j]);
    gi[j] = T::store(v);
    if constexpr (kPartial) part[j] += gj * nj;
  }
}

template <class T, class W>
MH_INLINE void bwd_blocks(const BwdArgs& a, int64_t block_begin, int64_t block_end) {
  const int64_t h = a.hidden;
  for (int64_t b = block_begin; b < block_end; ++b) {
    float* __restrict part = a.partial == nullptr ? nullptr : a.partial + b * h;
    if (part != nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < h; ++j) part[j] = 0.0f;
    }
    const int64_t row_begin = b * a.rows_per_block;
    const int64_t row_end = std::min(a.rows, row_begin + a.rows_per_block);
    for (int64_t i = row_begin; i < row_end; ++i) {
      if (a.grad_sum != nullptr) {
        part != nullptr ? bwd_row<T, W, true, true>(a, i, part)
                        : bwd_row<T, W, true, false>(a, i, part);
      } else {
        part != nullptr ? bwd_row<T, W, false, true>(a, i, part)
                        : bwd_row<T, W, false, false>(a, i, part);
      }
    }
  }
}
MH_CPU_ISA_VARIANTS(bwd_blocks, BwdArgs)

struct ColumnSumArgs {
  const float* partial;  // [blocks, hidden]
  float* out;            // [hidden]
  int64_t blocks;
  int64_t hidden;
};

// out[j] = sum over blocks of partial[b, j], in block order, for j in [begin, end).
template <class = void>
MH_INLINE void column_sums(const ColumnSumArgs& a, int64_t begin, int64_t end) {
  float* __restrict out = a.out;
#pragma omp simd
  for (int64_t j = begin; j < end; ++j) out[j] = a.partial[j];
  for (int64_t b = 1; b < a.blocks; ++b) {
    const float* __restrict row = a.partial + b * a.hidden;
#pragma omp simd
    for (int64_t j = begin; j < end; ++j) out[j] += row[j];
  }
}
MH_CPU_ISA_VARIANTS(column_sums, ColumnSumArgs)

// ---- ops ----

void check_weight(const at::Tensor& weight, const at::Tensor& x, const char* op) {
  check_cpu(weight, op, "weight");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat,
              "megatron_het::", op, ": weight must be ", x.scalar_type(), " or Float, got ",
              weight.scalar_type());
  check_sizes(weight, {x.size(1)}, op, "weight");
  check_contiguous(weight, op, "weight");
}

void check_rows(const at::Tensor& x, const char* op, const char* name) {
  check_cpu(x, op, name);
  TORCH_CHECK(x.dim() == 2, "megatron_het::", op, ": ", name, " must be 2-D [N, H], got shape ",
              x.sizes());
  check_contiguous(x, op, name);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_fwd_cpu(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
    double eps) {
  check_rows(x, kFwd, "x");
  const bool has_residual = residual.has_value() && residual->defined();
  if (has_residual) check_plain(*residual, x.scalar_type(), x.sizes(), kFwd, "residual");
  check_weight(weight, x, kFwd);
  const int64_t n = x.size(0), h = x.size(1);
  at::Tensor out = at::empty_like(x);
  at::Tensor sum = has_residual ? at::empty_like(x) : at::empty({0}, x.options());
  at::Tensor rstd = at::empty({n}, x.options().dtype(at::kFloat));
  with_float_type(x, kFwd, "x", [&](auto tag) {
    using T = decltype(tag);
    if (n == 0) return;
    const FwdArgs args{x.data_ptr(),   has_residual ? residual->data_ptr() : nullptr,
                       weight.data_ptr(), out.data_ptr(),
                       sum.data_ptr(), rstd.data_ptr<float>(),
                       h,              static_cast<float>(eps)};
    const Isa isa = host_isa();
    const auto rows = weight.scalar_type() == at::kFloat ? fwd_rows_for<T, F32>(isa)
                                                         : fwd_rows_for<T, T>(isa);
    at::parallel_for(0, n, grain_items(h), [&](int64_t b, int64_t e) { rows(args, b, e); });
  });
  return {out, sum, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cpu(const at::Tensor& grad_out,
                                                    const std::optional<at::Tensor>& grad_sum,
                                                    const at::Tensor& input,
                                                    const at::Tensor& weight,
                                                    const at::Tensor& rstd, bool weight_grad) {
  check_rows(input, kBwd, "input");
  check_plain(grad_out, input.scalar_type(), input.sizes(), kBwd, "grad_out");
  const bool has_grad_sum = grad_sum.has_value() && grad_sum->defined();
  if (has_grad_sum) check_plain(*grad_sum, input.scalar_type(), input.sizes(), kBwd, "grad_sum");
  check_weight(weight, input, kBwd);
  const int64_t n = input.size(0), h = input.size(1);
  check_plain(rstd, at::kFloat, {n}, kBwd, "rstd");
  const auto f32 = input.options().dtype(at::kFloat);
  at::Tensor grad_input = at::empty_like(input);
  at::Tensor grad_weight = weight_grad ? at::zeros({h}, f32) : at::empty({0}, f32);
  with_float_type(input, kBwd, "input", [&](auto tag) {
    using T = decltype(tag);
    if (n == 0) return;
    // Blocks depend on N and H only, never on the thread count (determinism, see top).
    int64_t rows_per_block = grain_items(h);
    if (weight_grad) {
      rows_per_block = std::max(rows_per_block, (n + kMaxWeightBlocks - 1) / kMaxWeightBlocks);
    }
    const int64_t blocks = (n + rows_per_block - 1) / rows_per_block;
    at::Tensor partial = weight_grad ? at::empty({blocks, h}, f32) : at::Tensor();
    const BwdArgs args{grad_out.data_ptr(),
                       has_grad_sum ? grad_sum->data_ptr() : nullptr,
                       input.data_ptr(),
                       weight.data_ptr(),
                       rstd.data_ptr<float>(),
                       grad_input.data_ptr(),
                       weight_grad ? partial.data_ptr<float>() : nullptr,
                       h,
                       n,
                       rows_per_block};
    const Isa isa = host_isa();
    const auto run = weight.scalar_type() == at::kFloat ? bwd_blocks_for<T, F32>(isa)
                                                        : bwd_blocks_for<T, T>(isa);
    at::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) { run(args, b, e); });
    if (!weight_grad) return;
    const ColumnSumArgs sums{partial.data_ptr<float>(), grad_weight.data_ptr<float>(), blocks, h};
    const auto add = column_sums_for<>(isa);
    at::parallel_for(0, h, grain_items(blocks), [&](int64_t b, int64_t e) { add(sums, b, e); });
  });
  return {grad_input, grad_weight};
}

}  // namespace
}  // namespace megatron_het::cpu

TORCH_LIBRARY_IMPL(megatron_het, CPU, m) {
  m.impl("rms_norm_fwd", &megatron_het::cpu::rms_norm_fwd_cpu);
  m.impl("rms_norm_bwd", &megatron_het::cpu::rms_norm_bwd_cpu);
}
