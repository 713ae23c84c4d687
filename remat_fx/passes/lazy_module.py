"""Lazy graph modules: an FX GraphModule whose Python code is generated when it is first called,
printed or asked for its code, not each time its graph is set or changed.

A plan search makes one backward module per partition and per rerun search, and reorders a few of
them; a plain ``fx.GraphModule`` writes and compiles its Python source every time (0.1-0.2 s for a
backward of 2,000 nodes), for modules nobody calls. PyTorch's partitioner makes its own modules lazy
under ``torch.compile`` (Dynamo sets ``torch.fx._lazy_graph_module._use_lazy_graph_module``, on by
default), not the backward it reorders last (``reordering_to_mimic_autograd_engine`` makes a plain
module, whose code its ``raise_getitems`` then writes a second time): remat's partition reorders it
with its own pass instead (passes/engine_order.py), which makes a lazy module, then reorders it
again (passes/schedule.py) and rewrites it (passes/rerun.py). Outside Dynamo (remat.pareto planning
captured joint graphs again; remat.fit and the whole-step planner lowering a step's graphs again,
remat_fx/step.py relower) nothing set that flag: ``lazy_modules`` sets it for the length of remat's
partition, where plain modules took a fifth of each min-cut (a 6-block GPT's joint graph planned at
budget 0: 27 modules written, 2.7 s of the nine min-cuts' 12.4 s under cProfile;
benchmarks/planning.py had set the flag itself). The private class ``_LazyGraphModule`` (checked on
torch 2.11, 2.13 and 2.14) and flag ``_use_lazy_graph_module`` (checked on 2.13 and 2.14,
tests/test_compile.py) are used here only; both have been in torch since 2.3; without them, plain
modules. What runs a module op by op (the eager lowering) writes its code first (``write_code``).
"""
from __future__ import annotations

import contextlib

import torch.fx as fx

try:
    from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module
except ImportError:  # pragma: no cover - an older or newer torch without them: plain modules
    _LazyGraphModule = _use_lazy_graph_module = None


def lazy_modules():
    """A block in which the modules PyTorch's passes make (``torch.fx._lazy_graph_module._make_graph_module``:
    the min-cut partitioner's forward and backward) are lazy, as under Dynamo; as before after it."""
    return contextlib.nullcontext() if _use_lazy_graph_module is None else _use_lazy_graph_module(True)


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
