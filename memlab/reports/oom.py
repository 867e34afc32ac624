"""An out-of-memory explained (`OOMExplanation`); a cell's pre-flight on a GPU is
`memlab.reports.preflight.Preflight`.

Plain data and its renderings only: `memlab.estimate.oom` computes them from the allocator's
state and the tensor accounting.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from typing import Any

from memlab.reports.frame import (
    CELL,
    LEFT,
    NAME,
    code_cell,
    note,
    num_cell,
    plain,
    table,
    text_cell,
    warning,
)
from memlab.reports.protocol import Result
from memlab.reports.units import fmt_bytes


@dataclass(frozen=True)
class LiveTensor:
    """One live storage at the moment of the failure."""

    nbytes: int
    category: str
    #: The user's variables that hold it (``x``, ``outs[3]``), if any.
    names: tuple[str, ...] = ()
    #: The cell line that allocated it (1-based, as the cell shows it), and its text (without a
    #: line: where it comes from, e.g. "before this cell").
    line: int | None = None
    source: str = ""

    def where(self, html: bool = False) -> str:
        """Where it was made; in HTML escaped, the cell's code set as code."""
        if self.line is None:
            return escape(self.source) if html else self.source
        code = self.source.strip()
        code = code if len(code) <= 60 else code[:59] + "…"
        return f"line {self.line}: " + (f"<code>{escape(code)}</code>" if html else code)

    def to_dict(self) -> dict[str, Any]:
        return {
            "nbytes": self.nbytes,
            "category": self.category,
            "names": list(self.names),
            "line": self.line,
            "source": self.source,
        }


@dataclass(frozen=True)
class Lever:
    """A change that would lower the peak, with the peak it is predicted to give."""

    name: str  # "AMP (bf16)", "del big", "expandable_segments"
    how: str  # what to change, code marked `like this`
    peak_reserved: int
    #: Whether that peak fits in the GPU's usable memory (None: no limit known).
    fits: bool | None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "how": plain(self.how), "peak_reserved": self.peak_reserved}


@dataclass(frozen=True)
class OOMExplanation(Result):
    """Why an allocation failed: the allocator's figures at that moment, what was live, and the
    levers that would make it fit."""

    css = "memlab-oom"

    where: str  # "cuda:0", "predicted T4 (16 GiB)"
    requested: int
    #: Bytes the allocator may reserve on this GPU (None: not known).
    capacity: int | None
    allocated: int
    reserved: int
    #: The largest free cached block of the request's pool ("small": up to 1 MiB, or "large").
    largest_free: int
    pool: str
    #: Free cached bytes of that pool.
    free_in_pool: int
    #: One sentence: why it failed (memory full, fragmentation, a request larger than the GPU).
    cause: str
    fragmented: bool = False
    #: The cell line where the failing allocation was made, and its text.
    line: int | None = None
    source: str = ""
    by_category: tuple[tuple[str, int], ...] = ()
    by_name: tuple[tuple[str, int], ...] = ()
    biggest: tuple[LiveTensor, ...] = ()
    levers: tuple[Lever, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def free_in_cache(self) -> int:
        """Reserved and not allocated: cached blocks, possibly in pieces."""
        return self.reserved - self.allocated

    @property
    def device_free(self) -> int | None:
        """What the allocator could still reserve from the device."""
        return None if self.capacity is None else max(0, self.capacity - self.reserved)

    @property
    def fragmentation(self) -> float:
        """1 - largest free block / free bytes, in the request's pool: 0 when its cache is one
        block (or empty), near 1 when it is many small pieces."""
        free = self.free_in_pool
        return 0.0 if free <= 0 else 1.0 - self.largest_free / free

    def figures(self) -> list[tuple[str, int | None]]:
        return [
            ("requested", self.requested),
            ("allocated", self.allocated),
            ("reserved", self.reserved),
            ("free in cache", self.free_in_cache),
            (f"largest free ({self.pool})", self.largest_free),
            ("free on the device", self.device_free),
            ("usable on the device", self.capacity),
        ]

    def headline(self) -> str:
        at = f" at line {self.line}" if self.line is not None else ""
        return f"out of memory on {self.where}{at}: {fmt_bytes(self.requested)} requested"

    def text(self) -> str:
        return self.headline() + "\n" + self.body_text()

    def body_text(self) -> str:
        """The text under the headline (a pre-flight puts its own headline above it)."""
        lines = []
        if self.line is not None and self.source.strip():
            lines.append(f"  line {self.line}: {self.source.strip()}")
        lines.append(f"  why: {plain(self.cause)}")
        lines += [f"  {k:<21}{fmt_bytes(v):>11}" for k, v in self.figures() if v is not None]
        lines.append(f"  {'fragmentation':<21}{self.fragmentation:>11.0%}")
        if self.by_category:
            lines.append("live by category:")
            lines += [f"  {c:<21}{fmt_bytes(n):>11}" for c, n in self.by_category]
        if self.by_name:
            lines.append("held by your variables:")
            lines += [f"  {k:<21}{fmt_bytes(n):>11}" for k, n in self.by_name]
        if self.biggest:
            lines.append("biggest live tensors:")
            for t in self.biggest:
                names = ", ".join(t.names) or "-"
                size = fmt_bytes(t.nbytes)
                lines.append(f"  {size:>11}  {t.category:<16} {names:<14} {t.where()}".rstrip())
        if self.levers:
            lines.append("levers (predicted peak reserved):")
            for lv in self.levers:
                verdict = "" if lv.fits is None else " fits" if lv.fits else " still too big"
                lines.append(
                    f"  {lv.name:<25}{fmt_bytes(lv.peak_reserved):>11}{verdict}  {plain(lv.how)}"
                )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def html(self) -> str:
        return warning(self.headline()) + "\n" + self.body_html()

    def body_html(self) -> str:
        """The HTML under the headline (a pre-flight puts its own headline above it)."""
        parts = []
        if self.line is not None and self.source.strip():
            parts.append(f"<div><code>line {self.line}: {escape(self.source.strip())}</code></div>")
        parts.append(f"<div>{_code('why: ' + self.cause)}</div>")
        rows = [text_cell(k, NAME) + num_cell(v) for k, v in self.figures() if v is not None]
        rows.append(text_cell("fragmentation", NAME) + text_cell(f"{self.fragmentation:.0%}", CELL))
        parts.append(table(["figure", "bytes"], rows, "memlab-oom-figures"))
        if self.by_category:
            rows = [text_cell(c, NAME) + num_cell(n) for c, n in self.by_category]
            parts.append(table(["live by category", "bytes"], rows, "memlab-oom-categories"))
        if self.by_name:
            rows = [code_cell(f"`{k}`", NAME) + num_cell(n) for k, n in self.by_name]
            parts.append(table(["held by your variables", "bytes"], rows, "memlab-oom-names"))
        if self.biggest:
            rows = [
                num_cell(t.nbytes)
                + text_cell(t.category)
                + text_cell(", ".join(t.names))
                + f'<td style="{LEFT}">{t.where(html=True)}</td>'
                for t in self.biggest
            ]
            parts.append(
                table(["biggest live", "category", "held by", "made at"], rows, "memlab-oom-big")
            )
        if self.levers:
            rows = [
                text_cell(lv.name, NAME)
                + num_cell(lv.peak_reserved)
                + text_cell("" if lv.fits is None else "fits" if lv.fits else "still too big")
                + code_cell(lv.how)
                for lv in self.levers
            ]
            parts.append(table(["lever", "predicted peak", "", "how"], rows, "memlab-oom-levers"))
        parts += [note(n) for n in self.notes]
        return "\n".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "where": self.where,
            "requested": self.requested,
            "capacity": self.capacity,
            "allocated": self.allocated,
            "reserved": self.reserved,
            "free_in_cache": self.free_in_cache,
            "largest_free": self.largest_free,
            "pool": self.pool,
            "free_in_pool": self.free_in_pool,
            "device_free": self.device_free,
            "fragmentation": round(self.fragmentation, 4),
            "fragmented": self.fragmented,
            "cause": plain(self.cause),
            "line": self.line,
            "source": self.source,
            "by_category": dict(self.by_category),
            "by_name": dict(self.by_name),
            "biggest": [t.to_dict() for t in self.biggest],
            "levers": [lv.to_dict() | {"fits": lv.fits} for lv in self.levers],
            "notes": list(self.notes),
        }


def _code(text: str) -> str:
    """Escaped text whose code, marked `like this`, is set in ``<code>``."""
    parts = escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))
