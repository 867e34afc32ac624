"""Tensor accounting against bytes the tests compute themselves."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import NOTHING_INSTALLED, hooks_installed
from torch.utils._python_dispatch import TorchDispatchMode

import memlab
from memlab import Category
from memlab.core.ledger import default_ledger

MiB = 1024**2


def nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def cpu(**kw: object) -> memlab.track:
    return memlab.track("cpu", **kw)  # type: ignore[arg-type]


def test_new_tensor_counts_its_exact_bytes() -> None:
    with cpu() as t:
        x = torch.empty(1000, 1000)
    r = t.report
    assert r.allocated_delta == 4_000_000
    assert r.peak_delta == 4_000_000
    assert r.source == "tensor-accounting" and r.device == "cpu"
    del x


def test_views_and_in_place_ops_add_nothing() -> None:
    x = torch.zeros(1000, 1000)
    with cpu() as t:
        v = x.view(-1)[10:500]
        x.add_(1)
        x.t_()
        v.mul_(2)
    assert t.report.allocated_delta == 0
    assert t.report.peak_delta == 0
    assert t.report.allocated_before == t.report.allocated_after >= 4_000_000


def test_deleted_tensor_returns_its_bytes() -> None:
    with cpu() as t1:
        x = torch.empty(1000, 1000)
    with cpu() as t2:
        del x
    assert t1.report.allocated_delta == 4_000_000
    assert t2.report.allocated_delta == -4_000_000
    assert t2.report.allocated_after == t2.report.allocated_before - 4_000_000


def test_transient_peak_is_seen() -> None:
    with cpu() as t:
        big = torch.empty(128 * MiB, dtype=torch.uint8)
        del big
        small = torch.empty(32 * MiB, dtype=torch.uint8)
    r = t.report
    assert r.peak_delta == 128 * MiB
    assert r.allocated_delta == 32 * MiB
    del small


def test_tensor_created_before_the_region_and_freed_in_it() -> None:
    x = torch.empty(250_000)  # never seen by memlab before the region
    with cpu(watch=[x]) as t:
        del x
    assert t.report.allocated_delta == -1_000_000


def test_pre_existing_tensor_read_by_the_region_is_counted_once() -> None:
    a = torch.ones(1000)
    with cpu() as t:
        b = a * 2
        c = a + b
    assert t.report.allocated_delta == nbytes(b, c)
    assert t.report.allocated_before >= 4000


def test_resize_and_out_arguments_grow_storage() -> None:
    with cpu() as t:
        z = torch.empty(0)
        z.resize_(1000)
        o = torch.empty(0)
        torch.add(torch.ones(10), 1, out=o)
    assert t.report.allocated_after - t.report.allocated_before == 4000 + 40 + 0


def make_mlp() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    return model, torch.randn(32, 64), torch.randint(0, 10, (32,))


def test_mlp_adam_step_breakdown_matches_numel_times_element_size() -> None:
    model, x, y = make_mlp()
    opt = torch.optim.Adam(model.parameters())
    with cpu(breakdown=True) as t:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    params = list(model.parameters())
    end = t.report.breakdown.at_end  # type: ignore[union-attr]
    assert end[Category.PARAMETER] == nbytes(*params)
    assert end[Category.GRADIENT] == nbytes(*(p.grad for p in params if p.grad is not None))
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert end[Category.OPTIMIZER_STATE] == nbytes(*states)
    # Adam keeps two moments per parameter (plus a scalar step each)
    assert nbytes(*states) == 2 * nbytes(*params) + 4 * len(params)
    assert end[Category.INPUT] == nbytes(x, y)
    assert Category.ACTIVATION not in end  # backward freed the graph
    # the rows add up to the totals
    r = t.report
    assert sum(end.values()) == r.allocated_after
    assert sum(r.breakdown.at_peak.values()) == r.peak_allocated  # type: ignore[union-attr]


def test_sgd_momentum_state_is_one_times_the_parameters() -> None:
    model, x, y = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with cpu(breakdown=True) as t:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    end = t.report.breakdown.at_end  # type: ignore[union-attr]
    assert end[Category.OPTIMIZER_STATE] == nbytes(*model.parameters())


def test_forward_only_keeps_exactly_the_saved_activations() -> None:
    model, x, _ = make_mlp()
    with cpu(breakdown=True) as t:
        out = model(x)
    end = t.report.breakdown.at_end  # type: ignore[union-attr]
    # Linear 1 saves x (an input) and its weight; ReLU saves its output, which Linear 2 also
    # saves: one storage of 32 x 128 floats. The first Linear's output was a temporary.
    assert end[Category.ACTIVATION] == 32 * 128 * 4
    assert end[Category.OTHER] == nbytes(out)
    assert end[Category.PARAMETER] == nbytes(*model.parameters())
    assert end[Category.INPUT] == nbytes(x)
    at_peak = t.report.breakdown.at_peak  # type: ignore[union-attr]
    assert at_peak[Category.TEMPORARY] == 32 * 128 * 4  # Linear 1's output, freed after the ReLU
    # In the next region the graph is still alive: everything it saves is an activation from
    # the start (x too: the graph holds it as well as the user). Dropping the output frees it.
    with cpu(breakdown=True) as t2:
        del out
    r2 = t2.report
    assert r2.breakdown.at_peak[Category.ACTIVATION] == 32 * 128 * 4 + nbytes(x)  # type: ignore[union-attr]
    assert Category.ACTIVATION not in r2.breakdown.at_end  # type: ignore[union-attr]
    assert r2.breakdown.at_end[Category.OTHER] == nbytes(x)  # type: ignore[union-attr]
    assert r2.allocated_delta == -(32 * 10 * 4 + 32 * 128 * 4)


def test_activation_kept_by_the_user_is_other_after_backward() -> None:
    w = torch.randn(100, 100, requires_grad=True)
    with cpu(breakdown=True) as t:
        h = torch.sigmoid(w @ w)  # sigmoid saves its output h
        h.sum().backward()
    end = t.report.breakdown.at_end  # type: ignore[union-attr]
    assert Category.ACTIVATION not in end
    assert end[Category.OTHER] == nbytes(h)
    assert end[Category.GRADIENT] == nbytes(w)


def test_double_backward_still_works_under_breakdown() -> None:
    a = torch.randn(5, requires_grad=True)
    with cpu(breakdown=True):
        b = torch.exp(a)
        (g,) = torch.autograd.grad(b.sum(), a, create_graph=True)
        (g2,) = torch.autograd.grad(g.sum(), a)
    assert torch.allclose(g2, torch.exp(a))


def test_timeline_ends_at_after_and_reaches_the_peak() -> None:
    model, x, y = make_mlp()
    opt = torch.optim.Adam(model.parameters())
    with cpu(breakdown=True, timeline=True) as t:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    r = t.report
    tl = r.timeline
    assert tl is not None and len(tl) > 10
    assert max(tl.allocated) == r.peak_allocated
    assert tl.allocated[-1] == r.allocated_after
    assert {"forward", "backward", "optimizer"} <= set(tl.phases)
    assert list(tl.seconds) == sorted(tl.seconds)


def test_long_timeline_is_thinned_but_keeps_the_peak() -> None:
    with cpu(timeline=True) as t:
        for i in range(6000):
            x = torch.empty(1000 + (5000 if i == 4321 else 0))
            del x
    tl = t.report.timeline
    assert tl is not None and len(tl) <= memlab.region.MAX_TIMELINE_POINTS
    assert max(tl.allocated) == t.report.peak_allocated
    assert t.report.peak_delta == 6000 * 4


def test_meta_tensors_are_counted_on_meta() -> None:
    with memlab.track("meta") as t:
        x = torch.empty(1000, 1000, device="meta")
        y = x @ x
    assert t.report.allocated_delta == 8_000_000
    assert t.report.device == "meta"
    del y


def test_fake_tensors_are_counted() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), cpu() as t:
        x = torch.empty(1000, 1000)
        y = x @ x
    assert t.report.allocated_delta == 8_000_000
    del x, y


class CountingMode(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_nests_with_a_users_dispatch_mode_both_ways() -> None:
    user = CountingMode()
    with cpu() as t, user:
        x = torch.ones(1000) * 2
    assert user.calls >= 2 and t.report.allocated_delta == nbytes(x)
    user2 = CountingMode()
    with user2, cpu() as t2:
        y = torch.ones(1000) * 2
    assert user2.calls >= 2 and t2.report.allocated_delta == nbytes(y)
    assert hooks_installed() == NOTHING_INSTALLED


@pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt])
def test_exception_removes_everything_and_still_reports(exc: type[BaseException]) -> None:
    region = cpu(breakdown=True, timeline=True)
    with pytest.raises(exc), region:
        keep = torch.empty(1000)
        assert hooks_installed()["module forward pre-hooks"] == 1  # (either way of measuring)
        raise exc()
    assert hooks_installed() == NOTHING_INSTALLED
    r = region.report
    assert r.raised == exc.__name__
    assert r.allocated_delta == 4000
    del keep


def test_nothing_installed_after_a_normal_region() -> None:
    model, x, y = make_mlp()
    with cpu(breakdown=True):
        assert hooks_installed() != NOTHING_INSTALLED
        torch.nn.functional.cross_entropy(model(x), y).backward()
    assert hooks_installed() == NOTHING_INSTALLED


def test_report_before_the_region_closes_is_an_error() -> None:
    t = cpu()
    with pytest.raises(RuntimeError, match="still open"):
        t.report  # noqa: B018
    with t, pytest.raises(RuntimeError, match="still open"):
        t.report  # noqa: B018
    with pytest.raises(RuntimeError, match="one region"), t:
        pass


def test_regions_nest_and_agree() -> None:
    with cpu() as outer:
        a = torch.empty(1000)
        with cpu() as inner:
            b = torch.empty(2000)
            del b
        c = torch.empty(500)
    assert inner.report.peak_delta == 8000 and inner.report.allocated_delta == 0
    assert outer.report.peak_delta == 4000 + 8000
    assert outer.report.allocated_delta == nbytes(a, c)


def test_bad_device_says_what_to_do() -> None:
    with pytest.raises(memlab.DeviceError, match="not a device"):
        memlab.track("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(memlab.DeviceError, match="no CUDA device"):
            memlab.track("cuda:1")
        with pytest.raises(memlab.DeviceError, match="every CUDA device"):
            memlab.track("all")


def test_allocation_is_stamped_when_its_op_starts() -> None:
    a = torch.randn(1500, 1500)
    with cpu(timeline=True) as t:
        c = a @ a  # tens of ms of compute after its output was allocated
    tl = t.report.timeline
    assert tl is not None and len(tl) == 1
    assert tl.seconds[0] < t.report.seconds / 2
    del c


def _roles_class(way: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """What learns roles with a breakdown: the dispatch mode's accountant, or the native
    record's hooks."""
    if way == "dispatch":
        from memlab.core.accounting import Accountant

        monkeypatch.setenv("MEMLAB_NATIVE", "0")
        return Accountant
    from memlab.core import native
    from memlab.core.native.roles import NativeRoles

    if native.too_old() is not None:  # (scripts/test_torch.sh on an older PyTorch)
        pytest.skip(native.too_old())
    # the record's self-check (once a process, at its first region) runs before the test
    # breaks its hooks: broken, they would fail the check and turn the record off for good
    with torch.enable_grad(), cpu(breakdown=True):
        pass
    assert native.unavailable() is None

    return NativeRoles


@pytest.mark.parametrize("way", ["dispatch", "native"])
def test_a_failure_in_memlab_never_replaces_the_regions_own_exception(
    way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: Any) -> None:
        raise RuntimeError("memlab's own bug")

    monkeypatch.setattr(_roles_class(way, monkeypatch), "finish", broken)
    region = cpu(breakdown=True)
    with pytest.raises(ZeroDivisionError), region:
        1 / 0  # noqa: B018
    assert hooks_installed() == NOTHING_INSTALLED
    with pytest.raises(RuntimeError, match="could not build") as info:
        region.report  # noqa: B018
    assert "memlab's own bug" in str(info.value.__cause__)
    # without an exception of its own, the region lets memlab's error through
    with pytest.raises(RuntimeError, match="memlab's own bug"), cpu(breakdown=True):
        pass
    assert hooks_installed() == NOTHING_INSTALLED


@pytest.mark.parametrize("way", ["dispatch", "native"])
def test_a_failed_start_leaves_nothing_behind(way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Any, *args: Any) -> None:
        raise RuntimeError("cannot install")

    monkeypatch.setattr(_roles_class(way, monkeypatch), "install", broken)
    region = cpu(breakdown=True)
    with pytest.raises(RuntimeError, match="cannot install"), region:
        pass
    assert hooks_installed() == NOTHING_INSTALLED
    assert not default_ledger()._listeners


def test_region_with_only_backward_knows_the_gradients() -> None:
    model, x, y = make_mlp()
    loss = torch.nn.functional.cross_entropy(model(x), y)  # forward outside any region
    with cpu(breakdown=True) as t:
        loss.backward()
    end = t.report.breakdown.at_end  # type: ignore[union-attr]
    assert end[Category.GRADIENT] == nbytes(*model.parameters())
    assert end[Category.PARAMETER] == nbytes(*model.parameters())


def saved_by_graph(root: object, exclude: set[int]) -> int:
    """Bytes of the unique storages a graph saved, read from its nodes' _saved_* attributes."""
    storages: dict[int, int] = {}
    seen: dict[int, object] = {}  # holds the nodes: a freed wrapper's id could be reused
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                for t in value if isinstance(value, (tuple, list)) else [value]:
                    if isinstance(t, torch.Tensor):
                        st = t.untyped_storage()
                        if st.data_ptr() not in exclude:
                            storages[st.data_ptr()] = st.nbytes()
        stack.extend(f for f, _ in node.next_functions)  # type: ignore[attr-defined]
    return sum(storages.values())


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])
def test_activations_equal_what_the_graph_saved(amp: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    x = torch.randn(128, 512)
    with cpu(breakdown=True) as t, torch.autocast("cpu", torch.bfloat16, enabled=amp):
        out = model(x)
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
    exclude.add(x.untyped_storage().data_ptr())  # an input, not an activation
    truth = saved_by_graph(out.grad_fn, exclude)
    assert t.report.breakdown.at_end[Category.ACTIVATION] == truth  # type: ignore[union-attr]
    # By hand. fp32: each Linear after the first saves its input (the first saves x, an input).
    # bf16 autocast on the CPU: every Linear saves a bf16 copy of its input (x's copy too), and
    # each one whose input needs grad also a bf16 copy of its weight (the first's doesn't): for
    # 512 x 512 weights and a batch of 128 that is more bytes than fp32, not half.
    bf16 = 2
    amp_bytes = 3 * 512 * 512 * bf16 + 4 * 128 * 512 * bf16
    assert truth == (amp_bytes if amp else 3 * 128 * 512 * 4)


def test_checkpointed_blocks_save_only_their_inputs() -> None:
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(8)
    )
    x = torch.randn(64, 256)
    one = 64 * 256 * 4  # one block output, in bytes

    def activations(ck: bool) -> int:
        with cpu(breakdown=True) as t:
            h = x
            for b in blocks:
                h = checkpoint(b, h, use_reentrant=False) if ck else b(h)
        return t.report.breakdown.at_end[Category.ACTIVATION]  # type: ignore[union-attr]

    # Plain: each block saves its Linear's output (for GELU) and its GELU output (for the next
    # Linear); the last output is not saved. Checkpointed: only the inputs of blocks 2..8 (the
    # first block's input is x, an input), and memlab's pack hook gives way to checkpoint's.
    assert activations(False) == 15 * one
    assert activations(True) == 7 * one


def test_iter_nodes_walks_a_deep_graph_without_recursion() -> None:
    from memlab.core.autograd import iter_nodes

    x = torch.ones(1, requires_grad=True)
    y = x
    for _ in range(5000):  # deeper than Python's recursion limit
        y = y * 1.0
    nodes = list(iter_nodes([y.grad_fn, None]))
    assert len(nodes) == 5001  # 5000 MulBackward0 and x's AccumulateGrad, each once
    assert sum(type(n).__name__ == "AccumulateGrad" for n in nodes) == 1


def test_code_that_replaces_the_saved_tensor_hooks_refusal_in_a_region_keeps_its_own() -> None:
    """A breakdown region puts its own `memlab.core.transforms.StepAside` in place of
    ``torch.autograd.graph.disable_saved_tensors_hooks``; what the program put there during the
    region stays after it (memlab removes only what it installed)."""
    original = torch.autograd.graph.disable_saved_tensors_hooks

    def theirs(message: str) -> Any:
        return original(message)

    try:
        with cpu(breakdown=True):
            assert torch.autograd.graph.disable_saved_tensors_hooks is not original
            torch.autograd.graph.disable_saved_tensors_hooks = theirs
        assert torch.autograd.graph.disable_saved_tensors_hooks is theirs
        with cpu(breakdown=True):  # and a later region leaves it too
            pass
        assert torch.autograd.graph.disable_saved_tensors_hooks is theirs
    finally:
        torch.autograd.graph.disable_saved_tensors_hooks = original
