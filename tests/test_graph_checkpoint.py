"""The graph of a checkpointed forward: activation checkpointing's pack hook replaces what its
forward saved by placeholders, and what backward really keeps is each checkpoint's inputs.
The graph must count those (as `memlab.track` does) or say that its total is a lower bound."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from conftest import TINY_DECODER
from torch.nn import functional
from torch.utils.checkpoint import checkpoint

import memlab
from memlab import Category
from memlab.graphs.retained import find_retained

D, B, T = 32, 4, 16
ROW = B * T * D * 4  # one block's input, fp32


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(D)
        self.f1 = torch.nn.Linear(D, 4 * D)
        self.f2 = torch.nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.f2(functional.gelu(self.f1(self.ln(x))))
        return out


class Net(torch.nn.Module):
    """Four checkpointed blocks, then a head on the mean: backward keeps the inputs of blocks
    1-3 (block 0's is the forward's input) and the head's input, B×D."""

    def __init__(self, reentrant: bool, nested: bool = False) -> None:
        super().__init__()
        self.reentrant, self.nested = reentrant, nested
        self.blocks = torch.nn.ModuleList(Block() for _ in range(4))
        self.head = torch.nn.Linear(D, 10)

    def pair(self, x: torch.Tensor, i: int) -> torch.Tensor:
        for b in self.blocks[i : i + 2]:
            x = checkpoint(b, x, use_reentrant=False)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.nested:  # two outer checkpoints of two inner ones each
            for i in (0, 2):
                x = checkpoint(self.pair, x, i, use_reentrant=False)
        else:
            for b in self.blocks:
                x = checkpoint(b, x, use_reentrant=self.reentrant)
        out: torch.Tensor = self.head(x.mean(1))
        return out


def tracked(model: torch.nn.Module, *args: object, **kwargs: object) -> int:
    with memlab.track("cpu", breakdown=True) as t:
        out = model(*args, **kwargs)
    del out
    return t.report.breakdown.at_end.get(Category.ACTIVATION, 0)  # type: ignore[union-attr]


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_blocks_count_the_inputs_backward_keeps(reentrant: bool) -> None:
    torch.manual_seed(0)
    net = Net(reentrant)
    x = torch.randn(B, T, D, requires_grad=reentrant)  # (reentrant: else no graph at all)
    g = memlab.graph(net, x)
    by_hand = 3 * ROW + B * D * 4
    assert g.exact
    assert g.activation_bytes == by_hand == tracked(net, x)
    if not reentrant:  # each block's input charged to a node of that block, once
        rows = [(n.module, s) for n in g.nodes for s in n.saved if s.attr == "checkpoint input"]
        counted = sorted(m.split(".")[1] for m, s in rows if s.kind == "activation")
        assert counted == ["1", "2", "3"]
        assert any(s.kind == "recomputed" for n in g.nodes for s in n.saved)
        assert any("activation checkpoint" in note for note in g.notes)


def test_nested_checkpoints_count_the_outer_inputs_once() -> None:
    """Inner checkpoints' inputs are packed by the outer one's hook: recomputed, so only the
    outer checkpoints' inputs stay (the second pair's input), and the head's."""
    torch.manual_seed(0)
    net = Net(reentrant=False, nested=True)
    x = torch.randn(B, T, D)
    g = memlab.graph(net, x)
    assert g.exact
    assert g.activation_bytes == ROW + B * D * 4 == tracked(net, x)


def test_graph_of_a_checkpointed_output_and_its_drawing() -> None:
    torch.manual_seed(0)
    net = Net(reentrant=False)
    x = torch.randn(B, T, D)
    out = net(x)
    g = memlab.graph_of(out, inputs=[x])
    assert g.exact and g.activation_bytes == 3 * ROW + B * D * 4
    dot = g.dot()
    assert "checkpoint input" in dot and "recomputed" in dot
    assert "<svg" in g.svg() and "<svg" in g.view(depth=1).svg()
    assert "checkpoint" in str(g)
    assert b"<svg" in memlab.make_dot(out).pipe(format="svg")


def test_a_hook_whose_packed_value_cannot_be_read_makes_the_total_a_lower_bound() -> None:
    """save_on_cpu packs (device, copy) tuples: no tensor to read, so not exact, "at least"."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x = torch.randn(B, D)
    with torch.autograd.graph.save_on_cpu():
        out = model(x)
    g = memlab.graph_of(out, inputs=[x])
    assert not g.exact and g.unread > 0
    assert g.total_text().startswith("at least")
    assert any("saved-tensors hook" in note for note in g.notes)


def test_keyword_arguments_a_checkpoint_holds_are_noted_not_counted() -> None:
    """A tensor bound by keyword (Hugging Face passes its rotary tables so) is kept by the
    checkpoint but never saved: `memlab.track` counts it as other, and the graph notes it."""
    block = Block()
    x = torch.randn(B, T, D)

    def fn(h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = block(h * scale)
        return out

    class Scaled(torch.nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            scale = torch.ones(B, T, 1) * 2  # made in the forward: 256 B
            h = checkpoint(functools.partial(fn, scale=scale), h * 1, use_reentrant=False)
            return h.sum(-1)

    g = memlab.graph(Scaled(), x)
    assert g.activation_bytes == ROW == tracked(Scaled(), x)  # h * 1, the checkpoint's input
    assert any("256 B more stay alive" in note for note in g.notes)


@pytest.mark.parametrize("family", ["Qwen2", "Llama"])
def test_hugging_face_gradient_checkpointing(family: str) -> None:
    config = getattr(transformers, f"{family}Config")(
        vocab_size=128,
        **TINY_DECODER,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).train()
    model.activation_checkpointing_enable({"use_reentrant": False})
    ids = torch.randint(0, 128, (2, 16))
    g = memlab.graph(model, input_ids=ids, labels=ids, use_cache=False)
    truth = tracked(model, input_ids=ids, labels=ids, use_cache=False)
    assert g.exact and g.activation_bytes == truth
    inputs = [s for n in g.nodes for s in n.saved if s.attr == "checkpoint input"]
    layer_input = 2 * 16 * 32 * 4
    assert [s.nbytes for s in inputs if s.kind == "activation"].count(layer_input) == 2


def test_retained_graphs_of_checkpointed_forwards_count_the_checkpoint_inputs() -> None:
    """``losses.append(loss)`` with checkpointed blocks keeps each forward's block inputs."""
    torch.manual_seed(0)
    net = Net(reentrant=False)
    x = torch.randn(B, T, D)
    losses = [net(x).sum() for _ in range(2)]
    assert find_retained({"losses": losses, "x": x}).total == 2 * (3 * ROW + B * D * 4)
