"""What a breakdown costs on a GPU, against a dispatch mode that does nothing (needs CUDA).

On a GPU, ``memlab.track()`` reads the caching allocator's counters at each end and follows no
op; ``breakdown=True`` reads the allocator's own log (`memlab.core.cuda_log`: no Python per
op), and with ``MEMLAB_CUDA_LOG=0`` every op passes through memlab's Python dispatch mode
instead. Three training steps, each timed bare, under a do-nothing ``TorchDispatchMode``, under
``track()``, under ``track(breakdown=True)`` both ways, the ways taking turns: torchvision's
ResNet-18 (batch 64, 224×224; where torchvision imports), an 8-layer tiny-op MLP, and a 4-layer
GPT-2 from transformers (where it imports). Then the process's CPU time against its wall time
with a breakdown: equal means the CPU is the bound (no sync waits hidden in it).

    python benchmarks/bench_gpu_breakdown.py [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from common import emit, header, median_time, under
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memlab


class Nothing(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def resnet18() -> tuple[nn.Module, torch.Tensor] | None:
    try:
        import torchvision
    except Exception:  # not installed, or built for another torch
        return None
    return torchvision.models.resnet18().cuda(), torch.randn(64, 3, 224, 224, device="cuda")


def mlp() -> tuple[nn.Module, torch.Tensor]:
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]).cuda()
    return model, torch.randn(16, 64, device="cuda")


def training_step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if x.is_cuda:
            torch.cuda.synchronize()

    return step


class DispatchMode:
    """``track(breakdown=True)`` measured by the dispatch mode (``MEMLAB_CUDA_LOG=0``)."""

    def __enter__(self) -> DispatchMode:
        os.environ["MEMLAB_CUDA_LOG"] = "0"
        self.region = memlab.track("cuda", breakdown=True)
        self.region.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.region.__exit__(*exc)
        finally:
            os.environ.pop("MEMLAB_CUDA_LOG", None)


class Read:
    """``track(breakdown=True)`` with its breakdown read after the step (the log's replay
    waits for the first read: `memlab.core.cuda_later`)."""

    def __enter__(self) -> Read:
        self.region = memlab.track("cuda", breakdown=True)
        self.region.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.region.__exit__(*exc)
        self.region.report.breakdown  # noqa: B018


def gpt2() -> tuple[nn.Module, Any] | None:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except Exception:
        return None
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8000, n_positions=256)
    model = GPT2LMHeadModel(cfg).cuda()
    ids = torch.randint(0, 8000, (8, 256), device="cuda")

    class Loss(nn.Module):  # (the step below squares what the model returns)
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x, labels=x).loss

    return Loss(), ids


WAYS: dict[str, Callable[[], Any]] = {
    "bare": lambda: None,
    "a dispatch mode that does nothing": Nothing,
    "memlab.track()": lambda: memlab.track("cuda"),
    "memlab.track(breakdown=True), read": Read,
    "the same, by the dispatch mode": DispatchMode,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.manual_seed(0)
    models = {
        "ResNet-18 (torchvision), batch 64": resnet18(),
        "8-layer MLP, 64 wide": mlp(),
        "GPT-2 (transformers), 4 layers, 8×256 tokens": gpt2(),
    }
    lines = header("A breakdown on a GPU (cuda)")
    lines += [
        f"Median wall time of one training step (SGD with momentum), {args.rounds} rounds of 8, "
        "the ways taking turns.",
        "",
        "| step | " + " | ".join(WAYS) + " |",
        "| --- |" + " ---: |" * len(WAYS),
    ]
    bound = []
    for name, built in models.items():
        if built is None:
            lines.append(f"| {name} | not installed |" + " |" * (len(WAYS) - 1))
            continue
        step = training_step(*built)
        for _ in range(3):
            step()
        rounds: dict[str, list[float]] = {w: [] for w in WAYS}
        for _ in range(args.rounds):
            for way, make in WAYS.items():
                rounds[way].append(median_time(lambda m=make, s=step: under(m, s), 8))
        bare = statistics.median(rounds["bare"])
        cells = [
            f"{statistics.median(v) * 1e3:.2f} ms ({statistics.median(v) / bare:.2f}×)"
            for v in rounds.values()
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(10):
            with memlab.track("cuda", breakdown=True):
                step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        per_step = f"wall {wall * 100:.2f} ms, CPU {cpu * 100:.2f} ms"
        bound.append(f"- {name}, with a breakdown, per step: {per_step}")
    lines += ["", "A step's process CPU time against its wall time:", "", *bound]
    try:
        lines += diagnosis()
    except Exception as e:  # the table above is still written
        lines += ["", f"Diagnosis failed: {type(e).__name__}: {e}"]
    emit(lines, args.out)


def diagnosis() -> list[str]:
    """Where a breakdown's time goes on CUDA, beside the same MLP step on the CPU under the
    dispatch mode (MEMLAB_NATIVE=0): per-op cost on each device, the synchronisations a
    breakdown makes (``torch.cuda.set_sync_debug_mode``), and the functions that cost most."""
    import cProfile
    import io
    import os
    import pstats
    import warnings

    out = ["", "Diagnosis, the 8-layer MLP step:", ""]
    counts = {}
    for device in ("cuda", "cpu"):
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]).to(device)
        x = torch.randn(16, 64, device=device)
        step = training_step(model, x)
        os.environ["MEMLAB_NATIVE"] = "0"
        try:
            for _ in range(3):
                with memlab.track(device, breakdown=True):
                    step()
            bare = median_time(step, 20)
            tracked = median_time(
                lambda s=step, d=device: under(lambda: memlab.track(d, breakdown=True), s), 20
            )
        finally:
            os.environ.pop("MEMLAB_NATIVE", None)
        with Counting() as ops:
            step()
        counts[device] = ops.n
        out.append(
            f"- {device}: {ops.n} ops, bare {bare * 1e3:.3f} ms, with a breakdown (dispatch "
            f"mode) {tracked * 1e3:.3f} ms: {(tracked - bare) / ops.n * 1e6:.1f} µs an op"
        )
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            with memlab.track("cuda", breakdown=True):
                training_step(*mlp())()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message).splitlines()[0] for w in said if "synchroniz" in str(w.message)]
    out.append(
        f"- synchronising calls in a breakdown region (the step's own included): {len(syncs)}"
    )
    out += [f"  - {s}" for s in sorted(set(syncs))[:8]]
    step = training_step(*mlp())
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        with memlab.track("cuda", breakdown=True):
            step()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    out += ["", "cProfile of 20 such steps on CUDA, by own time:", "", "```"]
    out += [line for line in text.getvalue().splitlines() if line.strip()][-20:]
    return [*out, "```"]


class Counting(TorchDispatchMode):
    n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


if __name__ == "__main__":
    main()
