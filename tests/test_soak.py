"""A soak: 1,000 tracked cells in a real kernel, as a long notebook session runs them.

A third are ``%%gpumem -d cpu`` cells, a third ``%%gpumem -b`` cells with a module's forward,
backward and an optimizer step (so that every hook memlab installs goes in and comes out), and
a third plain cells tracked by ``%gpumem_auto on``; each creates and frees a few tensors. Between
cell 100 and cell 1,000 memlab's own memory (what tracemalloc traces to memlab's files, in the
kernel) may grow only by its history, which grows by design (one small entry per cell): the
growth is measured with the history and again after ``%gpumem_history --clear``. After
``%unload_ext memlab`` nothing of memlab's is left installed. The figures are printed and kept as
test properties (``--junitxml``).
"""

from __future__ import annotations

import ast
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kernel_harness import Kernel

pytestmark = pytest.mark.slow

CELLS = 1000
MEASURE_FROM = 100
#: memlab's own growth over 900 cells, history cleared: about 8 KiB is measured (first-use caches),
#: and a leak of 73 B a cell (less than one small object) would exceed this
MAX_GROWTH = 64 * 1024
#: what one history entry may cost ("a few hundred bytes each", memlab/magic/history.py)
MAX_PER_ENTRY = 1024

SETUP = r"""
import gc, os, time, tracemalloc
import psutil, torch, memlab
from torch import nn

lin = nn.Linear(32, 32)
opt = torch.optim.SGD(lin.parameters(), lr=0.01)
_MEMLAB = os.path.dirname(memlab.__file__) + os.sep + "*"


def _soak_memlab_bytes():
    "What memlab's own code allocated and still holds (since tracemalloc started)."
    gc.collect()  # also empties the free lists, whose blocks tracemalloc counts as still held
    keep = [tracemalloc.Filter(True, _MEMLAB)]
    snap = tracemalloc.take_snapshot().filter_traces(keep)
    return sum(s.size for s in snap.statistics("filename"))


def _soak_rss():
    return psutil.Process().memory_info().rss


def _soak_installed():
    "Everything memlab could leave behind, counted."
    from torch.nn.modules import module as m
    from torch.optim import optimizer as o

    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    callbacks = [
        (event, repr(cb))
        for event, cbs in get_ipython().events.callbacks.items()
        for cb in cbs
        if "memlab" in (getattr(cb, "__module__", None) or repr(cb))
    ]
    from memlab.core import native

    lib = native._lib
    probe = torch.ones(8)
    return {
        "CPU allocator wrapper": 0 if lib is None else lib.mn_follows(probe.data_ptr()),
        # PyTorch's own dispatch table: a fallback of memlab's at any key (the native record's;
        # the inert fallthrough it leaves at its key, for threads that still have it, is not)
        "dispatch-key fallbacks": sum(
            "memlab" in line and "fallthrough" not in line
            for line in torch._C._dispatch_dump_table("aten::add.Tensor").splitlines()
        ),
        "dispatch modes": int(torch._C._len_torch_dispatch_stack()),
        "saved-tensor hooks": 0 if top is None else int(top(False) is not None),
        "module forward pre-hooks": len(m._global_forward_pre_hooks),
        "module forward hooks": len(m._global_forward_hooks),
        "module backward hooks": len(m._global_backward_hooks)
        + len(getattr(m, "_global_backward_pre_hooks", {})),
        "optimizer pre-hooks": len(o._global_optimizer_pre_hooks),
        "optimizer post-hooks": len(o._global_optimizer_post_hooks),
        "memlab IPython callbacks": callbacks,
        "memlab magics": sorted(
            name
            for kind in ("line", "cell")
            for name in get_ipython().magics_manager.magics[kind]
            if name.startswith("gpumem")
        ),
    }
"""

NOTHING = {
    "CPU allocator wrapper": 0,
    "dispatch-key fallbacks": 0,
    "dispatch modes": 0,
    "saved-tensor hooks": 0,
    "module forward pre-hooks": 0,
    "module forward hooks": 0,
    "module backward hooks": 0,
    "optimizer pre-hooks": 0,
    "optimizer post-hooks": 0,
    "memlab IPython callbacks": [],
    "memlab magics": [],
}

CPU = "x = torch.randn(64, 64)\ny = x @ x\ndel x, y"
STEP = (
    "out = lin(torch.randn(8, 32)).relu().sum()\nout.backward()\nopt.step()\nopt.zero_grad()\n"
    "del out"
)
PLAIN = "a = torch.ones(256) * 3\nb = a.sum()\ndel a, b"
#: The three kinds of tracked cell, in turn: (name, cell)
KINDS = [
    ("%%gpumem -d cpu", f"%%gpumem -d cpu -o last_cpu\n{CPU}"),
    ("%%gpumem -b", f"%%gpumem -b -d cpu\n{STEP}"),
    ("%gpumem_auto", PLAIN),
]


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    k = Kernel(str(tmp_path_factory.mktemp("ipython")), setup=SETUP)
    yield k
    k.shutdown()


def _value(kernel: Kernel, expr: str) -> Any:
    return ast.literal_eval(kernel.value(expr))


def test_a_thousand_tracked_cells(
    kernel: Kernel, record_property: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # the same cells without memlab: what a cell costs here anyway
    plain_times: list[float] = []
    for i in range(99):
        t0 = time.perf_counter()
        out = kernel.run([CPU, STEP, PLAIN][i % 3])
        if i >= 9:
            plain_times.append(time.perf_counter() - t0)
        assert out.status == "ok", out.describe()

    for cell in ("%load_ext memlab", "%gpumem_auto on -d cpu"):
        out = kernel.run(cell)
        assert out.status == "ok", out.describe()
    times: dict[str, list[float]] = {name: [] for name, _ in KINDS}
    traced = 0.0
    for i in range(CELLS):
        if i == MEASURE_FROM:
            start = (
                "tracemalloc.start(1)\nm0, rss0, a0 = _soak_memlab_bytes(), _soak_rss(), last_cpu"
            )
            out = kernel.run(start)
            assert out.status == "ok", out.describe()
        name, cell = KINDS[i % 3]
        t0 = time.perf_counter()
        out = kernel.run(cell)
        if i >= MEASURE_FROM:
            traced += time.perf_counter() - t0
        elif i >= 10:  # per-cell times: warmed up, and before tracemalloc slows the kernel
            times[name].append(time.perf_counter() - t0)
        assert out.status == "ok", f"cell {i}: {out.describe()}"
        assert out.reports, f"cell {i} showed no report: {out.describe()}"

    # memlab's growth: with its history, and with the history cleared
    out = kernel.run(
        "%gpumem_history --no-plot -o soak_history\n"
        "m1, rss1, a1, entries = _soak_memlab_bytes(), _soak_rss(), last_cpu, len(soak_history)"
    )
    assert out.status == "ok", out.describe()
    t0 = time.perf_counter()
    shown = kernel.run("%gpumem_history")
    history_seconds = time.perf_counter() - t0
    assert shown.status == "ok", shown.describe()
    out = kernel.run("%gpumem_history --clear\nm2 = _soak_memlab_bytes()\ntracemalloc.stop()")
    assert out.status == "ok", out.describe()
    m0, m1, m2, entries = _value(kernel, "(m0, m1, m2, entries)")
    rss0, rss1 = _value(kernel, "(rss0, rss1)")
    books = _value(
        kernel,
        "(a0.allocated_before, a0.allocated_after, a1.allocated_before, a1.allocated_after)",
    )
    growth, without_history = m1 - m0, m2 - m0
    per_entry = (m1 - m2) / max(entries, 1)

    # after %unload_ext, nothing of memlab's is left
    unload = kernel.run("%unload_ext memlab")
    assert unload.status == "ok", unload.describe()
    left = _value(kernel, "_soak_installed()")
    after = kernel.run(PLAIN + "\ntorch.ones(3).sum()")
    magic = kernel.run("%%gpumem -d cpu\n1")

    n = CELLS - MEASURE_FROM
    figures = {
        "cells": CELLS,
        "memlab growth, cells 100-1000, with history (B)": growth,
        "memlab growth, cells 100-1000, history cleared (B)": without_history,
        "history entries": entries,
        "bytes per history entry": round(per_entry),
        "kernel RSS growth, cells 100-1000 (B)": rss1 - rss0,
        "the same cells without memlab (ms a cell)": round(
            1000 * sum(plain_times) / len(plain_times), 2
        ),
        **{
            f"{name} cell (ms a cell)": round(1000 * sum(ts) / len(ts), 2)
            for name, ts in times.items()
        },
        "cells 100-1000 in all, under tracemalloc (s)": round(traced, 1),
        f"%gpumem_history of {entries} cells (s)": round(history_seconds, 2),
    }
    for key, v in figures.items():
        record_property(key, v)
    with capsys.disabled():
        print(f"\nmemlab soak over {n} tracked cells (after {MEASURE_FROM} to warm up):")
        for key, v in figures.items():
            print(f"  {key}: {v:,}" if isinstance(v, int) else f"  {key}: {v}")

    assert without_history <= MAX_GROWTH, f"memlab grew by {without_history:,} B over {n} cells"
    assert per_entry <= MAX_PER_ENTRY, f"{per_entry:.0f} B per history entry"
    assert entries >= n, f"the history holds {entries} entries for {n} tracked cells"
    assert books[0] == books[2] and books[1] == books[3], f"the figures drifted: {books}"
    assert left == NOTHING, f"left after %unload_ext memlab: {left}"
    assert after.status == "ok" and after.value == "tensor(3.)", after.describe()
    assert not after.reports, f"a cell was still tracked after the unload: {after.describe()}"
    assert magic.ename == "UsageError" and "gpumem" in (magic.evalue or ""), magic.describe()
    assert kernel.alive()
