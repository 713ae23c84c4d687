"""remat.annotate(name, policy=None, memory_budget=None): name a block of native ops, in both modes.

    with remat.annotate("layers.0.mlp", policy=remat.CheckpointPolicy.SAVE):
        h = torch.nn.functional.gelu(x @ w1) @ w2

Compiler mode: every op traced inside gets the name ``<name>.<op>.<k>`` (``layers.0.mlp.mm.1``)
and the policy, which the tag pass honours. Eager mode, inside a checkpoint region: the block is
one named op on the tape, run through the same machinery as ``remat.native_op``: SAVE caches the
block's outputs and skips it in recompute; RECOMPUTE reruns it. Outside a region it only names.
Unlike ``native_op`` the block's inputs are not known, so a SAVE block must not read a SAVE
op's output (use ``remat.native_op`` there).

``memory_budget`` (compiler mode) caps the saved bytes of the activations made inside the block,
as the backend option does for the whole graph (a fraction between the block's own feasible
extremes, or a size). The eager tape has no solver: there it warns once and only names.
"""
from __future__ import annotations

import contextlib
import sys
import warnings

import torch

from remat_fx.memory_budget import parse_budget
from remat_fx.naming import META_BUDGET, META_BUDGET_REGION, META_KIND, META_NAME, META_POLICY, check_name, \
    tracing_annotation
from remat_fx.policy import coerce_policy
from remat_fx.runtime.handle import RematHandle
from remat_fx.runtime.ops import SacScope
from remat_fx.runtime.tape import active_tape


def annotate(name: str, policy=None, *, memory_budget=None):
    """A context manager naming the native ops inside it (and giving them ``policy``)."""
    check_name(name, "remat.annotate")
    policy = coerce_policy(policy, what=f"remat.annotate('{name}')")
    parse_budget(memory_budget, f"remat.annotate('{name}', memory_budget=...)")  # fail early, in both modes
    if torch.compiler.is_compiling():
        entries = {META_NAME: name, META_POLICY: policy.name if policy is not None else None, META_KIND: "annotate"}
        if memory_budget is not None:
            entries.update({META_BUDGET_REGION: name, META_BUDGET: memory_budget})
        return tracing_annotation(entries)
    if memory_budget is not None and name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(f"remat.annotate('{name}', memory_budget={memory_budget!r}): memory budgets are solved in "
                      f"compiler mode (torch.compile(..., backend='remat')); the eager tape only names the block",
                      stacklevel=2)
    return _EagerBlock(name, policy)


_WARNED: set = set()


class _EagerBlock(contextlib.AbstractContextManager):
    def __init__(self, name, policy):
        self.name, self.policy, self.scope, self._entered = name, policy, None, False

    def __call__(self, *args, **kwargs):  # remat.annotate("blk")(fn): a decorator it is not
        self._entered = True  # said here: no second word from __del__
        raise TypeError(f"remat.annotate('{self.name}') is a context manager, not a decorator: write `with "
                        f"remat.annotate('{self.name}', ...):` around the ops it names")

    def __del__(self):
        if not getattr(self, "_entered", True) and not sys.is_finalizing():  # at exit warnings may be gone
            warnings.warn(f"remat.annotate('{self.name}') was never entered, so it named nothing and set no policy: "
                          f"it is a context manager, write `with remat.annotate('{self.name}', ...):` around the "
                          f"ops it names", RuntimeWarning, stacklevel=2)

    def __enter__(self):
        self._entered = True
        tape = active_tape()
        if tape is not None:
            handle = RematHandle(None, self.name, self.policy, kind="native", tape=tape)
            self.scope = SacScope(handle).__enter__()
        return self

    def __exit__(self, *exc):
        scope, self.scope = self.scope, None
        if scope is not None:
            scope.__exit__(*exc)
            if exc[0] is None:
                scope.handle.finish((), single=False)  # the RNG the block consumed, for SAVE
        return False
