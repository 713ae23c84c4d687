"""Data-inaccessible placeholder tensors for the outputs of skipped (SAVE) ops.

During recompute a SAVE op does not run; it returns placeholders with the right
size, stride, storage offset, dtype and device. Metadata queries and view ops
work (they are evaluated on ``meta`` tensors); anything that would read the
data raises an error that names the op at fault and the ways to fix it.
"""
from __future__ import annotations

import torch

from remat_fx.runtime.torch_compat import make_wrapper_subclass, tree_leaves, tree_map

_META_QUERIES = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.size.default,
    torch.ops.aten.stride.default,
    torch.ops.aten.sym_size.default,
    torch.ops.aten.sym_stride.default,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.numel.default,
    torch.ops.aten.dim.default,
    torch.ops.aten.storage_offset.default,
    torch.ops.aten.sym_storage_offset.default,
    torch.ops.aten.is_contiguous.default,
    torch.ops.aten.is_contiguous.memory_format,
    torch.ops.aten.is_strides_like_format.default,
    torch.ops.aten.is_non_overlapping_and_dense.default,
}


def bare_consumer_message(op_desc: str, producer: str) -> str:
    return (
        f"remat_fx: {op_desc} reads the output of SAVE op '{producer}' during recompute, "
        "but SAVE outputs are not recomputed (they are data-less placeholders then). Fix one of:\n"
        f"  1. wrap the consumer with remat.native_op(fn, 'a.unique.name', policy=...): policy=SAVE "
        "saves its output, policy=RECOMPUTE reruns it on the saved input;\n"
        "  2. move the consumer into a custom autograd Function decorated with remat.auto_forward "
        "(called through remat.op), or one that uses handle.save_or_load_inputs;\n"
        f"  3. change the policy of '{producer}' to CheckpointPolicy.RECOMPUTE."
    )


class Placeholder(torch.Tensor):
    """A tensor with metadata but no data. ``producer`` names the SAVE op it stands for."""

    producer: str

    @staticmethod
    def __new__(cls, size, stride, storage_offset, dtype, device, producer: str):
        t = make_wrapper_subclass(cls, size, stride, storage_offset, dtype, device)
        t.producer = producer
        return t

    @classmethod
    def like(cls, meta, producer: str) -> "Placeholder":
        return cls(meta.size, meta.stride, meta.storage_offset, meta.dtype, meta.device, producer)

    def _as_meta(self) -> torch.Tensor:
        base = torch.empty(0, dtype=self.dtype, device="meta")
        return base.as_strided(self.size(), self.stride(), self.storage_offset())

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"Placeholder(size={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
                f"producer='{self.producer}')")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        holders = [a for a in tree_leaves((args, kwargs)) if isinstance(a, Placeholder)]
        producer = holders[0].producer
        if func in _META_QUERIES or func.is_view:
            as_meta = tree_map(lambda a: a._as_meta() if isinstance(a, Placeholder) else a, (args, kwargs))
            out = func(*as_meta[0], **as_meta[1])

            def wrap(o):
                if isinstance(o, torch.Tensor) and o.device.type == "meta":
                    return cls(o.size(), o.stride(), o.storage_offset(), o.dtype, holders[0].device, producer)
                return o

            return tree_map(wrap, out)
        raise RuntimeError(bare_consumer_message(f"op {func}", producer))
