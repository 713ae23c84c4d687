"""Partition: split the tagged joint graph into forward and backward with PyTorch's min-cut.

``min_cut_rematerialization_partition`` honours the tags written by the tag pass:
MUST_SAVE nodes are banned from recomputation, MUST/PREFER_RECOMPUTE nodes are
recomputed in backward. This pass runs capture -> tag -> min-cut -> plan and checks
that the result follows every MUST tag.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.utils.checkpoint import CheckpointPolicy as TorchPolicy

from remat_fx.options import BackendOptions
from remat_fx.passes.capture import read_joint
from remat_fx.passes.plan import build_plan, record
from remat_fx.passes.tag import tag_joint


def partition(joint_gm: fx.GraphModule, joint_inputs, *, options: BackendOptions, num_fwd_outputs: int,
              static_lifetime_input_indices=None, **kwargs):
    joint = read_joint(joint_gm, num_fwd_outputs)
    tags = tag_joint(joint, options)
    fw, bw = min_cut_rematerialization_partition(
        joint_gm, joint_inputs, compiler="inductor", num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_indices=static_lifetime_input_indices, **kwargs)
    check_follows_tags(joint.names, tags, bw)
    plan = build_plan(joint, tags, fw, bw, num_fwd_outputs, static_lifetime_input_indices, options.lower)
    record(plan)
    if options.report:
        print(plan)
    return fw, bw


def check_follows_tags(names, tags, bw: fx.GraphModule) -> None:
    """No MUST_SAVE node may be recomputed in the backward graph (nodes keep their names).
    Views and getitems are exempt: the partitioner may save a base and redo the free view."""
    rerun = {n.name for n in bw.graph.nodes
             if n.op == "call_function" and not _is_view(n) and n.target is not operator.getitem}
    for node, tag in tags.items():
        if tag.policy is TorchPolicy.MUST_SAVE and node.name in rerun:
            raise RuntimeError(
                f"remat_fx: the partition recomputes '{names.get(node, node.name)}' ({node.name}), "
                f"which is tagged MUST_SAVE ({tag.reason}). Please report this with the model."
            )


def _is_view(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view
