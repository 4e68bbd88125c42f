// AVX2 + FMA + F16C kernel (x86-64 since Haswell / Zen), selected at run time.
#include <cstdint>

#include "kernel_api.h"

#if defined(CPU_ADAM_X86)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

namespace cpu_adam::isa_avx2 {
#include "scalar_policy.h"

struct Vec {
  using F = __m256;
  using M = __m256;
  using H = __m128i;  // 8 packed 16-bit values
  using I = __m256i;
  static constexpr int W = 8;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static void stream(float* p, F x) { _mm256_stream_ps(p, x); }  // p 32-byte aligned
  static F load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static F load_bf16(const uint16_t* p) {
    return from_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static F from_bf16(H h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static H to_f16(F x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // the low 16 bits of each 32-bit lane, packed (every lane is below 0x10000)
  static H pack(__m256i r) {
    // packus works per 128-bit lane: keep 64-bit elements 0 and 2
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
  }
  static H to_bf16(F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return pack(_mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan));
  }
  static void store_h(uint16_t* p, H h) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h); }
  static void stream_h(uint16_t* p, H h) {  // p 16-byte aligned
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), h);
  }
  static void fence() { _mm_sfence(); }
  static I lanes(uint32_t first) {
    return _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static I next(I index) { return _mm256_add_epi32(index, _mm256_set1_epi32(W)); }
  static I splat(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static __m256i fmix(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x85ebca6bu)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 13));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0xc2b2ae35u)));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  }
  // Scalar::round_sr on every lane: the sum already is the bf16 bits, no second rounding
  static H round_sr(F x, I index, I key) {
    const __m256i r = _mm256_srli_epi32(fmix(_mm256_xor_si256(index, key)), 16);
    const __m256i u = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), r), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return pack(_mm256_blendv_epi8(u, _mm256_set1_epi32(0x7fc0), nan));
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
  static float hsum(F x) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
  }
};

#include "adam_kernel.h"
}  // namespace cpu_adam::isa_avx2
#endif
