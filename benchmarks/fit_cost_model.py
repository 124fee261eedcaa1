"""Fit the allreduce cost model's machine figures to measured bench results.

    torchrun --nproc-per-node 4 -m torch_torus.bench --backends "torus:allreduce=ring;..." --json a.json
    python benchmarks/fit_cost_model.py a.json b.json

Every torus row whose `algorithm` column names one algorithm gives one equation
time = steps*latency + steps*crowding*crowded_latency + wire/bandwidth + reduced/reduce_rate
+ extra_messages*overhead, crowding = max(0, ranks/cores - 1) with --cores the host's cores
(default: this machine's; linear in the five unknowns, see torch_torus.cost_model.Machine); they
are solved by non-negative least squares on relative error (scipy.optimize.nnls), then each row's
prediction is printed beside its measurement.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
from scipy.optimize import nnls

from torch_torus.cost_model import Machine, allreduce_terms
from torch_torus.topology import choose_grid


def load_rows(paths):
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        n = result["world_size"]
        grid = choose_grid(n, [h for h, k in result["hosts"].items() for _ in range(k)], None)
        for row in result["rows"]:
            if row["backend"] == "torus" and row.get("algorithm") and row["time_us"]:
                terms = allreduce_terms(row["algorithm"], row["size_bytes"], n, grid.shape if grid else None)
                yield n, row, terms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", nargs="+", help="bench --json outputs")
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="cores of the host the runs ran on")
    args = parser.parse_args()
    rows = list(load_rows(args.json))
    if not rows:
        raise SystemExit("no torus rows with an algorithm column in " + ", ".join(args.json))
    seconds = np.array([row["time_us"] * 1e-6 for _, row, _ in rows])
    crowding = [max(0.0, n / args.cores - 1) for n, _, _ in rows]
    features = np.array([[t.steps, t.steps * c, t.wire_bytes, t.reduced_bytes, t.extra_messages]
                         for (_, _, t), c in zip(rows, crowding)])
    # Scale columns to unit size and rows by the measurement: a relative-error fit.
    scale = features.max(axis=0)
    scale[scale == 0] = 1
    solution = nnls(features / scale / seconds[:, None], np.ones(len(rows)))[0] / scale
    latency, crowded, inverse_bandwidth, inverse_reduce, overhead = (float(v) for v in solution)
    machine = Machine(latency=latency, bandwidth=1 / max(inverse_bandwidth, 1e-30),
                      reduce_rate=1 / max(inverse_reduce, 1e-30), message_overhead=overhead,
                      crowded_latency=crowded)
    print(f"# fitted ({args.cores} cores): {machine}")
    print(f"# {'n':>3} {'algorithm':>20} {'size':>10} {'measured us':>12} {'predicted us':>12} {'ratio':>6}")
    for n, row, terms in rows:
        predicted = machine.on_host(n, args.cores).seconds(terms) * 1e6
        print(f"  {n:>3} {row['algorithm']:>20} {row['size_bytes']:>10} {row['time_us']:>12.1f} "
              f"{predicted:>12.1f} {predicted / row['time_us']:>6.2f}")


if __name__ == "__main__":
    main()
