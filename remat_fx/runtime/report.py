"""remat.memory_report(out): what the tapes behind ``out`` hold until backward.

Walks the autograd graph from the given tensors to every checkpoint region
upstream, and lists, per region and named op, each tensor the region keeps:
region inputs (saved by the checkpoint itself), SAVE/OFFLOAD ops' backward
tensors, inputs saved for RECOMPUTE consumers, and native SAVE ops' cached
outputs. Bytes are counted per storage, once: a view pins its whole storage,
and later aliases of a storage already counted show 0 bytes and ``alias of``.
Parameters (leaves that require grad) are listed with 0 bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

import torch

from remat_fx.runtime.checkpoint import TAPE_KEY
from remat_fx.runtime.tape import Tape, TensorMeta
from remat_fx.runtime.tape import is_param as tape_is_param
from remat_fx.runtime.torch_compat import tree_leaves


@dataclass(frozen=True)
class SavedEntry:
    region: str
    op: str
    name: str  # the tensor's name within the op ("x", "out", "inputs.0", ...)
    shape: tuple
    dtype: torch.dtype
    device: str
    policy: str  # SAVE, OFFLOAD, INPUT (region input), or PARAM (not counted)
    bytes: int  # bytes charged to this entry (0 for an alias already counted)
    alias_of: Optional[str] = None
    source: Optional[str] = None  # when the tensor is a SAVE op's output: "<producer>.<out>"

    @property
    def qualname(self) -> str:
        return f"{self.op}.{self.name}" if self.op else self.name


@dataclass
class MemoryReport:
    entries: List[SavedEntry] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.entries)

    def bytes_by(self, key: str = "op") -> Dict[str, int]:
        out: Dict[str, int] = {}
        for e in self.entries:
            k = getattr(e, key)
            out[k] = out.get(k, 0) + e.bytes
        return out

    def bytes_by_owner(self) -> Dict[str, int]:
        """Bytes per remat op they are kept for: a SAVE op's own backward tensors under that op,
        and a SAVE op's outputs (kept for any consumer) under the op that produced them, as the
        compiler's Plan files them. Region inputs and parameters are left out."""
        out: Dict[str, int] = {}
        for e in self.entries:
            if e.policy in ("SAVE", "OFFLOAD"):
                owner = e.source.rsplit(".", 1)[0] if e.source else e.op
                out[owner] = out.get(owner, 0) + e.bytes
        return out

    def names(self, policies: Iterable[str] = ("SAVE", "OFFLOAD")) -> set:
        """Qualified names (``op.tensor``) of the entries with these policies."""
        policies = set(policies)
        return {e.qualname for e in self.entries if e.policy in policies}

    def __str__(self) -> str:
        header = ("region", "op", "tensor", "shape", "dtype", "policy", "bytes")
        rows = [(e.region, e.op, e.name + (f" = {e.source}" if e.source else "")
                 + (f" (alias of {e.alias_of})" if e.alias_of else ""),
                 "x".join(map(str, e.shape)) or "scalar", str(e.dtype).replace("torch.", ""), e.policy,
                 f"{e.bytes:,}") for e in self.entries]
        rows.append(("total", "", "", "", "", "", f"{self.total_bytes:,}"))
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
        fmt = lambda r: "  ".join(c.rjust(w) if i == 6 else c.ljust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(r, widths)))
        sep = "  ".join("-" * w for w in widths)
        table = "\n".join([fmt(header), sep] + [fmt(r) for r in rows[:-1]] + [sep, fmt(rows[-1])])
        if not self.entries:  # e.g. the output of a compiled model: its graphs keep no tape
            table += ("\n(no remat.checkpoint region on the eager tape upstream of these outputs; under "
                      "torch.compile(backend='remat') read remat.last_plan() or remat.step_report())")
        return table


def find_tapes(*outputs) -> List[Tape]:
    """Every live tape upstream of ``outputs`` in the autograd graph, in forward order."""
    seen, tapes = set(), {}
    stack = [t.grad_fn for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for tape in node.metadata.get(TAPE_KEY, ()):
            tapes[id(tape)] = tape
        stack.extend(n for n, _ in node.next_functions)
    return sorted(tapes.values(), key=lambda t: t.seq)


def memory_report(*outputs) -> MemoryReport:
    """What the checkpoint regions upstream of ``outputs`` hold for their backward."""
    if not any(isinstance(t, torch.Tensor) for t in tree_leaves(outputs)):
        got = ", ".join(type(o).__name__ for o in outputs) or "nothing"
        raise TypeError(f"remat.memory_report takes the tensors a forward computed (its outputs, e.g. the loss), "
                        f"got {got}")
    report = MemoryReport()
    counted: Dict[tuple, str] = {}

    def add(region, op, name, value, policy, is_param=None, source=None):
        if isinstance(value, torch.Tensor):
            meta, tensor = TensorMeta.of(value), value
        else:  # an offloader's packed value: charge what the tensor would take
            meta, tensor = getattr(value, "meta", None), None
            if meta is None:
                return
        qual = f"{op}.{name}" if op else name
        if is_param is None:
            is_param = tensor is not None and tape_is_param(tensor)
        if is_param:
            policy, nbytes, alias = "PARAM", 0, None
        else:
            if tensor is not None:
                storage = tensor.untyped_storage()
                key = (str(tensor.device), storage.data_ptr(), storage.nbytes())
                size = storage.nbytes()
            else:  # opaque packed values are never folded: one key each
                key = ("packed", len(report.entries))
                size = meta.size.numel() * meta.dtype.itemsize
            alias = counted.get(key)
            nbytes = 0 if alias is not None else size
            counted.setdefault(key, f"{region}:{qual}")
        report.entries.append(SavedEntry(region, op, name, tuple(meta.size), meta.dtype, str(meta.device),
                                         policy, nbytes, alias, source))

    for tape in find_tapes(*outputs):
        for i, ref in enumerate(tape.inputs):
            t = ref()
            if t is not None:
                add(tape.name, "", f"inputs.{i}", t, "INPUT")
        for rec in tape.records:
            for kind, slot in rec.slots():
                if slot.value is not None:
                    policy = rec.policy.name if kind == "saved" else (
                        "OFFLOAD" if slot.offloader is not None else "SAVE")
                    add(tape.name, rec.name, slot.name, _slot_value(slot), policy, slot.is_param, slot.source)
            if rec.sac is not None:
                for label, val in rec.sac.tensors():
                    add(tape.name, rec.name, label, val, rec.policy.name)
    return report


def _slot_value(slot):
    if slot.offloader is None:
        return slot.value
    if isinstance(slot.value, torch.Tensor):
        return slot.value

    class _Packed:  # an opaque packed value: report the tensor's own size
        meta = slot.meta

    return _Packed()
