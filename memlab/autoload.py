"""Loads memlab in every kernel of an environment (scripts/setup.sh and binder/ name this
module in IPython's ``extensions``). Under its own name, so that a notebook's own ``%load_ext
memlab`` (there for kernels without the setting) loads nothing twice and prints nothing."""

from __future__ import annotations

from typing import Any


def load_ipython_extension(ipython: Any) -> None:
    from memlab import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from memlab import unload_ipython_extension as unload

    unload(ipython)
