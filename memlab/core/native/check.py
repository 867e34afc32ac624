"""The native record's check of itself, once a process: a small training step measured natively
and under the dispatch mode, each on a ledger of its own, must give the same figures (and the
same categories at the peak, at the end and at their highest, with a breakdown).

The library is compiled against whichever PyTorch is installed; it is tested on this project's
(2.13), and this check is what stands between another release's changed internals (which ops
reach the dispatch key the record's fallback sits at, which ops a RecordFunction reports and
with which dispatch keys excluded) and a wrong figure: where the two disagree, memlab measures
with the dispatch mode for the rest of the process and `memlab.core.native.unavailable()` says
why.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from memlab.core.accounting import Accountant
from memlab.core.ledger import Ledger
from memlab.core.recorder import Recorder, Tally


def _workload() -> Callable[[], Any]:
    """Fresh objects each time: a linear layer's forward and backward (autograd's engine, a
    saved input, gradients made), an in-place op, a view, a tensor made from Python data, and
    a free of a tensor made before."""
    # no random numbers: the check must not move the program's generator
    weight = torch.linspace(-1.0, 1.0, 128).reshape(8, 16).requires_grad_()
    bias = torch.zeros(8, requires_grad=True)
    x = torch.arange(64, dtype=torch.float32).reshape(4, 16) / 64
    older = {"t": torch.ones(64)}

    def body() -> list[torch.Tensor]:
        out = torch.nn.functional.linear(x, weight, bias).relu()
        out.square().sum().backward()
        del older["t"]
        kept = torch.tensor([1.0, 2.0, 3.0]) * 2
        kept.add_(1)
        return [kept.view(3, 1), torch.cat([x, x])]

    return body


def _figures(tally: Tally) -> tuple[Any, ...]:
    return (tally.before, tally.after, tally.peak, tally.at_peak, tally.at_end, tally.highest)


def _native(lib: Any, keep: bool) -> tuple[Any, ...]:
    from memlab.core.native.region import NativeRegion
    from memlab.core.native.roles import NativeRoles

    body = _workload()
    ledger = Ledger()
    region = NativeRegion(ledger, lib, NativeRoles(ledger, lib) if keep else None)
    region.start()
    try:
        kept = body()
    finally:
        region.stop()
    tally = region.tally(keep)
    del kept
    return _figures(tally)


def _dispatch(keep: bool) -> tuple[Any, ...]:
    body = _workload()
    ledger = Ledger()
    acc = Accountant(ledger, keep)
    rec = Recorder(ledger, "cpu", keep, acc.phase)
    rec.start()
    acc.install()
    try:
        kept = body()
    finally:
        acc.uninstall()
        acc.finish()
        rec.stop()
    tally = rec.tally(keep, acc.used)
    del kept
    return _figures(tally)


def self_check(lib: Any) -> str | None:
    """None where the native record and the dispatch mode agree on the check's step, else what
    each measured (before, after, peak; with a breakdown, the categories too). Run on a thread
    of its own: the program's saved-tensor hooks, function modes and grad mode are its own
    thread's, and a hook that refuses the check's tensors must not turn the record off (nor
    see memlab's tensors at all). A Ctrl-C waits for the check (a few milliseconds)."""
    said: list[str | None] = []
    thread = threading.Thread(target=lambda: said.append(_check(lib)), name="memlab-self-check")
    thread.start()
    try:
        thread.join()
    except KeyboardInterrupt:
        thread.join()  # (the record must be free again before the Ctrl-C goes on)
        raise
    return said[0] if said else "its self-check did not finish"


def _check(lib: Any) -> str | None:
    for keep in (False, True):
        try:  # (under the caller's no_grad or inference mode, the step's backward would fail)
            with torch.inference_mode(False), torch.enable_grad():
                native, dispatch = _native(lib, keep), _dispatch(keep)
        except Exception as e:  # the record could not even run it
            return f"its self-check failed ({type(e).__name__}: {e})"
        if native != dispatch:
            what = "with a breakdown: " if keep else ""
            return (
                f"its self-check disagreed with the dispatch mode on this PyTorch "
                f"({torch.__version__}): {what}before, after, peak (and categories) {native} "
                f"against {dispatch}"
            )
    return None
