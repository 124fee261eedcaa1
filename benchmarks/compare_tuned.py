"""Tuned auto against every fixed allreduce algorithm, from one bench --json run.

    python benchmarks/compare_tuned.py benchmarks/results/tuned_check_4ranks.json

The tuned contender is the one with a tuning_file option; the fixed ones name one algorithm.
Prints, per size, the best fixed algorithm's time, the tuned one's, what it ran, and the ratio.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", help="bench --json output with fixed and tuning_file contenders")
    with open(parser.parse_args().json) as file:
        rows = json.load(file)["rows"]
    by_size = defaultdict(dict)
    for row in rows:
        by_size[row["size_bytes"]][row["contender"]] = row
    print(f"| size | best fixed (us) | tuned auto (us) | tuned ran | tuned / best |")
    print("|---|---|---|---|---|")
    for size, contenders in sorted(by_size.items()):
        fixed = {c: r for c, r in contenders.items() if "allreduce" in r["options"] and "tuning_file" not in r["options"]}
        tuned = next(r for r in contenders.values() if "tuning_file" in r["options"])
        best = min(fixed.values(), key=lambda r: r["time_us"])
        print(f"| {size} | {best['time_us']:.0f} ({best['options']['allreduce']}) | {tuned['time_us']:.0f} | "
              f"{tuned['algorithm']} | {tuned['time_us'] / best['time_us']:.2f} |")


if __name__ == "__main__":
    main()
