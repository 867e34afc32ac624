"""`bench_ops.py`'s three ways that matter for issue 23 alone (untracked step, `track()`, `track`
with a breakdown), more rounds and nothing heavy between them, for comparing two checkouts:
run it alternately from each (``PYTHONPATH=<checkout>``), several times, and compare the
medians. Prints one line: the untracked step (µs), `track` and breakdown as × untracked, and
what `track` and the breakdown add (µs).
    python benchmarks/bench_ops_light.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_ops import _untracked, mlp_step
from common import under

import memlab
from memlab.core import native
from memlab.core.native import pack


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=10, help="steps per timing")
    args = ap.parse_args()
    if native.unavailable() is None:
        pack.wait()
    step = mlp_step()
    ways = {
        "bare": _untracked,
        "track": lambda: memlab.track("cpu"),
        "breakdown": lambda: memlab.track("cpu", breakdown=True),
    }
    times: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(args.rounds + 1):
        for way, make in ways.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                under(make, step)
            if r:  # round 0 warms up
                times[way].append((time.perf_counter() - t0) / args.steps)
    med = {w: statistics.median(t) for w, t in times.items()}
    bare = med["bare"]
    print(
        f"untracked {bare * 1e6:.1f} µs; track {med['track'] / bare:.3f}×; breakdown "
        f"{med['breakdown'] / bare:.3f}×; track adds {(med['track'] - bare) * 1e6:.1f} µs, "
        f"the breakdown {(med['breakdown'] - med['track']) * 1e6:.1f} µs more"
    )


if __name__ == "__main__":
    main()
