"""Bounded time on big inputs (issue 18): graphs of deep models, long histories, big namespaces.

Targets on our 2-core CPU machine: the first picture of a 5,000-layer Sequential's graph (capture,
then what a notebook shows) ≤ 5 s; the history plot of 100,000 cells ≤ 0.5 s; the leak finder
over a namespace with a million-item list, deep nesting and hostile objects ≤ 1 s.
    python benchmarks/bench_limits.py [--repeat 3] [--timeout 120] [--out FILE]

Only public calls are used, so the same script times an older memlab (for before/after figures);
a case that errs or runs past --timeout is reported as such.
"""

from __future__ import annotations

import argparse
import random
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
from common import emit, header, median_time

import memlab
from memlab.graphs.retained import find_retained
from memlab.magic.history import History
from memlab.reports.plot import plot_history, png
from memlab.reports.report import MemoryReport


class TimedOutError(Exception):
    pass


def within(seconds: int, fn: Callable[[], object], repeat: int) -> str:
    def alarm(*_: Any) -> None:
        raise TimedOutError

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        return f"{median_time(fn, repeat):.3f} s"
    except TimedOutError:
        return f"> {seconds} s (stopped)"
    except Exception as e:
        return f"failed: {type(e).__name__}: {str(e)[:80]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def deep_mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(5_000):
        layers += [torch.nn.Linear(8, 8), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers), torch.randn(2, 8)


def torchviz_svg(model: torch.nn.Module, x: torch.Tensor) -> Callable[[], object]:
    """torchviz's picture of the same forward (no byte annotations), rendered by dot."""

    def draw() -> object:
        from torchviz import make_dot

        return make_dot(model(x), params=dict(model.named_parameters())).pipe(format="svg")

    return draw


def recurrence(steps: int) -> torch.Tensor:
    w = torch.randn(16, 16, requires_grad=True)
    h = torch.randn(4, 16)
    for _ in range(steps):
        h = torch.tanh(h @ w)
    return h


def chain(n: int) -> torch.Tensor:
    y = torch.ones(4, requires_grad=True)
    for _ in range(n):
        y = y * 1.0001
    return y


def hostile_namespace() -> dict[str, Any]:
    class Proxy:
        def __getattr__(self, name: str) -> Any:
            raise RuntimeError("working outside of request context")

    class Slow:
        @property
        def value(self) -> int:
            time.sleep(10)
            return 1

    nested: list[Any] = [chain(10)]
    for _ in range(5_000):
        nested = [nested]
    ns: dict[str, Any] = {f"v{i}": [i, {"k": float(i)}] for i in range(10_000)}
    w = torch.randn(64, 64, requires_grad=True)
    ns.update(
        huge=list(range(1_000_000)),
        nested=nested,
        proxy=Proxy(),
        slow=Slow(),
        losses=[(torch.randn(8, 64) @ w).relu().sum() for _ in range(10)],
    )
    return ns


def history_series(n: int) -> tuple[list[str], list[int], list[int]]:
    rng = random.Random(0)
    after = [rng.randrange(2**30) for _ in range(n)]
    return [f"[{i}]" for i in range(n)], after, [a + rng.randrange(2**28) for a in after]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=120)
    ap.add_argument("--out")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # imported once, outside the timings

    model, x = deep_mlp()
    g = memlab.graph(model, x)
    rnn, long = recurrence(5_000), chain(30_000)
    ns = hostile_namespace()
    s10k, s100k = history_series(10_000), history_series(100_000)
    h10k = History()
    for i in range(10_000):
        h10k.add(i, MemoryReport("cpu", "tensor-accounting", 0, i * 1024, i * 2048, 0.001))
    cases: list[tuple[str, Callable[[], object], float]] = [
        ("5,000 × (Linear, ReLU): memlab.graph (capture)", lambda: memlab.graph(model, x), 5),
        (
            "  the same: capture + what a notebook shows (SVG, table)",
            lambda: memlab.graph(model, x)._repr_mimebundle_(),
            5,
        ),
        ("  its module view, depth 1 (SVG)", lambda: g.view(depth=1).svg(), 5),
        (
            "  anchor: torchviz make_dot of the same forward, rendered to SVG",
            torchviz_svg(model, x),
            5,
        ),
        (
            "5,000-step recurrence sharing one weight: graph_of + SVG",
            lambda: memlab.graph_of(rnn).svg(),
            5,
        ),
        ("30,000-node chain: graph_of + SVG", lambda: memlab.graph_of(long).svg(), 5),
        ("history plot, 10,000 cells (figure + PNG)", lambda: png(plot_history(*s10k)), 0.5),
        ("history plot, 100,000 cells (figure + PNG)", lambda: png(plot_history(*s100k)), 0.5),
        ("history of 10,000 cells: table (HTML + text)", lambda: (h10k.html(), h10k.text()), 0.5),
        (
            "leak finder: 10,000 variables, 1 M-item list, 5,000-deep nesting, a proxy",
            lambda: find_retained(ns),
            1,
        ),
    ]
    rows = [(name, within(args.timeout, fn, args.repeat), target) for name, fn, target in cases]
    lines = header("Bounded time on big inputs")
    lines += [
        f"Median of {args.repeat} runs; a case stops after {args.timeout} s.",
        "",
        "| case | time | target |",
        "| --- | ---: | ---: |",
    ]
    lines += [f"| {name} | {t} | ≤ {target} s |" for name, t, target in rows]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
