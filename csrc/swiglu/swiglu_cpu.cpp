// CPU implementations of swiglu_fwd and swiglu_bwd (schemas and contract: csrc/ops.cpp).
//
// Element-wise, so the work is cut into items of one row's block of up to kColumnBlock
// columns, run in parallel (at::parallel_for, chunks of >= kGrainElements elements): a single
// long row still spreads over the threads. Each input is read once and each output written
// once; silu is recomputed from gate in the backward, so the forward saves nothing. Operands
// are read through their row strides (halves of a fused projection need no copy); outputs are
// contiguous. The loops are plain code vectorised per ISA variant (common/cpu_dispatch.h); all
// arithmetic is float32 and each output is rounded once. The 16-bit types go through float32
// copies of kScratch columns in L1: one loop widens the inputs, one computes, one rounds the
// outputs. In a single loop, the conversions' constants and the silu arithmetic do not fit the
// vector registers together (AVX2 has 16), and the spills cost more than the copies.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <type_traits>

#include "common/cpu_dispatch.h"
#include "swiglu/swiglu_rows.h"

namespace megatron_het::cpu {
namespace {

constexpr const char* kFwd = "swiglu_fwd";
constexpr const char* kBwd = "swiglu_bwd";

// Columns per work item: a multiple of every vector width, small enough that a row of 11008
// columns (7B) gives several items.
constexpr int64_t kColumnBlock = 2048;

// Columns per float32 copy of the 16-bit types: five copies (the backward's) take 10 KiB.
constexpr int64_t kScratch = 512;

MH_INLINE float pick(bool c, float a, float b) {
  return float_of(select_bits(c, bits_of(a), bits_of(b)));
}

struct Silu {
  float value;  // silu(g) = g * sigmoid(g)
  float slope;  // its derivative sigmoid(g) * (1 + g * (1 - sigmoid(g)))
};

// silu and its slope without overflow: with e = exp(-|g|) in (0, 1] and r = 1 / (1 + e),
// sigmoid(g) is r for g >= 0 and e * r below (1 - sigmoid(g) the other one), so nothing is
// exp of a large positive number. |g| * e is taken as 0 where e underflows to 0 (|g| > ~103),
// which gives the limits at g = +-inf (value +inf / -0, slope 1 / 0) instead of inf * 0; a NaN
// passes through every step. Branch-free (selects), so that the loops vectorise.
MH_INLINE Silu silu_of(float g) {
  const float a = float_of(bits_of(g) & 0x7fffffffu);
  const float e = exp_f32(-a);
  const float r = 1.0f / (1.0f + e);
  const float ae = pick(e == 0.0f, 0.0f, a * e);
  const bool positive = g >= 0.0f;
  return {pick(positive, g * r, -ae * r), pick(positive, r * (1.0f + ae * r), r * (e - ae * r))};
}

// gate and up (and grad) as rows; items are (row, column block) in row-major order.
struct Layout {
  int64_t cols;
  int64_t blocks;  // column blocks per row
  int64_t gate_stride;
  int64_t up_stride;
  int64_t grad_stride;
};

// The columns [begin, end) of item's row, and the row.
MH_INLINE int64_t item_columns(const Layout& l, int64_t item, int64_t* begin, int64_t* end) {
  const int64_t row = item / l.blocks;
  *begin = (item - row * l.blocks) * kColumnBlock;
  *end = std::min(l.cols, *begin + kColumnBlock);
  return row;
}

struct FwdArgs {
  Layout layout;
  const void* gate;
  const void* up;
  void* out;  // contiguous
};

template <class T>
MH_INLINE void widen(const typename T::storage* __restrict x, float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) y[j] = T::load(x[j]);
}

template <class T>
MH_INLINE void narrow(const float* __restrict x, typename T::storage* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) y[j] = T::store(x[j]);
}

// out = silu(g) * u over n float32 columns.
MH_INLINE void fwd_f32(const float* __restrict g, const float* __restrict u, float* __restrict out,
                       int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = silu_of(g[j]).value * u[j];
}

template <class T>
MH_INLINE void fwd_items(const FwdArgs& a, int64_t item_begin, int64_t item_end) {
  using S = typename T::storage;
  const Layout& l = a.layout;
  for (int64_t item = item_begin; item < item_end; ++item) {
    int64_t begin, end;
    const int64_t i = item_columns(l, item, &begin, &end);
    const S* g = static_cast<const S*>(a.gate) + i * l.gate_stride;
    const S* u = static_cast<const S*>(a.up) + i * l.up_stride;
    S* out = static_cast<S*>(a.out) + i * l.cols;
    if constexpr (std::is_same_v<T, F32>) {
      fwd_f32(g + begin, u + begin, out + begin, end - begin);
    } else {
      alignas(64) float gf[kScratch], uf[kScratch], outf[kScratch];
      for (int64_t b = begin; b < end; b += kScratch) {
        const int64_t n = std::min(kScratch, end - b);
        widen<T>(g + b, gf, n);
        widen<T>(u + b, uf, n);
        fwd_f32(gf, uf, outf, n);
        narrow<T>(outf, out + b, n);
      }
    }
  }
}
MH_CPU_ISA_VARIANTS(fwd_items, FwdArgs)

struct BwdArgs {
  Layout layout;
  const void* grad;
  const void* gate;
  const void* up;
  void* grad_gate;  // contiguous
  void* grad_up;    // contiguous
};

// grad_gate = d * u * silu'(g) and grad_up = d * silu(g) over n float32 columns.
MH_INLINE void bwd_f32(const float* __restrict d, const float* __restrict g,
                       const float* __restrict u, float* __restrict grad_gate,
                       float* __restrict grad_up, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const Silu s = silu_of(g[j]);
    grad_gate[j] = d[j] * u[j] * s.slope;
    grad_up[j] = d[j] * s.value;
  }
}

template <class T>
MH_INLINE void bwd_items(const BwdArgs& a, int64_t item_begin, int64_t item_end) {
  using S = typename T::storage;
  const Layout& l = a.layout;
  for (int64_t item = item_begin; item < item_end; ++item) {
    int64_t begin, end;
    const int64_t i = item_columns(l, item, &begin, &end);
    const S* d = static_cast<const S*>(a.grad) + i * l.grad_stride;
    const S* g = static_cast<const S*>(a.gate) + i * l.gate_stride;
    const S* u = static_cast<const S*>(a.up) + i * l.up_stride;
    S* grad_gate = static_cast<S*>(a.grad_gate) + i * l.cols;
    S* grad_up = static_cast<S*>(a.grad_up) + i * l.cols;
    if constexpr (std::is_same_v<T, F32>) {
      bwd_f32(d + begin, g + begin, u + begin, grad_gate + begin, grad_up + begin, end - begin);
    } else {
      alignas(64) float df[kScratch], gf[kScratch], uf[kScratch];
      alignas(64) float grad_gate_f[kScratch], grad_up_f[kScratch];
      for (int64_t b = begin; b < end; b += kScratch) {
        const int64_t n = std::min(kScratch, end - b);
        widen<T>(d + b, df, n);
        widen<T>(g + b, gf, n);
        widen<T>(u + b, uf, n);
        bwd_f32(df, gf, uf, grad_gate_f, grad_up_f, n);
        narrow<T>(grad_gate_f, grad_gate + b, n);
        narrow<T>(grad_up_f, grad_up + b, n);
      }
    }
  }
}
MH_CPU_ISA_VARIANTS(bwd_items, BwdArgs)

// ---- ops ----

// gate's layout after the checks of gate and up (and grad when given) against the contract.
Layout check_operands(const at::Tensor& gate, const at::Tensor& up, const at::Tensor* grad,
                      const char* op) {
  check_cpu(gate, op, "gate");
  check_cpu(up, op, "up");
  swiglu::check_like_gate(up, gate, op, "up");
  const swiglu::RowView g = swiglu::row_view(gate, op, "gate");
  Layout layout{g.cols, (g.cols + kColumnBlock - 1) / kColumnBlock, g.stride,
                swiglu::row_view(up, op, "up").stride, 0};
  if (grad != nullptr) {
    check_cpu(*grad, op, "grad");
    swiglu::check_like_gate(*grad, gate, op, "grad");
    layout.grad_stride = swiglu::row_view(*grad, op, "grad").stride;
  }
  return layout;
}

// Runs `kernel_for<T>` over every item of gate's rows (none for an empty tensor).
template <class Args, class KernelFor>
void run_items(const at::Tensor& gate, const Args& args, KernelFor kernel_for) {
  const Layout& l = args.layout;
  const int64_t items = gate.numel() == 0 ? 0 : gate.numel() / l.cols * l.blocks;
  if (items == 0) return;
  const auto run = kernel_for(host_isa());
  at::parallel_for(0, items, grain_items(std::min(l.cols, kColumnBlock)),
                   [&](int64_t b, int64_t e) { run(args, b, e); });
}

at::Tensor swiglu_fwd_cpu(const at::Tensor& gate, const at::Tensor& up) {
  const Layout layout = check_operands(gate, up, nullptr, kFwd);
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  with_float_type(gate, kFwd, "gate", [&](auto tag) {
    using T = decltype(tag);
    const FwdArgs args{layout, gate.data_ptr(), up.data_ptr(), out.data_ptr()};
    run_items(gate, args, [](Isa isa) { return fwd_items_for<T>(isa); });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> swiglu_bwd_cpu(const at::Tensor& grad, const at::Tensor& gate,
                                                  const at::Tensor& up) {
  const Layout layout = check_operands(gate, up, &grad, kBwd);
  at::Tensor grad_gate = at::empty(gate.sizes(), gate.options());
  at::Tensor grad_up = at::empty(gate.sizes(), gate.options());
  with_float_type(gate, kBwd, "gate", [&](auto tag) {
    using T = decltype(tag);
    const BwdArgs args{layout,        grad.data_ptr(),      gate.data_ptr(),
                       up.data_ptr(), grad_gate.data_ptr(), grad_up.data_ptr()};
    run_items(gate, args, [](Isa isa) { return bwd_items_for<T>(isa); });
  });
  return {grad_gate, grad_up};
}

}  // namespace
}  // namespace megatron_het::cpu

TORCH_LIBRARY_IMPL(megatron_het, CPU, m) {
  m.impl("swiglu_fwd", &megatron_het::cpu::swiglu_fwd_cpu);
  m.impl("swiglu_bwd", &megatron_het::cpu::swiglu_bwd_cpu);
}
