"""GPUs the estimator can predict for: their memory and what CUDA libraries take from it.

``memory`` is the card's nominal size (16 GiB, 80 GiB, ...). What a program can reserve is less:
the CUDA context and the libraries' code take a few hundred MiB outside PyTorch's allocator, and
``torch.cuda.get_device_properties(0).total_memory`` is itself a little below the nominal size.
``fits()`` therefore keeps ``context`` bytes aside.

``workspace`` is the cuBLAS workspace PyTorch allocates through its caching allocator on the first
matrix product of each cuBLAS handle (one per thread) and keeps: by PyTorch's defaults
(``CUBLAS_WORKSPACE_CONFIG`` unset), ``4096 KiB × 2 + 16 KiB × 8`` before Hopper and
``4096 KiB × 8`` on Hopper (sm90). ``lt_workspace`` is cuBLASLt's, taken by the first product
with a bias (``CUBLASLT_WORKSPACE_SIZE``, 1 MiB by default). On an H100 with torch 2.11, a
training step of ``nn.Linear`` layers left 65 MiB of them allocated: 32 MiB for the forward's
handle, 32 MiB for the backward's (the autograd engine's thread), 1 MiB for cuBLASLt. The other
cards' figures are PyTorch's documented defaults, not yet checked on each card: set
``workspace=`` to override, e.g. with what ``torch.cuda.memory_allocated()`` shows after one
``a @ b`` on your GPU.
"""

from __future__ import annotations

import dataclasses
import numbers
import re
from dataclasses import dataclass
from typing import Any

KiB, MiB, GiB = 1024, 1024**2, 1024**3

PRE_HOPPER_WORKSPACE = 4096 * KiB * 2 + 16 * KiB * 8
HOPPER_WORKSPACE = 4096 * KiB * 8
LT_WORKSPACE = 1024 * KiB
#: A rough allowance for the CUDA context and library code, outside PyTorch's allocator.
CONTEXT = 512 * MiB
#: The largest GPU memory memlab takes (a size past it is a typo, or a float's overflow).
LARGEST = 1024**5


@dataclass(frozen=True)
class GPU:
    name: str
    memory: int
    workspace: int
    context: int = CONTEXT
    lt_workspace: int = LT_WORKSPACE

    @property
    def usable(self) -> int:
        """Bytes left to PyTorch's allocator, by this model."""
        return self.memory - self.context

    def describe(self) -> str:
        gib = f"{self.memory / GiB:.4g} GiB"
        return self.name if self.name.endswith(f" {gib}") else f"{self.name} ({gib})"


GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU("T4", 16 * GiB, PRE_HOPPER_WORKSPACE),
        GPU("L4", 24 * GiB, PRE_HOPPER_WORKSPACE),
        GPU("RTX 4090", 24 * GiB, PRE_HOPPER_WORKSPACE),
        GPU("A100 40GB", 40 * GiB, PRE_HOPPER_WORKSPACE),
        GPU("A100 80GB", 80 * GiB, PRE_HOPPER_WORKSPACE),
        GPU("H100 80GB", 80 * GiB, HOPPER_WORKSPACE),
        GPU("H200", 141 * GiB, HOPPER_WORKSPACE),
    )
}


def gpu(spec: str | GPU | int | float | None) -> GPU | None:
    """A GPU by name (case and spaces ignored), a `GPU`, a size in bytes (a custom card with
    Hopper's workspace; a float too where it is a whole number: ``16.5 * 2**30``), or None (no
    card: no capacity, pre-Hopper workspace)."""
    if spec is None or isinstance(spec, GPU):
        return spec
    spec = _whole_bytes(spec)
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec > LARGEST:
            raise ValueError(
                f"gpu got {grouped(spec)} B, more than any GPU holds (memlab models up to "
                f"{LARGEST // GiB // 1024:,} TiB). Pass a size below that, a name such as "
                "'H100', or None for no limit."
            )
        if spec <= CONTEXT:
            raise ValueError(
                f"gpu got {spec:,}: a GPU of {spec:,} B leaves nothing after the CUDA context "
                f"({CONTEXT // MiB} MiB). Pass a size in bytes above that, a size such as "
                "'24GiB', or a name such as 'H100'."
            )
        return GPU(f"custom {spec / GiB:.3g} GiB", spec, HOPPER_WORKSPACE)
    if isinstance(spec, str):
        if _SIZE.match(spec):
            return parse(spec)
        found = _named(spec)
        if found is not None:
            return found
        raise ValueError(
            f"gpu got {spec!r}, an unknown GPU: pass one of {', '.join(GPUS)}, a size such as "
            "'24GiB', or a size in bytes."
        )
    raise TypeError(f"gpu takes a name, a GPU, a size in bytes or None, not {spec!r}.")


def _whole_bytes(spec: Any) -> Any:
    """A size in bytes as an int: numpy's integers, and a float that is a whole number (a size
    worked out as ``16.5 * 2**30``); anything else as it came. A float with a fraction of a
    byte is a ValueError: no GPU holds one, and rounding it would hide a unit slip."""
    if isinstance(spec, (bool, str)):
        return spec
    if isinstance(spec, numbers.Integral):
        return int(spec)
    if isinstance(spec, numbers.Real):
        size = float(spec)
        if not size.is_integer():  # (also inf and nan)
            raise ValueError(
                f"gpu got {spec!r}, not a whole number of bytes. Pass a size in bytes as an int "
                "(int(...) of it), a size with its unit such as '16.5GiB', or a name such as "
                "'H100'."
            )
        return int(size)
    return spec


def matching(name: str, memory: int, major: int) -> GPU:
    """The card of this list that a CUDA device is (by its name and ``total_memory``, within
    4 GiB), or a custom one of that size with the workspace of its generation (``major``: the
    compute capability's, 9 for Hopper)."""
    for g in GPUS.values():
        if g.name.split()[0] in name and abs(g.memory - memory) < 4 * GiB:
            return g
    return GPU(name, memory, HOPPER_WORKSPACE if major >= 9 else PRE_HOPPER_WORKSPACE)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)\s*$", re.IGNORECASE)
_UNIT = {"b": 1, "kib": KiB, "mib": MiB, "gib": GiB, "tib": GiB * 1024}
#: A GPU's memory in "GB" is what its maker and everyone after it say of a card of binary
#: gigabytes (an "80GB" A100 holds 80 GiB, a "24GB" card 24 GiB): read the same way here.
_UNIT |= {"kb": KiB, "mb": MiB, "gb": GiB, "tb": GiB * 1024}


def parse(spec: str, option: str = "gpu") -> GPU:
    """A GPU from a user's text: a preset's name ("T4", "a100 80gb") or a size with its unit
    ("24GiB", "16 GB": binary, as GPU makers count). A ValueError names ``option``, what it got
    and what to pass."""
    m = _SIZE.match(spec)
    if m:
        size = float(m.group(1)) * _UNIT[m.group(2).lower()]  # (too many digits: inf)
        if size > LARGEST:
            raise ValueError(
                f"{option} got {_short_text(spec)}: more than any GPU holds (memlab models up to "
                f"{LARGEST // GiB // 1024:,} TiB). Pass a smaller size, such as 80GiB, or a name "
                "such as H100."
            )
        if size <= CONTEXT:
            raise ValueError(
                f"{option} got {spec!r}: a GPU that small leaves nothing after the CUDA context "
                f"({CONTEXT // MiB} MiB). Pass a larger size, such as 24GiB, or a name such as "
                "H100."
            )
        return _sized(m, int(size))
    found = _named(spec, option)
    if found is not None:
        return found
    raise ValueError(
        f"{option} got {spec!r}: pass one of {', '.join(GPUS)} (quoted if it has a space), "
        "or a size such as 24GiB."
    )


def _named(spec: str, option: str = "gpu") -> GPU | None:
    """The preset a name means, spaces, dashes, underscores and case aside ("a100-80gb"); its
    words alone too ("H100", "4090"), whole words only: "H20" or "A10" is another GPU, not a
    part of "H200" or "A100". Words of several names are a ValueError naming them ("A100"); no
    match at all is None."""
    wanted = _key(spec)
    for name, g in GPUS.items():
        if _key(name) == wanted:
            return g
    near = [g for name, g in GPUS.items() if wanted and wanted in _word_runs(name)]
    if len(near) > 1:
        names = " or ".join(repr(g.name) for g in near)
        raise ValueError(f"{option} got {spec!r}, which could be {names}: pass one of them.")
    return near[0] if near else None


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name).lower()


def _word_runs(name: str) -> set[str]:
    """The keys of a preset name's runs of consecutive words, a size's "GB" optional ("A100
    80GB": a100, 80gb, a10080gb, and 80, a10080)."""
    words = [_key(w) for w in name.split()]
    runs = {"".join(words[i:j]) for i in range(len(words)) for j in range(i + 1, len(words) + 1)}
    return runs | {r[:-2] for r in runs if re.search(r"\dgb$", r)}


def _short_text(spec: str) -> str:
    return repr(spec) if len(spec) <= 40 else repr(spec[:20] + "..." + spec[-6:])


def grouped(n: int) -> str:
    """``n`` with its digits grouped, or its first digits and their count where it is huge."""
    digits = str(n)
    return f"{n:,}" if len(digits) <= 24 else f"{digits[:6]}... ({len(digits)} digits)"


def _sized(m: re.Match[str], size: int) -> GPU:
    found = gpu(size)
    assert found is not None
    # named as the user wrote it: "24 GB" (24 GiB, as GPU makers count), said beside it
    unit = {u.lower(): u for u in ("B", "KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "TB")}
    return dataclasses.replace(found, name=f"custom {m.group(1)} {unit[m.group(2).lower()]}")
