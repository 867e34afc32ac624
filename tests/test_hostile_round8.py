"""Hostile inputs, round 8 (found by a review that drove a real kernel): ``-o NAME`` where the
cell binds NAME itself, a timeline plot matplotlib cannot draw, a cell that clears its own
namespace before its value is shown, a watch that never ends, a plot given something that is
not an Axes."""

from __future__ import annotations

import os
import traceback
from typing import Any

import pytest
import torch
from conftest import run

import memlab
from memlab.region import args as region_args

#: memlab's own files (a checkout's path may hold "memlab" elsewhere too).
MEMLAB_DIR = os.path.dirname(memlab.__file__) + os.sep


def _memlab_lines(e: BaseException) -> list[str]:
    """The frames of ``e``'s traceback in memlab's own files."""
    frames = traceback.extract_tb(e.__traceback__)
    return [f.filename for f in frames if f.filename.startswith(MEMLAB_DIR)]


@pytest.mark.parametrize(
    "cell",
    [
        "%%gpumem -q -o model\nmodel = torch.nn.Linear(3, 3)",
        "%%gpumem -q -o np\nimport numpy as np",
        "%%gpumem -q -o f\ndef f():\n    return 1",
        "%gpumem -q -o model model = torch.nn.Linear(3, 3)",
    ],
    ids=["module", "import", "def", "line-form"],
)
def test_a_name_the_cell_binds_itself_keeps_the_cells_value(
    ip: Any, cell: str, capsys: pytest.CaptureFixture[str]
) -> None:
    name = cell.split("-o ")[1].split()[0]
    ip.user_ns.pop(name, None)
    result = run(ip, cell)
    assert result.success
    assert type(ip.user_ns[name]).__name__ != "MemoryReport"
    assert f"-o {name}: the cell bound {name!r} itself" in capsys.readouterr().out
    # a name the cell leaves alone still gets the report, replacing an earlier one
    run(ip, "%%gpumem -q -o _r8\nz = torch.ones(3)")
    first = ip.user_ns["_r8"]
    run(ip, "%%gpumem -q -o _r8\nz = torch.ones(4)")
    assert type(ip.user_ns["_r8"]).__name__ == "MemoryReport" and ip.user_ns["_r8"] is not first
    ip.user_ns.pop(name, None)


def test_a_timeline_plot_matplotlib_cannot_draw_leaves_the_cell_ok(
    ip: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from memlab.reports import report

    def broken(self: Any, ax: Any = None) -> Any:
        raise RuntimeError("Failed to process string with tex because latex could not be found")

    monkeypatch.setattr(report.MemoryReport, "plot", broken)
    result = run(ip, "%%gpumem -t\nq = torch.ones(3000)\nr = q * 2\nr.sum()")
    assert result.success and float(result.result) == 6000.0
    said = capsys.readouterr().out
    assert "no timeline plot for this cell" in said and "latex could not be found" in said
    from memlab.magic import history

    monkeypatch.setattr(history.History, "plot", lambda self: broken(self))
    result = run(ip, "%gpumem_history")
    assert result.success
    assert "no plot of the history" in capsys.readouterr().out


def test_a_cell_that_clears_its_namespace_raises_ipythons_error_without_memlabs_frames(
    ip: Any,
) -> None:
    saved = dict(ip.user_ns)
    try:
        result = run(ip, "%%gpumem -q\nglobals().clear()\n1")
        assert isinstance(result.error_in_exec, KeyError)
        assert _memlab_lines(result.error_in_exec) == []
    finally:
        ip.user_ns.update(saved)


def test_a_watch_that_never_ends_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(region_args, "MAX_OBJECTS", 1000)

    def endless() -> Any:
        while True:
            yield torch.ones(1)

    with pytest.raises(ValueError, match="watch gave more than 1,000 objects"):
        memlab.track("cpu", watch=endless())
    region = memlab.track("cpu", watch=lambda: endless())
    with pytest.raises(ValueError, match="watch function gave more than 1,000 objects"):
        region.__enter__()
    kept = [torch.ones(2) for _ in range(10)]
    with memlab.track("cpu", watch=(t for t in kept), breakdown=True) as t:  # a finite one
        y = kept[0] * 2
    assert t.report.allocated_after >= y.nbytes


def test_a_plot_given_something_that_is_no_axes_names_the_argument() -> None:
    with memlab.track("cpu", timeline=True) as t:
        x = torch.ones(100)
    del x
    with pytest.raises(TypeError, match="plot: ax is int: pass a matplotlib Axes") as e:
        t.report.plot(ax=5)
    assert _memlab_lines(e.value) == []


def test_auto_mode_keeps_memlabs_frames_out_beside_the_users_own_exception_handler(
    ip: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user's handler for KeyError was installed first: under the dispatch mode a tracked
    cell's error passes memlab's frames; neither the handler's KeyError nor another error
    shows them, the handler still handles its own, and `off` puts it back as it was."""
    monkeypatch.setenv("MEMLAB_NATIVE", "0")  # (the dispatch mode: its frames are in the way)
    seen: list[list[str]] = []

    def theirs(shell: Any, etype: Any, value: Any, tb: Any, tb_offset: Any = None) -> Any:
        seen.append(traceback.format_exception(etype, value, tb))
        return ["handled by the user's handler"]

    ip.set_custom_exc((KeyError,), theirs)
    users = ip.CustomTB
    try:
        run(ip, "%gpumem_auto on -d cpu")
        capsys.readouterr()
        run(ip, "torch.ones(3) @ torch.ones(4)")
        shown = capsys.readouterr()
        text = shown.out + shown.err
        assert "RuntimeError" in text and f"{os.sep}memlab{os.sep}" not in text
        run(ip, "def lookup(t):\n    return {}[t.sum().item()]\nlookup(torch.ones(2) * 2)")
        assert len(seen) == 1 and "KeyError" in seen[0][-1]
        assert not any(f"{os.sep}memlab{os.sep}" in line for line in seen[0])
        run(ip, "%gpumem_auto off")
        assert ip.CustomTB is users and ip.custom_exceptions == (KeyError,)
    finally:
        run(ip, "%gpumem_auto off")
        ip.set_custom_exc((), None)


SELF_CHECK = """
import torch, memlab
from torch.overrides import TorchFunctionMode
from memlab.core import native

seen, calls = [], []

def pack(t):
    seen.append(tuple(t.shape))
    if tuple(t.shape) in ((4, 16), (4, 8)):
        raise RuntimeError("my pack hook refuses " + str(tuple(t.shape)))
    return t

class Count(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))

w = torch.ones(3, 5, requires_grad=True)
torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t).__enter__()
Count().__enter__()
with memlab.track("cpu", breakdown=True) as t:
    (w * 2).sum().backward()
print("UNAVAILABLE", native.unavailable())
print("SEEN", sorted(set(seen)))
print("LINSPACE", "linspace" in calls)
"""


def test_the_native_records_self_check_never_meets_the_programs_hooks_or_modes() -> None:
    """The program's saved-tensor hooks (which refuse memlab's check's tensors) and its
    function mode are in force at the first breakdown: the check runs apart from them, the
    record stays on, and neither sees the check's work."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", SELF_CHECK], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "UNAVAILABLE None" in out, out
    assert "(4, 16)" not in out and "(4, 8)" not in out
    assert "LINSPACE False" in out


def test_control_characters_in_a_label_are_written_as_escapes_in_the_text(ip: Any) -> None:
    """A label with a NUL and an ANSI escape: the plain-text report and history write them as
    escapes (a terminal would act on them); the label itself is kept as given."""
    label = "b\x00c\x1b[2J<script>"
    ip.user_ns["lab"] = label
    run(ip, "%%gpumem -q -l $lab -o _r8c\nz = torch.ones(3)")
    report = ip.user_ns["_r8c"]
    assert report.label == label
    for text in (str(report), str(ip.user_ns["_r8c"]), repr(report)):
        assert "\x00" not in text and "\x1b" not in text
    assert "\\x1b[2J" in str(report)
    run(ip, "%gpumem_history -o _h8 --no-plot")
    history = str(ip.user_ns["_h8"])
    assert "\x1b" not in history and "\\x00" in history


def test_a_label_of_several_words_after_l_says_how_to_give_it(ip: Any) -> None:
    from IPython.core.error import UsageError

    from memlab.magic.args import parse_cell_line

    with pytest.raises(UsageError, match="-l takes one word; 'words' came after -l two"):
        parse_cell_line("-q -l two words")
    assert parse_cell_line("-q -l 'two words'").label == "two words"
    assert parse_cell_line("-q two words").label == "two words"


@pytest.mark.parametrize("collector", ["on", "off"])
def test_many_survivors_are_counted_and_the_collector_is_left_as_it_was(collector: str) -> None:
    """20,000 small tensors made in a region and kept: each counted to the byte, and Python's
    collector (held off while memlab registers them) is on or off after as it was before."""
    import gc

    from memlab.core.native import unavailable

    if unavailable() is not None:
        pytest.skip("no native record here")
    was = gc.isenabled()
    if collector == "off":
        gc.disable()
    try:
        with memlab.track("cpu") as t:
            kept = [torch.ones(1) for _ in range(20_000)]
        assert gc.isenabled() is (collector == "on")
        assert t.report.allocated_delta == sum(k.untyped_storage().nbytes() for k in kept)
    finally:
        if was:
            gc.enable()
