"""Schedule: recompute just in time, so the backward's peak falls with the saved bytes.

PyTorch's partitioner orders the backward graph like the autograd engine but puts every
recomputed forward node before the first gradient op (``reordering_to_mimic_autograd_engine``):
everything recomputed is alive at once, and at budget 0 the step's peak exceeds running with no
recompute at all. This pass moves each recomputed node to just before its first backward use
(its own recomputed inputs first, in forward order), so recomputation proceeds layer by layer as
eager checkpointing does; with the graph inputs freed at their last use (both lowerings free
the boxed argument list), each recomputed value dies right after its last use.
"""
from __future__ import annotations

from typing import Dict, Set

import torch.fx as fx


def schedule_recompute(bw: fx.GraphModule, recomputed: Set[str]) -> int:
    """Reorder ``bw`` in place; returns how many recomputed nodes moved later."""
    old = list(bw.graph.nodes)
    pos = {n: i for i, n in enumerate(old)}
    graph = fx.Graph(owning_module=bw, tracer_cls=bw.graph._tracer_cls)
    graph._codegen = bw.graph._codegen
    env: Dict[fx.Node, fx.Node] = {}

    def copy(node: fx.Node) -> None:
        env[node] = graph.node_copy(node, lambda n: env[n])

    def with_pending_inputs(node: fx.Node) -> None:
        pending, stack = set(), list(node.all_input_nodes)
        while stack:
            n = stack.pop()
            if n in env or n in pending:
                continue
            pending.add(n)
            stack.extend(n.all_input_nodes)
        for n in sorted(pending, key=pos.__getitem__):
            copy(n)

    for node in old:
        if node.op == "placeholder":
            copy(node)
    for node in old:
        if node in env or node.name in recomputed:
            continue  # recomputed nodes are emitted on demand, by their first user
        with_pending_inputs(node)
        copy(node)
    before = {n.name: i for i, n in enumerate(old)}
    moved = sum(1 for i, n in enumerate(graph.nodes) if n.name in recomputed and i > before[n.name])
    bw.graph = graph
    bw.recompile()
    return moved
