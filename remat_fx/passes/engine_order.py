"""The backward in the order autograd's engine would run it, as a lazy graph module.

PyTorch's min-cut partitioner extracts the backward with the recomputed forward ops where they lay
in the joint graph, all before the first gradient op, then reorders it
(``torch._functorch.partitioners.reordering_to_mimic_autograd_engine``): from the first op that
reads a tangent to the output, each op is placed after those of its inputs not placed yet, which
come in their joint-graph order (an in-place ``copy_`` before that first op is placed first, in
its place). That function builds a plain ``fx.GraphModule``, which writes and compiles its Python
code at once: with it, 0.09-0.15 s a call on the backward of an 8-layer Llama (this pass: 0.03-0.04
s), at each of the ten min-cuts budget 0 plans, for modules remat rewrites (reruns, the schedule)
before anything runs them.

``reorder`` is this team's own pass, the same order (``tests/test_compile.py`` compares the two on
the installed torch's function, node by node), making a lazy module (passes/lazy_module.py).
``our_reordering`` puts it in the partitioner's place for the length of remat's partition: the
partitioner's private function is swapped by name for the process (as passes/partition.py
``_rng_ops_that_draw`` swaps another) while the block runs, and put back after; Dynamo compiles
one frame at a time. Checked by the tests on torch 2.13 and 2.14 (CI's selection), where the
partitioner calls it by that name and the two versions' functions are the same; 2.11's (the GPU
image) read alike in its source, not run. A torch without the name is left as it is.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List

import torch
import torch.fx as fx

from remat_fx.passes.lazy_module import new_module
from remat_fx.passes.schedule import unplaced_inputs


def _reads_a_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and "tangents" in str(node.target)


def reorder(gm: fx.GraphModule) -> fx.GraphModule:
    """A new lazy module holding ``gm``'s backward, each op from the first gradient op on placed just
    after the inputs it needs that are not placed yet; ``gm`` itself where no op reads a tangent."""
    nodes: List[fx.Node] = list(gm.graph.nodes)
    position: Dict[fx.Node, int] = {n: i for i, n in enumerate(nodes)}
    readers = [user for n in nodes if _reads_a_tangent(n) for user in n.users]
    if not readers:
        return gm
    first = min(position[user] for user in readers)
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}

    def place(node: fx.Node) -> None:
        if node in env:
            return
        for n in unplaced_inputs(node, env, position) + [node]:  # its inputs come before it in ``position``
            env[n] = graph.node_copy(n, env.__getitem__)

    for n in nodes:
        if n.op == "placeholder":
            env[n] = graph.node_copy(n, env.__getitem__)
    for n in nodes[:first]:
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default:
            place(n)
    for n in nodes[first:]:
        place(n)
    return new_module(gm, graph)


@contextlib.contextmanager
def our_reordering():
    """PyTorch's min-cut partitioner reorders its backward with ``reorder`` until the block ends."""
    from torch._functorch import partitioners

    real = getattr(partitioners, "reordering_to_mimic_autograd_engine", None)
    if real is None:
        yield
        return
    partitioners.reordering_to_mimic_autograd_engine = reorder
    try:
        yield
    finally:
        partitioners.reordering_to_mimic_autograd_engine = real
