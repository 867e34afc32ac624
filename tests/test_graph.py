"""Annotated autograd graphs: exact bytes, module attribution, rendering, robustness."""

from __future__ import annotations

import shutil
import traceback
import warnings
import xml.etree.ElementTree as ET
from typing import Any

import pytest
import torch
from torch.nn import functional

import memlab
from memlab import Category
from memlab.graphs.dot import DotMissingError
from memlab.graphs.saved import GraphFreedError

#: For tests that render with graphviz's `dot` (CI installs it; the GPU machine lacks it).
needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None, reason="graphviz's dot is not installed"
)


def mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    return model, torch.randn(32, 64)


def accounted_activations(model: torch.nn.Module, *inputs: torch.Tensor) -> int:
    with memlab.track("cpu", breakdown=True) as t:
        out = model(*inputs)
    del out
    return t.report.breakdown.at_end.get(Category.ACTIVATION, 0)  # type: ignore[union-attr]


def test_mlp_bytes_are_exact_and_charged_to_the_earliest_saver() -> None:
    model, x = mlp()
    g = memlab.graph(model, x)
    relu = [n for n in g.nodes if n.op == "ReluBackward0"]
    assert len(relu) == 1 and relu[0].bytes == 32 * 128 * 4 and relu[0].module == "1"
    second = next(n for n in g.nodes if n.op == "AddmmBackward0" and n.module == "2")
    kinds = {s.attr: s.kind for s in second.saved}
    assert kinds == {"_saved_mat1": "shared", "_saved_mat2": "parameter"}  # ReLU's output
    first = next(n for n in g.nodes if n.op == "AddmmBackward0" and n.module == "0")
    assert [s.kind for s in first.saved] == ["input"]  # x exists anyway
    assert g.activation_bytes == 32 * 128 * 4
    leaves = sorted(n.leaf for n in g.nodes if n.leaf)
    assert leaves == ["0.bias", "0.weight", "2.bias", "2.weight"]


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_graph_total_equals_the_cores_activation_accounting(name: str) -> None:
    torch.manual_seed(0)
    if name == "mlp":
        model, x = mlp()
    else:
        layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        x = torch.randn(4, 16, 64)
    assert memlab.graph(model, x).activation_bytes == accounted_activations(model, x) > 0


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.gelu(self.proj(x)) * torch.sigmoid(
            x
        )  # functional ops belong to the block


def test_functional_ops_belong_to_the_module_whose_forward_ran_them() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block())
    g = memlab.graph(model, torch.randn(8, 32))
    ops = {(n.op, n.module) for n in g.nodes}
    assert ("GeluBackward0", "0") in ops and ("SigmoidBackward0", "1") in ops
    assert ("AddmmBackward0", "0.proj") in ops and ("AddmmBackward0", "1.proj") in ops
    by_top = g.by_module(depth=1)
    assert sum(b for b, _ in by_top.values()) == g.activation_bytes
    assert set(by_top) == {"0", "1"}


def test_meta_capture_allocates_nothing_and_agrees_with_cpu() -> None:
    model, x = mlp()
    cpu = memlab.graph(model, x).activation_bytes
    meta = memlab.graph(model.to("meta"), x.to("meta"))
    assert meta.activation_bytes == cpu
    assert "ReluBackward0" in meta.dot()


@needs_dot
def test_names_with_quotes_and_markup_are_escaped_in_dot_and_svg() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module('a "q" <b> & c', torch.nn.Linear(4, 4))
    model.add_module("act", torch.nn.Tanh())
    g = memlab.graph(model, torch.randn(2, 4))
    svg = g.svg()
    root = ET.fromstring(svg)  # well-formed XML despite the name
    text = "".join(root.itertext())
    assert 'a "q" <b> & c' in text
    assert '\\"q\\"' in g.dot()


def test_ten_thousand_nodes_walk_without_recursion() -> None:
    x = torch.ones(4, requires_grad=True)
    y = x
    for _ in range(10_000):
        y = y * 1.0001
    g = memlab.graph_of(y)
    assert len(g.nodes) == 10_001
    assert g.dot(limit=None).count("->") == 10_000  # every node, when asked for
    assert g.dot().count("->") < 400  # the default drawing is bounded (tests/test_graph_limits.py)


@needs_dot
def test_a_weight_shared_by_hundreds_of_nodes_is_drawn_without_its_edges() -> None:
    w = torch.randn(16, requires_grad=True)
    y = sum((w * float(i)).sum() for i in range(300))
    assert isinstance(y, torch.Tensor)
    g = memlab.graph_of(y)
    dot = g.dot()
    assert "used by 300 nodes" in dot
    svg = g.svg()  # lays out quickly: no 300-edge fan-in
    assert "used by 300 nodes" in svg


def test_output_without_a_graph_says_how_to_get_one() -> None:
    with torch.no_grad():
        t = torch.ones(3) * 2
    with pytest.raises(memlab.NoGraphError, match="grad enabled"):
        memlab.graph_of(t)


def test_a_reentrant_checkpoint_on_inputs_without_grad_is_named_as_a_cause() -> None:
    from torch.utils.checkpoint import checkpoint

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.b, checkpoint(self.a, x, use_reentrant=True), use_reentrant=True)

    with warnings.catch_warnings():  # (torch's own warning says the inputs lack grad)
        warnings.simplefilter("ignore")
        with pytest.raises(memlab.NoGraphError, match="use_reentrant=False"):
            memlab.graph(Net(), torch.randn(4, 16))


def test_graph_after_backward_says_to_annotate_before() -> None:
    model, x = mlp()
    out = model(x).sum()
    out.backward()
    with pytest.raises(GraphFreedError, match="before calling backward") as caught:
        memlab.graph_of(out)
    # the user's order of calls, said without memlab's frames or torch's error under it
    e = caught.value
    lines = traceback.format_exception(type(e), e, e.__traceback__)
    assert not [x for x in lines if "memlab/" in x and "tests" not in x], lines
    assert e.__cause__ is None and e.__suppress_context__


def test_dot_missing_gives_install_advice_and_keeps_the_dot_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, x = mlp()
    g = memlab.graph(model, x)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(DotMissingError, match="apt-get install graphviz"):
        g.svg()
    bundle = g._repr_mimebundle_()
    assert "apt-get install graphviz" in bundle["text/html"]
    assert "digraph memlab" in bundle["text/plain"]


@needs_dot
def test_module_level_view_collapses_modules_into_boxes() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block(), Block())
    g = memlab.graph(model, torch.randn(8, 32))
    view = g.view(depth=1)
    dot = view.source
    assert dot.count("nodes ·") == 3  # one box per block (each holds several nodes)
    assert "AddmmBackward0" not in dot
    assert "<svg" in view._repr_mimebundle_()["text/html"]
    # printed, a view is the graph's summary, not the fields of every node
    said = repr(view)
    assert said.startswith("view of modules 1 level(s) deep; memlab graph:") and "Node(" not in said
    assert len(said) < 2000


@needs_dot
def test_notebook_display_has_svg_and_the_heaviest_nodes() -> None:
    model, x = mlp()
    html = memlab.graph(model, x)._repr_mimebundle_()["text/html"]
    assert "<svg" in html and "ReluBackward0" in html and "16.0 KiB" in html


def test_golden_dot(golden: Any) -> None:
    model, x = mlp()
    golden("graph_mlp.dot", memlab.graph(model, x).dot())
    golden("graph_mlp_modules.dot", memlab.graph(model, x).dot(depth=1))


def test_to_dict_is_plain_data() -> None:
    model, x = mlp()
    d = memlab.graph(model, x).to_dict()
    assert d["activation_bytes"] == 32 * 128 * 4
    assert sum(n["bytes"] for n in d["nodes"]) == d["activation_bytes"]


def test_views_are_charged_once_with_their_base() -> None:
    a = torch.randn(10, 10, requires_grad=True)
    e = a.exp()  # saves its result e: 400 B
    v = e.t()  # a view of e: no new storage
    s = v.sigmoid()  # saves its result s: 400 B
    m = v * s  # saves v (e's storage) and s: both already charged
    g = memlab.graph_of(m)
    assert g.activation_bytes == 800
    mul = next(n for n in g.nodes if n.op == "MulBackward0")
    assert mul.bytes == 0 and {x.kind for x in mul.saved} == {"shared"}


def test_in_place_results_are_charged_once() -> None:
    a = torch.randn(10, 10, requires_grad=True)
    with memlab.track("cpu", breakdown=True) as t:
        b = a.clone()  # saves nothing
        b.relu_()  # saves its result, which is b's own storage: 400 B
        c = b.exp()  # saves its result, a new storage: 400 B
    g = memlab.graph_of(c)
    assert g.activation_bytes == 400 + 400
    assert t.report.breakdown.at_end[Category.ACTIVATION] == 800  # type: ignore[union-attr]


def test_a_shared_weight_is_a_parameter_counted_once() -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 16))
    x = torch.randn(4, 16)
    # The first matmul saves only x (x needs no grad, so w is not needed); the next two save
    # w (for the gradient of their other operand) and their tanh input, a 4 x 16 activation.
    h = torch.tanh(torch.tanh(x @ w) @ w) @ w
    g = memlab.graph_of(h.sum(), inputs=[x])
    assert g.saved_parameter_bytes == 16 * 16 * 4  # saved by two matmuls, counted once
    assert g.activation_bytes == 2 * 4 * 16 * 4
    leaf = next(n for n in g.nodes if n.leaf)
    assert leaf.leaf == "parameter 16×16"  # graph_of has no model to name it (memlab.graph does)


def test_fake_tensor_capture() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model, x = mlp()  # parameters and input are fake: nothing is allocated
        g = memlab.graph(model, x)
    assert g.activation_bytes == 32 * 128 * 4


def test_a_real_model_s_graph_is_shown_module_by_module_by_default() -> None:
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    enc = torch.nn.Sequential(
        torch.nn.Embedding(100, 64), torch.nn.TransformerEncoder(layer, 4), torch.nn.Linear(64, 100)
    )
    g = memlab.graph(enc, torch.randint(0, 100, (2, 16)))
    assert len(g.nodes) > 200 and g.auto_depth() == 3  # one box per encoder layer
    dot = g.dot(g.auto_depth())
    # a Sequential's children carry their layer type: "0 (Embedding)", not a bare "0"
    for name in ("0 (Embedding)", "1.layers.3 (TransformerEncoderLayer)", "2 (Linear)"):
        assert name in dot
    if shutil.which("dot"):
        html = g._repr_mimebundle_()["text/html"]
        assert "shown as one box per module 3 levels deep" in html and "g.view(depth=None)" in html
        every = g.view(depth=None)._repr_mimebundle_()["text/html"]
        assert "one box per module" not in every
    small = memlab.graph(torch.nn.Linear(4, 4), torch.randn(2, 4))
    assert small.auto_depth() is None  # small graphs show every node


class ReadsAValue(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if mask.all():  # a value: none on meta
            return self.lin(x)
        return self.lin(x * mask)


def test_a_forward_that_reads_a_value_on_meta_gets_a_hint_and_keeps_its_error() -> None:
    with torch.device("meta"):
        model = ReadsAValue()
    x, mask = torch.randn(2, 4, device="meta"), torch.ones(2, 4, device="meta")
    with pytest.raises(RuntimeError, match="meta") as raised:
        memlab.graph(model, x, mask)
    notes = getattr(raised.value, "__notes__", [])
    assert any("meta tensors, which have shapes but no values" in n for n in notes), notes
    # on the CPU the same forward draws, and no hint is added to an error off meta
    assert memlab.graph(ReadsAValue(), torch.randn(2, 4), torch.ones(2, 4)).nodes
