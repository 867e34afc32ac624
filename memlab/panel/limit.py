"""Which limit applies to the panel's runs and search: the budget the user typed, else the
simulated GPU's usable memory (which also fills the budget field), else this GPU's free
memory; said in a line under the controls."""

from __future__ import annotations

from html import escape
from typing import Any

from memlab.estimate.gpus import GPU
from memlab.reports.units import fmt_bytes

MiB = 1024**2
#: Quiet text that reads on light and dark themes; lines as close as the tables' (a widget's
#: HTML is otherwise spaced a whole control's height apart).
LINE = "font-size:12px;line-height:1.35;padding:2px 0"
MUTED = f"color:var(--jp-content-font-color2,#888);{LINE}"


def mib(nbytes: int | None) -> float:
    """Bytes as the budget field shows them: MiB, rounded for people."""
    return 0.0 if not nbytes else round(nbytes / MiB, 1)


class BudgetLimit:
    """The Explorer's budget field and limit line (``budget``, ``limit``, ``card``)."""

    budget: Any
    limit: Any
    #: Whether the budget field holds the simulated GPU's memory rather than a typed budget.
    _budget_from_gpu = False

    @property
    def card(self) -> GPU | None:
        raise NotImplementedError

    def _budget_typed(self, change: dict[str, Any]) -> None:
        if not self._setting_budget:
            self._budget_from_gpu = False
        self._show_limit()

    _setting_budget = False

    def _set_budget(self, nbytes: int | None) -> None:
        self._setting_budget = True
        try:
            self.budget.value = mib(nbytes)
        finally:
            self._setting_budget = False

    def _follow_gpu(self) -> None:
        """A simulated GPU's memory becomes the budget, unless the user typed one."""
        if self._budget_from_gpu or not self.budget.value:
            card = self.card
            self._set_budget(None if card is None else card.usable)
            self._budget_from_gpu = card is not None
        self._show_limit()

    def _show_limit(self) -> None:
        """Which limit applies to the runs and the search, said under the controls."""
        card = self.card
        typed = int(self.budget.value * MiB) if self.budget.value else None
        if typed and self._budget_from_gpu and card is not None:
            said = f"limit: {fmt_bytes(typed)}, the simulated {card.name}'s usable memory"
        elif typed:
            said = f"limit: {fmt_bytes(typed)}, your budget"
        elif card is not None:
            said = f"limit: {fmt_bytes(card.usable)}, the simulated {card.name}'s usable memory"
        else:
            said = "limit: none (a GPU's free memory for the search; set a budget on a CPU)"
        self.limit.value = f'<div style="{MUTED}">{escape(said)}</div>'
