// AVX2 + FMA + F16C kernel (x86-64 since Haswell / Zen), selected at run time.
//
// AVX2 has no bf16 instructions, so every bf16 load, rounding and store is built from
// integer ops, and on Zen 2/3 the shifts and shuffles among them share two of the four
// vector pipes with the multiplies and the divider. The policies below keep those to a
// minimum (docs/cpu_optimizer.md, "16-bit states on AVX2"):
// - a bf16 value is kept in the high half of its 32-bit lane until it is stored, so
//   rounding needs no shift and the store picks the high halves (one shuffle);
// - round to nearest even adds 0x8000 minus "bit 16 clear" (a compare, not a shift);
// - VecBf16, for steps whose streams are all bf16, holds 16 elements as their even and
//   odd halves: a 32-byte load becomes two fp32 vectors with one shift and one AND, two
//   rounded vectors become one 32-byte store with one shift and one word blend, and one
//   hash gives the random bits of an even and an odd element (its low and high halves);
// - VecBf16States, for an fp32 master beside bf16 m and v, holds 16 elements in the
//   order that widening a 32-byte bf16 load gives (0-3 | 8-11 and 4-7 | 12-15): the
//   16-bit streams cross no 128-bit lane, only the fp32 ones are permuted.
#include <cstdint>

#include "kernel_api.h"

#if defined(CPU_ADAM_X86)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

namespace cpu_adam::isa_avx2 {
#include "scalar_policy.h"

// Not __builtin_prefetch: GCC 12 at -O2 deletes it from the kernel loops (its mod/ref
// analysis treats it as dead), so the prefetch knob did nothing.
static inline void prefetch_line(const void* at) {
  __asm__ volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(at)));
}

// murmur3's fmix32 (Scalar's fmix32) but its last step, x ^ (x >> 16)
static inline __m256i fmix_before_last(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x85ebca6bu)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 13));
  return _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0xc2b2ae35u)));
}

static inline __m128i fmix(__m128i x) {
  x = _mm_xor_si128(x, _mm_srli_epi32(x, 16));
  x = _mm_mullo_epi32(x, _mm_set1_epi32(static_cast<int>(0x85ebca6bu)));
  x = _mm_xor_si128(x, _mm_srli_epi32(x, 13));
  x = _mm_mullo_epi32(x, _mm_set1_epi32(static_cast<int>(0xc2b2ae35u)));
  return _mm_xor_si128(x, _mm_srli_epi32(x, 16));
}

// The bf16 bits of x in the high half of each lane, nan as 0x7fc0 (f32_to_bf16's rule).
// kMayNan = false: the caller checked that x holds no nan (any_nan), so no blend.
template <bool kMayNan>
static inline __m256i keep_nan(__m256 x, __m256i rounded) {
  if constexpr (!kMayNan) return rounded;
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc00000), nan);
}

// Round to nearest even into the high half: u + 0x7fff + (bit 16) = u + 0x8000 - (bit 16
// clear), where the compare gives -1 for a clear bit.
template <bool kMayNan>
static inline __m256i nearest_high(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i clear = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x10000)),
                                           _mm256_setzero_si256());
  return keep_nan<kMayNan>(x, _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x8000)), clear));
}

// Stochastic rounding into the high half: the 16 random bits added below the kept mantissa.
template <bool kMayNan>
static inline __m256i stochastic_high(__m256 x, __m256i random16) {
  return keep_nan<kMayNan>(x, _mm256_add_epi32(_mm256_castps_si256(x), random16));
}

// Whether a, b or c holds a nan: two compares for three vectors (unordered: either is nan).
static inline bool any_nan8(__m256 a, __m256 b, __m256 c) {
  return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q),
                                         _mm256_cmp_ps(c, c, _CMP_UNORD_Q))) != 0;
}

static inline float hsum8(__m256 x) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// 8 consecutive elements per vector: any mix of fp32, fp16 and bf16 streams.
struct Vec {
  using F = __m256;
  using M = __m256;
  using H = __m128i;  // 8 packed 16-bit values
  using I = __m128i;  // the rounding's counter: the 4 element pairs of the vector
  static constexpr int W = 8;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static void stream(float* p, F x) { _mm256_stream_ps(p, x); }  // p 32-byte aligned
  static F load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // the 16 bytes in both 128-bit lanes (a load), then words 0-3 and 4-7 into the high
  // halves of lanes 0 and 1 (one in-lane shuffle)
  static F load_bf16(const uint16_t* p) {
    const __m256i b =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i to_high = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7,
                                             -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15);
    return _mm256_castsi256_ps(_mm256_shuffle_epi8(b, to_high));
  }
  static F from_bf16(H h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static H to_f16(F x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // the high halves of the 8 lanes, in order: gathered per 128-bit lane, then joined
  static H pack_high(__m256i r) {
    const __m256i gather = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                            2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_shuffle_epi8(r, gather), 0x08));
  }
  template <bool kMayNan = true>
  static H to_bf16(F x) { return pack_high(nearest_high<kMayNan>(x)); }
  static bool any_nan(F a, F b, F c) { return any_nan8(a, b, c); }
  static constexpr bool kFindsNan = true;
  static void store_h(uint16_t* p, H h) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h); }
  static void stream_h(uint16_t* p, H h) {  // p 16-byte aligned
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), h);
  }
  static void fence() { _mm_sfence(); }
  static void prefetch(const void* at) { prefetch_line(at); }
  // the touch probe's values: opaque to the compiler, so its loads and stores stay
  static F opaque(F x) {
    __asm__("" : "+x"(x));
    return x;
  }
  static void keep(F x) { __asm__ volatile("" : : "x"(x)); }
  // `first` (the index of lane 0) is even: lanes 2j and 2j + 1 share pair first / 2 + j
  static I lanes(uint32_t first) {
    return _mm_add_epi32(_mm_set1_epi32(static_cast<int>(first >> 1)), _mm_setr_epi32(0, 1, 2, 3));
  }
  static I next(I pairs) { return _mm_add_epi32(pairs, _mm_set1_epi32(W / 2)); }
  static I splat(uint32_t x) { return _mm_set1_epi32(static_cast<int>(x)); }
  // Scalar::round_sr on every lane: widening the 4 hashes' 16-bit halves gives lane 2j the
  // low half of hash j and lane 2j + 1 its high half
  template <bool kMayNan = true>
  static H round_sr(F x, I pairs, I key) {
    const __m256i random16 = _mm256_cvtepu16_epi32(fmix(_mm_xor_si128(pairs, key)));
    return pack_high(stochastic_high<kMayNan>(x, random16));
  }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F max0(F a) {  // keeps nan, unlike _mm256_max_ps(a, 0)
    const F zero = _mm256_setzero_ps();
    return _mm256_blendv_ps(a, zero, _mm256_cmp_ps(a, zero, _CMP_LT_OQ));
  }
  static M mask_zero() { return _mm256_setzero_ps(); }
  static M nonfinite_or(M acc, F x) {  // x - x is nan exactly for inf and nan
    return _mm256_or_ps(acc, _mm256_cmp_ps(_mm256_sub_ps(x, x), _mm256_setzero_ps(), _CMP_UNORD_Q));
  }
  static bool any(M acc) { return _mm256_movemask_ps(acc) != 0; }
  static float hsum(F x) { return hsum8(x); }
};

// 16 elements as two fp32 vectors a and b, in an order that VecBf16 and VecBf16States
// choose; the elementwise arithmetic cannot tell the order from memory order.
struct Vec2x8 {
  struct F {
    __m256 a, b;
  };
  using M = __m256;
  using H = __m256i;  // 16 packed 16-bit values, in memory order
  static constexpr int W = 16;
  static F set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static bool any_nan(F x, F y, F z) {  // unordered: either lane is nan
    const __m256 xy = _mm256_or_ps(_mm256_cmp_ps(x.a, x.b, _CMP_UNORD_Q),
                                   _mm256_cmp_ps(y.a, y.b, _CMP_UNORD_Q));
    return _mm256_movemask_ps(_mm256_or_ps(xy, _mm256_cmp_ps(z.a, z.b, _CMP_UNORD_Q))) != 0;
  }
  static constexpr bool kFindsNan = true;
  static void store_h(uint16_t* p, H h) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h); }
  static void stream_h(uint16_t* p, H h) {  // p 32-byte aligned
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), h);
  }
  static void fence() { _mm_sfence(); }
  static void prefetch(const void* at) { prefetch_line(at); }
  static F add(F x, F y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
  static F sub(F x, F y) { return {_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)}; }
  static F mul(F x, F y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
  static F div(F x, F y) { return {_mm256_div_ps(x.a, y.a), _mm256_div_ps(x.b, y.b)}; }
  static F sqrt(F x) { return {_mm256_sqrt_ps(x.a), _mm256_sqrt_ps(x.b)}; }
  static F max0(F x) { return {Vec::max0(x.a), Vec::max0(x.b)}; }
  static M mask_zero() { return _mm256_setzero_ps(); }
  static M nonfinite_or(M acc, F x) {  // one compare: unordered when either lane is nan
    return _mm256_or_ps(acc, _mm256_cmp_ps(_mm256_sub_ps(x.a, x.a),
                                           _mm256_sub_ps(x.b, x.b), _CMP_UNORD_Q));
  }
  static bool any(M acc) { return _mm256_movemask_ps(acc) != 0; }
  static float hsum(F x) { return hsum8(_mm256_add_ps(x.a, x.b)); }
};

// 16 consecutive elements held as their even (a) and odd (b) halves: only for steps whose
// every stream is bf16 (adam_kernel.h picks it through kAllBf16). One hash serves lane j
// of both halves (elements 2j and 2j + 1: Scalar::round_sr's pairing).
struct VecBf16 : Vec2x8 {
  using I = __m256i;  // the rounding's counter: the 8 element pairs
  // 32-bit lane j holds elements 2j (low half) and 2j + 1 (high half)
  static F load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(h, 16)),
            _mm256_castsi256_ps(_mm256_and_si256(h, _mm256_set1_epi32(static_cast<int>(0xffff0000u))))};
  }
  // rounded even and odd lanes (bf16 bits in their high halves) back in memory order
  static H join(__m256i even, __m256i odd) {
    return _mm256_blend_epi16(_mm256_srli_epi32(even, 16), odd, 0xaa);
  }
  template <bool kMayNan = true>
  static H to_bf16(F x) {
    return join(nearest_high<kMayNan>(x.a), nearest_high<kMayNan>(x.b));
  }
  static I lanes(uint32_t first) {  // `first` is even
    return _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first >> 1)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  // the step as a memory operand (inline assembly: GCC 12 otherwise rebuilds the constant
  // from a general register in every iteration, 3 instructions of which 2 vector)
  static I next(I pairs) {
    alignas(32) static const int32_t step[8] = {W / 2, W / 2, W / 2, W / 2, W / 2, W / 2, W / 2, W / 2};
    __asm__("vpaddd %1, %0, %0" : "+x"(pairs) : "m"(step));
    return pairs;
  }
  static I splat(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  // fmix's last step is h = y ^ (y >> 16): its high half is y's, so h >> 16 is the
  // y >> 16 it already computed (one shift fewer)
  template <bool kMayNan = true>
  static H round_sr(F x, I pairs, I key) {
    const __m256i y = fmix_before_last(_mm256_xor_si256(pairs, key));
    const __m256i high = _mm256_srli_epi32(y, 16);
    const __m256i h = _mm256_xor_si256(y, high);
    return join(stochastic_high<kMayNan>(x.a, _mm256_and_si256(h, _mm256_set1_epi32(0xffff))),
                stochastic_high<kMayNan>(x.b, high));
  }
};

// 16 consecutive elements as a = elements 0-3 | 8-11 and b = 4-7 | 12-15: for an fp32
// master beside bf16 m and v (adam_kernel.h picks it through kBf16States). That order is
// what widening a 32-byte bf16 load against zero gives (unpacklo/hi_epi16 work per
// 128-bit lane), and what narrowing returns to memory order without crossing a lane, so
// each 16-bit stream costs 2 shuffles per 16 elements to load and 3 to store (Vec: 2 and
// 4); the fp32 streams pay two lane permutes each way instead.
struct VecBf16States : Vec2x8 {
  using I = __m256i;  // the rounding's counter: unused, an fp32 master rounds nothing
  static F load(const float* p) {
    const __m256 lo = _mm256_loadu_ps(p);  // elements 0-7
    const __m256 hi = _mm256_loadu_ps(p + 8);
    return {_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31)};
  }
  static void store(float* p, F x) {
    _mm256_storeu_ps(p, _mm256_permute2f128_ps(x.a, x.b, 0x20));
    _mm256_storeu_ps(p + 8, _mm256_permute2f128_ps(x.a, x.b, 0x31));
  }
  static void stream(float* p, F x) {  // p 32-byte aligned
    _mm256_stream_ps(p, _mm256_permute2f128_ps(x.a, x.b, 0x20));
    _mm256_stream_ps(p + 8, _mm256_permute2f128_ps(x.a, x.b, 0x31));
  }
  // bf16 in the high half of a 32-bit lane is its exact fp32
  static F load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i zero = _mm256_setzero_si256();
    return {_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, h)),
            _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, h))};
  }
  // rounded a and b (bf16 bits in their high halves) back in memory order: per 128-bit
  // lane, a's four high halves then b's (each fits 16 bits: packus never saturates)
  static H join(__m256i a, __m256i b) {
    return _mm256_packus_epi32(_mm256_srli_epi32(a, 16), _mm256_srli_epi32(b, 16));
  }
  template <bool kMayNan = true>
  static H to_bf16(F x) {
    return join(nearest_high<kMayNan>(x.a), nearest_high<kMayNan>(x.b));
  }
  static I lanes(uint32_t) { return _mm256_setzero_si256(); }
  static I next(I pairs) { return pairs; }
  static I splat(uint32_t) { return _mm256_setzero_si256(); }
};

#include "adam_kernel.h"
}  // namespace cpu_adam::isa_avx2
#endif
