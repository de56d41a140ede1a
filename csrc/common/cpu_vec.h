// Scalar building blocks of the CPU kernels, written so that GCC (and clang) vectorise the row
// loops that use them: every function here is branch-free on its argument (selects, not
// jumps), works on plain floats and integer bits, and is force-inlined, so that it is compiled
// inside each ISA variant of a kernel (cpu_dispatch.h) with that variant's vector width.
//
// Nothing here includes torch: the element types are raw storage (float, or uint16_t bits for
// bfloat16 and float16), and conversions round to nearest even with NaN kept, as the contract
// asks ("each output is rounded once to its dtype").
#pragma once

#include <cstdint>

#define MH_INLINE inline __attribute__((always_inline))

namespace megatron_het::cpu {

MH_INLINE uint32_t bits_of(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof(u));
  return u;
}

MH_INLINE float float_of(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, sizeof(f));
  return f;
}

constexpr float kInf = __builtin_inff();

// c ? a : b as bit masks: written as a ternary, GCC sinks the float work that computes a or b
// into branches (it may trap, so it is not speculated back) and the loop no longer vectorises.
MH_INLINE uint32_t select_bits(bool c, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - uint32_t(c);
  return (a & mask) | (b & ~mask);
}

// ---- element types: storage plus exact widening and round-to-nearest-even narrowing ----

struct F32 {
  using storage = float;
  static MH_INLINE float load(float v) { return v; }
  static MH_INLINE float store(float v) { return v; }
};

struct BF16 {
  using storage = uint16_t;
  static MH_INLINE float load(uint16_t h) { return float_of(uint32_t(h) << 16); }
  static MH_INLINE uint16_t store(float f) {
    const uint32_t u = bits_of(f);
    // Adding 0x7fff plus the lowest kept bit rounds the 16 dropped bits to nearest even; a
    // carry into the exponent is the right answer (up to infinity).
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (u >> 16) | 0x40u;  // rounding could turn a NaN into infinity
    return uint16_t(select_bits((u & 0x7fffffffu) > 0x7f800000u, quiet_nan, rounded));
  }
};

struct F16 {
  using storage = uint16_t;
  static MH_INLINE float load(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t magnitude = h & 0x7fffu;
    const uint32_t normal = (magnitude << 13) + (112u << 23);  // exponent bias 15 -> 127
    const uint32_t inf_nan = normal + (112u << 23);            // exponent 31 -> 255
    // Subnormals (and zero) are magnitude * 2^-24: an exact int -> float conversion, so no
    // arithmetic on float denormals (which a flush-to-zero mode would lose).
    const uint32_t subnormal = bits_of(float(int32_t(magnitude)) * 0x1p-24f);
    const uint32_t finite = select_bits(magnitude >= 0x400u, normal, subnormal);
    return float_of(select_bits(magnitude >= 0x7c00u, inf_nan, finite) | sign);
  }
  static MH_INLINE uint16_t store(float f) {
    const uint32_t u = bits_of(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t a = u & 0x7fffffffu;
    // Normal results: rebias the exponent and round the 13 dropped bits to nearest even (a
    // carry past 0x7bff gives infinity, which is right from 65520 up).
    const uint32_t normal = (a - (112u << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;
    // Below 2^-14 the result is k * 2^-24: adding 0.5 puts 2^-24 at the float's last place, so
    // the hardware's own round-to-nearest-even picks k.
    const uint32_t subnormal = bits_of(float_of(a) + 0.5f) - 0x3f000000u;
    const uint32_t finite = select_bits(a >= 0x38800000u, normal, subnormal);  // >= 2^-14
    const uint32_t big = select_bits(a > 0x7f800000u, 0x7e00u, 0x7c00u);  // NaN, or infinity
    return uint16_t(select_bits(a >= 0x47800000u, big, finite) | sign);  // >= 65536
  }
};

// ---- exp ----

// exp(x) in float32 within 1.1e-7 relative (NaN in, NaN out; below -104 it is 0, above 88.8 inf),
// as plain arithmetic that vectorises: x = n ln2 + r with |r| <= ln2/2 (n rounded by the
// 1.5 * 2^23 shifter, which needs no float -> int conversion), e^r by its Taylor series to
// r^7 (truncation below 1e-8 relative), and 2^n built in the exponent field in two halves so
// that n from -150 to 128 never leaves the normal range. The library expf would not vectorise
// without -ffast-math (and its vector form is less accurate).
MH_INLINE float exp_f32(float x) {
  // Clamped through bit selects (NaN compares false and passes through), which vectorise where
  // float ternaries here did not.
  x = float_of(select_bits(x < -104.0f, bits_of(-104.0f), bits_of(x)));
  x = float_of(select_bits(x > 88.8f, bits_of(88.8f), bits_of(x)));
  constexpr float kShifter = 12582912.0f;  // 1.5 * 2^23
  const float shifted = x * 1.44269504088896341f + kShifter;
  const float n = shifted - kShifter;
  // ln2 split in two so that n * kLn2Hi is exact (its last 9 mantissa bits are 0, |n| <= 150).
  constexpr float kLn2Hi = 0.693145751953125f;
  constexpr float kLn2Lo = 1.42860682030941723212e-6f;
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // n as an integer: shifted and kShifter lie in [2^23, 2^24), where the last place is 1.
  const int32_t ni = int32_t(bits_of(shifted) - bits_of(kShifter));
  const int32_t n1 = ni >> 1;
  const int32_t n2 = ni - n1;
  const float scale1 = float_of(uint32_t(n1 + 127) << 23);
  const float scale2 = float_of(uint32_t(n2 + 127) << 23);
  return p * scale1 * scale2;
}

// ---- sums ----

// Terms per block of blocked_sum: each vector lane adds at most kSumBlock / lanes terms and
// the blocks are added in order, so the float32 rounding error grows like
// kSumBlock / lanes + n / kSumBlock rather than n (1e-6 relative holds for n in the millions).
constexpr int64_t kSumBlock = 256;

// sum of term(j) for j in [0, n) in float32, vectorised; term may also store (a fused write).
template <class Term>
MH_INLINE float blocked_sum(int64_t n, Term&& term) {
  float total = 0.0f;
  for (int64_t begin = 0; begin < n; begin += kSumBlock) {
    const int64_t end = n - begin < kSumBlock ? n : begin + kSumBlock;
    float part = 0.0f;
#pragma omp simd reduction(+ : part)
    for (int64_t j = begin; j < end; ++j) part += term(j);
    total += part;
  }
  return total;
}

}  // namespace megatron_het::cpu
