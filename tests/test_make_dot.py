"""``memlab.make_dot``: a drop-in for torchviz's ``make_dot``, drawn by the real torchviz, with the
bytes each node saved for backward; its figures reconcile with memlab's graph and accounting."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
import torchviz
from torch import nn

import memlab
from memlab import Category


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def structure(source: str) -> tuple[set[str], set[tuple[str, str]]]:
    """The node names and edges of a DOT text (what torchviz drew)."""
    nodes = set(re.findall(r"^\t(\d+) \[", source, re.MULTILINE))
    edges = set(re.findall(r"^\t(\d+) -> (\d+)", source, re.MULTILINE))
    return nodes, edges


def test_the_same_drawing_as_torchviz_with_bytes_added() -> None:
    model = net()
    y = model(torch.randn(3, 8)).sum()
    params = dict(model.named_parameters())
    theirs = torchviz.make_dot(y, params=params)
    ours = memlab.make_dot(y, params=params)
    assert type(ours) is type(theirs)  # a graphviz.Digraph, as torchviz returns
    assert structure(ours.source) == structure(theirs.source)  # same nodes, same edges
    assert '"0.weight\n (16, 8)"' in ours.source or "0.weight" in ours.source  # names kept
    # ReLU saves its output (3 × 16 float32); the first Linear its input (3 × 8); the second
    # Linear's input is the ReLU's output, counted once, on the node that saved it first
    labels = re.findall(r"saved ([\d.]+ \w+)\"", ours.source)
    tips = [int(b.replace(",", "")) for b in re.findall(r"\w+: ([\d,]+) B saved", ours.source)]
    assert sorted(tips) == [3 * 8 * 4, 3 * 16 * 4] and len(labels) == 2
    assert "288 B saved for backward" in ours.source


def test_the_total_is_what_memlab_measures_as_activations() -> None:
    model = net()
    x = torch.randn(32, 8)
    with memlab.track("cpu", breakdown=True, watch=[model], inputs=[x]) as t:
        y = model(x).sum()
    dot = memlab.make_dot(y, params=dict(model.named_parameters()), inputs=[x])
    assert t.report.breakdown is not None
    measured = t.report.breakdown.at_end[Category.ACTIVATION]
    assert dot.memlab_graph.activation_bytes == measured == 32 * 16 * 4  # the ReLU's output
    assert f"({measured:,} B)" in dot.source
    # without inputs=, the input the first Linear saved counts too, as torchviz knows no inputs
    plain = memlab.make_dot(y)
    assert plain.memlab_graph.activation_bytes == measured + x.nbytes


def test_several_outputs_and_torchviz_s_options() -> None:
    model = net()
    a = model(torch.randn(2, 8))
    b = a.relu().sum()
    ours = memlab.make_dot((a, b), show_attrs=True, show_saved=True)
    theirs = torchviz.make_dot((a, b), show_attrs=True, show_saved=True)
    # (a saved output is a new tensor object at each reading: its node's name differs)
    mine, their = structure(ours.source), structure(theirs.source)
    assert (len(mine[0]), len(mine[1])) == (len(their[0]), len(their[1]))
    assert "saved" in ours.source


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot is not installed")
def test_it_renders() -> None:
    model = net()
    svg = memlab.make_dot(model(torch.randn(3, 8)).sum()).pipe(format="svg").decode()
    assert "<svg" in svg and "saved for backward" in svg


def test_what_has_no_graph_is_told_what_to_pass() -> None:
    with pytest.raises(memlab.GraphArgumentError):
        memlab.make_dot(5)
    with pytest.raises(memlab.NoGraphError):
        memlab.make_dot(torch.ones(3))
