"""A Ctrl-C in a tracked cell reaches the user's code, the report says "interrupted" with the
figures up to that point, and the next cell's figures are right."""

from __future__ import annotations

import _thread
import threading
from typing import Any

import pytest
from conftest import run


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from memlab.core import devices

    monkeypatch.setattr(devices, "_cuda_count", lambda: 0)


def test_an_interrupted_cell_is_reported_and_the_next_one_is_right(ip: Any) -> None:
    run(ip, "%%gpumem -q\nwarm = 1")  # PyTorch's one-time imports, before the timer starts
    run(ip, "keep = torch.ones(1000)")  # 4,000 B that stay
    timer = threading.Timer(0.3, _thread.interrupt_main)
    timer.start()
    try:
        r = run(
            ip,
            "%%gpumem -b -o rep\n"
            "n = 0\n"
            "while True:\n"
            "    a = torch.ones(64) * 2\n"
            "    b = (a + 1).sum()\n"
            "    n += 1\n",
        )
    finally:
        timer.cancel()
    assert isinstance(r.error_in_exec, KeyboardInterrupt)  # it reached the loop, was not lost
    rep = ip.user_ns["rep"]
    assert rep.raised == "KeyboardInterrupt" and ip.user_ns["n"] > 0
    assert "INTERRUPTED" in str(rep) and "interrupted" in str(rep)
    r = run(ip, "%%gpumem -d cpu -o after\nx = torch.ones(250)")  # 1,000 B
    after = ip.user_ns["after"]
    # the ledger was settled: what is alive is `keep`, the loop's last tensors and x
    live = 4000 + 64 * 4 + 4 + 1000
    assert after.allocated_after - after.allocated_before == 1000
    assert after.allocated_after <= live + 64 * 4 + 4  # no storage counted twice, none leaked
