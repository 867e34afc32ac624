"""memlab's saved-tensor hooks in C (``pack.cpp``), built beside the record on first use.

The pack hook runs once per tensor autograd saves; as two C functions the hooks cost about a
microsecond less per saved tensor than a call of memlab's op through its Python binding (24
saved tensors a step of an 8-layer MLP: 0.38 ms untracked, about 25 µs less with a breakdown,
measured on the project's 2-core CPU machine, torch 2.13). Building them needs Python's headers
besides PyTorch's; it runs on a thread of its own after the record is loaded, and until it is
done (or where it cannot be done) the hooks call the op as before: the same figures.
"""

from __future__ import annotations

import ctypes
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Any

from memlab.core.native.build import compile_library, library_path, torch_dirs

_SOURCE = Path(__file__).with_name("pack.cpp")
_lock = threading.Lock()
_hooks: tuple[Any, Any] | None = None
_changed: Any = None  # (the namespace scan, `namespace_scan`)
_why: str | None = None
_tried = False
_builder: list[threading.Thread] = []


def hooks() -> tuple[Any, Any] | None:
    """The (pack, unpack) pair in C, or None where it is not built yet (never waits: a build
    is started on a thread of its own) or cannot be."""
    if _hooks is not None or _tried:
        return _hooks
    start()
    return None


def namespace_scan() -> Any:
    """The notebook namespace's scan in C (``changed`` in pack.cpp; `memlab.magic.namespace`),
    or None where the library is not loaded (never starts a build: ``%load_ext memlab`` does)."""
    return _changed


def start() -> None:
    """Loads the hooks now where they are built (milliseconds), else builds them on a thread of
    their own; never waits for a build."""
    if _hooks is not None or _tried:
        return
    if _target().is_file():
        _load()
        return
    with _lock:
        if not _builder:
            thread = threading.Thread(target=_load, name="memlab-pack-build", daemon=True)
            _builder.append(thread)
            thread.start()


def wait() -> str | None:
    """Builds and loads the hooks, waiting for a build under way; None where they are loaded,
    else why not (the benchmarks wait, so that they time the hooks a user gets)."""
    start()
    for thread in list(_builder):
        thread.join()
    if _hooks is None and not _tried:
        _load()
    return _why


def _load() -> None:
    """Builds (where needed) and loads the hooks; no lock is held while the compiler runs."""
    global _hooks, _why, _tried, _changed
    from memlab.core.native import library

    pair: tuple[Any, Any] | None = None
    why: str | None = None
    scan: Any = None
    try:
        lib = library()
        if lib is None:
            raise RuntimeError("the native record is not loaded")
        path = _build()
        made = ctypes.PyDLL(str(path))
        made.mnp_hooks.argtypes = [ctypes.c_void_p]
        made.mnp_hooks.restype = ctypes.py_object
        save = ctypes.cast(lib.mn_save_into, ctypes.c_void_p).value
        got = made.mnp_hooks(save)
        if not (isinstance(got, tuple) and len(got) == 2 and all(map(callable, got))):
            raise RuntimeError(f"the library gave {got!r}, not two hooks")
        pair = got
        scan = _scan_of(made)
    except Exception as e:  # (any failure: the op stands in, as where it cannot be built)
        why = f"{type(e).__name__}: {e}"
    with _lock:
        if not _tried:
            _hooks, _why, _tried, _changed = pair, why, True, scan


def _scan_of(made: Any) -> Any:
    """The namespace scan of the library ``made``, or None (the hooks do without it)."""
    try:
        made.mnp_changed.argtypes = []
        made.mnp_changed.restype = ctypes.py_object
        scan = made.mnp_changed()
    except Exception:  # (the magics scan with numpy instead)
        return None
    return scan if callable(scan) else None


def _python_include() -> Path:
    return Path(sysconfig.get_paths()["include"])


def _target() -> Path:
    from memlab.core.native import cache_dir

    # (Python's headers and version too: the hooks are built against its C API)
    return library_path(cache_dir(), "pack", _SOURCE, str(_python_include()), sys.version)


def _build() -> Path:
    target = _target()
    if target.is_file():
        return target
    include, python = torch_dirs()[0], _python_include()
    if not (python / "Python.h").is_file():
        raise RuntimeError(f"no Python headers ({python}): install python3-dev")
    if not (include / "torch" / "csrc" / "autograd" / "python_variable.h").is_file():
        raise RuntimeError(f"this PyTorch has no Python-layer headers ({include})")
    flags = [f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}", f"-I{python}"]
    libs = ["c10", "torch_cpu", "torch_python"]
    return compile_library(_SOURCE, target, flags, libs, "the C hooks")
