"""A pre-flight of a cell that catches its own out-of-memory error says that the GPU would run
the ``except`` branch, which the run on the CPU never did, and at which line."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
from conftest import run

from memlab.estimate.catches import catching

BIG = "torch.empty(200 * 2**20 // 4)"  # 200 MiB: more than the 0.6 GiB card's usable part


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from memlab.core import devices

    monkeypatch.setattr(devices, "_cuda_count", lambda: 0)


def preflight(ip: Any, body: str) -> Any:
    cell = "%%gpumem --gpu 0.6GiB -o pf\n" + textwrap.dedent(body).strip() + "\n"
    assert run(ip, cell).success
    return ip.user_ns["pf"]


@pytest.mark.parametrize(
    "handler",
    [
        "except torch.cuda.OutOfMemoryError:",
        "except torch.OutOfMemoryError as e:",
        "except RuntimeError:",
        "except (ValueError, Exception):",
        "except:",
    ],
)
def test_a_handler_that_catches_it_is_named_with_its_line(ip: Any, handler: str) -> None:
    pf = preflight(
        ip,
        f"""
        import torch
        try:
            x = {BIG}
        {handler}
            x = torch.empty(10)
        """,
    )
    assert not pf.fits and pf.oom.line == 4 and pf.caught_at == 5
    assert "the cell catches it at line 5: on the GPU that except branch would run" in pf.text()
    assert pf.to_dict()["caught_at"] == 5


def test_a_handler_for_other_errors_is_no_catch(ip: Any) -> None:
    pf = preflight(
        ip,
        f"""
        import torch
        try:
            x = {BIG}
        except (ValueError, KeyError):
            pass
        """,
    )
    assert not pf.fits and pf.caught_at is None and "catches" not in pf.text()


def test_a_function_called_inside_a_try_is_caught_there(ip: Any) -> None:
    pf = preflight(
        ip,
        f"""
        import torch
        def make():
            return {BIG}
        try:
            x = make()
        except torch.OutOfMemoryError:
            x = None
        """,
    )
    assert pf.oom.line == 4 and pf.caught_at == 7  # (raised in make, caught around its call)


def test_an_inner_try_for_other_errors_lets_the_outer_one_catch_it(ip: Any) -> None:
    pf = preflight(
        ip,
        f"""
        import torch
        try:
            try:
                x = {BIG}
            except KeyError:
                pass
        except Exception:
            x = None
        """,
    )
    assert pf.caught_at == 8


def test_a_cell_that_fits_or_raises_outside_any_try_says_nothing_of_it(ip: Any) -> None:
    fits = preflight(ip, "import torch\ntry:\n    x = torch.empty(10)\nexcept Exception:\n    pass")
    assert fits.fits and fits.caught_at is None
    after = preflight(ip, f"import torch\ntry:\n    pass\nexcept Exception:\n    pass\nx = {BIG}")
    assert not after.fits and after.caught_at is None


def test_a_cell_that_cannot_be_read_is_no_catch() -> None:
    assert catching(None, [1]) is None
    assert catching("<no such cell>", [1]) is None
