#!/usr/bin/env bash
# shellcheck disable=SC2317  # the step_* functions are called by name: "step_${name//-/_}"
# Everything the lent GPU machine is for, in one command (issue 15: torus's CUDA path):
#
#   env        what the machine has: GPU, driver, nvcc, compilers, torch, packages
#   build      pip install -e . with the system compiler and the CUDA path; sm_90 only
#   check      torch_torus._C.built_with_cuda must be True (fails loudly otherwise)
#   smoke      benchmarks/gpu_smoke.py: 1 and 2 ranks, one 4 KiB all_reduce sync, async + wait(),
#              async + then(), each bounded (20 s per world size); on a hang it names the step every
#              rank is stuck in and dumps its Python and native stacks (py-spy from $REPO/.whl when
#              the device tool carried it, else cuda-gdb); when it fails, the long steps are skipped
#   tests      tests/test_cuda.py (2 and 4 ranks on the one GPU; torus over shm and over tcp),
#              -rs, junit xml
#   memcheck   compute-sanitizer --tool memcheck over the ranks of a subset of test_cuda.py
#   ddp-torus  examples/ddp_resnet50.py on CUDA, 4 ranks on the one GPU, backend torus
#   ddp-gloo   the same with gloo, for comparison
#   ddp-noop   the same over torus with DDP's communication removed (--comm-hook noop): the bound
#              that communication hidden behind compute reaches
#   ddp-powersgd  the same over torus with torch's PowerSGD hook (collectives from callbacks)
#   bench      allreduce, 4 ranks, --device cuda, 4 KiB to 256 MiB, torus against gloo, --check, --json
#   bench-mps  the bench again under CUDA MPS (the 4 ranks' kernels share the GPU at once rather
#              than in time slices, as ranks on GPUs of their own would not contend at all)
#   tests-gloo (not run by default) tests/test_cuda.py's collective cases against gloo, to check
#              the tests and expectations.py's gloo entries on CUDA tensors
#
#   pip download py-spy tqdm psutil numpy -d .whl --no-deps --only-binary=:all: \
#       --python-version 3.12 --platform manylinux_2_28_x86_64   # here, once: what the machine lacks
#   benchmarks/gpu_verification.sh                 # the default steps, in the order above
#                                                   # (device tool: carry [".whl"] with it)
#   benchmarks/gpu_verification.sh tests bench     # some steps, by name
#
# Everything is written under $OUT (set by the device tool; default ./gpu-out): one log per step
# (<step>.log), test_cuda.xml, memcheck.txt, bench_cuda_allreduce.json, summary.txt, and all of
# them again in gpu-out.tar.gz. A failing step does not stop the others; the script exits non-zero
# if any step failed, timed out or was not run, after printing a summary.
#
# Time: the device tool allows 10 minutes per command, so the whole run has a budget
# (GPU_VERIFY_BUDGET_S, default 550 s) and every step a cap of its own (below); a step gets
# min(cap, what is left of the budget) and is not started with less than 30 s left (it is then
# reported NOT RUN: run it by name in a second command; a warm machine keeps the build). Expected
# on an H100 with 16 cores: build 1-3 min, smoke under 30 s (55 C++ files and the .cu kernels for sm_90 only,
# MAX_JOBS=16; a rebuild on a warm machine is incremental), tests ~3 min (about 600 tests), memcheck
# ~1.5 min (a 50-test subset, ws2 and float32 only, as the sanitizer slows every kernel and start),
# each DDP run ~40 s (3 warmup + 10 timed steps, 224x224 images, batch 8 per rank: enough for a
# steady images/s, few enough for gloo's host-staged 100 MB allreduce per step), the bench ~1 min
# (17 sizes, 3 warmup + 10 timed calls each: at 256 MiB gloo's call takes about a second).

set -u -o pipefail

SCRIPT=$(readlink -f "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SCRIPT")/.." && pwd)
OUT=$(mkdir -p "${OUT:-$PWD/gpu-out}" && cd "${OUT:-$PWD/gpu-out}" && pwd)
PYTHON=${PYTHON:-python}
BUDGET_S=${GPU_VERIFY_BUDGET_S:-550}
MIN_STEP_S=30
DEFAULT_STEPS=(env build check smoke tests memcheck ddp-torus ddp-gloo ddp-noop ddp-powersgd bench bench-mps)
# Steps that are pointless once the smoke step failed: they would hang the same way.
AFTER_SMOKE=(tests memcheck ddp-torus ddp-noop ddp-powersgd ddp-gloo bench bench-mps tests-gloo)
export REPO OUT PYTHON
# The source tree first: the tests and examples import torch_torus from here, built in place.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="$PATH:/usr/local/cuda/bin"
fi

cap_of() {  # seconds a step may take at most
    case "$1" in
        env) echo 30 ;;
        build) echo 300 ;;
        check) echo 60 ;;
        smoke) echo 60 ;;
        tests) echo 270 ;;
        memcheck) echo 180 ;;
        ddp-torus | ddp-gloo | ddp-noop | ddp-powersgd) echo 120 ;;
        bench | bench-mps) echo 180 ;;
        tests-gloo) echo 240 ;;
        *) echo 0 ;;
    esac
}

torchrun() {
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$@"
}

# ------------------------------------------------------------------------------------------ steps
# Each runs in its own bash (under timeout), cwd = the repository, output to $OUT/<step>.log.

step_env() {
    echo "date: $(date -u '+%Y-%m-%dT%H:%M:%SZ')  host: $(hostname)  cores: $(nproc)"
    echo "commit: $(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo '(no git here)')"
    nvidia-smi || echo "nvidia-smi failed"
    nvcc --version || echo "no nvcc on PATH"
    gcc --version | head -1
    g++ --version | head -1
    command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || echo "no compute-sanitizer found"
    "$PYTHON" - <<'EOF'
import importlib, platform, shutil, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "CUDA", torch.version.cuda, "available", torch.cuda.is_available(),
      "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print("GPU 0:", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
for name in ("pip", "setuptools", "wheel", "ninja", "pytest", "numpy", "torchvision", "psutil", "tqdm", "scipy"):
    try:
        module = importlib.import_module(name)
        print(f"{name:12} {getattr(module, '__version__', '(no version)')}")
    except Exception as error:  # noqa: BLE001
        print(f"{name:12} missing ({type(error).__name__})")
print("ninja binary:", shutil.which("ninja"))
EOF
}

# The lent machine reaches no package index: what it lacks comes from the wheels carried in
# $REPO/.whl (pip download <name> -d .whl --no-deps, for its Python 3.12).
install_carried() {  # module names; each one missing is installed from .whl
    local module
    for module in "$@"; do
        "$PYTHON" -c "import $module" >/dev/null 2>&1 && continue
        "$PYTHON" -m pip install -q --no-index --no-deps --find-links "$REPO/.whl" "${module//_/-}" \
            || echo "$module is missing and did not install from $REPO/.whl"
    done
}

step_build() {
    # torch_torus imports these at run time; the install below is --no-deps (torch is the machine's).
    install_carried psutil tqdm numpy
    # The system compiler: a g++ wrapper whose link bundled a private libstdc++ crashed the
    # extension on this machine before (docs/transports.md, "CUDA tensors"). sm_90 only (an H100):
    # half the nvcc time of the default architectures. TORUS_BUILD_CUDA=1: no CPU-only fallback.
    export CC=gcc CXX=g++ MAX_JOBS="${MAX_JOBS:-16}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" TORUS_BUILD_CUDA=1
    echo "CC=$CC CXX=$CXX MAX_JOBS=$MAX_JOBS TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST TORUS_BUILD_CUDA=1"
    if "$PYTHON" -m pip --version >/dev/null 2>&1; then
        "$PYTHON" -m pip install --no-build-isolation --no-deps -e .
    else
        echo "no pip: building in place with setup.py instead"
        "$PYTHON" setup.py build_ext --inplace -j "$MAX_JOBS"
    fi
}

step_check() {
    "$PYTHON" - <<'EOF'
import sys
import torch
import torch_torus
print("torch", torch.__version__, "CUDA", torch.version.cuda)
print("torch_torus from", torch_torus.__file__)
print("torch_torus._C from", torch_torus._C.__file__)
print("built_with_cuda =", torch_torus._C.built_with_cuda)
if torch_torus._C.built_with_cuda is not True:
    print("!" * 100)
    print("!!! torch_torus._C.built_with_cuda is not True: this build has NO CUDA path, so the torus cases of")
    print("!!! tests/test_cuda.py skip, and the DDP and bench steps cannot run torus on CUDA tensors.")
    print("!!! See build.log (was the toolkit found? torch with CUDA? TORUS_BUILD_CUDA?).")
    print("!" * 100)
    sys.exit(1)
EOF
}

step_smoke() {
    command -v py-spy >/dev/null 2>&1 || install_carried py_spy
    "$PYTHON" benchmarks/gpu_smoke.py --device cuda --bound 20 --out "$OUT"
}

skipped_for_lack_of_cuda() {  # junit xml: tests skipped because this machine or build lacks CUDA
    local skips
    skips=$(grep -o -E '<skipped [^>]*message="[^"]*' "$1" \
        | grep -o -E 'no GPU is visible|is built without CUDA|without its CUDA path|nvcc is not on PATH' | sort | uniq -c)
    if [ -n "$skips" ]; then
        echo "NOT A VERIFICATION: tests skipped for lack of a GPU, of CUDA or of the CUDA path (count, reason):"
        echo "$skips"
        return 1
    fi
}

step_tests() {
    "$PYTHON" -m pytest tests/test_cuda.py -rs -q -p no:cacheprovider --durations=25 \
        --junitxml="$OUT/test_cuda.xml"
    local status=$?
    skipped_for_lack_of_cuda "$OUT/test_cuda.xml" || return 1
    return "$status"
}

step_tests_gloo() {
    TORUS_TEST_BACKENDS=gloo "$PYTHON" -m pytest tests/test_cuda.py -rs -q -p no:cacheprovider \
        -k "not kernel and not nvcc" --junitxml="$OUT/test_cuda_gloo.xml"
    local status=$?
    skipped_for_lack_of_cuda "$OUT/test_cuda_gloo.xml" || return 1
    return "$status"
}

step_memcheck() {
    # Every rank is a process of its own (the harness spawns them): --target-processes all.
    # A subset (2 ranks, float32: all_reduce for every op, every other collective), as memcheck
    # makes every kernel and every process start much slower. The sanitizer's reports, from all
    # processes, come out of its front end: memcheck.txt; any "ERROR SUMMARY: <n>" with n > 0 fails.
    local sanitizer
    sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    "$sanitizer" --tool memcheck --target-processes all --error-exitcode 99 \
        "$PYTHON" -m pytest tests/test_cuda.py -rs -q -p no:cacheprovider \
        -k "ws2 and float32 and (test_cuda_allreduce or test_cuda_collective)" 2>&1 | tee "$OUT/memcheck.txt"
    local status=${PIPESTATUS[0]}
    local summaries errors
    summaries=$(grep -c "ERROR SUMMARY" "$OUT/memcheck.txt")
    errors=$(grep -E "ERROR SUMMARY: [1-9]" "$OUT/memcheck.txt")
    echo "memcheck: ${summaries} process summaries; sanitizer exit status ${status}"
    if [ -n "$errors" ]; then
        echo "memcheck found errors:"
        echo "$errors"
        return 1
    fi
    if [ "$summaries" -eq 0 ]; then
        echo "memcheck printed no ERROR SUMMARY: did the sanitizer run?"
        return 1
    fi
    return "$status"
}

ddp() {  # backend, comm hook
    torchrun 4 examples/ddp_resnet50.py --backend "$1" --comm-hook "$2" --device cuda --image-size 224 \
        --batch-size 8 --warmup-steps 3 --steps 10
}

step_ddp_torus() {
    ddp torus allreduce
}

step_ddp_gloo() {
    ddp gloo allreduce
}

step_ddp_noop() {
    ddp torus noop
}

step_ddp_powersgd() {
    ddp torus powersgd
}

bench() {  # the JSON file's name
    torchrun 4 -m torch_torus.bench --device cuda --backends "torus;gloo" -b 4K -e 256M -f 2 -n 10 -w 3 \
        --check --json "$OUT/$1"
}

step_bench() {
    bench bench_cuda_allreduce.json
}

step_bench_mps() {
    local control
    control=$(command -v nvidia-cuda-mps-control || echo /usr/bin/nvidia-cuda-mps-control)
    export CUDA_MPS_PIPE_DIRECTORY="$OUT/mps-pipe" CUDA_MPS_LOG_DIRECTORY="$OUT/mps-log"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    "$control" -d || { echo "the MPS daemon did not start ($control)"; return 1; }
    bench bench_cuda_allreduce_mps.json
    local status=$?
    echo quit | "$control"
    return "$status"
}

if [ "${1:-}" = "__step" ]; then  # one step, started by run_step below
    cd "$REPO" || exit 2
    "step_${2//-/_}"
    exit $?
fi

# ------------------------------------------------------------------------------------------ driver

START=$(date +%s)
DEADLINE=$((START + BUDGET_S))
SUMMARY=()
FAILED=0
SMOKE_FAILED=0

record() {  # step, status, seconds
    SUMMARY+=("$(printf '%-11s %-40s %5ss' "$1" "$2" "$3")")
}

run_step() {
    local name=$1 cap left limit began status seconds log verdict
    cap=$(cap_of "$name")
    if [ "$cap" -eq 0 ]; then
        echo "unknown step: $name (steps: ${DEFAULT_STEPS[*]} tests-gloo)"
        record "$name" "UNKNOWN STEP" 0
        FAILED=1
        return
    fi
    if [ "$SMOKE_FAILED" -eq 1 ] && [[ " ${AFTER_SMOKE[*]} " == *" $name "* ]]; then
        echo "=== $name: NOT RUN, the smoke step failed (see smoke.log: where each rank hangs)"
        record "$name" "NOT RUN (smoke failed)" 0
        FAILED=1
        return
    fi
    left=$((DEADLINE - $(date +%s)))
    if [ "$left" -lt "$MIN_STEP_S" ]; then
        echo "=== $name: NOT RUN, ${left}s left of the ${BUDGET_S}s budget"
        record "$name" "NOT RUN (budget spent: run it by name)" 0
        FAILED=1
        return
    fi
    limit=$((cap < left ? cap : left))
    log="$OUT/$name.log"
    echo "=== $name (at most ${limit}s) -> $log"
    began=$(date +%s)
    timeout --kill-after=15 "$limit" bash "$SCRIPT" __step "$name" >"$log" 2>&1
    status=$?
    seconds=$(($(date +%s) - began))
    if [ "$status" -eq 0 ]; then
        verdict="PASS"
    elif [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        verdict="TIMED OUT after ${limit}s"
        FAILED=1
    else
        verdict="FAIL (exit status $status)"
        FAILED=1
    fi
    echo "    $verdict in ${seconds}s; the log ends:"
    tail -n 12 "$log" | sed 's/^/    | /'
    record "$name" "$verdict" "$seconds"
    if [ "$name" = smoke ] && [ "$verdict" != PASS ]; then
        SMOKE_FAILED=1
    fi
}

STEPS=("$@")
if [ ${#STEPS[@]} -eq 0 ]; then
    STEPS=("${DEFAULT_STEPS[@]}")
fi
echo "gpu_verification: steps ${STEPS[*]}; budget ${BUDGET_S}s; output in $OUT"
for step in "${STEPS[@]}"; do
    run_step "$step"
done

for log in bench bench-mps; do  # the bench's table, for whoever reads only this output
    if [ -f "$OUT/$log.log" ]; then
        echo "=== $log table"
        grep -E '^(#|  +[0-9])' "$OUT/$log.log" | grep -v '^# torch ' | head -60
    fi
done
{
    echo "gpu_verification summary ($(($(date +%s) - START))s of a ${BUDGET_S}s budget):"
    printf '%s\n' "${SUMMARY[@]}"
    if [ "$FAILED" -eq 0 ]; then echo "ALL PASSED"; else echo "SOME STEPS FAILED OR DID NOT RUN"; fi
} | tee "$OUT/summary.txt"
# One file that holds every other: the device tool brings back only so many files.
tar -czf "$OUT/gpu-out.tar.gz" -C "$OUT" --exclude gpu-out.tar.gz --exclude mps-pipe . 2>/dev/null
exit "$FAILED"
