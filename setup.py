"""Builds the C++ CPU optimizer (csrc/) as megatron.optimizer._cpu_adam.

pybind11 on raw pointers, no PyTorch headers, so it builds in seconds:
`python setup.py build_ext --inplace` (what `make setup` runs).
"""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ext_modules = [
    Pybind11Extension(
        "megatron.optimizer._cpu_adam",
        ["csrc/cpu_adam.cpp"],
        cxx_std=17,
        extra_compile_args=["-O3"],
    )
]

setup(
    name="megatron-sysx",
    version="0.1.0",
    description="Megatron-LM fork for LLaMA training with host-resident model states",
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
    packages=[],
)
