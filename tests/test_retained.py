"""The retained-graph finder against bytes the tests compute themselves."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import run

import memlab
from memlab import Category
from memlab.graphs.retained import find_retained
from memlab.graphs.saved import GraphFreedError, saved_tensors


def mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    return model, torch.randn(32, 64)


def one_forward_activations(model: torch.nn.Module, x: torch.Tensor) -> int:
    """What one forward saves, measured by the core's tensor accounting."""
    with memlab.track("cpu", breakdown=True) as t:
        out = model(x)
    del out
    return t.report.breakdown.at_end[Category.ACTIVATION]  # type: ignore[union-attr]


def test_eval_loop_that_keeps_outputs_with_grad_holds_four_forwards() -> None:
    model, x = mlp()
    one = one_forward_activations(model, x)
    assert one == 32 * 128 * 4  # the ReLU output, saved by ReLU and by the second Linear
    outs = []
    for _ in range(4):
        outs.append(model(x))
    report = find_retained({"outs": outs, "x": x, "model": model})
    assert [i.name for i in report.items] == ["outs"]
    item = report.items[0]
    assert item.bytes == 4 * one and item.tensors == 4 and item.example == "outs[0]"
    assert "no_grad" in item.fix and "detach" in item.fix
    assert report.total == 4 * one


def test_detached_outputs_and_numbers_report_nothing() -> None:
    model, x = mlp()
    outs = [model(x).detach() for _ in range(4)]
    losses = [model(x).sum().item() for _ in range(4)]
    with torch.no_grad():
        kept = [model(x) for _ in range(4)]
    report = find_retained({"outs": outs, "losses": losses, "kept": kept, "model": model})
    assert report.items == ()
    assert "no variable" in str(report)


def test_shared_graphs_are_counted_once_and_found_in_dicts_and_attributes() -> None:
    model, x = mlp()

    class Trainer:
        def __init__(self) -> None:
            self.history = {"last": model(x)}

    trainer = Trainer()
    same = trainer.history["last"]
    one = 32 * 128 * 4
    report = find_retained({"trainer": trainer, "same": same, "x": x})
    assert report.total == one  # one graph, reachable from two variables, charged once
    assert report.items[0].example == "trainer.history['last']"


def test_intermediates_the_user_holds_are_not_charged() -> None:
    w = torch.randn(100, 100, requires_grad=True)
    h = torch.sigmoid(w @ w)  # sigmoid saves h itself, which the variable holds anyway
    y = (h * h).sum()  # saves h twice (held) -> nothing that detaching would free
    report = find_retained({"h": h, "y": y, "w": w})
    assert report.total == 0


def test_after_backward_the_graph_keeps_nothing() -> None:
    model, x = mlp()
    loss = model(x).sum()
    loss.backward()
    assert find_retained({"loss": loss, "x": x}).items == ()
    with pytest.raises(GraphFreedError, match="before calling backward"):
        list(saved_tensors(loss.grad_fn.next_functions[0][0]))


def test_magic_names_the_leaking_variable(ip: Any) -> None:
    run(
        ip,
        "model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), "
        "torch.nn.Linear(128, 10))\nx = torch.randn(32, 64)\n"
        "losses = []\nfor _ in range(3):\n    losses.append(model(x).sum())",
    )
    ip.rec.clear()
    r = run(ip, "%gpumem_leaks -o leaks")
    assert r.success
    html = ip.rec.html()[0]
    assert "<code>losses</code>" in html and "memlab-retained" in html
    assert ip.user_ns["leaks"].total == 3 * 32 * 128 * 4
    assert "-o NAME" in str(run(ip, "%gpumem_leaks --bogus").error_in_exec)


def test_magic_finds_a_graph_the_output_history_keeps(ip: Any) -> None:
    """A cell that ends with ``loss`` keeps it, graph and all, in ``Out[N]`` (and ``_N``, ``_``)
    after ``del loss``: the trap the course's notebook 03 teaches. The finder names it, with the
    bytes one forward saves, and says how to let it go."""
    run(
        ip,
        "model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), "
        "torch.nn.Linear(128, 10))\nx = torch.randn(32, 64)",
    )
    shown = run(ip, "loss = model(x).sum()\nloss")
    run(ip, "del loss")
    r = run(ip, "%gpumem_leaks -o leaks")
    assert r.success
    found = ip.user_ns["leaks"]
    n = shown.execution_count
    assert [i.name for i in found.items] == [f"Out[{n}]"]
    assert found.total == 32 * 128 * 4
    assert "%reset -f out" in found.items[0].fix and f"_{n}" in found.items[0].fix
    run(ip, "%reset -f out")
    assert not run(ip, "%gpumem_leaks -o leaks").error_in_exec
    assert ip.user_ns["leaks"].items == ()


def test_a_leaf_only_the_graph_holds_is_charged_and_a_variables_is_not() -> None:
    """``randn(..., requires_grad=True).sin()``: the leaf is no parameter and no variable holds
    it; sin saved it, and the graph alone keeps its 360,000 bytes alive."""
    t = torch.randn(300, 300, requires_grad=True).sin()
    found = find_retained({"t": t})
    assert [(i.name, i.bytes) for i in found.items] == [("t", 300 * 300 * 4)]
    x = torch.randn(300, 300, requires_grad=True)
    assert find_retained({"u": x.sin(), "x": x}).items == ()


def test_the_fix_has_no_literal_backticks_and_no_nested_brackets() -> None:
    import re

    from memlab.graphs.retained import Retained, RetainedReport

    report = RetainedReport(
        (Retained("loss", 4096, 3, 1, "loss"), Retained("losses", 8192, 6, 2, "losses[0]"))
    )
    text, html = str(report), report._repr_html_()
    assert "`" not in text and "`" not in html
    assert "<code>loss = loss.detach()</code>" in html and "<code>torch.no_grad()</code>" in html
    for line in text.splitlines():  # no bracket opened inside another one
        depth = 0
        for ch in re.sub(r"\w\(\)", "", line):  # a call's own () is not a bracket of prose
            depth += {"(": 1, ")": -1}.get(ch, 0)
            assert depth <= 1, line
