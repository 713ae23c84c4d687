"""Lazy graph modules: an FX GraphModule whose Python code is generated when it is first called,
printed or asked for its code, not each time its graph is set or changed.

A plan search makes one backward module per partition and per rerun search, and reorders a few of
them; a plain ``fx.GraphModule`` writes and compiles its Python source every time (0.1-0.2 s for a
backward of 2,000 nodes), for modules nobody calls. PyTorch's partitioner makes its own modules
lazy under ``torch.compile`` (Dynamo sets ``torch.fx._lazy_graph_module._use_lazy_graph_module``,
on by default), not the backward it reorders last (``reordering_to_mimic_autograd_engine`` makes a
plain module, whose code its ``raise_getitems`` then writes a second time), which remat then
reorders (passes/schedule.py) and rewrites (passes/rerun.py). In the library the private API is
used here only: ``_LazyGraphModule`` (checked on torch 2.11, 2.13 and 2.14; it has been in torch
since 2.3), and the partitioner's reordering, wrapped for the length of remat's partition
(``lazy_reordering``). Without them, plain modules. What runs a module op by op (the eager
lowering) writes its code first (``write_code``).
"""
from __future__ import annotations

import contextlib

import torch.fx as fx

try:
    from torch.fx._lazy_graph_module import _LazyGraphModule
except ImportError:  # pragma: no cover - an older or newer torch without it: plain modules
    _LazyGraphModule = None


def lazy(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` as a lazy module holding the same graph (``gm`` itself if it is one already); the
    caller uses the returned module from then on."""
    if _LazyGraphModule is None or isinstance(gm, _LazyGraphModule):
        return gm
    return _LazyGraphModule.from_graphmodule(gm)


def write_code(gm: fx.GraphModule) -> None:
    """Writes a lazy module's code now, before it runs: a lazy module's first ``forward`` writes it
    and then calls the module again (``nn.Module.__call__``), where module hooks see a call no
    plain module makes (FlopCounterMode's module tracker, inside ``autograd.grad``, then registered
    gradient hooks on a leaf and failed: tests/test_native_op.py)."""
    if _LazyGraphModule is not None and isinstance(gm, _LazyGraphModule):
        gm.real_recompile()


def new_module(root: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    """``fx.GraphModule(root, graph)``, lazy."""
    return fx.GraphModule(root, graph) if _LazyGraphModule is None else _LazyGraphModule(root, graph)


@contextlib.contextmanager
def lazy_reordering():
    """PyTorch's min-cut partitioner hands back the backward its reordering makes as a lazy module,
    until the block ends: the reordering still writes its code once (it builds a plain module),
    the partitioner's ``raise_getitems`` then no longer writes it again (budget 0 of the 8-layer
    Llama of benchmarks/planning.py: its 10 min-cuts 2.7 s where they took 3.2). The function is
    swapped for the process while the block runs (as passes/partition.py ``_rng_ops_that_draw``
    swaps another): Dynamo compiles one frame at a time, and the wrapper returns what PyTorch's
    function does, as a lazy module."""
    from torch._functorch import partitioners

    real = getattr(partitioners, "reordering_to_mimic_autograd_engine", None)
    if real is None or _LazyGraphModule is None:
        yield
        return

    def reordered(gm):
        return lazy(real(gm))

    partitioners.reordering_to_mimic_autograd_engine = reordered
    try:
        yield
    finally:
        partitioners.reordering_to_mimic_autograd_engine = real
