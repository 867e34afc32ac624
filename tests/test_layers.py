"""The shape of the package: floors that import only downwards, no import cycles, private
PyTorch names only behind the seam, and modules short enough to read."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "memlab"

#: Bottom to top. A module may import from its own floor and the floors below it.
FLOORS = [
    ("core",),
    ("reports", "snapshot"),
    ("region",),
    ("graphs",),
    ("step",),
    ("magic",),
    ("estimate",),
    ("distributed",),
    ("panel",),
    # above the floors: the public aliases, the model zoo's cases, the course, the package root
    ("whatif", "examples", "course", "autoload", "__init__"),
]
#: Lower than its folder suggests: the model zoo needs only torch and the step's RunConfig.
PINNED = {"examples": 4}
#: The seam, the one module allowed to name private PyTorch attributes.
SEAM = "core/_torch.py"
#: The seam's other files: the profiler's allocation record; what autograd holds.
SEAMS = {SEAM, "core/_torch_record.py", "core/_torch_autograd.py", "core/_torch_history.py"}
#: Modules allowed over 300 lines: tables of ops, not logic.
OP_TABLES = {"estimate/autocast.py"}
MAX_LINES = 300


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def name_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor_of(module: str) -> int:
    """The floor of a module ``memlab.x.y`` (its first component below the package)."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    if top in PINNED:
        return PINNED[top]
    for i, names in enumerate(FLOORS):
        if top in names:
            return i
    raise AssertionError(f"{module} is on no floor: add memlab/{top} to FLOORS in this test")


def imports(path: Path, top_level_only: bool = False) -> list[tuple[int, str]]:
    """(line, module) for each memlab module ``path`` imports."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("memlab")]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.level == 0
            and node.module.startswith("memlab")
        ):
            found.append((node.lineno, node.module))
    return found


def test_every_module_imports_only_from_its_floor_or_below() -> None:
    upward = []
    for path in modules():
        own = floor_of(name_of(path))
        for line, target in imports(path):
            if floor_of(target) > own:
                upward.append(f"{path.relative_to(PACKAGE)}:{line} imports {target}")
    assert not upward, "imports from a higher floor:\n" + "\n".join(upward)


def test_no_import_cycles_between_modules() -> None:
    graph = {name_of(p): {t for _, t in imports(p, top_level_only=True)} for p in modules()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt in graph and not state.get(nxt):
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if not state.get(node):
            visit(node)


def test_the_floor_test_catches_an_upward_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from memlab.estimate import estimate\n")
    targets = [t for _, t in imports(bad)]
    assert [floor_of(t) > floor_of("memlab.step.run") for t in targets] == [True]


# -- private PyTorch names --------------------------------------------------------------------
#: Names bound to torch modules in memlab's sources (``import torch.nn.functional as F``, ...).
TORCH_ALIASES = {"torch", "F", "nn", "aten", "registration"}
#: Private attributes of torch objects memlab has needed, wherever they are reached from.
KNOWN_PRIVATE = {
    "_apply",
    "_sequence_nr",
    "_destroy",
    "_snapshot",
    "_record_memory_history",
    "_dump_snapshot",
    "_execution_engine",
    "_current_autograd_node",
    "_privateuse1_backend_name",
    "_cdata",
    "_typed_storage",
    "_version",
}
PRIVATE_STRING_PREFIXES = ("_saved_", "_raw_saved_", "_native_", "_transformer_", "_cudnn_")


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_torch_names(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            mod = node.module or ""
            names = [a.name for a in node.names]
            if any(p.startswith("_") for p in mod.split(".")) or any(
                n.startswith("_") for n in names
            ):
                found.append(f"{node.lineno}: from {mod} import {', '.join(names)}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("torch") and any(p.startswith("_") for p in a.name.split(".")):
                    found.append(f"{node.lineno}: import {a.name}")
        elif isinstance(node, ast.Attribute):
            attr = node.attr
            private = attr.startswith("_") and not attr.startswith("__")
            if private and (_root(node) in TORCH_ALIASES or attr in KNOWN_PRIVATE):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith(PRIVATE_STRING_PREFIXES)
        ):
            found.append(f"{node.lineno}: {node.value!r}")
    return found


def test_private_torch_names_only_in_the_seam() -> None:
    outside = []
    for path in modules():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in SEAMS:
            continue
        outside += [f"{rel}:{hit}" for hit in private_torch_names(path.read_text())]
    assert not outside, "private torch names outside memlab/core/_torch.py:\n" + "\n".join(outside)


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ntorch._C._current_autograd_node()\n",
        "from torch.utils._python_dispatch import TorchDispatchMode\n",
        "model._apply(fn)\n",
        "names = [n for n in dir(node) if n.startswith('_saved_')]\n",
        "import torch.nn.functional as F\nF._canonical_mask\n",
    ],
)
def test_the_seam_test_catches_a_private_name(source: str) -> None:
    assert private_torch_names(source)


def test_the_seam_names_its_reasons() -> None:
    """Each private name in the seam is documented with the releases it was checked on."""
    for seam in sorted(SEAMS):
        text = (PACKAGE / seam).read_text()
        for node in ast.parse(text).body:
            if isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef)
            ) and not node.name.startswith("_"):
                doc = ast.get_docstring(node) or ""
                assert doc, f"{node.name} in {seam} has no docstring saying why"
    assert (PACKAGE / SEAM).read_text().count("Checked") >= 10


def test_modules_stay_short() -> None:
    long = []
    for path in modules():
        rel = path.relative_to(PACKAGE).as_posix()
        n = len(path.read_text().splitlines())
        if n > MAX_LINES and rel not in OP_TABLES:
            long.append(f"{rel}: {n} lines")
    assert not long, f"modules over {MAX_LINES} lines (split them by concept):\n" + "\n".join(long)
