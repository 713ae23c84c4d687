"""Cost model: how long recomputing a forward node takes, in seconds.

``roofline``: max(FLOPs / peak FLOP/s, bytes moved / memory bandwidth) + a per-op overhead
(dispatch or kernel launch). Bytes moved are the node's tensor inputs and output.
``auto``: the roofline, except that under the Inductor lowering the ops Inductor fuses into
their consumers (pointwise, views, copies, reductions) move no bytes of their own and launch
nothing: their recompute rides in a backward kernel that runs anyway. With the eager lowering
every recomputed op is a separate op over memory, so ``auto`` is the plain roofline.
``flops``: FLOPs only (PyTorch's default estimator: memory-bound ops are free).
``profile``: the node run on random inputs of its shapes, median wall time; fused ops as ``auto``.
FLOPs come from ``torch.utils.flop_counter``'s formulas, evaluated on the fake tensors.
"""
from __future__ import annotations

import operator
import statistics
import time
import weakref
from typing import Dict, Iterable

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from remat_fx.roofline import device_roofline
from remat_fx.sizes import concrete  # noqa: F401 - the passes read sizes through it

_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "prod", "var", "var_mean", "std", "any", "all",
               "argmax", "argmin", "logsumexp"}
_COPIES = {"clone", "_to_copy", "copy", "expand", "alias", "lift_fresh_copy", "empty_like", "zeros_like",
           "ones_like", "full_like", "full", "scalar_tensor", "iota", "arange"}
# indexed reads Inductor lowers as pointwise loads at computed indices: a pointwise producer is
# computed inside them (a cross-entropy's log-softmax inside its gather of the targets' entries),
# and they are computed inside their readers (an embedding's rows inside the first residual add)
_INDEXED_READS = {"gather", "index", "embedding"}


def fusible(node: fx.Node) -> bool:
    """Ops Inductor fuses into a neighbouring kernel (no separate pass over memory)."""
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target.is_view or torch.Tag.pointwise in target.tags:
        return True
    name = target.overloadpacket.__name__
    if name in _INDEXED_READS:
        return indexed_read(node)
    return name in _REDUCTIONS or name in _COPIES


def realised_reduction(node: fx.Node) -> bool:
    """A reduction Inductor realises as a buffer of its own when it lowers it (lowering.py's
    make_reduction), which a pointwise reader then loads as one read; not one it unrolls into a
    pointwise sum (fewer than ``unroll_reductions_threshold`` elements reduced, to more than one
    output, or to any number on a GPU)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.overloadpacket.__name__ not in _REDUCTIONS:
        return False
    x = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    out = node.meta.get("val")
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor):
        return True
    from torch._inductor import config

    numel, kept = concrete(x.numel()), concrete(out.numel())
    if not kept:
        return True
    return numel // kept >= config.unroll_reductions_threshold or (kept == 1 and x.device.type != "cuda")


def indexed_read(node: fx.Node) -> bool:
    """A gather, or an index by integer tensors on its input's device: a load at computed indices
    (Inductor falls back to ATen, and materialises the input, for a bool or uint8 mask or indices
    on another device)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.overloadpacket.__name__ not in _INDEXED_READS:
        return False
    if target.overloadpacket.__name__ == "gather":
        return True
    if target.overloadpacket.__name__ == "embedding":  # (weight, indices, ...): rows of the weight
        weight, ids = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in node.args[:2])
        return isinstance(weight, torch.Tensor) and isinstance(ids, torch.Tensor) and ids.device == weight.device
    x = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    indices = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], (list, tuple)) else ()
    for i in indices:
        val = i.meta.get("val") if isinstance(i, fx.Node) else None
        if i is not None and (not isinstance(val, torch.Tensor) or val.dtype in (torch.bool, torch.uint8)
                              or not isinstance(x, torch.Tensor) or val.device != x.device):
            return False
    return True


# Ops torch.utils.flop_counter has no formula for, counted by the formula of an op whose leading
# arguments are the same: CPU's flash attention (query, key, value, ...) and its backward (grad_out,
# query, key, value, ...). Uncounted, an attention recompute was priced as its bytes only, ~10x
# under its time on CPU (an 8-layer Llama's reruns at budget 0.3 recomputed 11 attentions, +33 ms
# of a 350 ms step, within an allowance of 3%).
_FLOPS_AS = {
    "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "_scaled_dot_product_flash_attention_backward",
}


def _flop_formula(packet):
    """torch.utils.flop_counter's formula for an op (an OpOverloadPacket), None if it has none."""
    fn = flop_registry.get(packet)
    if fn is None and packet is not None and packet.__name__ in _FLOPS_AS:
        fn = flop_registry.get(getattr(torch.ops.aten, _FLOPS_AS[packet.__name__], None))
    return fn


def flops(node: fx.Node) -> int:
    fn = _flop_formula(getattr(node.target, "overloadpacket", None))
    if fn is None:
        return 0
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    try:
        return concrete(fn(*args, **kwargs, out_val=node.meta.get("val")))  # a hint, never a shape guard
    except Exception:  # an op whose formula needs what the fake value lacks: count nothing
        return 0


def _nbytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return concrete(val.numel()) * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_nbytes(v) for v in val)
    return 0


def moved_bytes(node: fx.Node) -> int:
    """Bytes a standalone run of the node reads and writes (views move none)."""
    target = node.target
    if target is operator.getitem or (isinstance(target, torch._ops.OpOverload) and target.is_view):
        return 0
    return sum(_nbytes(n.meta.get("val")) for n in node.all_input_nodes) + _nbytes(node.meta.get("val"))


def node_device(nodes: Iterable[fx.Node]) -> torch.device:
    for node in nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.device.type != "meta":
            return val.device
    return torch.device("cpu")


class CostModel:
    """Seconds to recompute each node, under one model, lowering and device."""

    def __init__(self, model: str, lower: str, device: torch.device, roofline=None):
        self.model, self.lower, self.device = model, lower, device
        self.roof = device_roofline(device, roofline)
        self._profiled: Dict[tuple, float] = {}
        # a node's cost depends only on its op and its values' metadata, which never change: the
        # reruns' and the schedule's searches ask for the same nodes hundreds of thousands of times
        self._memo: "weakref.WeakKeyDictionary[fx.Node, float]" = weakref.WeakKeyDictionary()

    def describe(self) -> str:
        r = self.roof
        return (f"{self.model} ({self.lower} lowering; {r.flops_per_s:.3g} FLOP/s, {r.bytes_per_s:.3g} B/s, "
                f"{r.op_overhead_s * 1e6:.3g} us/op)")

    def __call__(self, node: fx.Node) -> float:
        if node.op != "call_function" or node.target is operator.getitem:
            return 0.0
        found = self._memo.get(node)
        if found is None:
            found = self._memo[node] = self._cost(node)
        return found

    def _cost(self, node: fx.Node) -> float:
        fused = self.lower == "inductor" and fusible(node) and self.model != "roofline"
        compute = flops(node) / self.roof.flops_per_s
        if self.model == "flops":
            return compute
        if fused:
            return compute
        if self.model == "profile":
            return self._profile(node)
        memory = moved_bytes(node) / self.roof.bytes_per_s
        return max(compute, memory) + self.roof.op_overhead_s

    def _profile(self, node: fx.Node) -> float:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        key = (node.target, *[(tuple(map(concrete, v.shape)), v.dtype) if isinstance(v, torch.Tensor) else repr(v)
                              for v in torch.utils._pytree.tree_leaves((args, kwargs))])
        if key not in self._profiled:
            self._profiled[key] = _time_op(node.target, args, kwargs, self.device)
        return self._profiled[key]


def _materialize(v, device):
    if isinstance(v, torch.Tensor):
        shape = tuple(concrete(d) for d in v.shape)
        if v.dtype.is_floating_point or v.dtype.is_complex:
            return torch.randn(shape, dtype=v.dtype, device=device)
        if v.dtype == torch.bool:
            return torch.ones(shape, dtype=torch.bool, device=device)
        return torch.zeros(shape, dtype=v.dtype, device=device)
    if isinstance(v, torch.SymInt):
        return concrete(v)
    return v


def _time_op(target, args, kwargs, device, reps: int = 5) -> float:
    from torch.utils._mode_utils import no_dispatch

    with no_dispatch(), torch.no_grad():
        args, kwargs = torch.utils._pytree.tree_map(lambda v: _materialize(v, device), (args, kwargs))
        try:
            target(*args, **kwargs)  # warm up
        except Exception:
            return 0.0  # an op that cannot run on random inputs (indices out of range): unknown, free
        times = []
        for _ in range(reps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            target(*args, **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
