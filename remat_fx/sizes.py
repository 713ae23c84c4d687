"""The sizes the cost model reads a graph of dynamic shapes at: each symbolic size at its hint (the
value of the call that compiled the graph), or at the sizes :func:`sizes_at` gives its symbols
while a graph is planned for larger calls than the one that compiled it (remat_fx/step.py: a short
batch makes Dynamo compile graphs of dynamic sizes at its size, and the full batches after it run
them)."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Dict, Iterator, Optional

import sympy
import torch

_AT: contextvars.ContextVar[Optional[Dict[object, int]]] = contextvars.ContextVar("remat_fx_sizes", default=None)


@contextlib.contextmanager
def sizes_at(sizes: Optional[Dict[object, int]]) -> Iterator[None]:
    """Sizes read with ``sizes`` (sympy symbol -> int) for their symbols; none given: the hints."""
    token = _AT.set({k: sympy.Integer(v) for k, v in sizes.items()} if sizes else None)
    try:
        yield
    finally:
        _AT.reset(token)


def concrete(x) -> int:
    """An int for a size that may be symbolic (dynamic shapes): at the sizes :func:`sizes_at` set
    where they give every symbol of it, else its hint, the example's value."""
    if isinstance(x, torch.SymInt):
        at = _AT.get()
        if at:
            value = x.node.expr.xreplace(at)
            if value.is_number:
                return int(value)
        hint = x.node.hint
        return int(hint) if hint is not None else 0
    return int(x)


def sizes_key() -> str:
    """The sizes set now, for a cache's key ('' at the hints)."""
    at = _AT.get()
    return "" if not at else repr(sorted((str(k), v) for k, v in at.items()))
