"""Per-op cost of tensor accounting on a step made of many tiny ops (a small MLP, CPU).

Beside it, in the same process and interleaved round robin (so a busy machine slows all alike):
the untracked step, the same step under a dispatch mode that does nothing (the floor of any
accounting done in Python per op), PyTorch's MemTracker (torch.distributed._tools) where it
imports, and PyTorch's profiler recording memory (its allocation events kept in C++). Timed by
the process's CPU time (--wall: wall clock, for a quiet machine).
Target (issue 23): track ≤ 1.5×, with breakdown ≤ 2× the untracked step. The untracked step
runs with PyTorch's own CPU allocator (memlab's native record wraps it from its first region on;
a way of its own shows what the wrapper costs an untracked step).
    python benchmarks/bench_ops.py [--rounds 15] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from common import emit, header, under

import memlab
from memlab.core import native
from memlab.core._torch import TorchDispatchMode
from memlab.core.allocations import AllocationRecord
from memlab.core.native import pack


class _Nothing(TorchDispatchMode):
    ops = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        _Nothing.ops += 1
        return func(*args, **(kwargs or {}))


_wrapper = {"in": False}


def _untracked() -> None:
    if _wrapper["in"]:
        # PyTorch's own CPU allocator: the step as it runs without memlab (the record's
        # dispatch-key fallback stays registered: it runs only where a region includes its key)
        native.uninstall(keep_fallback=True)
        _wrapper["in"] = False


def _wrapped() -> None:
    if not _wrapper["in"]:
        with memlab.track("cpu"):  # puts the wrapper in (it stays until uninstalled)
            pass
        _wrapper["in"] = True


class _Env:
    """A region measured with the native record turned off."""

    def __init__(self, region: Any) -> None:
        self.region = region

    def __enter__(self) -> Any:
        os.environ["MEMLAB_NATIVE"] = "0"
        return self.region.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.region.__exit__(*exc)
        os.environ.pop("MEMLAB_NATIVE", None)


def mlp_step() -> Callable[[], None]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(8):
        layers += [torch.nn.Linear(32, 32), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(16, 32)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def memtracker() -> Callable[[], Any] | None:
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except Exception:
        return None
    return MemTracker


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=10, help="steps per timing")
    ap.add_argument(
        "--wall", action="store_true", help="wall clock instead of the process's CPU time"
    )
    ap.add_argument("--out")
    args = ap.parse_args()
    # waits for a first build of the record and of the breakdown's hooks in C (a compiler
    # running beside the timings would slow them; and a user's regions have the hooks in C
    # from a few seconds after the first)
    if native.unavailable() is None:
        pack.wait()
    step = mlp_step()
    tracker = memtracker()
    ways: dict[str, Callable[[], Any]] = {
        # the anchor runs with memlab's allocator wrapper taken out (the native record puts it
        # in at its first region); the next way shows what the wrapper alone costs
        "untracked step": _untracked,
        "untracked step, memlab's allocator wrapper in place": _wrapped,
        "a dispatch mode that does nothing": _Nothing,
        "memlab.track()": lambda: memlab.track("cpu"),
        "memlab.track() with MEMLAB_NATIVE=0 (the dispatch mode)": lambda: _Env(
            memlab.track("cpu")
        ),
        "memlab.track(breakdown=True)": lambda: memlab.track("cpu", breakdown=True),
    }
    if tracker is not None:
        ways["MemTracker"] = tracker
    # PyTorch's own record of CPU allocations, kept in C++: the profiler's memory events, with
    # its op records (the public profiler) and without them (memlab's AllocationRecord)
    ways["torch.profiler(profile_memory=True)"] = lambda: torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    )
    ways["AllocationRecord (the profiler's memory events alone)"] = AllocationRecord
    with _Nothing():
        before = _Nothing.ops
        step()
        ops = _Nothing.ops - before
    clock = time.perf_counter if args.wall else time.process_time
    times: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(args.rounds + 1):
        for way, make in ways.items():
            t0 = clock()
            for _ in range(args.steps):
                under(make, step)
            if r:  # round 0 warms up
                times[way].append((clock() - t0) / args.steps)
    med = {w: statistics.median(t) for w, t in times.items()}
    bare = med["untracked step"]
    lines = header("Per-op cost of tensor accounting: a step of many tiny ops (cpu)")
    lines += [
        f"A training step of an 8-layer MLP (32 wide, batch 16, SGD with momentum): {ops} ATen "
        f"ops. Median {'wall' if args.wall else 'CPU'} time over {args.rounds} rounds of "
        f"{args.steps} steps, the ways interleaved round robin in one process"
        + ("." if args.wall else " (the process's CPU time: the machine is shared with others)."),
        "",
        "| way | per step | × untracked | per op beyond the untracked step |",
        "| --- | ---: | ---: | ---: |",
    ]
    for way, t in med.items():
        lines.append(
            f"| {way} | {t * 1e3:.2f} ms | {t / bare:.2f}× | {(t - bare) / ops * 1e6:.1f} µs |"
        )
    emit(lines, args.out)


if __name__ == "__main__":
    main()
