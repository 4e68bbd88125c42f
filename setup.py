"""Builds the C++ CPU optimizer (csrc/) as megatron.optimizer._cpu_adam and the state-file
I/O engine as megatron.optimizer._state_io.

pybind11 on raw pointers, no PyTorch headers: `python setup.py build_ext --inplace` (what
`make setup` runs). An extension's files compile at once, one per core
($MEGATRON_SYSX_BUILD_JOBS to choose how many), and `build_ext -j N` builds the two
extensions at once: the build takes about as long as its slowest file (under 30 s on one
core of a loaded 2-core AMD EPYC), not the sum (about 95 s there).

No -march=native: the AVX2 and AVX-512 kernels are compiled with per-file
`#pragma GCC target` and chosen at run time, so one binary runs on any x86-64 and the
portable kernel alone builds on aarch64. -ffp-contract=off keeps every kernel's
arithmetic identical (no fused multiply-add), so they agree bit for bit.
"""

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ParallelCompile("MEGATRON_SYSX_BUILD_JOBS").install()  # default: every core

ext_modules = [
    Pybind11Extension(
        "megatron.optimizer._cpu_adam",
        [
            "csrc/cpu_adam.cpp",
            "csrc/worker_pool.cpp",
            "csrc/isa_portable.cpp",
            "csrc/isa_avx2.cpp",
            "csrc/isa_avx512.cpp",
        ],
        depends=[
            "csrc/kernel_api.h",
            "csrc/worker_pool.h",
            "csrc/adam_kernel.h",
            "csrc/scalar_policy.h",
        ],
        cxx_std=17,
        extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"],
        extra_link_args=["-pthread"],
    ),
    # Optimizer states in files: O_DIRECT pread/pwrite on a thread pool (csrc/state_io.cpp).
    Pybind11Extension(
        "megatron.optimizer._state_io",
        ["csrc/state_io.cpp"],
        cxx_std=17,
        extra_compile_args=["-O2"],
        extra_link_args=["-pthread"],
    ),
]

class BuildWithProgress(build_ext):
    """A line before each extension and each source file it compiles: the build takes
    most of a minute on 2 cores, which `-q` would otherwise keep silent. The compiler is
    wrapped once, before `-j` builds the extensions on threads that share it."""

    def build_extensions(self) -> None:
        compile_one = self.compiler._compile  # distutils' per-file step (unixccompiler)

        def compile_with_line(obj, src, *args, **kwargs):
            print(f"  compiling {src}", flush=True)
            return compile_one(obj, src, *args, **kwargs)

        self.compiler._compile = compile_with_line
        try:
            super().build_extensions()
        finally:
            self.compiler._compile = compile_one

    def build_extension(self, ext) -> None:
        print(f"building {ext.name} ({len(ext.sources)} source file(s), each compiled only when "
              "changed)", flush=True)
        super().build_extension(ext)


setup(
    name="megatron-sysx",
    version="0.1.0",
    description="Megatron-LM fork for LLaMA training with host-resident model states",
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildWithProgress},
    packages=[],
)
