// CPU implementations of cross_entropy_stats, cross_entropy_grad_ and cross_entropy_fused_
// (schemas and contract: csrc/ops.cpp).
//
// Rows run in parallel. The statistics read a row once from memory: blocks of kStatsBlock
// logits (in L1) give a block max, then the block's sum of exp(logit - block max), and the
// running (max, sum) pair is rescaled to the larger max (the online softmax, per block rather
// than per element, so one exp per logit). The gradient reads and writes each logit once,
// evaluating exp again from the exchanged statistics; the fused op, which holds whole rows,
// keeps its exps in a scratch row instead (one exp per logit in all). exp is the vectorisable
// exp_f32 of common/cpu_vec.h; arithmetic is float32 and each written logit is rounded once.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "common/cpu_dispatch.h"

namespace megatron_het::cpu {
namespace {

constexpr const char* kStats = "cross_entropy_stats";
constexpr const char* kGrad = "cross_entropy_grad_";
constexpr const char* kFused = "cross_entropy_fused_";

// 8 KiB of float32 logits: a block is read from memory by the max pass and found in L1 by
// the sum pass.
constexpr int64_t kStatsBlock = 2048;

struct Rows {
  void* logits;  // [N, V], row stride `stride`, column stride 1
  const int64_t* labels;
  int64_t vocab_start;
  int64_t vocab;
  int64_t stride;
};

// The label's column in this chunk, or -1 when it lies outside [vocab_start, vocab_start + V).
MH_INLINE int64_t label_column(const Rows& r, int64_t i) {
  const int64_t t = r.labels[i] - r.vocab_start;
  return t >= 0 && t < r.vocab ? t : -1;
}

struct RowStats {
  float max;
  float sum_exp;
};

template <class T>
MH_INLINE RowStats row_stats(const typename T::storage* __restrict x, int64_t vocab) {
  float max = -kInf, sum = 0.0f;
  for (int64_t begin = 0; begin < vocab; begin += kStatsBlock) {
    const int64_t end = vocab - begin < kStatsBlock ? vocab : begin + kStatsBlock;
    float block_max = -kInf;
#pragma omp simd reduction(max : block_max)
    for (int64_t j = begin; j < end; ++j) {
      const float v = T::load(x[j]);
      block_max = v > block_max ? v : block_max;
    }
    // A block of -inf only: shift by 0 so that its terms are exp(-inf) = 0, not NaN.
    const float shift = block_max == -kInf ? 0.0f : block_max;
    float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
    for (int64_t j = begin; j < end; ++j) block_sum += exp_f32(T::load(x[j]) - shift);
    const float new_max = block_max > max ? block_max : max;
    if (new_max == -kInf) {
      sum += block_sum;  // 0, or NaN from a NaN logit
      continue;
    }
    sum = sum * exp_f32(max - new_max) + block_sum * exp_f32(shift - new_max);
    max = new_max;
  }
  return {max, sum};
}

// x[j] <- round((exp(x[j] - shift) * prob_mul - [j == t]) * scale): the softmax gradient with
// probabilities exp(x - shift) * prob_mul (shift = lse and prob_mul = 1, or shift = max and
// prob_mul = 1 / sum_exp).
template <class T>
MH_INLINE void write_grad_row(typename T::storage* __restrict x, int64_t vocab, int64_t t,
                              float shift, float prob_mul, float scale) {
  const float target_logit = t >= 0 ? T::load(x[t]) : 0.0f;
  const float mul = prob_mul * scale;
#pragma omp simd
  for (int64_t j = 0; j < vocab; ++j) x[j] = T::store(exp_f32(T::load(x[j]) - shift) * mul);
  if (t >= 0) x[t] = T::store((exp_f32(target_logit - shift) * prob_mul - 1.0f) * scale);
}

// ---- cross_entropy_stats ----

struct StatsArgs {
  Rows rows;
  float* max;
  float* sum_exp;
  float* target;
};

template <class T>
MH_INLINE void stats_rows(const StatsArgs& a, int64_t begin, int64_t end) {
  using S = typename T::storage;
  for (int64_t i = begin; i < end; ++i) {
    const S* x = static_cast<const S*>(a.rows.logits) + i * a.rows.stride;
    const RowStats st = row_stats<T>(x, a.rows.vocab);
    const int64_t t = label_column(a.rows, i);
    a.max[i] = st.max;
    a.sum_exp[i] = st.sum_exp;
    a.target[i] = t >= 0 ? T::load(x[t]) : 0.0f;
  }
}
MH_CPU_ISA_VARIANTS(stats_rows, StatsArgs)

// ---- cross_entropy_grad_ ----

struct GradArgs {
  Rows rows;
  const float* lse;
  const float* scale;  // may be null: 1
};

template <class T>
MH_INLINE void grad_rows(const GradArgs& a, int64_t begin, int64_t end) {
  using S = typename T::storage;
  for (int64_t i = begin; i < end; ++i) {
    S* x = static_cast<S*>(a.rows.logits) + i * a.rows.stride;
    const float scale = a.scale == nullptr ? 1.0f : a.scale[i];
    write_grad_row<T>(x, a.rows.vocab, label_column(a.rows, i), a.lse[i], 1.0f, scale);
  }
}
MH_CPU_ISA_VARIANTS(grad_rows, GradArgs)

// ---- cross_entropy_fused_ ----

// The fused op holds the whole row, so it evaluates exp once per logit: a max pass reads the
// row from memory, a second pass writes exp(logit - max) to a float32 scratch row of the
// thread's (the logit row and the scratch stay in L2 for vocabularies up to ~64k) and sums it,
// and the third scales the scratch into the gradient, written over the logits.
struct FusedArgs {
  Rows rows;
  const float* scale;  // may be null: 1
  float* loss;
  float* scratch;      // [vocab] float32, the calling chunk's own
};

template <class T>
MH_INLINE float row_max(const typename T::storage* __restrict x, int64_t vocab) {
  float max = -kInf;
#pragma omp simd reduction(max : max)
  for (int64_t j = 0; j < vocab; ++j) {
    const float v = T::load(x[j]);
    max = v > max ? v : max;
  }
  return max;
}

template <class T>
MH_INLINE void fused_rows(const FusedArgs& a, int64_t begin, int64_t end) {
  using S = typename T::storage;
  const int64_t vocab = a.rows.vocab;
  float* __restrict e = a.scratch;
  for (int64_t i = begin; i < end; ++i) {
    S* __restrict x = static_cast<S*>(a.rows.logits) + i * a.rows.stride;
    const float max = row_max<T>(x, vocab);
    // A row of -inf only: shift by 0 so that its terms are exp(-inf) = 0 (the loss is then
    // inf or NaN, as the reference's), not NaN from -inf - -inf.
    const float shift = max == -kInf ? 0.0f : max;
    const float sum = blocked_sum(vocab, [&](int64_t j) {
      const float p = exp_f32(T::load(x[j]) - shift);
      e[j] = p;
      return p;
    });
    const int64_t t = label_column(a.rows, i);
    const float target = t >= 0 ? T::load(x[t]) : 0.0f;
    a.loss[i] = std::log(sum) + shift - target;
    const float scale = a.scale == nullptr ? 1.0f : a.scale[i];
    const float mul = scale / sum;
#pragma omp simd
    for (int64_t j = 0; j < vocab; ++j) x[j] = T::store(e[j] * mul);
    if (t >= 0) x[t] = T::store((e[t] / sum - 1.0f) * scale);
  }
}
MH_CPU_ISA_VARIANTS(fused_rows, FusedArgs)

// ---- ops ----

// Checks logits [N, V] (writable: rows must not overlap) and labels; returns the row view.
Rows rows_of(const at::Tensor& logits, const at::Tensor& labels, int64_t vocab_start,
             const char* op, bool writable) {
  check_cpu(logits, op, "logits");
  TORCH_CHECK(logits.dim() == 2, "megatron_het::", op, ": logits must be 2-D [N, V], got shape ",
              logits.sizes());
  const int64_t n = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(logits.stride(1) == 1 || vocab <= 1, "megatron_het::", op,
              ": logits must have stride 1 in its last dimension, got strides ",
              logits.strides());
  TORCH_CHECK(!writable || n <= 1 || logits.stride(0) >= vocab, "megatron_het::", op,
              ": the rows of logits overlap (strides ", logits.strides(),
              "); pass a tensor that owns its rows");
  check_plain(labels, at::kLong, {n}, op, "labels");
  return {logits.data_ptr(), labels.data_ptr<int64_t>(), vocab_start, vocab, logits.stride(0)};
}

const float* optional_scale(const std::optional<at::Tensor>& scale, int64_t n, const char* op) {
  if (!scale.has_value() || !scale->defined()) return nullptr;
  check_plain(*scale, at::kFloat, {n}, op, "scale");
  return scale->data_ptr<float>();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_entropy_stats_cpu(const at::Tensor& logits,
                                                                       const at::Tensor& labels,
                                                                       int64_t vocab_start) {
  const Rows rows = rows_of(logits, labels, vocab_start, kStats, false);
  const int64_t n = logits.size(0);
  const auto f32 = logits.options().dtype(at::kFloat);
  at::Tensor max = at::empty({n}, f32), sum_exp = at::empty({n}, f32);
  at::Tensor target = at::empty({n}, f32);
  with_float_type(logits, kStats, "logits", [&](auto tag) {
    using T = decltype(tag);
    const StatsArgs args{rows, max.data_ptr<float>(), sum_exp.data_ptr<float>(),
                         target.data_ptr<float>()};
    const auto run = stats_rows_for<T>(host_isa());
    at::parallel_for(0, n, grain_items(rows.vocab), [&](int64_t b, int64_t e) { run(args, b, e); });
  });
  return {max, sum_exp, target};
}

void cross_entropy_grad_cpu(const at::Tensor& logits, const at::Tensor& labels,
                            int64_t vocab_start, const at::Tensor& lse,
                            const std::optional<at::Tensor>& scale) {
  const Rows rows = rows_of(logits, labels, vocab_start, kGrad, true);
  const int64_t n = logits.size(0);
  check_plain(lse, at::kFloat, {n}, kGrad, "lse");
  const float* scale_ptr = optional_scale(scale, n, kGrad);
  with_float_type(logits, kGrad, "logits", [&](auto tag) {
    using T = decltype(tag);
    const GradArgs args{rows, lse.data_ptr<float>(), scale_ptr};
    const auto run = grad_rows_for<T>(host_isa());
    at::parallel_for(0, n, grain_items(rows.vocab), [&](int64_t b, int64_t e) { run(args, b, e); });
  });
}

at::Tensor cross_entropy_fused_cpu(const at::Tensor& logits, const at::Tensor& labels,
                                   int64_t vocab_start, const std::optional<at::Tensor>& scale) {
  const Rows rows = rows_of(logits, labels, vocab_start, kFused, true);
  const int64_t n = logits.size(0);
  const float* scale_ptr = optional_scale(scale, n, kFused);
  const auto f32 = logits.options().dtype(at::kFloat);
  at::Tensor loss = at::empty({n}, f32);
  with_float_type(logits, kFused, "logits", [&](auto tag) {
    using T = decltype(tag);
    const auto run = fused_rows_for<T>(host_isa());
    at::parallel_for(0, n, grain_items(rows.vocab), [&](int64_t b, int64_t e) {
      // each chunk its own scratch row (chunks run one per thread at a time)
      at::Tensor scratch = at::empty({rows.vocab}, f32);
      FusedArgs args{rows, scale_ptr, loss.data_ptr<float>(), scratch.data_ptr<float>()};
      run(args, b, e);
    });
  });
  return loss;
}

}  // namespace
}  // namespace megatron_het::cpu

TORCH_LIBRARY_IMPL(megatron_het, CPU, m) {
  m.impl("cross_entropy_stats", &megatron_het::cpu::cross_entropy_stats_cpu);
  m.impl("cross_entropy_grad_", &megatron_het::cpu::cross_entropy_grad_cpu);
  m.impl("cross_entropy_fused_", &megatron_het::cpu::cross_entropy_fused_cpu);
}
