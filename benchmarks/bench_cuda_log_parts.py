"""Where a breakdown's time goes on a GPU (`memlab.core.cuda_log`), part by part (needs CUDA).

The cell `benchmarks/bench_magic.py` times under ``%%gpumem -q -b`` (a ~20 ms loop of training
steps of a 2-layer MLP, 2048 wide) runs here without a kernel, the ways taking turns each round:
bare; with the allocator's history alone (started, the loop, one snapshot, stopped: what
PyTorch's recording costs without memlab); under ``memlab.track()``; under
``memlab.track(breakdown=True)``. Under the last, each part of the log's work is timed on its
own: its start, the snapshot, the hooks' names at the end, the replay (``settle``, made when
the breakdown is first read: one way reads it), and the rest of the close. Medians over the
rounds, and how many events and names a region has.

    python benchmarks/bench_cuda_log_parts.py [--rounds 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import gc
import gzip
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from common import emit, header

import memlab
from memlab.core import _torch, cuda_later, cuda_log, cuda_names
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


def again(step: Callable[[int], None], n: int, dump: str | None) -> list[str]:
    """One region's replay timed again in the process, on its own: as it came, with the
    garbage collector off, and on a copy of the log made through JSON; written to ``dump``."""
    from memlab.core import cuda_settle

    got: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    inner = cuda_settle.settle

    def keep(*a: Any, **k: Any) -> Any:
        got.append((copy.deepcopy(a), copy.deepcopy(k)))
        return inner(*a, **k)

    cuda_later.settle = keep
    try:
        with memlab.track(breakdown=True, reset_peak=True) as region:
            step(n)
        report = region.report
        report.breakdown  # noqa: B018  (the replay waits for the first read)
    finally:
        cuda_later.settle = inner
    if not got:
        return ["The replay timed again: the region did not replay a log."]
    (a, k) = got[-1]

    def median_of(run: Callable[[], Any], gc_off: bool = False) -> float:
        times = []
        for _ in range(40):
            if gc_off:
                gc.disable()
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
            gc.enable()
        return statistics.median(times) * 1e3

    plain = json.loads(json.dumps(a[0]))
    keys = sorted({key for e in a[0] for key in e})
    out = [
        f"The replay timed again (one region, 40 times): {median_of(lambda: inner(*a, **k)):.3f} ms"
        f"; the garbage collector off {median_of(lambda: inner(*a, **k), True):.3f} ms; on a "
        f"copy of the log through JSON {median_of(lambda: inner(plain, *a[1:], **k)):.3f} ms. "
        f"An event's keys: {', '.join(keys)}.",
    ]
    if dump:
        record = {
            "events": a[0],
            "before": a[1],
            "active_at_end": a[2],
            "named": [(addr, when, c.value) for addr, when, c in a[3]],
            **{key: list(v) for key, v in k.items() if key != "complete"},
            # the allocator's own figures for the region, the truth the replay is checked with
            "allocator": {"peak": report.peak_allocated, "end": report.allocated_after},
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(),
        }
        with gzip.open(dump, "wt") as f:
            json.dump(record, f, default=str)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out")
    ap.add_argument("--dump", help="writes one region's log and names here (.json.gz)")
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

    def tracked(breakdown: bool, read: bool = False) -> Callable[[], None]:
        def run() -> None:
            with memlab.track(breakdown=breakdown) as region:
                step(n)
            if read:  # (the log's replay waits for the breakdown's first read)
                region.report.breakdown  # noqa: B018

        return run

    ways: dict[str, Callable[[], None]] = {
        "bare": lambda: step(n),
        "the allocator's history alone": history_alone,
        "`track()`": tracked(False),
        "`track(breakdown=True)`": tracked(True),
        "`track(breakdown=True)`, the breakdown read": tracked(True, read=True),
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
    timed(cuda_later, "settle", "the replay (settle), at the breakdown's first read", count=True)
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
    try:
        lines += ["", *again(step, n, args.dump)]
    except Exception as e:  # (the table above still stands)
        lines += ["", f"The replay timed again: failed ({type(e).__name__}: {e})"]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
