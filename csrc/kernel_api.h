// Interface between the dispatcher (cpu_adam.cpp) and the per-ISA kernels.
// Each ISA translation unit compiles adam_kernel.h inside its own namespace with its
// own target flags, so no inline function compiled for AVX-512 can be picked by the
// linker for a CPU without it. Keep this header free of STL includes for that reason.
#pragma once
#include <cstdint>

// x86-64 builds carry the AVX2 and AVX-512 kernels; elsewhere (aarch64) only the portable
// one. -DCPU_ADAM_PORTABLE_ONLY builds the portable-only module on x86 as well (how the
// non-x86 path is compiled and tested on an x86 machine).
#if defined(__x86_64__) && !defined(CPU_ADAM_PORTABLE_ONLY)
#define CPU_ADAM_X86 1
#endif

namespace cpu_adam {

// Element types of the gradient and of the working copy; kNone: no working copy.
enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kNone = -1 };

enum class Op : int {
  kStep = 0,     // unscale, check, AdamW update, write the working copy
  kInverse = 1,  // arithmetic inverse of kStep with the same gradient and hyper-parameters
  kRestore = 2,  // copy p, m, v back from the snapshot, rewrite the working copy
  kCheck = 3,    // unscale and check only (the synchronous baseline's first pass)
  // Recover the state before a step made with clip factor `undo_clip` (snapshot when
  // there is one, else the inverse) and apply the step with `clip` instead, in one pass:
  // reads p, m, v, grad once, writes p, m, v and the working copy once.
  kCorrect = 4,
  // Benchmark probe: the step's memory traffic without its arithmetic (reads p, m, v and
  // the gradient, writes p, m, v and the working copy, values not meaningful), which
  // tells how far the step is from the byte limit of its own streams.
  kTouch = 5,
};

// p (the master), m and v are fp32 or bf16: master_dtype for p, state_dtype for m and v.
struct Buffers {
  void* p;
  void* m;
  void* v;
  const void* grad;
  void* out;      // working copy (may be null when out_dtype == kNone)
  // exact mode: the pre-step p, m, v in their own dtypes, laid out as [p | m | v]
  // (n elements each); null otherwise
  void* snap;
  int64_t n;
  int grad_dtype;
  int out_dtype;
  int master_dtype;  // kF32 or kBF16
  int state_dtype;   // kF32 or kBF16
};

// Hyper-parameters of one step, already folded into the constants the update uses.
struct Hyper {
  float inv_scale;
  float decay;          // 1 - lr * weight_decay
  float one_minus_b1;
  float beta1;
  float beta2;
  float one_minus_b2;
  float inv_bc2_sqrt;   // 1 / sqrt(1 - beta2^t): a multiply, not a divide, per element
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^t)
  // Gradient clip factor, applied after the unscaling (the sum of squares is taken
  // before it, so it is the unclipped norm's): g_step = (g * inv_scale) * clip.
  float clip;
  float undo_clip;      // kCorrect: the clip factor of the step being corrected
  // Stochastic rounding of a bf16 master (kStep, kCorrect): element k of the call, whose
  // index inside its parameter is i = index_base + k (uint32 arithmetic), gets the 16
  // random bits of h = fmix32((i >> 1) ^ round_key): its low half for an even i, its high
  // half for an odd one; round_key mixes the seed, the parameter and the step
  // (megatron/optimizer/rounding.py). The caller splits a range where the parameter
  // changes. stochastic == 0: round to nearest even.
  int stochastic;
  uint32_t index_base;
  uint32_t round_key;
};

// Knobs that change the speed of a call, never its result (every setting gives the same
// bits: tests/test_cpu_adam_tuning.py). Set per process by set_tuning(), initialised from
// CPU_ADAM_PREFETCH, CPU_ADAM_STREAM_OUT and CPU_ADAM_BLOCK (docs/cpu_optimizer.md).
struct Tuning {
  int64_t prefetch;  // elements ahead each stream is software-prefetched; 0: none
  int stream_out;    // non-temporal stores for the working copy of a step (when aligned)
  int64_t block;     // elements per block the threads take from the shared counter
  int static_split;  // each worker first takes its own contiguous share of the blocks
};

struct RangeResult {
  int64_t stop;   // elements in [begin, stop) were changed by this call
  bool finite;    // every unscaled gradient in [begin, stop) was finite
  double sumsq;   // sum of squares of the unscaled gradient over [begin, stop)
};

// `abort` is shared by the threads of one call: the first one that sees a non-finite
// gradient sets it and the others stop at their next tile.
#define CPU_ADAM_DECLARE_ISA(ns)                                                     \
  namespace ns {                                                                     \
  RangeResult run_range(Op op, const Buffers& b, const Hyper& h, const Tuning& t,    \
                        int64_t begin, int64_t end, int* abort);                     \
  }

CPU_ADAM_DECLARE_ISA(isa_portable)
#if defined(CPU_ADAM_X86)
CPU_ADAM_DECLARE_ISA(isa_avx2)
CPU_ADAM_DECLARE_ISA(isa_avx512)
#endif

}  // namespace cpu_adam
