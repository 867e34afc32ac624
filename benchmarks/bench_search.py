"""The panel's "largest batch that fits": the line-and-confirm search beside the plain one.

Both run in this process on the same Explorer and the same measured steps: the plain search
doubles and then halves the interval (``largest_batch``), then runs the winner once more for the
comparison, as the panel did; the new one (``Explorer.largest_batch``, ``predicted_batch``) draws
the line of peak against batch from two small batches and confirms it near the edge. The answers
must be equal. Target (issue 23): ≤ 10 s on our 2-core CPU.
    python benchmarks/bench_search.py [--out FILE]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from common import emit, header

import memlab
from memlab.examples import GPT
from memlab.panel.search import largest_batch
from memlab.whatif import RunConfig, run


def gpt(layers: int, width: int, tokens: int) -> tuple[Callable[[], Any], Callable[[int], Any]]:
    def model_fn() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT(vocab=1000, ctx=tokens, width=width, layers=layers)

    def input_fn(batch: int) -> torch.Tensor:
        return torch.randint(0, 1000, (batch, tokens))

    return model_fn, input_fn


def case(name: str, layers: int, width: int, tokens: int, recipe: RunConfig, share: float) -> str:
    model_fn, input_fn = gpt(layers, width, tokens)
    base = run(model_fn, input_fn, None, recipe)
    assert base.peak is not None
    budget_mib = round(share * base.peak / 2**20, 1)

    def explorer() -> memlab.Explorer:
        ex = memlab.Explorer(model_fn, input_fn, config=recipe)
        ex.budget.value = budget_mib
        return ex

    # the plain search, as the panel ran it: every try a measured step, then the winner again
    ex = explorer()
    config = ex.config
    tries: list[int] = []

    def fits(batch: int) -> bool:
        tries.append(batch)
        return not ex._step(config.with_(batch_size=batch)).oom

    t0 = time.perf_counter()
    want = largest_batch(fits, config.accumulation)
    ex._step(config.with_(batch_size=want))
    plain = time.perf_counter() - t0

    ex = explorer()
    steps: list[int] = []
    measured = ex._step
    ex._step = lambda c: steps.append(c.batch_size) or measured(c)  # type: ignore[method-assign]
    t0 = time.perf_counter()
    got = ex.largest_batch()
    new = time.perf_counter() - t0
    same = "yes" if got == want else f"NO ({got} vs {want})"
    return (
        f"| {name} | {budget_mib:,} MiB | {want:,} | {plain:.1f} s ({len(tries) + 1} steps) "
        f"| {new:.1f} s ({len(steps)} steps: {', '.join(map(str, steps))}) | {plain / new:.1f}× "
        f"| {same} | {'met' if new <= 10 else 'missed'} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    rows = [
        case(
            "course GPT (notebook 07: 2 layers, width 128, 64 tokens, Adam), a quarter of batch "
            "32's peak",
            2,
            128,
            64,
            RunConfig(device="cpu", batch_size=32, optimizer="adam"),
            0.25,
        ),
        case(
            "small LM (the what-if notebook: 4 layers, width 128, 64 tokens, Adam), twice batch "
            "8's peak",
            4,
            128,
            64,
            RunConfig(device="cpu", batch_size=8),
            2.0,
        ),
        case(
            "small LM, 4 layers, width 256, 128 tokens, Adam: 4 × batch 8's peak",
            4,
            256,
            128,
            RunConfig(device="cpu", batch_size=8),
            4.0,
        ),
    ]
    lines = header("Largest batch that fits: line and confirm, beside doubling and halving")
    lines += [
        "Wall time of the whole search on one Explorer, each try a measured training step "
        "(warm-up + step), in this process; the plain search also runs the winner once more, "
        "as the panel did. Target: ≤ 10 s, the same answer.",
        "",
        "| model | budget | answer | doubling + halving | line + confirm | speed-up | same "
        "answer | target |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
        *rows,
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
