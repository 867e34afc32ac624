"""`GenerationFit`: what `memlab.estimate.fit_generation` found, as a result (text, HTML,
``to_dict()``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from memlab.reports.frame import NAME, heading, note, num_cell, table, text_cell, warning
from memlab.reports.protocol import Result
from memlab.reports.units import fmt_bytes


@dataclass(frozen=True)
class GenerationFit(Result):
    """The largest batch at a context, or the longest context at a batch, on one GPU.

    searched: "batch" or "context", what was searched; the other one was given.
    batch, context: the answer and the given figure (0 answered: not even 1 fits).
    context counts the prompt and the new tokens: the tokens of a sequence in the cache.
    peak, next_peak: predicted peak reserved at the answer and one past it (None: not tried,
        or the model of the allocator ran out of memory).
    limit: the largest value searched (the model's position table for a context).
    cache_per_token: the key/value cache's bytes per token of one sequence by the formula (in
        ``cache_dtype`` where given, else the parameters' type; below any sliding window),
        None without a Hugging Face config.
    cache_bytes: the cache's bytes at the end of the generation at the answer, predicted.
    """

    css = "memlab-generation-fit"

    gpu: str
    usable: int
    searched: str
    batch: int
    context: int
    new_tokens: int
    peak: int | None
    next_peak: int | None
    limit: int
    cache_per_token: int | None
    cache_bytes: int | None
    cache_dtype: str | None
    estimates: int
    config: str

    @property
    def answer(self) -> int:
        return self.batch if self.searched == "batch" else self.context

    @property
    def headline(self) -> str:
        if self.searched == "batch":
            what = f"largest batch at {self.context:,} tokens of context"
        else:
            what = f"longest context at batch {self.batch:,}"
        return f"{what} on {self.gpu}: {self.answer:,}" if self.answer else f"{what}: none fits"

    def lines(self) -> list[str]:
        """The lines below the headline (text and HTML both show them)."""
        unit = "sequences" if self.searched == "batch" else "tokens"
        out = [f"{self.new_tokens} new tokens a sequence; {self.config}"]
        shown = fmt_bytes
        figures = [f for f in (self.peak, self.next_peak, self.usable) if f is not None]
        if len({fmt_bytes(f) for f in figures}) < len(figures):  # too close to tell apart
            shown = "{:,} B".format
        if self.peak is not None:
            out.append(f"predicted peak reserved at {self.answer:,} {unit}: {shown(self.peak)}")
        if self.next_peak is not None:
            out.append(
                f"at {self.answer + 1:,}: {shown(self.next_peak)}, over the "
                f"{shown(self.usable)} usable"
            )
        elif self.answer >= self.limit:
            out.append(f"stopped at the limit searched, {self.limit:,} {unit}")
        kind = f" in {self.cache_dtype}" if self.cache_dtype else ""
        if self.cache_bytes:
            out.append(f"KV cache{kind} at the answer: {fmt_bytes(self.cache_bytes)}")
        if self.cache_per_token is not None:
            out.append(
                f"KV cache{kind} by the formula: {fmt_bytes(self.cache_per_token)} per token "
                "of a sequence"
            )
        if self.cache_dtype:
            out.append(
                f"cache in {self.cache_dtype}: modelled (the estimate's cache bytes scaled), "
                "not run"
            )
        out.append(f"{self.estimates} estimates")
        return out

    def text(self) -> str:
        return "\n".join([self.headline, *(f"  {line}" for line in self.lines())])

    def html(self) -> str:
        rows = [
            text_cell(name, NAME) + num_cell(value)
            for name, value in (
                ("usable memory", self.usable),
                ("peak reserved at the answer", self.peak),
                ("one past the answer", self.next_peak),
                ("KV cache at the answer", self.cache_bytes),
            )
        ]
        first = heading(self.headline, "predicted, confirmed at the edge")
        if not self.answer:
            first += warning("not even the smallest fits")
        return "\n".join(
            [
                first,
                table(["", "bytes"], rows, "memlab-generation-fit-table"),
                *(note(line) for line in self.lines()),
            ]
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "answer": self.answer}
