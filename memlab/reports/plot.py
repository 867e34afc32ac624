"""The one plotting module: every matplotlib figure memlab draws, and `png` to send one as an
image. matplotlib is imported here, when a plot is asked for, never before. Axes are in MiB."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from memlab.core.categories import Category
from memlab.core.choices import Source
from memlab.core.frames import the_users
from memlab.reports.units import fmt_label, mib

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from memlab.reports.report import MemoryReport

#: The allocated-bytes line: a blue that reads on white, on the dark theme's background and on
#: the phase bands alike (contrast 3.4 or more on each; the navy it replaces was 2.2 on dark).
LINE = "#2a7ab0"
_PHASE_COLOURS = {
    "forward": "#d6eaf8",
    "backward": "#fdebd0",
    "optimizer": "#e8daef",
    "prefill": "#fadbd8",
    "decode": "#d5f5e3",
}
CATEGORY_COLOURS = {
    Category.PARAMETER: "#1f4e79",
    Category.BUFFER: "#5b9bd5",
    Category.OPTIMIZER_STATE: "#7030a0",
    Category.GRADIENT: "#c55a11",
    Category.KV_CACHE: "#a23b72",
    Category.COMMUNICATION: "#2e8b8b",
    Category.INPUT: "#70ad47",
    Category.ACTIVATION: "#e8a33d",
    Category.HOST: "#9c6644",
    Category.TEMPORARY: "#bfbfbf",
    Category.OTHER: "#7f7f7f",
    Category.UNATTRIBUTED: "#d9d9d9",
}
#: Resolution of the images `png` makes: the magics' default; the panel's smaller charts pass 80.
DPI = 96


def png(fig: Any, dpi: int = DPI) -> bytes:
    """A figure as PNG bytes (for ``IPython.display.Image`` or an ipywidgets ``Image``)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def scale(largest: float) -> tuple[float, str]:
    """(divisor, unit) that shows byte counts up to ``largest`` in 1 to 1023 of a binary unit."""
    for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if largest >= 1024**power:
            return float(1024**power), unit
    return 1.0, "B"


#: Text, ticks and frames of every figure: a grey that reads on JupyterLab's light and dark
#: backgrounds alike (contrast 4.5 on white, 3.6 on the dark theme's #212121), on a transparent
#: background, so that a plot follows the notebook's theme.
INK = "#777777"


def _themed(fig: Figure) -> Figure:
    from matplotlib.text import Text

    for ax in fig.axes:
        ax.set_facecolor("none")
        ax.tick_params(colors=INK)
        for spine in ax.spines.values():
            spine.set_edgecolor(INK)
    for text in fig.findobj(Text):
        text.set_color(INK)
    return fig


def _axes(ax: Axes | None, size: tuple[float, float]) -> tuple[Figure, Axes]:
    if ax is not None:
        from matplotlib.axes import Axes as _Axes

        fig = ax.get_figure() if isinstance(ax, _Axes) else None
        if fig is None:
            e = TypeError(
                f"plot: ax is {type(ax).__name__}: pass a matplotlib Axes on a figure "
                "(fig.add_subplot()), or leave ax out for a new figure."
            )
            the_users(e)
            raise e
        return fig, ax  # type: ignore[return-value]
    fig = figure_class()(figsize=size, layout="constrained", facecolor="none")
    return fig, fig.add_subplot()


def figure_class() -> type[Figure]:
    """A matplotlib Figure that shows itself as an image when it is a cell's value. A Figure made
    without pyplot shows only as text ('<Figure size ...>') unless the notebook ran
    ``%matplotlib inline``; this one says how to draw itself (``_repr_png_``), so memlab
    registers nothing in the user's shell."""
    global _SHOWN
    if _SHOWN is None:
        from matplotlib.figure import Figure

        class ShownFigure(Figure):
            def _repr_png_(self) -> bytes:
                return png(self)

        _SHOWN = ShownFigure
    return _SHOWN


_SHOWN: type[Figure] | None = None


def plot_timeline(r: MemoryReport, ax: Axes | None = None) -> Figure:
    if r.timeline is None or not len(r.timeline):
        raise ValueError(
            "This report has no timeline. Measure with timeline=True "
            "(%%gpumem --timeline, or memlab.track(timeline=True))."
        )
    tl = r.timeline
    fig, ax = _axes(ax, (7.0, 2.8))
    xs = [0.0, *tl.seconds, r.seconds]
    ys = [r.allocated_before, *tl.allocated, tl.allocated[-1]]
    div, unit = scale(max(r.peak_allocated, *ys))
    ax.step(xs, [y / div for y in ys], where="post", color=LINE, lw=1.3, label="allocated")
    start = 0
    for i in range(1, len(tl.phases) + 1):
        if i == len(tl.phases) or tl.phases[i] != tl.phases[start]:
            colour = _PHASE_COLOURS.get(tl.phases[start])
            if colour:
                ax.axvspan(tl.seconds[start], xs[i + 1], color=colour, lw=0)
            start = i
    ax.axhline(r.peak_allocated / div, color="#b03a2e", ls="--", lw=0.8, label="peak")
    ax.axhline(r.allocated_before / div, color="#7f8c8d", ls=":", lw=0.8, label="before")
    ax.set_ylim(0, max(r.peak_allocated, *ys) / div * 1.08 or 1)  # the peak never at the edge
    for phase, colour in _PHASE_COLOURS.items():
        if phase in tl.phases:
            ax.axvspan(0, 0, color=colour, label=phase)
    if r.source == Source.ESTIMATE:  # the predicted step ran on the meta device, not a GPU
        ax.set_xlabel("progress through the step (seconds of its meta-device run, not GPU time)")
    else:
        ax.set_xlabel("seconds since the region started")
    ax.set_ylabel(unit)
    label = f" · {literal(fmt_label(r.label))}" if r.label else ""
    ax.set_title(f"{r.device}{label} ({tl.source})", fontsize=10)
    # beside the plot, never over the curve
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    return _themed(fig)


#: A history plot draws at most this many points per line, and this many x labels.
MAX_POINTS = 2_000
MAX_TICKS = 20
#: Longer cell names are cut in the x labels.
MAX_LABEL = 24


def envelope(values: Sequence[int], buckets: int) -> tuple[list[int], list[int]]:
    """(positions, values) of at most ``2 * buckets`` points that keep the shape of ``values``:
    each bucket's lowest and highest value, in the order they come, so every peak of a bucket
    (the highest of all included) stays on the line. One pass: O(len(values))."""
    n = len(values)
    size = max(1, -(-n // max(1, buckets)))
    xs: list[int] = []
    for lo in range(0, n, size):
        hi = min(n, lo + size)
        low = min(range(lo, hi), key=values.__getitem__)
        high = max(range(lo, hi), key=values.__getitem__)
        xs += sorted({low, high})
    return xs, [values[i] for i in xs]


def ticks(n: int, most: int = MAX_TICKS) -> list[int]:
    """At most ``most`` evenly spread positions out of ``n``, the first and the last included."""
    if n <= most:
        return list(range(n))
    step = (n - 1) / (most - 1)
    return sorted({round(k * step) for k in range(most)})


def _short(name: str) -> str:
    return literal(name if len(name) <= MAX_LABEL else name[: MAX_LABEL - 1] + "…")


def literal(text: str) -> str:
    """``text`` drawn as it is written: matplotlib reads what lies between two ``$`` as
    mathematical notation (``"cost $$"`` fails to draw, ``"$x^2$"`` is typeset)."""
    return text.replace("$", r"\$")


def plot_history(
    names: Sequence[str], after: Sequence[int], peak: Sequence[int], ax: Axes | None = None
) -> Figure:
    """Allocated after each tracked cell and the peak inside it. A long history is drawn in
    O(n): at most `MAX_POINTS` points a line (each stretch's lowest and highest value, so no
    peak is lost) and at most `MAX_TICKS` x labels."""
    fig, ax = _axes(ax, (7.0, 2.8))
    n = len(names)
    reduced = n > MAX_POINTS
    if reduced:
        xa, ya = envelope(after, MAX_POINTS // 2)
        xp, yp = envelope(peak, MAX_POINTS // 2)
    else:
        xa, ya, xp, yp = list(range(n)), list(after), list(range(n)), list(peak)
    dots = n <= 60
    ax.plot(
        xa,
        [mib(a) for a in ya],
        marker="o" if dots else None,
        color=LINE,
        label="allocated after",
    )
    ax.plot(
        xp,
        [mib(p) for p in yp],
        marker="^" if dots else None,
        ls="--",
        color="#b03a2e",
        label="peak inside",
    )
    shown = ticks(n)
    labels = [_short(names[i]) for i in shown]
    ax.set_xticks(shown, labels, rotation=45 if len(shown) > 12 else 0, fontsize=8)
    ax.set_xlabel("tracked cell")
    ax.set_ylabel("MiB")
    if reduced:
        ax.set_title(
            f"{n:,} cells; each line keeps the lowest and highest value of every "
            f"{-(-n // (MAX_POINTS // 2)):,} cells (no peak is lost)",
            fontsize=8,
        )
    ax.legend(loc="upper left", fontsize=8, frameon=False)
    return _themed(fig)


def plot_categories(
    at_peak: Sequence[Mapping[Category, int]], ax: Axes | None = None, budget: int | None = None
) -> Figure:
    """Stacked bars: each run's bytes by category at its peak (runs numbered from 1), each
    bar's total written on it (runs of MiB beside runs of GiB stay readable), and the budget as
    a line."""
    from memlab.reports.units import fmt_bytes

    fig, ax = _axes(ax, (5.5, 2.8))
    xs = list(range(1, len(at_peak) + 1))
    totals = [sum(cats.values()) for cats in at_peak]
    div, unit = scale(max([*totals, budget or 0, 1]))
    bottom = [0.0] * len(at_peak)
    for c in Category:
        values = [cats.get(c, 0) / div for cats in at_peak]
        if any(values):
            ax.bar(
                xs,
                values,
                bottom=bottom,
                color=CATEGORY_COLOURS[c],
                label=c.value.replace("_", " "),
            )
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, total in zip(xs, totals, strict=True):
        if total:
            ax.annotate(fmt_bytes(total), (x, total / div), ha="center", va="bottom", fontsize=7)
    if budget:
        ax.axhline(budget / div, color="#b03a2e", ls="--", lw=0.9, label="budget")
    ax.set_ylim(0, max([*totals, budget or 0, 1]) / div * 1.15)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("run")
    ax.set_ylabel(f"{unit} at the peak")
    ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1, 1))
    return _themed(fig)
