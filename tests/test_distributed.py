"""A real 2-rank gloo job on CPU, DDP and FSDP2: per-rank parameter, gradient and optimizer
bytes as memlab measures them against the local tensors' own storages, computed in the ranks."""

from __future__ import annotations

import gc
import json
from typing import Any

import pytest
import torch

import memlab
from memlab.core.categories import Category
from memlab.distributed import RankDataError, RankRow, RankTable, gather, launch

WORLD = 2
STATE = ("parameter", "gradient", "optimizer_state")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 33 outputs: an odd size, so FSDP pads the shards
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 33), torch.nn.ReLU()
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind the tensors' local parts."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = _local(t).untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _wrap(kind: str, model: torch.nn.Module) -> torch.nn.Module:
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, reshard_after_forward=kind == "fsdp")
    return fully_shard(model, reshard_after_forward=kind == "fsdp")


def _run(kind: str, world_size: int) -> tuple[RankTable | None, list[list[int]]]:
    """One measured step; the model, optimizer and tensors die on return (the next run's
    "at end" counts every parameter alive on the device)."""
    import torch.distributed as dist

    gc.collect()  # FSDP's modules and states hold each other in cycles: the last run's too
    model = _wrap(kind, _model())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(16, 64)
    with memlab.track("cpu", breakdown=True, timeline=True, watch=[model, opt]) as t:
        model(x).sum().backward()
        opt.step()
    table = gather(t)
    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    expected = torch.tensor(
        [
            _storage_bytes(params),
            _storage_bytes([p.grad for p in params if p.grad is not None]),
            _storage_bytes(state),
            sum(p.numel() * p.element_size() for p in params),  # full (unsharded) sizes
        ]
    )
    every = [torch.zeros_like(expected) for _ in range(world_size)]
    dist.all_gather(every, expected)
    return table, [e.tolist() for e in every]


def _job(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("ddp", "fsdp", "fsdp_no_reshard"):
        table, expected = _run(kind, world_size)
        if table is not None:
            out[kind] = {"table": table.to_dict(), "expected": expected}
    return out


@pytest.fixture(scope="module")
def job() -> dict[str, Any]:
    result = launch(_job, world_size=WORLD)  # spawn: _job is importable from this module
    assert isinstance(result, dict)
    return result


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fsdp_no_reshard"])
def test_state_bytes_per_rank_equal_the_local_tensors(job: dict[str, Any], kind: str) -> None:
    table = RankTable.from_dict(job[kind]["table"])
    assert table.world_size == WORLD and table.backend == "gloo"
    for row, (params, grads, state, _) in zip(table.rows, job[kind]["expected"], strict=True):
        at_end = row.at_end
        assert at_end[Category.PARAMETER] == params, (kind, row.rank)
        assert at_end[Category.GRADIENT] == grads, (kind, row.rank)
        assert at_end[Category.OPTIMIZER_STATE] == state, (kind, row.rank)
        assert row.peak >= sum(at_end[c] for c in STATE_CATEGORIES)
        assert row.peak_phase in ("forward", "backward", "optimizer")


STATE_CATEGORIES = (Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE)


def test_fsdp_holds_a_shard_and_ddp_everything(job: dict[str, Any]) -> None:
    full = job["ddp"]["expected"][0][3]
    ddp = RankTable.from_dict(job["ddp"]["table"])
    fsdp = RankTable.from_dict(job["fsdp"]["table"])
    for r in range(WORLD):
        assert ddp.rows[r].at_end[Category.PARAMETER] == full
        # half of every padded parameter: within one row of each layer of the full size / 2
        assert abs(fsdp.rows[r].at_end[Category.PARAMETER] - full // 2) < 4 * 128 * 4
        # DDP's gradient buckets: a flat copy of every gradient, marked as communication
        assert ddp.rows[r].at_end[Category.COMMUNICATION] == full


def test_the_table_renders_and_keeps_the_protocol(job: dict[str, Any]) -> None:
    table = RankTable.from_dict(job["fsdp"]["table"])
    assert json.loads(json.dumps(table.to_dict())) == table.to_dict()
    assert "rank 1" in str(table) and "rank 1" in table._repr_html_()
    assert RankTable.from_dict(table.to_dict()) == table


def test_bad_rank_data_is_refused_with_the_field_named() -> None:
    with pytest.raises(RankDataError, match="rank 1: 'peak_allocated'"):
        RankRow.from_dict({"allocated_before": 0, "allocated_after": 0, "peak_allocated": "x"}, 1)
    with pytest.raises(RankDataError, match="'ranks'"):
        RankTable.from_dict({"ranks": "no"})


def test_bad_arguments_name_what_to_pass() -> None:
    with pytest.raises(TypeError, match="fn must be a function"):
        launch(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend must be one of gloo, nccl, got 'mpi'"):
        launch(_job, backend="mpi")
    with pytest.raises(ValueError, match="world_size must be a whole number"):
        launch(_job, world_size=0)
    with pytest.raises(RuntimeError, match="needs a process group"):
        with memlab.track("cpu") as t:
            pass
        gather(t)
    with pytest.raises(TypeError, match=r"takes a memlab\.track object"):
        gather("report")  # type: ignore[arg-type]
