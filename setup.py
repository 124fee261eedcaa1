"""Builds torch_torus._C against the torch that is already installed.

Install with ``pip install --no-build-isolation .``: an isolated build environment would pull
an unpinned (CUDA) torch instead of the one the extension must link against.
"""

import glob
import os

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
sources = sorted(
    os.path.relpath(path, ROOT)
    for pattern in ("csrc/*.cpp", "csrc/**/*.cc")
    for path in glob.glob(os.path.join(ROOT, pattern), recursive=True)
)

setup(
    name="torch-torus",
    version="0.1.0",
    description="Ring and 2D-torus collective communication backend for torch.distributed",
    packages=find_packages(include=["torch_torus", "torch_torus.*"]),
    ext_modules=[
        CppExtension(
            name="torch_torus._C",
            sources=sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args=["-O3", "-std=c++17", "-Wall", "-Wno-unused-parameter"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.9",
)
