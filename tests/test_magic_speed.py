"""Per-cell cost: the magic looks again only at the namespace's names that changed, and a
breakdown sums the storages a cell never touched once, without changing a figure.
Timings: benchmarks/bench_cells.py."""

from __future__ import annotations

import gc
import sys
import weakref
from typing import Any

import pytest
import torch
from conftest import run

from memlab.core.categories import Category
from memlab.magic.namespace import NamespaceWatch, watchable


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from memlab.core import devices

    monkeypatch.setattr(devices, "_cuda_count", lambda: 0)


def before(ip: Any) -> int:
    run(ip, "%%gpumem -q -o _r\na = 1")
    return int(ip.user_ns["_r"].allocated_before)


def test_tensors_made_in_untracked_cells_count_before_the_next_tracked_cell(ip: Any) -> None:
    run(ip, "x = torch.zeros(1000)")
    assert before(ip) == 4000
    run(ip, "y = torch.zeros(500, dtype=torch.float64)")
    assert before(ip) == 4000 + 4000
    run(ip, "x = torch.zeros(10)")  # rebound: the old x is gone, the new one is seen
    assert before(ip) == 40 + 4000
    run(ip, "del y\nbox = [torch.zeros(3)]")
    assert before(ip) == 40 + 12
    run(ip, "box.append(torch.zeros(5))")  # a list changes without a new binding
    assert before(ip) == 40 + 12 + 20


def test_the_watch_hands_out_what_changed_and_what_can_change_unbound() -> None:
    model, plain, leaf = torch.nn.Linear(2, 2), torch.zeros(3), torch.ones(2, requires_grad=True)
    ns: dict[str, Any] = {"model": model, "plain": plain, "leaf": leaf, "n": 1, "box": [plain]}
    watch = NamespaceWatch(ns)
    first = watch()
    assert {id(o) for o in first} == {id(o) for o in watchable(ns)}
    again = watch()  # nothing rebound: the module, the leaf and the list's contents only
    assert sorted(map(id, again)) == sorted(map(id, [model, leaf, plain]))
    ns.pop("box")
    assert sorted(map(id, watch())) == sorted(map(id, [model, leaf]))
    fresh = torch.zeros(4)
    ns["plain"] = fresh
    assert sorted(map(id, watch())) == sorted(map(id, [model, leaf, fresh]))
    ns["plain"] = 3  # rebound to something not watched, then deleted
    del ns["leaf"]
    assert [id(o) for o in watch()] == [id(model)]


@pytest.mark.parametrize("n", [0, 1, 5000])
def test_the_identities_read_as_pointers_are_pythons_ids(n: int) -> None:
    """Values numpy would unpack (tensors, lists, arrays) stay whole, and each reads as id()."""
    import numpy as np

    from memlab.magic.namespace import identities

    kinds = [torch.zeros(3), [1, 2], np.ones(2), "text", 7, None, (torch.ones(1),)]
    ns = {f"v{i}": kinds[i % len(kinds)] if i % 2 else object() for i in range(n)}
    ids = identities(ns.values(), len(ns))
    assert ids.shape == (n,) and ids.tolist() == [id(v) for v in ns.values()]
    held = [sys.getrefcount(v) for v in kinds]
    identities(ns.values(), len(ns))
    assert [sys.getrefcount(v) for v in kinds] == held  # nothing kept


def test_the_watch_keeps_nothing_alive() -> None:
    ns: dict[str, Any] = {"m": torch.nn.Linear(3, 3), "w": torch.ones(2, requires_grad=True)}
    watch = NamespaceWatch(ns)
    assert len(watch()) == 2
    refs = [weakref.ref(ns.pop("m")), weakref.ref(ns.pop("w"))]
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert watch() == []


def test_a_breakdown_counts_the_storages_a_cell_never_touched(ip: Any) -> None:
    run(ip, "many = {}\nfor i in range(300): globals()[f'_t{i}'] = torch.zeros(100)")
    run(ip, "lin = torch.nn.Linear(10, 10)\nlin(torch.ones(1, 10)).sum().backward()")
    run(ip, "%%gpumem -q -b -o r\nz = torch.ones(25)")
    r = ip.user_ns["r"]
    assert r.allocated_before == 300 * 400 + (400 + 40) * 2
    at_end = r.breakdown.at_end
    assert at_end[Category.PARAMETER] == 400 + 40
    assert at_end[Category.GRADIENT] == 400 + 40
    assert at_end[Category.OTHER] == 300 * 400 + 100  # the names untouched, and z
    assert r.breakdown.at_peak == at_end and r.breakdown.highest == at_end
    assert sum(at_end.values()) == r.allocated_after


@pytest.fixture(params=["C", "numpy"])
def scan_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways the watch finds what changed: the library's pass over the dict in C, and the
    values' identities as a numpy array (where the library is not loaded)."""
    from memlab.core.native import pack, unavailable

    if request.param == "C":
        if unavailable() is not None or pack.wait() is not None:
            pytest.skip("memlab's library is not built here")
        assert pack.namespace_scan() is not None
    else:
        monkeypatch.setattr(pack, "_changed", None)
    return str(request.param)


def test_the_watch_finds_exactly_the_names_bound_rebound_or_deleted(scan_path: str) -> None:
    """Random edits of a namespace (names added, rebound to another object or to the same one,
    deleted, deleted and bound again, all cleared): each scan names exactly the names whose
    value is another object than at the last scan, or that came or went."""
    import random

    rng = random.Random(7)
    pool = [object() for _ in range(50)]  # (all alive: no address is reused)
    ns: dict[str, Any] = {f"v{i}": pool[i % 50] for i in range(300)}
    watch = NamespaceWatch(ns)
    last = {k: id(v) for k, v in ns.items()}
    assert watch._changed(ns) == set(last)
    for round_ in range(200):
        for _ in range(rng.choice([0, 1, 3, 20])):
            name = f"v{rng.randrange(400)}"
            what = rng.random()
            if what < 0.45:
                ns[name] = rng.choice(pool)
            elif what < 0.6 and name in ns:
                ns[name] = ns[name]  # the same object: not a change
            elif what < 0.8:
                ns.pop(name, None)
            else:
                value = ns.pop(name, rng.choice(pool))
                ns[name] = value  # moved to the end
        if round_ % 40 == 39:  # (many names at once: the dict's table is rebuilt)
            for i in range(rng.randrange(100, 400)):
                ns[f"w{round_}_{i}"] = rng.choice(pool)
        if round_ % 50 == 25:  # a key that is no string, set and taken away (not looked at)
            ns[round_] = pool[0]  # type: ignore[index]
        if round_ % 50 == 30:
            ns.pop(round_ - 5, None)  # type: ignore[call-overload]
        if round_ == 150:
            ns.clear()
        now = {k: id(v) for k, v in ns.items() if type(k) is str}
        expected = {k for k in now if last.get(k) != now[k]} | (last.keys() - now.keys())
        assert watch._changed(ns) == expected, round_
        last = now


def test_the_scan_in_c_holds_the_names_only_and_refuses_what_is_not_its_record() -> None:
    from memlab.core.native import pack, unavailable

    if unavailable() is not None or pack.wait() is not None:
        pytest.skip("memlab's library is not built here")
    scan = pack.namespace_scan()
    value = object()
    name = "".join(["a", "name"])  # (not interned: its count is this test's)
    ns = {name: value}
    held = sys.getrefcount(value), sys.getrefcount(name)
    keys: list[Any] = []
    ids = bytearray()
    # (this Python's dicts read as their entry table: 16 bytes a slot, the key's and value's)
    assert scan(ns, keys, ids) == [name] and keys == [name] and len(ids) == len(keys) * 16
    assert sys.getrefcount(value) == held[0]  # the value is not held
    assert sys.getrefcount(name) == held[1] + 1  # the name is, by the record
    assert scan(ns, keys, ids) == []
    assert scan(ns, keys, bytearray(3)) is None  # a record that is not one: compared as dicts
    assert scan({}, keys, ids) is None  # names deleted
    del ns[name]  # (a slot emptied: the record lets the name go)
    assert scan(ns, keys, ids) == [name] and keys == [None]
    assert sys.getrefcount(name) == held[1] - 1
    # a dict with a key that is no string is read by one pass over it: 8 bytes a name
    other: dict[Any, Any] = {1: value, name: value}
    keys, ids = [], bytearray()
    assert scan(other, keys, ids) == [1, name] and len(ids) == 16
    assert scan(other, keys, ids) == [] and scan(other, [], bytearray(16)) is None
    for bad in [([], keys, ids), (ns, (), ids), (ns, keys, b"")]:
        with pytest.raises(TypeError):
            scan(*bad)


EVIL = """
class Evil:
    armed = False
    def __hash__(self):
        if Evil.armed: raise RuntimeError('no hash')
        return 1
    def __eq__(self, other):
        if Evil.armed: raise RuntimeError('no eq')
        return self is other
class Meta(type):
    armed = False
    def __hash__(cls):
        if Meta.armed: raise RuntimeError('no type hash')
        return 2
class Odd(metaclass=Meta):
    pass
"""


def test_keys_and_types_that_refuse_to_hash_never_stop_a_tracked_cell(
    ip: Any, scan_path: str
) -> None:
    """A key set through globals() whose hash and == raise, and a value whose type's hash
    raises: the cell still runs, keeps its value and its report, and a tensor bound in an
    untracked cell is still counted before the next tracked one."""
    run(ip, EVIL)
    run(ip, "key = Evil()\nglobals()[key] = torch.zeros(3)\nodd = Odd()")
    run(ip, "Evil.armed = Meta.armed = True")
    try:
        run(ip, "x = torch.zeros(250)")
        result = run(ip, "%%gpumem -q -o _r\ny = torch.ones(5)\ny.sum()")
        assert result.success and float(result.result) == 5.0
        assert ip.user_ns["_r"].allocated_before >= 1000  # (x, seen by the scan)
        run(ip, "odd2 = Odd()")
        result = run(ip, "%%gpumem -q\n7")
        assert result.success and result.result == 7
    finally:
        run(ip, "Evil.armed = Meta.armed = False\ndel globals()[key]")


def test_a_region_that_cannot_start_still_runs_the_cell_and_says_why(
    ip: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """memlab's own failure while a tracked cell's region starts: the cell runs, keeps its
    value and names, and the magic says there is no report and why."""
    from memlab.core.native import region as native_region

    def broken(self: Any) -> None:
        raise RuntimeError("memlab's own bug at the start")

    monkeypatch.setattr(native_region.NativeRegion, "start", broken)
    from memlab.core import recorder

    monkeypatch.setattr(recorder.Recorder, "start", broken)
    result = run(ip, "%%gpumem -q\nkept = 41\nkept + 1")
    assert result.success and result.result == 42 and ip.user_ns["kept"] == 41
    said = capsys.readouterr().out
    assert "no report for this cell" in said and "memlab's own bug at the start" in said
    result = run(ip, "%%gpumem -q\nraise KeyError('mine')")  # the cell's own error, as it is
    assert isinstance(result.error_in_exec, KeyError)
