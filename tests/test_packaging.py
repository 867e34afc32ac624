"""The package's promises about itself: light import, no CUDA init, lint and types clean."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def python(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    return out.stdout.strip()


def test_import_memlab_pulls_in_nothing_heavy() -> None:
    heavy = python(
        "import sys, memlab\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'IPython', 'ipywidgets', 'matplotlib', 'graphviz', 'torchviz', 'ipykernel'}))"
    )
    assert heavy == "[]"


def test_loading_the_extension_does_not_initialise_cuda_or_change_the_process() -> None:
    out = python(
        "import os, sys, torch, warnings\n"
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "ip = InteractiveShell.instance()\n"
        "env = dict(os.environ); filters = list(warnings.filters)\n"
        "ip.run_line_magic('load_ext', 'memlab')\n"
        "print(torch.cuda.is_initialized(), env == dict(os.environ), "
        "filters == warnings.filters, 'matplotlib' in sys.modules)"
    )
    assert out == "False True True False"


def test_py_typed_is_shipped() -> None:
    assert (ROOT / "memlab" / "py.typed").exists()


def tool(name: str) -> str:
    exe = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if exe is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return exe


@pytest.mark.parametrize(
    "cmd",
    [
        ["ruff", "check", "memlab", "tests", "benchmarks", "scripts"],
        ["ruff", "format", "--check", "memlab", "tests", "benchmarks", "scripts"],
        ["mypy"],
    ],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_lint_and_types(cmd: list[str]) -> None:
    result = subprocess.run([tool(cmd[0]), *cmd[1:]], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


#: torch.cuda.empty_cache (memlab.estimate's allocator model has an empty_cache of its own,
#: which is not torch's), gc.collect, tracing and profiling hooks, logging set-up.
FORBIDDEN = [
    r"cuda\.empty_cache\(",
    r"import[^\n]*\bempty_cache\b",
    r"gc\.collect\(",
    r"\bsettrace\(",
    r"\bsetprofile\(",
    r"basicConfig\(",
]


def _code_only(text: str) -> str:
    """``text`` with its strings and comments blanked (same length and lines): advice to the
    user that names a call ("call gc.collect() before a run") is not a call."""
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    chars = list(text)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT):
            a = starts[tok.start[0] - 1] + tok.start[1]
            b = starts[tok.end[0] - 1] + tok.end[1]
            chars[a:b] = [c if c == "\n" else " " for c in chars[a:b]]
    return "".join(chars)


def test_the_call_check_reads_code_not_words() -> None:
    called = 'import gc\n\ndef f():\n    gc.collect()  # "quoted"\n'
    said = (
        'def f():\n    """Call gc.collect() first."""\n    print("gc.collect()")  # gc.collect()\n'
    )
    assert re.search(FORBIDDEN[2], _code_only(called))
    assert not re.search(FORBIDDEN[2], _code_only(said))


def test_memlab_never_calls_what_would_change_the_users_process() -> None:
    for path in sorted((ROOT / "memlab").rglob("*.py")):
        text = _code_only(path.read_text())
        for pattern in FORBIDDEN:
            found = re.search(pattern, text)
            assert found is None, f"{path.relative_to(ROOT)}: {found.group(0) if found else ''}"


def test_torchviz_imports_with_the_declared_dependencies() -> None:
    # torchviz still imports distutils, which Python 3.12 removed (setuptools provides it there)
    assert python("import torchviz; print(callable(torchviz.make_dot))") == "True"
