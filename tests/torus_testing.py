"""The test-only entry points in tests/native/, built as a module of their own: SubsetComms
(shared-memory collectives on Comms over some ranks of a group, for test_shm.py),
DeviceCollectivesOnHost (the device collectives on the host device layer, for
test_device_collectives.py), hmac_sha256 (the hellos' proofs, for test_auth.py), reduce_into
(every instruction-set variant of the reduction kernels, for test_reduce_kernels.py),
shared_tensor_claim_problem and shared_tensor_file_problem (the checks of a peer's posting of a
shared tensor, for test_shared_tensors.py) and, in a
build with libfabric, OfiAdversary (an endpoint that sends crafted messages, for test_wire_ofi.py).
They are not part of the package: `module()` compiles them the first time a test needs them (a
minute or two; later sessions reuse the build while the sources are unchanged), into build/testing-<python>/, linked against the torch_torus._C being tested so that
they call its code rather than a copy of it.

Build in the test process before starting ranks (`module()` in a fixture): the ranks then load
the finished module instead of compiling it under a case's bound.
"""

import functools
import glob
import hashlib
import os
import subprocess
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)
NATIVE = os.path.join(TESTS_DIR, "native")


def _headers_digest() -> str:
    """What the module's build depends on beyond its own sources, which torch's cache alone does not
    see: the core's headers (layouts and inline code it compiles in) and torch's version."""
    import torch

    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted(glob.glob(os.path.join(ROOT, "csrc", "**", "*.h"), recursive=True) +
                       glob.glob(os.path.join(NATIVE, "*.h"))):
        with open(path, "rb") as file:
            digest.update(os.path.relpath(path, ROOT).encode() + b"\0" + file.read())
    return digest.hexdigest()[:16]


def _libfabric_includes() -> list:
    """Where libfabric's headers are, as setup.py finds them (TORUS_OFI_HOME, else pkg-config)."""
    home = os.environ.get("TORUS_OFI_HOME", "")
    if home:
        return [os.path.join(home, "include")]
    try:
        flags = subprocess.run(["pkg-config", "--cflags-only-I", "libfabric"], capture_output=True, text=True).stdout
    except OSError:
        return []
    return [flag[2:] for flag in flags.split() if flag.startswith("-I")]


@functools.lru_cache(maxsize=None)
def module():
    """The built module (compiled on first use in this or an earlier session)."""
    import torch.utils.cpp_extension as cpp_extension
    import torch_torus

    core = torch_torus._C.__file__
    # The digest as a definition: a header that changed changes the flags, so torch rebuilds.
    flags = ["-O2", "-g0", "-Wall", "-Wno-unused-parameter", f"-DTORUS_TESTING_HEADERS={_headers_digest()}"]
    if torch_torus._C.built_with_cuda:
        flags.append("-DTORUS_WITH_CUDA=1")  # the headers' view of the build must match _C's
    sources = sorted(glob.glob(os.path.join(NATIVE, "*.cpp")))
    includes = [os.path.join(ROOT, "csrc"), NATIVE]
    if torch_torus._C.built_with_ofi:  # the adversary calls the transport's ofi::Fabric, only there
        flags.append("-DTORUS_WITH_OFI=1")
        includes += _libfabric_includes()
    else:
        sources.remove(os.path.join(NATIVE, "ofi_adversary.cpp"))
    build = os.path.join(ROOT, "build", f"testing-{sys.implementation.cache_tag}")
    os.makedirs(build, exist_ok=True)
    return cpp_extension.load(
        name="torus_testing",
        sources=sources,
        extra_include_paths=includes,
        extra_cflags=flags,
        extra_ldflags=[core, f"-Wl,-rpath,{os.path.dirname(core)}"],
        build_directory=build)
