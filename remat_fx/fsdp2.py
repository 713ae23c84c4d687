"""What a graph's call can learn of FSDP2 (``fully_shard``) from its inputs: the one place remat
reads FSDP2's internals.

Under FSDP2 a compiled block is given the unsharded parameters, which FSDP2 gathers for its forward
and frees after it. With gradient sync the gradients are reduce-scattered after each backward and
accumulate as shards on the *sharded* parameters, which no graph is given: a gradient accumulation
that syncs at every micro-batch (torchtitan's) holds them from its second micro-batch on, and the
step saw nothing there (a review: 10.76 MiB measured against an estimate of 7.80 on an 8-block GPT
on 2 gloo ranks, 3.03 MiB of shards). FSDP2's pre-forward hook gives the block's inputs that need a
gradient through its ``RegisterPostBackwardFunction``, whose context keeps the module's parameter
group (``ctx.param_group``, the autograd node of the input), and the group its parameters
(``fsdp_params``, each with its ``sharded_param``). These are private: read here only, checked on
torch 2.13 and 2.14 (``tests/test_distributed.py::
test_a_gradient_accumulation_under_fsdp2_counts_the_gradients_as_it_keeps_them``, in both of CI's
torch versions); where they are not found (another torch, another engine) nothing is found.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

_HOOK_NODE = "RegisterPostBackwardFunctionBackward"  # the autograd node of FSDP2's pre-forward hook's outputs


def sharded_gradients_there(args: Sequence) -> Optional[bool]:
    """Whether a sharded parameter of the FSDP2 module whose pre-forward hook gave one of ``args``
    has a gradient (None: no input came through that hook, or its internals are not as read here)."""
    for a in args:
        node = getattr(a, "grad_fn", None) if isinstance(a, torch.Tensor) else None
        if node is None or node.name() != _HOOK_NODE:
            continue
        try:
            params = [p.sharded_param for p in node.param_group.fsdp_params]
        except AttributeError:
            return None
        return any(p.grad is not None for p in params)
    return None
