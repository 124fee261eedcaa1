"""Run examples/hybrid_update.py on the emulated cluster for several modes, one run after another,
each under `flock /tmp/torus-bench.lock` (no overlap with other measurements on this machine).
Each run's whole output goes to <out>/hybrid_<task>_<hosts>x<nproc>_<link>_<run>[_seed<s>].txt,
and the JSON lines of all runs to <out>/hybrid_<task>_<hosts>x<nproc>_<link>.json (appended).

    python -m benchmarks.hybrid_grid --hosts 2 --nproc-per-host 4 --link 100mbit \\
        --runs sync hybrid:8:4 periodic:8 -- --task resnet50 --steps 32 --warmup-steps 2

A run is `sync`, `periodic:H` or `hybrid:H:τ`; arguments after `--` go to the example (each run
adds --mode, --period and --delay). TORUS_LINK_BANDWIDTH is set to the link's rate, so that
the cost model of every mode knows it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LOCK = "/tmp/torus-bench.lock"


def mode_arguments(run: str) -> list[str]:
    mode, *numbers = run.split(":")
    wanted = {"sync": 0, "periodic": 1, "hybrid": 2}
    if mode not in wanted or len(numbers) != wanted[mode] or not all(n.isdigit() for n in numbers):
        raise argparse.ArgumentTypeError(f"--runs: {run!r} is not sync, periodic:H or hybrid:H:TAU")
    arguments = ["--mode", mode]
    if numbers:
        arguments += ["--period", numbers[0], "--delay", numbers[1] if mode == "hybrid" else "0"]
    return arguments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, required=True)
    parser.add_argument("--nproc-per-host", type=int, required=True)
    parser.add_argument("--link", required=True, help="tc rate of every link, e.g. 100mbit")
    parser.add_argument("--runs", nargs="+", required=True, help="sync, periodic:H, hybrid:H:TAU")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="run each mode once per seed (--seed to the example)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("example_arguments", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    for run in args.runs:
        try:
            mode_arguments(run)  # refuse a bad run before the first measurement
        except argparse.ArgumentTypeError as error:
            parser.error(str(error))
    example = [a for a in args.example_arguments if a != "--"]
    task = example[example.index("--task") + 1] if "--task" in example else "unknown"
    layout = f"{task}_{args.hosts}x{args.nproc_per_host}_{args.link}"
    json_path = args.out / f"hybrid_{layout}.json"
    for seed in args.seeds or [None]:
        for run in args.runs:
            name = f"hybrid_{layout}_{run.replace(':', '_')}" + (f"_seed{seed}" if seed is not None else "")
            command = ["flock", LOCK, sys.executable, "-m", "benchmarks.cluster", "--hosts", str(args.hosts),
                       "--nproc-per-host", str(args.nproc_per_host), "--link", args.link,
                       "--env", f"TORUS_LINK_BANDWIDTH={args.link}", "--", "examples/hybrid_update.py",
                       *example, *mode_arguments(run), *(["--seed", str(seed)] if seed is not None else [])]
            print(" ".join(command), flush=True)
            result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
            (args.out / f"{name}.txt").write_text(result.stdout + result.stderr)
            lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
            if result.returncode or not lines:
                print(f"{name}: failed (exit {result.returncode}); see {args.out / (name + '.txt')}", flush=True)
                continue
            record = {**json.loads(lines[-1]), "hosts": args.hosts, "nproc_per_host": args.nproc_per_host,
                      "link": args.link, "seed": seed}
            with open(json_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"{name}: {lines[-1]}", flush=True)


if __name__ == "__main__":
    main()
