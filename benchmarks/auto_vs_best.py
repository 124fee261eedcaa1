"""How close `auto` comes to the best fixed allreduce algorithm, from bench --json files.

    python benchmarks/auto_vs_best.py benchmarks/results/cluster_auto_2x4_1gbit.json ...
    python benchmarks/auto_vs_best.py --choices --env TORUS_LINK_BANDWIDTH=1gbit FILE...

A file must hold the fixed contenders torus:allreduce=<algorithm> for ring, torus, direct,
recursive_doubling and rabenseifner. Without --choices, every other torus contender (auto, with
whatever options) is set against the fastest fixed one at each size: its own time / the best
time, and the time of the fixed contender of the algorithm it ran / the best time (what its
choice is worth when the same algorithm's two groups measure differently). With --choices, the
cost model of this checkout picks for each file's layout (world size and ranks per host, ranks
of a host consecutive), under the TORUS_* values of --env, and each pick's fixed contender is set
against the best: the choice checked against every run at once.
"""

from __future__ import annotations

import argparse
import json

from torch_torus.algorithms import ALLREDUCE as FIXED


def short(algorithm: str) -> str:
    """A table cell's name for an algorithm (recursive_doubling is too wide)."""
    return algorithm.replace("recursive_", "rec. ")

MISS = 1.10  # the target: auto within 10% of the best fixed algorithm


def size_text(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def ratio_text(value: float) -> str:
    return f"**{value:.2f}**" if value > MISS else f"{value:.2f}"


def load(path: str) -> tuple[dict, dict[int, dict[str, dict]]]:
    with open(path) as file:
        result = json.load(file)
    by_size: dict[int, dict[str, dict]] = {}
    for row in result["rows"]:
        by_size.setdefault(row["size_bytes"], {})[row["contender"]] = row
    return result, by_size


def fixed_times(rows: dict[str, dict]) -> dict[str, float]:
    """ms of each fixed contender that ran its own algorithm (one_shot's group runs two_shot above
    its shared-memory slot: that row is not a one_shot time)."""
    return {a: row["time_us"] / 1e3 for a in FIXED
            if (row := rows.get(f"torus:allreduce={a}")) and row.get("algorithm", a) == a}


def auto_table(path: str) -> None:
    result, by_size = load(path)
    autos = [c["label"] for c in result["contenders"]
             if c["backend"] == "torus" and c["options"].get("allreduce") not in FIXED]
    layout = " + ".join(str(k) for k in result["hosts"].values())
    head = f"| {path.rsplit('/', 1)[-1]} ({layout} ranks) | best fixed, ms |"
    rule = "|---|---|"
    for label in autos:
        head += f" `{label}`, ms | / best | its algorithm's fixed / best |"
        rule += "---|---|---|"
    print(head)
    print(rule)
    for size in sorted(by_size):
        rows = by_size[size]
        fixed = fixed_times(rows)
        best = min(fixed, key=fixed.__getitem__)
        line = f"| {size_text(size)} | {short(best)} {fixed[best]:.2f} |"
        for label in autos:
            row = rows[label]
            ms = row["time_us"] / 1e3
            line += (f" {short(row['algorithm'])} {ms:.2f} | {ratio_text(ms / fixed[best])} |"
                     f" {ratio_text(fixed[row['algorithm']] / fixed[best])} |")
        print(line)
    print()


def choices(paths: list[str], environ: dict[str, str]) -> None:
    from torch_torus import config, selection
    from torch_torus.topology import choose_grid

    values = config.resolve(None, environ=environ)
    misses = total = 0
    for path in paths:
        result, by_size = load(path)
        hosts = [host for host, count in result["hosts"].items() for _ in range(count)]
        grid = choose_grid(len(hosts), hosts, None)
        table = selection.resolve_tables(values, len(hosts), grid, hosts=hosts)["allreduce"]
        cells = []
        for size in sorted(by_size):
            fixed = fixed_times(by_size[size])
            best = min(fixed, key=fixed.__getitem__)
            pick = next(rule.algorithm for rule in table if rule.lo <= size <= rule.hi)
            value = fixed[pick] / fixed[best]
            misses, total = misses + (value > MISS), total + 1
            cells.append(f"{size_text(size)}: {pick} {ratio_text(value)}")
        print(f"{path}: {';'.join(str(r) for r in table)}\n  " + ", ".join(cells))
    print(f"{misses} of {total} picks more than {MISS - 1:.0%} slower than the best fixed algorithm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", nargs="+", help="bench --json outputs")
    parser.add_argument("--choices", action="store_true", help="check this checkout's cost model's picks instead")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="a TORUS_* value for --choices; repeatable")
    args = parser.parse_args()
    if args.choices:
        choices(args.json, dict(item.split("=", 1) for item in args.env))
    else:
        for path in args.json:
            auto_table(path)


if __name__ == "__main__":
    main()
