"""A graph built before a region (a model's output kept in a variable, from a cell without
``-b``) counts as activations in a breakdown, as one built inside a ``-b`` cell does: checked
against the graphs' own saved tensors, in both ways of measuring; read without running a
program's unpack hooks, walked once per graph, and bounded."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import run

from memlab.core import older_graphs
from memlab.core.categories import Category
from memlab.graphs.saved import saved_tensors

NEW_ENOUGH = hasattr(
    (torch.ones(1, requires_grad=True) * 2).grad_fn._raw_saved_self,
    "unpack_hook",  # type: ignore[union-attr]
)
pytestmark = pytest.mark.skipif(not NEW_ENOUGH, reason="reading without hooks needs torch 2.11")

SETUP = (
    "torch.manual_seed(0)\n"
    "net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))\n"
    "x = torch.randn(32, 64)"
)


def _saved_bytes(params: Any, *outputs: torch.Tensor) -> int:
    """Bytes of the storages the outputs' graphs saved for backward (each storage once), the
    parameters' aside (a weight saved as its transpose is the parameter's storage)."""
    weights = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}
    stack = [o.grad_fn for o in outputs]
    nodes: set[int] = set()
    keep = []
    while stack:
        node = stack.pop()
        if node is None or id(node) in nodes:
            continue
        nodes.add(id(node))
        keep.append(node)
        for _, t in saved_tensors(node):
            st = t.untyped_storage()
            if st.data_ptr() not in weights:
                seen[st.data_ptr()] = st.nbytes()
        stack.extend(f for f, _ in node.next_functions)
    return sum(seen.values())


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("first", ["-q", "-q -b", None])
def test_a_live_graph_from_an_earlier_cell_is_activation_whatever_its_cell_s_flags(
    ip: Any, monkeypatch: pytest.MonkeyPatch, native: str, first: str | None
) -> None:
    monkeypatch.setenv("MEMLAB_NATIVE", native)
    assert run(ip, SETUP).success
    assert run(ip, "y1 = net(x)" if first is None else f"%%gpumem {first}\ny1 = net(x)").success
    assert run(ip, "%%gpumem -q -b\ny2 = net(x)").success
    for _ in range(2):  # the second time from what the first walk kept
        assert run(ip, "%%gpumem -q -b -o later\nz = 1").success
        at_end = ip.user_ns["later"].breakdown.at_end
        y1, y2 = ip.user_ns["y1"], ip.user_ns["y2"]
        # x (read by both first layers) and each ReLU's output: saved, whichever cell made them
        saved = _saved_bytes(ip.user_ns["net"].parameters(), y1, y2)
        assert at_end[Category.ACTIVATION] == saved == 3 * 32 * 64 * 4
        assert at_end[Category.OTHER] == y1.untyped_storage().nbytes() * 2


def test_a_graph_released_by_backward_marks_nothing(ip: Any) -> None:
    setup = (
        "net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(200)])\n"
        "loss = net(torch.randn(4, 16)).sum()"
    )
    assert run(ip, setup).success
    assert run(ip, "%%gpumem -q -b -o r0\nz = 1").success
    assert ip.user_ns["r0"].breakdown.at_end[Category.ACTIVATION] == 200 * 4 * 16 * 4
    assert run(ip, "loss.backward()").success
    assert run(ip, "%%gpumem -q -b -o r\nz = 1").success
    assert Category.ACTIVATION not in ip.user_ns["r"].breakdown.at_end


@pytest.mark.parametrize("native", ["1", "0"])
def test_backward_of_an_older_graph_inside_a_b_cell_peaks_with_its_activations(
    ip: Any, monkeypatch: pytest.MonkeyPatch, native: str
) -> None:
    monkeypatch.setenv("MEMLAB_NATIVE", native)
    assert run(ip, SETUP + "\nloss = net(x).sum()").success
    assert run(ip, "%%gpumem -q -b -o r\nloss.backward()").success
    r = ip.user_ns["r"]
    # the graph saved x (held by a name too) and the ReLU's output (its own, freed by backward
    # before the gradients peak): x is an activation until backward lets it go, then "other"
    assert r.breakdown.at_peak[Category.ACTIVATION] == 32 * 64 * 4
    assert Category.ACTIVATION not in r.breakdown.at_end
    assert r.breakdown.at_end[Category.OTHER] == 32 * 64 * 4
    grads = sum(p.numel() * 4 for p in ip.user_ns["net"].parameters())
    assert r.peak_delta == grads + 4  # and backward's seed, the scalar ones of loss's shape
    assert not r.notes


def test_reading_a_checkpointed_or_offloaded_graph_runs_none_of_its_hooks(ip: Any) -> None:
    setup = (
        "import torch.utils.checkpoint as cp\n"
        "calls = []\n"
        "class Block(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.lin = torch.nn.Linear(32, 32)\n"
        "    def forward(self, h):\n"
        "        calls.append(1); return torch.relu(self.lin(h))\n"
        "blk = Block()\n"
        "h = torch.randn(8, 32, requires_grad=True)\n"
        "out = cp.checkpoint(blk, h, use_reentrant=False)\n"
        "copies = []\n"
        "def pack(t):\n"
        "    copies.append('pack'); return t.clone()\n"
        "def unpack(t):\n"
        "    copies.append('unpack'); return t\n"
        "with torch.autograd.graph.saved_tensors_hooks(pack, unpack):\n"
        "    off = blk(h).sin()\n"
        "n_calls, n_copies = len(calls), len(copies)"
    )
    assert run(ip, setup).success
    assert run(ip, "%%gpumem -q -b -o r\nz = 1").success
    assert run(ip, "%%gpumem -q -b -o r\nz = 2").success
    ns = ip.user_ns
    assert len(ns["calls"]) == ns["n_calls"] and len(ns["copies"]) == ns["n_copies"]
    # what the program's own hook packed (a clone, a tensor) is what the graph holds
    assert ns["r"].breakdown.at_end[Category.ACTIVATION] >= 3 * 8 * 32 * 4


def test_a_graph_is_walked_once_and_again_after_an_in_place_change(
    ip: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    walks: list[type] = []
    real = older_graphs._walk

    def counting(root: Any) -> Any:
        walks.append(type(root))
        return real(root)

    monkeypatch.setattr(older_graphs, "_walk", counting)
    assert run(ip, SETUP + "\ny = net(x)").success
    for _ in range(3):
        assert run(ip, "%%gpumem -q -b\nz = 1").success
    assert len(walks) == 1
    assert run(ip, "y.mul_(2)").success  # a new root: another graph on top of the old one
    assert run(ip, "%%gpumem -q -b -o r\nz = 1").success
    assert len(walks) == 2
    saved = _saved_bytes(ip.user_ns["net"].parameters(), ip.user_ns["y"])
    # x, the ReLU's output, and the scalar mul_ saved (as an 8-byte tensor)
    assert ip.user_ns["r"].breakdown.at_end[Category.ACTIVATION] == saved == 2 * 32 * 64 * 4 + 8


def test_a_huge_graph_is_read_up_to_a_bound_and_the_report_says_so(
    ip: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(older_graphs, "MAX_NODES", 50)
    setup = (
        "net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(100)])\n"
        "y = net(torch.randn(2, 8))"
    )
    assert run(ip, setup).success
    assert run(ip, "%%gpumem -q -b -o r\nz = 1").success
    r = ip.user_ns["r"]
    assert any("nodes read" in n for n in r.notes)
    assert 0 < r.breakdown.at_end[Category.ACTIVATION] < 100 * 2 * 8 * 4


def test_many_graphs_are_read_a_bounded_number_of_nodes_at_each_look(
    ip: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(older_graphs, "MAX_NODES", 50)
    setup = (
        "net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])\n"
        "losses = [net(torch.randn(2, 8)).sum() for _ in range(5)]"  # kept with their graphs
    )
    assert run(ip, setup).success
    each = 6 * 2 * 8 * 4  # each Linear saves its input
    seen = []
    for _ in range(4):
        assert run(ip, "%%gpumem -q -b -o r\nz = 1").success
        r = ip.user_ns["r"]
        seen.append(
            (
                r.breakdown.at_end.get(Category.ACTIVATION, 0),
                any("not read yet" in n for n in r.notes),
            )
        )
    assert seen[0][1] and seen[0][0] < 5 * each
    assert [a for a, _ in seen] == sorted(a for a, _ in seen)
    assert seen[-1] == (5 * each, False)


def test_a_tensor_whose_graph_cannot_be_read_leaves_the_cell_and_its_report_whole(
    ip: Any,
) -> None:
    setup = (
        "class Odd(torch.Tensor):\n"
        "    @property\n"
        "    def grad_fn(self):\n"
        "        raise RuntimeError('no graph for you')\n"
        "odd = (torch.ones(4, requires_grad=True) * 2).as_subclass(Odd)\n"
        "net = torch.nn.Linear(8, 8)\n"
        "y = net(torch.randn(2, 8))"
    )
    assert run(ip, setup).success
    result = run(ip, "%%gpumem -q -b -o r\nz = 41 + 1\nz")
    assert result.success and result.result == 42
    assert ip.user_ns["r"].breakdown.at_end[Category.ACTIVATION] == 2 * 8 * 4


def _activation(watch: Any, body: Any = None) -> tuple[int, int]:
    import memlab

    with memlab.track("cpu", breakdown=True, watch=watch) as t:
        if body is not None:
            body()
    b = t.report.breakdown
    return b.at_end.get(Category.ACTIVATION, 0), b.at_peak.get(Category.ACTIVATION, 0)


@pytest.mark.parametrize("native", ["1", "0"])
def test_an_in_place_op_inside_the_region_keeps_the_older_graph_s_activations(
    monkeypatch: pytest.MonkeyPatch, native: str
) -> None:
    monkeypatch.setenv("MEMLAB_NATIVE", native)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    x = torch.randn(32, 64)
    kept = {"y": net(x)}  # x and the ReLU's output, saved
    watch = lambda: [net, *kept.values()]  # noqa: E731
    assert _activation(watch) == (2 * 32 * 64 * 4,) * 2
    # still held under the new root (mul_ saves its scalar too, counted at the next look)
    assert _activation(watch, lambda: kept["y"].mul_(2)) == (2 * 32 * 64 * 4,) * 2
    assert _activation(watch)[0] == 2 * 32 * 64 * 4 + 8


def test_a_weight_updated_in_place_after_the_graph_does_not_hide_it() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    xv = torch.randn(32, 64)
    val = net(xv)  # kept with its graph, then a training step changes the weights it saved
    opt.zero_grad()
    net(torch.randn(32, 64)).sum().backward()
    opt.step()
    assert _activation(lambda: [net, opt, val, xv])[0] == 2 * 32 * 64 * 4


def test_an_outer_native_region_hears_a_release_an_inner_region_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import memlab

    monkeypatch.setenv("MEMLAB_NATIVE", "1")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    x = torch.randn(32, 64)
    kept = {"loss": net(x).sum()}
    watch = lambda: [net, *kept.values()]  # noqa: E731
    with (
        memlab.track("cpu", breakdown=True, watch=watch) as outer,
        memlab.track("cpu", breakdown=True, watch=watch),
    ):
        kept["loss"].backward()
    b = outer.report.breakdown
    assert b.at_peak.get(Category.ACTIVATION, 0) == 32 * 64 * 4  # x, saved until backward's end
    assert Category.ACTIVATION not in b.at_end  # (the inner region found the release)
