// One-lane policy: the portable kernel and every ISA's tail elements.
// Included inside an ISA namespace after <cstdint>; no includes of its own (see kernel_api.h).

static inline uint32_t bits_of(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof u);
  return u;
}

static inline float float_of(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return float_of(sign | 0x7f800000u | (mant << 13));  // inf, nan
  if (exp != 0) return float_of(sign | ((exp + 112) << 23) | (mant << 13));
  // zero and subnormals: mant * 2^-24 is exact in fp32
  return float_of(sign | bits_of(static_cast<float>(mant) * 5.9604644775390625e-8f));
}

// Round to nearest even, nan -> 0x7e00 (as F16C and torch do). The two multiplications
// let the FPU do the rounding of the mantissa (the classic FP16 library construction).
static inline uint16_t f32_to_f16(float f) {
  float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = bits_of(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xff000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = float_of((bias >> 1) + 0x07800000u) + base;
  const uint32_t b = bits_of(base);
  const uint32_t nonsign = ((b >> 13) & 0x7c00u) + (b & 0x0fffu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
}

static inline float bf16_to_f32(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

// Round to nearest even, nan -> 0x7fc0 (torch's c10::BFloat16 rounding).
static inline uint16_t f32_to_bf16(float f) {
  if (f != f) return 0x7fc0;
  const uint32_t u = bits_of(f);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// murmur3's 32-bit finalizer: the counter-based generator of the stochastic rounding.
static inline uint32_t fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85ebca6bu;
  x ^= x >> 13;
  x *= 0xc2b2ae35u;
  x ^= x >> 16;
  return x;
}

// The 16 random bits of the element with index `index` in its parameter: elements 2j and
// 2j + 1 share one hash, fmix32(j ^ key), the even one taking its low half and the odd
// one its high half (one hash per two elements: the vector kernels' lanes pair up).
static inline uint32_t random16(uint32_t index, uint32_t key) {
  const uint32_t h = fmix32((index >> 1) ^ key);
  return (index & 1u) ? h >> 16 : h & 0xffffu;
}

// x rounded stochastically to bf16: adds 16 random bits below the kept mantissa and
// truncates, so x rounds away from zero with probability equal to the dropped fraction.
// nan becomes 0x7fc0 (as f32_to_bf16 stores it).
static inline uint16_t bf16_stochastic(float x, uint32_t random16) {
  if (x != x) return 0x7fc0;
  return static_cast<uint16_t>((bits_of(x) + random16) >> 16);
}

struct Scalar {
  using F = float;
  using M = bool;
  using H = uint16_t;  // one 16-bit value (what a vector policy packs W of)
  using I = uint32_t;  // element index of each lane, for the rounding's random bits
  static constexpr int W = 1;
  static F set1(float x) { return x; }
  static F load(const float* p) { return *p; }
  static void store(float* p, F x) { *p = x; }
  static void stream(float* p, F x) { *p = x; }
  static F load_f16(const uint16_t* p) { return f16_to_f32(*p); }
  static F load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
  static F from_bf16(H h) { return bf16_to_f32(h); }
  static H to_f16(F x) { return f32_to_f16(x); }
  template <bool kMayNan = true>  // the nan rule costs nothing here: always applied
  static H to_bf16(F x) { return f32_to_bf16(x); }
  static void store_h(uint16_t* p, H h) { *p = h; }
  static void stream_h(uint16_t* p, H h) { *p = h; }
  static void fence() {}
  static void prefetch(const void*) {}
  // the touch probe's values: opaque to the compiler, so its loads and stores stay
  static F opaque(F x) {
    __asm__("" : "+m"(x));
    return x;
  }
  static void keep(F x) { __asm__ volatile("" : : "m"(x)); }
  // The rounding's counter: the element's index here (one lane); next() advances by W
  static I lanes(uint32_t first) { return first; }
  static I next(I index) { return index + 1; }
  static I splat(uint32_t x) { return x; }
  template <bool kMayNan = true>
  static H round_sr(F x, I index, I key) { return bf16_stochastic(x, random16(index, key)); }
  static bool any_nan(F, F, F) { return false; }  // (the roundings apply the nan rule anyway)
  static constexpr bool kFindsNan = false;         // any_nan does not look
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return __builtin_sqrtf(a); }
  static F max0(F a) { return a < 0.0f ? 0.0f : a; }  // keeps nan
  static M mask_zero() { return false; }
  static M nonfinite_or(M acc, F x) { return acc || !(x - x == 0.0f); }
  static bool any(M acc) { return acc; }
  static float hsum(F x) { return x; }
};
