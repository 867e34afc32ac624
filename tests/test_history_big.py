"""Big histories: a bounded plot (points, x labels) that keeps every peak, drawn in one pass,
and a bounded table that says what it leaves out. Timings: benchmarks/bench_limits.py."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from conftest import run

from memlab.magic.history import MAX_ENTRIES, MAX_ROWS, Entry, History
from memlab.reports.plot import MAX_POINTS, MAX_TICKS, envelope, plot_history, ticks
from memlab.reports.units import mib

pytest.importorskip("matplotlib")


class Counted(Sequence[int]):
    """A sequence that counts how often its items are read."""

    def __init__(self, values: list[int]) -> None:
        self.values = values
        self.reads = 0

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i: Any) -> Any:
        self.reads += 1
        return self.values[i]


def series(n: int, seed: int = 0) -> tuple[list[str], list[int], list[int]]:
    rng = random.Random(seed)
    after = [rng.randrange(2**30) for _ in range(n)]
    peak = [a + rng.randrange(2**28) for a in after]
    peak[rng.randrange(n)] = 2**33  # one short spike, to be kept
    return [f"[{i}]" for i in range(n)], after, peak


def test_the_envelope_keeps_each_buckets_lowest_and_highest_in_one_pass() -> None:
    _, _, peak = series(100_000)
    counted = Counted(peak)
    xs, ys = envelope(counted, 1_000)
    assert counted.reads <= 3 * len(peak)  # O(n): each value read a fixed number of times
    assert len(xs) <= 2 * 1_000 and xs == sorted(xs) and len(set(xs)) == len(xs)
    assert max(ys) == max(peak) == 2**33 and min(ys) == min(peak)
    size = 100
    for lo in range(0, len(peak), size):
        bucket = peak[lo : lo + size]
        assert max(bucket) in ys and min(bucket) in ys


def test_ticks_are_few_and_include_both_ends() -> None:
    assert ticks(12) == list(range(12))
    for n in (21, 1_000, 100_000):
        t = ticks(n)
        assert len(t) <= MAX_TICKS and t[0] == 0 and t[-1] == n - 1 and t == sorted(set(t))


@pytest.mark.parametrize("n", [10_000, 100_000])
def test_a_long_history_plot_is_bounded_and_keeps_the_peak(n: int) -> None:
    names, after, peak = series(n)
    names[0] = "a label far too long to fit under the axis of a plot"
    fig = plot_history(names, after, peak)
    ax = fig.axes[0]
    assert len(ax.get_xticks()) <= MAX_TICKS
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels[0] == "a label far too long to…" and labels[-1] == f"[{n - 1}]"
    after_line, peak_line = ax.lines
    for line in ax.lines:
        assert len(line.get_xdata()) <= MAX_POINTS and line.get_marker() in ("None", None, "")
    assert max(peak_line.get_ydata()) == mib(2**33)
    assert max(after_line.get_ydata()) == mib(max(after))
    assert f"{n:,} cells" in ax.get_title()


def test_a_short_history_plot_is_drawn_point_by_point() -> None:
    names, after, peak = series(12)
    ax = plot_history(names, after, peak).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == names
    assert [len(line.get_xdata()) for line in ax.lines] == [12, 12]
    assert ax.lines[0].get_marker() == "o" and ax.get_title() == ""


def filled(n: int) -> History:
    h = History()
    for i in range(n):
        if len(h.entries) == h.entries.maxlen:
            h.dropped += 1
        h.entries.append(Entry(i, "", "cpu", "tensor-accounting", 0, i, 2 * i, 0.001, None))
    return h


def test_a_long_history_table_shows_the_last_rows_and_says_what_is_hidden() -> None:
    h = filled(MAX_ENTRIES + 25)
    assert len(h) == MAX_ENTRIES and h.dropped == 25
    html, text = h._repr_html_(), str(h)
    assert html.count("<tr") == MAX_ROWS + 1  # the head and the last rows
    assert f"[{MAX_ENTRIES + 24}]" in html and f"[{MAX_ENTRIES + 24 - MAX_ROWS}]" not in html
    hidden = f"{MAX_ENTRIES - MAX_ROWS:,} earlier cell(s) not shown here"
    assert hidden in html and hidden in text
    assert "25 older cell(s) forgotten (the last 10,000 are kept)" in text
    assert len(text.splitlines()) == MAX_ROWS + 3  # title, note, head, rows
    d = h.to_dict()
    assert len(d["cells"]) == MAX_ENTRIES and d["dropped"] == 25
    h.clear()
    assert h.dropped == 0 and "not shown" not in str(filled(MAX_ROWS))


def test_the_magic_shows_a_long_history(ip: Any) -> None:
    history = ip._memlab_magics.history
    big = filled(MAX_ENTRIES)
    history.entries.extend(big.entries)
    ip.rec.clear()
    r = run(ip, "%gpumem_history")
    assert r.success, r.error_in_exec
    html = ip.rec.html()[0]
    assert html.count("<tr") == MAX_ROWS + 1 and "earlier cell(s) not shown here" in html
    assert any("image/png" in d for _, d in ip.rec.items)
    history.clear()


def test_adding_past_the_limit_forgets_the_oldest_and_counts_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from memlab.magic import history as module
    from memlab.reports.report import MemoryReport

    monkeypatch.setattr(module, "MAX_ENTRIES", 3)
    h = History()
    for i in range(5):
        h.add(i, MemoryReport("cpu", "tensor-accounting", 0, i, i, 0.001))
    assert [e.cell for e in h.entries] == [2, 3, 4] and h.dropped == 2
    assert "2 older cell(s) forgotten (the last 3 are kept)" in str(h)
