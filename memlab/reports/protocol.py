"""The report protocol: what every memlab result gives, whatever it measured or predicted.

A result implements three methods and inherits the rest:

- ``text()``: plain text for terminals and logs; ``str(result)`` and IPython's plain display;
- ``html()``: the HTML *body*, made with the pieces of `memlab.reports.frame`; ``_repr_html_``
  draws it in the one frame, with the class ``memlab <css>``;
- ``to_dict()``: plain data that ``json.dumps`` takes; byte figures are ints in bytes.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from memlab.reports.frame import frame

#: Control characters but the line break and the tab (C0, DEL, C1): a label or a model's name
#: holding them would act on a terminal (an ANSI escape clears it; a NUL cuts a log's line).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with each control character but ``\\n`` and ``\\t`` written as its escape."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


class Result(ABC):
    """Mixin for result types: ``__str__``, ``_repr_html_`` and ``_repr_pretty_`` from ``text``
    and ``html``."""

    #: The frame's CSS class, e.g. ``"memlab-report"`` (tests and the browser find results by it).
    css: ClassVar[str] = "memlab-result"

    @abstractmethod
    def text(self) -> str:
        """Plain text, several lines, no trailing newline."""

    @abstractmethod
    def html(self) -> str:
        """The HTML inside the frame; every user string escaped."""

    @abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """JSON-safe plain data."""

    def __str__(self) -> str:
        return printable(self.text())

    def _repr_html_(self) -> str:
        return frame(self.html(), self.css)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(printable(self.text()))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # IPython's pretty printer takes a class's own __repr__ (a dataclass writes one) before
        # an inherited _repr_pretty_: give each result type its own, so that a text front end
        # shows the text table, not the dataclass's fields.
        super().__init_subclass__(**kwargs)
        cls._repr_pretty_ = Result._repr_pretty_  # type: ignore[method-assign]
