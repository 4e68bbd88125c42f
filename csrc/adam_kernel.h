// The AdamW step over one contiguous range, written once for any SIMD policy.
// Included inside an ISA namespace after `struct Scalar` and `struct Vec` are defined.
//
// The range is walked in tiles that fit in L1: phase A reads the tile's gradient from
// memory once (converted to fp32 and unscaled into a tile buffer, checked for
// non-finite values, squared and summed); phase B updates the tile from that buffer.
// A tile with a non-finite gradient is never updated, so a caller can restore exactly
// the tiles before it.
//
// Arithmetic follows torch.optim.AdamW (single-tensor path): decoupled decay, lerp for
// m, addcmul for v, p += (-step_size * m) / denom, except that denom multiplies sqrt(v)
// by 1 / sqrt(bc2) instead of dividing (at most one ulp apart): the divider is the
// kernel's compute bottleneck (one divide and one square root per element remain).

constexpr int64_t kTile = 2048;

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

template <class P, int D>
static inline void store_from_f32(void* base, int64_t i, typename P::F x) {
  if constexpr (D == kF32) {
    P::store(static_cast<float*>(base) + i, x);
  } else if constexpr (D == kF16) {
    P::store_f16(static_cast<uint16_t*>(base) + i, x);
  } else if constexpr (D == kBF16) {
    P::store_bf16(static_cast<uint16_t*>(base) + i, x);
  }
}

template <class P>
static inline void adam_forward(typename P::F& p, typename P::F& m, typename P::F& v,
                                typename P::F g, const Hyper& h) {
  p = P::mul(p, P::set1(h.decay));
  m = P::add(m, P::mul(P::set1(h.one_minus_b1), P::sub(g, m)));
  v = P::add(P::mul(v, P::set1(h.beta2)), P::mul(P::mul(P::set1(h.one_minus_b2), g), g));
  const auto denom = P::add(P::mul(P::sqrt(v), P::set1(h.inv_bc2_sqrt)), P::set1(h.eps));
  p = P::add(p, P::div(P::mul(P::set1(h.neg_step_size), m), denom));
}

// Solves adam_forward for the old state, given the new state and the same gradient.
// v is clamped at zero (rounding can leave a tiny negative); nan and inf propagate.
template <class P>
static inline void adam_inverse(typename P::F& p, typename P::F& m, typename P::F& v,
                                typename P::F g, const Hyper& h) {
  const auto denom = P::add(P::mul(P::sqrt(v), P::set1(h.inv_bc2_sqrt)), P::set1(h.eps));
  p = P::sub(p, P::div(P::mul(P::set1(h.neg_step_size), m), denom));
  p = P::div(p, P::set1(h.decay));
  m = P::div(P::sub(m, P::mul(P::set1(h.one_minus_b1), g)), P::set1(h.beta1));
  v = P::max0(P::div(P::sub(v, P::mul(P::mul(P::set1(h.one_minus_b2), g), g)),
                     P::set1(h.beta2)));
}

// Phase A over tile elements [lo, hi): unscale into buf (when given), check, sum squares.
template <class P, int GD>
static inline void unscale_part(const void* grad, int64_t base, int64_t lo, int64_t hi,
                                float* buf, float inv_scale, bool& bad, double& sumsq) {
  typename P::M nonfinite = P::mask_zero();
  typename P::F sq = P::set1(0.0f);
  const auto s = P::set1(inv_scale);
  for (int64_t i = lo; i < hi; i += P::W) {
    const auto g = P::mul(load_as_f32<P, GD>(grad, base + i), s);
    nonfinite = P::nonfinite_or(nonfinite, g);
    sq = P::add(sq, P::mul(g, g));
    if (buf) P::store(buf + i, g);
  }
  bad = bad || P::any(nonfinite);
  sumsq += P::hsum(sq);
}

// Phase B over tile elements [lo, hi).
template <class P, int OD>
static inline void update_part(Op op, const Buffers& b, const Hyper& h, int64_t base,
                               int64_t lo, int64_t hi, const float* gbuf) {
  for (int64_t i = lo; i < hi; i += P::W) {
    const int64_t k = base + i;
    auto p = P::load(b.p + k);
    auto m = P::load(b.m + k);
    auto v = P::load(b.v + k);
    if (op == Op::kRestore) {
      p = P::load(b.snap + k);
      m = P::load(b.snap + b.n + k);
      v = P::load(b.snap + 2 * b.n + k);
    } else {
      const auto g = P::load(gbuf + i);
      if (op == Op::kStep) {
        if (b.snap) {
          P::store(b.snap + k, p);
          P::store(b.snap + b.n + k, m);
          P::store(b.snap + 2 * b.n + k, v);
        }
        adam_forward<P>(p, m, v, g, h);
      } else {
        adam_inverse<P>(p, m, v, g, h);
      }
    }
    P::store(b.p + k, p);
    P::store(b.m + k, m);
    P::store(b.v + k, v);
    store_from_f32<P, OD>(b.out, k, p);
  }
}

template <int GD, int OD>
static RangeResult range_impl(Op op, const Buffers& b, const Hyper& h, int64_t begin,
                              int64_t end, int* abort) {
  alignas(64) float buf[kTile];
  RangeResult r{begin, true, 0.0};
  for (int64_t t = begin; t < end; t += kTile) {
    if (abort && __atomic_load_n(abort, __ATOMIC_RELAXED)) return r;
    const int64_t len = (end - t < kTile) ? end - t : kTile;
    const int64_t nv = len - len % Vec::W;
    if (op != Op::kRestore) {
      bool bad = false;
      double sq = 0.0;
      float* dst = (op == Op::kCheck) ? nullptr : buf;
      unscale_part<Vec, GD>(b.grad, t, 0, nv, dst, h.inv_scale, bad, sq);
      unscale_part<Scalar, GD>(b.grad, t, nv, len, dst, h.inv_scale, bad, sq);
      if (bad) {
        r.finite = false;
        if (abort) __atomic_store_n(abort, 1, __ATOMIC_RELAXED);
        return r;
      }
      r.sumsq += sq;
    }
    if (op != Op::kCheck) {
      update_part<Vec, OD>(op, b, h, t, 0, nv, buf);
      update_part<Scalar, OD>(op, b, h, t, nv, len, buf);
    }
    r.stop = t + len;
  }
  return r;
}

template <int GD>
static RangeResult range_for_out(Op op, const Buffers& b, const Hyper& h, int64_t begin,
                                 int64_t end, int* abort) {
  switch (b.out_dtype) {
    case kF32: return range_impl<GD, kF32>(op, b, h, begin, end, abort);
    case kF16: return range_impl<GD, kF16>(op, b, h, begin, end, abort);
    case kBF16: return range_impl<GD, kBF16>(op, b, h, begin, end, abort);
    default: return range_impl<GD, kNone>(op, b, h, begin, end, abort);
  }
}

RangeResult run_range(Op op, const Buffers& b, const Hyper& h, int64_t begin, int64_t end,
                      int* abort) {
  switch (b.grad_dtype) {
    case kF16: return range_for_out<kF16>(op, b, h, begin, end, abort);
    case kBF16: return range_for_out<kBF16>(op, b, h, begin, end, abort);
    default: return range_for_out<kF32>(op, b, h, begin, end, abort);
  }
}
