"""`%%gpumem --gpu`'s explanation names what holds the memory: what earlier cells left when that
alone does not fit, the variables behind a module's parameters, and only `del` levers that
would change the peak."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from conftest import run

from memlab.core.ledger import Ledger
from memlab.estimate.holders import module_tensors, variable_names, variable_root
from memlab.reports.units import fmt_bytes

KiB = 1024
MiB = 2**20


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from memlab.core import devices

    monkeypatch.setattr(devices, "_cuda_count", lambda: 0)


def _preflight(ip: Any) -> str:
    texts = [d["text/plain"] for _, d in ip.rec.items if "pre-flight on" in d["text/plain"]]
    assert len(texts) == 1, ip.rec.items
    return str(texts[0])


def test_what_earlier_cells_left_not_fitting_is_said_so_with_its_variables(ip: Any) -> None:
    # made in an untracked cell: the ledger discovers them as the tracked cell opens
    assert run(ip, "keep = torch.nn.Linear(2048, 2048)\nh = torch.empty(96 * 2**20 // 4)").success
    cell = "%%gpumem --gpu 0.6GiB -o pf\ny = torch.ones(10)\n"
    assert run(ip, cell).success and ip.user_ns["y"].shape == (10,)
    text = _preflight(ip)
    left = sum(
        t.untyped_storage().nbytes()
        for t in (ip.user_ns["h"], ip.user_ns["keep"].weight, ip.user_ns["keep"].bias)
    )
    pf = ip.user_ns["pf"]
    assert pf.before == left and pf.to_dict()["before"] == left and not pf.fits
    assert "would run OUT OF MEMORY before this cell begins" in text
    assert f"what earlier cells left on the device ({fmt_bytes(left)})" in text
    assert "the request alone" not in text and pf.oom.line is None
    # every storage from before is listed, under the variable that holds it (a module's as
    # one line: `del keep` frees them all)
    assert dict(pf.oom.by_name) == {"h": 96 * MiB, "keep (2 tensors)": 16 * MiB + 2048 * 4}
    lever = re.search(r"del h +([\d.]+) MiB fits", text)
    assert lever is not None and float(lever.group(1)) < 102  # without h it fits
    # a cell that fits afterwards says so
    assert run(ip, "del h").success
    assert run(ip, cell).success and ip.user_ns["pf"].fits and ip.user_ns["pf"].before == 0


def test_a_cell_of_its_own_that_does_not_fit_is_unchanged(ip: Any) -> None:
    cell = "%%gpumem --gpu 0.6GiB -o pf\nw = torch.empty(8)\nbig = torch.empty(200 * 2**20 // 4)\n"
    assert run(ip, cell).success
    pf = ip.user_ns["pf"]
    assert pf.before == 0 and pf.oom.line == 3
    assert "at line 3" in _preflight(ip)


def test_a_module_s_parameters_are_named_and_useless_del_levers_left_out(ip: Any) -> None:
    assert run(ip, "w = torch.randn(8, 10)").success
    cell = (
        "%%gpumem --gpu 0.6GiB -o pf\n"
        "big = torch.nn.Linear(2048, 2048)\n"
        "h = torch.empty(60 * 2**20 // 4)\n"
        "g = torch.empty(40 * 2**20 // 4)\n"
    )
    assert run(ip, cell).success
    pf, text = ip.user_ns["pf"], _preflight(ip)
    names = dict(pf.oom.by_name)
    assert names["big (2 tensors)"] == 16 * MiB + 8 * KiB and names["h"] == 60 * MiB
    assert any("big.weight" in t.names for t in pf.oom.biggest)  # each tensor by its name
    assert "del w" not in text  # 320 bytes: dropping it changes nothing
    assert "del h" in text


def test_module_tensors_reads_the_modules_own_dicts_and_names_a_shared_one_once() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight
            self.norm = torch.nn.BatchNorm1d(3)

    m = Tied()

    def refuse(self: Any, name: str) -> Any:  # the user's own code never runs
        raise AssertionError(f"read {name}")

    Tied.__getattr__ = refuse  # type: ignore[method-assign,assignment]
    found = module_tensors(m)
    paths = [p for p, _ in found]
    assert paths[0] == "emb.weight" and "head.weight" not in paths
    assert {"norm.weight", "norm.bias", "norm.running_mean", "norm.running_var"} <= set(paths)
    assert len({id(t) for _, t in found}) == len(found)
    # a deep chain stays bounded
    deep = torch.nn.Sequential(*[torch.nn.Sequential() for _ in range(50)])
    assert module_tensors(deep, limit=10) == []


def test_variable_names_and_roots() -> None:
    ledger = Ledger()
    model = torch.nn.Linear(2, 2)
    for t in (model.weight, model.bias):
        ledger.existing(t, t.untyped_storage())
    names = variable_names(ledger, {"model": model, "_hidden": model, 3: model})
    assert sorted(n for ns in names.values() for n in ns) == ["model.bias", "model.weight"]
    assert variable_root("model.fc.weight") == "model" and variable_root("b['x']") == "b"
    assert variable_root("plain") == "plain"
