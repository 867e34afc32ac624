"""A breakdown on a GPU from the allocator's own event log: what it costs and what it finds,
beside the dispatch mode's breakdown (``memlab.track(breakdown=True)``) on the same steps. The
prototype of `memlab.core.cuda_log` (which `track` now uses), kept as the recorder of the logs
the CPU tests replay.

The route (`memlab.core.cuda_trace`): the CUDA caching allocator records its events in C++
(no stack frames); a saved-tensors pack hook and a post-accumulate-grad hook note the
addresses of what autograd saves and of each gradient, with the moment; at the end one
snapshot gives the log and the live blocks, and the objects give the roles of what is alive.
No Python runs per op.

For each step (torchvision's ResNet-18 where it imports, an 8-layer tiny-op MLP, a 4-layer
GPT-2 from transformers where it imports), the ways take turns, one step per region:

- bare; ``memlab.track()``; ``memlab.track(breakdown=True)``;
- the allocator's history alone (on for the step, off after);
- the route: history, hooks, the step, then the snapshot and the settling.

Then one region of each kind on the same step, and the two breakdowns side by side, with the
allocator's own peak and end (``max_memory_allocated``, ``memory_allocated``) as the truth the
route's replay must meet to the byte. Each route region's inputs (events, names, blocks,
counters) are written to ``--fixtures`` for CPU tests to replay.

    python benchmarks/bench_gpu_trace_route.py [--rounds 5] [--out FILE] [--fixtures DIR]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import emit, header, median_time, under
from torch import nn

import memlab
from memlab.core import _torch
from memlab.core.categories import Category
from memlab.core.cuda_settle import Settled, settle
from memlab.core.cuda_trace import active_blocks

MiB = 2**20


def _now_us() -> float:
    return time.time_ns() / 1000


class Route:
    """One region measured by the allocator's log (the prototype of a `-b` on CUDA)."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, inputs: list[torch.Tensor]):
        self.model, self.opt, self.inputs = model, opt, inputs
        self.named: list[tuple[int, float | None, Category]] = []
        self.settled: Settled | None = None
        self.record: dict[str, Any] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_cuda:
            self.named.append((t.untyped_storage().data_ptr(), _now_us(), Category.ACTIVATION))
        return t

    def _grad(self, p: torch.Tensor) -> None:
        g = p.grad
        if g is not None and g.is_cuda:
            self.named.append((g.untyped_storage().data_ptr(), _now_us(), Category.GRADIENT))

    def __enter__(self) -> Route:
        torch.cuda.synchronize()
        self.device = torch.cuda.current_device()
        self.before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        self.own = not torch._C._cuda_isHistoryEnabled()
        if self.own:
            _torch.record_memory_history(True)
        self.handles = [
            p.register_post_accumulate_grad_hook(self._grad)
            for p in self.model.parameters()
            if p.requires_grad
        ]
        self.saved = torch.autograd.graph.saved_tensors_hooks(self._pack, _same)
        self.saved.__enter__()
        self.t0 = _now_us()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.saved.__exit__(*exc)
        for h in self.handles:
            h.remove()
        torch.cuda.synchronize()
        peak, end = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
        snap = _torch.memory_snapshot()
        if self.own:
            _torch.record_memory_history(False)
        events = snap["device_traces"][self.device]
        if not self.own:
            events = [e for e in events if e.get("time_us", 0) >= self.t0 - 50]
        events = [e for e in events if e.get("action") in ("alloc", "free_requested")]
        named = list(self.named)
        for role, tensors in self.roles().items():
            named += [(t.untyped_storage().data_ptr(), None, role) for t in tensors if t.is_cuda]
        blocks = active_blocks(snap, self.device)
        self.settled = settle(events, self.before, blocks, named)
        self.record = {
            "events": [{k: e[k] for k in ("action", "addr", "size", "time_us")} for e in events],
            "before": self.before,
            "active_at_end": blocks,
            "named": [(a, w, c.value) for a, w, c in named],
            "allocator": {"peak": peak, "end": end},
        }

    def roles(self) -> dict[Category, list[torch.Tensor]]:
        state = [
            v for s in self.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        ]
        return {
            Category.PARAMETER: list(self.model.parameters()),
            Category.BUFFER: list(self.model.buffers()),
            Category.OPTIMIZER_STATE: state,
            Category.GRADIENT: [p.grad for p in self.model.parameters() if p.grad is not None],
            Category.INPUT: self.inputs,
        }


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class HistoryOnly:
    def __enter__(self) -> HistoryOnly:
        _torch.record_memory_history(True)
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.synchronize()
        _torch.record_memory_history(False)


def resnet18() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor], list[torch.Tensor]] | None:
    try:
        import torchvision
    except Exception:
        return None
    x = torch.randn(64, 3, 224, 224, device="cuda")
    return torchvision.models.resnet18().cuda(), lambda m: m(x).square().mean(), [x]


def mlp() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor], list[torch.Tensor]]:
    x = torch.randn(16, 64, device="cuda")
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]).cuda()
    return model, lambda m: m(x).square().mean(), [x]


def gpt2() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor], list[torch.Tensor]] | None:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except Exception:
        return None
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8000, n_positions=256)
    ids = torch.randint(0, 8000, (8, 256), device="cuda")
    return GPT2LMHeadModel(cfg).cuda(), lambda m: m(ids, labels=ids).loss, [ids]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out")
    ap.add_argument("--fixtures")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.manual_seed(0)
    cases = {
        "resnet18": ("ResNet-18 (torchvision), batch 64, SGD momentum", resnet18, "sgd"),
        "mlp": ("8-layer MLP, 64 wide, batch 16, SGD momentum", mlp, "sgd"),
        "gpt2": ("GPT-2 (transformers), 4 layers, 256 wide, 8×256 tokens, AdamW", gpt2, "adamw"),
    }
    ways = ["bare", "track()", "track(breakdown=True)", "history alone", "trace route"]
    lines = header("A breakdown on a GPU from the allocator's log (cuda)")
    lines += [
        f"Median wall time of one training step, one step per region, {args.rounds} rounds of "
        "8, the ways taking turns.",
        "",
        "| step | " + " | ".join(ways) + " |",
        "| --- |" + " ---: |" * len(ways),
    ]
    checks: list[str] = []
    for key, (name, make, kind) in cases.items():
        built = make()
        if built is None:
            lines.append(f"| {name} | not installed |" + " |" * (len(ways) - 1))
            continue
        model, loss_of, inputs = built
        opt: torch.optim.Optimizer = (
            torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            if kind == "sgd"
            else torch.optim.AdamW(model.parameters(), lr=1e-4)
        )

        def step(m: nn.Module = model, f: Any = loss_of, o: Any = opt) -> None:
            f(m).backward()
            o.step()
            o.zero_grad(set_to_none=True)
            torch.cuda.synchronize()

        for _ in range(3):
            step()
        made: dict[str, Callable[[], Any]] = {
            "bare": lambda: None,
            "track()": lambda: memlab.track("cuda"),
            "track(breakdown=True)": lambda: memlab.track("cuda", breakdown=True),
            "history alone": HistoryOnly,
            "trace route": lambda m=model, o=opt, i=inputs: Route(m, o, i),
        }
        rounds: dict[str, list[float]] = {w: [] for w in ways}
        for _ in range(args.rounds):
            for way in ways:
                rounds[way].append(median_time(lambda w=way, d=made: under(d[w], step), 8))
        bare = statistics.median(rounds["bare"])
        cells = [
            f"{statistics.median(v) * 1e3:.2f} ms ({statistics.median(v) / bare:.2f}×)"
            for v in rounds.values()
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        checks += compare(name, key, step, model, opt, inputs, args.fixtures)
    lines += ["", *checks]
    emit(lines, args.out)


def compare(
    name: str,
    key: str,
    step: Callable[[], None],
    model: nn.Module,
    opt: torch.optim.Optimizer,
    inputs: list[torch.Tensor],
    fixtures: str | None,
) -> list[str]:
    with memlab.track("cuda", breakdown=True) as t:
        step()
    b = t.report.breakdown
    route = Route(model, opt, inputs)
    t0 = time.perf_counter()
    with route:
        step()
    took = time.perf_counter() - t0
    s = route.settled
    assert s is not None and b is not None
    alloc = route.record["allocator"]
    out = [
        f"### {name}",
        "",
        f"- allocator: peak {alloc['peak']:,} B, end {alloc['end']:,} B; the route's replay: "
        f"peak {s.peak:,} B, end {s.end:,} B "
        f"({'equal' if (s.peak, s.end) == (alloc['peak'], alloc['end']) else 'DIFFERENT'}); "
        f"{s.events} events, {s.blocks} blocks; names not placed: {s.unplaced} of "
        f"{len(route.record['named'])}; one route region {took * 1e3:.2f} ms",
        "",
        "| category | dispatch mode at peak | route at peak | dispatch mode at end "
        "| route at end |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for c in Category:
        vals = (b.at_peak.get(c, 0), s.at_peak.get(c, 0), b.at_end.get(c, 0), s.at_end.get(c, 0))
        if any(vals):
            out.append(f"| {c.value} | " + " | ".join(f"{v:,}" for v in vals) + " |")
    out.append("")
    if fixtures:
        path = Path(fixtures) / f"gpu-breakdown-{key}.json.gz"
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "format": "memlab-gpu-breakdown/1",
            "case": name,
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            **route.record,
            "dispatch_mode": b.to_dict(),
        }
        with gzip.open(path, "wt") as f:
            json.dump(record, f)
    return out


if __name__ == "__main__":
    main()
