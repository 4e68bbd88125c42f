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

// kStream: a non-temporal store (the caller checked the alignment and fences after)
template <class P, int D, bool kStream = false>
static inline void store_h(void* base, int64_t i, typename P::H h) {
  uint16_t* const at = static_cast<uint16_t*>(base) + i;
  if constexpr (kStream) {
    P::stream_h(at, h);
  } else {
    P::store_h(at, h);
  }
}

template <class P, int D, bool kStream = false>
static inline void store_from_f32(void* base, int64_t i, typename P::F x) {
  if constexpr (D == kF32) {
    float* const at = static_cast<float*>(base) + i;
    if constexpr (kStream) {
      P::stream(at, x);
    } else {
      P::store(at, x);
    }
  } else if constexpr (D == kF16) {
    store_h<P, D, kStream>(base, i, P::to_f16(x));
  } else if constexpr (D == kBF16) {
    store_h<P, D, kStream>(base, i, P::to_bf16(x));
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
    __builtin_prefetch(static_cast<const char*>(p) + k * bytes_of(MD), 1);
    __builtin_prefetch(static_cast<const char*>(m) + k * bytes_of(SD), 1);
    __builtin_prefetch(static_cast<const char*>(v) + k * bytes_of(SD), 1);
    __builtin_prefetch(static_cast<const char*>(grad) + k * kGradBytes<GD>, 0);
  }
}

// Step, inverse or correction over tile elements [lo, hi), one vector at a time: the
// gradient is read, unscaled and checked in registers right before the update that uses
// it. Stops before the first vector holding a non-finite value and returns its index (hi
// when all were finite); [lo, returned index) was updated. p, m, v are read and written
// in their dtypes (MD for p, SD for m and v) with the arithmetic in fp32; a bf16 m or v
// rounds to nearest even, a bf16 p stochastically (h.stochastic) or to nearest even.
// kOp >= 0 fixes the op at compile time (the step, the hot path, then has no op tests in
// its loop); kOp < 0 takes it from `op`. kStream: non-temporal stores for the working copy.
template <class P, int GD, int OD, int MD, int SD, int kOp = -1, bool kStream = false>
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
  const bool stochastic = MD == kBF16 && h.stochastic && op != Op::kInverse;
  const int64_t ahead = t.prefetch;
  const typename P::I key = P::splat(h.round_key);
  typename P::I index = P::lanes(h.index_base + static_cast<uint32_t>(base + lo));
  typename P::F sq = P::set1(0.0f);
  int64_t i = lo;
  for (; i < hi; i += P::W, index = P::next(index)) {
    const int64_t k = base + i;
    prefetch<P, GD, MD, SD>(pp, mp, vp, grad, k + ahead, ahead > 0);
    const auto g = P::mul(load_as_f32<P, GD>(grad, k), c.inv_scale);
    if (P::any(P::nonfinite_or(P::mask_zero(), g))) break;
    sq = P::add(sq, P::mul(g, g));
    typename P::F p, m, v;
    if (op == Op::kCorrect && snap.p) {  // the pre-step state, bit-exact
      p = load_as_f32<P, MD>(snap.p, k);
      m = load_as_f32<P, SD>(snap.m, k);
      v = load_as_f32<P, SD>(snap.v, k);
    } else {
      p = load_as_f32<P, MD>(pp, k);
      m = load_as_f32<P, SD>(mp, k);
      v = load_as_f32<P, SD>(vp, k);
    }
    if (op == Op::kStep) {
      if (snap.p) {  // exact copies: each value is representable in its dtype
        store_from_f32<P, MD>(snap.p, k, p);
        store_from_f32<P, SD>(snap.m, k, m);
        store_from_f32<P, SD>(snap.v, k, v);
      }
      adam_forward<P>(p, m, v, P::mul(g, c.clip), c);
    } else if (op == Op::kCorrect) {
      if (!snap.p) adam_inverse<P>(p, m, v, P::mul(g, c.undo_clip), c);
      adam_forward<P>(p, m, v, P::mul(g, c.clip), c);
    } else {
      adam_inverse<P>(p, m, v, P::mul(g, c.clip), c);
    }
    store_from_f32<P, SD>(mp, k, m);
    store_from_f32<P, SD>(vp, k, v);
    if constexpr (MD == kBF16) {
      // rounded once; the working copy is the stored master
      const typename P::H p16 = stochastic ? P::round_sr(p, index, key) : P::to_bf16(p);
      store_h<P, MD>(pp, k, p16);
      if constexpr (OD == kBF16) {
        store_h<P, OD, kStream>(out, k, p16);
      } else if constexpr (OD != kNone) {
        store_from_f32<P, OD, kStream>(out, k, P::from_bf16(p16));
      }
    } else {
      store_from_f32<P, MD>(pp, k, p);
      if constexpr (OD != kNone) store_from_f32<P, OD, kStream>(out, k, p);
    }
  }
  if constexpr (kStream) P::fence();  // the streamed copy is visible before the call returns
  sumsq += P::hsum(sq);
  return i;
}

// Op::kTouch over tile elements [lo, hi): the loads and stores of a step (same streams,
// prefetch and stores) with one add in place of the update, so that nothing is elided.
template <class P, int GD, int OD, int MD, int SD, bool kStream>
static inline void touch_part(const Buffers& b, const Tuning& t, int64_t base, int64_t lo,
                              int64_t hi) {
  const auto zero = P::set1(0.0f);
  for (int64_t i = lo; i < hi; i += P::W) {
    const int64_t k = base + i;
    prefetch<P, GD, MD, SD>(b.p, b.m, b.v, b.grad, k + t.prefetch, t.prefetch > 0);
    const auto z = P::mul(load_as_f32<P, GD>(b.grad, k), zero);
    const auto p = P::add(load_as_f32<P, MD>(b.p, k), z);
    store_from_f32<P, MD>(b.p, k, p);
    store_from_f32<P, SD>(b.m, k, P::add(load_as_f32<P, SD>(b.m, k), z));
    store_from_f32<P, SD>(b.v, k, P::add(load_as_f32<P, SD>(b.v, k), z));
    store_from_f32<P, OD, kStream>(b.out, k, p);
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

// Whether the working copy's vectors from element `at` on can be stored non-temporally:
// the stream instructions need addresses aligned to the vector's bytes.
template <int OD>
static inline bool can_stream(const Buffers& b, const Tuning& t, int64_t at) {
  if constexpr (OD == kNone) {
    return false;
  } else {
    const uintptr_t address = reinterpret_cast<uintptr_t>(b.out) + at * bytes_of(OD);
    return t.stream_out && address % (Vec::W * bytes_of(OD)) == 0;
  }
}

template <int GD, int OD, int MD, int SD>
static int64_t update_vectors(Op op, const Buffers& b, const Hyper& h, const Tuning& t,
                              int64_t base, int64_t hi, double& sumsq) {
  if (op != Op::kStep) return update_part<Vec, GD, OD, MD, SD>(op, b, h, t, base, 0, hi, sumsq);
  if constexpr (OD != kNone && Vec::W > 1) {
    if (can_stream<OD>(b, t, base)) {
      return update_part<Vec, GD, OD, MD, SD, static_cast<int>(Op::kStep), true>(
          op, b, h, t, base, 0, hi, sumsq);
    }
  }
  return update_part<Vec, GD, OD, MD, SD, static_cast<int>(Op::kStep)>(op, b, h, t, base, 0,
                                                                        hi, sumsq);
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
      if (can_stream<OD>(b, tune, t)) {
        touch_part<Vec, GD, OD, MD, SD, true>(b, tune, t, 0, nv);
      } else {
        touch_part<Vec, GD, OD, MD, SD, false>(b, tune, t, 0, nv);
      }
      touch_part<Scalar, GD, OD, MD, SD, false>(b, tune, t, nv, len);
    } else if (op == Op::kRestore) {
      restore_part<Vec, OD, MD, SD>(b, t, 0, nv);
      restore_part<Scalar, OD, MD, SD>(b, t, nv, len);
    } else if (op == Op::kCheck) {
      bool bad = false;
      check_part<Vec, GD>(b.grad, t, 0, nv, h.inv_scale, bad, r.sumsq);
      check_part<Scalar, GD>(b.grad, t, nv, len, h.inv_scale, bad, r.sumsq);
      if (bad) r.finite = false;
    } else {
      int64_t done = update_vectors<GD, OD, MD, SD>(op, b, h, tune, t, nv, r.sumsq);
      if (done == nv) {
        done = update_part<Scalar, GD, OD, MD, SD>(op, b, h, tune, t, nv, len, r.sumsq);
      }
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
