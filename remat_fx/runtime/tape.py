"""The named tape: what a checkpoint region carries from its forward to its recompute.

A :class:`Tape` belongs to one call of a ``remat.checkpoint`` region. It holds one
:class:`Record` per named op, in forward order. Each record keeps the op's
policy, the named tensors its backward needs (SAVE/OFFLOAD ops), the inputs it
had to save because their producer is skipped in recompute, and the metadata
of its outputs (for placeholders and the desync check). Slots are released as
the recompute consumes them unless the backward retains the graph.
"""
from __future__ import annotations

import itertools
import weakref
from contextvars import ContextVar
from typing import Any, Dict, List, NamedTuple, Optional

import torch

from remat_fx.naming import NameGlobs
from remat_fx.policy import CheckpointPolicy, resolve_policy
from remat_fx.runtime import torch_compat as compat

FORWARD = "forward"
RECOMPUTE = "recompute"

_ACTIVE: ContextVar[Optional["Tape"]] = ContextVar("remat_fx_active_tape", default=None)
_SEQ = itertools.count()


def active_tape() -> Optional["Tape"]:
    return _ACTIVE.get()


_new_tuple = tuple.__new__  # skips NamedTuple's argument parsing on the per-op hot path


class TensorMeta(NamedTuple):
    size: torch.Size
    stride: tuple
    storage_offset: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorMeta":
        return _new_tuple(cls, (t.shape, t.stride(), t.storage_offset(), t.dtype, t.device))

    def describe(self) -> str:
        return (f"{tuple(self.size)} {str(self.dtype).replace('torch.', '')} on {self.device} "
                f"(stride {tuple(self.stride)}, offset {self.storage_offset})")


class Slot:
    """One tensor held by the tape: the tensor itself, or what an offloader packed it into."""

    __slots__ = ("name", "value", "offloader", "version", "meta", "is_param", "aliased", "source")

    def __init__(self, name: str, tensor: torch.Tensor, offloader=None, source: Optional[str] = None):
        self.name = name
        self.source = source  # "<producer>.<out>" when the tensor is a skipped op's output
        self.meta = TensorMeta.of(tensor)
        self.version = compat.tensor_version(tensor)
        self.is_param = is_param(tensor)
        self.offloader = offloader if not self.is_param else None
        # detached: same storage and version counter, but no grad_fn, so the tape (which the
        # graph owns) never owns the graph back; offloaders get the detached alias too
        detached = tensor.detach()
        self.value = self.offloader.pack(detached) if self.offloader is not None else detached
        # an offloader that keeps the tensor where it is (CPU tensors) still shares its version
        # counter: the in-place check applies. Copies cannot be checked after the copy.
        self.aliased = self.value is detached

    @property
    def released(self) -> bool:
        return self.value is None

    def load(self, tape: "Tape", op_name: str) -> torch.Tensor:
        if self.value is None:
            raise RuntimeError(
                f"remat_fx: tensor '{self.name}' of op '{op_name}' in region '{tape.name}' was already "
                "released by an earlier backward: a backward that does not retain the graph recomputes the "
                "whole region once and releases its tape. Pass retain_graph=True to the first backward, or "
                "run one backward through all the region's outputs."
            )
        t = self.offloader.unpack(self.value) if self.offloader is not None else self.value
        if self.aliased or self.offloader is None:
            version = compat.tensor_version(t)
            if version != self.version:
                raise RuntimeError(
                    f"remat_fx: tensor '{self.name}' saved by op '{op_name}' in region '{tape.name}' was "
                    f"modified in place after it was saved (version {self.version} -> {version}); its "
                    "gradient would be wrong. Clone it before modifying it, or make the op RECOMPUTE."
                )
        if not tape.keep_graph:
            self.value = None
        return t


class InputRef:
    """A SAVE op's saved tensor that is one of its own inputs, made by an op that is recomputed
    (or a region input): the recompute hands it over again, so the tape keeps nothing for it."""

    __slots__ = ("name", "index")

    def __init__(self, name: str, index: int):
        self.name, self.index = name, index


class Record:
    """The tape entry of one named op call."""

    __slots__ = ("name", "policy", "kind", "saved", "inputs", "input_metas",
                 "out_metas", "out_single", "out_consts", "sac", "rng_after", "rng_before", "packs_before")

    def __init__(self, name: str, policy: CheckpointPolicy, kind: str):
        self.name = name
        self.policy = policy
        self.kind = kind  # "op" (autograd Function), "native", "region" (nested checkpoint)
        self.saved: Optional[list] = None  # SAVE/OFFLOAD: backward tensors in ctx order (Slot/InputRef/None)
        self.inputs: Dict[int, Slot] = {}  # inputs saved because their producer is skipped
        self.input_metas: Optional[list] = None
        self.out_metas: Optional[list] = None
        self.out_single = True
        self.out_consts: Optional[list] = None
        self.sac = None  # native SAVE: SAC storage of the op's outputs
        self.rng_after = None  # RNG state after the op, when a skipped op consumed randomness
        self.rng_before = None  # a RECOMPUTE scope inside a SAVE block: the RNG state it began with
        self.packs_before = None  # tensors the region had saved for backward when this op began

    def slots(self):
        for s in self.saved or ():
            if isinstance(s, Slot):
                yield "saved", s
        for s in self.inputs.values():
            yield "input", s


def rng_snapshot():
    state = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state.append(torch.cuda.get_rng_state())
    return state


def rng_restore(state) -> None:
    torch.set_rng_state(state[0])
    if len(state) > 1:
        torch.cuda.set_rng_state(state[1])


def rng_changed(before, after) -> bool:
    return len(before) != len(after) or any(not torch.equal(a, b) for a, b in zip(before, after))


def is_param(t: torch.Tensor) -> bool:
    """Parameters (frozen ones too) and leaves that require grad: the user holds them anyway."""
    base = compat.view_base(t)
    base = t if base is None else base
    return isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)


class Tape:
    """Named records of one checkpoint-region call, shared by its forward and recomputes."""

    def __init__(self, name: str, globs: Optional[NameGlobs], offloader, preserve_rng: bool = True):
        self.name = name
        self.preserve_rng = preserve_rng
        # storages of skipped (SAVE/OFFLOAD) ops' outputs in forward, for consumers that reach them
        # through an alias without the tag (detach(), .data): storage key -> (expired, tag)
        self.skipped: Dict[Any, tuple] = {}
        self.globs = globs
        self.offloader = offloader
        self.seq = next(_SEQ)
        self.records: List[Record] = []
        self.by_name: Dict[str, Record] = {}
        self.phase = FORWARD
        # the caching modes of the SAVE/OFFLOAD scopes open in the forward (runtime/ops.py SacScope),
        # innermost last: a SAVE/OFFLOAD op nested in one runs with them off the dispatch stack
        self.caching: list = []
        self.passes = 0
        self.cursor = 0
        self.keep_graph = True
        self.auto_names = 0
        self.inputs: list = []  # weakrefs to the region's tensor inputs (held by the checkpoint frame)
        self.trigger = None
        self.frame = None  # PyTorch's checkpoint frame (compat view), during the forward pass only

    # -- passes ---------------------------------------------------------------
    def begin_pass(self) -> str:
        self.phase = FORWARD if self.passes == 0 else RECOMPUTE
        self.passes += 1
        self.cursor = 0
        self.auto_names = 0
        self.frame = compat.current_checkpoint_frame() if self.phase == FORWARD else None
        if self.phase == RECOMPUTE:
            self.keep_graph = compat.backward_keeps_graph()
        return self.phase

    def end_pass(self) -> None:
        if self.phase == FORWARD:
            self._drop_trailing()
            return
        if self.cursor != len(self.records):
            missing = self.records[self.cursor]
            raise RuntimeError(
                f"remat_fx: recompute of region '{self.name}' diverged from its forward: op "
                f"'{missing.name}' ({missing.policy.name}) ran in forward but not in recompute. "
                "Forward and recompute must run the same named ops in the same order."
            )

    def _drop_trailing(self) -> None:
        """PyTorch's checkpoint stops a recompute after the last tensor the region saved for
        backward (early stop). Ops that began after that point never rerun, so what the tape
        keeps for them (inputs of RECOMPUTE ops, caches of native SAVE ops) is released now,
        before it is held until backward for nothing."""
        frame, self.frame = self.frame, None
        if frame is None or not frame.early_stop:
            return
        final = frame.saved_count()
        for rec in reversed(self.records):
            if rec.packs_before is None or rec.packs_before < final:
                break
            rec.inputs = {}
            rec.sac = None

    # -- records --------------------------------------------------------------
    def next_record(self, name: str, written: Optional[CheckpointPolicy], kind: str) -> Record:
        policy = resolve_policy(name, written, self.globs)
        if self.phase == FORWARD:
            if name in self.by_name:
                raise RuntimeError(
                    f"remat_fx: op name '{name}' is used twice in checkpoint region '{self.name}'. "
                    "Names must be unique within a region: pass a distinct name to each call "
                    "(e.g. include the layer index)."
                )
            rec = Record(name, policy, kind)
            rec.packs_before = self.frame.saved_count() if self.frame is not None else None
            self.records.append(rec)
            self.by_name[name] = rec
            return rec
        if self.cursor >= len(self.records):
            raise RuntimeError(
                f"remat_fx: recompute of region '{self.name}' diverged from its forward: op '{name}' "
                f"({policy.name}) ran in recompute after all {len(self.records)} forward ops. "
                "Forward and recompute must run the same named ops in the same order."
            )
        rec = self.records[self.cursor]
        if rec.name != name or rec.policy is not policy or rec.kind != kind:
            raise RuntimeError(
                f"remat_fx: recompute of region '{self.name}' diverged from its forward at op #{self.cursor}: "
                f"forward ran '{rec.name}' ({rec.policy.name}), recompute ran '{name}' ({policy.name}). "
                "Forward and recompute must run the same named ops, with the same policies, in the same order."
            )
        self.cursor += 1
        return rec

    def auto_name(self, base: str) -> str:
        self.auto_names += 1
        return f"{base}#{self.auto_names}"

    def check_metas(self, rec: Record, what: str, expected: list, got: list) -> None:
        if expected == got:
            return
        for i, (a, b) in enumerate(itertools.zip_longest(expected, got)):
            if a != b:
                fa = a.describe() if isinstance(a, TensorMeta) else repr(a)
                fb = b.describe() if isinstance(b, TensorMeta) else repr(b)
                raise RuntimeError(
                    f"remat_fx: recompute of region '{self.name}' diverged from its forward at op "
                    f"'{rec.name}': {what} {i} was {fa} in forward but {fb} in recompute. "
                    "Forward and recompute must see the same tensor metadata."
                )

    # -- offload --------------------------------------------------------------
    def prefetch(self) -> None:
        for rec in self.records:
            for _, slot in rec.slots():
                if slot.offloader is not None and slot.value is not None:
                    pre = getattr(slot.offloader, "prefetch", None)
                    if pre is not None:
                        pre(slot.value)
            if rec.sac is not None:
                rec.sac.prefetch()


# A SAVE/OFFLOAD op's outputs carry this tag in forward, so a RECOMPUTE consumer
# knows to save them (they are placeholders in recompute). Weak, to avoid cycles.
_TAG = "_remat_fx_skipped"


def tag_skipped_output(t: torch.Tensor, tape: Tape, rec: Record, out_name: str) -> None:
    tag = (weakref.ref(tape), rec.name, out_name, rec.policy)
    setattr(t, _TAG, tag)
    key, expired = compat.storage_ref(t)
    tape.skipped[key] = (expired, tag)


def skipped_producer(t: torch.Tensor, tape: Tape):
    """(producer name, out name, policy) if ``t`` is a skipped op's output in ``tape``, or a view
    or alias of one (the tag on the tensor is the fast path; storage identity catches detach())."""
    tag = getattr(t, _TAG, None)
    if tag is None:
        base = compat.view_base(t)
        if base is not None:
            tag = getattr(base, _TAG, None)
    if tag is None and tape.skipped:
        found = tape.skipped.get(compat.storage_ref(t)[0])
        if found is not None and not found[0]():
            tag = found[1]
    if tag is None or tag[0]() is not tape:
        return None
    return tag[1:]

