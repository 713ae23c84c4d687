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

from typing import Container, Dict, List, Set

import torch.fx as fx


def unplaced_inputs(node: fx.Node, placed: Container[fx.Node], position: Dict[fx.Node, int]) -> List[fx.Node]:
    """``node``'s inputs, and theirs, transitively, that are not in ``placed``, in ``position`` order
    (a reordering places them, then the node: passes/engine_order.py too)."""
    pending, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in placed or n in pending:
            continue
        pending.add(n)
        stack.extend(n.all_input_nodes)
    return sorted(pending, key=position.__getitem__)


def schedule_recompute(bw: fx.GraphModule, recomputed: Set[str]) -> int:
    """Reorder ``bw`` in place; returns how many recomputed nodes moved later."""
    old = list(bw.graph.nodes)
    pos = {n: i for i, n in enumerate(old)}
    order: List[fx.Node] = []
    placed: Set[fx.Node] = set()

    def place(node: fx.Node) -> None:
        placed.add(node)
        order.append(node)

    def with_pending_inputs(node: fx.Node) -> None:
        for n in unplaced_inputs(node, placed, pos):
            place(n)

    for node in old:
        if node.op == "placeholder":
            place(node)
    for node in old:
        if node in placed or node.name in recomputed:
            continue  # recomputed nodes are placed on demand, by their first user
        with_pending_inputs(node)
        place(node)
    moved = sum(1 for i, n in enumerate(order) if n.name in recomputed and i > pos[n])
    if moved:
        # relink the nodes in the new order (moving a node is O(1); no node is copied)
        output = order[-1]
        for node in order[:-1]:
            if node.op != "placeholder":
                output.prepend(node)
        bw.recompile()
    return moved
