"""Sparse tensors (COO, CSR, CSC, BSR) hold their bytes in dense indices and values tensors: the
accounting counts those storages, made and freed, against the storages the test reads itself."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import run

import memlab

pytestmark = pytest.mark.filterwarnings("ignore:Sparse .* support is in beta")


PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
}


def _storages(*tensors: torch.Tensor) -> dict[int, Any]:
    """The distinct storages behind the sparse tensors' parts, by address."""
    found = {}
    for t in tensors:
        for name in PARTS[t.layout]:
            st = getattr(t, name)().untyped_storage()
            found[st.data_ptr()] = st
    return found


def _new_bytes(made: torch.Tensor, before: torch.Tensor) -> int:
    old = _storages(before)
    return sum(st.nbytes() for ptr, st in _storages(made).items() if ptr not in old)


MAKERS = {
    "coo": lambda d: d.to_sparse(),
    "csr": lambda d: d.to_sparse_csr(),
    "csc": lambda d: d.to_sparse_csc(),
    "bsr": lambda d: d.to_sparse_bsr((2, 2)),
}


@pytest.mark.parametrize("layout", MAKERS)
def test_a_sparse_result_counts_its_indices_and_values(layout: str) -> None:
    dense = torch.zeros(64, 64)
    dense[::3, ::2] = 1.0
    s = MAKERS[layout](dense)
    with memlab.track("cpu") as t:
        made = s * 2
    expected = _new_bytes(made, s)
    assert expected > 0
    assert t.report.allocated_delta == expected, layout
    assert t.report.peak_delta >= expected


def test_a_sparse_tensor_made_and_dropped_in_the_region_is_freed() -> None:
    s = torch.eye(128).to_sparse()
    with memlab.track("cpu") as t:
        made = s * 2
        expected = _new_bytes(made, s)
        del made
    assert t.report.allocated_delta == 0
    assert t.report.peak_delta >= expected > 0


def test_a_coo_tensor_not_coalesced_is_counted_as_it_is() -> None:
    u = torch.sparse_coo_tensor(
        torch.tensor([[0, 0, 1], [1, 1, 0]]),
        torch.tensor([1.0, 2.0, 3.0]),
        (2, 2),
        check_invariants=False,
    )
    with memlab.track("cpu") as t:
        v = u + u  # concatenated indices and values: still not coalesced
    assert not v.is_coalesced()
    assert t.report.allocated_delta == _new_bytes(v, u) > 0


def test_gpumem_reports_a_sparse_result(ip: Any) -> None:
    run(ip, "coo = torch.ones(100, 100).to_sparse()")
    r = run(ip, "%%gpumem -d cpu -q -o rep\nc2 = coo * 2")
    assert r.success, r.error_in_exec
    made, before = ip.user_ns["c2"], ip.user_ns["coo"]
    assert ip.user_ns["rep"].allocated_delta == _new_bytes(made, before) == 200_000
