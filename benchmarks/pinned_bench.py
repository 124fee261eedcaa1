"""torch_torus.bench with every rank pinned to a core, for placement experiments on one host:
PIN=interleaved puts rank r on core r mod cores, PIN=paired puts consecutive ranks on one core
(ranks per core = LOCAL_WORLD_SIZE / cores), PIN=none (default) pins nothing. Run it under torchrun
with the bench's own arguments:

    PIN=paired torchrun --standalone --nproc-per-node 4 benchmarks/pinned_bench.py --timing osu -b 4K -e 64K
"""

import os
import runpy
import sys

PLACEMENTS = ("none", "interleaved", "paired")

placement = os.environ.get("PIN", "none")
if placement not in PLACEMENTS:
    raise SystemExit(f"PIN={placement!r}: allowed {', '.join(PLACEMENTS)}")
if placement != "none":
    rank, ranks = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    cores = sorted(os.sched_getaffinity(0))
    per_core = max(1, -(-ranks // len(cores)))
    core = cores[rank % len(cores)] if placement == "interleaved" else cores[min(rank // per_core, len(cores) - 1)]
    os.sched_setaffinity(0, {core})
sys.argv = ["torch_torus.bench", *sys.argv[1:]]
runpy.run_module("torch_torus.bench", run_name="__main__", alter_sys=True)
