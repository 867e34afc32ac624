"""``memlab.mark``: a tensor's role named in the regions open on this thread, where memlab
cannot tell it (a key/value cache a program's own loop keeps in a list): in ``memlab.track``
and under ``%%gpumem -b``, checked against the bytes of the tensors the test made; nothing
outside a region; a bad role or no tensor refused with what to pass, without memlab's
frames."""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch

import memlab
from memlab.core.categories import Category

LAYERS, HEADS, DIM, BATCH = 2, 2, 8, 3


def decode(steps: int, named: bool) -> list[torch.Tensor]:
    """A loop of one's own: each layer's keys and values grown by a token a step, kept in a
    list (no Hugging Face cache for memlab to know)."""
    cache = [torch.zeros(BATCH, HEADS, 0, DIM) for _ in range(2 * LAYERS)]
    for _ in range(steps):
        cache = [torch.cat([t, torch.randn(BATCH, HEADS, 1, DIM)], dim=2) for t in cache]
        if named:
            for t in cache:
                memlab.mark(t, "kv_cache")
    return cache


@pytest.mark.parametrize("named", [True, False])
def test_a_cache_of_ones_own_is_named_in_a_region(named: bool) -> None:
    with memlab.track("cpu", breakdown=True) as t:
        cache = decode(5, named)
    b = t.report.breakdown
    assert b is not None
    truth = sum(x.untyped_storage().nbytes() for x in cache)
    assert truth == 2 * LAYERS * BATCH * HEADS * 5 * DIM * 4
    assert b.at_end.get(Category.KV_CACHE, 0) == (truth if named else 0)
    if not named:
        assert b.at_end[Category.OTHER] >= truth


def test_under_gpumem_b_the_innermost_region_is_named(ip: Any) -> None:
    from conftest import run

    ip.user_ns["decode"] = decode
    run(ip, "%%gpumem -b -q -o r\ncache = decode(4, True)")
    r = ip.user_ns["r"]
    truth = sum(x.untyped_storage().nbytes() for x in ip.user_ns["cache"])
    assert r.breakdown.at_end[Category.KV_CACHE] == truth > 0


def _said(call: Any) -> BaseException:
    with pytest.raises((TypeError, ValueError)) as e:
        call()
    lines = traceback.format_exception(e.value)
    assert not [ln for ln in lines if "memlab/region" in ln or "memlab/core" in ln], lines
    return e.value


def test_bad_calls_say_what_to_pass() -> None:
    t = torch.ones(3)
    memlab.mark(t, "kv_cache")  # no region open: nothing to name, and the loop runs on
    with memlab.track("cpu", breakdown=True):
        role = _said(lambda: memlab.mark(t, "cache"))
        derived = _said(lambda: memlab.mark(t, "other"))
        kind = _said(lambda: memlab.mark([t], "kv_cache"))
    assert isinstance(role, ValueError) and "role='cache'" in str(role)
    assert "'kv_cache'" in str(role) and "'other'" not in str(role)
    assert isinstance(derived, ValueError)
    assert isinstance(kind, TypeError) and "got list" in str(kind)


def test_every_region_open_on_the_thread_is_named() -> None:
    # a %%gpumem -b cell (the outer region) whose code times a part with a region of its own
    with memlab.track("cpu", breakdown=True) as outer, memlab.track("cpu"):
        cache = decode(3, True)
    b = outer.report.breakdown
    truth = sum(x.untyped_storage().nbytes() for x in cache)
    assert b is not None and b.at_end[Category.KV_CACHE] == truth


def test_a_step_fn_that_marks_runs_in_a_what_if_run() -> None:
    # its warm-up runs unmeasured: the mark names nothing there, and the measured step's cache
    from memlab import whatif

    def step(model: Any, x: torch.Tensor) -> torch.Tensor:
        kept = model(x)
        memlab.mark(kept, "kv_cache")
        return kept.square().mean()

    r = whatif.run(
        lambda: torch.nn.Linear(16, 16),
        lambda n: torch.randn(n, 16),
        step_fn=step,
        batch_size=4,
    )
    assert r.error is None and r.report is not None


def test_a_closed_region_is_not_named_into_and_the_outer_one_is() -> None:
    with memlab.track("cpu", breakdown=True) as outer:
        with memlab.track("cpu", breakdown=True):
            pass
        kept = torch.ones(256)
        memlab.mark(kept, Category.INPUT)  # (the inner one is closed: the outer is named)
    b = outer.report.breakdown
    assert b is not None and b.at_end[Category.INPUT] == kept.untyped_storage().nbytes()
