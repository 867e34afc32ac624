"""The report protocol: every result type has text, HTML in the one frame and a JSON-safe dict.

Goldens use constructed results with known numbers (timings vary run to run); a few real,
cheap measurements check that what the library returns keeps the protocol too.
``pytest --update-golden`` rewrites tests/golden/<type>.{txt,html}: review the diff.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import memlab
from memlab import Breakdown, Category, Graph, MemoryReport, Reports
from memlab.core.warn import MemlabDeprecationWarning
from memlab.distributed import Check, RankRow, RankTable, check
from memlab.estimate import Estimate, StrategyTable, compare, per_rank, strategies
from memlab.estimate.gpus import GPUS
from memlab.estimate.oom import explain
from memlab.estimate.spread import Cause
from memlab.estimate.trace import ReplayResult, StreamDiff, replay, synthetic
from memlab.estimate.trace import diff as compare_streams
from memlab.graphs.model import Node, Saved
from memlab.graphs.retained import Retained, RetainedReport
from memlab.magic.history import History
from memlab.reports.oom import Lever, LiveTensor, OOMExplanation
from memlab.reports.preflight import Preflight
from memlab.reports.protocol import Result
from memlab.snapshot import from_dict
from memlab.snapshot.synthetic import training_snapshot
from memlab.step.comparison import Comparison
from memlab.step.ranks import divide
from memlab.whatif import RunConfig, RunResult

MiB = 1024**2
EVIL = '<script>alert("x")</script> & co'
ESCAPED = "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; co"


def report(label: str | None = "step", **changes: Any) -> MemoryReport:
    r = MemoryReport(
        device="cpu",
        source="tensor-accounting",
        allocated_before=1 * MiB,
        allocated_after=3 * MiB,
        peak_allocated=12 * MiB,
        seconds=0.0125,
        label=label,
        breakdown=Breakdown(
            {Category.PARAMETER: 1 * MiB, Category.ACTIVATION: 8 * MiB, Category.GRADIENT: 1 * MiB},
            {Category.PARAMETER: 1 * MiB, Category.GRADIENT: 1 * MiB},
            {Category.PARAMETER: 1 * MiB, Category.ACTIVATION: 9 * MiB, Category.GRADIENT: 1 * MiB},
        ),
    )
    return dataclasses.replace(r, **changes)


def run_result(batch: int = 4, predicted_for: str | None = None, **changes: Any) -> RunResult:
    config = RunConfig(device="cpu", batch_size=batch, optimizer="sgd")
    r = report(None, peak_allocated=batch * 3 * MiB, **changes)
    return RunResult(config, r, predicted_for=predicted_for)


def history(label: str = "first") -> History:
    h = History()
    h.add(1, report(label))
    h.add(2, report(None, allocated_after=0, raised="ValueError"))
    return h


def comparison(label: str = "") -> Comparison:
    oom = RunResult(
        RunConfig(device="cpu", batch_size=64),
        None,
        oom=True,
        error=f"CUDA out of memory{label}",
    )
    return Comparison(
        [run_result(4), run_result(8), run_result(8, predicted_for="T4" + label), oom]
    )


def sharded_run(predicted_for: str | None = None) -> RunResult:
    """A run over 2 ranks with FSDP: its step divided by the per-rank rule."""
    config = RunConfig(device="cpu", batch_size=4, world_size=2, sharding="fsdp")
    r = report(None)
    assert r.breakdown is not None
    ranks = divide(r.breakdown, (MiB // 4,) * 4, 2, "fsdp")
    return RunResult(config, r, predicted_for=predicted_for, ranks=ranks)


def sharded_comparison(label: str = "") -> Comparison:
    return Comparison([run_result(4), sharded_run(), sharded_run("T4" + label)])


def an_estimate(label: str | None = None) -> Estimate:
    tensors = report(label)
    predicted = report(
        label,
        device="cuda:0",
        source="estimate",
        reserved_before=2 * MiB,
        reserved_after=20 * MiB,
        peak_reserved=20 * MiB,
        notes=("includes cuBLAS workspaces: 8 MiB (forward)",),
    )
    return Estimate(
        RunConfig(batch_size=4, optimizer="adam"),
        GPUS["T4"],
        tensors,
        predicted,
        fsdp_units=(MiB // 4,) * 4,
        workspaces=(("forward", 8 * MiB),),
        low=(11 * MiB, 20 * MiB),
        high=(13 * MiB, 22 * MiB),
        causes=(Cause("aten.convolution: cuDNN workspace (forward)", 2, MiB, MiB // 2, 3 * MiB),),
    )


def graph(module: str = "0") -> Graph:
    saved = Saved("_saved_mat1", (4, 128), "torch.float32", 2048, "activation")
    weight = Saved("_saved_mat2", (128, 10), "torch.float32", 5120, "parameter")
    nodes = (
        Node(0, "AddmmBackward0", module, 2048, (saved, weight), (1,)),
        Node(1, "AccumulateGrad", module, 0, (), (), leaf="0.weight"),
    )
    return Graph(nodes, (0,), 5120, ("one note",))


def retained(name: str = "losses") -> RetainedReport:
    return RetainedReport(
        (Retained(name, 3 * 16384, 9, 3, f"{name}[0]"), Retained("out", 4096, 2, 1, "out"))
    )


def replayed() -> ReplayResult:
    events = synthetic(
        [
            ("segment_alloc", 0, 2 * MiB),
            ("alloc", 0, 512),
            ("alloc", 512, 4096),
            ("free_completed", 0, 512),
        ]
    )
    return replay(events)


def stream_diff() -> StreamDiff:
    mine = synthetic([("alloc", 0, 512), ("alloc", 512, 4096), ("alloc", 8192, 4096)])
    real = synthetic([("alloc", 0, 512), ("alloc", 512, 8192)])
    return compare_streams(mine, real)


def oom(label: str = "x") -> OOMExplanation:
    live = [
        LiveTensor(64 * MiB, "activation", (), 4, "y = net(x)"),
        LiveTensor(32 * MiB, "other", (label,), 2, f"{label} = torch.empty(2**23)"),
        LiveTensor(MiB, "parameter"),
    ]
    levers = [
        Lever("AMP (bf16)", "`torch.autocast('cuda', dtype=torch.bfloat16)`", 70 * MiB, True),
        Lever(f"del {label}", f"`del {label}` before this cell", 98 * MiB, False),
    ]
    segments = [
        {"total_size": 100 * MiB, "blocks": [{"size": 97 * MiB, "state": "active_allocated"}]}
    ]
    return explain(
        where="predicted T4 (16 GiB)",
        requested=40 * MiB,
        capacity=120 * MiB,
        segments=segments,
        live=live,
        levers=levers,
        line=4,
        source="y = net(x)",
        notes=("one note",),
    )


def rank_table() -> RankTable:
    def row(rank: int, gathered: int) -> RankRow:
        at_peak = {
            Category.PARAMETER: 1 * MiB + gathered,
            Category.OPTIMIZER_STATE: 2 * MiB,
            Category.ACTIVATION: 3 * MiB,
            Category.COMMUNICATION: gathered,
        }
        at_end = {c: at_peak[c] for c in (Category.PARAMETER, Category.OPTIMIZER_STATE)}
        at_end[Category.PARAMETER] -= gathered
        peak = sum(at_peak.values())
        return RankRow(rank, "cpu", 3 * MiB, 3 * MiB, peak, "forward", at_peak, at_end, ())

    return RankTable((row(0, MiB // 2), row(1, MiB)), "gloo")


def a_check() -> Check:
    return check(rank_table(), per_rank(an_estimate(), 2, "fsdp"), "mlp")


#: name of the golden files -> a deterministic result of that type
RESULTS: dict[str, Callable[[], Result]] = {
    "reports": lambda: Reports((report(), report(device="meta"))),
    "history": history,
    "run_result": lambda: RunResult(
        RunConfig(device="cpu", batch_size=4, retention="attached"),
        report(),
        series=(2 * MiB, 4 * MiB, 6 * MiB),
    ),
    "comparison": comparison,
    "run_result_ranks": sharded_run,
    "comparison_ranks": sharded_comparison,
    "estimate": an_estimate,
    "strategy_table": lambda: strategies(an_estimate(), 4),
    "retained_report": retained,
    "graph": graph,
    "replay_result": replayed,
    "stream_diff": stream_diff,
    "oom_explanation": oom,
    "preflight": lambda: Preflight("T4 (16 GiB)", 15 * 1024 * MiB, 90 * MiB, 122 * MiB, oom()),
    "preflight_fits": lambda: Preflight("L4 (24 GiB)", 23 * 1024 * MiB, 90 * MiB, 122 * MiB),
    "snapshot": lambda: from_dict(training_snapshot(steps=1, layers=2)[0], "step.pickle"),
    "rank_table": rank_table,
    "check": a_check,
}


@pytest.mark.parametrize("name", sorted(RESULTS))
def test_every_result_keeps_the_protocol_and_its_golden(name: str, golden: Any) -> None:
    result = RESULTS[name]()
    assert isinstance(result, Result)
    assert json.loads(json.dumps(result.to_dict())) == result.to_dict()
    text, html = str(result), result._repr_html_()
    assert text.strip() and html.startswith(f'<div class="memlab {result.css}" style=')
    assert html.count("font-family") == html.count('<div class="memlab ')  # frames only
    golden(f"{name}.txt", text + "\n")
    golden(f"{name}.html", html + "\n")


def test_empty_results_say_so() -> None:
    for result in (History(), Comparison([]), RetainedReport(())):
        assert "no" in str(result) and "no" in result._repr_html_()
        json.dumps(result.to_dict())


def test_results_show_their_key_figures() -> None:
    c = comparison()
    assert [r.vs_baseline for r in c.rows()] == [None, 12 * MiB, None, None]
    assert "+12.0 MiB" in str(c) and 'title="12,582,912 B"' in c._repr_html_()
    assert "baselines: run 1 (measured), run 3 (predicted for T4)" in str(c)
    assert "out of memory" in str(c) and "out of memory" in c._repr_html_()
    assert c.to_dict()["runs"][1]["vs_baseline"] == 12 * MiB
    e = an_estimate()
    assert str(e).startswith("predicted for T4 (16 GiB) · fits") and "20.0 MiB" in str(e)
    assert e.to_dict()["workspaces"] == [["forward", 8 * MiB]]
    assert "12.0 MiB" in str(history()) and "raised ValueError" in str(history())
    assert "48.0 KiB" in str(retained()) and "48.0 KiB" in retained()._repr_html_()
    assert "2.00 KiB saved for backward" in graph()._repr_html_() and "note: one note" in str(
        graph()
    )
    rr = replayed()
    assert rr.exact and "4 events" in str(rr) and rr.to_dict()["first_divergence"] is None
    sd = stream_diff()
    assert sd.first == 1 and "first difference at allocation 1" in sd._repr_html_()


def test_the_strategy_table_keeps_compare_for_one_release() -> None:
    e = an_estimate()
    table = strategies(e, 4)
    assert isinstance(table, StrategyTable)
    assert [r.strategy for r in table.rows] == ["ddp", "zero1", "zero2", "fsdp"]
    with pytest.warns(MemlabDeprecationWarning, match="use memlab.estimate.strategies"):
        kept = compare(e, 4)
    assert kept == table.table() and str(table).startswith(kept)
    ddp = table.to_dict()["strategies"][0]
    assert ddp["strategy"] == "ddp" and ddp["by_category"]["activation"] == 8 * MiB
    assert ddp["total"] == table.rows[0].total
    assert "DDP&#x27;s gradient buckets" in table._repr_html_()


@pytest.mark.parametrize(
    "make",
    [
        lambda: Reports((report(EVIL),)),
        lambda: history(EVIL),
        lambda: run_result(predicted_for=EVIL),
        lambda: comparison(EVIL),
        lambda: sharded_comparison(EVIL),
        lambda: an_estimate(EVIL),
        lambda: retained(EVIL),
        lambda: graph(EVIL),
        lambda: dataclasses.replace(replayed(), first_divergence=_divergence()),
        lambda: oom(EVIL),
        lambda: from_dict(training_snapshot(steps=1, layers=2)[0], EVIL),
    ],
)
def test_user_strings_are_escaped(make: Callable[[], Result]) -> None:
    html = make()._repr_html_()
    assert "<script>" not in html and ESCAPED in html


def _divergence() -> Any:
    from memlab.estimate.trace import Divergence

    return Divergence(3, {"action": EVIL, "size": 512}, "reused", "reserved a 2 MiB segment")


def test_only_the_frame_module_writes_a_frame() -> None:
    package = Path(memlab.__file__).parent
    writers = [
        p.relative_to(package).as_posix()
        for p in package.rglob("*.py")
        if "font-family" in p.read_text()
    ]
    assert writers == ["reports/frame.py"]


def test_a_real_run_and_its_comparison_keep_the_protocol() -> None:
    from memlab.whatif import run

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Linear(16, 8)

    results = [
        run(model, lambda b: torch.randn(b, 16), None, RunConfig(device="cpu", batch_size=b))
        for b in (4, 8)
    ]
    for result in (*results, Comparison(results)):
        json.dumps(result.to_dict())
        assert "batch 8, adam" in str(result) or "batch 4, adam" in str(result)
        assert "batch 8, adam" in result._repr_html_() or "batch 4, adam" in result._repr_html_()
    assert results[0].report is not None
    assert results[0].to_dict()["peak"] == results[0].report.peak_allocated
    fig = Comparison(results).plot()
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["1", "2"]


def test_a_real_estimate_and_its_strategies_keep_the_protocol() -> None:
    from memlab.estimate import estimate

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))

    e = estimate(mlp, lambda b: torch.randn(b, 32), None, RunConfig(batch_size=4), gpu="T4")
    table = strategies(e, 2)
    for result in (e, table):
        json.dumps(result.to_dict())
        assert str(result) and result._repr_html_().startswith('<div class="memlab ')
    assert "T4" in e._repr_html_() and "fsdp" in table._repr_html_()
