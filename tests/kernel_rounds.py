"""The harness the later hostile rounds share (tests/test_hostile_round3.py, round4): a case
is one cell run in a real kernel beside the same code without memlab, its checks, and what the
session must look like after it."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kernel_harness import Kernel, Outcome
from test_hostile_kernel import SAME, Check, clean_state, clean_traceback


@dataclass(frozen=True)
class Case:
    id: str
    code: str
    checks: tuple[Check, ...]
    #: the same code without memlab (SAME: the cell without its first line), compared by checks
    plain: str | None = None
    setup: str = ""
    #: (expression, the value it must show) once the cell has run
    after: tuple[tuple[str, str], ...] = ()
    #: run once the checks are done (or in the end, if one failed before)
    cleanup: str = ""


class Cases(list[Case]):
    """A round's cases, in order; ``case`` adds one."""

    def case(self, id: str, code: str, *checks: Check, plain: str | None = None,
             setup: str = "", after: tuple[tuple[str, str], ...] = (),
             cleanup: str = "") -> None:  # fmt: skip
        self.append(Case(id, code, checks, plain, setup, after, cleanup))


def started(tmp: str, setup: str) -> Iterator[Kernel]:
    """A kernel with ``setup`` run, shut down when the module is done (a fixture's body)."""
    k = Kernel(tmp, setup=setup)
    yield k
    k.shutdown()


def imports_this_checkout(kernel: Kernel) -> bool:
    here = Path(__file__).resolve().parents[1] / "memlab" / "__init__.py"
    return kernel.value("memlab.__file__") == repr(str(here))


def run_setup(kernel: Kernel, code: str) -> Outcome:
    out = kernel.run(code, timeout=60)
    assert out.status == "ok", f"setup failed:\n{code}\n{out.describe()}"
    return out


def _plain(c: Case) -> str | None:
    if c.plain is SAME:
        return c.code.partition("\n")[2]
    return c.plain


def run_case(kernel: Kernel, c: Case, always: tuple[tuple[str, str], ...] = ()) -> None:
    """Runs ``c`` and asserts its checks, a traceback of a ``%%gpumem`` cell without memlab's
    frames, ``c.after`` and the round's ``always`` (expression, value) pairs, nothing of
    memlab's left installed, and the kernel alive."""
    cleanup = c.cleanup  # run once: at the end, or in finally if the case failed before it
    try:
        if c.setup:
            run_setup(kernel, c.setup)
        code = _plain(c)
        plain = kernel.run(code) if code is not None else None
        out = kernel.run(c.code, timeout=60)
        for check in c.checks:
            check(out, plain)
        if out.status == "error" and out.traceback and c.code.startswith("%%gpumem"):
            clean_traceback()(out, plain)
        for expr, expected in (*c.after, *always):
            assert kernel.value(expr) == expected, f"after the cell, {expr}"
        if cleanup:
            cleanup, done = "", cleanup
            run_setup(kernel, done)
        state = ast.literal_eval(kernel.value("_hk_state()"))
        assert state == clean_state(), "left installed"
        assert kernel.alive()
    finally:
        if cleanup:
            kernel.run(cleanup)
        kernel.run("_hk_reset()")
