"""One build benched under several environments, alternately: which setting is faster?

    python benchmarks/compare_settings.py --nproc 4 --runs 3 --backends 'torus;torus:api=op' \
        --setting base: --setting long:TORUS_EAGER_BYTES=1M -- -b 4K -e 1M -f 16

Each run is `torchrun --standalone -m torch_torus.bench --backends <--backends> --json ...` with
one setting's variables added to the environment (`label:NAME=VALUE,NAME=VALUE`; `label:` adds
none), the settings taking turns (a, b, c, a, b, c, ...) so that the machine's drift hits all
alike. Prints, per contender and size, each setting's median time over the runs, the spread of its
runs (max / min, the noise a ratio must exceed to mean anything) and its ratio to the first
setting. Writes every run's JSON to --out. (compare_builds.py does the same for two source trees.)
"""

from __future__ import annotations

import argparse
import statistics
import sys

from compare_builds import add_run_options, bench_run, times


def parse_setting(text: str) -> tuple[str, dict[str, str]]:
    label, sep, assignments = text.partition(":")
    if not label or not sep:
        raise SystemExit(f"--setting {text!r}: expected label:NAME=VALUE,... (label: for none)")
    variables = {}
    for item in filter(None, assignments.split(",")):
        name, eq, value = item.partition("=")
        if not name or not eq:
            raise SystemExit(f"--setting {text!r}: {item!r} is not NAME=VALUE")
        variables[name] = value
    return label, variables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", action="append", required=True, type=parse_setting,
                        help="label:NAME=VALUE,NAME=VALUE (repeat; the first is the baseline)")
    parser.add_argument("--backends", default="torus", help="bench contenders, separated by ';'")
    add_run_options(parser, "bench-out/compare_settings")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {label: [] for label, _ in args.setting}
    for index in range(args.runs):
        for label, variables in args.setting:
            print(f"run {index + 1}/{args.runs}: {label}", file=sys.stderr, flush=True)
            runs[label].append(bench_run(variables, args.nproc, args.backends, args.bench_args,
                                         args.out / f"{label}_{index + 1}.json"))
    labels = list(runs)
    first = runs[labels[0]][0]
    print(f"{args.nproc} ranks; median µs over {args.runs} runs (spread max/min) x ratio to {labels[0]}")
    print("| contender | size | " + " | ".join(labels) + " |")
    print("|---|---|" + "---|" * len(labels))
    for contender in dict.fromkeys(row["contender"] for row in first["rows"]):
        for size in sorted(times(first, backend=contender)):
            cells, baseline = [], None
            for label in labels:
                values = [times(run, backend=contender)[size] for run in runs[label]]
                median = statistics.median(values)
                baseline = baseline or median
                cells.append(f"{median:.1f} ({max(values) / min(values):.2f}) x{median / baseline:.2f}")
            print(f"| {contender} | {size} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
