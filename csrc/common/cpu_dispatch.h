// How the CPU kernels choose their code at run time, and the argument checks they share.
//
// ISA variants: a kernel's row loop is written once, as a force-inlined template taking an
// argument struct and a range of work items; MH_CPU_ISA_VARIANTS(kernel, Args) compiles it
// three times on x86-64, inside functions built for AVX-512, for AVX2 + FMA + F16C, and for
// the baseline, and kernel_for<Types...>(host_isa()) picks one for the running CPU. The build
// host's -march plays no part, so one wheel runs at full width everywhere. (The library is not
// built with torch's CPU_CAPABILITY flags, which is why at::vec is not used: its wide paths
// would compile out.)
//
// Element types: with_float_type(dtype, fn) calls fn(F32{}), fn(BF16{}) or fn(F16{}), the
// storage-and-rounding types of cpu_vec.h, and rejects any other dtype with the contract's
// one-line message.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <initializer_list>

#include "common/cpu_vec.h"
#include "common/op_checks.h"

namespace megatron_het::cpu {

// Work items per parallel chunk are sized to hold at least this many elements: below it the
// fork/join of a thread costs more than the chunk.
constexpr int64_t kGrainElements = 16384;

// Items per chunk for items of `elements_per_item` elements each.
inline int64_t grain_items(int64_t elements_per_item) {
  const int64_t per_item = elements_per_item > 1 ? elements_per_item : 1;
  return (kGrainElements + per_item - 1) / per_item;
}

enum class Isa { kBaseline, kAvx2, kAvx512 };

inline Isa host_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return Isa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return Isa::kAvx2;
  }
#endif
  return Isa::kBaseline;
}

template <class Args>
using RangeFn = void (*)(const Args&, int64_t begin, int64_t end);

#if defined(__x86_64__) || defined(__i386__)
#if defined(__clang__)
#define MH_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#else
// GCC would otherwise keep 256-bit vectors for generic tuning.
#define MH_TARGET_AVX512                                                          \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,"  \
                        "prefer-vector-width=512")))
#endif
#define MH_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

#define MH_CPU_ISA_VARIANTS(kernel, Args)                                           \
  template <class... Types>                                                         \
  MH_TARGET_AVX512 void kernel##_avx512(const Args& args, int64_t begin, int64_t end) { \
    kernel<Types...>(args, begin, end);                                             \
  }                                                                                 \
  template <class... Types>                                                         \
  MH_TARGET_AVX2 void kernel##_avx2(const Args& args, int64_t begin, int64_t end) {   \
    kernel<Types...>(args, begin, end);                                             \
  }                                                                                 \
  template <class... Types>                                                         \
  void kernel##_baseline(const Args& args, int64_t begin, int64_t end) {            \
    kernel<Types...>(args, begin, end);                                             \
  }                                                                                 \
  template <class... Types>                                                         \
  ::megatron_het::cpu::RangeFn<Args> kernel##_for(::megatron_het::cpu::Isa isa) {   \
    switch (isa) {                                                                  \
      case ::megatron_het::cpu::Isa::kAvx512:                                       \
        return &kernel##_avx512<Types...>;                                          \
      case ::megatron_het::cpu::Isa::kAvx2:                                         \
        return &kernel##_avx2<Types...>;                                            \
      default:                                                                      \
        return &kernel##_baseline<Types...>;                                        \
    }                                                                               \
  }
#else  // other architectures: their baseline (e.g. NEON on aarch64) is the one variant
#define MH_CPU_ISA_VARIANTS(kernel, Args)                                         \
  template <class... Types>                                                       \
  void kernel##_baseline(const Args& args, int64_t begin, int64_t end) {          \
    kernel<Types...>(args, begin, end);                                           \
  }                                                                               \
  template <class... Types>                                                       \
  ::megatron_het::cpu::RangeFn<Args> kernel##_for(::megatron_het::cpu::Isa) {     \
    return &kernel##_baseline<Types...>;                                          \
  }
#endif

// fn(tag) with tag F32{}, BF16{} or F16{} for t's dtype.
template <class Fn>
decltype(auto) with_float_type(const at::Tensor& t, const char* op, const char* name, Fn&& fn) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return fn(F32{});
    case at::kBFloat16:
      return fn(BF16{});
    case at::kHalf:
      return fn(F16{});
    default:
      TORCH_CHECK(false, "megatron_het::", op, ": ", name,
                  " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

inline void check_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "megatron_het::", op, ": ", name,
              " must be on the CPU like the other arguments, got ", t.device());
}

using checks::check_contiguous;
using checks::check_dtype;
using checks::check_sizes;

// A CPU tensor of `dtype`, contiguous, of the given shape: the common case of the checks.
inline void check_plain(const at::Tensor& t, at::ScalarType dtype, c10::IntArrayRef sizes,
                        const char* op, const char* name) {
  check_cpu(t, op, name);
  check_dtype(t, dtype, op, name);
  check_sizes(t, sizes, op, name);
  check_contiguous(t, op, name);
}

}  // namespace megatron_het::cpu
