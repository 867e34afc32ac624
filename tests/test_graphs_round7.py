"""Round 7 of the graphs: dataclass outputs, a batch dict given where keywords go, the graph's
total against `memlab.track` (wrapped Python numbers), nodes whose saved tensors cannot be read,
and `make_dot` on graphs deeper than the recursion limit."""

from __future__ import annotations

import dataclasses
import re
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torchviz
from torch import nn
from transformers import BatchEncoding, GPT2Config, GPT2LMHeadModel

import memlab
from memlab import Category
from memlab.graphs.retained import find_retained
from memlab.graphs.saved import wrapped_number

MEMLAB = str(Path(memlab.__file__).parent)


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: tuple[torch.Tensor, ...] = ()
    note: str = "plain"


@dataclasses.dataclass(frozen=True, slots=True)
class Slotted:
    inner: Out


class Net(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.how = nn.Linear(8, 16), how

    def forward(self, x: torch.Tensor) -> object:
        h = self.lin(x).relu()  # ReLU saves its result: 4 × 16 float32
        y = h.exp()  # exp saves its result too
        if self.how == "tuple":
            return (y, (h,))
        out = Out(y, (h,))
        return out if self.how == "dataclass" else Slotted(out)


def test_a_dataclass_output_is_unpacked_as_a_tuple_is() -> None:
    x = torch.randn(4, 8)
    truth = 2 * 4 * 16 * 4  # ReLU's and exp's results; the input and the weight exist anyway
    for how in ("tuple", "dataclass", "slotted"):
        model = Net(how)
        assert memlab.graph(model, x).activation_bytes == truth, how
        out = model(x)
        assert memlab.graph_of(out, inputs=[x]).activation_bytes == truth, how
        dot = memlab.make_dot(out, params=dict(model.named_parameters()), inputs=[x])
        assert dot.memlab_graph.activation_bytes == truth, how


def test_errors_name_the_function_called_and_say_an() -> None:
    with pytest.raises(memlab.graphs.capture.GraphArgumentError) as info:
        memlab.make_dot(Out(None))  # type: ignore[arg-type]
    said = str(info.value)
    assert said.startswith("memlab.make_dot(var, params): var is an Out object holding no tensor")
    assert "memlab.make_dot(loss)" in said and "graph_of" not in said
    with pytest.raises(memlab.graphs.capture.NoGraphError, match=r"^.*memlab\.make_dot got"):
        memlab.make_dot(torch.ones(3))
    with pytest.raises(memlab.graphs.capture.GraphArgumentError, match="argument 1 is an Out"):
        memlab.graph_of(Out(None))  # type: ignore[arg-type]


def tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=16, bos_token_id=0
    )
    config.eos_token_id = 0
    return GPT2LMHeadModel(config)


def test_a_batch_dict_given_where_keywords_go_gets_the_hint() -> None:
    model = tiny_gpt2()
    ids = torch.randint(0, 100, (2, 8))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    for given in (batch, BatchEncoding(batch)):
        with pytest.raises(AttributeError) as info:  # the model's own error, its type kept
            memlab.graph(model, given)
        notes = getattr(info.value, "__notes__", [])
        assert len(notes) == 1 and "memlab.graph(model, **batch)" in notes[0]
        assert "'input_ids', 'attention_mask'" in notes[0]
        frames = [f.filename for f in traceback.extract_tb(info.value.__traceback__)]
        assert frames and not any(f.startswith(MEMLAB) for f in frames)
    assert memlab.graph(model, **batch, use_cache=False).activation_bytes > 0


def test_the_graph_total_equals_track_on_a_real_gpt2() -> None:
    model = tiny_gpt2()
    ids = torch.randint(0, 100, (2, 8))
    graph = memlab.graph(model, ids, use_cache=False)
    with memlab.track("cpu", breakdown=True, watch=[model], inputs=[ids]) as t:
        out = model(ids, use_cache=False)
    assert t.report.breakdown is not None
    assert graph.activation_bytes == t.report.breakdown.at_end[Category.ACTIVATION]
    # GPT-2's GELU multiplies by Python numbers: each kept as a wrapped 0-d float64, not counted
    numbers = [s for n in graph.nodes for s in n.saved if s.kind == "number"]
    assert numbers and all(s.shape == () and s.dtype == "float64" for s in numbers)
    del out


def test_a_python_number_saved_by_an_op_is_not_an_activation() -> None:
    x = torch.randn(100, requires_grad=True)
    y = (x * 0.5).exp()
    assert memlab.graph_of(y).activation_bytes == y.nbytes  # exp's result; 0.5 is no memory
    mul: Any = y.grad_fn.next_functions[0][0]  # type: ignore[union-attr]
    assert wrapped_number(mul._saved_other)
    factor = torch.tensor(0.5, dtype=torch.float64)  # a real 0-d tensor: counted as before
    z = x * factor
    assert not wrapped_number(z.grad_fn._saved_other)  # type: ignore[union-attr]
    assert memlab.graph_of(z).activation_bytes == factor.untyped_storage().nbytes()


def test_a_warmed_up_torchscript_module_says_its_total_is_a_lower_bound() -> None:
    torch.manual_seed(0)
    scripted = torch.jit.script(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2)))
    x = torch.randn(8, 16)
    for _ in range(3):  # the profiling executor fuses the ops into one node
        scripted(x).sum().backward()
    graph = memlab.graph(scripted, x)
    assert "DifferentiableGraphBackward" in {n.op for n in graph.nodes}  # (CppFunction's name)
    assert not graph.exact and graph.to_dict()["exact"] is False
    assert "at least" in str(graph)
    assert any("DifferentiableGraphBackward" in n and "lower bound" in n for n in graph.notes)
    dot = memlab.make_dot(scripted(x))
    assert "at least" in dot.source


def test_a_python_autograd_function_s_saved_tensors_are_counted() -> None:
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, a: torch.Tensor) -> torch.Tensor:
            b = a * 2
            ctx.save_for_backward(b)  # type: ignore[attr-defined]
            return b.sin()

        @staticmethod
        def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
            (b,) = ctx.saved_tensors  # type: ignore[attr-defined]
            return g * b.cos() * 2  # type: ignore[no-any-return]

    a = torch.randn(500, requires_grad=True)
    with memlab.track("cpu", breakdown=True, inputs=[a]) as t:
        y = Twice.apply(a)
    graph = memlab.graph_of(y, inputs=[a])
    assert t.report.breakdown is not None
    assert graph.exact
    assert graph.activation_bytes == a.nbytes == t.report.breakdown.at_end[Category.ACTIVATION]


def test_tensors_a_python_function_keeps_on_ctx_are_counted_as_kept_for_backward() -> None:
    """``ctx.scale = y * 2`` (not ``save_for_backward``) holds its tensor as long as the node:
    the graph counts it, directly and inside a list or dict on the ctx, and the retained-graph
    finder sees the bytes a variable holding the output keeps alive."""

    class Kept(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            y = x.exp()
            ctx.scale = y * 2
            ctx.parts = [y + 1, 3]
            ctx.named = {"z": y - 1}
            ctx.n = 5
            return y

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g * ctx.scale / 2  # type: ignore[no-any-return]

    x = torch.randn(1000, 250, requires_grad=True)
    out = Kept.apply(x).sum()
    graph = memlab.graph_of(out)
    assert graph.exact
    assert graph.activation_bytes == 3 * x.nbytes  # scale, parts[0], named["z"]
    found = find_retained({"out": out})
    assert [r.name for r in found.items] == ["out"]
    assert found.items[0].bytes >= 3 * x.nbytes


def test_make_dot_draws_a_graph_deeper_than_the_recursion_limit() -> None:
    limit = sys.getrecursionlimit()
    x = torch.randn(2, requires_grad=True)
    y = x
    for _ in range(limit + 200):
        y = y.sin()
    with pytest.raises(RecursionError):  # deep enough for torchviz alone
        torchviz.make_dot(y)
    dot = memlab.make_dot(y)
    assert type(dot) is type(torchviz.make_dot(x * 1))  # a graphviz.Digraph
    drawn = set(re.findall(r'^\t(\d+) \[label="?SinBackward0', dot.source, re.MULTILINE))
    assert len(drawn) == limit + 200  # every node drawn, none collapsed
    # each sin saved its input: all but the first (x, the leaf) are activations
    assert dot.memlab_graph.activation_bytes == (limit + 199) * x.nbytes
    assert sys.getrecursionlimit() == limit
