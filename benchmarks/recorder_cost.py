"""What the flight recorder costs a call, measured alone (issue 40): the recorder's three steps of a
call (record, started, finished; record as started and finished where the recorder can, as
for a call its caller runs at once) on a 1-D tensor, back to back on one thread, in ns per call, the
best of --repeats runs of --calls calls (the best: what the code costs, not what the machine's
load adds). The recorder is compiled from --csrc (default: this checkout's csrc/), so that two
checkouts compare in one run:

    python benchmarks/recorder_cost.py --csrc /path/to/other/checkout/csrc --csrc csrc

The end-to-end figure (recorder on against off, interleaved) is benchmarks/recorder_overhead.py's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile

from torch.utils.cpp_extension import load

BENCH = r"""
#include <chrono>
#include <torch/extension.h>
#include "backend/flight_recorder.h"

double recorder_cost(int64_t calls, int64_t repeats, int64_t capacity) {
  torus::FlightRecorder recorder(capacity, "", 0, 2, "0");
  const std::vector<at::Tensor> tensors{at::ones({1024})};
  double best = 1e30;
  for (int64_t r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < calls; ++i) {
#ifdef RECORD_AS_STARTED
      const uint64_t id = recorder.record(
          torus::FlightRecorder::Call{"torus:all_reduce:ring", false, at::kFloat, -1, false}, tensors, tensors, i + 1);
#else
      const uint64_t id = recorder.record(
          torus::FlightRecorder::Call{"torus:all_reduce:ring", false, at::kFloat, -1, false}, tensors, tensors);
      recorder.started(id, i + 1);
#endif
      recorder.finished(id, std::string());
    }
    best = std::min(best, std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() /
                              calls);
  }
  return best;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("recorder_cost", &recorder_cost); }
"""


def build(csrc: str):
    csrc = os.path.abspath(csrc)
    name = "recorder_cost_" + hashlib.sha1(csrc.encode()).hexdigest()[:10]
    directory = os.path.join(tempfile.gettempdir(), name)
    os.makedirs(directory, exist_ok=True)
    bench = os.path.join(directory, "bench.cpp")
    with open(bench, "w") as f:
        f.write(BENCH)
    # A recorder that can record a call as started (a call its caller runs at once) is timed that
    # way, as the executor calls it; an older one records, then starts.
    with open(os.path.join(csrc, "backend", "flight_recorder.h")) as f:
        as_started = ["-DRECORD_AS_STARTED"] if "startedAs" in f.read() else []
    return load(name=name, sources=[bench, os.path.join(csrc, "backend", "flight_recorder.cc")],
                extra_include_paths=[csrc], extra_cflags=["-O3", "-g0", *as_started], build_directory=directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csrc", action="append", help="a checkout's csrc/ (repeatable); default: this one's")
    parser.add_argument("--calls", type=int, default=200000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--capacity", type=int, default=2000, help="the ring's entries (TORUS_TRACE_BUFFER)")
    parser.add_argument("--turns", type=int, default=3, help="turns through the checkouts, alternating")
    args = parser.parse_args()
    sources = args.csrc or [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "csrc")]
    modules = [(csrc, build(csrc)) for csrc in sources]
    for turn in range(args.turns):
        for csrc, module in modules:
            print(f"{csrc}: {module.recorder_cost(args.calls, args.repeats, args.capacity):.1f} ns per call")


if __name__ == "__main__":
    main()
