"""Two builds of torch-torus, benched alternately on one machine: did a change slow anything?

    python benchmarks/compare_builds.py --old ../old-checkout --new . --runs 3 -- -b 4K -e 64M -f 4

Each run is `torchrun --standalone -m torch_torus.bench --backends "<--backends>;gloo" --json ...`
with PYTHONPATH set to one build's source tree (its extension built in place), the builds taking
turns (old, new, old, new, ...) so that the machine's drift hits both alike. Prints, per torus
contender (`--backends`, default plain torus; e.g. "torus:allreduce=ring,transport=tcp;
torus:allreduce=direct,transport=tcp") and size, each build's median time over the runs, their
ratio (new / old), and the spread of each build's runs (max / min), which is the noise a ratio
must exceed to mean anything; gloo's ratio in the same runs shows how much the machine itself
moved. Writes every run's JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def add_run_options(parser: argparse.ArgumentParser, out: str) -> None:
    """The options of an alternating comparison of bench runs (this script, compare_settings.py)."""
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path(out))
    parser.add_argument("bench_args", nargs="*", help="after --: arguments for torch_torus.bench")


def bench_run(variables: dict[str, str], nproc: int, backends: str, bench_args: list[str], out: Path) -> dict:
    """One torchrun of the bench with `variables` added to the environment; its --json document."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "torch_torus.bench", "--backends", backends, "--json", str(out), *bench_args]
    subprocess.run(command, env={**os.environ, **variables}, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def times(document: dict, backend: str) -> dict[int, float]:
    return {row["size_bytes"]: row["time_us"] for row in document["rows"] if row["contender"] == backend}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, required=True, help="source tree of the old build")
    parser.add_argument("--new", type=Path, required=True, help="source tree of the new build")
    parser.add_argument("--backends", default="torus", help="torus contenders, separated by ';'")
    add_run_options(parser, "bench-out/compare_builds")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for index in range(args.runs):
        for build in ("old", "new"):
            print(f"run {index + 1}/{args.runs}: {build}", file=sys.stderr, flush=True)
            tree = args.old if build == "old" else args.new
            runs[build].append(bench_run({"PYTHONPATH": str(tree.resolve())}, args.nproc, f"{args.backends};gloo",
                                         args.bench_args, args.out / f"{build}_{index + 1}.json"))
    contenders = [c for c in dict.fromkeys(row["contender"] for row in runs["old"][0]["rows"]) if c != "gloo"]
    print("| contender | size | old µs | new µs | new/old | old spread | new spread | gloo new/old |")
    print("|---|---|---|---|---|---|---|---|")
    for contender in contenders:
        for size in sorted(times(runs["old"][0], backend=contender)):
            medians, spreads = {}, {}
            for build in ("old", "new"):
                values = [times(r, backend=contender)[size] for r in runs[build]]
                medians[build] = statistics.median(values)
                spreads[build] = max(values) / min(values)
            gloo = {b: statistics.median(times(r, backend="gloo")[size] for r in runs[b]) for b in ("old", "new")}
            print(f"| {contender} | {size} | {medians['old']:.1f} | {medians['new']:.1f} | "
                  f"{medians['new'] / medians['old']:.2f} | {spreads['old']:.2f} | {spreads['new']:.2f} | "
                  f"{gloo['new'] / gloo['old']:.2f} |")


if __name__ == "__main__":
    main()
