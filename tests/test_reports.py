"""Reports: the dict contract, golden text and HTML, escaping, units, plots."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from memlab import Breakdown, Category, MemoryReport, Reports, Timeline
from memlab.core.cuda import DriverView
from memlab.reports.frame import GROW
from memlab.reports.units import fmt_bytes, fmt_seconds

MiB = 1024**2


def cuda_report(**changes: Any) -> MemoryReport:
    r = MemoryReport(
        device="cuda:0",
        source="cuda-allocator",
        allocated_before=512 * MiB,
        allocated_after=640 * MiB,
        peak_allocated=1536 * MiB,
        seconds=0.0123,
        label="train step",
        reserved_before=1024 * MiB,
        reserved_after=2048 * MiB,
        peak_reserved=2048 * MiB,
        active_before=512 * MiB,
        active_after=640 * MiB,
        alloc_retries=1,
        ooms=0,
        breakdown=Breakdown(
            {
                Category.PARAMETER: 256 * MiB,
                Category.ACTIVATION: 900 * MiB,
                Category.UNATTRIBUTED: 380 * MiB,
            },
            {
                Category.PARAMETER: 256 * MiB,
                Category.GRADIENT: 256 * MiB,
                Category.UNATTRIBUTED: 128 * MiB,
            },
        ),
        driver=DriverView(free=70 * 1024 * MiB, total=80 * 1024 * MiB, process_used=2600 * MiB),
    )
    return dataclasses.replace(r, **changes)


def cpu_report() -> MemoryReport:
    return MemoryReport(
        device="cpu",
        source="tensor-accounting",
        allocated_before=0,
        allocated_after=4_000_000,
        peak_allocated=4_000_000 + 128 * MiB,
        seconds=0.000812,
        raised="KeyboardInterrupt",
    )


def test_to_dict_has_the_contract_keys_in_integer_bytes() -> None:
    d = cuda_report().to_dict()
    for key in (
        "device",
        "allocated_before",
        "allocated_after",
        "allocated_delta",
        "peak_allocated",
        "peak_delta",
        "reserved_before",
        "reserved_after",
        "seconds",
        "categories",
    ):
        assert key in d
    assert d["allocated_delta"] == 128 * MiB and d["peak_delta"] == 1024 * MiB
    cats = d["categories"]
    assert set(cats) == {"at_peak", "at_end", "highest"}
    assert set(cats["at_peak"]) == {c.value for c in Category}
    assert all(type(v) is int for part in cats.values() for v in part.values())
    assert cats["at_end"]["gradient"] == 256 * MiB and cats["at_end"]["activation"] == 0
    assert "categories" not in cpu_report().to_dict()


def test_reports_are_immutable() -> None:
    r = cuda_report()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.allocated_after = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        r.breakdown.at_peak[Category.PARAMETER] = 0  # type: ignore[index, union-attr]


def test_reports_are_values_a_set_or_a_dict_key_can_hold() -> None:
    """Frozen, so hashable like a tuple: equal reports hash alike, whatever their breakdown
    (whose mappings are read-only proxies, which have no hash of their own)."""
    r = cuda_report()
    same = dataclasses.replace(
        r,
        breakdown=Breakdown(
            dict(r.breakdown.at_peak), dict(r.breakdown.at_end), dict(r.breakdown.highest)
        ),
    )  # type: ignore[union-attr]
    assert same == r and hash(same) == hash(r) and len({r, same, Reports((r,))}) == 2
    other = dataclasses.replace(r, breakdown=Breakdown({Category.PARAMETER: 1}, {}))
    assert other != r and {r: "a", other: "b"}[other] == "b"


def test_text_golden(golden: Any) -> None:
    golden("report_cuda.txt", str(cuda_report()) + "\n")
    golden("report_cpu.txt", str(cpu_report()) + "\n")


def test_html_golden(golden: Any) -> None:
    golden("report_cuda.html", cuda_report()._repr_html_() + "\n")
    golden("report_cpu.html", cpu_report()._repr_html_() + "\n")


def test_html_highlights_growth_and_shows_exact_bytes() -> None:
    html = cuda_report()._repr_html_()
    assert GROW in html  # growth in red
    assert 'title="134,217,728 B"' in html  # exact delta on hover
    shrink = cuda_report(allocated_after=0)._repr_html_()
    assert "#1e8449" in shrink


def test_labels_are_escaped() -> None:
    evil = cuda_report(label='<script>alert("x")</script> & co')
    html = evil._repr_html_()
    assert "<script>" not in html and "&lt;script&gt;" in html and "&amp; co" in html


def test_notes_explain_what_the_numbers_mean() -> None:
    text = str(cuda_report(peak_scope="since-reset"))
    assert "since the allocator's peak counter was last reset" in text
    assert "1 allocation retry" in text
    assert "this process 2.54 GiB" in text and "CUDA context" in text
    assert "interrupted (KeyboardInterrupt): figures cover the region" in str(cpu_report())


@pytest.mark.parametrize(
    ("n", "signed", "text"),
    [
        (0, False, "0 B"),
        (512, False, "512 B"),
        (4_000_000, False, "3.81 MiB"),
        (4_000_000, True, "+3.81 MiB"),
        (-4_000_000, True, "-3.81 MiB"),
        (0, True, "±0 B"),
        (40 * MiB, False, "40.0 MiB"),
        (400 * MiB, False, "400 MiB"),
        (3 * 1024**3, False, "3.00 GiB"),
        (None, False, "n/a"),
    ],
)
def test_fmt_bytes(n: int | None, signed: bool, text: str) -> None:
    assert fmt_bytes(n, signed=signed) == text


def test_fmt_seconds() -> None:
    assert [fmt_seconds(s) for s in (0.000812, 0.0123, 1.5, 600)] == [
        "812 µs",
        "12.3 ms",
        "1.50 s",
        "10.0 min",
    ]


def test_plot_draws_the_timeline() -> None:
    tl = Timeline(
        seconds=(0.001, 0.002, 0.003, 0.004),
        allocated=(100, 300, 200, 150),
        phases=("forward", "forward", "backward", "optimizer"),
        source="tensor accounting",
    )
    r = dataclasses.replace(cpu_report(), allocated_before=50, peak_allocated=300, timeline=tl)
    fig = r.plot()
    ax = fig.axes[0]
    ys = ax.lines[0].get_ydata()
    assert max(ys) == pytest.approx(300) and ax.get_ylabel() == "B"  # in the unit that fits
    labels = ax.get_legend_handles_labels()[1]
    assert {"allocated", "peak", "forward", "backward", "optimizer"} <= set(labels)
    # a cell whose value is the figure shows it as an image, without %matplotlib inline
    from IPython.core.formatters import DisplayFormatter

    data, _ = DisplayFormatter().format(fig)
    assert data["image/png"][:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_timeline_says_how_to_get_one() -> None:
    with pytest.raises(ValueError, match="timeline=True"):
        cpu_report().plot()


def test_multi_device_reports() -> None:
    rs = Reports((cuda_report(), dataclasses.replace(cuda_report(), device="cuda:1")))
    assert len(rs) == 2 and rs[1].device == "cuda:1"
    assert rs._repr_html_().count("memlab-report") == 2
    assert [r["device"] for r in rs.to_dict()["reports"]] == ["cuda:0", "cuda:1"]


def test_bars_span_mib_to_gib_with_totals_written_and_the_budget_as_a_line() -> None:
    from memlab.reports.plot import plot_categories

    small = {Category.PARAMETER: 3 * 1024**2}
    big = {Category.PARAMETER: 2 * 1024**3, Category.ACTIVATION: 1024**3}
    fig = plot_categories([small, big], budget=4 * 1024**3)
    ax = fig.axes[0]
    assert ax.get_ylabel() == "GiB at the peak"
    written = [t.get_text() for t in ax.texts]
    assert written == ["3.00 MiB", "3.00 GiB"]  # the small run is readable though its bar is not
    budget = [line for line in ax.get_lines() if line.get_label() == "budget"]
    assert budget and budget[0].get_ydata()[0] == 4.0
    assert ax.get_ylim()[1] > 4.0  # the line is inside the plot


def test_the_timeline_keeps_its_peak_inside_and_its_legend_outside() -> None:
    r = cpu_report()
    if r.timeline is None:
        r = dataclasses.replace(
            r,
            timeline=Timeline(
                (0.1, 0.2), (10 * 1024**2, 4 * 1024**2), ("forward",) * 2, "tensor accounting"
            ),
        )
    fig = r.plot()
    ax = fig.axes[0]
    top = ax.get_ylim()[1]
    peak = max(max(line.get_ydata()) for line in ax.get_lines())
    assert peak < top
    legend = ax.get_legend()
    assert legend is not None and legend._bbox_to_anchor is not None  # placed beside the axes


def test_a_deferred_timeline_is_the_timeline_it_makes() -> None:
    """A region's timeline is made on first read: its length is known before, and equality,
    pickling and copies see the same points; a long one is thinned when the report is made
    (so an unread timeline keeps no more than a read one)."""
    import copy
    import pickle
    from array import array

    from memlab.core.recorder import Tally
    from memlab.region.assemble import MAX_TIMELINE_POINTS, _timeline
    from memlab.reports.report import Timeline

    n = 3 * MAX_TIMELINE_POINTS
    totals = array("q", [(i * 7919) % 1000 for i in range(n)])
    totals[1234] = 10**6  # the peak survives the thinning
    tally = Tally(0, 0, 10**6, None, None, None, array("d", range(n)), totals, array("b", [1] * n))
    made = _timeline(tally, 5)
    assert made is not None and "_points" in made.__dict__
    kept = len(made)
    assert kept <= MAX_TIMELINE_POINTS and "_points" in made.__dict__  # (still not made)
    captured = made.__dict__["_points"].__closure__
    assert all(
        len(c.cell_contents) <= kept for c in captured if hasattr(c.cell_contents, "__len__")
    )
    eager = Timeline(made.seconds, made.allocated, made.phases, made.source)
    assert made == eager and len(made.seconds) == kept and max(made.allocated) == 10**6 + 5
    assert set(made.phases) == {"forward"} and "_points" not in made.__dict__
    again = _timeline(tally, 5)
    assert pickle.loads(pickle.dumps(again)) == eager == copy.deepcopy(_timeline(tally, 5))
