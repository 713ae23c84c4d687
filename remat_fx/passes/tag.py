"""Tag: every forward node of the joint graph becomes SAVE or RECOMPUTE, must or prefer.

Precedence (first that applies):
  1. random ops are saved (MUST_SAVE): recomputing them would draw fresh randomness;
  2. the backend's ``save``/``recompute`` option globs (MUST);
  3. the enclosing region's ``save``/``offload``/``recompute`` globs (MUST);
  4. a region's outputs (MUST_SAVE): as in eager mode, their consumers outside the region hold them;
  5. inside a checkpoint region, the policy written at the call site: remat.op / native_op /
     annotate (MUST); outside one it decides nothing, as in eager mode;
  6. inside a remat.checkpoint region: PREFER_RECOMPUTE, as non-reentrant AC recomputes it;
  7. otherwise no tag: the min-cut partitioner chooses.
A SAVE op's inputs follow their own producers' tags, as on the eager tape, where a SAVE op's
backward input made by a recomputed op is handed over again by the recompute.
Backward nodes carry the forward's annotations in the joint graph and are never tagged.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy as TorchPolicy

from remat_fx.naming import META_NAME, META_POLICY, META_REGION, META_REGION_GLOBS, NameGlobs
from remat_fx.options import BackendOptions
from remat_fx.passes.capture import JointGraph, is_multi_output, is_random


@dataclass(frozen=True)
class Tag:
    policy: TorchPolicy
    reason: str

    @property
    def saves(self) -> bool:
        return self.policy in (TorchPolicy.MUST_SAVE, TorchPolicy.PREFER_SAVE)


_MUST = {"SAVE": TorchPolicy.MUST_SAVE, "OFFLOAD": TorchPolicy.MUST_SAVE, "RECOMPUTE": TorchPolicy.MUST_RECOMPUTE}


def _region_globs(custom: dict) -> Optional[NameGlobs]:
    raw = custom.get(META_REGION_GLOBS)
    return _globs_of(tuple(map(tuple, raw))) if raw and any(raw) else None


@functools.lru_cache(maxsize=64)
def _globs_of(raw: tuple) -> NameGlobs:  # one matcher (and its match cache) per region's globs
    save, offload, recompute = raw
    return NameGlobs(save=save, offload=offload, recompute=recompute)


def tag_node(joint: JointGraph, node: fx.Node, options: BackendOptions) -> Optional[Tag]:
    name, custom = joint.names[node], joint.custom(node)
    if is_random(node):
        return Tag(TorchPolicy.MUST_SAVE, "random op: saved so backward sees the forward's values")
    kind = options.globs.match(name) if options.globs else None
    if kind is not None:
        return Tag(_MUST[kind], f"backend option {kind.lower()} glob")
    region_globs = _region_globs(custom)
    kind = region_globs.match(name) if region_globs is not None else None
    if kind is not None:
        return Tag(_MUST[kind], f"region '{custom.get(META_REGION)}' {kind.lower()} glob")
    region = node.meta.get("ac_graph_id")
    in_region = region is not None or custom.get(META_REGION) is not None
    if in_region and any(u in joint.forward and u.meta.get("ac_graph_id") != region for u in node.users):
        # as in eager mode, a region's outputs are held by their consumers outside it
        return Tag(TorchPolicy.MUST_SAVE, f"output of checkpoint region '{custom.get(META_REGION, '?')}'")
    written = custom.get(META_POLICY)
    if in_region and written is not None and custom.get(META_NAME) is not None \
            and not (_is_layout(node) and written != "RECOMPUTE"):
        # (outside a checkpoint region a call-site policy decides nothing, as on the eager tape)
        # (views and copies inside a SAVE op are free to redo from what they copy: that decides)
        return Tag(_MUST[written], f"{written} at the call site of '{custom[META_NAME]}'")
    if in_region:
        return Tag(TorchPolicy.PREFER_RECOMPUTE, f"inside checkpoint region '{custom.get(META_REGION, '?')}'")
    return None


def tag_joint(joint: JointGraph, options: BackendOptions) -> Dict[fx.Node, Tag]:
    """Tag the forward nodes and write the tags where the min-cut partitioner reads them."""
    tags: Dict[fx.Node, Tag] = {}
    for node in joint.forward:
        tag = tag_node(joint, node, options)
        if tag is not None:
            tags[node] = tag
    # a tuple cannot be saved: a multi-output op stays banned from recompute and its getitem
    # outputs are what gets saved (a getitem left to recompute would need the banned tuple)
    for node in [n for n, t in tags.items() if t.saves and is_multi_output(n)]:
        for user in node.users:
            if user in joint.forward and user.target is operator.getitem:
                tags[user] = tags[node]
    for node, tag in tags.items():
        node.meta["recompute"] = tag.policy
    return tags


def _is_layout(node: fx.Node) -> bool:
    """Views and plain copies (decompositions add clones for contiguity): no compute to save."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and (target.is_view or target is torch.ops.aten.clone.default)
