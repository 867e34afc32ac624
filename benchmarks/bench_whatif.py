"""One what-if run's cost against the bare training step it measures.

Target: the measured step ≤ 1.3× the bare step + 0.2 s. A run also does one warm-up step (a
bare step, by design), so the whole run is reported beside it.
    python benchmarks/bench_whatif.py [--repeat 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import emit, header, median_time

from memlab.examples import GPT
from memlab.whatif import RunConfig, run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layers, batch, tokens = (12, 8, 256) if device == "cuda" else (2, 4, 128)
    torch.manual_seed(0)
    model = GPT(layers=layers, width=384 if device == "cpu" else 768).to(device)

    def input_fn(b: int) -> torch.Tensor:
        return torch.randint(0, 50257, (b, tokens), device=device)

    opt = torch.optim.Adam(model.parameters())

    def bare() -> None:
        model(input_fn(batch)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()

    bare()
    bare_s = median_time(bare, args.repeat)
    rows = []
    configs = [
        ("fp32", RunConfig(device=device, batch_size=batch)),
        ("checkpoint auto", RunConfig(device=device, batch_size=batch, checkpoint="auto")),
    ]
    if device == "cuda":  # bf16 matmuls on a CPU without bf16 units are many times slower
        configs.append(("bf16", RunConfig(device=device, batch_size=batch, amp="bf16")))
    for name, cfg in configs:
        steps, totals = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            r = run(lambda: model, input_fn, None, cfg)
            totals.append(time.perf_counter() - t0)
            assert r.report is not None
            steps.append(r.report.seconds)
        step = statistics.median(steps)
        ok = "met" if step <= 1.3 * bare_s + 0.2 else "missed"
        rows.append((name, step, statistics.median(totals), ok))
    lines = header(
        f"What-if run overhead ({device}, GPT with {layers} layers, batch {batch} × {tokens})"
    )
    lines += [
        f"Bare training step (Adam): {bare_s:.3f} s (median of {args.repeat}). Target: the "
        "measured step ≤ 1.3× bare + 0.2 s. A run is a warm-up step plus the measured step, plus "
        "restoring "
        "the model (its weights are copied to the CPU before and back after).",
        "",
        "| configuration | measured step | × bare | whole run | target |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    lines += [f"| {n} | {s:.3f} s | {s / bare_s:.2f}× | {t:.3f} s | {ok} |" for n, s, t, ok in rows]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
