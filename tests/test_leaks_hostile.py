"""The leak finder among hostile objects: it runs none of their code, skips what it cannot read
and says how many it skipped; big, deep and cyclic namespaces take bounded work."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from conftest import run

from memlab.graphs import scan
from memlab.graphs.retained import find_retained
from memlab.graphs.scan import MAX_ITEMS, Skipped, tensors_in

#: Every call into a hostile object's code lands here (none should).
CALLS: list[str] = []


def boom(what: str) -> Any:
    CALLS.append(what)
    raise RuntimeError(f"{what} was called")


class BadClass:
    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return boom("__class__")  # type: ignore[no-any-return]


class RequestProxy:
    """What web frameworks' lazy proxies do: every attribute goes to an object that is not
    there."""

    def __getattr__(self, name: str) -> Any:
        CALLS.append(f"__getattr__({name})")
        raise RuntimeError("working outside of request context")


class BadGetattribute:
    def __getattribute__(self, name: str) -> Any:
        return boom(f"__getattribute__({name})")


class BadLen(list):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return boom("__len__")  # type: ignore[no-any-return]

    def __iter__(self) -> Any:
        return boom("__iter__")


class BadDict(dict):  # type: ignore[type-arg]
    def items(self) -> Any:
        return boom("items")

    def __iter__(self) -> Any:
        return boom("dict __iter__")

    def __len__(self) -> int:
        return boom("dict __len__")  # type: ignore[no-any-return]


class BadEq:
    def __eq__(self, other: object) -> bool:
        return boom("__eq__")  # type: ignore[no-any-return]

    def __hash__(self) -> int:
        return boom("__hash__")  # type: ignore[no-any-return]


class BadRepr:
    def __repr__(self) -> str:
        return boom("__repr__")  # type: ignore[no-any-return]


class BadDel:
    def __del__(self) -> None:
        CALLS.append("__del__")


class SideEffects:
    """A property that is slow and changes state: reading it is the user's business."""

    def __init__(self, holds: Any) -> None:
        self.holds = holds

    @property
    def heavy(self) -> int:
        CALLS.append("heavy")
        time.sleep(5)
        return 1


class OwnDictProperty:
    @property
    def __dict__(self) -> dict[str, Any]:  # type: ignore[override]
        return boom("__dict__ property")  # type: ignore[no-any-return]


class Meta(type):
    def __hash__(cls) -> int:
        return boom("metaclass __hash__")  # type: ignore[no-any-return]

    def __eq__(cls, other: object) -> bool:
        return boom("metaclass __eq__")  # type: ignore[no-any-return]


class WithMeta(metaclass=Meta):
    pass


def one_forward() -> tuple[torch.Tensor, int]:
    """An output that keeps its graph, and the bytes only that graph keeps alive."""
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    # The matmul saves its input x (held by no variable), ReLU its result: 8 x 64 floats each.
    out = torch.relu(torch.randn(8, 64) @ w).sum()
    return out, 2 * 8 * 64 * 4


HOSTILE = {
    "bad_class": BadClass,
    "proxy": RequestProxy,
    "bad_getattribute": BadGetattribute,
    "bad_len": lambda: BadLen([1, 2]),
    "bad_dict": lambda: BadDict(a=1),
    "bad_eq": BadEq,
    "bad_repr": BadRepr,
    "bad_del": BadDel,
    "side_effects": lambda: SideEffects(3),
    "own_dict_property": OwnDictProperty,
    "with_meta": WithMeta,
}


@pytest.fixture(autouse=True)
def no_calls() -> Any:
    CALLS.clear()
    yield
    CALLS.clear()


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_object_beside_a_leak_runs_none_of_its_code(kind: str) -> None:
    out, expected = one_forward()
    namespace = {"hostile": HOSTILE[kind](), "losses": [out]}
    report = find_retained(namespace)
    assert CALLS == []
    assert [(i.name, i.bytes) for i in report.items] == [("losses", expected)]
    str(report), report._repr_html_(), report.to_dict()  # renders too


@pytest.mark.parametrize("kind", sorted(set(HOSTILE) - {"bad_len", "bad_dict"}))
def test_a_tensor_held_by_a_hostile_object_is_found_where_it_can_be_read(kind: str) -> None:
    out, expected = one_forward()
    holder = HOSTILE[kind]()
    try:
        object.__setattr__(holder, "kept", out)  # in its own __dict__, where there is one
    except (AttributeError, TypeError):
        pytest.skip("no instance dict")
    report = find_retained({"holder": holder})
    assert CALLS == []
    if kind == "own_dict_property":  # the class defines __dict__ itself: unread, and said so
        assert report.items == ()
        assert report.notes == (
            "skipped 1 object(s) whose attributes could not be read (their code was not run)",
        )
    else:
        assert report.total == expected
        assert report.items[0].example == "holder.kept"


def test_containers_are_read_through_their_base_class_and_keys_without_repr() -> None:
    out, expected = one_forward()
    bad_list = BadLen([out])
    bad_dict = BadDict({BadRepr(): out})
    report = find_retained({"bad_list": bad_list, "bad_dict": bad_dict})
    assert CALLS == []
    assert report.total == expected  # one graph, reachable twice, charged once
    assert report.items[0].example == "bad_list[0]"
    report = find_retained({"bad_dict": bad_dict})
    assert report.items[0].example == "bad_dict[<BadRepr>]"


def test_the_report_counts_what_it_skipped() -> None:
    out, expected = one_forward()
    opaque = torch.randn(2, 2).to_mkldnn()  # no storage to read
    namespace = {"a": OwnDictProperty(), "b": OwnDictProperty(), "s": opaque, "out": out}
    report = find_retained(namespace)
    assert report.total == expected
    assert report.notes == (
        "skipped 2 object(s) whose attributes could not be read (their code was not run)",
        "skipped 1 tensor(s) whose storage could not be read (a tensor without storage, as an "
        "MKL-DNN one): not counted",
    )
    assert "skipped 2 object(s)" in str(report) and "skipped 2 object(s)" in report._repr_html_()
    assert report.to_dict()["notes"] == list(report.notes)
    clean = find_retained({"out": out})
    assert clean.notes == () and "skipped" not in str(clean)


def test_sparse_tensors_are_counted_by_their_values_and_indices() -> None:
    s = torch.randn(6, 6).to_sparse().requires_grad_()  # a coalesced leaf
    soft = torch.sparse.softmax(s, 0)  # saves its sparse result
    dense = soft.to_dense()
    with torch.no_grad():
        parts = {id(t.untyped_storage()): t.untyped_storage() for t in (s.indices(), s.values())}
        kept = [soft.indices().untyped_storage(), soft.values().untyped_storage()]
    expected = sum(
        st.nbytes() for st in {id(st): st for st in kept}.values() if id(st) not in parts
    )
    report = find_retained({"dense": dense, "s": s})
    assert report.notes == ()
    assert [(i.name, i.bytes) for i in report.items] == [("dense", expected)]
    assert find_retained({"s": s, "soft": soft}).total == 0  # held by a variable anyway


def test_cycles_are_visited_once() -> None:
    out, expected = one_forward()
    a: list[Any] = [out]
    b: dict[str, Any] = {"a": a}
    a.append(b)
    a.append(a)
    node = SideEffects(None)
    node.holds = node
    report = find_retained({"a": a, "b": b, "node": node}, depth=50)
    assert report.total == expected and CALLS == []


def test_nesting_deeper_than_the_recursion_limit() -> None:
    out, expected = one_forward()
    nested: list[Any] = [out]
    for _ in range(5_000):
        nested = [nested]
    report = find_retained({"nested": nested}, depth=10_000)
    assert report.total == expected
    assert report.items[0].example == "nested" + "[0]" * 5_001
    assert find_retained({"nested": nested}).total == 0  # default depth: 3 levels


def test_a_huge_container_is_cut_and_the_cut_is_said() -> None:
    out, expected = one_forward()
    huge: list[Any] = list(range(1_000_000))
    huge.append(out)  # past the first MAX_ITEMS: not looked at
    report = find_retained({"huge": huge, "small": [out]})
    assert report.total == expected and report.items[0].name == "small"
    assert report.notes == (
        f"skipped {1_000_001 - MAX_ITEMS:,} container item(s) past the first {MAX_ITEMS:,} of a "
        "container (not looked at)",
    )


def test_the_scan_stops_after_max_objects_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scan, "MAX_OBJECTS", 100)
    skipped = Skipped()
    many = [[i] for i in range(500)]
    found = list(tensors_in([("many", many)], 3, skipped))
    assert found == []
    assert skipped.counts["objects"] > 0
    assert "the scan stops after 100 objects" in skipped.notes()[0]


def test_the_work_is_linear_in_the_objects_looked_at(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each object is classified once (by type, without its code): count the classifications."""
    counted = []
    real = scan._children

    def counting(value: Any, tp: type, dicts: Any) -> Any:
        counted.append(1)
        return real(value, tp, dicts)

    monkeypatch.setattr(scan, "_children", counting)
    shared = [object() for _ in range(100)]
    namespace = {f"v{i}": [shared, {"x": shared}] for i in range(100)}
    find_retained(namespace)
    # 100 variables x (their list + its dict) + the shared list + its 100 objects
    assert len(counted) == 100 * 2 + 1 + 100


def test_names_that_are_not_strings_and_private_names_are_ignored() -> None:
    out, _ = one_forward()
    namespace: dict[Any, Any] = {5: out, "_hidden": out, "In": [out]}
    assert find_retained(namespace, skip={"In"}).items == ()
    assert CALLS == []


def test_the_magic_survives_a_hostile_namespace(ip: Any) -> None:
    ip.user_ns.update({k: make() for k, make in HOSTILE.items()})
    ip.user_ns["opaque"] = torch.randn(2, 2).to_mkldnn()  # no storage to read
    assert run(ip, "w = torch.randn(64, 64, requires_grad=True)\nouts = []").success
    assert run(
        ip, "for _ in range(3):\n    outs.append(torch.relu(torch.randn(8, 64) @ w))"
    ).success
    ip.rec.clear()
    r = run(ip, "%gpumem_leaks -o leaks")
    assert r.success, r.error_in_exec
    assert CALLS == []
    leaks = ip.user_ns["leaks"]
    assert [(i.name, i.bytes) for i in leaks.items] == [("outs", 3 * 8 * 64 * 4)]  # the inputs
    html = ip.rec.html()[0]
    assert "<code>outs</code>" in html
    assert "skipped 1 object(s) whose attributes could not be read" in html
    assert "skipped 1 tensor(s) whose storage could not be read" in html
    for name in HOSTILE:
        ip.user_ns.pop(name, None)


def test_the_graph_of_an_unreadable_tensor_is_still_looked_at() -> None:
    u = torch.randn(2, 2).to_mkldnn().requires_grad_()  # no storage to read
    v = u * torch.tensor(3.0)  # an MKL-DNN tensor too; its graph saved the 0-d float factor
    report = find_retained({"v": v})
    assert [(i.name, i.bytes) for i in report.items] == [("v", 4)]
    assert report.notes[0].startswith("skipped 1 tensor(s) whose storage could not be read")


def test_a_sparse_tensor_not_coalesced_is_read_as_it_is() -> None:
    u = torch.sparse_coo_tensor(
        torch.tensor([[0, 0], [1, 1]]), torch.tensor([1.0, 2.0]), (2, 2), check_invariants=False
    ).requires_grad_()
    v = u * torch.tensor(3.0)  # not coalesced either; its graph saved the 0-d float factor
    assert not v.is_coalesced()
    report = find_retained({"v": v})
    assert [(i.name, i.bytes) for i in report.items] == [("v", 4)]
    assert report.notes == ()  # its indices and values were read, without coalescing it
    assert not v.is_coalesced()


class Slotted:
    __slots__ = ("loss", "unset")

    def __getattr__(self, name: str) -> Any:
        return boom(f"__getattr__({name})")


def test_slots_are_read_through_their_descriptors() -> None:
    out, expected = one_forward()
    holder = Slotted()
    holder.loss = out
    report = find_retained({"holder": holder})
    assert [(i.name, i.bytes, i.example) for i in report.items] == [
        ("holder", expected, "holder.loss")
    ]
    assert CALLS == [] and report.notes == ()
