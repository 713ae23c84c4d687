"""Capture: what the other passes need to know about AOTAutograd's joint graph.

The joint forward+backward graph comes from AOTAutograd (through Inductor's
``compile_fx`` or our own ``aot_autograd`` call, both with Inductor's
decompositions). This pass reads it: which nodes are forward, which backward,
and the name of every forward node that globs match against (its remat name,
or its module path and op).
"""
from __future__ import annotations

import operator
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.fx as fx

from remat_fx.naming import META_KIND, META_NAME, META_POLICY


def decompositions():
    """The decomposition table Inductor traces with, so both lowerings see the same graph."""
    # some of the table's entries (max_pool2d's, torch 2.13/2.14) reach torch._inductor.lowering as
    # an attribute, which only Inductor's own lowering imports: the eager lowering must import it
    import torch._inductor.lowering  # noqa: F401
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


@dataclass
class JointGraph:
    gm: fx.GraphModule
    num_fwd_outputs: int = 0
    forward: Set[fx.Node] = field(default_factory=set)  # call_function nodes the forward outputs need
    names: Dict[fx.Node, str] = field(default_factory=dict)  # forward node -> glob-matchable name
    paths: Dict[fx.Node, Tuple[str, ...]] = field(default_factory=dict)  # forward node -> its module paths

    def custom(self, node: fx.Node) -> dict:
        return node.meta.get("custom") or {}


def op_name(node: fx.Node) -> str:
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(target, "__name__", str(target))


_SUBSCRIPT = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")


def _dotted(path: str) -> str:
    # Dynamo spells paths as L['self'].layers[0].mlp or L['self']._modules['layers']._modules['0']
    # the root: L['self'], G['model'], or L['args'][0] (a forward wrapped by a decorator taking *args)
    path = re.sub(r"^[LG]\[['\"][^'\"]*['\"]\](\[[0-9]+\])*\.?", "", path)
    path = re.sub(r"\.?_modules\[['\"]([^'\"]+)['\"]\]", r".\1", path)  # only Dynamo's own accessor
    path = _SUBSCRIPT.sub(r".\1", path).strip(".")
    return re.sub(r"\.+", ".", path)


def module_paths(node: fx.Node) -> Tuple[str, ...]:
    """Dotted paths of the modules the node was traced in, outermost first (``layers``,
    ``layers.0``, ``layers.0.mlp``, ``layers.0.mlp.up``); the root module has none."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ()
    paths = (_dotted(path) for path, _ in stack.values())
    return tuple(dict.fromkeys(p for p in paths if p))


def numbered_block(node: fx.Node) -> Optional[str]:
    """The outermost module path of ``node`` that ends in an index (``model.layers.3``), or None:
    the block a per-layer checkpoint would wrap."""
    return next((p for p in module_paths(node) if p.rsplit(".", 1)[-1].isdigit()), None)


def module_path(node: fx.Node) -> Optional[str]:
    """Dotted path of the innermost module the node was traced in (``layers.0.mlp.up``)."""
    paths = module_paths(node)
    return paths[-1] if paths else None


def module_outputs(joint: "JointGraph", members: Set[fx.Node]) -> List[fx.Node]:
    """The nodes that make a module's output, as the user reads it: of the module's forward nodes
    ``members``, those whose value leaves it (read by a forward node outside it, or a forward
    output), each followed back through views to the node inside the module that computed it
    (a Linear on 3-d input: the ``addmm`` under the ``view`` that leaves)."""
    outputs: Dict[fx.Node, None] = {}
    for node in members:
        if any(u not in members and (u in joint.forward or u.op == "output") for u in node.users):
            base = storage_base(node)
            outputs[base if base in members else node] = None
    order = {n: i for i, n in enumerate(joint.gm.graph.nodes)}
    return sorted(outputs, key=order.__getitem__)


def read_joint(gm: fx.GraphModule, num_fwd_outputs: int) -> JointGraph:
    """Forward nodes are those the forward outputs depend on; every other computation is backward
    (including backward-formula nodes that read only forward values, like a weight's transpose),
    except the other outputs of a forward op, which are forward values whoever reads them."""
    joint = JointGraph(gm, num_fwd_outputs)
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    stack = _nodes_in(output.args[0][:num_fwd_outputs])
    seen: Set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    # the other outputs of a forward op (attention's logsumexp) are forward values too, even when
    # only the backward reads them
    for node in list(seen):
        if node.op == "call_function" and is_multi_output(node):
            seen.update(u for u in node.users if u.target is operator.getitem)
    _name_handle_ops(gm)
    counts: Counter = Counter()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node in seen:
            joint.forward.add(node)
            joint.names[node] = _name(node, joint.custom(node), counts)
            joint.paths[node] = module_paths(node)
    return joint


def _name_handle_ops(gm: fx.GraphModule) -> None:
    """An autograd Function using remat.get_handle marks its inputs ("handle_in") and outputs
    ("handle_out") under torch.compile: every unnamed node between them belongs to that op."""
    for out in gm.graph.nodes:
        custom = out.meta.get("custom") or {}
        if custom.get(META_KIND) != "handle_out":
            continue
        name = custom.get(META_NAME)
        stack, seen = list(out.all_input_nodes), set()
        while stack:
            node = stack.pop()
            if node in seen or node.op != "call_function":
                continue
            seen.add(node)
            inner = node.meta.get("custom") or {}
            if inner.get(META_NAME) is not None:  # the op's input markers, or another named op
                continue
            node.meta["custom"] = {**inner, META_NAME: name, META_POLICY: custom.get(META_POLICY),
                                   META_KIND: "op"}
            stack.extend(node.all_input_nodes)
        out.meta["custom"] = {**custom, META_KIND: "op"}


def _nodes_in(args) -> list:
    found = []
    fx.node.map_arg(args, found.append)
    return found


def _name(node: fx.Node, custom: dict, counts: Counter) -> str:
    op = op_name(node)
    remat = custom.get(META_NAME)
    if remat is not None:
        if custom.get(META_KIND) == "annotate":
            k = counts[(remat, op)]
            counts[(remat, op)] += 1
            return f"{remat}.{op}.{k}"
        return remat
    path = module_path(node)
    return f"{path}.{op}" if path else op


def is_random(node: fx.Node) -> bool:
    """Ops that draw from the RNG (attention with dropout_p == 0 does not)."""
    target = node.target
    if not (isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags):
        return False
    for i, arg in enumerate(target._schema.arguments):
        if arg.name == "dropout_p":
            value = node.kwargs.get("dropout_p", node.args[i] if i < len(node.args) else arg.default_value)
            return value != 0
    return True


def is_multi_output(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


def storage_base(node: fx.Node) -> fx.Node:
    """The node whose storage ``node`` shares: through views, and through getitems of
    multi-output views (split, unbind, chunk)."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node):
        target = node.target
        if target is operator.getitem:
            parent = node.args[0]
            if not (isinstance(parent.target, torch._ops.OpOverload) and parent.target.is_view):
                break
            node = parent
        elif isinstance(target, torch._ops.OpOverload) and target.is_view:
            node = node.args[0]
        else:
            break
    return node
