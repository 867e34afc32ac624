"""Capture + annotate + render (SVG) of annotated graphs, beside torchviz's make_dot.

Targets on our CPU machine: ResNet-50 with every node ≤ 2 s; a 12-layer GPT-2-small-sized
transformer in the module-level view ≤ 3 s.
    python benchmarks/bench_graph.py [--repeat 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from common import emit, header

import memlab
from memlab.examples import GPT, resnet50


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    cases = [
        (
            "ResNet-50, batch 1 at 224 px, every node",
            resnet50().train(),
            (torch.randn(1, 3, 224, 224),),
            None,
        ),
        (
            "GPT-2-small-sized (12 layers, 124 M), 1 × 128 tokens, module view (depth 2)",
            GPT(),
            (torch.randint(0, 50257, (1, 128)),),
            2,
        ),
        (
            "the same GPT on the meta device (nothing allocated)",
            GPT().to("meta"),
            (torch.randint(0, 50257, (1, 128), device="meta"),),
            2,
        ),
    ]
    rows = []
    for name, model, inputs, depth in cases:

        def ours(
            model: torch.nn.Module = model, inputs: tuple = inputs, depth: int | None = depth
        ) -> object:
            g = memlab.graph(model, *inputs)
            return g, g.svg(depth)

        secs, result = timed(ours, args.repeat)
        g = result[0]  # type: ignore[index]
        rows.append((name, len(g.nodes), g.activation_bytes, secs, torchviz_time(model, inputs)))
    lines = header("Annotated graphs: capture + annotate + render SVG")
    lines += [
        f"Median of {args.repeat} runs. torchviz: make_dot on the same forward's output, then "
        "render to SVG (no byte annotations, no modules).",
        "",
        "| graph | nodes | saved for backward | memlab | torchviz make_dot |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {n} | {k} | {b / 2**20:.1f} MiB | {s:.2f} s | {tv} |" for n, k, b, s, tv in rows]
    emit(lines, args.out)


def torchviz_time(model: torch.nn.Module, inputs: tuple) -> str:
    import torchviz

    if any(t.device.type == "meta" for t in inputs):
        return "n/a (needs real tensors to trace)"
    t0 = time.perf_counter()
    try:
        out = model(*inputs)
        torchviz.make_dot(out, params=dict(model.named_parameters())).pipe(format="svg")
    except Exception as e:  # e.g. RecursionError on deep graphs
        return f"failed: {type(e).__name__}"
    return f"{time.perf_counter() - t0:.2f} s"


if __name__ == "__main__":
    main()
