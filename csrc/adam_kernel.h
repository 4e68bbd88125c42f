// The AdamW step over one contiguous range, written once for any SIMD policy.
// Included inside an ISA namespace after `struct Scalar` and `struct Vec` are defined.
//
// One pass over memory: each vector of gradient is loaded once, converted to fp32,
// unscaled and checked in registers, then used for the update of the same elements, so
// p, m, v, the gradient and the working copy stream through together. The update stops
// before the first vector holding a non-finite value and reports where, so a caller can
// put back exactly the elements before it. The range is walked in tiles of kTile
// elements, the granularity at which threads notice another thread's abort.
//
// Arithmetic follows torch.optim.AdamW (single-tensor path): decoupled decay, lerp for
// m, addcmul for v, p += (-step_size * m) / denom, except that denom multiplies sqrt(v)
// by 1 / sqrt(bc2) instead of dividing (at most one ulp apart): the divider is the
// kernel's compute bottleneck (one divide and one square root per element remain).

constexpr int64_t kTile = 2048;
template <int D>
constexpr int64_t kGradBytes = D == kF32 ? 4 : 2;

template <class P, int D>
static inline typename P::F load_as_f32(const void* base, int64_t i) {
  if constexpr (D == kF32) {
    return P::load(static_cast<const float*>(base) + i);
  } else if constexpr (D == kF16) {
    return P::load_f16(static_cast<const uint16_t*>(base) + i);
  } else {
    return P::load_bf16(static_cast<const uint16_t*>(base) + i);
  }
}

// stream: a non-temporal store (the caller checked the alignment and fences after).
template <class P>
static inline void store_h(void* base, int64_t i, typename P::H h, bool stream = false) {
  uint16_t* const at = static_cast<uint16_t*>(base) + i;
  if (stream) {
    P::stream_h(at, h);
  } else {
    P::store_h(at, h);
  }
}

// kMayNan = false: the caller knows x holds no nan, so a bf16 rounding may skip the nan
// rule (policies where that rule is free ignore it).
template <class P, int D, bool kMayNan = true>
static inline void store_from_f32(void* base, int64_t i, typename P::F x, bool stream = false) {
  if constexpr (D == kF32) {
    float* const at = static_cast<float*>(base) + i;
    if (stream) {
      P::stream(at, x);
    } else {
      P::store(at, x);
    }
  } else if constexpr (D == kF16) {
    store_h<P>(base, i, P::to_f16(x), stream);
  } else if constexpr (D == kBF16) {
    store_h<P>(base, i, P::template to_bf16<kMayNan>(x), stream);
  }
}

// The hyper-parameters broadcast once per part into locals: read through `const Hyper&`
// inside the loop they would be reloaded after every store (a float store may alias
// them), which costs more than the arithmetic.
template <class P>
struct Consts {
  using F = typename P::F;
  F inv_scale, decay, one_minus_b1, beta1, beta2, one_minus_b2, inv_bc2_sqrt, eps, neg_step;
  F clip, undo_clip;
  explicit Consts(const Hyper& h)
      : inv_scale(P::set1(h.inv_scale)), decay(P::set1(h.decay)),
        one_minus_b1(P::set1(h.one_minus_b1)), beta1(P::set1(h.beta1)),
        beta2(P::set1(h.beta2)), one_minus_b2(P::set1(h.one_minus_b2)),
        inv_bc2_sqrt(P::set1(h.inv_bc2_sqrt)), eps(P::set1(h.eps)),
        neg_step(P::set1(h.neg_step_size)), clip(P::set1(h.clip)),
        undo_clip(P::set1(h.undo_clip)) {}
};

template <class P>
static inline void adam_forward(typename P::F& p, typename P::F& m, typename P::F& v,
                                typename P::F g, const Consts<P>& c) {
  p = P::mul(p, c.decay);
  m = P::add(m, P::mul(c.one_minus_b1, P::sub(g, m)));
  v = P::add(P::mul(v, c.beta2), P::mul(P::mul(c.one_minus_b2, g), g));
  const auto denom = P::add(P::mul(P::sqrt(v), c.inv_bc2_sqrt), c.eps);
  p = P::add(p, P::div(P::mul(c.neg_step, m), denom));
}

// Solves adam_forward for the old state, given the new state and the same gradient.
// v is clamped at zero (rounding can leave a tiny negative); nan and inf propagate.
template <class P>
static inline void adam_inverse(typename P::F& p, typename P::F& m, typename P::F& v,
                                typename P::F g, const Consts<P>& c) {
  const auto denom = P::add(P::mul(P::sqrt(v), c.inv_bc2_sqrt), c.eps);
  p = P::sub(p, P::div(P::mul(c.neg_step, m), denom));
  p = P::div(p, c.decay);
  m = P::div(P::sub(m, P::mul(c.one_minus_b1, g)), c.beta1);
  v = P::max0(P::div(P::sub(v, P::mul(P::mul(c.one_minus_b2, g), g)), c.beta2));
}

// Check only, over tile elements [lo, hi): unscale, look for inf/nan, sum squares.
template <class P, int GD>
static inline void check_part(const void* grad, int64_t base, int64_t lo, int64_t hi,
                                float inv_scale, bool& bad, double& sumsq) {
  typename P::M nonfinite = P::mask_zero();
  typename P::F sq = P::set1(0.0f);
  const auto s = P::set1(inv_scale);
  for (int64_t i = lo; i < hi; i += P::W) {
    const auto g = P::mul(load_as_f32<P, GD>(grad, base + i), s);
    nonfinite = P::nonfinite_or(nonfinite, g);
    sq = P::add(sq, P::mul(g, g));
  }
  bad = bad || P::any(nonfinite);
  sumsq += P::hsum(sq);
}

// Bytes of one element of a state (fp32 or bf16) or gradient.
constexpr int64_t bytes_of(int d) { return d == kF32 ? 4 : 2; }

// The snapshot's three parts (exact mode): [p | m | v], each in its state's dtype.
struct SnapParts {
  void* p;
  void* m;
  void* v;
};

template <int MD, int SD>
static inline SnapParts snap_parts(const Buffers& b) {
  if (!b.snap) return {nullptr, nullptr, nullptr};
  char* base = static_cast<char*>(b.snap);
  return {base, base + b.n * bytes_of(MD), base + b.n * (bytes_of(MD) + bytes_of(SD))};
}

// Software prefetch of element k of each input stream; keeps more lines in flight than
// the long dependency chain of the update lets the out-of-order window reach.
template <class P, int GD, int MD, int SD>
static inline void prefetch(const void* p, const void* m, const void* v, const void* grad,
                            int64_t k, bool on) {
  if (P::W > 1 && on) {
    P::prefetch(static_cast<const char*>(p) + k * bytes_of(MD));
    P::prefetch(static_cast<const char*>(m) + k * bytes_of(SD));
    P::prefetch(static_cast<const char*>(v) + k * bytes_of(SD));
    P::prefetch(static_cast<const char*>(grad) + k * kGradBytes<GD>);
  }
}

// Whether a step of these dtypes rounds its bf16 master stochastically.
template <int MD>
static inline bool rounds_stochastically(Op op, const Hyper& h) {
  return MD == kBF16 && h.stochastic && op != Op::kInverse;
}

// Whether the working copy's vectors from element `at` on can be stored non-temporally:
// the stream instructions need addresses aligned to the bytes they store at once.
template <int OD>
static inline bool can_stream(const Buffers& b, const Tuning& t, int64_t at, int vector_bytes) {
  if constexpr (OD == kNone) {
    return false;
  } else {
    const uintptr_t address = reinterpret_cast<uintptr_t>(b.out) + at * bytes_of(OD);
    return t.stream_out && address % vector_bytes == 0;
  }
}

// Whether a vector holds a nan among the values it rounds to bf16 (then the rounding
// needs the nan rule; on AVX2 that rule costs a compare and a blend per vector, the check
// a compare per two vectors). forward: p, m, v come from adam_forward, whose new p is
// computed from the new m and v (p + (-step * m) / (sqrt(v) * c + eps)): a nan in m or v
// makes p nan (IEEE arithmetic propagates nan), so p alone tells.
template <class P, int OD, int MD, int SD>
static inline bool rounds_nan(typename P::F p, typename P::F m, typename P::F v, bool forward) {
  constexpr bool p16 = MD == kBF16 || OD == kBF16;
  if constexpr (SD == kBF16) {
    if (forward) return P::any_nan(p, p, p);
    return P::any_nan(m, v, p16 ? p : m);
  } else if constexpr (p16) {
    return P::any_nan(p, p, p);
  } else {
    return false;
  }
}

// Whether rounds_nan looks at the new p after a forward step: then a non-finite gradient
// need not be checked before the update (adam_forward turns an inf or nan gradient into a
// nan p: m and v become inf or nan, and inf / inf, like any nan operand, gives nan), only
// where p is nan, before anything is stored. Not with a snapshot to write first, and not
// where any_nan does not look (kFindsNan false: the roundings apply the nan rule anyway).
template <class P, int OD, int MD, int SD>
constexpr bool kLateGradCheck = P::kFindsNan && (MD == kBF16 || OD == kBF16 || SD == kBF16);

// Writes the vector's new p, m, v and working copy (kMayNan: with the nan rule).
template <class P, int OD, int MD, int SD, bool kMayNan>
static inline void store_state(void* pp, void* mp, void* vp, void* out, int64_t k,
                               typename P::F p, typename P::F m, typename P::F v,
                               bool stochastic, typename P::I index, typename P::I key,
                               bool stream) {
  store_from_f32<P, SD, kMayNan>(mp, k, m);
  store_from_f32<P, SD, kMayNan>(vp, k, v);
  if constexpr (MD == kBF16) {
    // rounded once; the working copy is the stored master
    const typename P::H p16 = stochastic ? P::template round_sr<kMayNan>(p, index, key)
                                         : P::template to_bf16<kMayNan>(p);
    store_h<P>(pp, k, p16);
    if constexpr (OD == kBF16) {
      store_h<P>(out, k, p16, stream);
    } else if constexpr (OD != kNone) {
      store_from_f32<P, OD>(out, k, P::from_bf16(p16), stream);
    }
  } else {
    store_from_f32<P, MD>(pp, k, p);
    if constexpr (OD != kNone) store_from_f32<P, OD, kMayNan>(out, k, p, stream);
  }
}

// Step, inverse or correction over tile elements [lo, hi), one vector at a time: the
// gradient is read, unscaled and checked in registers right before the update that uses
// it. Stops before the first vector holding a non-finite value and returns its index (hi
// when all were finite); [lo, returned index) was updated. p, m, v are read and written
// in their dtypes (MD for p, SD for m and v) with the arithmetic in fp32; a bf16 m or v
// rounds to nearest even, a bf16 p stochastically (h.stochastic) or to nearest even.
// Template values >= 0 fix at compile time what would be tested in the loop (the step,
// the hot path, then carries no dead code that the register allocator must make room
// for): kOp the op, kExact whether there is a snapshot, kScaled whether the loss scale
// or the clip factor differs from 1 (g * 1 == g: skipping both changes no bit; bf16
// training has neither). -1: decided at run time.
template <class P, int GD, int OD, int MD, int SD, int kOp = -1, int kExact = -1,
          int kScaled = -1>
static inline int64_t update_part(Op op_arg, const Buffers& b, const Hyper& h,
                                  const Tuning& t, int64_t base, int64_t lo, int64_t hi,
                                  double& sumsq) {
  const Op op = kOp >= 0 ? static_cast<Op>(kOp) : op_arg;
  const Consts<P> c(h);
  // local copies of the pointers, for the same aliasing reason as Consts
  void* const pp = b.p;
  void* const mp = b.m;
  void* const vp = b.v;
  const void* const grad = b.grad;
  void* const out = b.out;
  const SnapParts snap = snap_parts<MD, SD>(b);
  const bool exact = kExact >= 0 ? kExact == 1 : snap.p != nullptr;
  const bool scaled = kScaled != 0;
  const bool stochastic = rounds_stochastically<MD>(op, h);
  const bool stream = op == Op::kStep && can_stream<OD>(b, t, base + lo, P::W * bytes_of(OD));
  const int64_t ahead = t.prefetch;
  const typename P::I key = P::splat(h.round_key);
  typename P::I index = P::lanes(h.index_base + static_cast<uint32_t>(base + lo));
  typename P::F sq = P::set1(0.0f);
  const bool forward = op != Op::kInverse;
  const bool late = kLateGradCheck<P, OD, MD, SD> && forward && !(exact && op == Op::kStep);
  int64_t i = lo;
  for (; i < hi; i += P::W, index = P::next(index)) {
    const int64_t k = base + i;
    prefetch<P, GD, MD, SD>(pp, mp, vp, grad, k + ahead, ahead > 0);
    const auto g16 = load_as_f32<P, GD>(grad, k);
    const auto g = scaled ? P::mul(g16, c.inv_scale) : g16;
    if (!late && P::any(P::nonfinite_or(P::mask_zero(), g))) break;
    typename P::F p, m, v;
    if (op == Op::kCorrect && exact) {  // the pre-step state, bit-exact
      p = load_as_f32<P, MD>(snap.p, k);
      m = load_as_f32<P, SD>(snap.m, k);
      v = load_as_f32<P, SD>(snap.v, k);
    } else {
      p = load_as_f32<P, MD>(pp, k);
      m = load_as_f32<P, SD>(mp, k);
      v = load_as_f32<P, SD>(vp, k);
    }
    if (op == Op::kStep) {
      if (exact) {  // exact copies: each value is representable in its dtype
        store_from_f32<P, MD>(snap.p, k, p);
        store_from_f32<P, SD>(snap.m, k, m);
        store_from_f32<P, SD>(snap.v, k, v);
      }
      adam_forward<P>(p, m, v, scaled ? P::mul(g, c.clip) : g, c);
    } else if (op == Op::kCorrect) {
      if (!exact) adam_inverse<P>(p, m, v, P::mul(g, c.undo_clip), c);
      adam_forward<P>(p, m, v, P::mul(g, c.clip), c);
    } else {
      adam_inverse<P>(p, m, v, P::mul(g, c.clip), c);
    }
    // rare (__builtin_expect): GCC then keeps the nan rule's constants out of the loop's
    // registers, not the hyper-parameters and sums (3 % of the all-bf16 step on AVX2)
    if (__builtin_expect(rounds_nan<P, OD, MD, SD>(p, m, v, forward), 0)) {
      if (late && P::any(P::nonfinite_or(P::mask_zero(), g))) break;
      store_state<P, OD, MD, SD, true>(pp, mp, vp, out, k, p, m, v, stochastic, index, key, stream);
    } else {
      store_state<P, OD, MD, SD, false>(pp, mp, vp, out, k, p, m, v, stochastic, index, key, stream);
    }
    sq = P::add(sq, P::mul(g, g));
  }
  if (stream) P::fence();  // the streamed copy is visible before the call returns
  sumsq += P::hsum(sq);
  return i;
}

// Op::kTouch: the bytes a step of these dtypes moves (p, m, v read and written in their
// dtypes, the gradient read, the working copy written), as raw words, with neither
// conversion nor arithmetic: the streaming limit of the step's own traffic. Element k of
// a stream starts at word k * bytes / 4 (k even); 2W elements fill W words of a 16-bit
// stream and 2W of an fp32 one.
template <int D>
static inline float* words_at(const void* base, int64_t k) {
  return static_cast<float*>(const_cast<void*>(base)) + k * bytes_of(D) / 4;
}

template <class P, int D>
static inline void touch_read_write(void* base, int64_t k) {
  float* const w = words_at<D>(base, k);
  for (int j = 0; j < bytes_of(D) / 2; ++j) P::store(w + j * P::W, P::opaque(P::load(w + j * P::W)));
}

template <class P, int GD, int OD, int MD, int SD, bool kStream>
static inline void touch_part(const Buffers& b, const Tuning& t, int64_t base, int64_t lo,
                              int64_t hi) {
  const auto zero = P::set1(0.0f);
  for (int64_t i = lo; i < hi; i += 2 * P::W) {
    const int64_t k = base + i;
    prefetch<P, GD, MD, SD>(b.p, b.m, b.v, b.grad, k + t.prefetch, t.prefetch > 0);
    for (int j = 0; j < bytes_of(GD) / 2; ++j) P::keep(P::load(words_at<GD>(b.grad, k) + j * P::W));
    touch_read_write<P, MD>(b.p, k);
    touch_read_write<P, SD>(b.m, k);
    touch_read_write<P, SD>(b.v, k);
    if constexpr (OD != kNone) {
      for (int j = 0; j < bytes_of(OD) / 2; ++j) {
        float* const w = words_at<OD>(b.out, k) + j * P::W;
        if constexpr (kStream) P::stream(w, zero); else P::store(w, zero);
      }
    }
  }
  if constexpr (kStream) P::fence();
}

// Copies p, m, v back from the snapshot over tile elements [lo, hi).
template <class P, int OD, int MD, int SD>
static inline void restore_part(const Buffers& b, int64_t base, int64_t lo, int64_t hi) {
  const SnapParts snap = snap_parts<MD, SD>(b);
  for (int64_t i = lo; i < hi; i += P::W) {
    const int64_t k = base + i;
    const auto p = load_as_f32<P, MD>(snap.p, k);
    store_from_f32<P, MD>(b.p, k, p);
    store_from_f32<P, SD>(b.m, k, load_as_f32<P, SD>(snap.m, k));
    store_from_f32<P, SD>(b.v, k, load_as_f32<P, SD>(snap.v, k));
    store_from_f32<P, OD>(b.out, k, p);
  }
}

// The update's vector policy: VecBf16 where every stream is bf16, VecBf16States where an
// fp32 master sits beside bf16 m and v (an ISA may lay those vectors out differently, see
// isa_avx2.cpp), Vec otherwise.
template <int GD, int OD, int MD, int SD>
constexpr bool kAllBf16 =
    GD == kBF16 && (OD == kBF16 || OD == kNone) && MD == kBF16 && SD == kBF16;
template <bool kBf16, class A, class B>
struct PickPolicy {
  using type = B;
};
template <class A, class B>
struct PickPolicy<true, A, B> {
  using type = A;
};
// VecBf16States: an fp32 master beside bf16 m and v, no fp16 stream.
template <int GD, int OD, int MD, int SD>
constexpr bool kBf16States = MD == kF32 && SD == kBF16 && GD != kF16 && OD != kF16;
template <int GD, int OD, int MD, int SD>
using UpdateVec = typename PickPolicy<
    kAllBf16<GD, OD, MD, SD>, VecBf16,
    typename PickPolicy<kBf16States<GD, OD, MD, SD>, VecBf16States, Vec>::type>::type;

template <int GD, int OD, int MD, int SD>
static int64_t update_vectors(Op op, const Buffers& b, const Hyper& h, const Tuning& t,
                              int64_t base, int64_t lo, int64_t hi, double& sumsq) {
  using V = UpdateVec<GD, OD, MD, SD>;
  if (op != Op::kStep) return update_part<V, GD, OD, MD, SD>(op, b, h, t, base, lo, hi, sumsq);
  constexpr int kStep = static_cast<int>(Op::kStep);
  const bool exact = b.snap != nullptr;
  const bool scaled = h.inv_scale != 1.0f || h.clip != 1.0f;
  if (exact) {
    return scaled ? update_part<V, GD, OD, MD, SD, kStep, 1, 1>(op, b, h, t, base, lo, hi, sumsq)
                  : update_part<V, GD, OD, MD, SD, kStep, 1, 0>(op, b, h, t, base, lo, hi, sumsq);
  }
  return scaled ? update_part<V, GD, OD, MD, SD, kStep, 0, 1>(op, b, h, t, base, lo, hi, sumsq)
                : update_part<V, GD, OD, MD, SD, kStep, 0, 0>(op, b, h, t, base, lo, hi, sumsq);
}

// Step, inverse or correction over the tile's elements [0, len); returns where it stopped
// (len when every gradient was finite). Vectors of the stochastic rounding start at an
// even element index (two lanes share a hash), so an odd start goes first alone.
template <int GD, int OD, int MD, int SD>
static int64_t update_tile(Op op, const Buffers& b, const Hyper& h, const Tuning& t,
                           int64_t base, int64_t len, double& sumsq) {
  using V = UpdateVec<GD, OD, MD, SD>;
  const bool odd = rounds_stochastically<MD>(op, h) &&
                   ((h.index_base + static_cast<uint32_t>(base)) & 1u) && len > 0;
  const int64_t head = odd ? 1 : 0;
  int64_t done = update_part<Scalar, GD, OD, MD, SD>(op, b, h, t, base, 0, head, sumsq);
  if (done != head) return done;
  const int64_t nv = head + (len - head) - (len - head) % V::W;
  done = update_vectors<GD, OD, MD, SD>(op, b, h, t, base, head, nv, sumsq);
  if (done != nv) return done;
  return update_part<Scalar, GD, OD, MD, SD>(op, b, h, t, base, nv, len, sumsq);
}

template <int GD, int OD, int MD, int SD>
static RangeResult range_impl(Op op, const Buffers& b, const Hyper& h, const Tuning& tune,
                              int64_t begin, int64_t end, int* abort) {
  RangeResult r{begin, true, 0.0};
  for (int64_t t = begin; t < end; t += kTile) {
    if (abort && __atomic_load_n(abort, __ATOMIC_RELAXED)) return r;
    const int64_t len = (end - t < kTile) ? end - t : kTile;
    const int64_t nv = len - len % Vec::W;
    if (op == Op::kTouch) {
      const int64_t even = len - len % (2 * Vec::W);
      if (can_stream<OD>(b, tune, t, Vec::W * 4)) {  // words of W floats
        touch_part<Vec, GD, OD, MD, SD, true>(b, tune, t, 0, even);
      } else {
        touch_part<Vec, GD, OD, MD, SD, false>(b, tune, t, 0, even);
      }
      touch_part<Scalar, GD, OD, MD, SD, false>(b, tune, t, even, len - len % 2);
    } else if (op == Op::kRestore) {
      restore_part<Vec, OD, MD, SD>(b, t, 0, nv);
      restore_part<Scalar, OD, MD, SD>(b, t, nv, len);
    } else if (op == Op::kCheck) {
      bool bad = false;
      check_part<Vec, GD>(b.grad, t, 0, nv, h.inv_scale, bad, r.sumsq);
      check_part<Scalar, GD>(b.grad, t, nv, len, h.inv_scale, bad, r.sumsq);
      if (bad) r.finite = false;
    } else {
      const int64_t done = update_tile<GD, OD, MD, SD>(op, b, h, tune, t, len, r.sumsq);
      if (done != len) {
        r.stop = t + done;
        r.finite = false;
      }
    }
    if (!r.finite) {
      if (abort) __atomic_store_n(abort, 1, __ATOMIC_RELAXED);
      return r;
    }
    r.stop = t + len;
  }
  return r;
}

template <int GD, int OD>
static RangeResult range_for_states(Op op, const Buffers& b, const Hyper& h, const Tuning& t,
                                    int64_t begin, int64_t end, int* abort) {
  const bool bf16_master = b.master_dtype == kBF16;
  const bool bf16_states = b.state_dtype == kBF16;
  if (bf16_master && bf16_states) return range_impl<GD, OD, kBF16, kBF16>(op, b, h, t, begin, end, abort);
  if (bf16_master) return range_impl<GD, OD, kBF16, kF32>(op, b, h, t, begin, end, abort);
  if (bf16_states) return range_impl<GD, OD, kF32, kBF16>(op, b, h, t, begin, end, abort);
  return range_impl<GD, OD, kF32, kF32>(op, b, h, t, begin, end, abort);
}

template <int GD>
static RangeResult range_for_out(Op op, const Buffers& b, const Hyper& h, const Tuning& t,
                                 int64_t begin, int64_t end, int* abort) {
  switch (b.out_dtype) {
    case kF32: return range_for_states<GD, kF32>(op, b, h, t, begin, end, abort);
    case kF16: return range_for_states<GD, kF16>(op, b, h, t, begin, end, abort);
    case kBF16: return range_for_states<GD, kBF16>(op, b, h, t, begin, end, abort);
    default: return range_for_states<GD, kNone>(op, b, h, t, begin, end, abort);
  }
}

RangeResult run_range(Op op, const Buffers& b, const Hyper& h, const Tuning& t, int64_t begin,
                      int64_t end, int* abort) {
  switch (b.grad_dtype) {
    case kF16: return range_for_out<kF16>(op, b, h, t, begin, end, abort);
    case kBF16: return range_for_out<kBF16>(op, b, h, t, begin, end, abort);
    default: return range_for_out<kF32>(op, b, h, t, begin, end, abort);
  }
}
