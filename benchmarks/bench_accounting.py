"""Tensor-accounting overhead on a CPU training step of a ResNet-18-sized network.

Target: memlab.track on the CPU (tensor accounting) costs at most 1.3x the bare step.
    python benchmarks/bench_accounting.py [--batch 8] [--repeat 5] [--out FILE]
"""

from __future__ import annotations

import argparse

import torch
from common import emit, header, median_time

import memlab
from memlab.examples import resnet18


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = resnet18()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, 1000, (args.batch,))

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def tracked(**kw: bool) -> None:
        with memlab.track("cpu", **kw):
            step()

    for _ in range(2):  # warm-up: first-use allocations, momentum buffers, lazy imports
        step()
        tracked(breakdown=True, timeline=True)
    bare = median_time(step, args.repeat)
    rows = [("bare step", bare)]
    for name, kw in (
        ("track()", {}),
        ("track(breakdown=True)", {"breakdown": True}),
        ("track(breakdown=True, timeline=True)", {"breakdown": True, "timeline": True}),
    ):
        rows.append((name, median_time(lambda kw=kw: tracked(**kw), args.repeat)))
    with memlab.track("cpu", breakdown=True) as t:
        step()
    lines = header(f"Tensor accounting on a ResNet-18 training step (CPU, batch {args.batch})")
    lines += [
        f"Median of {args.repeat} steps after 2 warm-up steps. Target: ≤ 1.3× the bare step.",
        "",
        "| run | seconds | × bare |",
        "| --- | ---: | ---: |",
    ]
    lines += [f"| {name} | {s:.3f} | {s / bare:.2f}× |" for name, s in rows]
    r = t.report
    lines += [
        "",
        f"The step's peak above its start: {r.peak_delta / 2**20:.1f} MiB "
        f"({len(list(model.parameters()))} parameter tensors, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters).",
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
