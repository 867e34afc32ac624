"""Where ``%%gpumem -q -b``'s time goes inside a real ipykernel (bench_magic.py's step cell).

The ways take turns, each cell run with `run_cell` as bench_magic.py runs it: bare; ``-q``;
``-q -b``; the same region without the magic (``with memlab.track(breakdown=True)`` in the
cell); ``-q -b`` with the garbage collector off for the cell, and off only while the
allocator's snapshot is made; each with the collector's passes counted and timed. Then cProfile
over the ``-q -b`` cells: memlab's functions by cumulative time, and every function by its own time.

    python benchmarks/bench_magic_parts.py [--repeat 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import pstats
import statistics
import sys
import time
from typing import Any

from bench_magic import SETUP, calibrate_step, in_kernel
from common import emit, header
from IPython.core.interactiveshell import InteractiveShell

#: The garbage collector's passes while a cell runs: (generation, seconds) each.
_passes: list[tuple[int, float]] = []
_started: list[float] = []


def _gc_watch(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _started.append(time.perf_counter())
    elif _started:
        _passes.append((info["generation"], time.perf_counter() - _started.pop()))


def _snapshot_gc_off(inner: Any) -> Any:
    def read() -> Any:
        on = gc.isenabled()
        gc.disable()
        try:
            return inner()
        finally:
            if on:
                gc.enable()

    return read


def run(shell: Any, cell: str, way: str = "") -> tuple[float, list[tuple[int, float]]]:
    """The cell's wall time and the collector's passes in it; ``way``: "gc off" (for the
    cell) or "snapshot gc off" (only while the allocator's snapshot is made)."""
    from memlab.core import _torch

    plain = _torch.memory_snapshot
    if way == "snapshot gc off":
        _torch.memory_snapshot = _snapshot_gc_off(plain)
    del _passes[:]
    with contextlib.redirect_stdout(io.StringIO()):
        if way == "gc off":
            gc.disable()
        t0 = time.perf_counter()
        try:
            shell.run_cell(cell, store_history=True)
        finally:
            took = time.perf_counter() - t0
            gc.enable()
            _torch.memory_snapshot = plain
    return took, list(_passes)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--out")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.inner:
        in_kernel(sys.argv[1:], __file__)
        return
    shell = InteractiveShell.instance()
    shell.run_cell(SETUP)
    n = calibrate_step(shell)
    if "memlab" not in shell.extension_manager.loaded:
        shell.run_line_magic("load_ext", "memlab")
    shell.run_cell("import memlab")
    body = f"step({n})"
    ways = {
        "bare": (body, ""),
        "%%gpumem -q": ("%%gpumem -q\n" + body, ""),
        "%%gpumem -q -b": ("%%gpumem -q -b\n" + body, ""),
        "`with memlab.track(breakdown=True)` in the cell": (
            f"with memlab.track(breakdown=True):\n    {body}",
            "",
        ),
        "%%gpumem -q -b, garbage collector off": ("%%gpumem -q -b\n" + body, "gc off"),
        "%%gpumem -q -b, collector off for the snapshot": (
            "%%gpumem -q -b\n" + body,
            "snapshot gc off",
        ),
    }
    gc.callbacks.append(_gc_watch)
    for cell, way in ways.values():
        for _ in range(3):
            run(shell, cell, way)
    times: dict[str, list[float]] = {w: [] for w in ways}
    passes: dict[str, list[list[tuple[int, float]]]] = {w: [] for w in ways}
    for _ in range(args.repeat):
        for w, (cell, way) in ways.items():
            took, seen = run(shell, cell, way)
            times[w].append(took)
            passes[w].append(seen)
    gc.callbacks.remove(_gc_watch)
    bare = statistics.median(times["bare"])
    lines = header("Where `%%gpumem -q -b`'s time goes in a kernel (`bench_magic_parts.py`)")
    lines += [
        f"`step({n})`, bench_magic.py's cell; median of {args.repeat}, the ways taking turns; "
        "the garbage collector's passes in the cells (per cell: how many of each generation, "
        "and their time, mean).",
        "",
        "| way | wall | over bare | gc passes 0/1/2 a cell | gc time a cell |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for w, ts in times.items():
        m = statistics.median(ts)
        cells = passes[w]
        by_gen = [sum(1 for c in cells for g, _ in c if g == k) / len(cells) for k in range(3)]
        spent = sum(t for c in cells for _, t in c) / len(cells)
        lines.append(
            f"| {w} | {m * 1e3:.2f} ms | +{(m - bare) * 1e3:.2f} ms | "
            f"{'/'.join(f'{x:.1f}' for x in by_gen)} | {spent * 1e3:.2f} ms |"
        )
    lines += [
        "",
        f"Objects the collector tracks: {len(gc.get_objects()):,}; thresholds "
        f"{gc.get_threshold()}.",
    ]
    prof = cProfile.Profile()
    cell = ways["%%gpumem -q -b"][0]
    with contextlib.redirect_stdout(io.StringIO()):
        prof.enable()
        for _ in range(args.repeat):
            shell.run_cell(cell, store_history=True)
        prof.disable()
    for order, only in (("cumulative", "memlab"), ("tottime", "")):
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out).sort_stats(order)
        stats.print_stats(only, 40) if only else stats.print_stats(30)
        lines += ["", f"cProfile of {args.repeat} `-q -b` cells, by {order}:", "", "```"]
        lines += [ln for ln in out.getvalue().splitlines() if ln.strip()][-45:]
        lines += ["```"]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
