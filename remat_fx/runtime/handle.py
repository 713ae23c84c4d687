"""RematHandle: the protocol a remat-aware autograd Function follows.

    handle = remat.get_handle(ctx, "layers.0.mlp.up", policy)
    if (ret := handle.maybe_load_saved()) is not None:
        return ret
    x = handle.save_or_load_inputs(x)
    ...
    handle.save_for_backward({"x": x, "h": h})
    return handle.record_outputs(out)

Outside a ``remat.checkpoint`` region the handle is a pass-through to ``ctx``.
"""
from __future__ import annotations

from typing import Optional

import torch

from remat_fx.naming import check_name, op_annotation
from remat_fx.policy import CheckpointPolicy, coerce_policy
from remat_fx.runtime.placeholder import Placeholder
from remat_fx.runtime.tape import (FORWARD, RECOMPUTE, InputRef, Slot, Tape, TensorMeta, active_tape,
                                   rng_changed, rng_restore, rng_snapshot, skipped_producer,
                                   tag_skipped_output)


def get_handle(ctx, op_name: str, policy=None) -> "RematHandle":
    """Create the handle for one named call of a remat-aware autograd Function."""
    if torch.compiler.is_compiling():
        return TracedHandle(ctx, op_name, coerce_policy(policy, what=f"remat.get_handle('{op_name}')"))
    check_name(op_name, "remat.get_handle")
    handle = RematHandle(ctx, op_name, coerce_policy(policy, what=f"remat.get_handle('{op_name}')"))
    if handle.record is not None and ctx is not None:
        _refuse_direct_saves(ctx, op_name)
    return handle


def _refuse_direct_saves(ctx, op_name: str) -> None:
    """Inside a region, a handle's Function saves through the handle: a ``ctx.save_for_backward`` left
    from the Function as it was written (the protocol replaces it) would override the handle's save or be
    overridden by it, and the recompute then fails at the first backward with PyTorch's count mismatch
    naming neither the op nor the fix, or a SAVE op silently runs again. Refused where it is called; the
    handle itself saves through the ctx's class (``RematHandle._save``)."""
    def refused(*tensors):
        raise RuntimeError(
            f"remat_fx: op '{op_name}' called ctx.save_for_backward inside a remat.checkpoint region, where its "
            f"Function took a remat handle: save through the handle instead, by name, "
            f"handle.save_for_backward({{'x': x, ...}}) (dict order = ctx.saved_tensors order), after "
            f"`if (ret := handle.maybe_load_saved()) is not None: return ret`")
    ctx.save_for_backward = refused


class TracedHandle:
    """The handle under torch.compile: the forward is traced once and the compiler decides what
    to save, so every method passes through. To carry the op's name and policy to the compiler,
    the inputs handed to ``save_or_load_inputs`` and the outputs of ``record_outputs`` go through
    annotated aliases: the capture pass names every node between them after the op."""

    def __init__(self, ctx, name: str, policy: Optional[CheckpointPolicy]):
        self.ctx, self.name, self.policy = ctx, name, policy

    def _mark(self, xs, kind):
        with op_annotation(self.name, self.policy, kind):
            return tuple(x.view_as(x) if isinstance(x, torch.Tensor) else x for x in xs)

    def maybe_load_saved(self):
        return None

    def save_or_load_inputs(self, *xs):
        xs = self._mark(xs, "handle_in")
        return xs[0] if len(xs) == 1 else xs

    def save_for_backward(self, tensors: dict) -> None:
        self.ctx.save_for_backward(*tensors.values())

    def record_outputs(self, *outs):
        outs = self._mark(outs, "handle_out")
        return outs[0] if len(outs) == 1 else outs


class RematHandle:
    __slots__ = ("ctx", "name", "policy", "tape", "record", "_rng_before", "inputs")

    def __init__(self, ctx, name: str, policy: Optional[CheckpointPolicy], kind: str = "op",
                 tape: Optional[Tape] = None):
        self.ctx = ctx
        self.name = name
        self.inputs = ()  # the op's positional arguments, where the caller knows them (auto_forward)
        self.tape = tape if tape is not None else active_tape()
        self._rng_before = None
        if self.tape is None:
            self.record = None
            self.policy = policy if policy is not None else CheckpointPolicy.RECOMPUTE
            return
        self.record = self.tape.next_record(name, policy, kind)
        self.policy = self.record.policy
        if self.tape.phase == FORWARD and self.policy.skips_recompute:
            self._rng_before = rng_snapshot()

    @property
    def is_recompute(self) -> bool:
        return self.tape is not None and self.tape.phase == RECOMPUTE

    # -- protocol -------------------------------------------------------------
    def maybe_load_saved(self):
        """In the recompute of a SAVE/OFFLOAD op: load its saved tensors into ``ctx`` and
        return placeholder outputs. Otherwise None (run the real forward)."""
        if not self.is_recompute or not self.policy.skips_recompute:
            return None
        rec = self.record
        if rec.out_metas is None:
            raise RuntimeError(
                f"remat_fx: SAVE op '{self.name}' did not call handle.record_outputs(...) in forward, "
                "so its outputs cannot be replayed. End its forward with `return handle.record_outputs(out)`."
            )
        tensors = [None if s is None else self.inputs[s.index] if isinstance(s, InputRef)
                   else s.load(self.tape, self.name) for s in rec.saved or ()]
        if self.ctx is not None:
            self._save(*tensors)
        if rec.rng_after is not None and self.tape.preserve_rng:
            rng_restore(rec.rng_after)
        outs = tuple(Placeholder.like(m, self.name) if m is not None else c
                     for m, c in zip(rec.out_metas, rec.out_consts))
        return outs[0] if rec.out_single else outs

    def save_or_load_inputs(self, *xs):
        """RECOMPUTE ops: in forward, save inputs whose producer is skipped in recompute;
        in recompute, return those saved tensors in place of the placeholders."""
        out = self.load_inputs(xs) if self.policy is CheckpointPolicy.RECOMPUTE else xs
        return out[0] if len(out) == 1 else tuple(out)

    def load_inputs(self, xs):
        """save_or_load_inputs without the policy gate (native ops and nested regions use it)."""
        tape, rec = self.tape, self.record
        if tape is None:
            return xs
        metas = [TensorMeta.of(x) if isinstance(x, torch.Tensor) else None for x in xs]
        if tape.phase == FORWARD:
            rec.input_metas = metas
            for i, x in enumerate(xs):
                if isinstance(x, torch.Tensor):
                    src = skipped_producer(x, tape)
                    if src is not None:
                        producer, out_name, policy = src
                        off = tape.offloader if policy is CheckpointPolicy.OFFLOAD else None
                        rec.inputs[i] = Slot(f"inputs.{i}", x, off, source=f"{producer}.{out_name}")
            return xs
        tape.check_metas(rec, "input", rec.input_metas, metas)
        xs = list(xs)
        for i, x in enumerate(xs):
            slot = rec.inputs.get(i)
            if slot is not None:
                t = slot.load(tape, self.name)
                # native ops save for backward according to requires_grad: match the forward's
                xs[i] = t.detach().requires_grad_() if x.requires_grad and not t.requires_grad else t
            elif isinstance(x, Placeholder):
                raise RuntimeError(
                    f"remat_fx: input {i} of op '{self.name}' in region '{tape.name}' is the output of "
                    f"SAVE op '{x.producer}' in recompute, but it was not saved in forward (forward saw a "
                    "tensor that was not that op's output). Forward and recompute must pass the same tensors."
                )
        return tuple(xs)

    def check_inputs(self, xs) -> None:
        """Record input metadata in forward and compare it in recompute (for ops whose
        inputs are otherwise unseen in recompute, like SAVE ops called via auto_forward)."""
        tape, rec = self.tape, self.record
        if tape is None:
            return
        metas = [TensorMeta.of(x) if isinstance(x, torch.Tensor) else None for x in xs]
        if tape.phase == FORWARD:
            rec.input_metas = metas
        else:
            tape.check_metas(rec, "input", rec.input_metas, metas)

    def save_for_backward(self, tensors: dict) -> None:
        """Name and save the tensors the backward needs (dict order = ``ctx.saved_tensors`` order)."""
        if not isinstance(tensors, dict):
            raise TypeError(
                f"remat_fx: handle.save_for_backward of op '{self.name}' takes a dict of names to tensors "
                f"(its order is the ctx.saved_tensors order), got {type(tensors).__name__}"
            )
        for k, v in tensors.items():
            if not isinstance(k, str) or not (v is None or isinstance(v, torch.Tensor)):
                raise TypeError(
                    f"remat_fx: handle.save_for_backward of op '{self.name}': entry {k!r} must map a "
                    f"string name to a Tensor or None, got {type(v).__name__}"
                )
        values = tuple(tensors.values())
        rec = self.record
        if rec is not None:
            if self.is_recompute and self.policy.skips_recompute:
                raise RuntimeError(
                    f"remat_fx: {self.policy.name} op '{self.name}' ran its forward during recompute. "
                    "Call `if (ret := handle.maybe_load_saved()) is not None: return ret` first."
                )
            if self.tape.phase == FORWARD:
                if self.policy.skips_recompute:
                    rec.saved = [self._keep(k, v) for k, v in tensors.items()]
        if self.ctx is not None:
            self._save(*values)

    def _save(self, *tensors) -> None:
        """``ctx.save_for_backward`` as its class defines it (get_handle refuses the user's direct call)."""
        type(self.ctx).save_for_backward(self.ctx, *tensors)

    def _keep(self, name: str, t: Optional[torch.Tensor]):
        """How the tape keeps one of a SAVE op's backward tensors."""
        if t is None:
            return None
        src = skipped_producer(t, self.tape)
        if src is None:
            for i, arg in enumerate(self.inputs):
                if arg is t:  # an input the recompute remakes (or a region input): keep nothing
                    return InputRef(name, i)
        off = self.tape.offloader if self.policy is CheckpointPolicy.OFFLOAD else None
        return Slot(name, t, off, source=f"{src[0]}.{src[1]}" if src is not None else None)

    def record_outputs(self, *outs):
        """Name the outputs (``out``, or ``0``, ``1``, ...) and return them, single or tuple."""
        return self.finish(outs, single=len(outs) == 1)

    def finish(self, outs: tuple, single: bool):
        rec, tape = self.record, self.tape
        if rec is not None:
            metas = [TensorMeta.of(o) if isinstance(o, torch.Tensor) else None for o in outs]
            if tape.phase == FORWARD:
                rec.out_metas, rec.out_single = metas, single
                rec.out_consts = [None if isinstance(o, torch.Tensor) else o for o in outs]
                if self.policy.skips_recompute and rec.kind == "op":
                    for i, o in enumerate(outs):
                        if isinstance(o, torch.Tensor):
                            tag_skipped_output(o, tape, rec, "out" if single else str(i))
                if self._rng_before is not None:
                    after = rng_snapshot()
                    if rng_changed(self._rng_before, after):
                        rec.rng_after = after
                    self._rng_before = None
            else:
                tape.check_metas(rec, "output", rec.out_metas, metas)
        return outs[0] if single else tuple(outs)
