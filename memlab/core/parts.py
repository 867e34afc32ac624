"""Each of memlab's packages reaches its modules as attributes, imported when first asked for:
``memlab.estimate.trace.replay(...)`` or ``memlab.graphs.retained.find_retained(...)``, as the
docs write them, work after a plain ``import memlab``, without importing every module with it."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType


def is_part(folder: Path, name: str) -> bool:
    """Whether ``name`` is a module or package in ``folder`` (a package's own folder)."""
    if not name.isidentifier() or name.startswith("_"):
        return False
    return (folder / name / "__init__.py").is_file() or (folder / f"{name}.py").is_file()


def part(package: str, file: str, name: str) -> ModuleType:
    """The module ``name`` of ``package`` (whose ``__init__`` is ``file``), imported; an
    AttributeError, as Python's own, where it has none."""
    if is_part(Path(file).parent, name):
        return importlib.import_module(f"{package}.{name}")
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
