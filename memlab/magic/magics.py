"""The magics: parse, run under ``memlab.track``, display. No measurement logic here."""

from __future__ import annotations

import contextlib
import sys
from html import escape
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.display import Image, display

from memlab.core.devices import DeviceError
from memlab.core.ledger import default_ledger
from memlab.magic.args import (
    HELP,
    Options,
    parse_auto_line,
    parse_cell_line,
    parse_statement_line,
    variable_name,
)
from memlab.magic.cell import NO_VALUE, compile_cell, execute, has_value, measured
from memlab.magic.history import History
from memlab.magic.namespace import NamespaceWatch
from memlab.magic.oom import OOMHooks, release
from memlab.magic.tracebacks import show_without_memlab, without_memlab
from memlab.region import track
from memlab.reports.plot import png
from memlab.reports.report import MemoryReport, Reports
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


@magics_class
class GpumemMagics(Magics):
    def __init__(self, shell: Any, preflight: Any = None, after_oom: Any = None) -> None:
        super().__init__(shell)
        self._oom = OOMHooks(preflight, after_oom)
        self.sh: Any = shell  # never None once registered
        # kept on the shell, so that %reload_ext memlab keeps the kernel's history
        self.history: History = getattr(shell, "_memlab_history", None) or History()
        shell._memlab_history = self.history
        self._auto: Options | None = None
        self._auto_region: track | None = None
        self._custom_exc: Any = None
        self._watch: NamespaceWatch | None = None

    # -- %%gpumem / %gpumem ---------------------------------------------------------------------
    @line_cell_magic
    def gpumem(self, line: str, cell: str | None = None) -> Any:
        __tracebackhide__ = True
        if cell is None:
            opts, source = parse_statement_line(line)
            header = None
        else:
            opts, source = parse_cell_line(line), cell
            header = f"%%gpumem {line}".rstrip()  # line 1 of the visible cell
        region = self._region(opts)
        flight = self._oom.flight(opts.gpu, self.sh)
        try:
            body, expr, quiet = compile_cell(self.sh, source, header)
        except SyntaxError as e:
            e.with_traceback(None)  # the cell's line is in the error itself: no memlab frames
            raise
        if flight is not None:
            flight.start(body.co_filename)
        try:
            with measured(region):
                value = execute(self.sh, body, expr)
                if cell is not None and quiet:
                    # a hidden value is dropped in the cell, as IPython drops it: it must not
                    # count as still allocated at the cell's end
                    value = NO_VALUE
        except BaseException as e:
            self._oom.land(flight, opts, self.sh, e, region.lost)
            self._oom.explain(e, region.targets[0].name, self.sh, opts.quiet)
            self._publish(region, opts)
            without_memlab(e)
            release(e)
            raise
        self._oom.land(flight, opts, self.sh, lost=region.lost)
        if cell is None:  # the line form returns its value, like %time
            self._publish(region, opts)
            return value if has_value(value) and not quiet else None
        if has_value(value) and not quiet:
            sys.displayhook(value)  # Out[n] first, then the report (%%capture swaps it)
        self._publish(region, opts)
        return None

    def _region(self, opts: Options) -> track:
        ns, ledger = self.sh.user_ns, default_ledger()
        # what the watch handed out is in this ledger: a new namespace or ledger starts afresh
        if self._watch is None or self._watch.ns is not ns or self._watch.ledger is not ledger:
            self._watch = NamespaceWatch(ns, self.sh.user_ns_hidden, ledger)
        try:
            return track(
                "cpu" if opts.gpu else opts.device,  # pre-flight: tracked on the CPU
                breakdown=opts.breakdown or opts.gpu is not None,  # the roles explain an OOM
                timeline=opts.timeline,
                reset_peak=opts.reset,
                driver=opts.driver,
                label=opts.label,
                # scanned only when the region runs tensor accounting (CPU, or a breakdown),
                # and then only what changed since the last scan
                watch=self._watch,
                ledger=ledger,
            )
        except DeviceError as e:
            raise UsageError(f"%gpumem -d: {e}") from None

    def _publish(self, region: track, opts: Options) -> None:
        try:
            reports = region.reports
        except RuntimeError as e:
            print(f"memlab: no report for this cell: {e.__cause__ or e}.")
            return
        for r in reports:
            self.history.add(cell_number(self.sh), r)
        result: MemoryReport | Reports = reports[0] if len(reports) == 1 else reports
        if opts.out and not opts.gpu:  # with --gpu, -o keeps the pre-flight
            self.sh.user_ns[opts.out] = result
        if opts.quiet:
            return
        display(result)
        if opts.timeline:
            for r in reports:
                if r.timeline is not None and len(r.timeline):
                    display(_png(r.plot()))

    # -- %gpumem_history ------------------------------------------------------------------------
    @line_magic
    def gpumem_history(self, line: str) -> None:
        """Show every tracked cell of this kernel: a table and a plot.

        %gpumem_history            table and plot
        %gpumem_history --no-plot  table only
        %gpumem_history --clear    forget the history
        %gpumem_history -o NAME    also store the history object in NAME
        """
        args = line.split()
        out = None
        if "-o" in args:
            i = args.index("-o")
            if i + 1 >= len(args):
                raise UsageError("%gpumem_history: -o needs a variable name.")
            out = variable_name(args.pop(i + 1), "%gpumem_history")
            args.remove("-o")
        unknown = set(args) - {"--clear", "--no-plot"}
        if unknown:
            raise UsageError(
                f"%gpumem_history: unknown option {sorted(unknown)[0]!r}; "
                "use --clear, --no-plot or -o NAME."
            )
        if "--clear" in args:
            n = len(self.history)
            self.history.clear()
            print(f"memlab: history cleared ({n} entries).")
            return
        if out:
            self.sh.user_ns[out] = self.history
        display(self.history)
        if "--no-plot" not in args and len(self.history):
            display(_png(self.history.plot()))

    # -- %gpumem_leaks --------------------------------------------------------------------------
    @line_magic
    def gpumem_leaks(self, line: str) -> None:
        """Find variables that keep autograd graphs (and their saved tensors) alive.

        %gpumem_leaks            show them, with the bytes each keeps alive and the fix
        %gpumem_leaks -o NAME    also store the report in NAME
        """
        from memlab.graphs.retained import find_retained

        args = line.split()
        out = None
        if args[:1] == ["-o"] and len(args) == 2:
            out = variable_name(args[1], "%gpumem_leaks")
        elif args:
            raise UsageError("%gpumem_leaks takes no arguments but -o NAME.")
        report = find_retained(self.sh.user_ns, skip=self.sh.user_ns_hidden)
        if out:
            self.sh.user_ns[out] = report
        display(report)

    # -- %gpumem_auto ---------------------------------------------------------------------------
    @line_magic
    def gpumem_auto(self, line: str) -> None:
        """Track every cell with a one-line summary: %gpumem_auto on [-d DEVICE] [-b] | off."""
        words = line.split(maxsplit=1)
        if not words:
            state = "on" if self._auto else "off"
            print(f"memlab: automatic tracking is {state}. Use %gpumem_auto on|off.")
            return
        opts = parse_auto_line(words[0], words[1] if len(words) > 1 else "")
        if opts is None:
            self.auto_off()
            return
        self._region(opts)  # validate the device now, not at the next cell
        self.auto_off()
        self._auto = opts
        self.sh.events.register("pre_run_cell", self._pre_cell)
        self.sh.events.register("post_run_cell", self._post_cell)
        if not self.sh.custom_exceptions:  # the user's own handler, if any, stays
            # an error in a tracked cell reaches IPython through memlab's dispatch mode:
            # shown without memlab's frames, as under %%gpumem
            before = (self.sh.custom_exceptions, getattr(self.sh, "CustomTB", None))
            self.sh.set_custom_exc((Exception, KeyboardInterrupt), show_without_memlab)
            self._custom_exc = (self.sh.CustomTB, before)
        print("memlab: tracking every cell (%gpumem_auto off to stop).")

    def auto_off(self) -> None:
        if self._auto is None:
            return
        for name, cb in (("pre_run_cell", self._pre_cell), ("post_run_cell", self._post_cell)):
            with contextlib.suppress(ValueError):
                self.sh.events.unregister(name, cb)
        if self._custom_exc is not None:
            mine, (exceptions, handler) = self._custom_exc
            if getattr(self.sh, "CustomTB", None) is mine:  # nobody replaced it since
                self.sh.custom_exceptions, self.sh.CustomTB = exceptions, handler
        self._custom_exc = None
        self._close_auto(None)
        self._auto = None

    def _pre_cell(self, info: Any) -> None:
        raw = (getattr(info, "raw_cell", "") or "").lstrip()
        if self._auto is None or raw.startswith(("%%gpumem", "%gpumem_auto")):
            return
        region = self._region(self._auto)
        try:
            region.__enter__()
        except Exception as e:  # memlab's own failure never stops the user's cell
            print(f"memlab: this cell is not tracked: {e}.")
            return
        self._auto_region = region

    def _post_cell(self, result: Any) -> None:
        err = getattr(result, "error_in_exec", None)
        region = self._close_auto(type(err) if err is not None else None)
        if region is None:
            return
        try:
            r = region.report
        except RuntimeError as e:
            print(f"memlab: no report for this cell: {e.__cause__ or e}.")
            return
        self.history.add(cell_number(self.sh), r)
        text = one_line(r, cell_number(self.sh))
        display(
            {
                "text/plain": text,
                "text/html": f'<div style="font-size:11px;color:#555">{escape(text)}</div>',
            },
            raw=True,
        )

    def _close_auto(self, err: type[BaseException] | None) -> track | None:
        region, self._auto_region = self._auto_region, None
        if region is not None:  # memlab's own failure: no report (said by _post_cell)
            with contextlib.suppress(Exception):
                region.__exit__(err, None, None)
        return region

    gpumem.__doc__ = HELP


def _png(fig: Any) -> Image:
    return Image(data=png(fig), format="png")
