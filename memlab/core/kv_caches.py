"""The key/value caches of Hugging Face models, named in a breakdown whoever generates.

A language model that generates keeps each layer's keys and values for every token so far in a
cache object (``transformers.cache_utils``: ``DynamicCache`` and its layers, ``StaticCache``,
the sliding-window and quantized ones). memlab's own generate mode names that memory; a user's
``model.generate(...)`` in a ``%%gpumem -b`` cell builds its cache inside the library, where no
variable holds it. So while a breakdown region is open, the ``update`` of every cache class of
the library (where it is imported) names what the object holds afterwards ``kv_cache``: its
own tensors (a layer's keys and values), and the entries for the layer updated in its lists of
tensors (older releases keep ``key_cache[layer]``). The classes are as they were after.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memlab.core.categories import Category
from memlab.core.threads import PerThread

_MODULE = "transformers.cache_utils"


def _held(obj: Any, layer: Any) -> Iterator[torch.Tensor]:
    """Keys and values: the object's tensors (a scalar, a static layer's count of tokens
    written, is bookkeeping), and the updated layer's in its lists."""
    for value in vars(obj).values():
        if isinstance(value, torch.Tensor):
            if value.dim():
                yield value
        elif (
            isinstance(value, list) and isinstance(layer, int) and -len(value) <= layer < len(value)
        ):
            item = value[layer]
            if isinstance(item, torch.Tensor):
                yield item


#: The open breakdown regions' marks, by thread (a cache filled on a thread is named for the
#: regions open on that thread), and the classes patched while any is open.
_MARKS = PerThread()
_PATCHED: list[tuple[type, Any]] = []


def _update_named(update: Callable[..., Any]) -> Any:
    def update_named(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = update(self, *args, **kwargs)
        marks = _MARKS.mine()
        if marks:
            try:
                layer = kwargs.get("layer_idx", args[2] if len(args) > 2 else None)
                for t in _held(self, layer):
                    for mark in marks:
                        mark(t, Category.KV_CACHE)
            except Exception:  # the library's object as it is: its bytes stay where they are
                pass
        return out

    update_named.__wrapped__ = update  # type: ignore[attr-defined]
    return update_named


def _patch() -> None:
    module = sys.modules.get(_MODULE)
    for cls in vars(module).values() if module is not None else ():
        own = inspect.isclass(cls) and cls.__module__ == _MODULE and cls.__dict__.get("update")
        if callable(own):
            _PATCHED.append((cls, own))
            setattr(cls, "update", _update_named(own))  # noqa: B010


def _unpatch() -> None:
    while _PATCHED:
        cls, own = _PATCHED.pop()
        setattr(cls, "update", own)  # noqa: B010


def named_by(mark: Callable[[torch.Tensor, Category], None]) -> Callable[[], None]:
    """From now, what Hugging Face's caches hold after each ``update`` on this thread is told
    to ``mark`` as ``kv_cache`` (nothing where transformers is not imported), until the
    callable returned is called. The classes are patched while any ``mark`` is in, on any
    thread, and put back after the last is out."""
    _MARKS.push(mark, _first)  # (patched here where transformers was imported since)

    def out() -> None:
        _MARKS.pop(mark, _last)

    return out


def adopt(owner: int) -> None:
    """This thread, started inside the region(s) open on the thread ``owner`` (``generate``
    run beside a streamer), names the caches it fills for them, while they are open."""
    _MARKS.share(owner)


def _first(first: bool) -> None:
    if not _PATCHED:
        _patch()


def _last(last: bool) -> None:
    if last:
        _unpatch()
