// pybind11 entry points of megatron.optimizer._cpu_adam: ISA dispatch and the worker pool.
// Buffers arrive as raw addresses + sizes + dtype codes; the Python layer
// (megatron/optimizer/cpu_adam.py) owns the tensors and validates them.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernel_api.h"
#include "worker_pool.h"

namespace py = pybind11;

namespace cpu_adam {
namespace {

using RangeFn = RangeResult (*)(Op, const Buffers&, const Hyper&, const Tuning&, int64_t,
                                int64_t, int*);

// Threads take blocks of `block` elements from a shared counter, so that a thread slowed
// down by other work on its core (another rank, a data loader) holds up no one. Default:
// 16 tiles, a multiple of 64 elements, so no two threads share a cache line.
// prefetch: 1 KiB of each fp32 stream ahead (BENCHMARKS.md, "CPU optimizer": 0-4% at 20M
// parameters on Zen 3, within the rounds' spread; the hardware prefetchers do most of it).
// stream_out: the 16-bit working copy is stored non-temporally (where aligned), so its lines
// are not read into the cache first: 28 bytes a parameter moved instead of 30; the fp32
// step ran 1.04-1.10x faster with it in three quiet runs (BENCHMARKS.md, "CPU optimizer").
constexpr Tuning kDefaultTuning{256, 1, 16 * 2048, 0};

int64_t env_int(const char* name, int64_t fallback) {
  const char* text = std::getenv(name);
  if (!text || !*text) return fallback;
  try {
    return std::stoll(text);
  } catch (const std::exception&) {
    throw std::invalid_argument(std::string(name) + "=" + text + " is not an integer");
  }
}

void check_tuning(const Tuning& t) {
  if (t.prefetch < 0 || t.prefetch > (1 << 20)) {
    throw std::invalid_argument("prefetch=" + std::to_string(t.prefetch) + " must lie in [0, 2^20] (CPU_ADAM_PREFETCH)");
  }
  if (t.block < 64 || t.block % 64 != 0) {
    throw std::invalid_argument("block=" + std::to_string(t.block) + " must be a positive multiple of 64 (CPU_ADAM_BLOCK)");
  }
}

Tuning tuning_from_env() {
  Tuning t{env_int("CPU_ADAM_PREFETCH", kDefaultTuning.prefetch),
           static_cast<int>(env_int("CPU_ADAM_STREAM_OUT", kDefaultTuning.stream_out) != 0),
           env_int("CPU_ADAM_BLOCK", kDefaultTuning.block),
           static_cast<int>(env_int("CPU_ADAM_STATIC_SPLIT", kDefaultTuning.static_split) != 0)};
  check_tuning(t);
  return t;
}

// Read by every call while it holds the GIL, so a set_tuning() never lands mid-call.
Tuning g_tuning = kDefaultTuning;

struct IsaEntry {
  const char* name;
  RangeFn fn;
};

std::vector<IsaEntry> available() {
  std::vector<IsaEntry> isas{{"portable", &isa_portable::run_range}};
#if defined(CPU_ADAM_X86)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (avx2) isas.push_back({"avx2", &isa_avx2::run_range});
  if (avx2 && __builtin_cpu_supports("avx512f")) isas.push_back({"avx512", &isa_avx512::run_range});
#endif
  return isas;
}

std::vector<std::string> available_names() {
  std::vector<std::string> names;
  for (const auto& e : available()) names.emplace_back(e.name);
  return names;
}

RangeFn resolve(const std::string& isa) {
  const auto isas = available();
  if (isa == "auto") return isas.back().fn;  // listed from least to most capable
  std::string names;
  for (const auto& e : isas) {
    if (isa == e.name) return e.fn;
    names += names.empty() ? e.name : std::string(", ") + e.name;
  }
  throw std::invalid_argument("isa='" + isa + "' is not available on this CPU; expected auto or one of: " + names);
}

struct Blocks {
  int64_t n;
  int64_t size;
  int64_t count;
  int64_t begin(int64_t k) const { return k * size; }
  int64_t end(int64_t k) const { return (k + 1) * size < n ? (k + 1) * size : n; }
};

Blocks blocks_of(int64_t n, const Tuning& t) { return {n, t.block, (n + t.block - 1) / t.block}; }

Hyper make_hyper(double lr, double beta1, double beta2, double eps, double weight_decay,
                 int64_t step, double inv_scale, double clip, double undo_clip = 1.0) {
  // Same double-precision scalars as torch.optim.AdamW computes in Python.
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  Hyper h;
  h.inv_scale = static_cast<float>(inv_scale);
  h.decay = static_cast<float>(1.0 - lr * weight_decay);
  h.one_minus_b1 = static_cast<float>(1.0 - beta1);
  h.beta1 = static_cast<float>(beta1);
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_b2 = static_cast<float>(1.0 - beta2);
  h.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  h.eps = static_cast<float>(eps);
  h.neg_step_size = static_cast<float>(-(lr / bc1));
  h.clip = static_cast<float>(clip);
  h.undo_clip = static_cast<float>(undo_clip);
  h.stochastic = 0;
  h.index_base = 0;
  h.round_key = 0;
  return h;
}

// The caller's state dtypes and stochastic rounding, passed as one argument.
struct StateFormat {
  int master_dtype = kF32;
  int state_dtype = kF32;
  // Stochastic rounding of a bf16 master: rows of (begin, end, index_base, round_key) that
  // tile [0, n) (elements [begin, end) belong to one parameter, see Hyper); empty: none.
  std::vector<std::array<int64_t, 4>> runs;
};

Buffers make_buffers(uintptr_t p, uintptr_t m, uintptr_t v, uintptr_t grad, int grad_dtype,
                     uintptr_t out, int out_dtype, uintptr_t snapshot, int64_t n,
                     const StateFormat& format = StateFormat{}) {
  for (const int d : {format.master_dtype, format.state_dtype}) {
    if (d != kF32 && d != kBF16) {
      throw std::invalid_argument("state dtype=" + std::to_string(d) + " is not 0 (fp32) or 2 (bf16)");
    }
  }
  if (grad_dtype < kF32 || grad_dtype > kBF16) {
    throw std::invalid_argument("grad_dtype=" + std::to_string(grad_dtype) + " is not 0 (fp32), 1 (fp16) or 2 (bf16)");
  }
  if (out_dtype < kNone || out_dtype > kBF16) {
    throw std::invalid_argument("out_dtype=" + std::to_string(out_dtype) + " is not -1 (none), 0, 1 or 2");
  }
  if (n < 0) throw std::invalid_argument("n=" + std::to_string(n) + " must be >= 0");
  return {reinterpret_cast<void*>(p), reinterpret_cast<void*>(m), reinterpret_cast<void*>(v),
          reinterpret_cast<const void*>(grad), out ? reinterpret_cast<void*>(out) : nullptr,
          snapshot ? reinterpret_cast<void*>(snapshot) : nullptr, n, grad_dtype,
          out ? out_dtype : static_cast<int>(kNone), format.master_dtype, format.state_dtype};
}

// Runs `fn` over [begin, end) one parameter run at a time when the master is rounded
// stochastically (each run has its own index base and key), else in one call. The
// results combine as one call's would: stop at the first non-finite run.
RangeResult run_pieces(RangeFn fn, Op op, const Buffers& b, const Hyper& h, const Tuning& t,
                       const StateFormat& format, int64_t begin, int64_t end, int* abort) {
  if (format.runs.empty()) return fn(op, b, h, t, begin, end, abort);
  RangeResult total{begin, true, 0.0};
  for (const auto& run : format.runs) {
    const int64_t lo = run[0] > begin ? run[0] : begin;
    const int64_t hi = run[1] < end ? run[1] : end;
    if (lo >= hi) continue;
    Hyper piece = h;
    piece.stochastic = 1;
    piece.index_base = static_cast<uint32_t>(run[2]);
    piece.round_key = static_cast<uint32_t>(run[3]);
    const RangeResult r = fn(op, b, piece, t, lo, hi, abort);
    total.sumsq += r.sumsq;
    total.stop = r.stop;
    if (!r.finite || r.stop != hi) {
      total.finite = r.finite;
      return total;
    }
  }
  return total;
}

void check_runs(const StateFormat& format, int64_t n) {
  int64_t at = 0;
  for (const auto& run : format.runs) {
    if (run[0] != at || run[1] <= run[0]) break;
    at = run[1];
  }
  if (!format.runs.empty() && at != n) {
    throw std::invalid_argument("rounding runs do not tile [0, " + std::to_string(n) + ")");
  }
  if (!format.runs.empty() && format.master_dtype != kBF16) {
    throw std::invalid_argument("rounding runs given for an fp32 master");
  }
}

// One full step. A non-finite gradient anywhere leaves p, m, v and the working copy as
// they were: the tiles updated before it was seen are put back (from the snapshot when
// there is one, bit-exact; otherwise by the arithmetic inverse, which rounds). Every block
// runs to its own first non-finite tile, none stops early when another block has seen
// one: which tiles a thread reached before that news would depend on timing, and with
// the rounding inverse the same run would not repeat its bits (nor match another thread
// count). An overflowing step costs a whole pass and its undo; overflows are rare.
py::tuple step(uintptr_t p, uintptr_t m, uintptr_t v, uintptr_t grad, int grad_dtype,
               uintptr_t out, int out_dtype, uintptr_t snapshot, int64_t n, double lr,
               double beta1, double beta2, double eps, double weight_decay, int64_t step_count,
               double inv_scale, WorkerPool& pool, const std::string& isa, double clip,
               const StateFormat& format) {
  const RangeFn fn = resolve(isa);
  const Buffers b = make_buffers(p, m, v, grad, grad_dtype, out, out_dtype, snapshot, n, format);
  check_runs(format, n);
  const Hyper h = make_hyper(lr, beta1, beta2, eps, weight_decay, step_count, inv_scale, clip);
  const Tuning t = g_tuning;
  const Blocks blocks = blocks_of(n, t);
  std::vector<RangeResult> results(blocks.count);
  for (int64_t k = 0; k < blocks.count; ++k) results[k] = {blocks.begin(k), true, 0.0};
  bool finite = true;
  double sumsq = 0.0;
  {
    py::gil_scoped_release release;
    pool.run(blocks.count, [&](int64_t k) {
      results[k] = run_pieces(fn, Op::kStep, b, h, t, format, blocks.begin(k), blocks.end(k),
                              nullptr);
    }, t.static_split);
    for (const auto& r : results) {
      finite = finite && r.finite;
      sumsq += r.sumsq;
    }
    if (!finite) {  // each block updated [begin, stop): up to its first non-finite tile
      const Op undo = b.snap ? Op::kRestore : Op::kInverse;
      pool.run(blocks.count, [&](int64_t k) {
        fn(undo, b, h, t, blocks.begin(k), results[k].stop, nullptr);
      }, t.static_split);
    }
  }
  return py::make_tuple(finite, finite ? sumsq : INFINITY);
}

// Runs `op` over every block; each must get through its whole range (the gradient was
// checked by the step these ops undo or correct).
void run_all(Op op, RangeFn fn, const Buffers& b, const Hyper& h, const StateFormat& format,
             WorkerPool& pool) {
  check_runs(format, b.n);
  const Tuning t = g_tuning;
  const Blocks blocks = blocks_of(b.n, t);
  std::vector<RangeResult> results(blocks.count);
  {
    py::gil_scoped_release release;
    pool.run(blocks.count, [&](int64_t k) {
      results[k] = run_pieces(fn, op, b, h, t, format, blocks.begin(k), blocks.end(k), nullptr);
    }, t.static_split);
  }
  for (int64_t k = 0; k < blocks.count; ++k) {
    if (!results[k].finite || results[k].stop != blocks.end(k)) {
      throw std::runtime_error(
          "rollback met a non-finite gradient: the gradient buffer changed after the step");
    }
  }
}

// Undoes a step that was applied with the same arguments.
void undo(uintptr_t p, uintptr_t m, uintptr_t v, uintptr_t grad, int grad_dtype, uintptr_t out,
          int out_dtype, uintptr_t snapshot, int64_t n, double lr, double beta1, double beta2,
          double eps, double weight_decay, int64_t step_count, double inv_scale, WorkerPool& pool,
          const std::string& isa, double clip, const StateFormat& format) {
  const Buffers b = make_buffers(p, m, v, grad, grad_dtype, out, out_dtype, snapshot, n, format);
  const Hyper h = make_hyper(lr, beta1, beta2, eps, weight_decay, step_count, inv_scale, clip);
  // restoring and inverting round to nearest: no random bits needed
  run_all(b.snap ? Op::kRestore : Op::kInverse, resolve(isa), b, h, StateFormat{}, pool);
}

// Replaces a step applied with clip factor `undo_clip` by the same step with `clip`, in
// one pass (the clipping correction of a speculative step).
void correct(uintptr_t p, uintptr_t m, uintptr_t v, uintptr_t grad, int grad_dtype,
             uintptr_t out, int out_dtype, uintptr_t snapshot, int64_t n, double lr,
             double beta1, double beta2, double eps, double weight_decay, int64_t step_count,
             double inv_scale, WorkerPool& pool, const std::string& isa, double clip,
             const StateFormat& format, double undo_clip) {
  const Buffers b = make_buffers(p, m, v, grad, grad_dtype, out, out_dtype, snapshot, n, format);
  const Hyper h = make_hyper(lr, beta1, beta2, eps, weight_decay, step_count, inv_scale, clip,
                             undo_clip);
  run_all(Op::kCorrect, resolve(isa), b, h, format, pool);
}

// Benchmark probe: a step's loads and stores without its arithmetic (Op::kTouch); the
// buffers' values change meaninglessly.
void touch(uintptr_t p, uintptr_t m, uintptr_t v, uintptr_t grad, int grad_dtype, uintptr_t out,
           int out_dtype, int64_t n, WorkerPool& pool, const std::string& isa,
           const StateFormat& format) {
  const Buffers b = make_buffers(p, m, v, grad, grad_dtype, out, out_dtype, 0, n, format);
  run_all(Op::kTouch, resolve(isa), b, Hyper{}, StateFormat{}, pool);
}

// Unscale and check only (the synchronous schedule's first pass).
py::tuple check(uintptr_t grad, int grad_dtype, int64_t n, double inv_scale, WorkerPool& pool,
                const std::string& isa) {
  const RangeFn fn = resolve(isa);
  const Buffers b = make_buffers(0, 0, 0, grad, grad_dtype, 0, kNone, 0, n);
  Hyper h{};
  h.inv_scale = static_cast<float>(inv_scale);
  const Tuning t = g_tuning;
  const Blocks blocks = blocks_of(n, t);
  std::vector<RangeResult> results(blocks.count);
  bool finite = true;
  double sumsq = 0.0;
  {
    py::gil_scoped_release release;
    int abort = 0;
    pool.run(blocks.count, [&](int64_t k) {
      results[k] = fn(Op::kCheck, b, h, t, blocks.begin(k), blocks.end(k), &abort);
    }, t.static_split);
    for (const auto& r : results) {
      finite = finite && r.finite;
      sumsq += r.sumsq;
    }
    finite = finite && !abort;
  }
  return py::make_tuple(finite, finite ? sumsq : INFINITY);
}

py::dict tuning_dict(const Tuning& t) {
  py::dict d;
  d["prefetch"] = t.prefetch;
  d["stream_out"] = t.stream_out != 0;
  d["block"] = t.block;
  d["static_split"] = t.static_split != 0;
  return d;
}

// Replaces the knobs given (None: keep); returns the previous setting.
py::dict set_tuning(std::optional<int64_t> prefetch, std::optional<bool> stream_out,
                    std::optional<int64_t> block, std::optional<bool> static_split) {
  Tuning next = g_tuning;
  if (prefetch) next.prefetch = *prefetch;
  if (stream_out) next.stream_out = *stream_out ? 1 : 0;
  if (block) next.block = *block;
  if (static_split) next.static_split = *static_split ? 1 : 0;
  check_tuning(next);
  const py::dict previous = tuning_dict(g_tuning);
  g_tuning = next;
  return previous;
}

}  // namespace
}  // namespace cpu_adam

PYBIND11_MODULE(_cpu_adam, mod) {
  using namespace cpu_adam;
  mod.doc() = "Mixed-precision AdamW over flat host buffers (see docs/cpu_optimizer.md).";
  mod.attr("F32") = static_cast<int>(kF32);
  mod.attr("F16") = static_cast<int>(kF16);
  mod.attr("BF16") = static_cast<int>(kBF16);
  mod.attr("NONE") = static_cast<int>(kNone);
  py::class_<WorkerPool>(mod, "WorkerPool",
                         "Persistent kernel threads, pinned to cores when given; shared by steps.")
      .def(py::init<int, std::vector<int>>(), py::arg("threads"), py::arg("cores"),
           py::call_guard<py::gil_scoped_release>())
      .def("close", &WorkerPool::close, py::call_guard<py::gil_scoped_release>(),
           "Join the worker threads; the pool cannot run steps afterwards.")
      .def_property_readonly("threads", &WorkerPool::threads)
      .def_property_readonly("cores", &WorkerPool::cores)
      .def_property_readonly("worker_count", &WorkerPool::worker_count,
                             "Threads the pool started (0 when the caller runs every block).");
  py::class_<StateFormat>(mod, "StateFormat",
                          "Dtypes of the master and of m, v; rounding runs of a bf16 master.")
      .def(py::init<>())
      .def_readwrite("master_dtype", &StateFormat::master_dtype)
      .def_readwrite("state_dtype", &StateFormat::state_dtype)
      .def_readwrite("runs", &StateFormat::runs);
  g_tuning = tuning_from_env();
  mod.def("get_tuning", [] { return tuning_dict(g_tuning); },
          "The speed knobs every call uses: prefetch (elements), stream_out, block (elements), "
          "static_split.");
  mod.def("set_tuning", &set_tuning, py::arg("prefetch") = py::none(),
          py::arg("stream_out") = py::none(), py::arg("block") = py::none(),
          py::arg("static_split") = py::none(),
          "Set speed knobs (results do not change); returns the previous setting.");
  mod.def("available_isas", &available_names,
          "Kernels this CPU can run, from least to most capable ('auto' picks the last).");
  const auto step_args = [](auto... extra) {
    return std::make_tuple(py::arg("p"), py::arg("m"), py::arg("v"), py::arg("grad"),
                           py::arg("grad_dtype"), py::arg("out"), py::arg("out_dtype"),
                           py::arg("snapshot"), py::arg("n"), py::arg("lr"), py::arg("beta1"),
                           py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
                           py::arg("step"), py::arg("inv_scale"), py::arg("pool"),
                           py::arg("isa"), py::arg("clip") = 1.0,
                           py::arg("format") = StateFormat{}, extra...);
  };
  std::apply([&](auto... a) {
    mod.def("step", &step, a...,
            "AdamW step; returns (finite, sum of squares of the unscaled gradient).");
  }, step_args());
  std::apply([&](auto... a) {
    mod.def("undo", &undo, a..., "Undo a step made with the same arguments.");
  }, step_args());
  std::apply([&](auto... a) {
    mod.def("correct", &correct, a...,
            "Replace a step made with clip factor undo_clip by the step with clip, in one pass.");
  }, step_args(py::arg("undo_clip")));
  mod.def("touch", &touch, py::arg("p"), py::arg("m"), py::arg("v"), py::arg("grad"),
          py::arg("grad_dtype"), py::arg("out"), py::arg("out_dtype"), py::arg("n"),
          py::arg("pool"), py::arg("isa") = "auto", py::arg("format") = StateFormat{},
          "Benchmark probe: a step's memory traffic without its arithmetic (values change).");
  mod.def("check", &check, py::arg("grad"), py::arg("grad_dtype"), py::arg("n"),
          py::arg("inv_scale"), py::arg("pool"), py::arg("isa"),
          "Unscale and check; returns (finite, sum of squares of the unscaled gradient).");
}
