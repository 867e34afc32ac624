"""memlab's native record of CPU tensor memory: ``record.cpp``, compiled on first use.

The library is built once per PyTorch build and source version with the machine's C++ compiler
(a few seconds) into memlab's cache folder (``$MEMLAB_CACHE``, else ``$XDG_CACHE_HOME/memlab``,
else ``~/.cache/memlab``), then loaded with ctypes. Where it cannot be (no compiler, no PyTorch
headers, not Linux, ``MEMLAB_NATIVE=0``), ``library()`` returns None, ``unavailable()`` says why,
and memlab measures with its Python dispatch mode instead: the same figures, at more cost per op.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from memlab.core.native.build import compile_library, library_path
from memlab.core.native.build import torch_dirs as _torch_dirs
from memlab.core.native.signatures import declare, quick
from memlab.core.parts import part

_SOURCE = Path(__file__).with_name("record.cpp")
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why: str | None = None
_tried = False


#: The oldest PyTorch the record is checked on (its own tests pass there). It compiles against
#: the headers of 2.4.1 to 2.12 too, but built on 2.11 its figures part from the dispatch mode's
#: for a wrapper subclass's ops, a program's own dispatch mode left on past the region, and the
#: timeline of a checkpointed step: there the dispatch mode measures.
OLDEST = (2, 13)


def too_old(version: str | None = None) -> str | None:
    """Why the record is not used with this PyTorch (``torch.__version__`` by default), or None
    where it is recent enough (a version it cannot read is left to the build and self-check)."""
    version = str(torch.__version__ if version is None else version)
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) >= OLDEST:
        return None
    return (
        f"PyTorch {version} is older than {OLDEST[0]}.{OLDEST[1]}, the oldest the native record "
        "is checked on: the dispatch mode measures (the same figures, at more cost per op)"
    )


def cache_dir() -> Path:
    base = os.environ.get("MEMLAB_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "memlab" if xdg else Path.home() / ".cache" / "memlab"


def enabled() -> bool:
    """False where the user turned the native record off (``MEMLAB_NATIVE=0``)."""
    return os.environ.get("MEMLAB_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def unavailable() -> str | None:
    """None where the native record is loaded (building it if needed, and waiting for a build
    already under way), else why not."""
    library()
    return _why


def settled() -> bool:
    """Whether loading was tried and is over (loaded or failed), not still being built."""
    return _lib is not None or _tried


def library(wait: bool = True) -> ctypes.CDLL | None:
    """The loaded library, built on first use; None where it cannot be (see ``unavailable``).
    ``wait=False`` never waits for a compiler: a library already built is loaded at once,
    otherwise a build starts on a thread of its own and None is returned until it is done
    (the caller measures with the dispatch mode meanwhile: the same figures)."""
    global _lib, _why, _tried
    if _lib is not None:
        return _lib
    if not enabled():
        _why = "turned off (MEMLAB_NATIVE=0)"
        return None
    if _tried:
        return None
    old = too_old()
    if old is not None:
        _why, _tried = old, True
        return None
    if not wait and not _built():
        _build_in_background()
        return None
    with _lock:
        if not _tried:
            try:
                path = str(_build())
                _lib = quick(declare(ctypes.CDLL(path)), path)
                from memlab.core.native import objects

                objects.load(path)
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _why = str(e) or type(e).__name__
            _tried = True
    return _lib


def prepare() -> None:
    """Loads the library now, or starts building it on a thread of its own (``%load_ext
    memlab`` calls this, so that the first tracked cell does not wait for the compiler), and
    puts its allocator wrapper in as soon as it is loaded: the tensors the notebook makes before
    its first tracked cell are followed, and a cell that frees them (a model built again) places
    those frees in time. The breakdown's hooks in C (`memlab.core.native.pack`) are built after
    it, on the same terms."""
    _install_at_load[:] = [True]
    lib = library(wait=False)
    if lib is not None:
        lib.mn_install()  # (2: another allocator in place: the first region says so)
        from memlab.core.native import pack

        pack.start()


#: Whether `prepare` asked for the wrapper as soon as the library is loaded.
_install_at_load: list[bool] = []


def _build_then_install() -> None:
    lib = library()
    if lib is not None and _install_at_load:
        lib.mn_install()


_builder: list[threading.Thread] = []


def _build_in_background() -> None:
    with _lock_start:
        if not _builder:
            thread = threading.Thread(
                target=_build_then_install, name="memlab-native-build", daemon=True
            )
            _builder.append(thread)
            thread.start()


_lock_start = threading.Lock()


def _built() -> bool:
    """Whether this PyTorch's library is already in the cache (loading it takes milliseconds)."""
    try:
        return _target().is_file()
    except (OSError, RuntimeError):
        return False


def _target() -> Path:
    """Where this PyTorch's build of the library lives in the cache."""
    return library_path(cache_dir(), "record", _SOURCE)


def _build() -> Path:
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"built on Linux only (this is {sys.platform})")
    include = _torch_dirs()[0]
    if not (include / "ATen" / "record_function.h").is_file():
        raise RuntimeError(f"this PyTorch has no C++ headers ({include})")
    target = _target()
    if target.is_file():
        return target
    # the dispatch-key route where this PyTorch has the key it uses (see record.cpp)
    flags = ["-DMN_MODE_KEY"] if has_mode_key(include) else []
    # the breakdown where a tensor's Python object can be read from C++ (see mn_aliases)
    if reads_python_objects(include):
        flags.append("-DMN_LOAD_PYOBJ")
    return compile_library(_SOURCE, target, flags, ["c10", "torch_cpu"], "it")


def has_mode_key(include: Path) -> bool:
    """Whether this PyTorch's dispatcher has the key the record's fallback sits at (``Fake``:
    below autograd and the Python key, above the backends; PyTorch 2.13 declares it and uses
    it for nothing yet). Where it does not, ops are followed through RecordFunction."""
    try:
        text = (include / "c10" / "core" / "DispatchKey.h").read_text(errors="replace")
    except OSError:
        return False
    return re.search(r"^\s*Fake,", text, re.MULTILINE) is not None


def reads_python_objects(include: Path) -> bool:
    """Whether this PyTorch lets C++ read a tensor's Python object and take a reference to it
    without the Python layer (PyTorch 2.10 and later: ``PyObjectSlot::load_pyobj()`` and
    ``getGlobalPyInterpreter()``), as the record's breakdown does. Earlier ones name a
    ``load_pyobj_interpreter`` that does something else; there, a breakdown is the dispatch
    mode's."""
    return _declares(
        include, "c10/core/impl/PyObjectSlot.h", r"PyObject\*\s+load_pyobj\(\)"
    ) and _declares(include, "c10/core/impl/PyInterpreterHooks.h", r"\bgetGlobalPyInterpreter\(")


def _declares(include: Path, header: str, pattern: str) -> bool:
    try:
        return re.search(pattern, (include / header).read_text(errors="replace")) is not None
    except OSError:
        return False


def route() -> str | None:
    """How the last native region followed ops: "dispatch key" (a C++ fallback at a dispatch
    mode's rank: one boxing per op), "RecordFunction" (a record per op and per op inside it),
    or None where the library is not loaded."""
    if _lib is None:
        return None
    return "dispatch key" if int(_lib.mn_route()) == 1 else "RecordFunction"


def uninstall(keep_fallback: bool = False) -> bool:
    """Puts PyTorch's CPU allocator back where the native record wrapped it, and takes its
    dispatch-key fallback out (no region may be open). True where nothing of the record stays
    installed. ``keep_fallback``: the fallback stays (it does nothing while no region is open;
    the benchmarks' untracked anchor, which would otherwise pay a millisecond to register it
    again at every round), and so do the storages the record knows the ledger holds (and
    with which lasting role): the ledger is the same when the next region puts the wrapper
    back in, which would otherwise read every parameter's role again once."""
    _install_at_load.clear()  # (a build still under way no longer puts the wrapper in)
    if _lib is None:
        return True
    return int(_lib.mn_uninstall(int(keep_fallback))) == 0


def disable(why: str) -> None:
    """Stops using the library for the rest of the process (its self-check failed): the
    allocator wrapper comes out, and ``unavailable()`` says ``why``."""
    global _lib, _why, _tried
    uninstall()
    _lib, _why, _tried = None, f"turned off: {why}", True


def __getattr__(name: str) -> Any:  # (its modules, imported when first asked for)
    return part(__name__, __file__, name)
