"""The magics in a real in-process IPython shell that records what it displays."""

from __future__ import annotations

import re
from typing import Any

import pytest
from conftest import run

import memlab

MiB = 1024**2


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests check the CPU's tensor accounting. Where a GPU is present the magic's default
    device would be the GPU instead: hide it (tests/test_cuda.py tests the GPU's path)."""
    from memlab.core import devices

    monkeypatch.setattr(devices, "_cuda_count", lambda: 0)


def test_report_renders_under_the_cells_own_output(ip: Any, capsys: Any) -> None:
    r = run(ip, '%%gpumem -o rep\nprint("hello")\nx = torch.empty(1000, 1000)\nx.shape')
    assert r.success
    assert capsys.readouterr().out == "hello\n"
    assert ip.rec.kinds() == ["out", "display"]  # Out[n] first, then the report
    assert "torch.Size([1000, 1000])" in ip.rec.items[0][1]["text/plain"]
    html = ip.rec.reports()[0]
    assert "+3.81 MiB" in html and 'title="4,000,000 B"' in html
    assert ip.user_ns["rep"].allocated_delta == 4_000_000
    assert ip.user_ns["Out"][ip.execution_count - 1] == ip.user_ns["x"].shape
    assert ip.user_ns["_"] == ip.user_ns["x"].shape


def test_definitions_land_in_the_namespace(ip: Any) -> None:
    run(ip, "%%gpumem -q\ndef f(a):\n    return a + 1\nclass K:\n    v = 3\nimport math as m")
    assert ip.user_ns["f"](1) == 2 and ip.user_ns["K"].v == 3 and ip.user_ns["m"].pi > 3


def test_exception_shows_report_then_traceback_at_the_cells_line(ip: Any, capsys: Any) -> None:
    r = run(ip, "%%gpumem\na = 1\nb = torch.ones(10)\nraise ValueError('boom')\nc = 2")
    assert isinstance(r.error_in_exec, ValueError)
    out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
    assert "raise ValueError('boom')" in out and "----> 4" in out
    assert f"Cell In[{r.execution_count}], line 4" in out  # the cell's own number and line
    r = run(ip, "%%gpumem -q\nraise KeyError('k')")
    out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
    assert "      1 # %%gpumem -q\n----> 2 raise KeyError('k')" in out
    assert len(ip.rec.reports()) == 1 and "raised ValueError" in ip.rec.reports()[0]
    assert ip.user_ns["a"] == 1 and "c" not in ip.user_ns  # ran up to the error, no further


def test_keyboard_interrupt_reports_and_the_shell_lives(ip: Any) -> None:
    r = run(ip, "%%gpumem\nbefore = torch.empty(10)\nraise KeyboardInterrupt")
    assert isinstance(r.error_in_exec, KeyboardInterrupt)
    assert "INTERRUPTED" in ip.rec.reports()[0]
    assert "interrupted (KeyboardInterrupt): figures cover the region" in ip.rec.reports()[0]
    assert "before" in ip.user_ns
    assert run(ip, "%%gpumem -q\nafter = 1").success and ip.user_ns["after"] == 1


@pytest.mark.parametrize("body", ["# only a comment\n", "\n\n", "pass"])
def test_empty_and_comment_only_cells(ip: Any, body: str) -> None:
    r = run(ip, "%%gpumem\n" + body)
    assert r.success and r.result is None
    assert ip.rec.kinds() == ["display"]


def test_multi_line_strings_are_kept_byte_for_byte(ip: Any) -> None:
    cell = '%%gpumem -q\ns = """first\n    indented  \n\ttab\n"""\ns'
    r = run(ip, cell)
    assert r.success
    assert ip.user_ns["s"] == "first\n    indented  \n\ttab\n"
    assert ip.rec.items[0][1]["text/plain"] == repr("first\n    indented  \n\ttab\n")


def test_cell_that_uses_magics_itself(ip: Any, capsys: Any) -> None:
    r = run(ip, "%%gpumem -q\n%gpumem -q -o inner y = torch.empty(100)\nz = %time 1 + 1\n!echo hi")
    assert r.success
    assert ip.user_ns["z"] == 2 and ip.user_ns["inner"].allocated_delta == 400
    out = capsys.readouterr().out
    assert "Wall time" in out and "hi" in out


def test_semicolon_hides_the_value(ip: Any) -> None:
    run(ip, "%%gpumem\n1 + 1;")
    assert ip.rec.kinds() == ["display"]


def test_a_hidden_value_is_freed_before_the_cell_ends(ip: Any) -> None:
    # IPython drops a value that `;` hides; memlab must not report it as left allocated
    run(ip, "%%gpumem -q -o hidden\ntorch.empty(1000, 1000);")
    assert ip.user_ns["hidden"].allocated_delta == 0
    assert ip.user_ns["hidden"].peak_delta == 4_000_000
    run(ip, "%%gpumem -q -o shown\ntorch.empty(1000, 1000)")
    assert ip.user_ns["shown"].allocated_delta == 4_000_000  # Out[n] keeps it


def test_line_magic_returns_the_value(ip: Any) -> None:
    r = run(ip, "y = %gpumem -o rep torch.ones(10)\ny.sum()")
    assert r.success and float(r.result) == 10.0
    assert ip.user_ns["rep"].allocated_delta == 40
    r = run(ip, "%gpumem torch.zeros(3)")
    assert r.result.shape == (3,)
    run(ip, "%gpumem w = 'a  b  \"c\"'")
    assert ip.user_ns["w"] == 'a  b  "c"'  # the statement is not re-tokenised


def test_exact_bytes_across_cells(ip: Any) -> None:
    run(ip, "%%gpumem -q -o r1\nx = torch.empty(1000, 1000)\nv = x.view(-1)\nx.add_(1);")
    run(ip, "%%gpumem -q -o r2\ndel x, v")
    assert ip.user_ns["r1"].allocated_delta == 4_000_000
    assert ip.user_ns["r2"].allocated_delta == -4_000_000


def test_displayed_tensor_stays_alive_in_out_history(ip: Any) -> None:
    # The notebook trap: Out[n] keeps a displayed tensor alive after `del`, and memlab says so.
    run(ip, "%%gpumem -q -o r1\nx = torch.empty(1000, 1000)\nx")
    run(ip, "import weakref\nalive = weakref.ref(x.untyped_storage())")
    run(ip, "%%gpumem -q -o r2\ndel x")
    assert ip.user_ns["r2"].allocated_delta == 0
    assert ip.user_ns["alive"]() is not None  # the truth: the storage was not freed


def test_tensor_made_outside_tracking_is_returned_when_deleted(ip: Any) -> None:
    run(ip, "old = torch.empty(250_000)")
    run(ip, "%%gpumem -q -o r\ndel old")
    assert ip.user_ns["r"].allocated_delta == -1_000_000


def test_transient_inside_a_cell(ip: Any) -> None:
    cell = (
        "%%gpumem -q -o r\n"
        "big = torch.empty(128 * 2**20, dtype=torch.uint8)\ndel big\n"
        "small = torch.empty(32 * 2**20, dtype=torch.uint8)"
    )
    run(ip, cell)
    r = ip.user_ns["r"]
    assert r.peak_delta >= 128 * MiB and r.allocated_delta == 32 * MiB


def test_breakdown_of_a_training_step(ip: Any) -> None:
    run(
        ip,
        "model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), "
        "torch.nn.Linear(128, 10))\nopt = torch.optim.Adam(model.parameters())\n"
        "x = torch.randn(32, 64)",
    )
    run(ip, "%%gpumem -b -o r\nmodel(x).sum().backward()\nopt.step()")
    r = ip.user_ns["r"]
    params = sum(p.numel() * 4 for p in ip.user_ns["model"].parameters())
    cats = r.to_dict()["categories"]["at_end"]
    assert cats["parameter"] == params and cats["gradient"] == params
    assert cats["optimizer_state"] == 2 * params + 4 * 4
    html = ip.rec.reports()[0]
    assert "optimizer state" in html and "gradient" in html


def test_timeline_draws_a_plot(ip: Any) -> None:
    run(ip, "%%gpumem -t\nfor i in range(5):\n    a = torch.empty(1000 * (i + 1))")
    kinds = [d.keys() for _, d in ip.rec.items]
    assert any("image/png" in k for k in kinds)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--bogus", "unrecognized arguments"),
        ("-d", "expected one argument"),
        ("-d gpu7", "not a device"),
        ("-d cuda:3", "cuda"),
        ("-q -t", "-q shows nothing"),
        ("-o 1abc", "variable name"),
        ("-l one two", "-l takes one word"),
    ],
)
def test_bad_arguments_are_one_line_usage_errors_and_nothing_runs(
    ip: Any, capsys: Any, line: str, message: str
) -> None:
    r = run(ip, f"%%gpumem {line}\nran = True")
    assert type(r.error_in_exec).__name__ == "UsageError"
    assert message in str(r.error_in_exec)
    assert "\n" not in str(r.error_in_exec).strip()
    assert "ran" not in ip.user_ns
    assert "Traceback" not in capsys.readouterr().out


def test_line_magic_without_a_statement(ip: Any) -> None:
    r = run(ip, "%gpumem -b")
    assert "needs a statement" in str(r.error_in_exec)


def test_top_level_await_is_refused_before_running(ip: Any) -> None:
    r = run(ip, "%%gpumem\nran = True\nawait something()")
    assert "await" in str(r.error_in_exec) and "ran" not in ip.user_ns
    # what it says to do instead runs in the same shell (asyncio.run would not, in a kernel)
    assert "with memlab.track() as t:" in str(r.error_in_exec)
    said = run(
        ip, "import asyncio, memlab\nwith memlab.track('cpu') as t:\n    await asyncio.sleep(0)"
    )
    assert said.success and ip.user_ns["t"].report.allocated_delta == 0


def test_syntax_error_is_shown_like_ipython(ip: Any, capsys: Any) -> None:
    r = run(ip, "%%gpumem\nx = (")
    assert isinstance(r.error_in_exec, SyntaxError)


def test_help_comes_from_the_parser(ip: Any) -> None:
    doc = ip.find_cell_magic("gpumem").__doc__
    assert "--breakdown" in doc and "--no-reset" in doc and "-o NAME" in doc


def test_history_table_plot_and_clear(ip: Any, capsys: Any) -> None:
    run(ip, "%%gpumem -q my first\na = torch.empty(1000)")
    run(ip, "%%gpumem -q\nb = torch.empty(2000)")
    ip.rec.clear()
    run(ip, "%gpumem_history -o h")
    html = ip.rec.html()[0]
    assert "my first" in html and "memlab-history" in html
    assert any("image/png" in d for _, d in ip.rec.items)
    h = ip.user_ns["h"]
    assert [e.after - e.before for e in h.entries] == [4000, 8000]
    run(ip, "%gpumem_history --clear")
    assert len(h) == 0
    r = run(ip, "%gpumem_history --bogus")
    assert "unknown option" in str(r.error_in_exec)


def test_auto_mode_tracks_every_cell_until_off(ip: Any, capsys: Any) -> None:
    run(ip, "%gpumem_auto on -d cpu")
    ip.rec.clear()
    run(ip, "a = torch.empty(1000)")
    run(ip, "b = torch.empty(2000)\nraise ValueError")
    run(ip, "%%gpumem -q\nc = 1")  # a %%gpumem cell is not tracked twice
    lines = [d["text/plain"] for _, d in ip.rec.items if "memlab [" in d.get("text/plain", "")]
    assert len(lines) == 2 and "+3.91 KiB" in lines[0] and "+7.81 KiB" in lines[1]
    history = ip._memlab_magics.history
    assert [e.raised for e in history.entries] == [None, "ValueError", None]
    n = ip.execution_count  # the next cell; the three above were n-3, n-2, n-1
    assert [e.cell for e in history.entries] == [n - 3, n - 2, n - 1]
    assert lines[0].startswith(f"memlab [{n - 3}] cpu")
    run(ip, "%gpumem_auto off")
    ip.rec.clear()
    run(ip, "d = torch.empty(10)")
    assert not ip.rec.items
    r = run(ip, "%gpumem_auto maybe")
    assert "on or off" in str(r.error_in_exec)


def test_auto_mode_measures_a_captured_cell_once_and_captures_none_of_memlab(ip: Any) -> None:
    """``%%capture`` runs its body as a cell of its own (not in the history): part of the cell
    around it, which has the one summary, outside what was captured."""
    run(ip, "%gpumem_auto on -d cpu")
    history = ip._memlab_magics.history
    n = len(history)
    ip.rec.clear()
    run(ip, "%%capture cap\nprint('captured')\nc = torch.ones(1000)")
    assert len(history) == n + 1 and history.entries[-1].after - history.entries[-1].before == 4000
    lines = [d["text/plain"] for _, d in ip.rec.items if "memlab [" in d.get("text/plain", "")]
    assert len(lines) == 1 and "+3.91 KiB" in lines[0]
    cap = ip.user_ns["cap"]
    assert cap.stdout == "captured\n" and not cap.outputs  # (memlab's summary not in it)
    # a cell run from a cell with its own place in the history keeps its own summary
    run(ip, "get_ipython().run_cell('d = torch.ones(10)', store_history=True)")
    assert len(history) == n + 3
    run(ip, "%gpumem_auto off")


def test_loading_the_extension_twice_and_unloading(ip: Any) -> None:
    run(ip, "%reload_ext memlab")
    assert run(ip, "%%gpumem -q\nq = 1").success


def test_public_api_shape() -> None:
    assert callable(memlab.track) and memlab.Category.ACTIVATION.value == "activation"


@pytest.mark.parametrize(
    "cell",
    [
        "x = 1  # a plain cell: no IPython syntax\ny = '%' * 3\ny",
        ">>> a = 3\n>>> a",  # pasted doctest prompts: IPython strips them
        "In [1]: b = 4\nIn [2]: b",
        "def f():\n    return 41\nf() + 1",
    ],
)
def test_cell_means_what_it_means_without_the_magic(ip: Any, cell: str) -> None:
    bare = run(ip, cell).result
    ip.rec.clear()
    tracked = run(ip, "%%gpumem -q\n" + cell)
    assert tracked.success
    assert ip.rec.items[0][1]["text/plain"] == repr(bare)


def test_the_same_cell_line_is_parsed_once_and_a_bad_one_refused_every_time() -> None:
    from IPython.core.error import UsageError

    from memlab.magic.args import parse_cell_line

    assert parse_cell_line("-q -b my label") is parse_cell_line("-q -b my label")
    assert parse_cell_line("-q -b my label").label == "my label"
    for _ in range(2):
        with pytest.raises(UsageError):
            parse_cell_line("-o 1bad")


@pytest.mark.parametrize(
    "line, option, values",
    [
        ("-d cpu -d meta", "-d", "'cpu', then 'meta'"),
        ("--device cpu -d meta", "-d", "'cpu', then 'meta'"),
        ("-o first -o second", "-o", "'first', then 'second'"),
        ("-l one -l two", "-l", "'one', then 'two'"),
        ("--gpu T4 --gpu=24GiB", "--gpu", "'T4', then '24GiB'"),
    ],
)
def test_an_option_given_twice_is_refused_naming_both_values(
    ip: Any, line: str, option: str, values: str
) -> None:
    """Where argparse keeps the last value without a word (``-d cpu -d cuda`` measured the GPU
    while the user read "cpu" first), the magic says which option came twice and with what;
    the cell does not run. A flag given twice (-q -q) means what it means once."""
    result = ip.run_cell(f"%%gpumem {line}\nran = True")
    err = result.error_in_exec
    assert err is not None and type(err).__name__ == "UsageError"
    assert f"{option} given twice ({values}): give it once" in str(err), str(err)
    assert "ran" not in ip.user_ns
    assert ip.run_cell("%%gpumem -q -q -d cpu\nran = True").success and ip.user_ns["ran"]
