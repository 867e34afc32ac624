"""Per-rank memory of a real 2-rank job (gloo, CPU), measured by memlab.distributed, beside the
estimator's per-rank prediction; and the ZeRO paper's model-state table.

    python benchmarks/bench_distributed.py [--out table.md] [--width 1024] [--depth 8] [--batch 32]

Each strategy runs a warm-up step, then one measured step (forward, backward, Adam with
``foreach=True`` as the estimator assumes) on every rank. The prediction is
`memlab.estimate.per_rank` of one estimate of the unwrapped model on the meta device.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import emit, header

import memlab
from memlab.distributed import RankTable, check, gather, launch
from memlab.estimate import estimate, model_states, per_rank
from memlab.reports.units import fmt_bytes

KINDS = ("ddp", "zero1", "fsdp", "fsdp_no_reshard")
SHAPE = {"width": 1024, "depth": 8, "batch": 32}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    w = SHAPE["width"]
    return torch.nn.Sequential(*[torch.nn.Linear(w, w) for _ in range(SHAPE["depth"])])


def _input(batch: int) -> torch.Tensor:
    return torch.randn(batch, SHAPE["width"])


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.sum()


def _wrap(kind: str, model: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    if kind in ("ddp", "zero1"):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        if kind == "zero1":
            return ddp, ZeroRedundancyOptimizer(
                ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3, foreach=True
            )
        return ddp, torch.optim.Adam(ddp.parameters(), lr=1e-3, foreach=True)
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        fully_shard(layer, reshard_after_forward=kind == "fsdp")
    fully_shard(model, reshard_after_forward=kind == "fsdp")
    return model, torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)


def _one(kind: str) -> RankTable | None:
    gc.collect()
    model, opt = _wrap(kind, _model())
    x = _input(SHAPE["batch"])
    _loss(model(x)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    with memlab.track("cpu", breakdown=True, timeline=True, watch=[model, opt]) as t:
        out = model(x)  # held through backward and the step, as memlab.whatif's step does
        loss = _loss(out)
        loss.backward()
        opt.step()
    return gather(t)


def _job(rank: int, world_size: int, shape: dict[str, int]) -> dict[str, Any]:
    SHAPE.update(shape)
    out = {}
    for kind in KINDS:
        table = _one(kind)
        if table is not None:
            out[kind] = table.to_dict()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--width", type=int, default=SHAPE["width"])
    parser.add_argument("--depth", type=int, default=SHAPE["depth"])
    parser.add_argument("--batch", type=int, default=SHAPE["batch"])
    args = parser.parse_args()
    SHAPE.update(width=args.width, depth=args.depth, batch=args.batch)
    measured = launch(_job, world_size=2, args=(dict(SHAPE),), start_method="fork")
    predicted = estimate(
        _model, _input, _loss, batch_size=SHAPE["batch"], gpu=None, cuda_kernels=False
    )
    lines = header("Per-rank memory of a 2-rank job (gloo), measured and predicted")
    w, d, b = SHAPE["width"], SHAPE["depth"], SHAPE["batch"]
    lines += [
        f"{d} × Linear({w}, {w}), batch {b} a rank, Adam (foreach); a warm-up step, then the "
        "measured step. Measured: `memlab.distributed` (every rank's peak by tensor accounting); "
        "predicted: `memlab.estimate.per_rank` of one meta-device estimate.",
        "",
        "| strategy | rank | measured peak | phase | predicted | moment | error |",
        "| --- | ---: | ---: | --- | ---: | --- | ---: |",
    ]
    for kind in KINDS:
        strategy = "fsdp" if kind.startswith("fsdp") else kind
        rank = per_rank(predicted, 2, strategy, reshard_after_forward=kind == "fsdp")
        result = check(RankTable.from_dict(measured[kind]), rank, kind)
        for row in result.measured.rows:
            lines.append(
                f"| {kind} | {row.rank} | {fmt_bytes(row.peak)} ({row.peak:,} B) | "
                f"{row.peak_phase} | {fmt_bytes(rank.total)} ({rank.total:,} B) | "
                f"{rank.moment} | {result.error(row.rank):+.2%} |"
            )
    lines += ["", "The ZeRO paper's table (7.5B parameters, 64 ranks, mixed-precision Adam):", ""]
    lines += ["| | unsharded | optimizer states | + gradients | + parameters |"]
    lines += ["| --- | ---: | ---: | ---: | ---: |"]
    zero = model_states(7_500_000_000, 64)
    lines.append("| paper | 120 GB | 31.4 GB | 16.6 GB | 1.9 GB |")
    lines.append(
        "| `model_states(7_500_000_000, 64)` | "
        + " | ".join(f"{r.total / 1e9:.1f} GB" for r in zero.rows)
        + " |"
    )
    emit(lines, args.out)


if __name__ == "__main__":
    main()
