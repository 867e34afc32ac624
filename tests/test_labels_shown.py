"""A label is drawn and shown as written, and bounded: ``$`` is no mathematical notation in a
plot, and a label of a million characters (made from a variable) is cut in the report, the
history and the plots, while the report's data keeps it whole."""

from __future__ import annotations

from typing import Any

import matplotlib
import pytest
import torch
from conftest import run

import memlab
from memlab.reports.units import MAX_SHOWN_LABEL, fmt_label

matplotlib.use("Agg")


@pytest.mark.parametrize("label", ["cost $$", r"$\undefinedcmd{x}$ and $x^", "$5 & 10$", "a\\b"])
def test_a_label_with_dollars_draws_as_written(label: str) -> None:
    with memlab.track("cpu", timeline=True, label=label) as t:
        x = torch.ones(1000)
    del x
    fig = t.report.plot()
    fig.canvas.draw()  # (matplotlib parses the text as it draws)
    title = fig.axes[0].get_title()
    assert title.replace("\\$", "$").count("$") == label.count("$")


def test_a_huge_label_is_cut_where_it_is_shown_and_kept_in_the_data(ip: Any) -> None:
    ip.user_ns["lab"] = "z" * 1_000_000
    for _ in range(3):
        assert run(ip, "%%gpumem -q -l $lab -o r\nc = torch.ones(3)").success
    r = ip.user_ns["r"]
    assert r.label == "z" * 1_000_000 and r.to_dict()["label"] == r.label
    assert len(r.text()) < 5_000 and len(r._repr_html_()) < 20_000
    assert "(1,000,000 characters)" in r.text()
    history = ip._memlab_magics.history
    assert len(history.text()) < 3 * 2 * MAX_SHOWN_LABEL + 2_000
    fig = history.plot()
    fig.canvas.draw()


def test_fmt_label_keeps_short_labels_and_puts_line_breaks_on_one_line() -> None:
    assert fmt_label("step 1") == "step 1"
    assert fmt_label("a\nb\rc") == "a b c"
    cut = fmt_label("x" * 500)
    assert len(cut) <= MAX_SHOWN_LABEL + 30 and cut.endswith("(500 characters)")
