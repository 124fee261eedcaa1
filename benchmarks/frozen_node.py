"""How long the survivors of a frozen node take to fail, torus against gloo (issue 53).

python benchmarks/frozen_node.py [--rounds 3]

Runs tests/freeze_jobs.py: 4 ranks over a TCPStore served by a process of its own, group timeout
4 s, 1 MiB all_reduces; at step 20 the last rank freezes (SIGSTOP), with the store's process frozen
too ("store-frozen") or still answering ("store-answering"). Prints, per backend, scene and round,
each survivor's time from its last completed step to its error, whether the error names the frozen
rank, and the slowest survivor; a survivor still running 60 s after the timeout is reported as hung
(and killed). Backends and scenes alternate within each round.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import freeze_jobs  # noqa: E402
import test_freeze  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", nargs="+", default=["torus", "gloo"])
    args = parser.parse_args()
    import tempfile

    print(f"timeout {freeze_jobs.TIMEOUT_S:g} s; rank {test_freeze.SIZE - 1} of {test_freeze.SIZE} frozen at step "
          f"{freeze_jobs.FREEZE_AT}")
    print(f"{'round':>5} {'scene':<16} {'backend':<6} {'survivors failed after (s)':<28} names it  slowest")
    for round_ in range(1, args.rounds + 1):
        for scene in ("store-frozen", "store-answering"):
            for backend in args.backends:
                with tempfile.TemporaryDirectory() as scratch:
                    reports, problems = test_freeze.run_scene(scene, scratch, backend)
                times = [r["failed_after_s"] for r in reports if "failed_after_s" in r]
                named = all(f"rank {test_freeze.SIZE - 1}" in r.get("error", "") for r in reports)
                shown = ", ".join(f"{t:.2f}" for t in times) + (f" + {len(problems)} hung" if problems else "")
                slowest = "hung" if problems else f"{max(times):.2f}"
                print(f"{round_:>5} {scene:<16} {backend:<6} {shown:<28} {'yes' if named else 'no':<9} {slowest}",
                      flush=True)


if __name__ == "__main__":
    main()
