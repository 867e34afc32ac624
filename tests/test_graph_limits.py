"""Graphs on big and odd input: bounded drawings that say what they collapsed, no recursion
limits, and errors that say what to pass. Timings are in benchmarks/bench_limits.py; these tests
assert the bounds (boxes drawn, clusters, nesting), never a time."""

from __future__ import annotations

import random
import re
import shutil
from typing import Any

import pytest
import torch

import memlab
from memlab.graphs.args import GraphArgumentError
from memlab.graphs.collapse import MAX_DRAWN, plan
from memlab.graphs.dot import MAX_CLUSTERS, MAX_NESTING
from memlab.graphs.model import Graph, Node
from memlab.graphs.retained import find_retained

needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None, reason="graphviz's dot is not installed"
)
BOX = re.compile(r"^[nmg]\d+ \[label=", re.M)


def boxes(dot: str) -> int:
    return len(BOX.findall(dot))


def nesting(dot: str) -> int:
    """How deep the clusters nest."""
    deepest = depth = 0
    for line in dot.splitlines():
        if line.startswith("subgraph cluster_") and "legend" not in line:
            depth += 1
            deepest = max(deepest, depth)
        elif line == "}" and depth:
            depth -= 1
    return deepest


def drawn_bytes(graph: Graph, depth: int | None = None, limit: int = MAX_DRAWN) -> int:
    """The bytes of every box of the drawing, summed (groups and single units)."""
    if depth is None:
        unit_of = list(range(len(graph.nodes)))
    else:
        keys = {k: u for u, k in enumerate(sorted({_cut(n.module, depth) for n in graph.nodes}))}
        unit_of = [keys[_cut(n.module, depth)] for n in graph.nodes]
    p = plan(graph, unit_of, max(unit_of) + 1, limit, depth is None)
    used = {g for g in p.group_of if g >= 0}
    grouped = sum(p.groups[g].saved(graph.nodes) for g in used)
    return grouped + sum(n.bytes for n in graph.nodes if p.group_of[unit_of[n.id]] < 0)


def _cut(path: str, depth: int) -> str:
    return ".".join(path.split(".")[:depth]) if path else path


@pytest.fixture(scope="module")
def deep_mlp() -> Graph:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(5_000):
        layers += [torch.nn.Linear(8, 8), torch.nn.ReLU()]
    return memlab.graph(torch.nn.Sequential(*layers), torch.randn(2, 8))


def test_a_5000_layer_sequential_is_drawn_as_a_few_boxes(deep_mlp: Graph) -> None:
    g = deep_mlp
    assert len(g.nodes) == 25_000  # addmm, transpose, two leaves, relu per layer
    assert g.activation_bytes == 5_000 * 2 * 8 * 4  # each ReLU's result, counted once
    dot = g.dot()
    assert boxes(dot) == 6  # layers 0 and 1 node by node, and one box for the other 4,999 pairs
    assert "2 … 9999\\nLinear, ReLU ×4,999 more, as 0 … 1\\n24,995 nodes" in dot
    assert drawn_bytes(g) == g.activation_bytes  # the boxes' bytes add up exactly
    assert g.notes == (
        "drawing: 25,000 nodes drawn as 6 boxes (at most 400); repeats collapsed: 2 … 9999: "
        "Linear, ReLU ×4,999 more, as 0 … 1",
        "graph.dot(limit=None) draws every node (graphviz may take minutes)",
    )
    assert "repeats collapsed" in dot  # the drawing says it too
    assert "note: drawing: 25,000 nodes drawn as 6 boxes" in str(g)


def test_the_module_view_collapses_repeated_siblings(deep_mlp: Graph) -> None:
    view = deep_mlp.view(depth=1)
    assert boxes(view.source) == 3
    assert "10,000 module boxes drawn as 3 boxes" in view.source
    assert drawn_bytes(deep_mlp, depth=1) == deep_mlp.activation_bytes


def test_a_tighter_limit_collapses_the_first_block_too(deep_mlp: Graph) -> None:
    dot = deep_mlp.dot(limit=3)
    assert boxes(dot) == 1
    assert "0 … 9999\\nLinear, ReLU ×5,000\\n25,000 nodes" in dot
    assert drawn_bytes(deep_mlp, limit=3) == deep_mlp.activation_bytes


@needs_dot
def test_the_5000_layer_drawing_renders(deep_mlp: Graph) -> None:
    bundle = deep_mlp._repr_mimebundle_()
    assert "<svg" in bundle["text/html"] and "×4,999 more" in bundle["text/html"]
    assert "<svg" in deep_mlp.view(depth=1).svg()


def test_limit_none_draws_every_node_and_bad_limits_are_refused() -> None:
    x = torch.ones(4, requires_grad=True)
    y = x
    for _ in range(1_000):
        y = torch.sin(y)
    g = memlab.graph_of(y)
    assert boxes(g.dot(limit=None)) == 1_001
    assert boxes(g.dot(limit=50)) <= 50
    for bad in (0, -1, 2.5, "10"):
        with pytest.raises(ValueError, match="limit must be a positive int or None"):
            g.dot(limit=bad)  # type: ignore[arg-type]


def test_a_weight_shared_by_thousands_of_steps_is_one_node_without_edges() -> None:
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    h = torch.randn(4, 16)
    for _ in range(2_000):  # an unrolled recurrence: every step uses w
        h = torch.tanh(h @ w)
    g = memlab.graph_of(h)
    dot = g.dot()
    assert boxes(dot) <= 12
    assert "used by 2000 nodes" in dot and "×1,99" in dot
    leaf = next(n for n in g.nodes if n.leaf)
    assert f"n{leaf.id} ->" not in dot  # the hub's edges are not drawn
    # each tanh's result, and the first matmul's input (the later ones are tanh results)
    assert drawn_bytes(g) == g.activation_bytes == (2_000 + 1) * 4 * 16 * 4


def test_a_sum_of_many_terms_and_a_stack_of_many_inputs_collapse() -> None:
    w = torch.randn(8, requires_grad=True)
    total = sum((w * float(i)).sum() for i in range(2_000))
    assert isinstance(total, torch.Tensor)
    g = memlab.graph_of(total)
    assert boxes(g.dot()) <= 20 and "[AddBackward0] ×1,99" in g.dot()
    xs = [torch.randn(4, requires_grad=True) for _ in range(2_000)]
    s = memlab.graph_of(torch.stack([(x * 2).exp() for x in xs]))
    assert boxes(s.dot()) <= 10
    assert "1,999 more inputs of StackBackward0 like ExpBackward0" in s.dot()
    assert drawn_bytes(s) == s.activation_bytes


def test_a_graph_without_repeats_keeps_the_nodes_nearest_the_output() -> None:
    rng = random.Random(0)
    n = 5_000
    nodes = tuple(
        Node(
            i,
            f"Op{i}Backward",
            "",
            8 * (i % 7),
            (),
            tuple(sorted({i + 1, rng.randrange(i + 1, n)})),  # all reachable from node 0
        )
        if i < n - 1
        else Node(i, "AccumulateGrad", "", 0, (), (), leaf="x")
        for i in range(n)
    )
    g = Graph(nodes, (0,))
    dot = g.dot()
    assert boxes(dot) == MAX_DRAWN
    assert "more nodes not drawn" in dot and "farthest from the output are one box" in dot
    assert "n0 [label=" in dot  # the output is drawn
    assert drawn_bytes(g) == g.activation_bytes


def test_module_nesting_deeper_than_the_recursion_limit() -> None:
    n = 3_000
    nodes = tuple(
        Node(
            i,
            "AddBackward0",
            ".".join(["m"] * (1 + i % 1_500)),
            8,
            (),
            (i + 1,) if i + 1 < n else (),
        )
        for i in range(n)
    )
    g = Graph(nodes, (0,))
    for dot in (g.dot(), g.dot(limit=None), g.dot(depth=1_200), g.dot(depth=2)):
        assert dot.count("subgraph cluster_") - 1 <= MAX_CLUSTERS  # the legend is one
        assert nesting(dot) <= MAX_NESTING
    assert sum(b for b, _ in g.by_module(3).values()) == 8 * n


def test_deep_models_and_deep_autograd_graphs_do_not_recurse() -> None:
    model: torch.nn.Module = torch.nn.Linear(4, 4)
    for _ in range(150):
        model = torch.nn.Sequential(model, torch.nn.ReLU())
    g = memlab.graph(model, torch.randn(2, 4))
    assert len(g.nodes) == 154 and nesting(g.dot()) <= MAX_NESTING
    x = torch.ones(4, requires_grad=True)
    y = x
    for _ in range(30_000):
        y = y * 1.0
    deep = memlab.graph_of(y)
    assert len(deep.nodes) == 30_001 and boxes(deep.dot()) <= 10
    assert find_retained({"y": y}).total == 30_000 * 8  # each mul saves its 0-d factor


# -- errors that say what to pass ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((5,), r"argument 1 is an int \(5\), not a tensor. Pass the tensor\(s\) a forward"),
        (("loss",), r"argument 1 is a str \('loss'\), not a tensor"),
        (([],), r"argument 1 is a list of 0 item\(s\) holding no tensor"),
        ((torch.nn.Linear(2, 2),), r"a Linear module, not a tensor.*memlab.graph\(model, x\)"),
        ((), r"needs at least one tensor with a grad_fn"),
    ],
)
def test_graph_of_something_else_says_what_to_pass(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(GraphArgumentError, match=match) as info:
        memlab.graph_of(*args)
    assert isinstance(info.value, TypeError)


def test_graph_of_unpacks_lists_tuples_and_dicts() -> None:
    w = torch.randn(4, 4, requires_grad=True)
    a, b = (w * 2).exp(), (w * 3).sin()
    alone = memlab.graph_of(a, b).activation_bytes
    assert memlab.graph_of([a, b]).activation_bytes == alone
    assert memlab.graph_of((a, {"b": b, "n": 3})).activation_bytes == alone
    # exp's result and sin's input (w * 3), 4 x 4 floats each (each mul's factor, a Python
    # number wrapped as a 0-d tensor on the host, is not counted, as memlab.track does not)
    assert alone == 2 * 4 * 4 * 4


def test_graph_of_unpacks_nesting_deeper_than_the_recursion_limit() -> None:
    w = torch.randn(4, 4, requires_grad=True)
    nested: Any = (w * 2).exp()
    for _ in range(5_000):
        nested = [nested]
    assert memlab.graph_of(nested).activation_bytes == 4 * 4 * 4


def test_graph_of_a_tensor_without_grad_fn_says_why() -> None:
    with torch.no_grad():
        plain = torch.ones(3) * 2
    with torch.inference_mode():
        inferred = torch.ones(3) * 2
    leaf = torch.ones(3, requires_grad=True)
    cases = [
        (plain, "does not require grad. Run the forward with grad enabled"),
        (inferred, "was made under torch.inference_mode()"),
        (leaf, "is a leaf: it requires grad but was not computed from anything"),
    ]
    for t, why in cases:
        with pytest.raises(memlab.NoGraphError, match=re.escape(why)) as info:
            memlab.graph_of(t)
        assert "a tensor (3, float32)" in str(info.value)
    with pytest.raises(memlab.NoGraphError, match="got 2 tensors and none has one"):
        memlab.graph_of([plain, leaf])


def test_graph_of_a_function_or_without_inputs_says_what_to_pass() -> None:
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    x = torch.ones(3, requires_grad=True)
    with pytest.raises(GraphArgumentError, match=r"not the function .*double.*graph_of\(fn\(x\)\)"):
        memlab.graph(double, x)  # type: ignore[arg-type]
    with pytest.raises(GraphArgumentError, match=r"not an int \(5\).*memlab.graph\(model, x\)"):
        memlab.graph(5)  # type: ignore[arg-type]
    with pytest.raises(GraphArgumentError, match=r"Linear.forward takes input and none was given"):
        memlab.graph(torch.nn.Linear(2, 2))


class Constant(torch.nn.Module):
    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value

    def forward(self) -> Any:
        return self.value


def test_graph_of_a_forward_without_a_graph_says_why() -> None:
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(memlab.NoGraphError, match="no parameter of the model and no input"):
        memlab.graph(frozen, torch.randn(1, 2))
    with pytest.raises(memlab.NoGraphError, match=r"returned a NoneType \(None\), no tensor"):
        memlab.graph(Constant(None))  # a forward that takes nothing is run
    assert len(memlab.graph(Constant(torch.ones(2, requires_grad=True) * 2)).nodes) == 2


# -- sparse tensors -----------------------------------------------------------------------------


def test_sparse_tensors_in_a_graph_are_counted_by_values_and_indices() -> None:
    torch.manual_seed(0)
    s = torch.randn(6, 6).to_sparse().requires_grad_()
    soft = torch.sparse.softmax(s, 0)  # saves its sparse result (and s, a leaf)
    g = memlab.graph_of(soft.to_dense())
    with torch.no_grad():
        leaf = {id(t.untyped_storage()) for t in (s.indices(), s.values())}
        result = {
            id(st): st for t in (soft.indices(), soft.values()) if (st := t.untyped_storage())
        }
    assert g.activation_bytes == sum(st.nbytes() for k, st in result.items() if k not in leaf)
    node = next(n for n in g.nodes if n.op == "SparseSoftmaxBackward0")
    assert {x.kind for x in node.saved} == {"activation", "parameter"}


def test_a_sparse_tensor_not_coalesced_is_read_as_it_is() -> None:
    u = torch.sparse_coo_tensor(
        torch.tensor([[0, 0], [1, 1]]), torch.tensor([1.0, 2.0]), (2, 2), check_invariants=False
    ).requires_grad_()  # not coalesced: read by its own indices and values, not a copy
    y = torch.sparse.mm(u, torch.randn(2, 2, requires_grad=True))
    g = memlab.graph_of(y)
    assert [s.kind for n in g.nodes for s in n.saved] == ["parameter", "parameter"]
    assert not any("not counted" in n for n in g.notes)
    assert not u.is_coalesced()


def test_a_tensor_without_storage_is_noted_not_counted() -> None:
    a, b = (torch.randn(2, 2).to_mkldnn().requires_grad_() for _ in range(2))
    g = memlab.graph_of(a * b)  # MKL-DNN tensors: opaque, no storage to read
    assert [s.kind for n in g.nodes for s in n.saved] == ["unread", "unread"]
    assert "2 saved tensor(s) not counted" in g.notes[-1] and "MKL-DNN" in g.notes[-1]


def test_a_model_with_a_sparse_weight() -> None:
    class SparseLinear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8, 8).to_sparse())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(torch.sparse.mm(self.weight, x))

    g = memlab.graph(SparseLinear(), torch.randn(8, 4))
    assert g.activation_bytes == 8 * 4 * 4  # the ReLU's result
    assert g.saved_parameter_bytes > 0  # the sparse weight's values and indices
