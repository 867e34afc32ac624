"""A device this machine does not have is refused by name, as ``cuda`` is on a machine without
a GPU: ``mps``, ``xpu``, ``hpu`` or a private backend measured nothing and said nothing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import run

import memlab
from memlab.core import devices


@pytest.mark.parametrize("device", ["mps", "xpu", "hpu", "privateuseone", "xpu:1"])
def test_a_device_the_machine_lacks_is_refused_by_name(device: str) -> None:
    kind = device.partition(":")[0]
    if devices._available(kind):
        pytest.skip(f"this machine has a {kind} device")
    with pytest.raises(memlab.DeviceError, match=f"'{device}': no {kind} device is available"):
        memlab.track(device)


def test_the_magic_refuses_it_with_a_usage_error(ip: Any) -> None:
    if devices._available("mps"):
        pytest.skip("this machine has an mps device")
    r = run(ip, "%%gpumem -d mps\nx = torch.ones(10)")
    assert "no mps device is available" in str(r.error_in_exec)


def test_a_device_its_module_says_is_there_is_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    class Backend:
        @staticmethod
        def is_available() -> bool:
            return True

    monkeypatch.setattr(torch, "xpu", Backend, raising=False)
    assert [t.name for t in memlab.track("xpu").targets] == ["xpu"]
    assert [t.name for t in memlab.track("cpu:3").targets] == ["cpu"]  # (one CPU)
