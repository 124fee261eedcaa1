"""TORUS_WAIT's policies on a busy host: each against the others and gloo, in one interleaved run.

    python benchmarks/busy_host.py                          # the whole matrix
    python benchmarks/busy_host.py --ranks 2 --threads 1 --load none build --pin none
    python benchmarks/busy_host.py --ddp --load none build   # DDP ResNet-50 cells only

A cell is one torchrun on this host:
- ranks: 2 (on 2 cores, a core each) or 4 (oversubscribed);
- threads: calling threads per rank, each on a group of its own;
- load beside it: none, busyN (N processes spinning in `while True: pass`), or build (a parallel
  C++ build, `make -B -j8` over and over: short-lived compilers, the busiest kind of host);
- pin: none, or pinned (rank r on core r mod cores, as mpiexec binds).

Every rank creates, per contender, one group per thread: torus with TORUS_WAIT=auto, pause and
yield (pg_options), and gloo. Then --rounds rounds; in each, the contenders take turns --slices
times (in an order that changes every turn, each contender following each other equally often:
balanced_orders), each turn --bytes all_reduce on all threads at
once, so that a scheduler's mood that lasts a second hits all alike; a contender's µs per call
over its turns of a round (the threads' mean) is one sample, about --seconds of calls.
--ddp cells train ResNet-50 (batch 8 per rank, synthetic images made by a DataLoader with
--workers processes per rank) with DDP over each contender's group in turn, and a sample is the
images/s of one rank.

Prints each cell as it ends and at the end a table: each contender's median and slowest sample,
auto's median against the best policy's and gloo's, and auto's slowest sample against the best
policy's slowest. --markdown writes that table (BENCHMARKS.md, "Waiting on a busy host"), --out
every sample as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from torch_torus._C import WAIT_POLICIES as POLICIES  # TORUS_WAIT's choices, the default first

CONTENDERS = (*POLICIES, "gloo")
LOADS_HELP = "none, busyN (N spinning processes) or build (make -B -j8 over and over)"


def parse_load(text: str) -> str:
    if text in ("none", "build") or (text.startswith("busy") and text[4:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"--load {text!r}: expected {LOADS_HELP}")


# ---------------------------------------------------------------- the load beside a cell


_SOURCE = """#include <map>
#include <regex>
#include <string>
#include <vector>
std::vector<std::string> f{index}(const std::string& text) {{
  std::map<std::string, std::vector<std::regex>> patterns;
  patterns[text].emplace_back("([a-z]+)[0-9]{{{index}}}");
  std::vector<std::string> found;
  for (auto& [key, list] : patterns)
    for (auto& pattern : list)
      for (std::sregex_iterator it(key.begin(), key.end(), pattern), end; it != end; ++it) found.push_back(it->str());
  return found;
}}
"""


@contextlib.contextmanager
def load_beside(load: str, workdir: Path):
    """Runs `load` while the block runs."""
    processes = []
    if load.startswith("busy"):
        for _ in range(int(load[4:])):
            processes.append(subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True))
    elif load == "build":
        tree = workdir / "build-load"
        tree.mkdir(parents=True, exist_ok=True)
        for index in range(16):
            (tree / f"unit{index}.cc").write_text(_SOURCE.format(index=index + 1))
        (tree / "Makefile").write_text("OBJECTS := $(patsubst %.cc,%.o,$(wildcard *.cc))\nall: $(OBJECTS)\n"
                                       "%.o: %.cc\n\tg++ -O2 -c $< -o $@\n")
        processes.append(subprocess.Popen(["sh", "-c", "while :; do make -s -B -j8 >/dev/null 2>&1; done"],
                                          cwd=tree, start_new_session=True))
    try:
        if processes:
            time.sleep(2)  # the load at full strength before the cell starts
        yield
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# ---------------------------------------------------------------- one rank of a cell


def make_group(label: str):
    import torch.distributed as dist

    if label == "gloo":
        return dist.new_group(backend="gloo")
    import torch_torus

    return dist.new_group(backend="torus", pg_options=torch_torus.Options(wait=label))


def calls_per_slice(args, seconds_per_call: float) -> int:
    """The calls each thread makes in one slice: about --seconds / --slices at the slowest rank's
    last pace (agreed on the control group, so every rank makes as many)."""
    import torch
    import torch.distributed as dist

    pace = torch.tensor([seconds_per_call], dtype=torch.float64)
    dist.all_reduce(pace, op=dist.ReduceOp.MAX)
    return int(min(20000, max(5, args.seconds / args.slices / pace.item())))


def all_reduce_slice(args, groups, label: str, calls: int) -> float:
    """Seconds per all_reduce over one slice, the mean over this rank's threads calling at once."""
    import torch
    import torch.distributed as dist

    start_together = threading.Barrier(args.threads)
    per_call = [0.0] * args.threads
    failures = []

    def thread_calls(index: int) -> None:
        try:
            tensor = torch.ones(args.bytes // 4)
            group = groups[label][index]
            dist.all_reduce(tensor, group=group)
            start_together.wait()
            start = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(tensor, group=group)
            per_call[index] = (time.perf_counter() - start) / calls
        except BaseException as error:  # reported by the rank below, not lost in a thread
            failures.append(error)
            start_together.abort()

    dist.barrier()
    threads = [threading.Thread(target=thread_calls, args=(i,)) for i in range(args.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return statistics.fmean(per_call)


def balanced_orders(labels: list[str]) -> list[list[str]]:
    """Orders of the contenders in which each follows each other equally often (a Williams
    square): a contender's slice runs in what the one before left (pause's ranks spinning on both
    cores, gloo's asleep), which with one fixed cyclic order cost the one behind gloo 10% in every
    4-rank cell, measured against the same code run behind pause."""
    n = len(labels)
    first = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    orders = [[labels[(k + i) % n] for k in first] for i in range(n)]
    return orders + [order[::-1] for order in orders] if n % 2 else orders


def all_reduce_round(args, groups, orders: list[list[str]], round_index: int) -> dict[str, float]:
    """One sample per contender, µs per call: the mean of --slices slices, the contenders taking
    turns slice by slice, so that a scheduler's mood that lasts a second hits all alike, in an
    order that changes every slice (balanced_orders)."""
    labels = orders[0]
    calls = {label: calls_per_slice(args, all_reduce_slice(args, groups, label, 10)) for label in labels}
    spent = {label: 0.0 for label in labels}
    for slice_index in range(args.slices):
        for label in orders[(round_index * args.slices + slice_index) % len(orders)]:
            per_call = all_reduce_slice(args, groups, label, calls[label])
            spent[label] += per_call
            # The pace of a busy host changes within a round: the next slice follows it.
            calls[label] = calls_per_slice(args, per_call)
    return {label: spent[label] / args.slices * 1e6 for label in labels}


class Training:
    """DDP ResNet-50 over each contender's group, fed by one DataLoader with worker processes."""

    def __init__(self, args, groups):
        import torch
        from torch.nn.parallel import DistributedDataParallel

        from torch_torus.resnet import resnet50

        self.args = args
        self.models = {}
        for label in args.contenders:
            torch.manual_seed(0)
            model = DistributedDataParallel(resnet50(num_classes=100), process_group=groups[label][0])
            self.models[label] = (model, torch.optim.SGD(model.parameters(), lr=0.01))
        loader = torch.utils.data.DataLoader(SyntheticImages(args.image_size), batch_size=8,
                                             num_workers=args.workers, persistent_workers=args.workers > 0)
        self.batches = itertools.cycle(loader) if args.workers == 0 else iter(_forever(loader))

    def sample(self, label: str) -> float:
        """images/s of this rank over --steps steps, after one untimed step."""
        import torch.distributed as dist
        import torch.nn.functional as F

        model, optimizer = self.models[label]

        def step() -> None:
            images, labels = next(self.batches)
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()

        step()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(self.args.steps):
            step()
        return 8 * self.args.steps / (time.perf_counter() - start)


def _forever(loader):
    while True:
        yield from loader


class SyntheticImages:
    """Random images made in the DataLoader's workers: their CPU time is the data pipeline's."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int):
        import torch

        generator = torch.Generator().manual_seed(index)
        return torch.randn(3, self.size, self.size, generator=generator), index % 100


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    if args.pin == "pinned":
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[local_rank % len(cores)]})
    torch.set_num_threads(1)
    # The control group: barriers and the probe's agreement, never timed.
    dist.init_process_group("gloo")
    groups = {label: [make_group(label) for _ in range(args.threads)] for label in args.contenders}
    training = Training(args, groups) if args.ddp else None
    samples: dict[str, list[float]] = {label: [] for label in args.contenders}
    orders = balanced_orders(args.contenders)
    for round_index in range(args.rounds):
        if training:
            for label in orders[round_index % len(orders)]:
                samples[label].append(training.sample(label))
        else:
            for label, value in all_reduce_round(args, groups, orders, round_index).items():
                samples[label].append(value)
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps(samples))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- the matrix


def cell_name(cell: dict) -> str:
    what = "DDP ResNet-50" if cell["ddp"] else f"{cell['threads']} thread{'s' * (cell['threads'] > 1)}"
    return f"{cell['ranks']} ranks, {what}, load {cell['load']}, pin {cell['pin']}"


def run_cell(args, cell: dict, workdir: Path) -> dict[str, list[float]]:
    result = workdir / "cell.json"
    result.unlink(missing_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cell['ranks']}",
               __file__, "--rank-main", "--result", str(result), "--threads", str(cell["threads"]),
               "--pin", cell["pin"], "--rounds", str(args.rounds), "--seconds", str(args.seconds), "--slices", str(args.slices),
               "--bytes", str(args.bytes), "--steps", str(args.steps), "--workers", str(args.workers),
               "--image-size", str(args.image_size), "--contenders", *args.contenders]
    if cell["ddp"]:
        command.append("--ddp")
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    with load_beside(cell["load"], workdir):
        subprocess.run(command, env=environment, check=True, timeout=args.cell_timeout,
                       stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())


def summary(cell: dict, samples: dict[str, list[float]]) -> dict:
    """auto against the best policy and gloo; for images/s higher is better."""
    higher_better = cell["ddp"]
    better = max if higher_better else min
    worst = min if higher_better else max
    medians = {label: statistics.median(values) for label, values in samples.items()}
    policies = [label for label in POLICIES if label in samples]
    best = better(policies, key=lambda label: medians[label])
    row = {"medians": medians, "slowest": {label: worst(values) for label, values in samples.items()}, "best": best}
    if "auto" in samples:
        ratio = (lambda a, b: b / a) if higher_better else (lambda a, b: a / b)
        row["auto_vs_best"] = ratio(medians["auto"], medians[best])
        row["auto_tail_vs_best_tail"] = ratio(row["slowest"]["auto"], row["slowest"][best])
        if "gloo" in samples:
            row["auto_vs_gloo"] = ratio(medians["auto"], medians["gloo"])
    return row


def table(cells: list[dict], contenders: list[str]) -> str:
    lines = ["| cell | unit | " + " | ".join(f"{c} median (slowest)" for c in contenders) +
             " | auto / best policy | auto / gloo | auto's slowest / best's slowest |",
             "|---|---|" + "---|" * len(contenders) + "---|---|---|"]
    for cell in cells:
        row = cell["summary"]
        unit = "images/s" if cell["ddp"] else "µs/call"
        values = " | ".join(f"{row['medians'][c]:.4g} ({row['slowest'][c]:.4g})" for c in contenders)
        flags = [f"{row.get(k, float('nan')):.2f}" for k in ("auto_vs_best", "auto_vs_gloo", "auto_tail_vs_best_tail")]
        lines.append(f"| {cell_name(cell)} | {unit} | {values} | " + " | ".join(flags) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--load", type=parse_load, nargs="+", default=["none", "busy2", "busy6", "build"],
                        help=LOADS_HELP)
    parser.add_argument("--pin", nargs="+", choices=["none", "pinned"], default=["none", "pinned"])
    parser.add_argument("--ddp", action="store_true", help="DDP ResNet-50 cells (2 ranks, unpinned, 1 thread)")
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0, help="length of one all_reduce sample")
    parser.add_argument("--slices", type=int, default=10, help="slices of a sample, interleaved with the others'")
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3, help="timed DDP steps per sample")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank (--ddp)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--cell-timeout", type=float, default=1200)
    parser.add_argument("--out", type=Path, default=Path("bench-out/busy_host.json"))
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        args.pin, args.threads = args.pin[0], args.threads[0]
        rank_main(args)
        return
    if args.bytes < 4 or args.bytes % 4:
        parser.error(f"--bytes {args.bytes}: a positive multiple of 4 (float32 elements)")
    if args.ddp:
        cells = [dict(ranks=2, threads=1, load=load, pin="none", ddp=True) for load in args.load]
    else:
        cells = [dict(ranks=r, threads=t, load=load, pin=pin, ddp=False)
                 for r, t, pin, load in itertools.product(args.ranks, args.threads, args.pin, args.load)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="busy-host-"))
    started = time.monotonic()
    try:
        for index, cell in enumerate(cells, 1):
            print(f"[{time.monotonic() - started:6.0f} s] cell {index}/{len(cells)}: {cell_name(cell)}",
                  file=sys.stderr, flush=True)
            cell["samples"] = run_cell(args, cell, workdir)
            cell["summary"] = summary(cell, cell["samples"])
            print("    " + ", ".join(f"{label} {statistics.median(values):.4g}"
                                     for label, values in cell["samples"].items()), file=sys.stderr, flush=True)
            args.out.write_text(json.dumps(cells[:index], indent=1))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = table(cells, args.contenders)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
