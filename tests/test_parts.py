"""Every dotted name the README and the docs write (``memlab.estimate.trace.replay``,
``memlab.graphs.retained.find_retained``) is reachable as written after a plain ``import
memlab``, in a fresh process: each package imports its modules when they are first asked for."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def dotted_names() -> list[str]:
    found: set[str] = set()
    for doc in DOCS:
        for name in re.findall(r"\bmemlab(?:\.[A-Za-z_]\w*)+", doc.read_text(encoding="utf-8")):
            found.add(name)
    return sorted(found)


def test_the_docs_name_some_dotted_paths() -> None:
    names = dotted_names()
    assert "memlab.graphs.retained.find_retained" in names and len(names) > 20


def test_every_dotted_name_in_the_docs_is_reachable_after_import_memlab() -> None:
    script = (
        "import memlab, sys\n"
        "bad = []\n"
        "for name in sys.argv[1:]:\n"
        "    obj = memlab\n"
        "    try:\n"
        "        for part in name.split('.')[1:]:\n"
        "            obj = getattr(obj, part)\n"
        "    except AttributeError as e:\n"
        "        bad.append(f'{name}: {e}')\n"
        "print('\\n'.join(bad))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, *dotted_names()],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "", done.stdout


@pytest.mark.parametrize("package", ["memlab", "memlab.graphs", "memlab.estimate"])
def test_a_name_no_module_has_is_still_an_attribute_error(package: str) -> None:
    import importlib

    module = importlib.import_module(package)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_part'"):
        module.no_such_part  # noqa: B018
    assert not hasattr(module, "_private_name")
