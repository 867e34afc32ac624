"""Hostile round 7, the magics: auto mode's regions when cells nest, a label holding line
breaks, memlab's modules removed from ``sys.modules``, ``-o`` onto a module, interleaved
regions' notes, and ``%reload_ext`` with auto mode on."""

from __future__ import annotations

import linecache
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from conftest import run

import memlab
from memlab.core.native import region as native_region

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def summaries(ip: Any) -> list[str]:
    """The one-line summaries auto mode displayed, in order."""
    return [
        d["text/plain"] for _, d in ip.rec.items if d.get("text/plain", "").startswith("memlab [")
    ]


# -- 1. auto mode: a region per cell, cells nested or not --------------------------------------


def test_a_cell_that_runs_a_cell_gets_its_own_summary_and_no_region_stays_open(ip: Any) -> None:
    assert run(ip, "%gpumem_auto on -d cpu").success
    ip.rec.clear()
    inner = 'get_ipython().run_cell("b = torch.ones(5)", store_history=True)'
    assert run(ip, f"{inner}\nc = torch.ones(8)").success
    b, c = (ip.user_ns[n].untyped_storage().nbytes() for n in ("b", "c"))
    inner_line, outer_line = summaries(ip)  # the inner cell's first, then the outer's
    assert f"(+{b} B)" in inner_line and f"(+{b + c} B)" in outer_line
    # one run without a place in the history (as %%capture runs its body) is the outer cell's
    ip.rec.clear()
    assert run(ip, 'get_ipython().run_cell("d = torch.ones(5)")\ne = torch.ones(8)').success
    d, e = (ip.user_ns[n].untyped_storage().nbytes() for n in ("d", "e"))
    (line,) = summaries(ip)
    assert f"(+{d + e} B)" in line
    run(ip, "%gpumem_auto off")
    assert native_region._OPEN == []


def test_a_post_run_cell_without_its_pre_run_cell_closes_nothing_of_another_cell(ip: Any) -> None:
    # an empty cell gets post_run_cell only: it must not end the outer cell's region early
    assert run(ip, "%gpumem_auto on -d cpu").success
    ip.rec.clear()
    assert run(ip, 'get_ipython().run_cell("")\nx = torch.ones(8)').success
    x = ip.user_ns["x"].untyped_storage().nbytes()
    (line,) = summaries(ip)
    assert f"(+{x} B)" in line
    run(ip, "%gpumem_auto off")


STOPS = ["run_line_magic('gpumem_auto', 'off')", "run_line_magic('unload_ext', 'memlab')"]


@pytest.mark.parametrize("stop", STOPS, ids=["off", "unload"])
def test_off_and_unload_inside_a_nested_cell_close_every_region_auto_mode_holds(
    ip: Any, stop: str
) -> None:
    assert run(ip, "%gpumem_auto on -d cpu").success
    try:
        cell = f'get_ipython().run_cell("get_ipython().{stop}")\nleft_open = len(_nr._OPEN)'
        ip.user_ns["_nr"] = native_region
        assert run(ip, cell).success
        assert ip.user_ns["left_open"] == 0 and native_region._OPEN == []
        assert torch._C._len_torch_dispatch_stack() == 0
    finally:
        if getattr(ip, "_memlab_magics", None) is None:
            ip.run_line_magic("load_ext", "memlab")


# -- 2. a label with line breaks stays a label ---------------------------------------------------

BREAKS = ["\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


def test_a_label_with_a_line_break_never_runs_as_code(ip: Any, capsys: Any) -> None:
    ip.user_ns["lab"] = "epoch 1\nprint('INJECTED')"
    capsys.readouterr()
    result = run(ip, "%%gpumem -d cpu {lab}\nx = 1\nx + 1")
    assert result.success and result.result == 2
    assert "INJECTED" not in capsys.readouterr().out


#: Labels with each line break of Python's tokenizer or of linecache, and what cannot be compiled.
LABELS = [f"a{brk}b = 2{brk}c = 3" for brk in BREAKS] + ["a\0b", "a\ud800b"]


@pytest.mark.parametrize("label", LABELS, ids=[ascii(label) for label in LABELS])
def test_a_label_with_any_line_break_keeps_the_cells_line_numbers(ip: Any, label: str) -> None:
    ip.user_ns["lab2"] = label
    result = run(ip, '%%gpumem -d cpu {lab2}\ny = 1\nraise ValueError("which line?")')
    err = result.error_in_exec
    assert isinstance(err, ValueError), repr(result.error_before_exec or err)
    tb, last = err.__traceback__, None
    while tb is not None:  # the cell's own frame: the last in a file of IPython's cells
        last = tb if tb.tb_frame.f_code.co_filename.startswith("<ipython-input") else last
        tb = tb.tb_next
    assert last is not None and last.tb_lineno == 3
    shown = linecache.getline(last.tb_frame.f_code.co_filename, 3)
    assert shown.strip() == 'raise ValueError("which line?")'
    assert "b" not in ip.user_ns and "c" not in ip.user_ns and ip.user_ns["y"] == 1


# -- 3. memlab's modules removed from sys.modules ------------------------------------------------


def test_the_magics_work_after_memlabs_modules_are_removed_from_sys_modules() -> None:
    # in a process of its own: the test's own process keeps one import of memlab
    script = textwrap.dedent(
        """
        import sys
        from IPython.core.interactiveshell import InteractiveShell
        sh = InteractiveShell.instance()
        def cell(src):
            r = sh.run_cell(src, store_history=True)
            assert r.success, repr(r.error_before_exec or r.error_in_exec)
            return r.result
        def drop():
            cell("for k in [k for k in sys.modules if k.startswith('memlab')]: del sys.modules[k]")
        cell("import torch, sys")
        cell("%load_ext memlab")
        drop()
        cell("%reload_ext memlab")  # memlab not in sys.modules: IPython does nothing
        cell("%%gpumem -b -d cpu -o r1\\nw = torch.ones(3)")
        w = sh.user_ns["w"].untyped_storage().nbytes()
        assert sh.user_ns["r1"].allocated_delta == w, sh.user_ns["r1"].allocated_delta
        cell("%gpumem_auto on -d cpu")
        drop()
        n = len(sh._memlab_magics.history)
        cell("u = torch.ones(5)")
        entries = sh._memlab_magics.history.entries
        u = sh.user_ns["u"].untyped_storage().nbytes()
        assert len(entries) == n + 1 and entries[-1].after - entries[-1].before == u
        cell("%gpumem_auto off")
        import memlab.core.native.region as nr
        kind = type(sh._memlab_magics)
        assert nr._OPEN == [] and sys.modules[kind.__module__].GpumemMagics is kind
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (
        done.stdout[-2000:] + done.stderr[-2000:]
    )


# -- 4. -o onto a module ------------------------------------------------------------------------

HISTORY_LEAKS = ["%gpumem_history -o {name}", "%gpumem_leaks -o {name}"]


@pytest.mark.parametrize(
    "line",
    ["%%gpumem -d cpu -o {name}\n4", "%gpumem -o {name} 4", *HISTORY_LEAKS],
    ids=["cell", "line", "history", "leaks"],
)
@pytest.mark.parametrize("name", ["torch", "memlab", "np", "track"])
def test_o_never_replaces_a_module_or_memlabs_own_function(ip: Any, line: str, name: str) -> None:
    run(ip, "import memlab\nimport numpy as np\nfrom memlab import track")
    before = ip.user_ns[name]
    result = run(ip, line.format(name=name))
    err = result.error_in_exec
    assert type(err).__name__ == "UsageError", repr(err)
    assert f"-o {name}" in str(err) and "pick another name" in str(err)
    assert ("module" in str(err)) == (name != "track")
    assert ip.user_ns[name] is before


def test_o_still_replaces_a_users_variable_of_another_kind(ip: Any) -> None:
    run(ip, "r = 5\ndef f(): pass")
    assert run(ip, "%%gpumem -d cpu -q -o r\nx = torch.ones(4)").success
    assert isinstance(ip.user_ns["r"], memlab.MemoryReport)
    assert run(ip, "%gpumem_history -o f").success


# -- 5. interleaved regions ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
def test_interleaved_regions_never_report_memlabs_own_modes_as_the_codes(n: int) -> None:
    reports = []

    def gen() -> Any:
        with memlab.track("cpu") as t:
            yield torch.ones(10)
            yield torch.ones(20)
        reports.append(t.report)

    gens = [gen() for _ in range(n)]
    for _ in range(2):
        for g in gens:
            next(g)
    for g in gens:
        list(g)
    assert len(reports) == n
    for r in reports:
        assert not [note for note in r.notes if "dispatch mode" in note], r.notes
        assert r.peak_delta >= 80  # (torch.ones(20): 80 B, alive at each region's peak)
    assert torch._C._len_torch_dispatch_stack() == 0


# -- 6. %reload_ext keeps auto mode on ----------------------------------------------------------


def test_reload_ext_keeps_auto_mode_on_and_says_so(ip: Any, capsys: Any) -> None:
    assert run(ip, "%gpumem_auto on -d cpu").success
    capsys.readouterr()
    assert run(ip, "%reload_ext memlab").success
    assert "still tracking every cell" in capsys.readouterr().out
    ip.rec.clear()
    assert run(ip, "z = torch.ones(6)").success
    (line,) = summaries(ip)
    assert f"(+{ip.user_ns['z'].untyped_storage().nbytes()} B)" in line


def test_a_load_in_a_later_cell_than_the_unload_starts_with_auto_mode_off(ip: Any) -> None:
    assert run(ip, "%gpumem_auto on -d cpu").success
    assert run(ip, "%unload_ext memlab").success
    assert run(ip, "%load_ext memlab").success
    ip.rec.clear()
    assert run(ip, "z = torch.ones(6)").success
    assert summaries(ip) == []
