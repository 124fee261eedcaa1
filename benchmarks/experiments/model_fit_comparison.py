"""How well and how fast torch_torus.model's --fit fits, on the fits of BENCHMARKS.md's model
sections: each fitted to a tuning run and compared with independent bench runs.

    python benchmarks/experiments/model_fit_comparison.py [--repeat 3]

Per fit: predictions within 25% of the measurements fitted to and of the independent ones
(what `python -m torch_torus.model --fit ... --compare ...` prints), their squared relative
errors, the fitted figures, and the fit's time (the best of --repeat runs; loading the files and
importing are not timed).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from torch_torus import model

R = "benchmarks/results/"
CLUSTER = {"nodes": 2, "ranks_per_node": 4, "link_bandwidth": 117e6}  # --link-bandwidth 117M: given
FITS = [  # name, figures given (kept out of the fit), fitted to, compared with
    ("4 ranks", {"nodes": 1, "ranks_per_node": 4}, [R + "tuning_4ranks.json"], [R + "tuned_check_4ranks.json"]),
    ("2 x 4 cluster", CLUSTER, [R + "tuning_cluster_2x4_1gbit.json"],
     [R + "cluster_shmtcp_small_2x4_1gbit.json", R + "cluster_shmtcp_big_2x4_1gbit.json"]),
    ("2 x 4 fit, 4 x 2 and 8 x 1 runs", CLUSTER, [R + "tuning_cluster_2x4_1gbit.json"],
     [R + f"cluster_shmtcp_{s}_4x2_1gbit.json" for s in ("small", "big")]
     + [R + f"cluster_rounds_{s}_8x1_1gbit.json" for s in ("small", "big")]),
    ("4 ranks, 16 cores", {"nodes": 1, "ranks_per_node": 4}, [R + "tuning_4ranks_16cores.json"],
     [R + "tuned_check_4ranks_16cores.json"]),
    ("8 ranks, 16 cores", {"nodes": 1, "ranks_per_node": 8}, [R + "tuning_8ranks_16cores.json"],
     [R + "tuned_check_8ranks_16cores.json"]),
]


def scores(system: model.System, measurements: list[model.Measurement]) -> str:
    ratios = [model.predict(system, m) / m.seconds for m in measurements]
    within = sum(abs(r - 1) <= 0.25 for r in ratios)
    return f"{within:>2} of {len(ratios):<2} (squared error {sum((r - 1) ** 2 for r in ratios):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="fits timed per case (default: %(default)s)")
    args = parser.parse_args()
    print(f"# {'fit':<32} {'within 25%: fitted points':<34} {'independent points':<34} {'seconds':>7}")
    for name, given, fitted_to, compared_with in FITS:
        system = dataclasses.replace(model.System(), **given)
        fitted, independent = model.load_measurements(fitted_to), model.load_measurements(compared_with)
        fixed = tuple(n for n in model.FITTED if n in given)
        seconds = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            result = model.fit(system, fitted, fixed=fixed)
            seconds.append(time.perf_counter() - started)
        print(f"  {name:<32} {scores(result, fitted):<34} {scores(result, independent):<34} {min(seconds):>7.2f}")
        print("      " + ", ".join(f"{n}={getattr(result, n):.3g}" for n in model.FITTED))


if __name__ == "__main__":
    main()
