"""``%gpumem_auto``: a region around every cell, opened by IPython's pre_run_cell and closed by
the matching post_run_cell, with a one-line summary.

Cells nest: a cell may run another (``get_ipython().run_cell``, ``%rerun``), and the inner
cell's hooks fire inside the outer cell's. One run without a place in the history (``%%capture``
runs its body so) is part of the cell around it: that cell's region measures it, and it has no
summary of its own (which ``%%capture`` would take into what it captured). The open regions
are therefore a stack, each tied to the cell (IPython's ``ExecutionInfo``, which post_run_cell
gets back on its result) whose pre_run_cell opened it. A post_run_cell closes its own cell's
region, and any region above it whose post_run_cell never came; one for a cell memlab opened
nothing for (an empty cell, a ``%%gpumem`` cell) closes nothing. ``off``, and unloading the
extension, close every region still open: none outlives automatic tracking.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from html import escape
from typing import Any

from IPython.display import display

from memlab.magic.args import Options
from memlab.magic.tracebacks import chained_to, show_without_memlab
from memlab.reports.report import MemoryReport
from memlab.reports.units import fmt_bytes, fmt_seconds


def cell_number(shell: Any) -> int:
    """The number of the cell running now. IPython 9 increments execution_count before it runs a
    cell, older versions after; its displayhook's prompt_count is right in both."""
    return int(getattr(shell.displayhook, "prompt_count", shell.execution_count))


def one_line(r: MemoryReport, cell: int | None = None) -> str:
    where = f"[{cell}] " if cell is not None else ""
    return (
        f"memlab {where}{r.device}: allocated {fmt_bytes(r.allocated_before)} → "
        f"{fmt_bytes(r.allocated_after)} ({fmt_bytes(r.allocated_delta, signed=True)}), "
        f"peak {fmt_bytes(r.peak_delta, signed=True)} over before, {fmt_seconds(r.seconds)}"
        + (
            f" · {'interrupted' if r.raised == 'KeyboardInterrupt' else 'raised ' + r.raised}"
            if r.raised
            else ""
        )
    )


class AutoTracking:
    """What ``%gpumem_auto on`` installed, and the regions it holds open.

    ``region(opts)`` makes a cell's `memlab.track`; ``history.add(cell, report)`` keeps each
    summary. ``pre`` and ``post`` are called by the magics' own event callbacks."""

    def __init__(self, shell: Any, region: Callable[[Options], Any], history: Any) -> None:
        self.sh = shell
        self._region = region
        self._history = history
        self.opts: Options | None = None
        #: What followed ``on`` (so that ``%reload_ext memlab`` can turn it on again).
        self.line: str | None = None
        self._custom_exc: Any = None
        #: (the cell's ExecutionInfo, its open region), innermost last.
        self._open: list[tuple[Any, Any]] = []

    def on(self, opts: Options, line: str, hooks: tuple[Any, Any]) -> None:
        """Track every cell from now on with ``opts``; ``hooks``: the (pre, post) callbacks."""
        self._region(opts)  # validate the device now, not at the next cell
        self.off(hooks)
        self.opts, self.line = opts, line
        self.sh.events.register("pre_run_cell", hooks[0])
        self.sh.events.register("post_run_cell", hooks[1])
        # an error in a tracked cell reaches IPython through memlab's dispatch mode: shown
        # without memlab's frames, as under %%gpumem (the user's own handler, if any, still
        # handles what it handled, given the traceback without them)
        before = (self.sh.custom_exceptions, getattr(self.sh, "CustomTB", None))
        types = tuple(before[0] or ())
        handler = chained_to(types, before[1]) if types else show_without_memlab
        caught = tuple(dict.fromkeys((Exception, KeyboardInterrupt, *types)))
        self.sh.set_custom_exc(caught, handler)
        self._custom_exc = (self.sh.CustomTB, before)

    def off(self, hooks: tuple[Any, Any]) -> None:
        """Removes what ``on`` installed and closes every region still open (no summaries)."""
        for name, cb in zip(("pre_run_cell", "post_run_cell"), hooks, strict=True):
            with contextlib.suppress(ValueError):
                self.sh.events.unregister(name, cb)
        if self._custom_exc is not None:
            mine, (exceptions, handler) = self._custom_exc
            if getattr(self.sh, "CustomTB", None) is mine:  # nobody replaced it since
                self.sh.custom_exceptions, self.sh.CustomTB = exceptions, handler
        self._custom_exc = None
        self._close(self._open, None)
        self._open = []
        self.opts, self.line = None, None

    def pre(self, info: Any) -> None:
        raw = (getattr(info, "raw_cell", "") or "").lstrip()
        if self.opts is None or raw.startswith(("%%gpumem", "%gpumem_auto")):
            return
        if self._open and not getattr(info, "store_history", True):
            return  # run inside a tracked cell (%%capture's body): the cell's region has it
        region = self._region(self.opts)
        try:
            region.__enter__()
        except Exception as e:  # memlab's own failure never stops the user's cell
            print(f"memlab: this cell is not tracked: {e}.")
            return
        self._open.append((info, region))

    def post(self, result: Any) -> None:
        region = self._closing(result)
        if region is None:
            return
        err = getattr(result, "error_in_exec", None)
        self._close([(None, region)], type(err) if err is not None else None)
        try:
            r = region.report
        except RuntimeError as e:  # memlab's own failure: no report
            print(f"memlab: no report for this cell: {e.__cause__ or e}.")
            return
        self._history.add(cell_number(self.sh), r)
        text = one_line(r, cell_number(self.sh))
        html = f'<div style="font-size:11px;color:#555">{escape(text)}</div>'
        display({"text/plain": text, "text/html": html}, raw=True)

    def _closing(self, result: Any) -> Any:
        """The region of the cell ``result`` ends, taken off the stack, or None. Regions above
        it (cells whose post_run_cell never came) are closed here, without a summary."""
        info = getattr(result, "info", None)
        at = [i for i, (cell, _) in enumerate(self._open) if cell is info and info is not None]
        if at:
            i = at[-1]
        elif result is None and self._open:  # IPython ran no cell to its end: the innermost
            i = len(self._open) - 1
        else:
            return None
        region = self._open[i][1]
        self._close(self._open[i + 1 :], None)
        del self._open[i:]
        return region

    @staticmethod
    def _close(entries: list[tuple[Any, Any]], err: type[BaseException] | None) -> None:
        """Exits ``entries``' regions, innermost first; memlab's own failure is not raised."""
        for _, region in reversed(entries):
            with contextlib.suppress(Exception):
                region.__exit__(err, None, None)
