// AVX-512F kernel (Skylake-SP, Ice Lake, Sapphire Rapids, Zen 4), selected at run time.
#include <cstdint>

#include "kernel_api.h"

#if defined(CPU_ADAM_X86)
#pragma GCC target("avx512f,avx2,fma,f16c")
// GCC 12 warns about its own _mm512_undefined_* placeholders inside immintrin.h.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

namespace cpu_adam::isa_avx512 {
#include "scalar_policy.h"

struct Vec {
  using F = __m512;
  using M = __mmask16;
  using H = __m256i;  // 16 packed 16-bit values
  using I = __m256i;  // the rounding's counter: the 8 element pairs of the vector
  static constexpr int W = 16;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static void stream(float* p, F x) { _mm512_stream_ps(p, x); }  // p 64-byte aligned
  static F load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F load_bf16(const uint16_t* p) {
    return from_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F from_bf16(H h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static H to_f16(F x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  template <bool kMayNan = true>  // the nan rule is one masked blend: always applied
  static H to_bf16(F x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    r = _mm512_srli_epi32(r, 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r,
                                _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
  }
  static void store_h(uint16_t* p, H h) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h); }
  static void stream_h(uint16_t* p, H h) {  // p 32-byte aligned
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), h);
  }
  static void fence() { _mm_sfence(); }
  // Not __builtin_prefetch: GCC 12 at -O2 deletes it from the kernel loops.
  static void prefetch(const void* at) {
    __asm__ volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(at)));
  }
  // the touch probe's values: opaque to the compiler, so its loads and stores stay
  static F opaque(F x) {
    __asm__("" : "+v"(x));
    return x;
  }
  static void keep(F x) { __asm__ volatile("" : : "v"(x)); }
  // `first` (the index of lane 0) is even: lanes 2j and 2j + 1 share pair first / 2 + j
  static I lanes(uint32_t first) {
    return _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first >> 1)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static I next(I pairs) { return _mm256_add_epi32(pairs, _mm256_set1_epi32(W / 2)); }
  static I splat(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static __m256i fmix(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x85ebca6bu)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 13));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0xc2b2ae35u)));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  }
  // Scalar::round_sr on every lane: widening the 8 hashes' 16-bit halves gives lane 2j
  // the low half of hash j and lane 2j + 1 its high half; the sum is the bf16 bits
  template <bool kMayNan = true>
  static H round_sr(F x, I pairs, I key) {
    const __m512i r = _mm512_cvtepu16_epi32(fmix(_mm256_xor_si256(pairs, key)));
    const __m512i u = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), r), 16);
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(
        _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x7fc0)));
  }
  static bool any_nan(F, F, F) { return false; }  // (the roundings apply the nan rule anyway)
  static constexpr bool kFindsNan = false;         // any_nan does not look
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F max0(F a) {  // keeps nan
    const F zero = _mm512_setzero_ps();
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, zero, _CMP_LT_OQ), a, zero);
  }
  static M mask_zero() { return 0; }
  static M nonfinite_or(M acc, F x) {  // x - x is nan exactly for inf and nan
    return acc | _mm512_cmp_ps_mask(_mm512_sub_ps(x, x), _mm512_setzero_ps(), _CMP_UNORD_Q);
  }
  static bool any(M acc) { return acc != 0; }
  static float hsum(F x) { return _mm512_reduce_add_ps(x); }
};

using VecBf16 = Vec;
using VecBf16States = Vec;

#include "adam_kernel.h"
}  // namespace cpu_adam::isa_avx512
#endif
