"""The package's promises about itself: light import, no CUDA init, lint and types clean."""

from __future__ import annotations

import io
import re
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


def test_every_part_of_memlab_is_reachable_after_a_plain_import() -> None:
    """``import memlab`` then ``memlab.distributed.launch(...)`` (as the docs write it): every
    module and package of memlab is an attribute, imported when first used; other names are
    still an AttributeError."""
    import pkgutil

    import memlab

    names = sorted(m.name for m in pkgutil.iter_modules(memlab.__path__) if m.name[0] != "_")
    assert {"distributed", "whatif", "estimate", "snapshot"} <= set(names)
    out = python(
        "import sys, memlab\n"
        f"for name in {names!r}:\n"
        "    print(name, getattr(memlab, name).__name__ == 'memlab.' + name)\n"
        "for name in ('nope', '_torch', 'os'):\n"
        "    try:\n"
        "        getattr(memlab, name)\n"
        "    except AttributeError:\n"
        "        print(name, 'refused')\n"
    )
    assert out.splitlines() == [f"{n} True" for n in names] + [
        "nope refused",
        "_torch refused",
        "os refused",
    ]


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
    from types_early import executable

    exe = executable(name)
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
def test_lint_and_types(cmd: list[str], request: pytest.FixtureRequest) -> None:
    if cmd == ["mypy"]:  # (started when the tests were collected: `tests/types_early.py`)
        import types_early
        from conftest import _shared

        early = types_early.result(_shared(request.config))
        if early is not None:
            status, output = early
            assert status == 0, output
            return
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


#: The one exception, and why: a CPU region's threads join it through the profile hook the
#: threading module gives each thread it starts; the hook is set while the region is open and
#: put back after, and each new thread gets the hook it would have had at its first call
#: (tests/test_native_threads.py checks both).
ALLOWED = {("memlab/core/native/joiner.py", r"\bsetprofile\(")}


def test_memlab_never_calls_what_would_change_the_users_process() -> None:
    for path in sorted((ROOT / "memlab").rglob("*.py")):
        text = _code_only(path.read_text())
        where = str(path.relative_to(ROOT))
        for pattern in FORBIDDEN:
            if (where, pattern) in ALLOWED:
                continue
            found = re.search(pattern, text)
            assert found is None, f"{path.relative_to(ROOT)}: {found.group(0) if found else ''}"


def test_torchviz_imports_with_the_declared_dependencies() -> None:
    # torchviz still imports distutils, which Python 3.12 removed (setuptools provides it there)
    assert python("import torchviz; print(callable(torchviz.make_dot))") == "True"


def test_the_native_record_is_used_from_the_pytorch_it_is_checked_on() -> None:
    """Older PyTorch releases build it, but its figures part from the dispatch mode's there:
    the reason names the version and what measures instead; a version it cannot read is left to
    the build and self-check."""
    from memlab.core.native import OLDEST, too_old

    assert OLDEST == (2, 13)
    for fine in ("2.13.0+cpu", "2.13.0a0+git1234", "2.14.1", "3.0", "nightly"):
        assert too_old(fine) is None, fine
    for old in ("2.11.0+cu130", "2.4.1", "1.13.1"):
        said = too_old(old)
        assert said is not None and old in said and "dispatch mode measures" in said, old
