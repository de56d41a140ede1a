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
    // carry into the exponent is the right answer (up to infinity). A NaN is made quiet
    // instead, since rounding could turn it into infinity. The select comes before the shift,
    // on 32-bit lanes, so that the vectorised loop narrows to 16 bits once.
    const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(select_bits(f != f, u | 0x400000u, rounded) >> 16);
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

// exp(x) in float32 within 1.2e-7 relative over the normal range (NaN in, NaN out; below -104
// it is 0, above 88.8 inf, subnormal in between), as plain arithmetic that vectorises:
// x = n ln2 + r with |r| <= ln2/2, e^r by a degree-6 minimax polynomial, and 2^n built in the
// exponent field in two halves so that n from -150 to 128 never leaves the normal range.
// Against double exp: 7.7e-8 at most over every float32 input with FMA, 9.8e-8 without (a
// 2e7-point sweep of [-104, 89]). The library expf would not vectorise without -ffast-math (and
// its vector form is less accurate).
MH_INLINE float exp_f32(float x) {
  // Below -104 the result is 0: clamped through a bit select (NaN compares false and passes
  // through), which vectorises where a float ternary does not (it may trap, so GCC keeps a
  // branch).
  x = float_of(select_bits(x < -104.0f, bits_of(-104.0f), bits_of(x)));
  // n = round(x / ln2) by a shifter of 1.5 * 2^23 + 254: shifted lies in [2^23, 2^24), where
  // the last place is 1, so its low 9 bits are n + 254 (no float -> int conversion). Above,
  // n is capped at 128 by an unsigned min on those bits (a signed one got GCC to branch, and
  // the loops no longer vectorised): past ln(FLT_MAX) ~ 88.72 up to +inf, r = x - 128 ln2 > 0
  // then gives e^r > 1 and the result overflows to inf. A NaN of either sign goes on through r
  // whatever n it gets.
  constexpr float kShifter = 12583166.0f;
  const float shifted = x * 1.44269504088896341f + kShifter;
  const uint32_t top = bits_of(kShifter + 128.0f);
  const uint32_t biased = bits_of(shifted) < top ? bits_of(shifted) : top;
  const float n = float_of(biased) - kShifter;
  // ln2 split in two so that n * kLn2Hi is exact (its last 9 mantissa bits are 0, |n| <= 150).
  constexpr float kLn2Hi = 0.693145751953125f;
  constexpr float kLn2Lo = 1.42860682030941723212e-6f;
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  // 1 + r + r^2 (c2 + ... + c6 r^4), the relative minimax on |r| <= ln2/2 (3.1e-9 before its
  // coefficients were rounded to float32; the rest of the error is float32 rounding).
  float p = 0x1.6a244cp-10f;
  p = p * r + 0x1.1239d4p-7f;
  p = p * r + 0x1.5558f2p-5f;
  p = p * r + 0x1.555492p-3f;
  p = p * r + 0x1.fffffcp-2f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^n = 2^(e1 - 127) * 2^(e2 - 127) with e1 + e2 = n + 254, from the low 9 bits of biased
  // (the higher ones leave the exponent field in the shifts); e1, e2 lie in [52, 191].
  const uint32_t half = biased >> 1;
  return p * float_of(half << 23) * float_of((biased - half) << 23);
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
