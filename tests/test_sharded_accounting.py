"""Accounting of what sharded training does outside the dispatcher, in this process: storages
resized with ``resize_`` (FSDP), DTensors (their local shard), collectives' buffers. A world of
one rank (gloo) is enough to run FSDP2 and DTensor for real; the 2-rank job is
tests/test_distributed.py."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

import memlab
from memlab.core import resizes
from memlab.core.categories import Category
from memlab.core.collectives import buffers, is_collective

dist = pytest.importorskip("torch.distributed")


def test_a_resize_inside_a_region_is_followed_and_the_wrapper_leaves() -> None:
    original = torch.UntypedStorage.resize_
    with memlab.track("cpu"):  # (the record installed first: its order has the block below;
        pass  # one from before it is freed "at the region's end", and the report says so)
    t = torch.empty(1000)  # 4,000 bytes
    st = t.untyped_storage()
    with memlab.track("cpu", timeline=True, watch=[t]) as r:
        assert resizes.installed()
        st.resize_(0)
        st.resize_(8000)
    assert not resizes.installed() and torch.UntypedStorage.resize_ == original
    report = r.report
    assert report.allocated_after - report.allocated_before == 4000
    assert report.peak_allocated == report.allocated_after  # 8,000 is the most it held
    assert min(report.timeline.allocated) == report.allocated_before - 4000  # emptied


def test_a_storage_first_seen_when_resized_counts_from_its_old_size() -> None:
    st = torch.empty(250).untyped_storage()  # 1,000 bytes the ledger has never seen
    with memlab.track("cpu") as r:
        st.resize_(3000)
    assert r.report.allocated_after - r.report.allocated_before == 2000
    st.resize_(0)  # outside any region: read again when the next one opens
    with memlab.track("cpu") as r2:
        pass
    assert r2.report.allocated_before == r.report.allocated_after - 3000


def test_collectives_are_told_from_other_ops_and_their_nested_tensors_found() -> None:
    assert is_collective(torch.ops.c10d.allreduce_.default)
    assert not is_collective(torch.ops.aten.add.Tensor)
    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    assert {id(t) for t in buffers(([[a, b]], 1), {"x": c}, (None, [a]))} == {id(a), id(b), id(c)}


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _local_bytes(tensors: list[torch.Tensor]) -> int:
    seen = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(seen.values())


def test_a_dtensor_counts_its_local_shard(one_rank: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.tensor import Shard, distribute_tensor
    except ImportError:  # torch 2.4: not public yet
        from torch.distributed._tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    with memlab.track("cpu", breakdown=True) as r:
        d = distribute_tensor(torch.randn(64, 32), mesh, [Shard(0)])
        p = torch.nn.Parameter(d)
        r.mark(p, Category.PARAMETER)
    assert r.report.breakdown.at_end[Category.PARAMETER] == _local_bytes([p]) == 64 * 32 * 4


def test_fsdp2_parameters_are_counted_as_their_shards_after_the_step(one_rank: None) -> None:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.4 and 2.5: not public yet
        from torch.distributed._composable.fsdp import fully_shard

    gc.collect()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(96, 96) for _ in range(3)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(4, 96)
    with memlab.track("cpu", breakdown=True, timeline=True, watch=[model, opt]) as r:
        model(x).sum().backward()
        opt.step()
    params = list(model.parameters())
    at_end = r.report.breakdown.at_end
    # FSDP freed each gathered unit with resize_(0): only the shards are left
    assert at_end[Category.PARAMETER] == _local_bytes(params)
    assert at_end[Category.GRADIENT] == _local_bytes([p.grad for p in params])
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert at_end[Category.OPTIMIZER_STATE] == _local_bytes(state)
    # while a unit computed, its gathered parameters (resized up from 0) were held too
    assert r.report.breakdown.highest[Category.PARAMETER] > at_end[Category.PARAMETER]
    del model, opt, params, state
