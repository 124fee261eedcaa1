#!/bin/sh
# Builds oneccl_osu against oneCCL and Intel MPI from PyPI, installed in a venv:
#   python3 -m venv /work/oneccl-venv && /work/oneccl-venv/bin/pip install oneccl-devel impi-devel impi-rt
# ONECCL_VENV=<venv> picks another venv. An RPATH (not RUNPATH: it must also serve libccl's own
# dependencies, libsycl, libsvml, ...) points at <venv>/lib, so no LD_LIBRARY_PATH is needed.
set -e
V=${ONECCL_VENV:-/work/oneccl-venv}
cd "$(dirname "$0")"
g++ -std=c++17 -O2 -Wall -o oneccl_osu oneccl_osu.cpp -I"$V/include" -L"$V/lib" -Wl,--disable-new-dtags,-rpath,"$V/lib" \
    -lccl -lmpi
echo "built $(pwd)/oneccl_osu against $V"
