"""The magics: parse, run under ``memlab.track``, display. No measurement logic here."""

from __future__ import annotations

import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class, no_var_expand
from IPython.display import Image, display

from memlab.core import ledger as _ledger
from memlab.core.devices import DeviceError
from memlab.core.ledger import default_ledger
from memlab.magic.args import (
    HELP,
    Options,
    parse_auto_line,
    parse_cell_line,
    parse_statement_line,
)
from memlab.magic.auto import AutoTracking, cell_number, one_line
from memlab.magic.cell import NO_VALUE, compile_cell, execute, has_value, measured
from memlab.magic.expand import expand
from memlab.magic.history import History
from memlab.magic.namespace import MAX_FRESH, NamespaceWatch
from memlab.magic.oom import OOMHooks, release
from memlab.magic.out_name import bound, free_for, store, variable_name
from memlab.magic.tracebacks import without_memlab
from memlab.region import track
from memlab.reports.plot import png
from memlab.reports.report import MemoryReport, Reports

__all__ = ["GpumemMagics", "cell_number", "one_line"]

#: The modules these magics' objects come from, as imported with them.
_IMPORTED = (sys.modules[__name__], _ledger)


def reimported() -> bool:
    """Whether memlab's modules were removed from ``sys.modules`` since these magics were
    imported (some users clear their package's prefix to force a fresh import). memlab's lazy
    imports then load new classes, which the objects these magics hold are not instances of."""
    return any(sys.modules.get(m.__name__) is not m for m in _IMPORTED)


@magics_class
class GpumemMagics(Magics):
    def __init__(self, shell: Any, preflight: Any = None, after_oom: Any = None) -> None:
        super().__init__(shell)
        self._oom = OOMHooks(preflight, after_oom)
        self.sh: Any = shell  # never None once registered
        # kept on the shell, so that %reload_ext memlab keeps the kernel's history
        self.history: History = getattr(shell, "_memlab_history", None) or History()
        shell._memlab_history = self.history
        self.auto = AutoTracking(shell, self._region, self.history)
        self._watch: NamespaceWatch | None = None

    def _current(self) -> GpumemMagics:
        """These magics, or, once memlab was imported again (see `reimported`), the magics of
        the new import, which replace these (automatic tracking kept on): what the new
        modules' code is given is then always theirs."""
        if not reimported():
            return self
        import importlib

        importlib.import_module("memlab").load_ipython_extension(self.sh)
        return self.sh._memlab_magics  # type: ignore[no-any-return]

    def _again(self, magic: str, *args: Any) -> Any:
        """The magic ``magic`` of the new import's magics (see `_current`), called."""
        __tracebackhide__ = True
        return getattr(self._current(), magic)(*args)

    # -- %%gpumem / %gpumem ---------------------------------------------------------------------
    @no_var_expand  # (its copy of the namespace, at every cell: see memlab/magic/expand.py)
    @line_cell_magic
    def gpumem(self, line: str, cell: str | None = None) -> Any:
        __tracebackhide__ = True
        if reimported():
            return self._again("gpumem", line, cell)
        if cell is None:
            opts, source = parse_statement_line(line, lambda head: expand(self.sh, head))
            header = None
        else:
            opts, source = parse_cell_line(expand(self.sh, line)), cell
            header = f"%%gpumem {line}".rstrip()  # line 1 of the visible cell
        free_for(opts.out, self.sh.user_ns, "%gpumem")
        before = bound(opts.out, self.sh.user_ns)  # (a cell that binds it keeps its value)
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
            self._oom.land(flight, opts, self.sh, e, region.lost, before)
            self._oom.explain(e, region.targets[0].name, self.sh, opts.quiet)
            self._publish(region, opts, before)
            without_memlab(e)
            release(e)
            raise
        self._oom.land(flight, opts, self.sh, lost=region.lost, before=before)
        if cell is None:  # the line form returns its value, like %time
            self._publish(region, opts, before)
            return value if has_value(value) and not quiet else None
        if has_value(value) and not quiet:
            try:
                sys.displayhook(value)  # Out[n] first, then the report (%%capture swaps it)
            except BaseException as e:  # (IPython's: a namespace the cell cleared)
                self._publish(region, opts, before)
                without_memlab(e)
                raise
        self._publish(region, opts, before)
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

    def _publish(self, region: track, opts: Options, before: Any) -> None:
        try:
            reports = region.reports
        except RuntimeError as e:
            print(f"memlab: no report for this cell: {e.__cause__ or e}.")
            return
        waiting = len(self._watch.waiting) if self._watch is not None else 0
        if waiting:  # (a namespace of very many tensors: looked at over several cells)
            said = (
                f"{waiting:,} names in the notebook not looked at yet (at most {MAX_FRESH:,} a "
                "cell): their tensors count when a cell uses them, the rest at the next cells"
            )
            reports = reports.noted(said)
        for r in reports:
            self.history.add(cell_number(self.sh), r)
        result: MemoryReport | Reports = reports[0] if len(reports) == 1 else reports
        if not opts.gpu:  # with --gpu, -o keeps the pre-flight
            store(opts.out, self.sh.user_ns, result, before, "%gpumem")
        if opts.quiet:
            return
        display(result)
        if opts.timeline:
            for r in reports:
                if r.timeline is not None and len(r.timeline):
                    _show_plot(r.plot, "timeline plot for this cell")

    # -- %gpumem_history ------------------------------------------------------------------------
    @line_magic
    def gpumem_history(self, line: str) -> None:
        """Show every tracked cell of this kernel: a table and a plot.

        %gpumem_history            table and plot
        %gpumem_history --no-plot  table only
        %gpumem_history --clear    forget the history
        %gpumem_history -o NAME    also store the history object in NAME
        """
        if reimported():
            self._again("gpumem_history", line)
            return
        args = line.split()
        out = None
        if "-o" in args:
            i = args.index("-o")
            if i + 1 >= len(args):
                raise UsageError("%gpumem_history: -o needs a variable name.")
            out = variable_name(args.pop(i + 1), "%gpumem_history")
            args.remove("-o")
            free_for(out, self.sh.user_ns, "%gpumem_history")
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
            _show_plot(self.history.plot, "plot of the history")

    # -- %gpumem_leaks --------------------------------------------------------------------------
    @line_magic
    def gpumem_leaks(self, line: str) -> None:
        """Find variables that keep autograd graphs (and their saved tensors) alive.

        %gpumem_leaks            show them, with the bytes each keeps alive and the fix
        %gpumem_leaks -o NAME    also store the report in NAME
        """
        if reimported():
            self._again("gpumem_leaks", line)
            return
        from memlab.graphs.retained import find_retained

        args = line.split()
        out = None
        if args[:1] == ["-o"] and len(args) == 2:
            out = variable_name(args[1], "%gpumem_leaks")
            free_for(out, self.sh.user_ns, "%gpumem_leaks")
        elif args:
            raise UsageError("%gpumem_leaks takes no arguments but -o NAME.")
        outputs = getattr(getattr(self.sh, "history_manager", None), "output_hist", None)
        report = find_retained(self.sh.user_ns, skip=self.sh.user_ns_hidden, outputs=outputs)
        if out:
            self.sh.user_ns[out] = report
        display(report)

    # -- %gpumem_auto ---------------------------------------------------------------------------
    @line_magic
    def gpumem_auto(self, line: str) -> None:
        """Track every cell with a one-line summary: %gpumem_auto on [-d DEVICE] [-b] | off."""
        if reimported():
            self._again("gpumem_auto", line)
            return
        words = line.split(maxsplit=1)
        if not words:
            state = "on" if self.auto.opts else "off"
            print(f"memlab: automatic tracking is {state}. Use %gpumem_auto on|off.")
            return
        rest = words[1] if len(words) > 1 else ""
        opts = parse_auto_line(words[0], rest)
        if opts is None:
            self.auto_off()
            return
        self.auto.on(opts, rest, (self._pre_cell, self._post_cell))
        print("memlab: tracking every cell (%gpumem_auto off to stop).")

    def resume_auto(self, line: str) -> None:
        """``%reload_ext memlab`` with automatic tracking on: on again, with the same options,
        and said (a reload replaces the code, not the user's choice)."""
        try:
            opts = parse_auto_line("on", line)
            assert opts is not None  # (None is "off")
            self.auto.on(opts, line, (self._pre_cell, self._post_cell))
        except Exception as e:  # the device went away: said, not raised from the reload
            again = f"%gpumem_auto on {line}".rstrip()
            print(f"memlab: automatic tracking is off after the reload ({e}); {again} turns it on.")
            return
        print("memlab: still tracking every cell after the reload (%gpumem_auto off to stop).")

    def auto_off(self) -> None:
        """Automatic tracking off, every region it holds open closed."""
        self.auto.off((self._pre_cell, self._post_cell))

    def _pre_cell(self, info: Any) -> None:
        self._current().auto.pre(info)  # (the new import's, where memlab was imported again)

    def _post_cell(self, result: Any) -> None:
        self.auto.post(result)

    gpumem.__doc__ = HELP


def _png(fig: Any) -> Image:
    return Image(data=png(fig), format="png")


def _show_plot(plot: Any, what: str) -> None:
    """A figure drawn and shown as a PNG; where matplotlib fails (a text.usetex setting with
    no LaTeX, a recursion limit set low), said instead of failing the cell that ran, as is a
    Ctrl-C while it draws (it stops memlab's drawing; the cell ran to its end)."""
    try:
        image = _png(plot())
    except KeyboardInterrupt:
        print(f"memlab: no {what}: interrupted while memlab drew it (the cell ran to its end).")
    except Exception as e:
        print(f"memlab: no {what}: matplotlib could not draw it ({type(e).__name__}: {e}).")
    else:
        display(image)
