"""Builds torch_torus._C against the torch that is already installed.

Install with ``pip install --no-build-isolation .``: an isolated build environment would pull
an unpinned (CUDA) torch instead of the one the extension must link against.

The CUDA path (csrc/**/*.cu and the C++ under csrc/**/cuda/) is compiled in when torch has CUDA
and a CUDA toolkit is found; otherwise the extension is built CPU-only from the other sources.
TORUS_BUILD_CUDA=0 forces the CPU-only build (e.g. a toolkit whose major version differs from
torch's, which torch's build refuses), TORUS_BUILD_CUDA=1 makes a missing CUDA an error.

The OFI transport (csrc/transport/ofi/) is compiled in when libfabric is found: by pkg-config, or
under TORUS_OFI_HOME (its include/ and lib/). TORUS_BUILD_OFI=0 leaves it out, TORUS_BUILD_OFI=1
makes a missing libfabric an error; without it, TORUS_TRANSPORT=ofi says how to get it.

TORUS_SANITIZE=address or thread builds the C++ with AddressSanitizer or ThreadSanitizer, for
the sanitizer runs in tests/README.md (python then needs the sanitizer's runtime preloaded).
"""

import glob
import os
import shutil
import subprocess
import sys

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
# No -std: torch's build adds the standard its headers need (C++17 up to torch 2.11, C++20 since).
# -g0 overrides the -g of Python's own CFLAGS: debug information for torch's templates was a
# third of the build's time (a torch-heavy file: 16.7 s with it, 10.7 without; BENCHMARKS.md).
# Stacks still name functions (the symbol table stays); the sanitizer builds keep -g.
CXX_FLAGS = ["-O3", "-g0", "-Wall", "-Wno-unused-parameter"]
LINK_FLAGS = []
SANITIZER = os.environ.get("TORUS_SANITIZE", "")
if SANITIZER not in ("", "address", "thread"):
    raise SystemExit(f"TORUS_SANITIZE={SANITIZER!r}: expected address or thread (or unset)")
if SANITIZER:
    CXX_FLAGS = ["-O1", "-g", "-fno-omit-frame-pointer", f"-fsanitize={SANITIZER}", "-Wall", "-Wno-unused-parameter"]
    LINK_FLAGS = [f"-fsanitize={SANITIZER}"]
    print(f"torch-torus: building with -fsanitize={SANITIZER}")


def sources_matching(*patterns):
    return sorted(
        os.path.relpath(path, ROOT)
        for pattern in patterns
        for path in glob.glob(os.path.join(ROOT, pattern), recursive=True)
    )


def why_not_cuda():
    """None when the CUDA kernels can be built, else the reason they are not."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} has no CUDA"
    if CUDA_HOME is None:
        return "no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)"
    return None


def build_cuda():
    choice = os.environ.get("TORUS_BUILD_CUDA", "auto")
    if choice not in ("auto", "0", "1"):
        raise SystemExit(f"TORUS_BUILD_CUDA={choice!r}: expected auto, 0 or 1")
    if choice == "0":
        print("torch-torus: building CPU-only (TORUS_BUILD_CUDA=0)")
        return False
    reason = why_not_cuda()
    if reason is not None:
        if choice == "1":
            raise SystemExit(f"TORUS_BUILD_CUDA=1 but the CUDA kernels cannot be built: {reason}")
        print(f"torch-torus: building CPU-only: {reason}")
        return False
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        # torch takes the architectures of the visible GPUs; with none (a build machine) it has
        # nothing to compile for.
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
    print(f"torch-torus: building with the CUDA path (toolkit {CUDA_HOME}, torch CUDA "
          f"{torch.version.cuda}, architectures {os.environ.get('TORCH_CUDA_ARCH_LIST', 'of the visible GPUs')})")
    return True


def find_libfabric():
    """(include dirs, library dirs) of libfabric, or the reason it is not used."""
    choice = os.environ.get("TORUS_BUILD_OFI", "auto")
    if choice not in ("auto", "0", "1"):
        raise SystemExit(f"TORUS_BUILD_OFI={choice!r}: expected auto, 0 or 1")
    if choice == "0":
        return "TORUS_BUILD_OFI=0"
    home = os.environ.get("TORUS_OFI_HOME", "")
    found = None
    if home:
        header = os.path.join(home, "include", "rdma", "fabric.h")
        if not os.path.exists(header):
            raise SystemExit(f"TORUS_OFI_HOME={home!r}: no {header}")
        lib = next((d for d in ("lib64", "lib") if glob.glob(os.path.join(home, d, "libfabric.so*"))), "lib")
        found = ([os.path.join(home, "include")], [os.path.join(home, lib)])
    elif shutil.which("pkg-config"):
        result = subprocess.run(["pkg-config", "--cflags-only-I", "--libs-only-L", "libfabric"], capture_output=True,
                                text=True)
        if result.returncode == 0:
            flags = result.stdout.split()
            found = ([f[2:] for f in flags if f.startswith("-I")], [f[2:] for f in flags if f.startswith("-L")])
    if found is None:
        reason = "libfabric not found (pkg-config libfabric, or TORUS_OFI_HOME)"
        if choice == "1":
            raise SystemExit(f"TORUS_BUILD_OFI=1 but {reason}")
        return reason
    return found


# Sources under a cuda/ directory use the CUDA runtime (and c10's CUDA side): CUDA builds only.
cuda_sources = sources_matching("csrc/**/cuda/*.cc", "csrc/**/*.cu")
# Sources under an ofi/ directory use libfabric; without it, ofi_unavailable.cc stands in.
ofi_sources = sources_matching("csrc/**/ofi/*.cc")
ofi_absent = sources_matching("csrc/transport/ofi_unavailable.cc")
cpp_sources = [path for path in sources_matching("csrc/*.cpp", "csrc/**/*.cc")
               if path not in cuda_sources + ofi_sources + ofi_absent]
include_dirs = [os.path.join(ROOT, "csrc")]
libfabric = find_libfabric()
if isinstance(libfabric, str):
    print(f"torch-torus: building without the OFI transport: {libfabric}")
    cpp_sources += ofi_absent
else:
    print(f"torch-torus: building with the OFI transport (libfabric: {' '.join(libfabric[1]) or 'system'})")
    cpp_sources += ofi_sources
    include_dirs += libfabric[0]
    # Not linked: the transport loads libfabric when first used (csrc/transport/ofi/fabric.cc
    # says why); the library's directory is the module's RUNPATH, where that load looks first.
    LINK_FLAGS = LINK_FLAGS + [f"-Wl,-rpath,{d}" for d in libfabric[1]]
if build_cuda():
    extension = CUDAExtension(
        name="torch_torus._C",
        sources=cpp_sources + cuda_sources,
        include_dirs=include_dirs,
        define_macros=[("TORUS_WITH_CUDA", "1")],
        # No --use_fast_math: AVG divides exactly, as the CPU path does.
        extra_compile_args={"cxx": CXX_FLAGS, "nvcc": ["-O3"]},
        extra_link_args=LINK_FLAGS,
    )
else:
    extension = CppExtension(
        name="torch_torus._C",
        sources=cpp_sources,
        include_dirs=include_dirs,
        extra_compile_args=CXX_FLAGS,
        extra_link_args=LINK_FLAGS,
    )

class BuildKeepingObjects(BuildExtension.with_options(use_ninja=True)):
    """Compiles into build/ of the source tree whichever command builds: pip install -e builds in
    a temporary directory otherwise, so a second install (the README's test command after its
    demo's, in one venv) compiled everything again; ninja now recompiles only what changed."""

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = os.path.join(ROOT, "build", f"objects-{sys.implementation.cache_tag}")


# Name, version, description and packages: pyproject.toml.
setup(ext_modules=[extension], cmdclass={"build_ext": BuildKeepingObjects})
