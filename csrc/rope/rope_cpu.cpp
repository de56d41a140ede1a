// CPU implementation of rope_fwd (schema and contract: csrc/ops.cpp).
//
// One parallel loop over the positions (b, s) of q and k together: each item rotates every
// head row of q and k at that position, so the position's cos/sin row is read once and stays
// in L1. q and k are read through their strides (views of a fused qkv output are the normal
// case), group by group so that the reads walk the qkv block in address order (taking all of
// q's rows first and then k's made bfloat16 RoPE 2.2x slower than on contiguous inputs), and
// written contiguous. The row loop is plain code vectorised per ISA variant
// (common/cpu_dispatch.h); arithmetic is float32 and each output is rounded once.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "common/cpu_dispatch.h"

namespace megatron_het::cpu {
namespace {

constexpr const char* kOp = "rope_fwd";

// One of q, k: [B, S, G, R, D] read through strides (in elements; stride(-1) is 1), written
// contiguous.
struct Operand {
  const void* in;
  void* out;
  int64_t groups;
  int64_t reps;
  int64_t stride_b;
  int64_t stride_s;
  int64_t stride_g;
  int64_t stride_r;
};

struct Args {
  Operand q;
  Operand k;
  bool has_k;
  int64_t seq;
  int64_t dim;
  const float* cos;  // [P, dim / 2]
  const float* sin;
  int64_t offset;
  float sign;  // -1 for the inverse rotation
};

template <class T>
MH_INLINE void rotate_row(const typename T::storage* __restrict x,
                          typename T::storage* __restrict y, const float* __restrict cos,
                          const float* __restrict sin, int64_t half, float sign) {
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) {
    const float a = T::load(x[j]);
    const float c = T::load(x[j + half]);
    const float s = sign * sin[j];
    y[j] = T::store(a * cos[j] - c * s);
    y[j + half] = T::store(c * cos[j] + a * s);
  }
}

// Every head row of q and k at position (b, s), group by group: q's rows of group g, then k's,
// so that reads walk a fused qkv's position block in address order.
template <class T>
MH_INLINE void rotate_position(const Args& a, int64_t b, int64_t s, const float* cos,
                               const float* sin) {
  using S = typename T::storage;
  const int64_t half = a.dim / 2;
  const Operand& q = a.q;
  const Operand& k = a.k;
  const S* q_in = static_cast<const S*>(q.in) + b * q.stride_b + s * q.stride_s;
  S* q_out = static_cast<S*>(q.out) + (b * a.seq + s) * q.groups * q.reps * a.dim;
  const S* k_in = a.has_k ? static_cast<const S*>(k.in) + b * k.stride_b + s * k.stride_s
                          : nullptr;
  S* k_out = a.has_k ? static_cast<S*>(k.out) + (b * a.seq + s) * k.groups * k.reps * a.dim
                     : nullptr;
  // k's groups spread evenly over q's (GQA: k has G2 <= G groups); k's rows of a group are
  // rotated after the q group whose index maps to it.
  const int64_t k_rows = a.has_k ? k.groups * k.reps : 0;
  int64_t k_done = 0;
  for (int64_t g = 0; g < q.groups; ++g) {
    for (int64_t r = 0; r < q.reps; ++r) {
      rotate_row<T>(q_in + g * q.stride_g + r * q.stride_r, q_out, cos, sin, half, a.sign);
      q_out += a.dim;
    }
    const int64_t k_until = k_rows * (g + 1) / q.groups;
    for (; k_done < k_until; ++k_done) {
      const int64_t kg = k_done / k.reps, kr = k_done - kg * k.reps;
      rotate_row<T>(k_in + kg * k.stride_g + kr * k.stride_r, k_out, cos, sin, half, a.sign);
      k_out += a.dim;
    }
  }
}

// Positions [begin, end) of the flattened (b, s).
template <class T>
MH_INLINE void rope_positions(const Args& a, int64_t begin, int64_t end) {
  const int64_t half = a.dim / 2;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / a.seq;
    const int64_t s = item - b * a.seq;
    const float* cos = a.cos + (a.offset + s) * half;
    const float* sin = a.sin + (a.offset + s) * half;
    rotate_position<T>(a, b, s, cos, sin);
  }
}
MH_CPU_ISA_VARIANTS(rope_positions, Args)

void check_operand(const at::Tensor& t, const char* name) {
  check_cpu(t, kOp, name);
  TORCH_CHECK(t.dim() == 5, "megatron_het::rope_fwd: ", name,
              " must be 5-D [B, S, G, R, D], got shape ", t.sizes());
  TORCH_CHECK(t.stride(4) == 1 || t.size(4) <= 1, "megatron_het::rope_fwd: ", name,
              " must have stride 1 in its last dimension, got strides ", t.strides());
}

Operand operand_of(const at::Tensor& in, const at::Tensor& out) {
  return {in.data_ptr(), out.data_ptr(), in.size(2),   in.size(3),
          in.stride(0),  in.stride(1),   in.stride(2), in.stride(3)};
}

std::tuple<at::Tensor, at::Tensor> rope_fwd_cpu(const at::Tensor& q,
                                                const std::optional<at::Tensor>& k,
                                                const at::Tensor& cos, const at::Tensor& sin,
                                                int64_t offset, bool inverse) {
  check_operand(q, "q");
  const int64_t batch = q.size(0), seq = q.size(1), dim = q.size(4);
  TORCH_CHECK(dim % 2 == 0, "megatron_het::rope_fwd: the head dimension D must be even, got ",
              dim);
  const bool has_k = k.has_value() && k->defined();
  if (has_k) {
    check_operand(*k, "k");
    check_dtype(*k, q.scalar_type(), kOp, "k");
    TORCH_CHECK(k->size(0) == batch && k->size(1) == seq && k->size(4) == dim,
                "megatron_het::rope_fwd: k must have q's B, S and D ", q.sizes(), ", got ",
                k->sizes());
  }
  TORCH_CHECK(offset >= 0, "megatron_het::rope_fwd: offset must be >= 0, got ", offset);
  TORCH_CHECK(cos.dim() == 2, "megatron_het::rope_fwd: cos must be 2-D [P, D/2], got shape ",
              cos.sizes());
  const int64_t positions = cos.size(0);
  check_plain(cos, at::kFloat, {positions, dim / 2}, kOp, "cos");
  check_plain(sin, at::kFloat, {positions, dim / 2}, kOp, "sin");
  TORCH_CHECK(positions >= offset + seq, "megatron_het::rope_fwd: the cos/sin tables hold ",
              positions, " positions but offset + S = ", offset + seq,
              "; build them for at least that many");
  at::Tensor q_out = at::empty(q.sizes(), q.options());
  at::Tensor k_out = has_k ? at::empty(k->sizes(), k->options()) : at::empty({0}, q.options());
  with_float_type(q, kOp, "q", [&](auto tag) {
    using T = decltype(tag);
    if (batch * seq == 0) return;
    const Args args{operand_of(q, q_out),
                    has_k ? operand_of(*k, k_out) : Operand{},
                    has_k,
                    seq,
                    dim,
                    cos.data_ptr<float>(),
                    sin.data_ptr<float>(),
                    offset,
                    inverse ? -1.0f : 1.0f};
    const int64_t rows = q.size(2) * q.size(3) + (has_k ? k->size(2) * k->size(3) : 0);
    const auto run = rope_positions_for<T>(host_isa());
    at::parallel_for(0, batch * seq, grain_items(rows * dim),
                     [&](int64_t b, int64_t e) { run(args, b, e); });
  });
  return {q_out, k_out};
}

}  // namespace
}  // namespace megatron_het::cpu

TORCH_LIBRARY_IMPL(megatron_het, CPU, m) { m.impl("rope_fwd", &megatron_het::cpu::rope_fwd_cpu); }
