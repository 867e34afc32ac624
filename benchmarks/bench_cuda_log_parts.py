"""Where a breakdown's time goes on a GPU (`memlab.core.cuda_log`), part by part (needs CUDA).

The cell `benchmarks/bench_magic.py` times under ``%%gpumem -q -b`` (a ~20 ms loop of training
steps of a 2-layer MLP, 2048 wide) runs here without a kernel, the ways taking turns each round:
bare; with the allocator's history alone (started, the loop, one snapshot, stopped: what
PyTorch's recording costs without memlab); under ``memlab.track()``; under
``memlab.track(breakdown=True)``. Under the last, each part of the log's work is timed on its
own: its start, the snapshot, the hooks' names at the end, the replay (``settle``), and the
rest of the close. Medians over the rounds, and how many events and names a region has.

    python benchmarks/bench_cuda_log_parts.py [--rounds 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from common import emit, header

import memlab
from memlab.core import _torch, cuda_log, cuda_names
from memlab.core._torch_history import start_cuda_log

_parts: dict[str, list[float]] = defaultdict(list)
_sizes: dict[str, list[int]] = defaultdict(list)


def timed(owner: Any, name: str, label: str, count: bool = False) -> None:
    """Times each call of ``owner.name`` into ``_parts[label]`` (while the benchmark runs);
    ``count``: the call is ``settle``'s, whose events and names are counted too."""
    inner = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if count:
            _sizes["events"].append(len(args[0]))
            _sizes["names"].append(len(args[3]))
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            _parts[label].append(time.perf_counter() - t0)

    setattr(owner, name, wrapper)


def model_and_step() -> tuple[Callable[[int], None], int]:
    torch.manual_seed(0)
    width = 2048
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = torch.randn(256, width, device="cuda")

    def step(n: int) -> None:
        for _ in range(n):
            model(batch).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    step(3)
    t0 = time.perf_counter()
    step(5)
    per = (time.perf_counter() - t0) / 5
    return step, max(1, round(0.020 / per))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA: nothing measured")
        return
    step, n = model_and_step()

    snapshot, record = _torch.memory_snapshot, _torch.record_memory_history  # (before timed)

    def history_alone() -> None:
        start_cuda_log(cuda_log.MAX_EVENTS)
        step(n)
        snapshot()
        record(False)

    def tracked(breakdown: bool) -> Callable[[], None]:
        def run() -> None:
            with memlab.track(breakdown=breakdown):
                step(n)

        return run

    ways: dict[str, Callable[[], None]] = {
        "bare": lambda: step(n),
        "the allocator's history alone": history_alone,
        "`track()`": tracked(False),
        "`track(breakdown=True)`": tracked(True),
    }
    for way in ways.values():  # warm up
        way()
    _parts.clear()
    _sizes.clear()
    timed(cuda_log.CudaLog, "start", "log start (history on, hooks in)")
    timed(cuda_log, "start_cuda_log", "  of which the history's start")
    timed(cuda_log.CudaLog, "stop", "log stop (hooks off, read, names at the end)")
    timed(_torch, "memory_snapshot", "  of which the snapshot")
    timed(cuda_names.Names, "at_end", "  of which the names at the end")
    timed(cuda_log, "active_blocks", "  of which the blocks alive, read")
    timed(_torch, "record_memory_history", "  of which the history's stop")
    timed(cuda_log, "settle", "the replay (settle)", count=True)
    walls: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.rounds):
        for name, way in ways.items():
            t0 = time.perf_counter()
            way()
            walls[name].append(time.perf_counter() - t0)

    bare = statistics.median(walls["bare"])
    lines = header("Where a breakdown's time goes on a GPU (`bench_cuda_log_parts.py`)")
    lines += [
        f"A loop of {n} training steps of a 2-layer MLP (2048 wide, batch 256, SGD), the cell "
        f"`bench_magic.py` times; median of {args.rounds} rounds, the ways taking turns.",
        "",
        "| way | wall | over bare |",
        "| --- | ---: | ---: |",
    ]
    for name, ts in walls.items():
        m = statistics.median(ts)
        lines.append(f"| {name} | {m * 1e3:.2f} ms | +{(m - bare) * 1e3:.2f} ms |")
    lines += ["", "| part of `track(breakdown=True)` | median per region |", "| --- | ---: |"]
    for name, ts in _parts.items():
        lines.append(f"| {name} | {statistics.median(ts) * 1e3:.3f} ms |")
    events, names = (statistics.median(_sizes[k]) if _sizes[k] else 0 for k in ("events", "names"))
    lines += ["", f"A region's log (median): {events:,.0f} events, {names:,.0f} names."]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
